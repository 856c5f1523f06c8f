"""The PPO algorithms as pure tensor functions: masked reductions, KL shaping, GAE, losses.

This package re-exports the public names; it must not depend on Ray, process groups or
configuration objects (callers pass tensors and explicit hyperparameters).
"""

from ppo_trainer.algorithms.advantages import KL_ESTIMATORS, gae, kl_penalty, kl_shaped_rewards
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
    entropy_from_logits,
    log_probs_from_logits,
    masked_mean,
    masked_sum,
    masked_whiten,
    policy_loss,
    value_loss,
)

__all__ = [
    "KL_ESTIMATORS",
    "AdvantageInputs",
    "AdvantageOutputs",
    "CustomAdvantageError",
    "FunctionReferenceError",
    "LoadedFunction",
    "compute_custom_advantages",
    "entropy_from_logits",
    "gae",
    "kl_penalty",
    "kl_shaped_rewards",
    "load_advantage_function",
    "load_function",
    "log_probs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "policy_loss",
    "value_loss",
]
