"""What the operator observed of a job's world: compact records of its children and its trainer.

The summarize_* functions turn a watched object's body into a small frozen record (what kopf's
indices keep in memory), so that the reconcile reads the cluster from memory, not from the API
server. `Observed` gathers the records of one job. Pure; depends on the standard library,
the vocabulary and `job`.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from ppo_operator.job import parse_time
from ppojob_api.vocabulary import KIND, LABEL_ATTEMPT, LABEL_ROLE, PROGRESS_KEY, ROLE_HEAD


def _attempt(labels: Mapping[str, str]) -> int | None:
    value = labels.get(LABEL_ATTEMPT, "")
    return int(value) if value.isdigit() else None


@dataclasses.dataclass(frozen=True)
class PodRecord:
    name: str
    attempt: int | None
    role: str
    phase: str
    node: str | None
    created: datetime | None
    scheduled_at: datetime | None
    unschedulable: str
    """The scheduler's reason and message while the pod is not placed ("" once placed)."""
    deleting: bool
    uid: str = ""
    ready: bool = True
    """The pod's Ready condition is True (the kubelet says its containers are ready; the node
    controller sets it False when the node stops reporting)."""


@dataclasses.dataclass(frozen=True)
class ClusterRecord:
    name: str
    attempt: int | None
    ready: bool
    state: str
    suspended: bool
    deleting: bool
    uid: str = ""


@dataclasses.dataclass(frozen=True)
class PodGroupRecord:
    name: str
    attempt: int | None
    api_version: str
    kind: str
    summary: Mapping[str, Any]
    """{'spec': {'minMember'}, 'status': {...}}: what a gang backend needs to describe its state."""
    deleting: bool
    uid: str = ""


def summarize_pod(body: Mapping[str, Any]) -> PodRecord:
    meta, spec, status = body.get("metadata", {}), body.get("spec", {}), body.get("status", {}) or {}
    labels = meta.get("labels") or {}
    scheduled = next((c for c in status.get("conditions") or [] if c.get("type") == "PodScheduled"), None)
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    unschedulable = ""
    if not spec.get("nodeName") and scheduled and scheduled.get("status") == "False":
        unschedulable = f"{scheduled.get('reason', 'Unschedulable')}: {scheduled.get('message', '')}".strip()
    return PodRecord(
        name=meta.get("name", ""),
        attempt=_attempt(labels),
        role=labels.get(LABEL_ROLE, ""),
        phase=status.get("phase") or "Pending",
        node=spec.get("nodeName") or None,
        created=parse_time(meta.get("creationTimestamp")),
        scheduled_at=parse_time(scheduled.get("lastTransitionTime")) if scheduled and scheduled.get("status") == "True" else None,
        unschedulable=unschedulable,
        deleting=bool(meta.get("deletionTimestamp")),
        uid=meta.get("uid", ""),
        ready=bool(ready and ready.get("status") == "True"),
    )


def summarize_raycluster(body: Mapping[str, Any]) -> ClusterRecord:
    meta, status = body.get("metadata", {}), body.get("status") or {}
    provisioned = any(
        c.get("type") == "RayClusterProvisioned" and c.get("status") == "True" for c in status.get("conditions") or []
    )
    state = status.get("state") or ""
    return ClusterRecord(
        name=meta.get("name", ""),
        attempt=_attempt(meta.get("labels") or {}),
        ready=state == "ready" or provisioned,
        state=state or ("provisioned" if provisioned else "pending"),
        suspended=bool((body.get("spec") or {}).get("suspend")),
        deleting=bool(meta.get("deletionTimestamp")),
        uid=meta.get("uid", ""),
    )


def summarize_pod_group(body: Mapping[str, Any]) -> PodGroupRecord:
    meta = body.get("metadata", {})
    return PodGroupRecord(
        name=meta.get("name", ""),
        attempt=_attempt(meta.get("labels") or {}),
        api_version=body.get("apiVersion", ""),
        kind=body.get("kind", "PodGroup"),
        summary={
            "spec": {"minMember": (body.get("spec") or {}).get("minMember")},
            "status": dict(body.get("status") or {}),
        },
        deleting=bool(meta.get("deletionTimestamp")),
        uid=meta.get("uid", ""),
    )


@dataclasses.dataclass(frozen=True)
class KueueCondition:
    """One condition of a Kueue Workload, in Kueue's own words."""

    reason: str
    message: str
    since: datetime | None


@dataclasses.dataclass(frozen=True)
class WorkloadRecord:
    """The Kueue Workload of a RayCluster: whether and where it is admitted, or why not."""

    name: str
    cluster: str
    """The RayCluster it was made for (its controller owner)."""
    queue: str
    cluster_queue: str
    """The ClusterQueue that reserved its quota ("" while none has)."""
    created: datetime | None
    admitted: KueueCondition | None
    """Its Admitted condition while True."""
    pending: KueueCondition | None
    """Its QuotaReserved condition while False: why Kueue does not admit it (yet)."""
    evicted: KueueCondition | None
    """Its Evicted condition while True: why Kueue took its admission back (preempted, ...)."""
    uid: str = ""


def _kueue_conditions(status: Mapping[str, Any]) -> dict[tuple[str, str], KueueCondition]:
    return {
        (c.get("type", ""), c.get("status", "")): KueueCondition(
            c.get("reason", ""), c.get("message", ""), parse_time(c.get("lastTransitionTime")))
        for c in status.get("conditions") or []
    }


def summarize_workload(body: Mapping[str, Any]) -> WorkloadRecord:
    meta, status = body.get("metadata", {}), body.get("status") or {}
    owner = next((o.get("name", "") for o in meta.get("ownerReferences") or []
                  if o.get("kind") == "RayCluster" and o.get("controller")), "")
    conditions = _kueue_conditions(status)
    return WorkloadRecord(
        name=meta.get("name", ""),
        cluster=owner,
        queue=(body.get("spec") or {}).get("queueName", ""),
        cluster_queue=(status.get("admission") or {}).get("clusterQueue", ""),
        created=parse_time(meta.get("creationTimestamp")),
        admitted=conditions.get(("Admitted", "True")),
        pending=conditions.get(("QuotaReserved", "False")),
        evicted=conditions.get(("Evicted", "True")),
        uid=meta.get("uid", ""),
    )


@dataclasses.dataclass(frozen=True)
class ReportRecord:
    """The trainer's latest report, from its progress ConfigMap."""

    owner_uid: str
    """The uid of the PPOJob that owns the ConfigMap (a job of the same name made later has another)."""
    progress: Mapping[str, Any] | None
    """`status.progress` as the trainer reported it; None before its first report, or if unreadable."""


def summarize_report(body: Mapping[str, Any]) -> ReportRecord:
    meta = body.get("metadata", {})
    owner = next((o.get("uid", "") for o in meta.get("ownerReferences") or [] if o.get("kind") == KIND), "")
    text = (body.get("data") or {}).get(PROGRESS_KEY)
    try:
        progress = json.loads(text) if text else None
    except ValueError:
        progress = None
    return ReportRecord(owner_uid=owner, progress=progress if isinstance(progress, dict) else None)


def report_of(reports: Iterable[ReportRecord], job_uid: str) -> Mapping[str, Any] | None:
    """The progress the job's own trainer last reported, if any."""
    return next((r.progress for r in reports if r.owner_uid == job_uid and r.progress is not None), None)


class TrainerState(str, enum.Enum):
    """What a launcher knows of the trainer of one attempt."""

    NOT_STARTED = "NotStarted"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    UNKNOWN = "Unknown"  # the launcher cannot tell now (e.g. the dashboard did not answer)


@dataclasses.dataclass(frozen=True)
class TrainerRecord:
    state: TrainerState = TrainerState.NOT_STARTED
    handle: str = ""
    """What identifies the trainer: a Ray submission id, or `local:<pid>`."""
    message: str = ""


@dataclasses.dataclass(frozen=True)
class Observed:
    """Everything compute_status needs beyond the job itself."""

    pods: tuple[PodRecord, ...] = ()
    clusters: tuple[ClusterRecord, ...] = ()
    pod_groups: tuple[PodGroupRecord, ...] = ()
    workloads: tuple[WorkloadRecord, ...] = ()
    """Kueue's Workloads of the job's RayClusters."""
    trainer: TrainerRecord = TrainerRecord()
    reference_problem: str | None = None
    """A referenced object (volume claim, secret) that does not exist, naming the field."""
    identity_ready: bool = False
    """The job's own children were ensured: the trainer's ServiceAccount, Role, RoleBinding and
    progress ConfigMap, the Ray token Secret, the NetworkPolicy."""

    def pods_of(self, attempt: int) -> list[PodRecord]:
        return [p for p in self.pods if p.attempt == attempt]

    def duplicate_heads(self, attempt: int) -> list[PodRecord]:
        """The attempt's head pods beside its oldest, while that one lives. KubeRay makes a second head
        when the reply to its create is lost (an API server restart) and then reconciles the cluster no
        more until all but one are deleted; the gang and its losses are counted without them."""
        heads = sorted((p for p in self.pods_of(attempt) if p.role == ROLE_HEAD),
                       key=lambda p: (p.created or datetime.min.replace(tzinfo=UTC), p.name))
        if len(heads) < 2 or heads[0].deleting or heads[0].phase in ("Failed", "Succeeded"):
            return []
        return heads[1:]

    def gang_pods(self, attempt: int) -> list[PodRecord]:
        """The attempt's pods less its duplicate heads: the members of its gang."""
        duplicates = self.duplicate_heads(attempt)
        return [p for p in self.pods_of(attempt) if p not in duplicates]

    def cluster_of(self, attempt: int) -> ClusterRecord | None:
        return next((c for c in self.clusters if c.attempt == attempt and not c.deleting), None)

    def workload_of(self, cluster: str) -> WorkloadRecord | None:
        return next((w for w in self.workloads if w.cluster == cluster), None)

    def pod_group_of(self, attempt: int) -> PodGroupRecord | None:
        return next((g for g in self.pod_groups if g.attempt == attempt and not g.deleting), None)

    def stale(self, attempt: int) -> list[ClusterRecord | PodGroupRecord | PodRecord]:
        """Children (and pods) of other attempts, still present."""
        items: Iterable[Any] = (*self.clusters, *self.pod_groups, *self.pods)
        return [item for item in items if item.attempt != attempt]
