"""When a trainer's progress must reach the PPOJob's status at once, and how long the rest may wait.

One rule for both ends of a report: the trainer paces what it sends to its progress ConfigMap, the
operator paces what it folds from there into the PPOJob's status (a PPOJob write costs the API
server several times a ConfigMap write, docs/scale.md). What the operator acts on or tells as an
Event goes at once; a routine change (a new step, a stage, a residency, a heartbeat) waits for the
interval, longer while the API server is slow. Works on `status.progress` as the CRD spells it.
Depends on nothing but the standard library.
"""

from __future__ import annotations

from collections.abc import Mapping
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
    if current.get("criticOnlyStepsDone") != previous.get("criticOnlyStepsDone"):
        return "warm-up step"
    return None


def routine_interval(min_interval: float, last_write_s: float, slowdown: float = SLOWDOWN) -> float:
    """Seconds between two routine reports: `min_interval`, stretched while the API server is slow."""
    return min(max(MAX_INTERVAL_S, min_interval), max(min_interval, slowdown * last_write_s))
