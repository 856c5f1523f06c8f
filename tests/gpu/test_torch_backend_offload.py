"""The Torch backend's offload on a real GPU: a role asleep gives its device memory back.

The device-memory figures are read in a process of their own (`in_fresh_process`): blocks that earlier
tests of the session leave in torch's caching allocator can share a segment with the parked buffer
and keep it reserved. Skipped without CUDA (CI has none); run on the GPU machine with
`python -m pytest -q -m gpu tests/gpu`.
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from ppo_trainer.backends.torch_backend import TorchBackend
from ppo_trainer.batch import RolloutBatch
from ppojob_api.spec import ModelSpec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def checkpoint(random_qwen2):
    """A Qwen2 of ~6.5M parameters: tens of megabytes to park, well above the allocator's granularity."""
    return random_qwen2("qwen2-small", vocab_size=4096, hidden_size=512, intermediate_size=1024,
                        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                        max_position_embeddings=128)


def make_batch() -> RolloutBatch:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 4096, (4, 24), generator=generator)
    attention = torch.ones(4, 24, dtype=torch.long)
    return RolloutBatch(tokens=tokens, attention_mask=attention, response_mask=attention[:, 12:].float(),
                        prompt_length=12, rollout_log_probs=torch.zeros(4, 12), scores=torch.zeros(4))


def in_fresh_process(function, *args) -> None:
    """`function(*args)` in a new process (its own CUDA context and caching allocator); what it
    raises is raised here."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        pool.apply(function, args)


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_a_trained_role_asleep_holds_no_device_memory(checkpoint, role):
    """After training, an offload alone (no cache emptying by the caller) returns the parked
    parameters and optimizer state to the driver, the second time too, when they are views of
    the one device buffer the previous onload allocated."""
    in_fresh_process(trained_role_asleep_holds_no_device_memory, checkpoint, role)


def trained_role_asleep_holds_no_device_memory(checkpoint, role: str) -> None:
    backend = TorchBackend(model_spec=ModelSpec(path=str(checkpoint), dtype="float32"), role=role,
                           learning_rate=1e-3, max_grad_norm=1.0, device="cuda", seed=0)
    batch = make_batch()
    key = "values" if role == "critic" else "log_probs"

    def loss_fn(outputs, rows):
        return outputs[key].square().mean(), {}

    for _ in range(2):
        backend.train(batch, loss_fn, micro_batch_size=2)
        torch.cuda.synchronize()
        awake = torch.cuda.memory_reserved()
        backend.offload()
        parked = backend.last_transfer["bytes"]
        assert parked > 50e6
        assert torch.cuda.memory_reserved() < awake - 0.95 * parked, (awake, torch.cuda.memory_reserved(), parked)
        backend.onload()


def test_an_offload_after_a_turn_that_changed_nothing_copies_nothing_and_loses_nothing(checkpoint):
    """A log-probs turn (onload, forward, offload) moves nothing back to the host: the host copies
    still hold the values, the device memory is freed all the same; after a train they move again."""
    in_fresh_process(unchanged_offload_copies_nothing_and_loses_nothing, checkpoint)


def unchanged_offload_copies_nothing_and_loses_nothing(checkpoint) -> None:
    backend = TorchBackend(model_spec=ModelSpec(path=str(checkpoint), dtype="float32"), role="actor",
                           learning_rate=1e-3, max_grad_norm=1.0, device="cuda", seed=0)
    batch = make_batch()

    def loss_fn(outputs, rows):
        return outputs["log_probs"].square().mean(), {}

    parameters = sum(p.numel() * p.element_size() for p in backend.model.parameters())
    backend.train(batch, loss_fn, micro_batch_size=2)
    trained = backend.forward(batch)["log_probs"]
    backend.offload()
    assert backend.last_transfer["bytes"] > 50e6
    backend.onload()
    assert torch.equal(backend.forward(batch)["log_probs"], trained)
    torch.cuda.synchronize()
    awake = torch.cuda.memory_reserved()
    backend.offload()
    assert backend.last_transfer["bytes"] == 0 and backend.last_transfer["copies"] == 0
    assert torch.cuda.memory_reserved() < awake - 0.95 * parameters
    backend.onload()
    assert torch.equal(backend.forward(batch)["log_probs"], trained)
    backend.train(batch, loss_fn, micro_batch_size=2)
    changed = backend.forward(batch)["log_probs"]
    backend.offload()
    assert backend.last_transfer["bytes"] > 50e6
    backend.onload()
    assert torch.equal(backend.forward(batch)["log_probs"], changed) and not torch.equal(changed, trained)


def test_the_optimizer_state_comes_back_beside_the_training_pass_and_changes_no_step(checkpoint):
    """Onload brings the parameters only; `train` brings the optimizer state on a side stream (in shares
    beside its micro-batches) and steps exactly as a backend that never slept."""
    def make():
        return TorchBackend(model_spec=ModelSpec(path=str(checkpoint), dtype="float32"), role="actor",
                            learning_rate=1e-3, max_grad_norm=1.0, device="cuda", seed=0)

    slept, stayed, batch = make(), make(), make_batch()

    def loss_fn(outputs, rows):
        return outputs["log_probs"].square().mean(), {}

    parameters = sum(p.numel() * p.element_size() for p in slept.model.parameters())
    for backend in (slept, stayed):
        backend.train(batch, loss_fn, micro_batch_size=2)
    slept.offload()
    slept.onload()
    assert slept.last_transfer["bytes"] == pytest.approx(parameters, rel=0.01)  # no optimizer state
    slept.forward(batch)
    slept.offload()
    slept.onload()
    for backend in (slept, stayed):
        backend.train(batch, loss_fn, micro_batch_size=2)
    assert slept.last_transfer["beside_compute"] and slept.last_transfer["bytes"] >= 2 * parameters  # Adam's moments
    torch.testing.assert_close(slept.forward(batch)["log_probs"], stayed.forward(batch)["log_probs"], atol=1e-6, rtol=0)
