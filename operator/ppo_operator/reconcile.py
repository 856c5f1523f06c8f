"""The reconcile path of one PPOJob, on one screen: observe, compute the status, write it if it
changed, tell the story in Events, then act on the plan.

The status is written before acting, so the decision (a new attempt, Failed, Suspended) is durable
before any child is deleted or created; a crash between the two is repaired by the next reconcile,
which derives the same plan from the stored status. Children are read from kopf's watch-fed indices
(passed in as `Children`), never polled, with one exception: the children of an earlier attempt
that linger for AUDIT_AFTER_S are looked up once more on the API server, because kopf lists again
after a watch's 410 Gone but never drops what the new list lacks, so a deletion that falls in that
gap would otherwise be waited for forever. Depends on everything pure, `kube` and a launcher.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from ppo_operator import names
from ppo_operator.builders.common import BuildOptions
from ppo_operator.builders.network_policy import build_network_policy
from ppo_operator.builders.ray_token import build_ray_token_secret
from ppo_operator.builders.rbac import build_progress_configmap, build_role, build_role_binding, build_service_account
from ppo_operator.decisions import Policy, should_confirm_children
from ppo_operator.events import (
    Event,
    compute_events,
    compute_progress_events,
    compute_refused_report_event,
    compute_refused_status_event,
)
from ppo_operator.gang import GroupResource
from ppo_operator.gang.kueue import LOCAL_QUEUES
from ppo_operator.job import Job
from ppo_operator.kube import PLURALS, PPOJOBS, SECRETS, Kube, KubeError, resource_of
from ppo_operator.launchers import Launcher
from ppo_operator.observed import (
    ClusterRecord,
    Observed,
    PodGroupRecord,
    PodRecord,
    ReportRecord,
    TrainerRecord,
    WorkloadRecord,
    report_of,
    summarize_pod,
    summarize_raycluster,
)
from ppo_operator.plan import PODS, RAYCLUSTERS, Plan, next_wakeup, plan_actions, pod_group_resource_of
from ppo_operator.status import compute_status, hold_routine_progress, operator_status, status_changed, status_patch
from ppojob_api.progress import MIN_INTERVAL_S, routine_interval
from ppojob_api.spec import PPOJobSpec
from ppojob_api.vocabulary import LABEL_JOB_NAME, GangScheduler, Reason

log = logging.getLogger(__name__)

PVCS = GroupResource("", "v1", "persistentvolumeclaims", "PersistentVolumeClaim")
# The deletions a job's Events tell of (its pod groups go unannounced, with their RayCluster).
DELETION_EVENTS = {RAYCLUSTERS: ("Normal", Reason.CLUSTER_DELETED), PODS: ("Warning", Reason.DUPLICATE_HEAD_DELETED)}


@dataclasses.dataclass(frozen=True)
class Children:
    """A job's children as the watches last saw them (all attempts)."""

    pods: tuple[PodRecord, ...] = ()
    clusters: tuple[ClusterRecord, ...] = ()
    pod_groups: tuple[PodGroupRecord, ...] = ()
    reports: tuple[ReportRecord, ...] = ()
    workloads: tuple[WorkloadRecord, ...] = ()


@dataclasses.dataclass
class JobMemory:
    """What one job's loop keeps between reconciles; all of it can be re-derived after a restart."""

    last_written: Mapping[str, Any] | None = None
    """The object as our last status patch returned it (newer than the watch until it catches up)."""
    identity_ready: bool = False
    """The job's own children were ensured by this loop: the trainer's ServiceAccount, Role,
    RoleBinding, progress ConfigMap, the Ray token Secret and the NetworkPolicy (after a restart they
    are ensured once more: six creates answered 409)."""
    references_checked: int | None = None
    reference_problem: str | None = None
    progress_seen: Mapping[str, Any] | None = None
    refused_generation: int | None = None
    """The generation whose status the API server refused to store (told once in an Event)."""
    folded_at: datetime | None = None
    """When the trainer's report was last folded into the status (with any status write of this loop)."""
    refused_report: Mapping[str, Any] | None = None
    """The trainer's report the API server refused to store in the status: ignored until the next one."""
    unseen: dict[tuple[str, str, str], datetime] = dataclasses.field(default_factory=dict)
    """Our creates and deletes of children that the watches have not shown yet: ("create" or
    "delete", kind, name) -> when. A reconcile that runs before the watch has delivered them (a
    job's own events wake its loop at once) would send them again, answered 409 or 404."""
    lingering_since: datetime | None = None
    """Since when (or the last audit) children of an earlier attempt are shown by the watches."""
    phantoms: set[str] = dataclasses.field(default_factory=set)
    """uids the watches still show that the API server no longer has (found by `Reconciler.audit`)."""


UNSEEN_S = 30.0
"""How long a create or delete waits for the watches before it may be sent again."""
AUDIT_AFTER_S = 10.0
"""How long children of an earlier attempt may linger before the API server is asked whether they exist."""


class JobGone(Exception):
    """The job's status cannot be written: the job no longer exists."""


def without_phantoms(children: Children, phantoms: set[str]) -> Children:
    """The children minus the records of objects known to be gone."""
    if not phantoms:
        return children
    pods, clusters, pod_groups = (tuple(r for r in records if r.uid not in phantoms)
                                  for records in (children.pods, children.clusters, children.pod_groups))
    return dataclasses.replace(children, pods=pods, clusters=clusters, pod_groups=pod_groups)


def child_resource(record: PodRecord | ClusterRecord | PodGroupRecord) -> GroupResource | None:
    """The API resource of a watched child's record (None: a pod group of no known scheduler)."""
    if isinstance(record, PodRecord):
        return PODS
    if isinstance(record, ClusterRecord):
        return RAYCLUSTERS
    return pod_group_resource_of(record.api_version)


def settle(memory: JobMemory, children: Children, now: datetime) -> None:
    """Forget the writes the watches now show (a created child there, a deleted one gone or going), or too old."""
    shown = {(c.kind, c.name): c.deleting for c in children.pod_groups}
    shown.update({("RayCluster", c.name): c.deleting for c in children.clusters})
    shown.update({("Pod", p.name): p.deleting for p in children.pods})
    for key, when in list(memory.unseen.items()):
        verb, kind, name = key
        done = (kind, name) in shown if verb == "create" else shown.get((kind, name), True)
        if done or (now - when).total_seconds() > UNSEEN_S:
            del memory.unseen[key]


def freshest(body: Mapping[str, Any], written: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """The watched body, or our own last write when the watch has not delivered it yet."""
    if written is None:
        return body
    try:
        newer = int(written["metadata"]["resourceVersion"]) > int(body["metadata"]["resourceVersion"])
    except (KeyError, TypeError, ValueError):
        newer = False
    return written if newer else body


def utcnow() -> datetime:
    return datetime.now(UTC)


class Reconciler:
    def __init__(
        self, *, kube: Kube, launcher: Launcher, policy: Policy, options: BuildOptions,
        post_event: Callable[[Job, Event], None], pause_after_pod_group_s: float = 0.0,
        clock: Callable[[], datetime] = utcnow,
    ):
        self.kube, self.launcher, self.policy, self.options = kube, launcher, policy, options
        self.post_event, self.pause_after_pod_group_s, self.clock = post_event, pause_after_pod_group_s, clock
        self.last_write_s = 0.0
        """How long the last status write took (any job's): it stretches `fold_interval`."""

    async def reconcile(self, body: Mapping[str, Any], children: Children, memory: JobMemory) -> float | None:
        """One pass; returns the seconds until a deadline needs another pass (None: only on events)."""
        job = Job.from_body(freshest(body, memory.last_written))
        report = report_of(children.reports, job.uid)
        job = job.with_report(None if report == memory.refused_report else report)
        if job.deleting:
            return None
        spec, _ = job.parse()
        children = without_phantoms(children, memory.phantoms)
        observed = await self.observe(job, spec, children, memory)
        now = self.clock()
        if await self.audit(job, observed, memory, now):
            return 0.0  # phantoms dropped: again, on what really exists
        settle(memory, children, now)
        status, held_s = hold_routine_progress(job, compute_status(job, observed, now, policy=self.policy),
                                               folded_at=memory.folded_at, now=now, interval_s=self.fold_interval())
        if status_changed(job, status):
            try:
                started = time.monotonic()
                memory.last_written = await self.kube.patch_status(PPOJOBS, job.namespace, job.name, status_patch(job, status))
                memory.folded_at, self.last_write_s = now, time.monotonic() - started
            except KubeError as exc:
                if exc.status == 404:
                    raise JobGone(f"{job.namespace}/{job.name}") from exc
                if exc.status != 422:
                    raise
                if job.report is not None and job.report != job.status.get("progress"):
                    self.refuse_report(job, exc.body, memory)
                    return 0.0  # again at once, as if the trainer had not reported it
                self.tell_refused(job, status, exc.body, memory)
                return None  # act on no decision that cannot be recorded; a change of the object retries
        self.tell(job, status, memory)
        plan = plan_actions(job, status, observed, now, policy=self.policy, options=self.options)
        launched = await self.apply(job, plan, memory)
        if launched:
            return 0.0
        wakeup = next_wakeup(spec, status, job.progress, now, policy=self.policy)
        if observed.trainer.handle and status.get("phase") not in ("Succeeded", "Failed", "Suspended"):
            wakeup = min(wakeup if wakeup is not None else self.launcher.poll_seconds, self.launcher.poll_seconds)
        if memory.lingering_since is not None:  # the audit is due even if no event comes
            wakeup = min(wakeup if wakeup is not None else AUDIT_AFTER_S, AUDIT_AFTER_S)
        if held_s is not None:  # the held report is folded then, unless a write comes first
            wakeup = min(wakeup if wakeup is not None else held_s, held_s)
        return wakeup

    def fold_interval(self) -> float:
        """How long a routine report may be held back: as the trainer's throttle, stretched by how
        long this operator's last status write took (a slow API server is a loaded one)."""
        return routine_interval(MIN_INTERVAL_S, self.last_write_s)

    async def audit(self, job: Job, observed: Observed, memory: JobMemory, now: datetime) -> bool:
        """Children of earlier attempts that linger AUDIT_AFTER_S (and every AUDIT_AFTER_S after)
        are looked up on the API server; those it no longer has become phantoms. True if any did."""
        lingering = observed.stale(job.attempt)
        if not lingering:
            memory.lingering_since = None
            return False
        if memory.lingering_since is None or (now - memory.lingering_since).total_seconds() < AUDIT_AFTER_S:
            memory.lingering_since = memory.lingering_since or now
            return False
        memory.lingering_since = now
        checked = [(r, resource) for r in lingering if r.uid and (resource := child_resource(r)) is not None]
        present: set[str] = set()
        for resource in {resource for _, resource in checked}:
            present |= await self.kube.list_uids(resource, job.namespace, f"{LABEL_JOB_NAME}={job.name}")
        gone = [(r, resource) for r, resource in checked if r.uid not in present]
        phantoms = {r.uid for r, _ in gone}
        if gone:
            log.warning("%s/%s: the watches still show %s, which the API server no longer has; dropped", job.namespace,
                        job.name, ", ".join(sorted(f"{resource.kind} {r.name}" for r, resource in gone)))
        memory.phantoms |= phantoms
        return bool(phantoms)

    async def observe(self, job: Job, spec: PPOJobSpec | None, children: Children, memory: JobMemory) -> Observed:
        attempt = job.attempt
        unchecked = spec is not None and memory.references_checked != attempt
        if unchecked and not any(c.attempt == attempt for c in children.clusters):
            memory.reference_problem = await self.check_references(job, spec)
            memory.references_checked = attempt
        trainer = await self.launcher.observe(job, attempt) if spec is not None else TrainerRecord()
        observed = Observed(
            pods=children.pods, clusters=children.clusters, pod_groups=children.pod_groups,
            workloads=children.workloads, trainer=trainer,
            reference_problem=memory.reference_problem, identity_ready=memory.identity_ready,
        )
        if spec is not None and should_confirm_children(job, spec, observed):
            selector = f"{LABEL_JOB_NAME}={job.name}"
            pods, clusters = await asyncio.gather(self.kube.list(PODS, job.namespace, selector),
                                                  self.kube.list(RAYCLUSTERS, job.namespace, selector))
            observed = dataclasses.replace(observed, pods=tuple(summarize_pod(p) for p in pods),
                                           clusters=tuple(summarize_raycluster(c) for c in clusters))
        return observed

    async def check_references(self, job: Job, spec: PPOJobSpec) -> str | None:
        """The objects the spec names and the schema cannot check: they must exist before the pods do."""
        wanted = [
            (spec.checkpoint.volume_claim, PVCS, "spec.checkpoint.volumeClaim"),
            (spec.env_from_secret, SECRETS, "spec.envFromSecret"),
        ]
        if spec.scheduling.gang_scheduler == GangScheduler.KUEUE:  # Kueue itself would only keep it pending
            wanted.append((spec.scheduling.queue, LOCAL_QUEUES, "spec.scheduling.queue"))
        for name, resource, field in wanted:
            if name and not await self.kube.exists(resource, job.namespace, name):
                return f"{field}: {resource.kind} {name!r} not found in namespace {job.namespace}; create it or fix the name"
        return None

    def tell_refused(self, job: Job, status: Mapping[str, Any], reply: str, memory: JobMemory) -> None:
        """Once per generation: the status that cannot be stored, as a Warning Event."""
        if memory.refused_generation != job.generation:
            memory.refused_generation = job.generation
            self.post_event(job, compute_refused_status_event(status, reply))

    def refuse_report(self, job: Job, reply: str, memory: JobMemory) -> None:
        """The trainer's report breaks the CRD's schema (a trainer of another version, or a bug): it is
        left out of the status, not allowed to stop the operator's own writes, and told in a Warning."""
        memory.refused_report = job.report
        self.post_event(job, compute_refused_report_event(reply))

    def tell(self, job: Job, status: Mapping[str, Any], memory: JobMemory) -> None:
        events = compute_events(operator_status(job.status), status)
        if memory.progress_seen is not None:
            events += compute_progress_events(memory.progress_seen, job.progress)
        memory.progress_seen = dict(job.progress)
        for event in events:
            self.post_event(job, event)

    def note(self, memory: JobMemory, verb: str, kind: str, name: str) -> None:
        """A create or delete that succeeded (or found it done): not to be sent again before the watches show it."""
        memory.unseen[(verb, kind, name)] = self.clock()

    async def apply(self, job: Job, plan: Plan, memory: JobMemory) -> bool:
        """Carry out the plan, each step idempotent; True when a trainer was launched."""
        for deletion in plan.deletions:
            if ("delete", deletion.resource.kind, deletion.name) in memory.unseen:
                continue
            deleted = await self.kube.ensure_deleted(deletion.resource, job.namespace, deletion.name)
            self.note(memory, "delete", deletion.resource.kind, deletion.name)
            if deleted and deletion.resource in DELETION_EVENTS:
                event_type, reason = DELETION_EVENTS[deletion.resource]
                self.post_event(job, Event(event_type, reason.value, f"{deletion.resource.kind} {deletion.name} deleted: {deletion.why}"))
        await self.launcher.stop_others(job, plan.keep_trainer)
        if plan.revoke_identity:
            for identity in (build_role_binding(job), build_role(job), build_service_account(job),
                             build_progress_configmap(job)):
                await self.kube.ensure_deleted(resource_of(identity, PLURALS[identity["kind"]]), job.namespace,
                                               identity["metadata"]["name"])
            memory.identity_ready = False
        if plan.ensure_identity:
            # A token Secret that exists keeps its token (409): the job's clusters already use it.
            for manifest in (build_service_account(job), build_role(job), build_role_binding(job),
                             build_progress_configmap(job), build_ray_token_secret(job, token=secrets.token_hex(32)),
                             build_network_policy(job, options=self.options)):
                await self.kube.ensure_created(manifest)
            memory.identity_ready = True
        created = []
        group = plan.pod_group
        if group is not None and ("create", group["kind"], group["metadata"]["name"]) not in memory.unseen:
            new = await self.kube.ensure_created(group)
            self.note(memory, "create", group["kind"], group["metadata"]["name"])
            if new:
                created.append(f"{plan.pod_group['kind']} {plan.pod_group['metadata']['name']} (minMember {plan.pod_group['spec']['minMember']})")
            if self.pause_after_pod_group_s:  # fault injection for the crash-between-creations test
                log.warning("pausing %.0fs after the pod group (--debug-pause-after-pod-group)", self.pause_after_pod_group_s)
                await asyncio.sleep(self.pause_after_pod_group_s)
        cluster = plan.raycluster
        if cluster is not None and ("create", "RayCluster", cluster["metadata"]["name"]) not in memory.unseen:
            new = await self.kube.ensure_created(cluster)
            self.note(memory, "create", "RayCluster", cluster["metadata"]["name"])
            if new:
                created.append(f"RayCluster {cluster['metadata']['name']}")
        if created:
            self.post_event(job, Event("Normal", Reason.CREATED.value, "created " + " and ".join(created)))
        launched = False
        if plan.launch_attempt is not None:
            record = await self.launcher.launch(job, plan.launch_attempt)
            launched = True
            log.info("trainer of %s/%s attempt %d: %s", job.namespace, job.name, plan.launch_attempt, record.handle)
        if plan.delete_job:
            self.post_event(job, Event("Normal", Reason.TTL_EXPIRED.value, "runPolicy.ttlSecondsAfterFinished passed: deleting the job"))
            await self.kube.ensure_deleted(PPOJOBS, job.namespace, job.name)
        return launched


def job_key(namespace: str, job_name: str) -> tuple[str, str]:
    """The key of a job's children in the indices: (namespace, value of ppojob.io/job-name)."""
    return namespace, names.job_label_value(job_name)


__all__ = ["Children", "JobMemory", "KubeError", "Reconciler", "freshest", "job_key"]
