"""The loop's view of its own progress: stage, counters, residencies, and passing them to a reporter.

`ProgressTracker` holds the current `Progress` snapshot and updates it as the loop moves on: each
stage change first collects the roles' offload transitions (reported one by one as events) and
their residencies, then reports the snapshot. Each step's time is the wall time since the one
before finished (so a checkpoint counts in the step it follows), and the steps left are priced
from those (`estimate_remaining_seconds`). `poll` is a function, so the tracker needs no Ray
(the loop passes `Roles.poll`). Depends on the reporters, metrics and the API vocabulary.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from ppo_trainer.checkpoint import TrainerState
from ppo_trainer.offload import Transition
from ppo_trainer.reporting.metrics import StepMetrics
from ppo_trainer.reporting.reporters import CheckpointInfo, EvaluationInfo, ExportInfo, Progress, Reporter, utc_now
from ppojob_api.progress import estimate_remaining_seconds
from ppojob_api.vocabulary import RolloutResidency, Stage, TrainResidency

Poll = Callable[[], tuple[list[Transition], dict[str, str]]]


class ProgressTracker:
    def __init__(self, *, reporter: Reporter, poll: Poll, total_steps: int, critic_only_steps: int,
                 with_critic: bool, state: TrainerState, attempt: int,
                 last_checkpoint: CheckpointInfo | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.reporter = reporter
        self.poll = poll
        self.clock = clock
        self.step_seconds: list[tuple[bool, float]] = []
        """This process's steps as (critic_only, wall seconds), for the estimate."""
        self._last_step_end = clock()
        self.progress = Progress(
            total_steps=total_steps,
            critic_only_steps=critic_only_steps,
            attempt=attempt,
            step=state.step,
            critic_only_steps_done=state.critic_only_steps_done,
            weight_syncs_skipped=state.weight_syncs_skipped,
            critic=TrainResidency.ON_DEVICE if with_critic else None,
            last_checkpoint=last_checkpoint,
            last_evaluation=last_evaluation(state.history),
            last_export=ExportInfo.from_status(state.last_export) if state.last_export else None,
        )

    def _update(self, **changes) -> None:
        self.progress = replace(self.progress, **changes)
        self.reporter.report(self.progress)

    def _residencies(self) -> dict:
        transitions, states = self.poll()
        for t in transitions:
            self.reporter.event("transition", role=t.role, rank=t.rank, frm=t.from_state, to=t.to_state,
                                seconds=round(t.seconds, 6), time=t.time)
        residency = {"actor": TrainResidency(states["actor"]), "rollout": RolloutResidency(states["rollout"])}
        if "critic" in states:
            residency["critic"] = TrainResidency(states["critic"])
        if "reward" in states:
            residency["reward"] = RolloutResidency(states["reward"])
        return residency

    def stage(self, stage: Stage, *, state: TrainerState) -> None:
        self._update(stage=stage, step=state.step, critic_only_steps_done=state.critic_only_steps_done,
                     weight_syncs_skipped=state.weight_syncs_skipped, **self._residencies())

    def step_done(self, metrics: StepMetrics, *, state: TrainerState) -> None:
        self.reporter.event("step", line=metrics.summary_line(self.progress.total_steps), **metrics.to_dict())
        now = self.clock()
        self.step_seconds.append((metrics.critic_only, now - self._last_step_end))
        self._last_step_end = now
        critic_only_left = max(0, self.progress.critic_only_steps - state.critic_only_steps_done)
        remaining = estimate_remaining_seconds(
            self.step_seconds, critic_only_left=critic_only_left,
            ppo_left=max(0, self.progress.total_steps - state.step - critic_only_left))
        self._update(step=state.step, critic_only_steps_done=state.critic_only_steps_done,
                     weight_syncs_skipped=state.weight_syncs_skipped, metrics=metrics.to_status(),
                     last_evaluation=metrics.evaluation() or self.progress.last_evaluation,
                     estimated_remaining_seconds=remaining, **self._residencies())

    def checkpoint(self, *, step: int, path: str, seconds: float) -> None:
        self.reporter.event("checkpoint", step=step, path=path, seconds=round(seconds, 3),
                            line=f"checkpoint after step {step}: {path} ({seconds:.2f}s)")
        self._update(last_checkpoint=CheckpointInfo(step=step, path=path, time=utc_now()))

    def exported(self, export: ExportInfo, *, seconds: float) -> None:
        critic = f", critic {export.critic_path}" if export.critic_path else ""
        self.reporter.event("export", step=export.step, path=export.path, critic_path=export.critic_path,
                            seconds=round(seconds, 3),
                            line=f"export after step {export.step}: {export.path}{critic} ({seconds:.2f}s)")
        self._update(last_export=export)

    def finish(self, *, error: str | None = None) -> None:
        if error is not None:
            self.reporter.event("error", line=f"error: {error}", message=error)
        self._update(stage=Stage.DONE if error is None else self.progress.stage, finished=error is None, error=error)


def last_evaluation(history: list[dict]) -> EvaluationInfo | None:
    """The latest held-out evaluation in a run's step history (a resumed run's, from its checkpoint)."""
    evaluations = [StepMetrics.from_dict(record).evaluation() for record in history]
    return next((e for e in reversed(evaluations) if e is not None), None)
