"""HostMirror on a CUDA device: one flat pinned buffer, exact round trips, one copy once packed."""

from __future__ import annotations

import pytest
import torch

from ppo_trainer.models.residency import HostMirror

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_round_trip_is_exact_and_the_second_offload_is_one_copy():
    mirror = HostMirror(device="cuda")
    tensors = [torch.randn(1000, 7, device="cuda").to(torch.bfloat16), torch.randn(3, device="cuda"),
               torch.tensor(5.0, device="cuda"), torch.randint(0, 9, (17,), device="cuda")]
    expected = [t.cpu() for t in tensors]
    slots = list(tensors)

    def put(index: int, moved: torch.Tensor) -> None:
        slots[index] = moved

    mirror.to_host(list(slots), put)
    assert all(t.device.type == "cpu" and t.is_pinned() for t in slots)
    assert mirror.last_transfer["copies"] == len(tensors) and mirror.last_transfer["bytes"] > 0
    assert len({t.untyped_storage().data_ptr() for t in slots}) == 1
    mirror.to_device(list(slots), put)
    assert mirror.last_transfer["copies"] == 1 and mirror.last_transfer["seconds"] > 0
    assert all(t.device.type == "cuda" for t in slots)
    for t, e in zip(slots, expected, strict=True):
        assert t.dtype == e.dtype and torch.equal(t.cpu(), e)
    slots[1].add_(1.0)
    mirror.to_host(list(slots), put)
    assert mirror.last_transfer["copies"] == 1
    assert torch.equal(slots[1], expected[1] + 1.0) and torch.equal(slots[0], expected[0])
