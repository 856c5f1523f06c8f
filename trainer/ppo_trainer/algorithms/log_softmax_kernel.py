"""The output layer's log-softmax, token log-prob and entropy in one read of the logits, and their
gradient in one more: two Triton kernels behind an autograd function, for logits on a GPU.

Over a 151,936-token vocabulary the logits of one chunk of rows are far larger than anything else
the step touches, so these passes are bound by memory traffic. The forward reads each row once,
keeping running (max, sum of exp, sum of exp * logit) per lane, and saves per row the logsumexp and
the expected logit; the backward reads the row once more and writes its gradient:

    p = softmax(x), x = logits / T
    d log p[token] / dx = onehot(token) - p
    d entropy / dx      = p * (E[x] - x)          (entropy = logsumexp(x) - E[x])

`torch.compile` of the same arithmetic (`ppo._log_softmax_chunk`) reads the logits several times.
"""

from __future__ import annotations

import functools

import torch

BLOCK = 4096
"""Logits a program reads at once along the vocabulary."""


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def forward(logits, stride, tokens, inverse_temperature, vocab, picked, entropy, lse_out, expected_out,
                with_entropy: tl.constexpr, block: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits + row * stride
        lanes = tl.arange(0, block)
        # Per-lane running maximum, sum of exp and sum of exp * x (rescaled when the maximum moves);
        # a finite floor rather than -inf keeps masked lanes free of inf - inf.
        high = tl.full((block,), -1e30, tl.float32)
        total = tl.zeros((block,), tl.float32)
        weighted = tl.zeros((block,), tl.float32)
        for start in range(0, vocab, block):
            inside = start + lanes < vocab
            x = tl.load(base + start + lanes, mask=inside, other=float("-inf")).to(tl.float32) * inverse_temperature
            new_high = tl.maximum(high, x)
            scale = tl.exp(high - new_high)
            e = tl.exp(x - new_high)
            total = total * scale + e
            if with_entropy:
                weighted = weighted * scale + e * tl.where(inside, x, 0.0)
            high = new_high
        peak = tl.max(high, axis=0)
        rescale = tl.exp(high - peak)
        sum_exp = tl.sum(total * rescale, axis=0)
        lse = peak + tl.log(sum_exp)
        token = tl.load(tokens + row).to(tl.int64)
        tl.store(picked + row, tl.load(base + token).to(tl.float32) * inverse_temperature - lse)
        tl.store(lse_out + row, lse)
        if with_entropy:
            expected = tl.sum(weighted * rescale, axis=0) / sum_exp
            tl.store(entropy + row, lse - expected)
            tl.store(expected_out + row, expected)

    @triton.jit
    def backward(logits, stride, grad_logits, grad_stride, tokens, inverse_temperature, vocab, lse_in, expected_in,
                 grad_picked, grad_entropy, with_entropy: tl.constexpr, block: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits + row * stride
        out = grad_logits + row * grad_stride
        lanes = tl.arange(0, block)
        lse = tl.load(lse_in + row)
        g_picked = tl.load(grad_picked + row)
        token = tl.load(tokens + row).to(tl.int64)
        if with_entropy:
            expected = tl.load(expected_in + row)
            g_entropy = tl.load(grad_entropy + row)
        for start in range(0, vocab, block):
            columns = start + lanes
            inside = columns < vocab
            x = tl.load(base + columns, mask=inside, other=0.0).to(tl.float32) * inverse_temperature
            p = tl.exp(x - lse)
            g = g_picked * (tl.where(columns == token, 1.0, 0.0) - p)
            if with_entropy:
                g += g_entropy * p * (expected - x)
            tl.store(out + columns, (g * inverse_temperature).to(out.dtype.element_ty), mask=inside)

    return forward, backward


class _FusedLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, tokens: torch.Tensor, temperature: float, with_entropy: bool):
        forward_kernel, _ = _kernels()
        rows, vocab = logits.shape
        picked, entropy, lse, expected = (torch.empty(rows, dtype=torch.float32, device=logits.device) for _ in range(4))
        if rows:
            forward_kernel[(rows,)](logits, logits.stride(0), tokens, 1.0 / temperature, vocab, picked, entropy, lse,
                                    expected, with_entropy=with_entropy, block=BLOCK, num_warps=8)
        ctx.save_for_backward(logits, tokens, lse, expected)
        ctx.temperature, ctx.with_entropy = temperature, with_entropy
        if not with_entropy:
            entropy.zero_()
            ctx.mark_non_differentiable(entropy)
        return picked, entropy

    @staticmethod
    def backward(ctx, grad_picked: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        _, backward_kernel = _kernels()
        logits, tokens, lse, expected = ctx.saved_tensors
        rows, vocab = logits.shape
        zeros = torch.zeros(rows, dtype=torch.float32, device=logits.device)
        grad_picked = zeros if grad_picked is None else grad_picked.float().contiguous()
        with_entropy = ctx.with_entropy and grad_entropy is not None
        grad_entropy = grad_entropy.float().contiguous() if with_entropy else zeros
        grad_logits = torch.empty_like(logits)
        if rows:
            backward_kernel[(rows,)](logits, logits.stride(0), grad_logits, grad_logits.stride(0), tokens,
                                     1.0 / ctx.temperature, vocab, lse, expected, grad_picked, grad_entropy,
                                     with_entropy=with_entropy, block=BLOCK, num_warps=8)
        return grad_logits, None, None, None


def fused_log_softmax(logits: torch.Tensor, tokens: torch.Tensor, temperature: float,
                      with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`ppo._log_softmax_chunk` for `[N, V]` logits on a GPU (any float dtype, rows contiguous):
    float32 `[N]` log-probs of `tokens` and entropies (zeros without `with_entropy`), differentiable
    in the logits."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return _FusedLogSoftmax.apply(logits, tokens.contiguous(), temperature, with_entropy)
