"""A trainer's progress report: how far it is and how long the rest should take, when it must reach
the PPOJob's status at once, and how long the rest may wait.

The trainer computes `status.progress.percent` and `estimatedRemainingSeconds` from its own step
times (`estimate_remaining_seconds`): it alone sees every step, knows which one paid for the start
and which are critic-only; the operator folds the report as it is. One pacing rule for both ends of
a report: the trainer paces what it sends to its progress ConfigMap, the operator paces what it
folds from there into the PPOJob's status (a PPOJob write costs the API server several times a
ConfigMap write, docs/scale.md). What the operator acts on or tells as an Event goes at once; a
routine change (a new step, a stage, a residency, a heartbeat, the estimate) waits for the
interval, longer while the API server is slow. Works on `status.progress` as the CRD spells it.
Depends on nothing but the standard library.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

MIN_INTERVAL_S = 10.0
"""The least time between two routine reports."""
MAX_INTERVAL_S = 30.0
"""The most a routine report is held back: the trainer's heartbeat period."""
SLOWDOWN = 50.0
"""A routine report waits at least this many times as long as the last write took: with the API
server answering in 0.2 s or less the interval stays `MIN_INTERVAL_S`; at 0.6 s it is the maximum."""


def urgency(previous: Mapping[str, Any] | None, current: Mapping[str, Any]) -> str | None:
    """Why `current` must go out now (its reason), or None when it may wait for the interval. Each
    urgent change is one the operator acts on or tells as an Event: the warm-up count moves the job
    to Training at N of N."""
    if not previous:
        return "first report"
    if current.get("attempt") != previous.get("attempt"):
        return "new attempt"
    if current.get("error") is not None and current.get("error") != previous.get("error"):
        return "error"
    if current.get("finished") and not previous.get("finished"):
        return "finished"
    if current.get("lastCheckpoint") != previous.get("lastCheckpoint"):
        return "checkpoint"
    if current.get("lastExport") != previous.get("lastExport"):
        return "export"
    if current.get("criticOnlyStepsDone") != previous.get("criticOnlyStepsDone"):
        return "warm-up step"
    return None


def routine_interval(min_interval: float, last_write_s: float, slowdown: float = SLOWDOWN) -> float:
    """Seconds between two routine reports: `min_interval`, stretched while the API server is slow."""
    return min(max(MAX_INTERVAL_S, min_interval), max(min_interval, slowdown * last_write_s))


def percent_done(steps_done: int, total_steps: int) -> int:
    """Steps done as a whole percentage of the total, rounded down (100 only when all are done)."""
    if total_steps <= 0:
        return 100
    return max(0, min(100, steps_done * 100 // total_steps))


def estimate_remaining_seconds(step_seconds: Sequence[tuple[bool, float]], *, critic_only_left: int,
                               ppo_left: int) -> float | None:
    """Seconds the steps left should take, from this process's measured steps, in order, as
    (critic_only, seconds). The first is left out: it also pays for starting up (compiling, the
    first allocations, the engines' first batch). A critic-only step skips the actor's update and
    the weight sync, so each kind is priced by its own mean, a kind not measured yet by the other's.
    None while no step past the first has been measured (0.0 when none is left)."""
    if critic_only_left + ppo_left == 0:
        return 0.0
    measured = step_seconds[1:]
    if not measured:
        return None
    overall = sum(seconds for _, seconds in measured) / len(measured)

    def mean(critic_only: bool) -> float:
        of_kind = [seconds for kind, seconds in measured if kind == critic_only]
        return sum(of_kind) / len(of_kind) if of_kind else overall

    return critic_only_left * mean(True) + ppo_left * mean(False)


def format_duration(seconds: float) -> str:
    """A duration as `kubectl get` writes ages: '45s', '3m20s', '1h05m', '2d03h'."""
    total = max(0, round(seconds))
    minutes, secs = divmod(total, 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"
