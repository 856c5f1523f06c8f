"""TorchBackend on the tiny model: outputs aligned with responses, training, offload, checkpoints."""

from __future__ import annotations

import pytest
import torch

from ppo_trainer.algorithms import aggregate_loss, batch_counts
from ppo_trainer.backends.torch_backend import TorchBackend
from ppo_trainer.rollout.base import Generation
from ppo_trainer.rollout.layout import build_rollout_batch
from ppojob_api.spec import ModelSpec

TINY = ModelSpec(path="builtin:tiny")
PAD = 258


def make_backend(role: str = "actor", *, seed: int = 0, device: str = "cpu", **overrides) -> TorchBackend:
    kwargs = {"model_spec": TINY, "role": role, "learning_rate": 1e-2, "max_grad_norm": 1.0}
    kwargs |= {"device": device, "seed": seed}
    return TorchBackend(**{**kwargs, **overrides})


def make_batch(prompts, responses):
    """A RolloutBatch from token lists; responses are right-padded, masks follow their lengths."""
    width = max(len(r) for r in responses)
    tokens = torch.full((len(responses), width), PAD)
    mask = torch.zeros(len(responses), width)
    for row, response in enumerate(responses):
        tokens[row, : len(response)] = torch.tensor(response)
        mask[row, : len(response)] = 1.0
    generation = Generation(response_tokens=tokens, response_mask=mask, log_probs=torch.zeros_like(mask))
    return build_rollout_batch(prompts, generation, [0.0] * len(prompts), PAD)


def sample_batch(rows: int = 6):
    generator = torch.Generator().manual_seed(0)
    prompts = [[256] + torch.randint(0, 256, (3 + i % 4,), generator=generator).tolist() for i in range(rows)]
    responses = [torch.randint(0, 256, (2 + (i * 3) % 5,), generator=generator).tolist() for i in range(rows)]
    return make_batch(prompts, responses)


SAMPLE_TOKENS = sample_batch().num_response_tokens


def nll_loss(output, rows):
    """A loss term of `sample_batch()` (`LossFn`): the micro-batch's token sum over the batch's tokens."""
    loss = -output["log_probs"].sum() / SAMPLE_TOKENS
    return loss, {"entropy": output["entropy"].detach().sum() / SAMPLE_TOKENS}


# --- forward -----------------------------------------------------------------------------------


def test_forward_outputs_are_cpu_float32_aligned_with_responses_and_zero_on_padding():
    batch = sample_batch()
    backend = make_backend()
    out = backend.forward(batch, with_entropy=True)
    assert set(out) == {"log_probs", "entropy"}
    for value in out.values():
        assert value.shape == batch.response_mask.shape
        assert value.dtype == torch.float32 and value.device.type == "cpu"
        assert torch.all(value[batch.response_mask == 0] == 0)
    real = batch.response_mask.bool()
    assert torch.all(out["log_probs"][real] < 0) and torch.all(out["entropy"][real] > 0)

    # Against a plain full-sequence forward of row 0 without padding.
    p = batch.prompt_length
    keep = batch.attention_mask[0].bool()
    ids = batch.tokens[0][keep][None]
    n = int(batch.response_mask[0].sum())
    logits = backend.model(input_ids=ids).logits[0, -n - 1 : -1]
    expected = torch.log_softmax(logits, -1).gather(-1, batch.tokens[0, p : p + n, None]).squeeze(-1)
    torch.testing.assert_close(out["log_probs"][0, :n], expected, atol=1e-5, rtol=0)


def test_forward_left_padding_does_not_change_a_rows_log_probs():
    backend = make_backend()
    prompt, response = [256, 10, 20, 30], [40, 50, 60]
    alone = backend.forward(make_batch([prompt], [response]))["log_probs"]
    padded = backend.forward(make_batch([prompt, [256] + list(range(1, 40))], [response, [7]]))["log_probs"]
    torch.testing.assert_close(padded[0], alone[0], atol=1e-5, rtol=0)


def test_forward_micro_batch_size_does_not_change_the_result():
    batch = sample_batch(7)
    one = make_backend(forward_micro_batch_size=1).forward(batch)["log_probs"]
    all_rows = make_backend(forward_micro_batch_size=64).forward(batch)["log_probs"]
    torch.testing.assert_close(one, all_rows, atol=1e-5, rtol=0)


def test_forward_logits_temperature_scales_the_distribution():
    batch = sample_batch()
    hot = make_backend(logits_temperature=2.0).forward(batch, with_entropy=True)
    cold = make_backend().forward(batch, with_entropy=True)
    real = batch.response_mask.bool()
    assert torch.all(hot["entropy"][real] > cold["entropy"][real])


def test_critic_forward_values_are_the_head_on_the_state_before_each_response_token():
    batch = make_batch([[256, 1, 2]], [[3, 4]])
    critic = make_backend("critic")
    values = critic.forward(batch)["values"]
    assert values.shape == (1, 2)
    ids = batch.tokens[:, :4]
    full = critic.model(input_ids=ids)
    torch.testing.assert_close(values[0], full[0, 2:4], atol=1e-6, rtol=0)


# --- train -------------------------------------------------------------------------------------


def test_train_step_lowers_the_loss_and_reports_the_sum_of_the_terms():
    batch = sample_batch()
    backend = make_backend()
    out = backend.forward(batch, with_entropy=True)
    before = -out["log_probs"].sum().item()
    stats = [backend.train(batch, nll_loss, micro_batch_size=2) for _ in range(5)]
    after = -backend.forward(batch)["log_probs"].sum().item()
    assert after < before
    assert stats[0]["loss"] == pytest.approx(before / SAMPLE_TOKENS, rel=1e-5)  # the whole batch's mean NLL
    assert stats[0]["entropy"] == pytest.approx(out["entropy"].sum().item() / SAMPLE_TOKENS, rel=1e-5)
    assert stats[-1]["loss"] < stats[0]["loss"]
    assert set(stats[0]) == {"loss", "entropy", "grad_norm", "skipped"}
    assert stats[0]["grad_norm"] > 0 and stats[0]["skipped"] == 0.0


def test_train_critic_fits_a_target():
    batch = sample_batch()
    critic = make_backend("critic")

    counts = batch_counts(batch.response_mask)

    def mse(output, rows):
        mask = batch.response_mask[rows]
        return aggregate_loss((output["values"] - 1.0) ** 2, mask, mode="TokenMean", counts=counts), {}

    first = critic.train(batch, mse, micro_batch_size=3)["loss"]
    for _ in range(10):
        last = critic.train(batch, mse, micro_batch_size=3)["loss"]
    assert last < first / 2


def test_train_gradient_accumulation_matches_one_big_micro_batch():
    batch = sample_batch(6)

    def mean_loss(output, rows):
        return -output["log_probs"].sum() / batch.num_response_tokens, {}

    def gradients_of_one_step(micro_batch_size):
        backend = make_backend(max_grad_norm=0.0)
        captured = []
        backend.optimizer.step = lambda: captured.extend(p.grad.clone() for p in backend.model.parameters())
        stats = backend.train(batch, mean_loss, micro_batch_size=micro_batch_size)
        return captured, stats

    small, small_stats = gradients_of_one_step(2)
    big, big_stats = gradients_of_one_step(6)
    for a, b in zip(small, big, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert small_stats["loss"] == pytest.approx(big_stats["loss"], rel=1e-6)
    assert small_stats["grad_norm"] == pytest.approx(big_stats["grad_norm"], rel=1e-5)


def test_train_clips_the_gradient_norm_before_the_step():
    batch = sample_batch()
    backend = make_backend(max_grad_norm=0.5)
    norms = []
    backend.optimizer.step = lambda: norms.append(
        torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in backend.model.parameters()])).item()
    )
    stats = backend.train(batch, nll_loss, micro_batch_size=6)
    assert stats["grad_norm"] > 0.5
    assert norms == [pytest.approx(0.5, rel=1e-4)]


def test_ref_backend_has_no_optimizer_and_refuses_to_train():
    ref = make_backend("ref", learning_rate=0.0)
    assert ref.optimizer is None and not any(p.requires_grad for p in ref.model.parameters())
    with pytest.raises(ValueError, match="no optimizer"):
        ref.train(sample_batch(), nll_loss, micro_batch_size=2)


@pytest.mark.parametrize(
    "overrides,field",
    [
        ({"role": "judge"}, "role"),
        ({"learning_rate": 0.0}, "learning_rate"),
        ({"max_grad_norm": -1.0}, "max_grad_norm"),
        ({"logits_temperature": 0.0}, "logits_temperature"),
    ],
)
def test_constructor_rejects_bad_arguments_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        make_backend(**overrides)


def test_named_weights_are_hugging_face_names():
    names = [name for name, _ in make_backend().named_weights()]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names


# --- offload and checkpoints -------------------------------------------------------------------


def assert_same_state(a: dict, b: dict) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key, value in a.items():
            assert_same_state(value, b[key])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same_state(x, y)
    else:
        assert a == b


def offload_round_trip(device: str) -> None:
    batch = sample_batch()
    backend = make_backend(device=device)
    backend.train(batch, nll_loss, micro_batch_size=3)
    before = backend.state_dict()
    backend.offload()
    offloaded = backend.last_transfer
    backend.offload()
    assert backend.offloaded and backend.last_transfer is offloaded
    with pytest.raises(RuntimeError, match="onload"):
        backend.train(batch, nll_loss, micro_batch_size=3)
    backend.onload()
    backend.onload()
    assert not backend.offloaded and backend.last_transfer["direction"] == "onload"
    assert_same_state(before, backend.state_dict())
    assert {p.device.type for p in backend.model.parameters()} == {torch.device(device).type}
    backend.train(batch, nll_loss, micro_batch_size=3)
    twin = make_backend(device=device)
    twin.train(batch, nll_loss, micro_batch_size=3)
    twin.train(batch, nll_loss, micro_batch_size=3)
    assert_same_state(twin.state_dict()["model"], backend.state_dict()["model"])
    return offloaded


def test_offload_onload_round_trips_exactly_and_is_idempotent_on_cpu():
    offloaded = offload_round_trip("cpu")
    assert offloaded["direction"] == "offload" and offloaded["bytes"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_offload_onload_round_trips_exactly_on_cuda():
    offloaded = offload_round_trip("cuda")
    assert offloaded["bytes"] > 0 and offloaded["seconds"] > 0


def test_state_dict_round_trip_continues_identically():
    batch = sample_batch()
    a = make_backend()
    a.train(batch, nll_loss, micro_batch_size=3)
    state = a.state_dict()
    b = make_backend(seed=99)
    b.load_state_dict(state)
    assert_same_state(state, b.state_dict())
    a.train(batch, nll_loss, micro_batch_size=3)
    b.train(batch, nll_loss, micro_batch_size=3)
    assert_same_state(a.state_dict(), b.state_dict())
    with pytest.raises(ValueError, match="model"):
        b.load_state_dict({"weights": {}})
