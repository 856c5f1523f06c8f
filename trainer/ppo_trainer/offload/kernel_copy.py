"""A host-to-device copy run by the GPU's cores (a kernel reading pinned host memory over the bus)
instead of its copy engines.

The driver clears the device memory a process releases on the copy engines before another process
may use it. A role waking on a GPU shared by turns allocates what the last role just released, and
an ordinary copy (`Tensor.copy_`, on the copy engines) then runs beside that clearing: 56% of the
pinned bandwidth right after another process released 40 GB, 88% after 10 GB
(`bench/gpu_memory_handover.py`). This kernel reads the host memory itself at about 90% of the
pinned bandwidth (49.3 against 55.1 GB/s on an H100), released memory or not. It occupies the cores,
so it is for copies that nothing else waits beside (a role's wake), not for copies beside compute.
Not on every host: on another H100 host the same kernel read at 45-47% of the pinned bandwidth, so
`WakeCopyPath` picks the path by the process's own wakes.
"""

from __future__ import annotations

import functools

import torch

BLOCK = 4096
"""Words (8 bytes) a program copies; 1024 to 16384 copied at the same 49.3 GB/s on an H100."""


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def copy_words(source, target, words, block: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * block + tl.arange(0, block)
        inside = offsets < words
        tl.store(target + offsets, tl.load(source + offsets, mask=inside), mask=inside)

    return copy_words, triton.cdiv


def copy_from_host(target: torch.Tensor, source: torch.Tensor) -> None:
    """`target.copy_(source)` for a contiguous CUDA `target` and a contiguous pinned host `source`
    of the same bytes, queued on the current stream: the 8-byte words by the kernel, a tail of
    fewer than 8 bytes (or tensors not aligned to 16 bytes) by `Tensor.copy_`."""
    if target.nbytes != source.nbytes or not (target.is_contiguous() and source.is_contiguous()):
        raise ValueError(f"copy_from_host needs two contiguous tensors of the same bytes; got {target.nbytes} "
                         f"and {source.nbytes} bytes")
    if (target.data_ptr() | source.data_ptr()) % 16:
        target.copy_(source, non_blocking=True)
        return
    flat_target, flat_source = target.view(-1).view(torch.uint8), source.view(-1).view(torch.uint8)
    words = target.nbytes // 8
    if words:
        copy_words, cdiv = _kernel()
        copy_words[(cdiv(words, BLOCK),)](flat_source[: words * 8].view(torch.int64),
                                          flat_target[: words * 8].view(torch.int64), words, block=BLOCK)
    if words * 8 < target.nbytes:
        flat_target[words * 8 :].copy_(flat_source[words * 8 :], non_blocking=True)


class WakeCopyPath:
    """Which path a wake's host-to-device copy takes, learnt from one mover's own wakes: the GPU's
    cores (`copy_from_host`) or its copy engines (`Tensor.copy_`).

    The first wake goes by the cores, the second by the copy engines; each later wake takes the
    path whose latest copy ran faster, and every `RECHECK`-th wake the other one, so that a change
    of conditions is seen. A wake of fewer than `MIN_BYTES` teaches nothing (its rate is mostly
    launch latency)."""

    RECHECK = 16
    MIN_BYTES = 1 << 26

    def __init__(self) -> None:
        self._rates: dict[bool, float] = {}
        self._wakes = 0

    def by_kernel(self) -> bool:
        """The next wake's path: True for the cores, False for the copy engines."""
        if len(self._rates) < 2:
            return True not in self._rates
        faster = self._rates[True] >= self._rates[False]
        return faster != (self._wakes % self.RECHECK == 0)

    def observe(self, by_kernel: bool, nbytes: int, seconds: float) -> None:
        """A wake's copy of `nbytes` by that path took `seconds` on the device."""
        if nbytes >= self.MIN_BYTES and seconds > 0:
            self._rates[by_kernel] = nbytes / seconds
            self._wakes += 1


def path_name(by_kernel: bool) -> str:
    """How transfer records name a path."""
    return "cores" if by_kernel else "engines"
