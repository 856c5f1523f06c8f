"""Held-out evaluation during training: the policy answers held-out prompts, the job's reward scores them.

`Evaluator` holds the prompts of `data.validation` (read once) and says when an evaluation is due:
after every `interval` steps and after the last. An evaluation hands each rollout engine its share
of the prompts; each engine answers every prompt once with the weights it serves (those of the
step's weight sync) and scores the answers with the job's reward; the driver reduces the scores to
an `Evaluation` (the mean, and the pass rate when every score is 0 or 1).

It draws nothing from the training run's random stream: its prompts are fixed (the prompt sampler is
not asked), the engines sample from generators seeded by `evaluation_seed` (one seed for all the
evaluations of a run, so two of them differ by the weights alone), and the actor, critic and
reference are not called. Imports no Ray itself (the rollout group does the calls).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from ppo_trainer.data import SYNTHETIC_SET_SIZE, Prompt, synthetic_prompts
from ppo_trainer.prompt_files import load_prompt_file
from ppo_trainer.roles.group import RoleGroup
from ppo_trainer.roles.rollout import RolloutWorker
from ppojob_api.spec import PPOJobSpec


@dataclass(frozen=True)
class Evaluation:
    """One evaluation of the policy on the held-out prompts."""

    step: int
    """Steps done when it ran: the policy after that many steps."""
    reward_mean: float
    pass_rate: float | None
    """The share of scores equal to 1, when every score is 0 or 1 (a pass/fail reward); else None."""
    samples: int
    seconds: float
    """Wall time of the evaluation, generation and scoring on every engine."""


def evaluation_seed(seed: int) -> int:
    """The engines' sampling seed for every evaluation of a run with `seed`: the last of the block of
    step seeds the training steps take theirs from (`seed * 1_000_003 + step`), which no run reaches."""
    return seed * 1_000_003 + 1_000_002


def is_evaluation_due(steps_done: int, *, interval: int, total_steps: int) -> bool:
    """After every `interval` steps (0: none), and after the last step."""
    return steps_done == total_steps or (interval > 0 and steps_done % interval == 0)


def score_summary(scores: Sequence[float]) -> tuple[float, float | None]:
    """The mean score, and the pass rate (the share of 1s) when every score is 0 or 1."""
    if not scores:
        raise ValueError("no scores to summarize: the evaluation needs at least one held-out prompt")
    mean = sum(scores) / len(scores)
    return mean, (mean if all(s in (0.0, 1.0) for s in scores) else None)


def load_validation_prompts(spec: PPOJobSpec) -> list[Prompt]:
    """The held-out prompts of data.validation: the first `count` (0 or unset: all). Raises
    FileNotFoundError or ValueError (naming the file and line) as the training prompts do."""
    validation, data = spec.data.validation, spec.data
    if validation.prompts == "synthetic":  # another seed's prompts, less any the synthetic training set holds
        training = {p.text for p in synthetic_prompts(SYNTHETIC_SET_SIZE, seed=spec.seed)}
        prompts = [p for p in synthetic_prompts(SYNTHETIC_SET_SIZE, seed=spec.seed + 1) if p.text not in training]
    else:
        prompts = load_prompt_file(validation.prompts, prompt_key=data.prompt_key, label_key=data.label_key)
    return prompts[: validation.count] if validation.count else prompts


class Evaluator:
    def __init__(self, spec: PPOJobSpec, prompts: list[Prompt]) -> None:
        validation = spec.data.validation
        self.prompts = prompts
        self.interval = validation.interval or 0
        self.total_steps = spec.ppo.num_rollouts
        self.temperature = validation.temperature or 0.0
        self.max_new_tokens = validation.max_new_tokens or spec.rollout.max_new_tokens
        self.seed = evaluation_seed(spec.seed)

    @classmethod
    def from_spec(cls, spec: PPOJobSpec) -> Evaluator:
        """The job's evaluator; without data.validation.prompts it has no prompts and is never due."""
        return cls(spec, load_validation_prompts(spec) if spec.data.validation.enabled else [])

    def is_due(self, steps_done: int) -> bool:
        return bool(self.prompts) and is_evaluation_due(steps_done, interval=self.interval, total_steps=self.total_steps)

    def evaluate(self, rollout: RoleGroup, *, step: int) -> Evaluation:
        """Every held-out prompt answered and scored by the engines of `rollout`, with the weights they serve."""
        started = time.perf_counter()
        parts = rollout.call(RolloutWorker.evaluate, rollout.split(self.prompts), seed=rollout.seeds(self.seed),
                             temperature=self.temperature, max_new_tokens=self.max_new_tokens)
        scores = [score for part in parts for score in part]
        mean, pass_rate = score_summary(scores)
        return Evaluation(step=step, reward_mean=mean, pass_rate=pass_rate, samples=len(scores),
                          seconds=time.perf_counter() - started)
