"""The one place where per-token rewards, advantages and returns are derived for a batch.

Both the critic (for its returns) and the actor (for its advantages) call `compute_targets` with
the same inputs: the sequence scores, the actor's log-probs before the update and the reference
log-probs (computed once per step and handed to both as object refs), and the critic's values
before its update. So the critic's targets and the actor's advantages always use the same
KL-shaped rewards; the actor checks that its returns equal the critic's bit for bit. Depends on
the algorithms and the spec; not on Ray.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ppo_trainer.algorithms import (
    AdvantageInputs,
    compute_custom_advantages,
    gae,
    kl_penalty,
    kl_shaped_rewards,
    masked_mean,
)
from ppo_trainer.batch import RolloutBatch
from ppojob_api.spec import PPOSpec


class TargetMismatchError(RuntimeError):
    """The actor's returns differ from those the critic trained on: the reward definitions diverged."""


@dataclass(frozen=True)
class Targets:
    rewards: torch.Tensor
    """[B, T] KL-shaped per-token rewards."""
    advantages: torch.Tensor
    """[B, T] before whitening."""
    returns: torch.Tensor
    """[B, T] the critic's targets."""
    kl: float
    """Masked mean of the per-token KL estimate against the reference."""


def compute_targets(
    batch: RolloutBatch,
    *,
    values: torch.Tensor,
    old_log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    ppo: PPOSpec,
    advantage_fn: Callable | None = None,
) -> Targets:
    """Rewards, advantages and returns from GAE, or from `advantage_fn` (the loaded
    `ppo.customAdvantageFunction`) when given."""
    mask = batch.response_mask
    estimator = ppo.kl_estimator.value
    rewards = kl_shaped_rewards(
        batch.scores, old_log_probs, ref_log_probs, mask, kl_coef=ppo.kl_coef, estimator=estimator
    )
    if advantage_fn is not None:
        inputs = AdvantageInputs(
            rewards=rewards, values=values, mask=mask, scores=batch.scores, gamma=ppo.gamma, lam=ppo.lam
        )
        advantages, returns = compute_custom_advantages(advantage_fn, inputs)
    else:
        advantages, returns = gae(rewards, values, mask, gamma=ppo.gamma, lam=ppo.lam)
    kl = masked_mean(kl_penalty(old_log_probs, ref_log_probs, estimator=estimator), mask)
    return Targets(rewards=rewards, advantages=advantages, returns=returns, kl=float(kl))


def check_same_returns(actor_returns: torch.Tensor, critic_returns: torch.Tensor, *, function: str | None) -> None:
    """Raise unless the actor derived exactly the returns the critic trained on."""
    if actor_returns.shape == critic_returns.shape and torch.equal(actor_returns, critic_returns):
        return
    source = f"custom advantage function {function}" if function else "GAE"
    raise TargetMismatchError(
        f"the actor's returns differ from the critic's (shapes {tuple(actor_returns.shape)} and "
        f"{tuple(critic_returns.shape)}): both come from {source} on the same rewards and values, so "
        "the function must be deterministic (a pure function of its inputs)"
    )
