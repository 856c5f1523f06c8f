"""The PPO algorithms as pure tensor functions: masked reductions, loss aggregation, KL shaping, GAE,
losses, and the rollout/training log-prob mismatch.

This package re-exports the public names; it must not depend on Ray, process groups or
configuration objects (callers pass tensors and explicit hyperparameters).
"""

from ppo_trainer.algorithms.advantages import K3_BOUND, KL_ESTIMATORS, gae, kl_penalty, kl_shaped_rewards
from ppo_trainer.algorithms.aggregation import (
    LOSS_AGGREGATIONS,
    TOKEN_MEAN,
    BatchCounts,
    aggregate_loss,
    batch_counts,
)
from ppo_trainer.algorithms.custom_advantage import (
    AdvantageInputs,
    AdvantageOutputs,
    CustomAdvantageError,
    FunctionReferenceError,
    LoadedFunction,
    compute_custom_advantages,
    load_advantage_function,
    load_function,
)
from ppo_trainer.algorithms.ppo import (
    LOG_RATIO_BOUND,
    entropy_from_logits,
    log_probs_from_logits,
    masked_mean,
    masked_moments,
    masked_sum,
    masked_whiten,
    policy_loss,
    value_loss,
)
from ppo_trainer.algorithms.rollout_correction import (
    log_prob_mismatch,
    summarize_mismatch,
    truncated_importance_weights,
)

__all__ = [
    "K3_BOUND",
    "KL_ESTIMATORS",
    "LOG_RATIO_BOUND",
    "LOSS_AGGREGATIONS",
    "TOKEN_MEAN",
    "AdvantageInputs",
    "AdvantageOutputs",
    "BatchCounts",
    "CustomAdvantageError",
    "FunctionReferenceError",
    "LoadedFunction",
    "aggregate_loss",
    "batch_counts",
    "compute_custom_advantages",
    "entropy_from_logits",
    "gae",
    "kl_penalty",
    "kl_shaped_rewards",
    "load_advantage_function",
    "load_function",
    "log_prob_mismatch",
    "log_probs_from_logits",
    "masked_mean",
    "masked_moments",
    "masked_sum",
    "masked_whiten",
    "policy_loss",
    "summarize_mismatch",
    "truncated_importance_weights",
    "value_loss",
]
