"""Conditions in the standard Kubernetes form, updated without losing their transition times.

`set_condition` returns a new list; a condition's lastTransitionTime moves only when its status
flips (True/False/Unknown), not when its reason or message changes. Pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from ppo_operator.job import format_time, parse_time
from ppojob_api.vocabulary import ConditionType, Reason

TRUE, FALSE, UNKNOWN = "True", "False", "Unknown"


def get_condition(conditions: Iterable[Mapping[str, Any]], type_: ConditionType) -> Mapping[str, Any] | None:
    return next((c for c in conditions if c.get("type") == type_.value), None)


def is_true(conditions: Iterable[Mapping[str, Any]], type_: ConditionType) -> bool:
    condition = get_condition(conditions, type_)
    return bool(condition) and condition.get("status") == TRUE


def transition_time(conditions: Iterable[Mapping[str, Any]], type_: ConditionType) -> datetime | None:
    condition = get_condition(conditions, type_)
    return parse_time(condition.get("lastTransitionTime")) if condition else None


def set_condition(
    conditions: Iterable[Mapping[str, Any]],
    type_: ConditionType,
    status: bool | str,
    reason: Reason | str,
    message: str,
    *,
    now: datetime,
    generation: int,
    since: datetime | None = None,
) -> list[dict[str, Any]]:
    """The conditions with `type_` set; other conditions and their order are kept.

    `since` is when the flip happened, when known better than `now` (e.g. the last pod's
    scheduling time for GangScheduled). `reason` is ours, or another controller's own word as it
    gave it (Kueue's, on Admitted)."""
    value = status if isinstance(status, str) else (TRUE if status else FALSE)
    reason_text = reason.value if isinstance(reason, Reason) else reason
    result: list[dict[str, Any]] = []
    found = False
    for condition in conditions:
        if condition.get("type") != type_.value:
            result.append(dict(condition))
            continue
        found = True
        moved = condition.get("status") != value
        result.append(
            {
                "type": type_.value,
                "status": value,
                "reason": reason_text,
                "message": message,
                "lastTransitionTime": format_time(since or now) if moved else condition["lastTransitionTime"],
                "observedGeneration": generation,
            }
        )
    if not found:
        result.append(
            {
                "type": type_.value,
                "status": value,
                "reason": reason_text,
                "message": message,
                "lastTransitionTime": format_time(since or now),
                "observedGeneration": generation,
            }
        )
    return result
