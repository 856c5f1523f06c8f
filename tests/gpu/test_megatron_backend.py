"""MegatronBackend and the compiled TorchBackend on a real GPU against the eager TorchBackend, on a tiny Qwen2
checkpoint (float32).

Skipped without CUDA or megatron-core (CI has neither); run on the GPU machine with
`python -m pytest -q -m gpu tests/gpu`.
"""

from __future__ import annotations

import pytest
import torch

from ppo_trainer.batch import RolloutBatch
from ppojob_api.spec import ModelSpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (megatron-core does not run on CPUs)"),
]
megatron = pytest.importorskip("megatron.core", reason="needs megatron-core (tools/gpu-bundle packs it)")


@pytest.fixture(scope="module")
def checkpoint(random_qwen2):
    return random_qwen2("qwen2-tiny", vocab_size=256, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=128)


def make(kind: str, checkpoint, role: str = "actor", **extra):
    kwargs = {"model_spec": ModelSpec(path=str(checkpoint), dtype="float32"), "role": role, "learning_rate": 1e-3,
              "max_grad_norm": 1.0, "device": "cuda", "seed": 0, **extra}
    if kind == "megatron":
        from ppo_trainer.backends.megatron.backend import MegatronBackend

        return MegatronBackend(**kwargs)
    from ppo_trainer.backends.torch_backend import TorchBackend

    return TorchBackend(**kwargs)


def make_batch() -> RolloutBatch:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (4, 12), generator=generator)
    attention = torch.ones(4, 12, dtype=torch.long)
    attention[1, :3] = 0  # left padding of a shorter prompt
    attention[2, 10:] = 0  # a shorter response
    response = attention[:, 6:].float()
    return RolloutBatch(tokens=tokens, attention_mask=attention, response_mask=response, prompt_length=6,
                        rollout_log_probs=torch.zeros(4, 6), scores=torch.zeros(4))


def test_megatron_log_probs_equal_the_torch_backend_and_weights_round_trip(checkpoint):
    batch = make_batch()
    torch_lp = make("torch", checkpoint).forward(batch)["log_probs"]
    backend = make("megatron", checkpoint)
    lp = backend.forward(batch)["log_probs"]
    torch.testing.assert_close(lp, torch_lp, atol=2e-4, rtol=0)
    from safetensors.torch import load_file

    hf = load_file(str(checkpoint / "model.safetensors"))
    exported = dict(backend.named_weights())
    assert set(exported) == set(hf) - {"lm_head.weight"}
    for name, tensor in exported.items():
        torch.testing.assert_close(tensor.cpu(), hf[name], atol=0, rtol=0)


def test_megatron_offload_round_trip_and_train_step(checkpoint):
    batch = make_batch()
    backend = make("megatron", checkpoint)

    def loss_fn(output, rows):
        lp = output["log_probs"]
        return -(lp * batch.response_mask[rows].to(lp.device)).sum() / batch.response_mask.sum(), {}  # a term of the batch

    stats = backend.train(batch, loss_fn, micro_batch_size=2)
    assert torch.isfinite(torch.tensor(stats["grad_norm"])) and stats["skipped"] == 0.0
    before = backend.forward(batch)["log_probs"]
    allocated = torch.cuda.memory_allocated()
    backend.offload()
    backend.offload()
    assert backend.last_transfer["direction"] == "offload" and backend.last_transfer["bytes"] > 0
    assert torch.cuda.memory_allocated() < allocated
    backend.onload()
    assert torch.equal(backend.forward(batch)["log_probs"], before)
    backend.offload()  # the turn changed nothing: the host copies hold the values, nothing is copied
    assert backend.last_transfer["bytes"] == 0
    backend.onload()
    assert torch.equal(backend.forward(batch)["log_probs"], before)
    after = backend.train(batch, loss_fn, micro_batch_size=4)
    assert after["loss"] < stats["loss"]
    trained = backend.forward(batch)["log_probs"]
    backend.offload()
    assert backend.last_transfer["bytes"] > 0
    backend.onload()
    assert torch.equal(backend.forward(batch)["log_probs"], trained)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_megatron_resumes_from_its_state_dict_with_the_optimizer_state(checkpoint, dtype):
    """A backend loaded from another's state_dict then trains exactly as the original goes on to
    (Adam's moments and the fp32 main parameters come back, not only the weights)."""
    batch = make_batch()

    def loss_fn(output, rows):
        lp = output["log_probs"]
        return -(lp * batch.response_mask[rows].to(lp.device)).sum() / batch.response_mask.sum(), {}  # a term of the batch

    spec = ModelSpec(path=str(checkpoint), dtype=dtype)
    original = make("megatron", checkpoint, model_spec=spec)
    for _ in range(2):
        original.train(batch, loss_fn, micro_batch_size=2)
    saved = original.state_dict()
    assert saved["optimizer"] and saved["optimizer"][0]["torch"]["state"]
    resumed, restarted = make("megatron", checkpoint, model_spec=spec), make("megatron", checkpoint, model_spec=spec)
    resumed.load_state_dict(saved)
    restarted.load_state_dict({"model": saved["model"], "optimizer": None})  # weights only
    for backend in (original, resumed, restarted):
        backend.train(batch, loss_fn, micro_batch_size=2)
    expected = original.forward(batch)["log_probs"]
    torch.testing.assert_close(resumed.forward(batch)["log_probs"], expected, atol=0, rtol=0)
    assert not torch.equal(restarted.forward(batch)["log_probs"], expected)  # the moments matter


def test_megatron_critic_values_have_the_batch_layout(checkpoint):
    batch = make_batch()
    values = make("megatron", checkpoint, role="critic").forward(batch)["values"]
    assert values.shape == (4, 6) and torch.all(values[batch.response_mask == 0] == 0)


@pytest.mark.parametrize("kind", ["torch", "megatron"])
def test_compiled_backend_equals_eager_for_log_probs_values_and_a_train_step(checkpoint, kind):
    """`compile` (each decoder layer through torch.compile, megatron's as `fused_layer.decoder_layer`; rows padded
    to widths of 64) changes no result."""
    batch = make_batch()

    def loss_fn(output, rows):
        out = output.get("log_probs", output.get("values"))
        return (out * batch.response_mask[rows].to(out.device)).pow(2).mean(), {}

    for role, key in (("actor", "log_probs"), ("critic", "values")):
        eager, compiled = make(kind, checkpoint, role), make(kind, checkpoint, role, compile=True)
        torch.testing.assert_close(compiled.forward(batch)[key], eager.forward(batch)[key], atol=1e-4, rtol=0)
        eager.train(batch, loss_fn, micro_batch_size=2)
        compiled.train(batch, loss_fn, micro_batch_size=2)
        torch.testing.assert_close(compiled.forward(batch)[key], eager.forward(batch)[key], atol=1e-4, rtol=0)


def policy_loss_for(batch: RolloutBatch, *, mode: str):
    """The actor's loss as roles/actor.py builds it (clipped policy loss plus an entropy bonus, each a
    term of the whole batch), with fixed old log-probs and advantages."""
    from ppo_trainer.algorithms import aggregate_loss, batch_counts, policy_loss

    counts = batch_counts(batch.response_mask)
    generator = torch.Generator().manual_seed(1)
    old = -torch.rand(batch.response_mask.shape, generator=generator) * 6
    advantages = torch.randn(batch.response_mask.shape, generator=generator)

    def loss_fn(output, rows):
        lp = output["log_probs"]
        mask = batch.response_mask[rows].to(lp.device)
        pg, _ = policy_loss(lp, old[rows].to(lp.device), advantages[rows].to(lp.device), mask, clip_eps=0.2,
                            aggregation=mode, counts=counts)
        return pg - 0.01 * aggregate_loss(output["entropy"], mask, mode=mode, counts=counts), {}

    return loss_fn


def gradients_by_hf_name(backend, batch, loss_fn, *, micro_batch_size: int) -> dict[str, torch.Tensor]:
    """The reduced gradient of one `train` call under Hugging Face names; the step itself is skipped
    (so one backend serves several calls)."""
    from ppo_trainer.backends.megatron import conversion
    from ppo_trainer.backends.megatron.backend import MegatronBackend

    captured: dict[str, torch.Tensor] = {}
    if isinstance(backend, MegatronBackend):
        def record():
            grads = {name: p.main_grad.detach().float().clone() for name, p in backend.gpt.named_parameters()}
            grads = conversion.from_stage(grads, backend.shape, layers=backend.layers, first=backend.first_stage)
            captured.update({name: g.cpu() for name, g in conversion.megatron_to_hf(grads, backend.shape)})
            return True, 0.0, None
    else:
        def record():
            captured.update({name: p.grad.detach().float().cpu() for name, p in backend.model.named_parameters()})
    backend.optimizer.step = record
    backend.train(batch, loss_fn, micro_batch_size=micro_batch_size)
    return captured


def relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    diff = torch.cat([(a[k] - b[k]).reshape(-1) for k in a])
    return float(diff.norm() / torch.cat([b[k].reshape(-1) for k in b]).norm())


@pytest.mark.parametrize("mode", ["TokenMean", "SequenceMeanTokenMean", "SequenceMeanTokenSum"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_megatron_gradient_is_the_same_for_any_micro_batch_and_equals_the_torch_backends(checkpoint, mode, dtype):
    """The shared normalisation on megatron's schedule: micro-batches of 1 row and the whole batch give
    the same gradient (fp32 round-off), and it equals the fp32 Torch backend's (within bf16's precision)."""
    batch = make_batch()
    loss_fn = policy_loss_for(batch, mode=mode)
    unclipped = {"max_grad_norm": 0.0}  # the Torch backend clips before its step, megatron inside it
    reference = gradients_by_hf_name(make("torch", checkpoint, **unclipped), batch, loss_fn, micro_batch_size=4)
    backend = make("megatron", checkpoint, model_spec=ModelSpec(path=str(checkpoint), dtype=dtype), **unclipped)
    whole = gradients_by_hf_name(backend, batch, loss_fn, micro_batch_size=4)
    one_row = gradients_by_hf_name(backend, batch, loss_fn, micro_batch_size=1)
    split, versus_torch = relative_difference(one_row, whole), relative_difference(whole, reference)
    print(f"\n{mode} {dtype}: micro-batch 1 vs whole {split:.2e}; megatron vs torch {versus_torch:.2e}")
    assert split < (1e-5 if dtype == "float32" else 1e-2)
    assert versus_torch < (1e-3 if dtype == "float32" else 5e-2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_megatron_fused_layers_give_the_gradient_of_megatrons_own_layers(checkpoint, dtype):
    """`compile` at tensor parallel 1 runs each decoder layer through `fused_layer.decoder_layer`: the
    reduced gradient (megatron's DDP buffers) is the one of megatron's own layers, up to rounding."""
    batch = make_batch()
    loss_fn = policy_loss_for(batch, mode="TokenMean")
    spec = ModelSpec(path=str(checkpoint), dtype=dtype)
    fused_backend = make("megatron", checkpoint, model_spec=spec, compile=True)
    assert "forward" in vars(fused_backend.gpt.decoder.layers[0])  # the fused forward is in place
    fused = gradients_by_hf_name(fused_backend, batch, loss_fn, micro_batch_size=2)
    own = gradients_by_hf_name(make("megatron", checkpoint, model_spec=spec), batch, loss_fn, micro_batch_size=2)
    difference = relative_difference(fused, own)
    print(f"\n{dtype}: fused vs megatron's layers {difference:.2e}")
    assert difference < (1e-4 if dtype == "float32" else 2e-2)


@pytest.mark.parametrize("kind, dtype", [("torch", "float32"), ("megatron", "float32"), ("megatron", "bfloat16")])
def test_the_optimizer_state_leaves_alone_and_training_goes_on_as_if_it_had_stayed(checkpoint, kind, dtype):
    """What the actor does before a weight sync: the optimizer state to the host, the weights staying
    on the device (device memory falls by the bytes moved, the weights read the same); the trained
    weights then offload and onload whole, and the next step equals that of a backend that kept it."""
    batch = make_batch()

    def loss_fn(output, rows):
        lp = output["log_probs"]
        return -(lp * batch.response_mask[rows].to(lp.device)).sum() / batch.response_mask.sum(), {}

    spec = ModelSpec(path=str(checkpoint), dtype=dtype)
    left, kept = make(kind, checkpoint, model_spec=spec), make(kind, checkpoint, model_spec=spec)
    for backend in (left, kept):
        backend.train(batch, loss_fn, micro_batch_size=2)
    parameters = sum(p.numel() for p in left.model.parameters())
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    left.offload_optimizer_state()
    moved = left.last_transfer
    assert moved["direction"] == "offload" and moved["bytes"] >= 2 * 4 * parameters  # Adam's fp32 moments at least
    assert allocated - torch.cuda.memory_allocated() >= 0.95 * moved["bytes"]
    left.offload_optimizer_state()
    assert left.last_transfer is moved  # already on the host: nothing moves
    for (name, weight), (_, expected) in zip(left.named_weights(), kept.named_weights(), strict=True):
        assert weight.is_cuda and torch.equal(weight, expected), name
    trained = kept.forward(batch)["log_probs"]
    left.offload()
    left.onload()
    assert torch.equal(left.forward(batch)["log_probs"], trained)  # the changed weights were copied, not stale
    for backend in (left, kept):
        backend.train(batch, loss_fn, micro_batch_size=2)
    stepped = kept.forward(batch)["log_probs"]
    torch.testing.assert_close(left.forward(batch)["log_probs"], stepped, atol=1e-6, rtol=0)
    assert not torch.equal(stepped, trained)
