"""Status reporting behind one small interface: a terminal, JSON lines, or the PPOJob's status.

The loop builds a `Progress` snapshot (the fields of the CRD's `status.progress`) and hands it to
a `Reporter` at each stage; transitions, per-step summaries and checkpoints go through `event`.
`TerminalReporter` draws a tqdm bar and one line per step, `JsonLinesReporter` writes one JSON
object per call (to stdout when it is not a terminal, or to a file), `FanOut` sends to several.
The Kubernetes reporter lives in `kubernetes.py`. Depends on the API vocabulary and tqdm
only; not on torch or Ray.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field, is_dataclass
from datetime import UTC, datetime
from typing import IO, Any, Protocol

from ppojob_api.progress import format_duration, percent_done
from ppojob_api.vocabulary import RolloutResidency, Stage, TrainResidency


def utc_now() -> str:
    return utc_time(datetime.now(UTC).timestamp())


def utc_time(seconds: float) -> str:
    """A POSIX time as status times are written (RFC 3339, UTC, whole seconds)."""
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: str
    time: str


@dataclass(frozen=True)
class EvaluationInfo:
    """The latest held-out evaluation, as `status.progress.evaluation` shows it."""

    step: int
    reward_mean: float
    pass_rate: float | None
    samples: int

    def to_status(self) -> dict[str, Any]:
        status = {"step": self.step, "rewardMean": self.reward_mean, "samples": self.samples}
        return status if self.pass_rate is None else {**status, "passRate": self.pass_rate}


@dataclass(frozen=True)
class ExportInfo:
    """A Hugging Face export (`status.progress.lastExport`): the actor's directory, and the critic's when exported."""

    step: int
    path: str
    time: str
    critic_path: str | None = None

    @classmethod
    def from_status(cls, status: dict[str, Any]) -> ExportInfo:
        return cls(step=status["step"], path=status["path"], time=status["time"], critic_path=status.get("criticPath"))

    def to_status(self) -> dict[str, Any]:
        status = {"step": self.step, "path": self.path, "time": self.time}
        if self.critic_path is not None:
            status["criticPath"] = self.critic_path
        return status


@dataclass(frozen=True)
class Progress:
    """What the trainer reports: `status.progress` of the PPOJob (see `to_status`)."""

    total_steps: int
    critic_only_steps: int
    attempt: int = 0
    step: int = 0
    """Steps finished (so also the index of the step in progress)."""
    critic_only_steps_done: int = 0
    stage: Stage = Stage.STARTING
    actor: TrainResidency = TrainResidency.ON_DEVICE
    critic: TrainResidency | None = TrainResidency.ON_DEVICE
    rollout: RolloutResidency = RolloutResidency.AWAKE
    reward: RolloutResidency | None = None
    """The reward model's residency (reward.type Model); None without one."""
    weight_syncs_skipped: int = 0
    last_checkpoint: CheckpointInfo | None = None
    last_evaluation: EvaluationInfo | None = None
    last_export: ExportInfo | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    finished: bool = False
    error: str | None = None
    estimated_remaining_seconds: float | None = None
    """How long the steps left should take (`ppojob_api.progress.estimate_remaining_seconds`); None
    until a step past this process's first has been measured."""

    @property
    def steps(self) -> str:
        return f"{self.step}/{self.total_steps}"

    @property
    def percent(self) -> int:
        return percent_done(self.step, self.total_steps)

    @property
    def warmup(self) -> str:
        return f"{self.critic_only_steps_done}/{self.critic_only_steps}"

    @property
    def offload(self) -> str:
        """One-line residency summary, e.g. 'actor=Offloaded critic=OnDevice rollout=Asleep reward=Asleep'."""
        parts = [f"actor={self.actor.value}"]
        if self.critic is not None:
            parts.append(f"critic={self.critic.value}")
        parts.append(f"rollout={self.rollout.value}")
        if self.reward is not None:
            parts.append(f"reward={self.reward.value}")
        return " ".join(parts)

    def to_status(self) -> dict[str, Any]:
        """The `status.progress` object, field names and enum strings as in the CRD."""
        status: dict[str, Any] = {
            "attempt": self.attempt,
            "step": self.step,
            "totalSteps": self.total_steps,
            "criticOnlyStepsDone": self.critic_only_steps_done,
            "criticOnlySteps": self.critic_only_steps,
            "steps": self.steps,
            "percent": self.percent,
            "warmup": self.warmup,
            "stage": self.stage.value,
            "actor": self.actor.value,
            "rollout": self.rollout.value,
            "offload": self.offload,
            "weightSyncsSkipped": self.weight_syncs_skipped,
            "finished": self.finished,
        }
        if self.critic is not None:
            status["critic"] = self.critic.value
        if self.reward is not None:
            status["reward"] = self.reward.value
        if self.estimated_remaining_seconds is not None:
            status["estimatedRemainingSeconds"] = round(self.estimated_remaining_seconds)
            status["eta"] = format_duration(self.estimated_remaining_seconds)
        if self.last_checkpoint is not None:
            status["lastCheckpoint"] = asdict(self.last_checkpoint)
        if self.last_evaluation is not None:
            status["evaluation"] = self.last_evaluation.to_status()
        if self.last_export is not None:
            status["lastExport"] = self.last_export.to_status()
        if self.metrics:
            status["metrics"] = dict(self.metrics)
        if self.error is not None:
            status["error"] = self.error
        return status


class Reporter(Protocol):
    def report(self, progress: Progress) -> None:
        """The current progress (called at every stage change; a reporter may throttle)."""
        ...

    def event(self, kind: str, **fields: Any) -> None:
        """Something that happened: 'transition', 'step' (with its metrics), 'checkpoint', 'export', 'error'."""
        ...

    def close(self) -> None: ...


def _jsonable(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return _jsonable(asdict(value))
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "value") and isinstance(value.value, str):
        return value.value
    return value


class JsonLinesReporter:
    """One JSON object per line: {"time", "kind", ...}; progress lines carry the CRD's status fields."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream

    def _write(self, record: dict[str, Any]) -> None:
        self.stream.write(json.dumps(_jsonable(record), sort_keys=False) + "\n")
        self.stream.flush()

    def report(self, progress: Progress) -> None:
        self._write({"time": utc_now(), "kind": "progress", **progress.to_status()})

    def event(self, kind: str, **fields: Any) -> None:
        self._write({"time": utc_now(), "kind": kind, **fields})

    def close(self) -> None:
        if self.stream not in (sys.stdout, sys.stderr):
            self.stream.close()


class TerminalReporter:
    """A tqdm progress bar over the steps, its postfix the stage and residencies; one line per step."""

    def __init__(self, *, total_steps: int, initial: int = 0, stream: IO[str] | None = None) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total_steps, initial=initial, unit="step", file=stream or sys.stderr, dynamic_ncols=True)

    def report(self, progress: Progress) -> None:
        self.bar.n = progress.step
        warmup = f" warmup {progress.warmup}" if progress.critic_only_steps else ""
        self.bar.set_postfix_str(f"{progress.stage.value}{warmup} | {progress.offload}", refresh=True)

    def event(self, kind: str, **fields: Any) -> None:
        if kind in ("step", "checkpoint", "export", "error", "note"):
            self.bar.write(fields.get("line") or f"{kind}: {json.dumps(_jsonable(fields))}")

    def close(self) -> None:
        self.bar.close()


class FanOut:
    """Sends every call to each of several reporters."""

    def __init__(self, *reporters: Reporter) -> None:
        self.reporters = list(reporters)

    def report(self, progress: Progress) -> None:
        for reporter in self.reporters:
            reporter.report(progress)

    def event(self, kind: str, **fields: Any) -> None:
        for reporter in self.reporters:
            reporter.event(kind, **fields)

    def close(self) -> None:
        for reporter in self.reporters:
            reporter.close()


class Recorder:
    """Keeps everything in memory (tests, and the run summary)."""

    def __init__(self) -> None:
        self.progress: list[Progress] = []
        self.events: list[tuple[str, dict[str, Any]]] = []

    def report(self, progress: Progress) -> None:
        self.progress.append(progress)

    def event(self, kind: str, **fields: Any) -> None:
        self.events.append((kind, fields))

    def close(self) -> None:
        pass
