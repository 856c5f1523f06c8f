"""A host-to-device copy run by the GPU's cores (a kernel reading pinned host memory over the bus)
instead of its copy engines.

The driver clears the device memory a process releases on the copy engines before another process
may use it. A role waking on a GPU shared by turns allocates what the last role just released, and
an ordinary copy (`Tensor.copy_`, on the copy engines) then runs beside that clearing: 56% of the
pinned bandwidth right after another process released 40 GB, 88% after 10 GB
(`bench/gpu_memory_handover.py`). This kernel reads the host memory itself at about 90% of the
pinned bandwidth (49.3 against 55.1 GB/s on an H100), released memory or not. It occupies the cores,
so it is for copies that nothing else waits beside (a role's wake), not for copies beside compute.
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
