"""Per-token rewards (sequence score plus KL shaping) and GAE advantages and returns.

One reward definition for both roles: ``kl_shaped_rewards`` turns sequence scores into per-token
rewards (``-kl_coef * KL`` at every response token, plus the score at the last one), and those
SAME rewards feed ``gae``, which yields both the actor's advantages and the critic's returns
(``returns = advantages + values``). The seed framework trained the critic on returns without the
KL term while the actor's advantages had it; computing both from one reward tensor makes that
mismatch impossible. A custom advantage function receives these same rewards.

Shapes: ``B`` = batch, ``T`` = response length (right-padded); ``mask`` is float or bool
``[B, T]`` with 1 on real response tokens. Pure tensor functions: nothing here may depend on Ray,
devices chosen at run time, or configuration objects.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ppo_trainer.algorithms.ppo import LOG_RATIO_BOUND, _check_same_shape

__all__ = ["K3_BOUND", "KL_ESTIMATORS", "gae", "kl_penalty", "kl_shaped_rewards"]

KL_ESTIMATORS = ("k1", "k2", "k3")
"""Schulman's estimators of KL(pi || ref) from tokens sampled from pi."""

K3_BOUND = 10.0
"""The k3 estimate of one token is at most 10 nats: past a log-ratio of ~88 its ``exp`` overflows
float32 (the reward and the advantages would be -inf, or NaN with klCoef 0), and one token far
off the reference should not outweigh every score in the batch."""


def kl_penalty(logp: Tensor, ref_logp: Tensor, *, estimator: str) -> Tensor:
    """Per-token estimate of KL(pi || ref) from log-probs of tokens sampled from pi.

    logp, ref_logp: ``[B, T]`` -> ``[B, T]``. With ``log_r = ref_logp - logp``:

        k1 = -log_r                   (unbiased, high variance, can be negative)
        k2 = 0.5 * log_r ** 2         (biased, low variance, >= 0)
        k3 = exp(log_r) - log_r - 1   (unbiased, low variance, >= 0)

    For k3, ``log_r`` is clamped to ``±LOG_RATIO_BOUND`` and the estimate to at most ``K3_BOUND``,
    so it stays finite (and its gradient too) for any finite log-probs.
    """
    _check_same_shape(logp=logp, ref_logp=ref_logp)
    log_r = ref_logp - logp
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    if estimator == "k3":
        log_r = torch.clamp(log_r, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        return torch.clamp(torch.expm1(log_r) - log_r, max=K3_BOUND)  # exp(x) - 1 - x, accurate near x = 0
    raise ValueError(f"unknown KL estimator {estimator!r}; valid choices: {', '.join(KL_ESTIMATORS)}")


def _last_valid_index(mask: Tensor) -> Tensor:
    """Index of the last nonzero entry of each row of ``mask`` ``[B, T]``; -1 for empty rows."""
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), positions, torch.full_like(positions, -1)).max(dim=-1).values


def kl_shaped_rewards(
    scores: Tensor,
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    *,
    kl_coef: float,
    estimator: str,
) -> Tensor:
    """Per-token rewards: ``-kl_coef * KL`` at each valid token, plus the score at the last one.

    scores: ``[B]`` sequence rewards; logp, ref_logp, mask: ``[B, T]``. Returns ``[B, T]`` in
    ``logp``'s dtype, zero where the mask is 0. A row with no valid token gets no reward at all.
    """
    _check_same_shape(logp=logp, ref_logp=ref_logp, mask=mask)
    if tuple(scores.shape) != (mask.shape[0],):
        raise ValueError(
            f"scores have shape {tuple(scores.shape)}; expected ({mask.shape[0]},), one score per row of "
            f"the response mask {tuple(mask.shape)}"
        )
    kl = kl_penalty(logp, ref_logp, estimator=estimator)
    valid = mask.bool()
    rewards = torch.where(valid, -kl_coef * kl, torch.zeros_like(kl))

    last = _last_valid_index(mask)
    has_token = last >= 0
    rows = torch.arange(mask.shape[0], device=mask.device)[has_token]
    rewards = rewards.index_put((rows, last[has_token]), scores[has_token].to(rewards.dtype), accumulate=True)
    return rewards


def gae(rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation over the valid tokens of each response.

    rewards, values, mask: ``[B, T]``. Returns ``(advantages, returns)``, each ``[B, T]``:

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}
        R_t     = A_t + V_t

    where ``t + 1`` is the next valid token of the row, and ``V`` and ``A`` after the last valid
    token are 0 (the episode ends). Masked positions are skipped and set to 0 in both outputs,
    whatever ``rewards`` and ``values`` hold there. The loop runs over ``T``, vectorised over ``B``.
    """
    _check_same_shape(rewards=rewards, values=values, mask=mask)
    valid = mask.bool()
    rewards = torch.where(valid, rewards, torch.zeros_like(rewards))
    values = torch.where(valid, values, torch.zeros_like(values))

    next_value = rewards.new_zeros(rewards.shape[0])
    next_advantage = rewards.new_zeros(rewards.shape[0])
    advantages_reversed = []
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage_t = delta + gamma * lam * next_advantage
        advantages_reversed.append(torch.where(valid[:, t], advantage_t, torch.zeros_like(advantage_t)))
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        next_advantage = torch.where(valid[:, t], advantage_t, next_advantage)
    if advantages_reversed:
        advantages = torch.stack(advantages_reversed[::-1], dim=1)
    else:
        advantages = torch.zeros_like(rewards)

    returns = torch.where(valid, advantages + values, torch.zeros_like(advantages))
    return advantages, returns
