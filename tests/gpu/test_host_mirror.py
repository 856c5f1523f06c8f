"""HostMirror on a CUDA device: one flat pinned buffer, exact round trips, one copy once packed; in place,
every view stays valid and a host copy is reused only while unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ppo_trainer.offload.host_mirror import HostMirror, pinned_empty

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



def test_pinned_buffers_take_their_exact_size_where_torchs_allocator_rounds_up():
    """3 GiB + 1 byte: pinned_empty adds that much resident host memory; torch's pinned allocator
    (the control, last: it keeps its block cached) adds the next power of two, 4 GiB."""
    from ppo_trainer.offload.host_mirror import pinned_empty

    size = 3 * 2**30 + 1
    before = _resident_bytes()
    host = pinned_empty(size, torch.uint8)
    assert host.is_pinned() and host.numel() == size
    added = _resident_bytes() - before
    assert size - 2**24 <= added < size + 2**24, added
    device = torch.arange(251, dtype=torch.uint8, device="cuda").repeat(1000)
    host[-device.numel():].copy_(device, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(host[-device.numel():].cuda(), device)
    del host
    assert _resident_bytes() - before < 2**28  # the 3 GiB went back (the copies above leave some megabytes)
    before = _resident_bytes()
    rounded = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    assert _resident_bytes() - before >= 4 * 2**30 - 2**24
    del rounded


def _resident_bytes() -> int:
    """This process's resident host memory, from /proc (VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def test_a_staged_onload_copied_beside_on_a_side_stream_lands_before_the_waiting_stream_reads_it():
    """`stage_on_device` puts the device views in place at once; `SideStreamCopy` fills them on its own
    stream, and work queued after `wait` on the current stream sees the values."""
    from ppo_trainer.offload.side_stream import SideStreamCopy

    mirror = HostMirror(device="cuda")
    tensors = [torch.randn(4096, 1024, device="cuda"), torch.randn(777, device="cuda")]
    expected = [t.cpu() for t in tensors]
    slots = list(tensors)

    def put(index: int, moved: torch.Tensor) -> None:
        slots[index] = moved

    del tensors
    mirror.to_host(list(slots), put)
    side = SideStreamCopy(device="cuda")
    side.PART_BYTES = 2**20  # several parts
    side.prepare(mirror.stage_on_device(list(slots), put), sum(e.numel() * e.element_size() for e in expected))
    assert all(t.device.type == "cuda" for t in slots)
    busy = torch.randn(2048, 2048, device="cuda")
    for _ in range(20):  # compute queued after the allocation, beside which the copy runs
        busy = busy @ busy / 2048**0.5
    side.split(3)
    side.advance()
    side.wait()  # queues the other parts
    sums = [t.sum() for t in slots]
    transfer = side.settle()
    assert transfer["beside_compute"] and transfer["bytes"] == sum(e.numel() * e.element_size() for e in expected)
    for s, e in zip(sums, expected, strict=True):
        torch.testing.assert_close(s.cpu(), e.sum())


@pytest.mark.parametrize("size", [8, 4096 * 8 * 3 + 5, 3])
def test_the_kernel_copy_brings_every_byte_aligned_or_not(size):
    """The kernel copies the 8-byte words, `Tensor.copy_` a shorter tail or unaligned tensors."""
    from ppo_trainer.offload.kernel_copy import copy_from_host

    host = pinned_empty(size + 1, torch.uint8)
    host.copy_(torch.randint(0, 256, (size + 1,), dtype=torch.uint8))
    for offset in (0, 1):  # aligned, then one byte off
        target = torch.zeros(size + 1, dtype=torch.uint8, device="cuda")
        copy_from_host(target[offset:], host[offset:])
        torch.cuda.synchronize()
        assert torch.equal(target[offset:].cpu(), host[offset:])
        assert int(target[:offset].sum()) == 0
    with pytest.raises(ValueError, match="same bytes"):
        copy_from_host(torch.zeros(4, device="cuda"), host[:3])


def test_wakes_by_either_path_bring_the_same_bytes_and_follow_the_faster():
    """The first wake goes by the cores, the second by the copy engines, both exact; the third
    takes whichever the two timed faster."""
    from ppo_trainer.offload.kernel_copy import WakeCopyPath

    mirror = HostMirror(device="cuda")
    slots = [torch.randint(-2**62, 2**62, (WakeCopyPath.MIN_BYTES // 8 + 3,), device="cuda"),
             torch.randn(1001, device="cuda")]
    expected = [t.cpu() for t in slots]

    def put(index: int, moved: torch.Tensor) -> None:
        slots[index] = moved

    rates = {}
    for _ in range(3):
        mirror.to_host(list(slots), put)
        mirror.to_device(list(slots), put)
        transfer = mirror.last_transfer
        rates.setdefault(transfer["path"], transfer["bytes"] / transfer["seconds"])
        for t, e in zip(slots, expected, strict=True):
            assert torch.equal(t.cpu(), e)
    print("wakes GB/s by path:", {path: round(rate / 1e9, 1) for path, rate in rates.items()})
    assert list(rates) == ["cores", "engines"]
    assert transfer["path"] == max(rates, key=rates.get)


def test_in_place_the_tensors_and_their_views_stay_and_get_their_values_back():
    """In place (Megatron's flat buffers): storage freed where it is and refilled, views into it valid
    throughout; a tensor not kept comes back zeroed; after an unchanged turn nothing is copied, after
    a change everything is; the optimizer state's staged copy in parts brings every byte."""
    mirror = HostMirror(device="cuda", in_place=True)
    buffer = torch.randn(4096, device="cuda")
    view = buffer[1000:1010]  # a parameter living in the buffer
    grads = torch.randn(4096, device="cuda")
    expected = buffer.cpu()
    free_before = torch.cuda.memory_allocated()
    mirror.to_host([buffer, grads], keep=[True, False])
    assert buffer.untyped_storage().nbytes() == 0 and grads.untyped_storage().nbytes() == 0
    assert mirror.last_transfer["bytes"] == buffer.nbytes and mirror.last_transfer["copies"] == 1
    assert torch.cuda.memory_allocated() <= free_before - 2 * buffer.nbytes
    mirror.to_device()
    assert torch.equal(buffer.cpu(), expected) and torch.equal(view.cpu(), expected[1000:1010])
    assert int(grads.count_nonzero()) == 0 and mirror.last_transfer["path"] in ("cores", "engines")
    mirror.to_host([buffer, grads], keep=[True, False], unchanged=True)
    assert mirror.last_transfer["bytes"] == 0 and mirror.last_transfer["copies"] == 0
    mirror.to_device()
    assert torch.equal(buffer.cpu(), expected)
    view.add_(1.0)  # a training step writes through the view
    mirror.to_host([buffer, grads], keep=[True, False])
    assert mirror.last_transfer["bytes"] == buffer.nbytes
    from ppo_trainer.offload.side_stream import SideStreamCopy

    side = SideStreamCopy(device="cuda")
    side.PART_BYTES = 2**12  # several parts
    side.prepare(mirror.stage_on_device(), mirror.parked_bytes)
    side.split(4)
    side.wait()
    assert side.settle()["bytes"] == buffer.nbytes
    expected[1000:1010] += 1.0
    assert torch.equal(buffer.cpu(), expected) and torch.equal(view.cpu(), expected[1000:1010])
