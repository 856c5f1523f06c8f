"""The `TrainBackend` contract, run against every backend built by `build_backend`: Torch on the CPU
(CI), Megatron on a GPU (`pytest -m gpu`; skipped without CUDA and megatron-core).

What a role may rely on and nothing else: forward's outputs (float32 on CPU, [B, T], zero on
padding), one optimizer step per train (a reference has none), idempotent offload/onload that
leave the model as it was and change no later step (the optimizer state may also leave alone), a
state dict that round-trips bit for bit and whose optimizer part brings the moments but not the
learning rate (the spec's wins), weights under Hugging Face names (a policy's for the engines, a critic's
those of a token classifier with one label whose logits are its values), and
process-group attach/release around a rebuilt group.
"""

from __future__ import annotations

import socket

import pytest
import torch
from transformers import LlamaForTokenClassification

from ppo_trainer.backends.build import build_backend
from ppo_trainer.batch import RolloutBatch
from ppo_trainer.models import tiny_config
from ppojob_api.spec import parse_spec


def has_megatron() -> bool:
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


BACKENDS = [
    pytest.param("Torch", id="torch"),
    pytest.param("Megatron", id="megatron", marks=[
        pytest.mark.gpu, pytest.mark.skipif(not has_megatron(), reason="needs a CUDA GPU and megatron-core")]),
]


@pytest.fixture(scope="module")
def default_group():
    """Megatron builds its model-parallel groups on the default group: one rank of its own."""
    import torch.distributed as dist

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield


@pytest.fixture(params=BACKENDS)
def make(request):
    kind = request.param
    if kind == "Megatron":
        request.getfixturevalue("default_group")
    device = "cuda" if kind == "Megatron" else "cpu"

    def build(role: str, learning_rate: float = 1e-2):
        spec = parse_spec({"image": "local", "seed": 3, "model": {"path": "builtin:tiny"},
                           "actor": {"backend": kind, "learningRate": learning_rate, "microBatchSize": 2,
                                     "compile": False}})
        return build_backend(spec, role=role, device=device)

    return build


def sample_batch() -> RolloutBatch:
    g = torch.Generator().manual_seed(0)
    rows, prompt, response = 4, 3, 5
    mask = torch.ones(rows, response)
    mask[1, 2:] = 0
    mask[3, 4:] = 0
    tokens = torch.randint(0, 256, (rows, prompt + response), generator=g)
    attention = torch.cat([torch.ones(rows, prompt, dtype=torch.long), mask.long()], dim=1)
    return RolloutBatch(tokens=tokens, attention_mask=attention, response_mask=mask, prompt_length=prompt,
                        rollout_log_probs=torch.zeros(rows, response), scores=torch.ones(rows))


def loss_fn(output, rows):
    key = "values" if "values" in output else "log_probs"
    term = (output[key] ** 2).sum() / 100.0
    return term, {"term": term}


@pytest.mark.parametrize(("role", "key"), [("actor", "log_probs"), ("ref", "log_probs"), ("critic", "values")])
def test_forward_is_float32_on_cpu_per_response_token_and_zero_on_padding(make, role, key):
    backend, batch = make(role), sample_batch()
    out = backend.forward(batch)
    assert backend.is_value_model == (role == "critic") and key in out
    assert out[key].shape == batch.response_mask.shape
    assert out[key].dtype == torch.float32 and out[key].device.type == "cpu"
    assert torch.all(out[key][batch.response_mask == 0] == 0)


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_train_takes_one_step_and_reports_loss_and_grad_norm(make, role):
    backend, batch = make(role), sample_batch()
    before = backend.forward(batch)
    stats = backend.train(batch, loss_fn, micro_batch_size=2)
    assert {"loss", "term", "grad_norm", "skipped"} <= set(stats) and stats["skipped"] == 0.0
    assert stats["loss"] == pytest.approx(stats["term"]) and stats["grad_norm"] > 0
    # the stats are summed over the micro-batches (on the device) and come back as numbers
    key = "values" if role == "critic" else "log_probs"
    assert all(isinstance(value, float) for value in stats.values())
    assert stats["term"] == pytest.approx(float((before[key] ** 2).sum()) / 100.0, rel=1e-2)
    after = backend.forward(batch)
    assert not all(torch.equal(before[k], after[k]) for k in before)


def test_a_reference_does_not_train(make):
    with pytest.raises(ValueError, match="no optimizer"):
        make("ref").train(sample_batch(), loss_fn, micro_batch_size=2)


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_offload_and_onload_are_idempotent_and_leave_the_model_as_it_was(make, role):
    backend, batch = make(role), sample_batch()
    backend.train(batch, loss_fn, micro_batch_size=2)  # optimizer state exists and moves too
    before = backend.forward(batch)
    backend.offload()
    backend.offload()
    with pytest.raises(RuntimeError, match="offloaded"):
        backend.forward(batch)
    backend.onload()
    backend.onload()
    after = backend.forward(batch)
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_sleeping_between_steps_changes_no_step(make, role):
    """Offloads after a training turn and after a read-only turn (no copy back then), and the
    optimizer state coming back beside the next training pass, train as a backend that never slept."""
    slept, stayed, batch = make(role), make(role), sample_batch()
    for backend in (slept, stayed):
        backend.train(batch, loss_fn, micro_batch_size=2)
    slept.offload()
    slept.onload()
    slept.forward(batch)  # a read-only turn
    slept.offload()
    slept.onload()
    for backend in (slept, stayed):
        backend.train(batch, loss_fn, micro_batch_size=2)
    slept.offload()
    slept.onload()
    want, got = stayed.forward(batch), slept.forward(batch)
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=0)


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_the_optimizer_state_leaving_alone_keeps_every_pass_and_changes_no_step(make, role):
    """What the actor does before a weight sync: the backend stays awake for every pass, and the
    optimizer state comes back for the next training pass as if it had never left."""
    left, stayed, batch = make(role), make(role), sample_batch()
    for backend in (left, stayed):
        backend.train(batch, loss_fn, micro_batch_size=2)
    left.offload_optimizer_state()
    left.offload_optimizer_state()
    want, got = stayed.forward(batch), left.forward(batch)
    assert all(torch.equal(got[k], want[k]) for k in want)
    left.offload()
    left.onload()
    for backend in (left, stayed):
        backend.train(batch, loss_fn, micro_batch_size=2)
    want, got = stayed.forward(batch), left.forward(batch)
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=0)


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_state_dict_round_trips_bit_for_bit(make, role):
    trained, batch = make(role), sample_batch()
    trained.train(batch, loss_fn, micro_batch_size=2)
    fresh = make(role)
    fresh.load_state_dict(trained.state_dict())
    want, got = trained.forward(batch), fresh.forward(batch)
    assert all(torch.equal(want[k], got[k]) for k in want)
    trained.train(batch, loss_fn, micro_batch_size=2)
    fresh.train(batch, loss_fn, micro_batch_size=2)  # the optimizer state came along: the same next step
    want, got = trained.forward(batch), fresh.forward(batch)
    assert all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_a_loaded_optimizer_steps_at_the_learning_rate_it_was_built_with(make, role):
    trained, batch = make(role), sample_batch()  # saved at learning rate 1e-2
    trained.train(batch, loss_fn, micro_batch_size=2)
    saved = trained.state_dict()
    loaded = make(role, learning_rate=1e-12)
    loaded.load_state_dict(saved)
    before = loaded.forward(batch)
    loaded.train(batch, loss_fn, micro_batch_size=2)
    trained.train(batch, loss_fn, micro_batch_size=2)
    for key, value in before.items():
        # A step at 1e-2 moves the outputs by far more than 1e-6; one at 1e-12 cannot.
        torch.testing.assert_close(loaded.forward(batch)[key], value, atol=1e-6, rtol=0)
        assert (trained.forward(batch)[key] - value).abs().max() > 1e-3


def test_policy_weights_for_the_engines_and_a_critic_s_as_a_token_classifier_with_its_values(make):
    names = [name for name, _ in make("actor").named_weights()]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names
    critic, batch = make("critic"), sample_batch()
    config = tiny_config()
    config.num_labels = 1
    classifier = LlamaForTokenClassification(config).eval()
    classifier.load_state_dict({name: t.cpu().float() for name, t in critic.named_weights()}, strict=True)
    with torch.no_grad():  # column t: the value of the state before response token t
        logits = classifier(input_ids=batch.tokens).logits[..., 0]
    start, width = batch.prompt_length - 1, batch.response_mask.shape[1]
    expected = logits[:, start:start + width] * batch.response_mask
    torch.testing.assert_close(critic.forward(batch)["values"], expected, atol=1e-4, rtol=1e-4)


def test_process_groups_release_and_attach_around_a_rebuild(make):
    backend, batch = make("actor"), sample_batch()
    before = backend.forward(batch)
    backend.release_process_groups()
    backend.attach_process_groups()
    assert torch.equal(backend.forward(batch)["log_probs"], before["log_probs"])
