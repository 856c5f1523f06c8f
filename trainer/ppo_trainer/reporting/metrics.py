"""Per-step metrics of a run, the time each stage takes, and a PNG plot of the run.

`StepMetrics` is one step's record (reward, losses, KL, clip fractions, entropy, the rollout and
training log-prob mismatch, stage times, tokens/s), and its TensorBoard scalars (`scalars`, written
by `tensorboard.py`), with the held-out evaluation it ended with, if any (`eval_*`); `StageTimer`
measures the stages; `plot_run` draws the reward and loss curves with matplotlib's Agg backend (no
display needed). Depends on the standard library, the reporters' `EvaluationInfo` and matplotlib
(imported inside `plot_run`), not on torch or Ray.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ppo_trainer.reporting.reporters import EvaluationInfo


@dataclass(frozen=True)
class StepMetrics:
    step: int
    critic_only: bool
    reward_mean: float
    response_tokens: int
    """Response tokens generated in the step."""
    samples: int
    seconds: float
    """Wall time of the whole step."""
    stage_seconds: dict[str, float] = field(default_factory=dict)
    value_loss: float | None = None
    value_clipfrac: float | None = None
    policy_loss: float | None = None
    clipfrac: float | None = None
    kl: float | None = None
    entropy: float | None = None
    rollout_log_ratio_mean: float | None = None
    """Mean over the step's tokens of log pi_train - log pi_rollout (the trainer's log-probs before
    the update against the engine's, for the sampled tokens)."""
    rollout_log_ratio_abs_max: float | None = None
    """The largest |log pi_train - log pi_rollout| of the step."""
    rollout_k3: float | None = None
    """Mean k3 estimate of KL(pi_rollout || pi_train) per token."""
    staleness: int = 0
    """Actor updates between the weights that generated the step's batch and the actor's before this
    step's update (0 Synchronous; at most 1 with ppo.schedule OneStepOverlap, 0 in the warm-up)."""
    rollout_weights_version: int = 0
    """The actor updates in the weights the engines generated the batch with (stamped by the engines)."""
    generation_seconds: float | None = None
    """The engines' own time generating and scoring the batch (the slowest engine)."""
    generated_at: tuple[float, float] | None = None
    """When the engines generated the batch: (first start, last end), Unix seconds."""
    compile_seconds: float | None = None
    """Seconds the roles' processes (engines included) spent in torch.compile during the step, summed over
    the processes (the first step of a job pays the compiles; warm caches make them short)."""
    eval_reward_mean: float | None = None
    """The mean score on the held-out prompts (data.validation), when the step ended with an evaluation."""
    eval_pass_rate: float | None = None
    """The share of held-out prompts scored 1, when every score was 0 or 1."""
    eval_samples: int | None = None
    """Held-out prompts answered."""
    eval_seconds: float | None = None
    """Wall time of the evaluation (part of `seconds`)."""

    @property
    def tokens_per_second(self) -> float:
        """Generated response tokens per second of the whole step (end to end)."""
        return self.response_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "tokens_per_second": self.tokens_per_second}

    @classmethod
    def from_dict(cls, data: dict) -> StepMetrics:
        return cls(**{k: v for k, v in data.items() if k != "tokens_per_second"})

    def scalars(self) -> dict[str, float]:
        """The step's TensorBoard scalars by tag (grouped by the tag's first part); unset ones left out."""
        fields = {
            "reward/mean": self.reward_mean,
            "loss/value": self.value_loss,
            "loss/policy": self.policy_loss,
            "kl/reference": self.kl,
            "clipfrac/policy": self.clipfrac,
            "clipfrac/value": self.value_clipfrac,
            "policy/entropy": self.entropy,
            "rollout_mismatch/log_ratio_mean": self.rollout_log_ratio_mean,
            "rollout_mismatch/log_ratio_abs_max": self.rollout_log_ratio_abs_max,
            "rollout_mismatch/k3": self.rollout_k3,
            "throughput/tokens_per_second": self.tokens_per_second,
            "time/step_seconds": self.seconds,
            "warmup/critic_only": float(self.critic_only),
            "policy/staleness": self.staleness,
            "time/generation_seconds": self.generation_seconds,
            "time/compile_seconds": self.compile_seconds,
            "eval/reward_mean": self.eval_reward_mean,
            "eval/pass_rate": self.eval_pass_rate,
            "eval/samples": self.eval_samples,
            "eval/seconds": self.eval_seconds,
            **{f"time/{stage}_seconds": seconds for stage, seconds in self.stage_seconds.items()},
        }
        return {tag: float(v) for tag, v in fields.items() if v is not None}

    def evaluation(self) -> EvaluationInfo | None:
        """The held-out evaluation the step ended with, as the status shows it; None without one."""
        if self.eval_reward_mean is None:
            return None
        return EvaluationInfo(step=self.step + 1, reward_mean=self.eval_reward_mean, pass_rate=self.eval_pass_rate,
                              samples=int(self.eval_samples or 0))

    def to_status(self) -> dict[str, float]:
        """The `status.progress.metrics` fields of the PPOJob (camelCase; unset ones left out)."""
        fields = {
            "rewardMean": self.reward_mean,
            "valueLoss": self.value_loss,
            "policyLoss": self.policy_loss,
            "kl": self.kl,
            "entropy": self.entropy,
            "tokensPerSecond": round(self.tokens_per_second, 2),
            "secondsPerStep": round(self.seconds, 3),
        }
        return {k: float(v) for k, v in fields.items() if v is not None}

    def summary_line(self, total_steps: int) -> str:
        def fmt(name: str, value: float | None) -> str:
            return f" {name}={value:.4f}" if value is not None else ""

        kind = "critic-only" if self.critic_only else "ppo"
        compiled = f" compile {self.compile_seconds:.1f}s" if self.compile_seconds else ""
        mismatch = (f" rollout_mismatch(k3={self.rollout_k3:.2e} max|log_ratio|={self.rollout_log_ratio_abs_max:.2e})"
                    if self.rollout_k3 is not None else "")
        evaluated = (f" eval(reward={self.eval_reward_mean:.4f}{fmt('pass_rate', self.eval_pass_rate)}"
                     f" n={self.eval_samples} {self.eval_seconds:.2f}s)" if self.eval_reward_mean is not None else "")
        return (
            f"step {self.step + 1}/{total_steps} [{kind}] reward={self.reward_mean:.4f}"
            f"{fmt('value_loss', self.value_loss)}{fmt('policy_loss', self.policy_loss)}{fmt('kl', self.kl)}"
            f"{fmt('entropy', self.entropy)}{mismatch}{evaluated} {self.seconds:.2f}s{compiled}"
            f" {self.tokens_per_second:.0f} tok/s"
        )


class StageTimer:
    """Wall time per named stage of one step: `with timer("generate"): ...`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._started = time.perf_counter()

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started

    @property
    def total(self) -> float:
        return time.perf_counter() - self._started


def plot_run(history: list[StepMetrics], path: str | Path) -> Path:
    """Reward, losses and KL per step as one PNG; critic-only warm-up steps shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m.step for m in history]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = [
        ("mean reward", [("reward", [m.reward_mean for m in history])]),
        ("losses", [("value", [m.value_loss for m in history]), ("policy", [m.policy_loss for m in history])]),
        ("KL to reference", [("kl", [m.kl for m in history])]),
    ]
    warmup = [m.step for m in history if m.critic_only]
    for ax, (title, series) in zip(axes, panels):
        for label, values in series:
            points = [(s, v) for s, v in zip(steps, values) if v is not None]
            if points:
                ax.plot(*zip(*points), marker="o", markersize=3, label=label)
        if warmup:
            ax.axvspan(min(warmup) - 0.5, max(warmup) + 0.5, color="grey", alpha=0.15, label="critic-only")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def summarize_run(history: list[StepMetrics], *, window: int = 3) -> dict:
    """The figures a run is judged by: time per step and stage, tokens/s, the reward curve's ends
    (each end also as the mean of `window` steps, since a single step's reward is noisy), and the
    rollout/training mismatch (the mean of the steps' k3, the largest |log-ratio|) and the seconds
    spent compiling."""
    if not history:
        return {"steps": 0}
    seconds = sum(m.seconds for m in history)
    stages = sorted({name for m in history for name in m.stage_seconds})
    measured = [m for m in history if m.rollout_k3 is not None]
    mismatch = {
        "rolloutK3Mean": sum(m.rollout_k3 for m in measured) / len(measured),
        "rolloutLogRatioAbsMax": max(m.rollout_log_ratio_abs_max for m in measured),
    } if measured else {}
    return {
        "steps": len(history),
        "secondsPerStep": round(seconds / len(history), 3),
        "tokensPerSecond": round(sum(m.response_tokens for m in history) / seconds, 1) if seconds else 0.0,
        "stageSecondsPerStep": {
            name: round(sum(m.stage_seconds.get(name, 0.0) for m in history) / len(history), 3) for name in stages
        },
        "rewardStart": round(history[0].reward_mean, 4),
        "rewardEnd": round(history[-1].reward_mean, 4),
        f"rewardFirst{window}Mean": round(sum(m.reward_mean for m in history[:window]) / len(history[:window]), 4),
        f"rewardLast{window}Mean": round(sum(m.reward_mean for m in history[-window:]) / len(history[-window:]), 4),
        "compileSeconds": round(sum(m.compile_seconds or 0.0 for m in history), 3),
        **mismatch,
        **summarize_evaluations(history),
    }


def summarize_evaluations(history: list[StepMetrics]) -> dict:
    """The held-out evaluations' ends: the first and last mean score (and pass rate), and the seconds
    an evaluation took on average; nothing when the run made none."""
    evaluated = [m for m in history if m.eval_reward_mean is not None]
    if not evaluated:
        return {}
    first, last = evaluated[0], evaluated[-1]
    pass_rates = {"evalPassRateStart": first.eval_pass_rate, "evalPassRateEnd": last.eval_pass_rate}
    return {
        "evaluations": len(evaluated),
        "evalRewardStart": round(first.eval_reward_mean, 4),
        "evalRewardEnd": round(last.eval_reward_mean, 4),
        "evalRewardEndStep": last.step + 1,
        **{k: round(v, 4) for k, v in pass_rates.items() if v is not None},
        "evalSecondsPerEvaluation": round(sum(m.eval_seconds for m in evaluated) / len(evaluated), 3),
    }
