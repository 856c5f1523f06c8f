"""The Torch backend's offload on a real GPU: a role asleep gives its device memory back.

Skipped without CUDA (CI has none); run on the GPU machine with `python -m pytest -q -m gpu tests/gpu`.
"""

from __future__ import annotations

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


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_a_trained_role_asleep_holds_no_device_memory(checkpoint, role):
    """After training, an offload alone (no cache emptying by the caller) returns the parked
    parameters and optimizer state to the driver, the second time too, when they are views of
    the one device buffer the previous onload allocated."""
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
