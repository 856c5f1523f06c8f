"""Questions the reconcile asks, each answered with its reason so it can go into a condition and an event.

`is_*` answer yes/no about what was observed; `find_failure` names what went wrong with the
current attempt (a gang not placed in time, a lost pod, a dead or silent trainer); `Policy` holds
the operator-wide knobs. Pure: the clock comes in as `now`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from ppo_operator.builders.common import gang_of
from ppo_operator.conditions import is_true, transition_time
from ppo_operator.gang import GangBackend, backend_for
from ppo_operator.job import Job, parse_time
from ppo_operator.observed import Observed, PodRecord, TrainerState
from ppojob_api.spec import PPOJobSpec
from ppojob_api.vocabulary import ConditionType, GangScheduler, Reason


@dataclasses.dataclass(frozen=True)
class Policy:
    """Operator-wide settings of the decisions (flags of `ppo-operator`)."""

    heartbeat_timeout_s: float = 180.0
    """A running trainer that has not reported for this long is lost (and the job restarts)."""
    scheduler_names: Mapping[GangScheduler, str] = dataclasses.field(default_factory=dict)
    """schedulerName per gang scheduler, where the cluster's differs from the backend's default."""
    enabled: frozenset[GangScheduler] = frozenset(GangScheduler)
    """The gang schedulers this cluster runs; a job asking for another is an invalid spec."""

    def backend(self, spec: PPOJobSpec) -> GangBackend:
        return backend_for(spec.scheduling.gang_scheduler, self.scheduler_names)

    def check(self, spec: PPOJobSpec) -> str | None:
        """What this operator's cluster cannot run, naming the field."""
        scheduler = spec.scheduling.gang_scheduler
        if scheduler not in self.enabled:
            offered = ", ".join(sorted(s.value for s in self.enabled))
            return f"spec.scheduling.gangScheduler: {scheduler.value} is not available on this cluster; use one of {offered}"
        return self.backend(spec).check(spec)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """A failure of the current attempt: why, in words, and whether a restart may cure it."""

    reason: Reason
    message: str
    retryable: bool = True


@dataclasses.dataclass(frozen=True)
class Placement:
    placed: bool
    expected: int
    scheduled: int
    since: datetime | None
    """When the last pod of the gang was placed."""


def gang_placement(job: Job, spec: PPOJobSpec, observed: Observed, attempt: int) -> Placement:
    """All pods of the attempt's gang are bound to nodes."""
    expected = gang_of(job, spec, attempt).min_member
    pods = [p for p in observed.gang_pods(attempt) if not p.deleting]
    placed = [p for p in pods if p.node]
    times = [p.scheduled_at for p in placed if p.scheduled_at]
    return Placement(
        placed=len(placed) >= expected,
        expected=expected,
        scheduled=len(placed),
        since=max(times) if times else None,
    )


def should_confirm_children(job: Job, spec: PPOJobSpec, observed: Observed) -> bool:
    """The attempt's gang was placed, yet its RayCluster or some of its pods are not seen: gone, or
    not yet listed by this operator's indices (a replica that has just taken over from another).
    Before a restart is decided on it, the API server is asked."""
    attempt = job.attempt
    if not is_true(job.status.get("conditions") or [], ConditionType.GANG_SCHEDULED):
        return False
    seen = [p for p in observed.gang_pods(attempt) if not p.deleting]
    return observed.cluster_of(attempt) is None or len(seen) < gang_of(job, spec, attempt).min_member


def describe_pending_gang(
    job: Job, spec: PPOJobSpec, observed: Observed, attempt: int, backend: GangBackend
) -> str:
    """The scheduler's words on a gang not yet placed: its pod group's state and the pods' reasons."""
    placement = gang_placement(job, spec, observed, attempt)
    group = observed.pod_group_of(attempt)
    words = [f"{placement.scheduled}/{placement.expected} pods placed"]
    backend_words = backend.describe_pending(group.summary if group else None)
    if backend_words:
        words.append(backend_words)
    reasons = sorted({p.unschedulable for p in observed.pods_of(attempt) if p.unschedulable})
    if reasons:
        words.append("scheduler: " + " | ".join(reasons))
    return "; ".join(words)


def _lost_pods(pods: Sequence[PodRecord], placed_at: datetime | None, expected: int) -> list[str]:
    alive = [p for p in pods if not p.deleting and p.phase not in ("Failed", "Succeeded")]
    lost = [f"pod {p.name} {'deleted' if p.deleting else p.phase.lower()}" for p in pods if p not in alive]
    if placed_at:
        lost += [f"pod {p.name} replaced (created after the gang was placed)" for p in alive if p.created and p.created > placed_at]
    if not lost and len(alive) < expected:
        lost.append(f"{expected - len(alive)} of {expected} pods gone")
    return lost


def find_failure(
    job: Job,
    spec: PPOJobSpec,
    observed: Observed,
    conditions: Sequence[Mapping[str, Any]],
    now: datetime,
    policy: Policy,
) -> Verdict | None:
    """What went wrong with the current attempt, if anything; conditions are the new ones so far."""
    attempt = job.attempt
    backend = policy.backend(spec)
    placement = gang_placement(job, spec, observed, attempt)
    pending_since = transition_time(conditions, ConditionType.GANG_SCHEDULED)
    if not is_true(conditions, ConditionType.GANG_SCHEDULED):
        timeout = spec.scheduling.schedule_timeout_seconds
        if observed.cluster_of(attempt) and pending_since and (now - pending_since).total_seconds() >= timeout:
            words = describe_pending_gang(job, spec, observed, attempt, backend)
            return Verdict(
                Reason.GANG_TIMEOUT,
                f"the gang was not placed within scheduling.scheduleTimeoutSeconds ({timeout}s): {words}",
                retryable=False,
            )
        return None
    lost = _lost_pods(observed.gang_pods(attempt), pending_since, placement.expected)
    if lost or not observed.cluster_of(attempt):
        what = lost or [f"RayCluster of attempt {attempt} disappeared"]
        return Verdict(Reason.POD_LOST, "; ".join(what))
    trainer = observed.trainer
    if trainer.state == TrainerState.FAILED:
        error = job.progress.get("error")
        return Verdict(Reason.TRAINER_FAILED, trainer.message + (f"; trainer reported: {error}" if error else ""))
    if is_true(conditions, ConditionType.TRAINER_RUNNING) and trainer.state != TrainerState.SUCCEEDED:
        if trainer.state == TrainerState.NOT_STARTED:
            return Verdict(Reason.TRAINER_LOST, f"the trainer of attempt {attempt} is gone: {trainer.message}")
        started = transition_time(conditions, ConditionType.TRAINER_RUNNING)
        heartbeat = parse_time(job.progress.get("heartbeatTime"))
        last = max(t for t in (started, heartbeat) if t) if (started or heartbeat) else None
        if last and (now - last).total_seconds() > policy.heartbeat_timeout_s:
            return Verdict(
                Reason.TRAINER_LOST,
                f"no heartbeat from the trainer for {int((now - last).total_seconds())}s"
                f" (limit {int(policy.heartbeat_timeout_s)}s)",
            )
    return None


def is_finished_by_trainer(job: Job, observed: Observed) -> bool:
    """The trainer said it is done: its process or Ray job succeeded, or it reported finished."""
    return observed.trainer.state == TrainerState.SUCCEEDED or bool(job.progress.get("finished"))


def is_deadline_exceeded(spec: PPOJobSpec, start: datetime | None, now: datetime) -> bool:
    limit = spec.run_policy.active_deadline_seconds
    return bool(limit and start and (now - start).total_seconds() >= limit)


def ttl_expires_at(spec: PPOJobSpec | None, status: Mapping[str, Any]) -> datetime | None:
    """When a finished job is to be deleted (runPolicy.ttlSecondsAfterFinished), or None."""
    completed = parse_time(status.get("completionTime"))
    if spec is None or completed is None or spec.run_policy.ttl_seconds_after_finished is None:
        return None
    return completed + timedelta(seconds=spec.run_policy.ttl_seconds_after_finished)
