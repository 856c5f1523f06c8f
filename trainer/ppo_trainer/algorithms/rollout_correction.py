"""The rollout engine's and the trainer's log-probs of the same sampled tokens: how far apart, and a correction.

The engine samples with its own numerics (SGLang kernels, bf16) while the trainer recomputes the
log-probs of those tokens with its own (fp32, Megatron): ``pi_train`` is not exactly the
``pi_rollout`` that produced the data. `log_prob_mismatch` measures the gap on one rank's rows
as sums, `summarize_mismatch` combines the ranks' sums into the step's figures, and
`truncated_importance_weights` gives the per-token weights ``min(pi_train / pi_rollout, cap)``
that reweight the policy loss (truncated importance sampling: the tokens came from
``pi_rollout``, the PPO ratio is taken against ``pi_train``). Pure tensor functions; nothing here
may depend on Ray, process groups or configuration objects.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor

from ppo_trainer.algorithms.advantages import kl_penalty
from ppo_trainer.algorithms.ppo import LOG_RATIO_BOUND, _check_same_shape

__all__ = ["log_prob_mismatch", "summarize_mismatch", "truncated_importance_weights"]


def log_prob_mismatch(train_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Sums over the valid tokens of ``log_r = train_logp - rollout_logp`` (``[B, T]`` each).

    Returns float64 scalars {"tokens", "log_ratio_sum", "log_ratio_abs_max", "k3_sum"}, where k3 is the
    estimate of KL(pi_rollout || pi_train) per token (the tokens were sampled by the engine;
    `kl_penalty`'s k3, clamped the same way). Sums, so that ranks' parts combine exactly
    (`summarize_mismatch`).
    """
    _check_same_shape(train_logp=train_logp, rollout_logp=rollout_logp, mask=mask)
    valid = mask.bool()
    log_ratio = torch.where(valid, train_logp - rollout_logp, torch.zeros_like(train_logp)).double()
    k3 = kl_penalty(rollout_logp.double(), train_logp.double(), estimator="k3")
    return {
        "tokens": valid.sum().double(),
        "log_ratio_sum": log_ratio.sum(),
        "log_ratio_abs_max": log_ratio.abs().amax() if log_ratio.numel() else log_ratio.new_zeros(()),
        "k3_sum": torch.where(valid, k3, torch.zeros_like(k3)).sum(),
    }


def summarize_mismatch(parts: Iterable[Mapping[str, float | Tensor]]) -> dict[str, float]:
    """The step's figures from every rank's `log_prob_mismatch`: the mean log-ratio, the largest
    absolute log-ratio, and the mean k3 over all their tokens (0 when there were none). Ranks
    that hold the same rows (the model-parallel ranks of one data rank) weigh the same, which
    leaves the means and the maximum unchanged."""
    parts = [{key: float(value) for key, value in part.items()} for part in parts]
    tokens = sum(p["tokens"] for p in parts)
    return {
        "rollout_log_ratio_mean": sum(p["log_ratio_sum"] for p in parts) / tokens if tokens else 0.0,
        "rollout_log_ratio_abs_max": max((p["log_ratio_abs_max"] for p in parts), default=0.0),
        "rollout_k3": sum(p["k3_sum"] for p in parts) / tokens if tokens else 0.0,
    }


def truncated_importance_weights(train_logp: Tensor, rollout_logp: Tensor, mask: Tensor, *, cap: float) -> Tensor:
    """``min(exp(train_logp - rollout_logp), cap)`` per token, ``[B, T]``, detached, 0 on padding.

    `train_logp` are the trainer's log-probs of the sampled tokens before the update (PPO's
    ``old_logp``); the log-ratio is clamped to ``±LOG_RATIO_BOUND`` before ``exp``.
    """
    _check_same_shape(train_logp=train_logp, rollout_logp=rollout_logp, mask=mask)
    if not cap >= 1.0:
        raise ValueError(f"cap={cap} must be >= 1 (e.g. 2.0): weights above it are cut to it")
    log_ratio = torch.clamp(train_logp.detach() - rollout_logp, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    weights = torch.clamp(torch.exp(log_ratio), max=cap)
    return torch.where(mask.bool(), weights, torch.zeros_like(weights))
