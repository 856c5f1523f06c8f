"""PPO losses and the masked reductions they stand on, as pure tensor functions.

Shapes: ``B`` = batch, ``T`` = response length (right-padded), ``V`` = vocabulary. A ``mask`` is a
float or bool tensor ``[B, T]`` with 1 on real response tokens. Every function takes tensors and
explicit keyword hyperparameters and returns tensors; nothing here may depend on Ray, process
groups, devices chosen at run time, or configuration objects. The losses reduce their per-token
terms with `aggregation.aggregate_loss` over the counts of the whole batch (by default the
batch given: a plain mean), so micro-batches of one batch add up to that batch's loss.
"""

from __future__ import annotations

import functools

import torch
import torch.utils.checkpoint
from torch import Tensor

from ppo_trainer.algorithms.aggregation import TOKEN_MEAN, BatchCounts, aggregate_loss, batch_counts
from ppo_trainer.algorithms.log_softmax_kernel import fused_log_softmax

__all__ = [
    "LOG_RATIO_BOUND",
    "chunked_log_probs_and_entropy",
    "entropy_from_logits",
    "log_probs_from_logits",
    "masked_mean",
    "masked_moments",
    "masked_sum",
    "masked_whiten",
    "policy_loss",
    "value_loss",
]

LOG_RATIO_BOUND = 20.0
"""Log-ratios of two policies' token probabilities are clamped to [-20, 20] before ``exp``:
exp(20) ~ 4.9e8 is finite in float32 and bfloat16, where exp overflows past ~88. Beyond the
bound a token's gradient is 0: with A > 0 PPO's clip gives 0 there anyway; with A < 0 it would
be ~A * exp(log-ratio), the overflow itself (the dual clip bounds such tokens too)."""


def _check_same_shape(**tensors: Tensor) -> None:
    """Raise ValueError naming the arguments when the given tensors differ in shape."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
        raise ValueError(f"shape mismatch: {listed}; these tensors must all have the same shape")


def _zero_padding(mask: Tensor, *tensors: Tensor) -> tuple[Tensor, ...]:
    """The tensors with 0 where the mask is 0, so that NaN or inf on padding reaches neither a loss
    nor, through the operations after this one, its gradient."""
    valid = mask.bool()
    return tuple(torch.where(valid, t, torch.zeros_like(t)) for t in tensors)


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` over the entries where ``mask`` is nonzero (weighted by a float mask).

    x, mask: same shape. Returns a scalar (``dim=None``) or ``x`` reduced over ``dim``.
    Entries outside the mask never contribute, even when they are NaN or inf.
    """
    _check_same_shape(x=x, mask=mask)
    weighted = torch.where(mask.bool(), x * mask.to(x.dtype), torch.zeros_like(x))
    return weighted.sum() if dim is None else weighted.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over the entries where ``mask`` is nonzero; 0 where the mask is empty.

    x, mask: same shape. Returns a scalar (``dim=None``) or ``x`` reduced over ``dim``.
    """
    total = masked_sum(x, mask, dim)
    count = masked_sum(torch.ones_like(x), mask, dim)
    return torch.where(count > 0, total / count.clamp(min=torch.finfo(total.dtype).tiny), 0.0)


def masked_moments(x: Tensor, mask: Tensor) -> Tensor:
    """``[count, sum, sum of squares]`` of ``x``'s masked entries, float64 ``[3]``.

    Moments of parts of a batch add up to the moments of the whole (so data-parallel ranks can
    sum theirs and whiten with the whole batch's mean and variance: `masked_whiten(moments=...)`).
    """
    _check_same_shape(x=x, mask=mask)
    valid = mask.bool()
    values = torch.where(valid, x, torch.zeros_like(x)).double()
    return torch.stack([valid.sum().double(), values.sum(), (values * values).sum()])


def masked_whiten(
    x: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = 1e-8, moments: Tensor | None = None
) -> Tensor:
    """Normalize ``x`` to zero mean and unit variance over its masked entries.

    x, mask: ``[B, T]`` (any equal shapes). Mean and (population) variance are taken over all
    valid entries together, in float64, from `moments` (`masked_moments` of the whole batch, when
    ``x`` is one shard of it) or else from ``x`` itself. ``shift_mean=False`` keeps the original
    mean and only rescales. Returns the same shape as ``x`` with zeros where the mask is 0.
    """
    count, total, squares = (masked_moments(x, mask) if moments is None else moments.double()).tolist()
    mean = total / count if count > 0 else 0.0
    var = max(squares / count - mean * mean, 0.0) if count > 0 else 0.0
    whitened = (x - mean) * (var + eps) ** -0.5
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps: float,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
    aggregation: str = TOKEN_MEAN,
    counts: BatchCounts | None = None,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate loss, with asymmetric clipping and optional dual clip.

    logp, old_logp, advantages, mask: ``[B, T]``. The ratio ``r = exp(logp - old_logp)``, its
    log clamped to ``±LOG_RATIO_BOUND``, is clipped to ``[1 - clip_eps, 1 + clip_eps_high]``
    (``clip_eps_high`` defaults to ``clip_eps``):

        pg_loss1 = -A * r
        pg_loss2 = -A * clip(r, 1 - clip_eps, 1 + clip_eps_high)
        pg_loss  = max(pg_loss1, pg_loss2)

    Dual clip (``dual_clip = c > 1``) bounds the loss of tokens with ``A < 0`` at ``-c * A``:
    ``pg_loss3 = -c * A``; ``pg_loss = min(pg_loss, pg_loss3)`` where ``A < 0``.
    ``token_weights`` ``[B, T]`` (constants, e.g. `truncated_importance_weights`) multiply each
    token's ``pg_loss``.

    Returns ``aggregate_loss(pg_loss, mask, mode=aggregation, counts=counts)`` (a scalar; `counts`
    of the whole batch when ``logp`` is one micro-batch of it, by default this batch's own) and
    detached scalar statistics, each this batch's part of a token mean over ``counts.tokens``:
    ``clipfrac`` (tokens where the clipped term was chosen), ``approx_kl`` (k3 estimate of
    KL(old || new) on the sampled tokens), ``dual_clipfrac`` (tokens bounded by the dual clip).
    """
    _check_same_shape(logp=logp, old_logp=old_logp, advantages=advantages, mask=mask)
    if clip_eps_high is None:
        clip_eps_high = clip_eps
    if clip_eps <= 0 or clip_eps_high <= 0:
        raise ValueError(
            f"clip_eps={clip_eps} and clip_eps_high={clip_eps_high} must both be > 0 (e.g. 0.2 and 0.28)"
        )
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip={dual_clip} must be > 1 (e.g. 3.0), or None to disable the dual clip")
    counts = batch_counts(mask) if counts is None else counts
    logp, old_logp, advantages = _zero_padding(mask, logp, old_logp, advantages)

    log_ratio = torch.clamp(logp - old_logp, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps_high)
    pg_loss_clipped = torch.maximum(pg_loss1, pg_loss2)

    if dual_clip is not None:
        pg_loss3 = -advantages * dual_clip
        dual_clipped = (advantages < 0) & (pg_loss_clipped > pg_loss3)
        pg_loss = torch.where(dual_clipped, pg_loss3, pg_loss_clipped)
    else:
        dual_clipped = torch.zeros_like(mask, dtype=torch.bool)
        pg_loss = pg_loss_clipped
    if token_weights is not None:
        _check_same_shape(logp=logp, token_weights=token_weights)
        pg_loss = pg_loss * _zero_padding(mask, token_weights.detach())[0]

    loss = aggregate_loss(pg_loss, mask, mode=aggregation, counts=counts)
    with torch.no_grad():
        stats = {
            "clipfrac": aggregate_loss((pg_loss2 > pg_loss1).to(logp.dtype), mask, mode=TOKEN_MEAN, counts=counts),
            "approx_kl": aggregate_loss((ratio - 1.0) - log_ratio, mask, mode=TOKEN_MEAN, counts=counts),
            "dual_clipfrac": aggregate_loss(dual_clipped.to(logp.dtype), mask, mode=TOKEN_MEAN, counts=counts),
        }
    return loss, stats


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip_range: float | None,
    aggregation: str = TOKEN_MEAN,
    counts: BatchCounts | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss: ``0.5 * max((v - R)^2, (v_clipped - R)^2)``, aggregated like `policy_loss`.

    values, old_values, returns, mask: ``[B, T]``. ``v_clipped = old + clamp(v - old, -c, c)``
    with ``c = clip_range``; ``clip_range=None`` gives the plain ``0.5 * (v - R)^2``.
    Returns ``aggregate_loss`` of the per-token loss (`counts` of the whole batch, by default
    this one's) and detached statistics: ``clipfrac`` (tokens where the clipped term was the
    larger one; this batch's part of a token mean over ``counts.tokens``).
    """
    _check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    counts = batch_counts(mask) if counts is None else counts
    values, old_values, returns = _zero_padding(mask, values, old_values, returns)
    v_loss_unclipped = (values - returns) ** 2
    if clip_range is None:
        v_loss_max = v_loss_unclipped
        clipped = torch.zeros_like(values, dtype=torch.bool)
    else:
        if clip_range <= 0:
            raise ValueError(f"clip_range={clip_range} must be > 0 (e.g. 0.2), or None for no clipping")
        v_clipped = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
        v_loss_clipped = (v_clipped - returns) ** 2
        v_loss_max = torch.maximum(v_loss_unclipped, v_loss_clipped)
        clipped = v_loss_clipped > v_loss_unclipped
    loss = 0.5 * aggregate_loss(v_loss_max, mask, mode=aggregation, counts=counts)
    with torch.no_grad():
        stats = {"clipfrac": aggregate_loss(clipped.to(values.dtype), mask, mode=TOKEN_MEAN, counts=counts)}
    return loss, stats


def _at_least_float32(logits: Tensor) -> Tensor:
    return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical distribution given by ``logits``: ``[B, T, V] -> [B, T]``.

    Computed in at least float32; tokens with ``-inf`` logits (probability 0) contribute 0.
    """
    logits = _at_least_float32(logits)
    logp = torch.log_softmax(logits, dim=-1)
    p = logp.exp()
    return -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(dim=-1)


def log_probs_from_logits(logits: Tensor, tokens: Tensor) -> Tensor:
    """Log-probability of each token under ``logits``: ``[B, T, V], [B, T] -> [B, T]``.

    ``log_softmax(logits)[b, t, tokens[b, t]]``, computed stably as the gathered logit minus the
    logsumexp over the vocabulary, in at least float32, without materialising the full
    log-softmax.
    """
    if tuple(tokens.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"tokens have shape {tuple(tokens.shape)}; expected {tuple(logits.shape[:-1])}, "
            f"the logits' shape {tuple(logits.shape)} without its vocabulary dimension"
        )
    logits = _at_least_float32(logits)
    picked = torch.gather(logits, dim=-1, index=tokens.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def _log_softmax_chunk(logits: Tensor, tokens: Tensor, temperature: float, with_entropy: bool) -> tuple[Tensor, Tensor]:
    logits = _at_least_float32(logits)
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    picked = torch.gather(logits, dim=-1, index=tokens.long().unsqueeze(-1)).squeeze(-1) - lse
    if not with_entropy:
        return picked, torch.zeros_like(picked)
    expected = (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)
    return picked, lse - expected


@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=True)


def chunked_log_probs_and_entropy(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = True,
    chunk_size: int = 2048,
    compiled: bool = False,
    kept_logits_bytes: int = 0,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs of ``tokens`` and entropies under an output layer, never holding all the logits.

    hidden ``[N, H]``, weight ``[V, H]`` (bias ``[V]``), tokens ``[N]`` -> (``[N]`` log-probs,
    ``[N]`` entropies or None), in at least float32, for ``logits = (hidden @ weight.T + bias) / temperature``:
    the same numbers as ``log_probs_from_logits`` and ``entropy_from_logits`` on those logits (the
    logits of a finite linear layer: no ``-inf`` entries). Rows go ``chunk_size`` at a time. When
    gradients are needed, the chunks' logits are kept for the backward while they fit in
    ``kept_logits_bytes`` (in the hidden states' dtype); every later chunk is checkpointed, its
    logits recomputed in the backward (an extra third of the output layer's matmuls), so beyond
    the budget at most one chunk's ``[chunk_size, V]`` logits exist at once. On a GPU each chunk's
    log-softmax, log-probs and entropies take one read of its logits (and their gradient one more:
    `log_softmax_kernel.py`); on a CPU ``compiled`` runs them through ``torch.compile`` (one fused
    pass instead of a kernel per operation). Both give the same numbers up to float rounding.
    """
    if hidden.dim() != 2 or tokens.shape != hidden.shape[:1]:
        raise ValueError(
            f"hidden must be [N, H] and tokens [N]; got hidden {tuple(hidden.shape)}, tokens {tuple(tokens.shape)}"
        )
    if not temperature > 0 or chunk_size < 1:
        raise ValueError(f"temperature must be > 0 and chunk_size >= 1; got {temperature} and {chunk_size}")
    track = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    if hidden.is_cuda:
        log_softmax_chunk = fused_log_softmax
    else:
        log_softmax_chunk = _compiled(_log_softmax_chunk) if compiled else _log_softmax_chunk

    def head_chunk(rows: Tensor, chunk_tokens: Tensor) -> tuple[Tensor, Tensor]:
        logits = torch.nn.functional.linear(rows, weight, bias)
        return log_softmax_chunk(logits, chunk_tokens, temperature, with_entropy)

    log_probs, entropies = [], []
    kept = 0
    for start in range(0, hidden.shape[0], chunk_size):
        rows, chunk_tokens = hidden[start : start + chunk_size], tokens[start : start + chunk_size]
        logits_bytes = rows.shape[0] * weight.shape[0] * rows.element_size()
        if track and kept + logits_bytes > kept_logits_bytes:
            picked, entropy = torch.utils.checkpoint.checkpoint(head_chunk, rows, chunk_tokens, use_reentrant=False)
        else:
            kept += logits_bytes if track else 0
            picked, entropy = head_chunk(rows, chunk_tokens)
        log_probs.append(picked)
        entropies.append(entropy)
    if not log_probs:
        empty = _at_least_float32(hidden.new_zeros(0))
        return empty, (empty if with_entropy else None)
    return torch.cat(log_probs), (torch.cat(entropies) if with_entropy else None)
