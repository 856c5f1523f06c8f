"""compute_events: the Kubernetes Events that tell a job's story, derived from status transitions.

Each phase change and each condition flip becomes one Event (Warning for failures), so that
`kubectl describe ppojob` reads as the job's history. Progress events (warm-up k/N, checkpoint
written, held-out evaluation) come from two successive trainer reports. Pure.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from ppo_operator.conditions import TRUE, get_condition
from ppojob_api.vocabulary import ConditionType, Phase, Reason

NORMAL, WARNING = "Normal", "Warning"

REPORTING_COMPONENT = "ppojob-operator"
"""Who posts the Events: their `reportingComponent` and `source.component` (`kubectl describe`'s
From column; kopf's default says "kopf"), and the start of their names."""

WARNING_REASONS = {
    Reason.INVALID_SPEC, Reason.GANG_TIMEOUT, Reason.POD_LOST, Reason.TRAINER_LOST, Reason.TRAINER_FAILED,
    Reason.BACKOFF_LIMIT_EXCEEDED, Reason.DEADLINE_EXCEEDED, Reason.RECONCILE_ERROR, Reason.REPORT_REFUSED,
}
# Condition flips worth an Event of their own (the phase events cover the rest).
STORY_CONDITIONS = (ConditionType.GANG_SCHEDULED, ConditionType.CLUSTER_READY, ConditionType.TRAINER_RUNNING)


@dataclasses.dataclass(frozen=True)
class Event:
    type: str
    reason: str
    message: str


def _event(reason: str, message: str) -> Event:
    warning = reason in {r.value for r in WARNING_REASONS}
    return Event(WARNING if warning else NORMAL, reason, message)


def compute_events(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[Event]:
    """Events for the transitions from the old operator status to the new one, in story order."""
    events: list[Event] = []
    old_conditions, new_conditions = old.get("conditions") or [], new.get("conditions") or []
    for type_ in STORY_CONDITIONS:
        before, after = get_condition(old_conditions, type_), get_condition(new_conditions, type_)
        if after and after.get("status") == TRUE and (not before or before.get("status") != TRUE):
            events.append(_event(after["reason"], after.get("message", "")))
    if new.get("phase") != old.get("phase") and new.get("phase") not in (None, Phase.PENDING.value):
        phase = Phase(new["phase"])
        message = new.get("message", "")
        events.append(_event(new.get("reason") or phase.value, f"{phase.value}: {message}" if message else phase.value))
    return events


def compute_progress_events(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[Event]:
    """Events for what the trainer reported since its previous report: warm-up steps, checkpoints, evaluations."""
    events: list[Event] = []
    done, total = new.get("criticOnlyStepsDone"), new.get("criticOnlySteps")
    if done and done != old.get("criticOnlyStepsDone") and total:
        reason = Reason.WARMUP_DONE if done >= total else Reason.WARMUP_STEP
        events.append(_event(reason.value, f"critic-only warm-up {done}/{total} done"))
    checkpoint, before = new.get("lastCheckpoint") or {}, old.get("lastCheckpoint") or {}
    # By step and path: a resumed trainer reports the checkpoint it resumed from, written before.
    if checkpoint.get("step") is not None and (checkpoint.get("step"), checkpoint.get("path")) != (
            before.get("step"), before.get("path")):
        events.append(
            _event(Reason.CHECKPOINT_WRITTEN.value, f"checkpoint of step {checkpoint['step']} at {checkpoint.get('path', '?')}")
        )
    evaluation = new.get("evaluation") or {}
    if evaluation.get("step") is not None and evaluation != (old.get("evaluation") or {}):
        events.append(_event(Reason.EVALUATED.value, describe_evaluation(evaluation)))
    return events


def describe_evaluation(evaluation: Mapping[str, Any]) -> str:
    """One line for `status.progress.evaluation`: 'held-out evaluation after step 20: mean reward 0.4213, pass rate
    0.3000 (64 prompts)'."""
    passed = f", pass rate {evaluation['passRate']:.4f}" if evaluation.get("passRate") is not None else ""
    return (f"held-out evaluation after step {evaluation['step']}: mean reward {evaluation.get('rewardMean', 0.0):.4f}"
            f"{passed} ({evaluation.get('samples', '?')} prompts)")


def compute_refused_report_event(reply: str) -> Event:
    """The trainer's latest report cannot be stored in the status (422): it is left out until the next."""
    return _event(Reason.REPORT_REFUSED.value, f"the trainer's latest report was left out of the status: the API server "
                  f"refuses it ({_server_words(reply)}); is the trainer's version the operator's?")


def _server_words(reply: str) -> str:
    try:
        return json.loads(reply).get("message") or reply
    except (ValueError, AttributeError):
        return reply


def compute_refused_status_event(status: Mapping[str, Any], reply: str) -> Event:
    """The API server refused our status patch (422): the stored object breaks the CRD's schema (it was
    written past validation, or stored under an older schema) and no status of it can be saved. So an
    Event says what the status would have said, with the server's own words."""
    words = _server_words(reply)
    failed = status.get("phase") == Phase.FAILED.value and status.get("reason")
    reason = status["reason"] if failed else Reason.INVALID_SPEC.value
    what = f"{status.get('message')}; " if failed else ""
    return _event(reason, f"{what}the API server refuses to store this job's status ({words}); fix or recreate the object")
