"""The one host-memory mover: a set of device tensors parked in one pinned host buffer, and back.

Offload (training backends, through `parking.py`) and sleep (the built-in rollout engine) both park
tensors in host memory and bring them back with a `HostMirror`. It packs the caller's device tensors
into ONE pinned host buffer, locked at its exact size (`pinned_empty`) and allocated once per layout
and reused, since pinning costs far more than copying, and gives their device memory back in one of
two ways, chosen when the mirror is built:

- swapped (the default: the Torch backend, the engine): the caller swaps host views in for its
  tensors; bringing them back allocates one device buffer, copies the whole host buffer in one
  transfer and hands back views into it. While the tensors are still those views, the next offload
  is again one copy.
- in place (Megatron, whose parameters, gradients and optimizer shards are views into flat buffers
  that other objects hold): each tensor's storage is freed where it is and refilled on the way back,
  so every view into it stays valid. A tensor whose values need not survive (a gradient buffer,
  zeroed before use) is freed without a copy and comes back zeroed.

The stale-copy rule: a host copy is reused, nothing copied to the host, only when the caller says
the tensors are `unchanged` since this mirror brought them to the device (no training step, no
load since); a first offload or a new layout is always copied. A copy to the device runs by a
kernel on the GPU's cores or by its copy engines, whichever this mirror's wakes found faster
(`kernel_copy.py` says why). The copies themselves are timed with device events ("seconds");
waiting for them and releasing the freed device memory are timed apart ("sync_seconds"). On a CPU
device the host copy is the tensor itself and nothing moves. Must not depend on models, optimizers
or the PPO loop: callers decide which tensors to move.
"""

from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Callable

import torch

from ppo_trainer.offload.kernel_copy import WakeCopyPath, copy_from_host, path_name

ALIGNMENT = 512
"""Byte alignment of each tensor inside the flat buffers (vectorised kernels want 16 or more)."""


Put = Callable[[int, torch.Tensor], None]
"""`put(index, moved)`: the caller replaces its tensor number `index` with `moved`."""

Entry = tuple[int, torch.Size, torch.dtype]
"""Where one tensor's values lie in a flat buffer: (byte offset, shape, dtype)."""

Copy = Callable[..., int]
"""`copy(part, parts, *, by_kernel=False)`: queues that share of a staged copy to the device on the
current stream and returns its bytes (`HostMirror.stage_on_device`)."""


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

    Swapped (the default): `to_host(tensors, put)` and `to_device(tensors, put)` call
    `put(index, moved)` for each tensor that moves (the caller swaps it in, dropping its reference to
    the old one, before the freed device memory is released). In place (`in_place=True`):
    `to_host(tensors, keep=...)` frees each tensor's storage where it is, and `to_device()` refills
    the same tensors, which the mirror holds meanwhile. `last_transfer` describes the latest call:
    {"direction", "bytes", "seconds" (the copy on the device), "sync_seconds" (waiting for it and
    releasing device memory), "copies", "path" (of a copy to the device: "cores" or "engines",
    `WakeCopyPath`'s choice)}.
    """

    def __init__(self, *, device: str | torch.device, in_place: bool = False):
        self.device = torch.device(device)
        self.in_place = in_place
        self._host: torch.Tensor | None = None
        self._layout: list[Entry] = []
        self._device_flat: torch.Tensor | None = None
        """Swapped: the one device buffer the latest `to_device` allocated."""
        self._parked: list[tuple[torch.Tensor, int, Entry | None]] = []
        """In place: each parked tensor, its storage's bytes, and where its values lie (None: not kept)."""
        self.wake_path = WakeCopyPath()
        self.last_transfer: dict = {"direction": None, "bytes": 0, "seconds": 0.0, "sync_seconds": 0.0, "copies": 0,
                                    "path": None}

    @property
    def parked_bytes(self) -> int:
        """The bytes of the values the host buffer holds (alignment left out)."""
        return sum(_nbytes(entry) for entry in self._layout)

    def to_host(self, tensors: list[torch.Tensor], put: Put | None = None, *, keep: list[bool] | None = None,
                direction: str = "offload", unchanged: bool = False) -> None:
        """Host copies of the device tensors' values, and their device memory given back; tensors
        already on the host stay as they are.

        Swapped: `put(index, view)` swaps each for its view of the host buffer, and `tensors` is
        emptied before the freed device memory is released, so that it holds no reference to the
        device copies. In place (no `put`): each tensor's storage is freed where it is; `keep[index]`
        False marks one whose values need not survive (freed without a copy, zeroed on the way
        back). `unchanged`: nothing has written to the tensors since `to_device` brought them in, so
        the host buffer still holds their values: when they are laid out as it is (swapped: still
        that call's views), no copy is made (0 bytes recorded) and only the device memory is freed."""
        if (put is None) != self.in_place or (keep is not None and not self.in_place):
            raise ValueError("a swapping HostMirror takes `put` (and no `keep`); one built with in_place=True takes no `put`")
        if self._parked:
            raise RuntimeError("this HostMirror's tensors are parked already: bring them back (to_device) first")
        moving = [i for i, t in enumerate(tensors) if self.device.type != "cpu" and t.device.type != "cpu"]
        if not moving:
            self._record(direction, 0, 0.0, 0.0, 0)
            return
        started = time.perf_counter()
        kept = [i for i in moving if keep is None or keep[i]]
        layout = self._plan([tensors[i] for i in kept])
        fresh = self._host is None or layout != self._layout
        if fresh:
            self._host = None  # unpinned before the next one is locked
            self._host = pinned_empty(_size(layout), torch.uint8)
            self._layout = layout
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        copies = self._copy_to_host(tensors, kept, skip=unchanged and not fresh)
        end.record()
        if self.in_place:
            self._free_in_place(tensors, moving, kept)
        else:
            for i, entry in zip(moving, layout, strict=True):
                put(i, self._view(self._host, entry))
            self._device_flat = None
            tensors.clear()
        self._finish(direction, begin, end, started, copies, release=True, moved=copies > 0)

    def _copy_to_host(self, tensors: list[torch.Tensor], kept: list[int], *, skip: bool) -> int:
        """Queue the kept tensors' copies into the host buffer (none when `skip` and the host holds
        their values); returns how many copies."""
        flat = self._device_flat
        whole = not self.in_place and flat is not None and all(
            tensors[i].is_contiguous() and tensors[i].data_ptr() == flat.data_ptr() + offset
            for i, (offset, _, _) in zip(kept, self._layout, strict=True)
        )
        if skip and (whole or self.in_place):
            return 0
        if whole:
            self._host.copy_(flat, non_blocking=True)
            return 1
        for i, entry in zip(kept, self._layout, strict=True):
            self._view(self._host, entry).copy_(tensors[i], non_blocking=True)
        return len(kept)

    def _free_in_place(self, tensors: list[torch.Tensor], moving: list[int], kept: list[int]) -> None:
        """Each moving tensor's storage freed where it is, and held to be refilled; every size is read
        before any storage is freed (two tensors may share one)."""
        entries = dict(zip(kept, self._layout, strict=True))
        self._parked = [(tensors[i], tensors[i].untyped_storage().nbytes(), entries.get(i)) for i in moving]
        for tensor, _, _ in self._parked:
            tensor.untyped_storage().resize_(0)

    def to_device(self, tensors: list[torch.Tensor] | None = None, put: Put | None = None, *,
                  direction: str = "onload") -> None:
        """The parked tensors back on the device, their values in one call's copies. Swapped: the
        tensors (and `put`) as the caller has them now, device views of one buffer filled in one
        copy; anything `to_host` did not park stays put (tensors that live on the host for good,
        such as AdamW's unfused `step` counters). In place (no arguments): the tensors this mirror parked."""
        started = time.perf_counter()
        copies = sum(entry is not None for _, _, entry in self._parked) if self.in_place else 1
        copy = self.stage_on_device(tensors, put)
        if copy is None:
            self._record(direction, 0, 0.0, 0.0, 0)
            return
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        by_kernel = self.wake_path.by_kernel()
        begin.record()
        copy(0, 1, by_kernel=by_kernel)
        end.record()
        self._finish(direction, begin, end, started, copies, release=False, path=path_name(by_kernel))
        self.wake_path.observe(by_kernel, self.last_transfer["bytes"], self.last_transfer["seconds"])

    def stage_on_device(self, tensors: list[torch.Tensor] | None = None, put: Put | None = None) -> Copy | None:
        """`to_device` in two parts: the tensors' device memory now, their values when the returned
        function runs (`Copy`: `copy(part, parts)` queues that share on the current stream and
        returns its bytes; `SideStreamCopy` runs it beside other work; `by_kernel=True` copies by
        `kernel_copy.copy_from_host`, for a copy that nothing runs beside). Swapped: the device views
        of one buffer put in place at once, a share being a share of its bytes. In place: each parked
        tensor's storage given back, a share being the tensors that start in it. None when nothing
        is parked."""
        if (put is None) != self.in_place or (tensors is None) != self.in_place:
            raise ValueError("a swapping HostMirror takes the tensors and `put`; one built with in_place=True takes neither")
        return self._stage_in_place() if self.in_place else self._stage_swapped(tensors, put)

    def _stage_swapped(self, tensors: list[torch.Tensor], put: Put) -> Copy | None:
        host = self._host
        moving = [] if self.device.type == "cpu" or host is None else [
            i for i, t in enumerate(tensors)
            if t.device.type == "cpu" and t.untyped_storage().data_ptr() == host.untyped_storage().data_ptr()
        ]
        if not moving:
            return None
        flat = torch.empty(host.numel(), dtype=torch.uint8, device=self.device)
        by_offset = {entry[0]: entry for entry in self._layout}
        for i in moving:
            put(i, self._view(flat, by_offset[tensors[i].data_ptr() - host.data_ptr()]))
        self._device_flat = flat
        size = self.parked_bytes

        def copy(part: int, parts: int, *, by_kernel: bool = False) -> int:
            low, high = host.numel() * part // parts, host.numel() * (part + 1) // parts
            if by_kernel:
                copy_from_host(flat[low:high], host[low:high])
            else:
                flat[low:high].copy_(host[low:high], non_blocking=True)
            return size * (part + 1) // parts - size * part // parts

        return copy

    def _stage_in_place(self) -> Copy | None:
        parked, self._parked = self._parked, []
        if not parked:
            return None
        for tensor, size, _ in parked:
            tensor.untyped_storage().resize_(size)
        host = self._host
        starts = list(itertools.accumulate((_nbytes(entry) if entry else 0 for _, _, entry in parked), initial=0))

        def copy(part: int, parts: int, *, by_kernel: bool = False) -> int:
            share = [i for i, start in enumerate(starts[:-1]) if min(start * parts // max(starts[-1], 1), parts - 1) == part]
            for i in share:
                tensor, _, entry = parked[i]
                if entry is None:
                    tensor.zero_()
                elif by_kernel and tensor.is_contiguous():
                    copy_from_host(tensor, self._view(host, entry))
                else:
                    tensor.copy_(self._view(host, entry), non_blocking=True)
            return sum(starts[i + 1] - starts[i] for i in share)

        return copy

    def _plan(self, tensors: list[torch.Tensor]) -> list[Entry]:
        layout, offset = [], 0
        for tensor in tensors:
            layout.append((offset, tensor.shape, tensor.dtype))
            offset += _aligned(tensor.nbytes)
        return layout

    @staticmethod
    def _view(flat: torch.Tensor, entry: Entry) -> torch.Tensor:
        offset, shape, dtype = entry
        return flat[offset : offset + _nbytes(entry)].view(dtype).view(shape)

    def _finish(self, direction: str, begin, end, started: float, copies: int, *, release: bool,
                moved: bool = True, path: str | None = None) -> None:
        end.synchronize()
        if release:
            torch.cuda.empty_cache()
        copy_seconds = begin.elapsed_time(end) / 1e3
        total = time.perf_counter() - started
        size = self.parked_bytes if moved else 0
        self._record(direction, size, copy_seconds, max(0.0, total - copy_seconds), copies, path)

    def _record(self, direction: str, size: int, seconds: float, sync_seconds: float, copies: int,
                path: str | None = None) -> None:
        self.last_transfer = {
            "direction": direction, "bytes": size, "seconds": seconds, "sync_seconds": sync_seconds, "copies": copies,
            "path": path,
        }


def _nbytes(entry: Entry) -> int:
    _, shape, dtype = entry
    return shape.numel() * dtype.itemsize


def _size(layout: list[Entry]) -> int:
    """Bytes of a flat buffer holding `layout`."""
    return layout[-1][0] + _aligned(_nbytes(layout[-1])) if layout else 0
