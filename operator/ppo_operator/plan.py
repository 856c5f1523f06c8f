"""plan_actions: what the reconcile must do so that the world matches the status just computed.

Level-triggered and idempotent: the plan is a function of the new status and what was observed,
so a plan made again after a crash asks for the same objects (by their deterministic names) and
the `ensure_*` steps find them. Also `next_wakeup`: the nearest deadline (gang timeout, trainer
heartbeat, active deadline, TTL), so the operator needs no polling of the API server. Pure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from ppo_operator.builders.common import BuildOptions
from ppo_operator.builders.pod_group import build_pod_group
from ppo_operator.builders.raycluster import build_raycluster
from ppo_operator.conditions import get_condition, is_true, transition_time
from ppo_operator.decisions import Policy, ttl_expires_at
from ppo_operator.gang import GroupResource, pod_group_resources
from ppo_operator.job import Job, parse_time
from ppo_operator.observed import Observed
from ppojob_api.spec import PPOJobSpec
from ppojob_api.vocabulary import ConditionType, Phase, Reason

RAYCLUSTERS = GroupResource("ray.io", "v1", "rayclusters", "RayCluster")
PODS = GroupResource("", "v1", "pods", "Pod")
ACTIVE = {Phase.PENDING, Phase.QUEUED, Phase.SCHEDULING, Phase.INITIALIZING, Phase.CRITIC_WARMUP, Phase.TRAINING, Phase.RESTARTING}


@dataclasses.dataclass(frozen=True)
class Deletion:
    resource: GroupResource
    name: str
    why: str


@dataclasses.dataclass(frozen=True)
class Plan:
    ensure_identity: bool = False
    """Ensure the job's own children: the trainer's identity and progress ConfigMap, the Ray token
    Secret and the NetworkPolicy (before the pod group and RayCluster, whose pods need them)."""
    pod_group: Mapping[str, Any] | None = None
    raycluster: Mapping[str, Any] | None = None
    deletions: tuple[Deletion, ...] = ()
    launch_attempt: int | None = None
    """Start the trainer of this attempt."""
    keep_trainer: int | None = None
    """Stop every trainer but this attempt's (None: stop them all)."""
    delete_job: bool = False
    revoke_identity: bool = False
    """Delete the trainer's ServiceAccount, Role, RoleBinding and progress ConfigMap (the job ended; its
    tokens die with them). The Ray token Secret and the NetworkPolicy stay until the job is deleted:
    the token opens only the job's clusters, which are gone."""

    @property
    def creates(self) -> bool:
        return bool(self.ensure_identity or self.pod_group or self.raycluster or self.launch_attempt is not None)


def pod_group_resource_of(api_version: str) -> GroupResource | None:
    return next((r for r in pod_group_resources() if r.api_version == api_version), None)


def _deletions(observed: Observed, keep_attempt: int | None, why: str) -> tuple[Deletion, ...]:
    result = [Deletion(RAYCLUSTERS, c.name, why) for c in observed.clusters if c.attempt != keep_attempt and not c.deleting]
    for group in observed.pod_groups:
        resource = pod_group_resource_of(group.api_version)
        if group.attempt != keep_attempt and not group.deleting and resource is not None:
            result.append(Deletion(resource, group.name, why))
    return tuple(result)


def plan_actions(
    job: Job, status: Mapping[str, Any], observed: Observed, now: datetime, *, policy: Policy, options: BuildOptions
) -> Plan:
    phase = Phase(status["phase"])
    spec, _ = job.parse()
    if phase not in ACTIVE:
        why = {Phase.SUSPENDED: "suspended"}.get(phase, f"job {phase.value.lower()}")
        expires = ttl_expires_at(spec, status)
        # The status written just before this plan no longer names the identity; the job's
        # previous status still does only on the pass that ended it, so it is revoked once (and if
        # the operator dies first, the garbage collector takes it with the job).
        ended = phase in (Phase.SUCCEEDED, Phase.FAILED)
        return Plan(
            deletions=_deletions(observed, None, why),
            keep_trainer=None,
            delete_job=bool(expires and expires <= now),
            revoke_identity=ended and "serviceAccount" in (job.status.get("children") or {}),
        )
    attempt = int(status["attempt"])
    cluster = observed.cluster_of(attempt)
    duplicates = tuple(
        Deletion(PODS, p.name, f"a second head pod of RayCluster {cluster.name if cluster else '?'}"
                               " (KubeRay stops reconciling a cluster with two heads)")
        for p in observed.duplicate_heads(attempt) if not p.deleting
    )
    deletions = _deletions(observed, attempt, f"attempt {attempt} replaces it") + duplicates
    if spec is None:  # not reached: an invalid spec is Failed; kept for type narrowing
        return Plan(deletions=deletions, keep_trainer=attempt)
    current = dataclasses.replace(job, status={**job.status, "attempt": attempt})
    backend = policy.backend(spec)
    pod_group = None
    if observed.pod_group_of(attempt) is None:
        pod_group = build_pod_group(current, spec, attempt=attempt, backend=backend)
    raycluster = None
    if observed.cluster_of(attempt) is None:
        raycluster = build_raycluster(current, spec, attempt=attempt, backend=backend, options=options)
    launch = status.get("reason") == Reason.TRAINER_PENDING.value
    return Plan(
        ensure_identity=not observed.identity_ready,
        pod_group=pod_group,
        raycluster=raycluster,
        deletions=deletions,
        launch_attempt=attempt if launch else None,
        # Queued: Kueue holds the RayCluster suspended (evicted: its pods are gone), so no trainer runs.
        keep_trainer=None if phase == Phase.QUEUED else attempt,
    )


def next_wakeup(
    spec: PPOJobSpec | None, status: Mapping[str, Any], progress: Mapping[str, Any], now: datetime, *, policy: Policy
) -> float | None:
    """Seconds until the nearest deadline that could change the status without any watch event."""
    deadlines: list[datetime] = []
    conditions = status.get("conditions") or []
    phase = status.get("phase")
    if spec is not None and phase in {p.value for p in ACTIVE}:
        gang = get_condition(conditions, ConditionType.GANG_SCHEDULED)
        if gang and gang.get("status") != "True":
            since = transition_time(conditions, ConditionType.GANG_SCHEDULED)
            if since:
                deadlines.append(since + timedelta(seconds=spec.scheduling.schedule_timeout_seconds))
        if is_true(conditions, ConditionType.TRAINER_RUNNING):
            times = [t for t in (transition_time(conditions, ConditionType.TRAINER_RUNNING),
                                 parse_time(progress.get("heartbeatTime"))) if t]
            if times:
                deadlines.append(max(times) + timedelta(seconds=policy.heartbeat_timeout_s))
        start = parse_time(status.get("startTime"))
        if start and spec.run_policy.active_deadline_seconds:
            deadlines.append(start + timedelta(seconds=spec.run_policy.active_deadline_seconds))
    expires = ttl_expires_at(spec, status)
    if expires:
        deadlines.append(expires)
    if not deadlines:
        return None
    return max(0.0, (min(deadlines) - now).total_seconds())
