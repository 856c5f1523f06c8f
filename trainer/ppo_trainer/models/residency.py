"""Moving a set of tensors between an accelerator and one flat pinned host buffer, and back.

Offload (training backends) and sleep (rollout engines) both park tensors in host memory and
bring them back. A `HostMirror` packs the caller's device tensors into ONE pinned buffer
(allocated once per layout and reused, since pinning costs far more than copying) and hands
back views into it; bringing them back allocates one device buffer, copies the whole pinned
buffer in one transfer, and hands back views into that. While the tensors are still those
views, the next offload is again one copy. The copies themselves are timed with device events
("seconds"); waiting for them and releasing the freed device memory are timed apart
("sync_seconds"). On a CPU device the host copy is the tensor itself and nothing moves.
Must not depend on models, optimizers or the PPO loop: callers decide which tensors to move.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable

import torch

ALIGNMENT = 512
"""Byte alignment of each tensor inside the flat buffers (vectorised kernels want 16 or more)."""


Put = Callable[[int, torch.Tensor], None]
"""`put(index, moved)`: the caller replaces its tensor number `index` with `moved`."""


def pinned_empty(shape: tuple[int, ...] | torch.Size | int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised host tensor whose pages are locked at its exact size.

    torch's own pinned allocator (`pin_memory=True`) rounds every allocation up to a power of two:
    a role's 43 GB of parked optimizer state would lock 64 GB of host memory. Here the pages are an
    ordinary host allocation registered with the driver (cudaHostRegister), unregistered when the
    tensor is collected. Keep the returned tensor itself for as long as its views are used.
    """
    tensor = torch.empty(shape, dtype=dtype)
    size = tensor.untyped_storage().nbytes()
    if size == 0:
        return tensor
    cudart = torch.cuda.cudart()
    error = cudart.cudaHostRegister(tensor.data_ptr(), size, 0)
    if int(error) != 0:
        raise RuntimeError(f"cudaHostRegister of {size / 1e9:.2f} GB of host memory failed (CUDA error {int(error)}):"
                           " the host may be out of lockable memory (ulimit -l) or of memory")
    weakref.finalize(tensor, cudart.cudaHostUnregister, tensor.data_ptr())
    return tensor


def _aligned(size: int) -> int:
    return (size + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


class HostMirror:
    """One flat pinned host buffer for one device's tensors; counts bytes and times each transfer.

    `to_host(tensors, put)` and `to_device(tensors, put)` call `put(index, moved)` for each
    tensor that moves (the caller swaps it in, dropping its reference to the old one, before the
    freed device memory is released); `last_transfer` describes the latest call: {"direction", "bytes", "seconds" (the copy on the
    device), "sync_seconds" (waiting for it and releasing device memory), "copies"}.
    """

    def __init__(self, *, device: str | torch.device):
        self.device = torch.device(device)
        self._host: torch.Tensor | None = None
        self._layout: list[tuple[int, torch.Size, torch.dtype]] = []
        self._device_flat: torch.Tensor | None = None
        self.last_transfer: dict = {"direction": None, "bytes": 0, "seconds": 0.0, "sync_seconds": 0.0, "copies": 0}

    def to_host(self, tensors: list[torch.Tensor], put: Put, *, direction: str = "offload") -> None:
        """Host views holding the device tensors' values; tensors already on the host stay as they are.

        `tensors` is emptied before the freed device memory is released, so that it holds no
        reference to the device copies."""
        moving = [i for i, t in enumerate(tensors) if self.device.type != "cpu" and t.device.type != "cpu"]
        if not moving:
            self._record(direction, 0, 0.0, 0.0, 0)
            return
        started = time.perf_counter()
        layout = self._plan([tensors[i] for i in moving])
        if self._host is None or layout != self._layout:
            total = layout[-1][0] + _aligned(_nbytes(layout[-1]))
            self._host = None  # unpinned before the next one is locked
            self._host = pinned_empty(total, torch.uint8)
            self._layout = layout
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        flat = self._device_flat
        whole = flat is not None and all(
            tensors[i].is_contiguous() and tensors[i].data_ptr() == flat.data_ptr() + offset
            for i, (offset, _, _) in zip(moving, layout, strict=True)
        )
        begin.record()
        if whole:
            self._host.copy_(flat, non_blocking=True)
            copies = 1
        else:
            for i, entry in zip(moving, layout, strict=True):
                self._view(self._host, entry).copy_(tensors[i], non_blocking=True)
            copies = len(moving)
        end.record()
        for i, entry in zip(moving, layout, strict=True):
            put(i, self._view(self._host, entry))
        self._device_flat = flat = None
        tensors.clear()
        self._finish(direction, begin, end, started, copies, release=True)

    def to_device(self, tensors: list[torch.Tensor], put: Put, *, direction: str = "onload") -> None:
        """Device views of the tensors that `to_host` parked (in one copy); anything else stays
        put (tensors that live on the host for good, such as AdamW's unfused `step` counters)."""
        host = self._host
        moving = [] if self.device.type == "cpu" or host is None else [
            i for i, t in enumerate(tensors)
            if t.device.type == "cpu" and t.untyped_storage().data_ptr() == host.untyped_storage().data_ptr()
        ]
        if not moving:
            self._record(direction, 0, 0.0, 0.0, 0)
            return
        started = time.perf_counter()
        flat = torch.empty(host.numel(), dtype=torch.uint8, device=self.device)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        flat.copy_(host, non_blocking=True)
        end.record()
        by_offset = {entry[0]: entry for entry in self._layout}
        for i in moving:
            put(i, self._view(flat, by_offset[tensors[i].data_ptr() - host.data_ptr()]))
        self._device_flat = flat
        self._finish(direction, begin, end, started, 1, release=False)

    def _plan(self, tensors: list[torch.Tensor]) -> list[tuple[int, torch.Size, torch.dtype]]:
        layout, offset = [], 0
        for tensor in tensors:
            layout.append((offset, tensor.shape, tensor.dtype))
            offset += _aligned(tensor.nbytes)
        return layout

    @staticmethod
    def _view(flat: torch.Tensor, entry: tuple[int, torch.Size, torch.dtype]) -> torch.Tensor:
        offset, shape, dtype = entry
        return flat[offset : offset + _nbytes(entry)].view(dtype).view(shape)

    def _finish(self, direction: str, begin, end, started: float, copies: int, *, release: bool) -> None:
        end.synchronize()
        if release:
            torch.cuda.empty_cache()
        copy_seconds = begin.elapsed_time(end) / 1e3
        total = time.perf_counter() - started
        self._record(direction, sum(_nbytes(e) for e in self._layout), copy_seconds, max(0.0, total - copy_seconds), copies)

    def _record(self, direction: str, size: int, seconds: float, sync_seconds: float, copies: int) -> None:
        self.last_transfer = {
            "direction": direction, "bytes": size, "seconds": seconds, "sync_seconds": sync_seconds, "copies": copies,
        }


def _nbytes(entry: tuple[int, torch.Size, torch.dtype]) -> int:
    _, shape, dtype = entry
    return shape.numel() * dtype.itemsize
