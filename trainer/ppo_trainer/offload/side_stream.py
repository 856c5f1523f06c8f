"""The optimizer state's copy back to the device on a stream of its own, beside a training pass.

A `SideStreamCopy` queues the host-to-device copies that `HostMirror.stage_on_device` prepared on a
stream of its own, so that compute runs beside them. Must not depend on models, optimizers or the
PPO loop.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


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
