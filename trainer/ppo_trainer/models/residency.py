"""Moving a set of tensors between an accelerator and one flat pinned host buffer, and back.

Offload (training backends) and sleep (rollout engines) both park tensors in host memory and
bring them back. A `HostMirror` packs the caller's device tensors into ONE pinned buffer
(allocated once per layout and reused, since pinning costs far more than copying) and hands
back views into it; bringing them back allocates one device buffer, copies the whole pinned
buffer in one transfer (by a kernel on the GPU's cores or by its copy engines, whichever this
mirror's wakes found faster: `kernel_copy.py` says why), and hands back views into that. While
the tensors are still those views, the next offload is again one copy. The copies themselves are timed with device events
("seconds"); waiting for them and releasing the freed device memory are timed apart
("sync_seconds"). On a CPU device the host copy is the tensor itself and nothing moves.
A `SideStreamCopy` queues copies on a stream of their own, so that compute runs beside them.
Must not depend on models, optimizers or the PPO loop: callers decide which tensors to move.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable

import torch

from ppo_trainer.models.kernel_copy import WakeCopyPath, copy_from_host, path_name

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
    device), "sync_seconds" (waiting for it and releasing device memory), "copies", "path" (of a
    copy to the device: "cores" or "engines", `WakeCopyPath`'s choice)}.
    """

    def __init__(self, *, device: str | torch.device):
        self.device = torch.device(device)
        self._host: torch.Tensor | None = None
        self._layout: list[tuple[int, torch.Size, torch.dtype]] = []
        self._device_flat: torch.Tensor | None = None
        self.wake_path = WakeCopyPath()
        self.last_transfer: dict = {"direction": None, "bytes": 0, "seconds": 0.0, "sync_seconds": 0.0, "copies": 0,
                                    "path": None}

    def to_host(self, tensors: list[torch.Tensor], put: Put, *, direction: str = "offload",
                unchanged: bool = False) -> None:
        """Host views holding the device tensors' values; tensors already on the host stay as they are.

        `unchanged`: nothing has written to the tensors since `to_device` brought them in, so
        the host buffer still holds their values: when they are still that call's views, no copy
        is made (0 bytes recorded) and only the device memory is freed. `tensors` is emptied
        before the freed device memory is released, so that it holds no reference to the device copies."""
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
        moved = not (whole and unchanged)
        if whole and unchanged:
            copies = 0
        elif whole:
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
        self._finish(direction, begin, end, started, copies, release=True, moved=moved)

    def to_device(self, tensors: list[torch.Tensor], put: Put, *, direction: str = "onload") -> None:
        """Device views of the tensors that `to_host` parked (in one copy); anything else stays
        put (tensors that live on the host for good, such as AdamW's unfused `step` counters)."""
        started = time.perf_counter()
        copy = self.stage_on_device(tensors, put)
        if copy is None:
            self._record(direction, 0, 0.0, 0.0, 0)
            return
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        by_kernel = self.wake_path.by_kernel()
        begin.record()
        copy(0, 1, by_kernel=by_kernel)
        end.record()
        self._finish(direction, begin, end, started, 1, release=False, path=path_name(by_kernel))
        self.wake_path.observe(by_kernel, self.last_transfer["bytes"], self.last_transfer["seconds"])

    def stage_on_device(self, tensors: list[torch.Tensor], put: Put) -> Callable[[int, int], int] | None:
        """`to_device` in two parts: the device views are put in place now, their values arrive
        when the returned function runs (`copy(part, parts)` queues that share of the one buffer's
        copy on the current stream and returns its bytes; `SideStreamCopy` runs it beside other
        work; `by_kernel=True` copies by `kernel_copy.copy_from_host`, for a copy that nothing runs
        beside). None when nothing is parked."""
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
        size = sum(_nbytes(e) for e in self._layout)

        def copy(part: int, parts: int, *, by_kernel: bool = False) -> int:
            low, high = host.numel() * part // parts, host.numel() * (part + 1) // parts
            if by_kernel:
                copy_from_host(flat[low:high], host[low:high])
            else:
                flat[low:high].copy_(host[low:high], non_blocking=True)
            return size * (part + 1) // parts - size * part // parts

        return copy

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

    def _finish(self, direction: str, begin, end, started: float, copies: int, *, release: bool,
                moved: bool = True, path: str | None = None) -> None:
        end.synchronize()
        if release:
            torch.cuda.empty_cache()
        copy_seconds = begin.elapsed_time(end) / 1e3
        total = time.perf_counter() - started
        size = sum(_nbytes(e) for e in self._layout) if moved else 0
        self._record(direction, size, copy_seconds, max(0.0, total - copy_seconds), copies, path)

    def _record(self, direction: str, size: int, seconds: float, sync_seconds: float, copies: int,
                path: str | None = None) -> None:
        self.last_transfer = {
            "direction": direction, "bytes": size, "seconds": seconds, "sync_seconds": sync_seconds, "copies": copies,
            "path": path,
        }


def _nbytes(entry: tuple[int, torch.Size, torch.dtype]) -> int:
    _, shape, dtype = entry
    return shape.numel() * dtype.itemsize


class SideStreamCopy:
    """Host-to-device copies run on a stream of their own, beside compute queued on the current
    stream (a training pass beside its optimizer state's onload). `prepare` takes the function that
    queues them, right after the caller allocated their device memory: they will wait for the work
    queued before that point (whose memory the allocation may reuse), not for what is queued after.
    The function queues one of several parts (`copy(part, parts)`, returning its bytes). A
    training pass calls `split(micro_batches)` and then `advance` once a micro-batch, after the
    micro-batch's own host-to-device copies (which would otherwise wait behind the whole copy on
    the copy engine): the copy goes in parts of at most PART_BYTES beside the last micro-batches,
    one part each, so that each part is short beside a micro-batch's passes and the optimizer
    state's memory is filled late. `wait` queues what is left and makes the current stream wait
    for it (no host wait); `settle` waits on the host and returns the transfer's record. On a CPU
    the parts run as they are queued.
    """

    PART_BYTES = 2 * 2**30
    """At most this much a part: about 40 ms at the H200's pinned bandwidth, well under one
    micro-batch's passes of workload A (0.5B) or B (3B)."""

    def __init__(self, *, device: str | torch.device):
        self.device = torch.device(device)
        self._stream: torch.cuda.Stream | None = None
        self._copy: Callable[[int, int], int] | None = None
        self._size = 0
        self._ready: torch.cuda.Event | None = None
        self._parts, self._next, self._skip = 1, 0, 0
        self._queued: list[tuple[torch.cuda.Event, torch.cuda.Event] | None] = []
        self._bytes = 0

    def prepare(self, copy: Callable[[int, int], int], size: int) -> None:
        """`copy(part, parts)` queues that part of the copies (`size` bytes in all) and returns its
        bytes; one part, queued by the first `advance`, unless `split`."""
        self._ready = None
        if self.device.type == "cuda":
            self._ready = torch.cuda.Event()
            self._ready.record()
        self._copy, self._size, self._parts, self._next, self._skip = copy, size, 1, 0, 0

    def split(self, steps: int) -> None:
        """`advance` will be called `steps` times: the prepared copy, none of it queued yet, goes in
        parts of at most PART_BYTES (at most `steps` of them) beside the last calls; no-op when
        none is prepared."""
        if self._copy is not None and self._next == 0:
            steps = max(1, steps)
            self._parts = min(steps, max(1, -(-self._size // self.PART_BYTES)))
            self._skip = steps - self._parts

    def advance(self) -> None:
        """Queue the next part on the side stream (once the calls that `split` leaves out have
        passed); no-op when none is left."""
        if self._copy is None:
            return
        if self._skip > 0:
            self._skip -= 1
            return
        part, parts, copy = self._next, self._parts, self._copy
        self._next += 1
        if self._next == parts:
            self._copy = None
        if self._ready is None:
            self._bytes += copy(part, parts)
            self._queued.append(None)
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        if part == 0:
            self._stream.wait_event(self._ready)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._stream):
            begin.record()
            self._bytes += copy(part, parts)
            end.record()
        self._queued.append((begin, end))

    def wait(self) -> None:
        """Work queued from now on on the current stream runs after the copies (every part queued)."""
        self._skip = 0
        while self._copy is not None:
            self.advance()
        if self._queued and self._queued[-1] is not None:
            torch.cuda.current_stream().wait_event(self._queued[-1][1])

    def settle(self, default: dict | None = None) -> dict | None:
        """Wait until the copies are done (queued if they were not); their record as
        `HostMirror.last_transfer` gives one ("seconds": the parts' copies on the device, summed), or
        `default` when none was prepared."""
        self.wait()
        if not self._queued:
            return default
        queued, size = self._queued, self._bytes
        self._queued, self._bytes = [], 0
        seconds = 0.0
        for events in queued:
            if events is not None:
                events[1].synchronize()
                seconds += events[0].elapsed_time(events[1]) / 1e3
        return {"direction": "onload", "bytes": size, "seconds": seconds, "sync_seconds": 0.0, "path": "engines",
                "beside_compute": True}
