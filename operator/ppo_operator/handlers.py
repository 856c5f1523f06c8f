"""kopf handlers: they decide nothing themselves, they feed the indices and wake the job's loop.

Watches (server-side filtered by the label ppojob.io/job-name): pods, RayClusters, each enabled
scheduler's pod groups and the trainers' progress ConfigMaps go into in-memory indices keyed by
(namespace, job); any event on them, or on the PPOJob itself, wakes that job's loop, which runs
`Reconciler.reconcile` (at once for a report or the job's own event; a child's burst settles
first). A loop sleeps until woken or until its next deadline: no polling of the API server.

Each job's loop is an asyncio task of ours (`Jobs`), started by the job's first watch event,
stopped by its deletion and standing by while kopf's peering pauses this replica (`leadership`),
not a kopf daemon: kopf puts a finalizer on every object that has a
daemon, and that finalizer cost three PPOJob writes a job (on; the deletion's timestamp; off) and
left PPOJobs stuck whenever the operator was gone before them. Nothing needs to block a deletion:
every child carries the job's owner reference, and the development launcher's leftovers of a
job deleted while no operator ran are swept when the next one starts (`Launcher.sweep`).
Depends on kopf, `reconcile`, `observed`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

import kopf

from ppo_operator import metrics
from ppo_operator.events import Event
from ppo_operator.gang import GroupResource
from ppo_operator.gang.kueue import WORKLOADS
from ppo_operator.job import Job
from ppo_operator.launchers import Launcher
from ppo_operator.leadership import Leadership
from ppo_operator.observed import (
    summarize_pod,
    summarize_pod_group,
    summarize_raycluster,
    summarize_report,
    summarize_workload,
)
from ppo_operator.reconcile import Children, JobGone, JobMemory, Reconciler, job_key
from ppojob_api.vocabulary import GROUP, LABEL_JOB_NAME, PLURAL, VERSION, Reason

log = logging.getLogger(__name__)

FINALIZER = "ppojob.io/operator"
CHILD = {LABEL_JOB_NAME: kopf.PRESENT}


@dataclasses.dataclass
class JobLoop:
    """One job's reconcile loop: the object as the watch last gave it, its wake-up call, its stop."""

    body: kopf.Body
    wake: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    stop: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    prompt: bool = False
    """The last wake was by the job itself (a trainer's report, a spec change): reconcile at once."""
    deleted: bool = False
    """Stopped because the job is gone (not because the operator exits): drop the launcher's state."""
    task: asyncio.Task | None = None

    def woken(self, *, prompt: bool) -> None:
        self.prompt |= prompt
        self.wake.set()

    async def sleep(self, timeout: float | None) -> bool:
        """Until woken, stopped, or timeout seconds (None: no timeout); True if a wake was prompt."""
        await self._until_stopped_or(self.wake.wait(), timeout)
        self.wake.clear()
        prompt, self.prompt = self.prompt, False
        return prompt

    async def stand_by(self, leadership: Leadership) -> None:
        """Until this replica serves again (another one of higher priority serves meanwhile), or stopped."""
        await self._until_stopped_or(leadership.wait_serving(), None)

    async def _until_stopped_or(self, awaitable: Awaitable[Any], timeout: float | None) -> None:
        waiters = {asyncio.ensure_future(awaitable), asyncio.ensure_future(self.stop.wait())}
        try:
            await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()


class Jobs:
    """The loop of every job this operator serves, by (namespace, name).

    A wake by a child (pods, RayCluster, pod group) comes in bursts, so the loop lets the burst
    settle (`Runtime.debounce_s`) before it reconciles; a wake by the job itself is prompt.
    """

    def __init__(self) -> None:
        self._loops: dict[tuple[str, str], JobLoop] = {}

    def seen(self, key: tuple[str, str], body: kopf.Body, start: Callable[[JobLoop], Awaitable[None]]) -> JobLoop:
        """The job's watch event: keep its body, start its loop if it has none, wake it promptly."""
        loop = self._loops.get(key)
        if loop is not None and loop.body.get("metadata", {}).get("uid") != body.get("metadata", {}).get("uid"):
            self.gone(key)  # deleted and created again under the same name while the deletion went unseen
            loop = None
        if loop is None:
            loop = self._loops[key] = JobLoop(body)
            loop.task = asyncio.create_task(start(loop), name=f"ppojob {key[0]}/{key[1]}")
            return loop
        loop.body = body
        loop.woken(prompt=True)
        return loop

    def gone(self, key: tuple[str, str]) -> None:
        """The job was deleted: its loop stops and drops what the launcher keeps of it."""
        loop = self._loops.pop(key, None)
        if loop is not None:
            loop.deleted = True
            loop.stop.set()

    def ended(self, key: tuple[str, str], loop: JobLoop) -> None:
        if self._loops.get(key) is loop:
            del self._loops[key]

    def wake(self, key: tuple[str, str], *, prompt: bool = False) -> None:
        """A child of the job changed, or (prompt) its trainer reported; nothing to do if the job has no loop."""
        loop = self._loops.get(key)
        if loop is not None:
            loop.woken(prompt=prompt)

    async def stop_all(self, timeout: float) -> None:
        """The operator exits: every loop stops (keeping its trainer, which the next operator adopts);
        those still busy after `timeout` seconds are cancelled."""
        loops, self._loops = list(self._loops.values()), {}
        for loop in loops:
            loop.stop.set()
        tasks = [loop.task for loop in loops if loop.task is not None]
        if tasks:
            _, busy = await asyncio.wait(tasks, timeout=timeout)
            for task in busy:
                task.cancel()
            await asyncio.gather(*busy, return_exceptions=True)


class LeanDiffBaseStorage(kopf.AnnotationsDiffBaseStorage):
    """kopf's own diff-base essence (spec, labels, annotations), without the whole-object copy.

    kopf builds the essence of every watched object on every event (pods, RayClusters and pod
    groups included) by deep-copying the object whole, status and managedFields too, and then
    dropping all but the spec, labels and annotations. Here only those parts are copied: the same
    essence, for a fraction of the CPU (at 500 jobs the whole-object copies were about a tenth
    of the event loop's time).
    """

    KEPT_METADATA = ("labels", "annotations", "ownerReferences")  # ownerReferences: kopf's key naming reads them

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> Any:
        if extra_fields:  # fields a handler asked for may be anywhere: kopf's own way
            return super().build(body=body, extra_fields=extra_fields)
        metadata = body.get("metadata") or {}
        slim = {key: value for key, value in body.items() if key not in ("metadata", "status")}
        slim["metadata"] = {key: metadata[key] for key in self.KEPT_METADATA if key in metadata}
        return super().build(body=kopf.Body(slim), extra_fields=extra_fields)


@dataclasses.dataclass
class Runtime:
    """What the handlers share, passed through kopf's memo."""

    reconciler: Reconciler
    launcher: Launcher
    pod_group_resources: tuple[GroupResource, ...]
    jobs: Jobs = dataclasses.field(default_factory=Jobs)
    leadership: Leadership = dataclasses.field(default_factory=Leadership)
    """Whether this replica serves (kopf's peering); standalone by default."""
    debounce_s: float = 0.05
    """How long a loop woken by its children waits for the rest of their burst (not for the job's own events)."""
    stop_timeout_s: float = 10.0
    """How long the loops get to finish a reconcile when the operator exits."""

    def children(self, key: tuple[str, str], indices: Mapping[str, Any]) -> Children:
        def records(index_name: str) -> tuple:
            index = indices.get(index_name)
            return tuple(index.get(key, ())) if index is not None else ()

        clusters = records("ppojob_rayclusters")
        workloads = indices.get("ppojob_workloads")
        return Children(
            pods=records("ppojob_pods"),
            clusters=clusters,
            pod_groups=tuple(r for res in self.pod_group_resources for r in records(pod_group_index(res))),
            reports=records("ppojob_reports"),
            workloads=() if workloads is None else tuple(
                w for c in clusters for w in workloads.get((key[0], c.name), ())),
        )


def pod_group_index(resource: GroupResource) -> str:
    return f"ppojob_podgroups_{resource.group.replace('.', '_')}"


def post_event(job: Job, event: Event) -> None:
    ref = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "PPOJob",
           "metadata": {"name": job.name, "namespace": job.namespace, "uid": job.uid}}
    kopf.event(ref, type=event.type, reason=event.reason, message=event.message[:1000])


def register(registry: kopf.OperatorRegistry, *, pod_group_resources: Iterable[GroupResource],
             namespaced: bool = False, kueue: bool = False) -> None:
    """Register every handler into `registry` (pod groups only of the enabled gang schedulers).
    `namespaced`: the operator serves the namespaces it was given, not the whole cluster.
    `kueue`: Kueue is enabled: its Workloads are watched too."""
    pod_group_resources = tuple(pod_group_resources)

    @kopf.on.startup(registry=registry, id="configure")
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        # No handler needs a finalizer any more; naming the one earlier versions put on makes kopf
        # take it off the PPOJobs that still carry it.
        settings.persistence.finalizer = FINALIZER
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
        settings.persistence.diffbase_storage = LeanDiffBaseStorage(prefix=GROUP)
        # Given namespaces are watched until the operator stops. With scanning on, kopf stops
        # watching a namespace as soon as it sees it terminating, before the namespace controller
        # has deleted the PPOJobs: their loops would never see their deletion, and (in versions
        # with a finalizer) the namespace never went. (The cost: CRDs created after the start are
        # not picked up.)
        settings.scanning.disabled = namespaced
        settings.posting.level = logging.INFO
        settings.watching.label_selectors["v1", "pods"] = LABEL_JOB_NAME
        settings.watching.label_selectors["ray.io", "rayclusters"] = LABEL_JOB_NAME
        settings.watching.label_selectors["v1", "configmaps"] = LABEL_JOB_NAME
        for resource in pod_group_resources:
            settings.watching.label_selectors[resource.group, resource.plural] = LABEL_JOB_NAME

    @kopf.on.startup(registry=registry, id="follow_peering")
    async def follow_peering(memo: kopf.Memo, **_: Any) -> None:
        memo.runtime.leadership.start()

    @kopf.on.startup(registry=registry, id="sweep")
    async def sweep(memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
        """Before any watch: what the launcher keeps of jobs deleted while no operator ran goes."""
        for folder in await memo.runtime.launcher.sweep():
            logger.info("dropped the trainer state of a job deleted while no operator ran: %s", folder)

    @kopf.on.cleanup(registry=registry, id="stop")
    async def stop(memo: kopf.Memo, **_: Any) -> None:
        await memo.runtime.jobs.stop_all(memo.runtime.stop_timeout_s)
        await memo.runtime.leadership.stop()
        await memo.runtime.reconciler.kube.close()

    @kopf.on.login(registry=registry, id="login")
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        """In-cluster token or KUBECONFIG, as the kubernetes client finds them (and as `Kube` does)."""
        return kopf.login_via_client(**kwargs)

    @kopf.index("v1", "pods", labels=CHILD, registry=registry, id="ppojob_pods")
    async def ppojob_pods(namespace: str, labels: Mapping[str, str], body: kopf.Body, **_: Any):
        return {(namespace, labels[LABEL_JOB_NAME]): summarize_pod(body)}

    @kopf.index("ray.io", "v1", "rayclusters", labels=CHILD, registry=registry, id="ppojob_rayclusters")
    async def ppojob_rayclusters(namespace: str, labels: Mapping[str, str], body: kopf.Body, **_: Any):
        return {(namespace, labels[LABEL_JOB_NAME]): summarize_raycluster(body)}

    @kopf.index("v1", "configmaps", labels=CHILD, registry=registry, id="ppojob_reports")
    async def ppojob_reports(namespace: str, labels: Mapping[str, str], body: kopf.Body, **_: Any):
        return {(namespace, labels[LABEL_JOB_NAME]): summarize_report(body)}

    @kopf.on.event("v1", "configmaps", labels=CHILD, registry=registry, id="wake_on_report")
    async def wake_on_report(namespace: str, labels: Mapping[str, str], memo: kopf.Memo, **_: Any) -> None:
        memo.runtime.jobs.wake((namespace, labels[LABEL_JOB_NAME]), prompt=True)  # as the job's own events

    watched = [("v1", "pods"), ("ray.io", "v1", "rayclusters")]
    for resource in pod_group_resources:
        kopf.index(resource.group, resource.version, resource.plural, labels=CHILD, registry=registry,
                   id=pod_group_index(resource))(_index_pod_group)
        watched.append((resource.group, resource.version, resource.plural))

    for selector in watched:
        kopf.on.event(*selector, labels=CHILD, registry=registry, id=f"wake_{'_'.join(selector).replace('.', '_')}")(
            _wake_parent
        )

    if kueue:
        _register_kueue(registry)

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry, id="ppojob")
    async def ppojob(event: kopf.RawEvent, body: kopf.Body, namespace: str, name: str, memo: kopf.Memo,
                     **kwargs: Any) -> None:
        runtime, key = memo.runtime, job_key(namespace, name)
        if event.get("type") == "DELETED":
            runtime.jobs.gone(key)
            return
        # The loop keeps the indices only: the other arguments hold this event's whole object.
        indices = {index_name: value for index_name, value in kwargs.items() if isinstance(value, kopf.Index)}
        runtime.jobs.seen(key, body, lambda loop: run_job(runtime, loop, key, indices))


def _register_kueue(registry: kopf.OperatorRegistry) -> None:
    """Kueue's Workloads carry none of the job's labels, only their RayCluster as owner: they are
    indexed by (namespace, RayCluster), and a second index of the RayClusters finds a cluster's job."""

    @kopf.index("ray.io", "v1", "rayclusters", labels=CHILD, registry=registry, id="ppojob_cluster_jobs")
    async def ppojob_cluster_jobs(namespace: str, name: str, labels: Mapping[str, str], **_: Any):
        return {(namespace, name): labels[LABEL_JOB_NAME]}

    @kopf.index(WORKLOADS.group, WORKLOADS.version, WORKLOADS.plural, registry=registry, id="ppojob_workloads")
    async def ppojob_workloads(namespace: str, body: kopf.Body, **_: Any):
        record = summarize_workload(body)
        return {(namespace, record.cluster): record} if record.cluster else None

    @kopf.on.event(WORKLOADS.group, WORKLOADS.version, WORKLOADS.plural, registry=registry, id="wake_on_workload")
    async def wake_on_workload(namespace: str, body: kopf.Body, memo: kopf.Memo, ppojob_cluster_jobs: kopf.Index,
                               **_: Any) -> None:
        cluster = summarize_workload(body).cluster
        for job in ppojob_cluster_jobs.get((namespace, cluster), ()) if cluster else ():
            memo.runtime.jobs.wake((namespace, job))


async def _index_pod_group(namespace: str, labels: Mapping[str, str], body: kopf.Body, **_: Any):
    return {(namespace, labels[LABEL_JOB_NAME]): summarize_pod_group(body)}


async def _wake_parent(namespace: str, labels: Mapping[str, str], memo: kopf.Memo, **_: Any) -> None:
    memo.runtime.jobs.wake((namespace, labels[LABEL_JOB_NAME]))


async def run_job(runtime: Runtime, loop: JobLoop, key: tuple[str, str], indices: Mapping[str, Any]) -> None:
    """A job's lifetime in this operator: reconcile, sleep until woken or due, repeat; never crash."""
    memory = JobMemory(progress_seen=dict((loop.body.get("status") or {}).get("progress") or {}))
    failures = 0
    try:
        while not loop.stop.is_set():
            if not runtime.leadership.is_serving():  # kopf paused this replica: its indices stand still
                await loop.stand_by(runtime.leadership)
                continue
            try:
                with metrics.RECONCILE_SECONDS.time():
                    delay = await runtime.reconciler.reconcile(loop.body, runtime.children(key, indices), memory)
                failures = 0
            except JobGone:  # deleted while its deletion went unseen (a watch gap)
                loop.deleted = True
                break
            except Exception as exc:  # a bad object or a flaky API must never stop the others
                failures += 1
                delay = min(60.0, 2.0 ** failures)
                log.exception("%s/%s: reconcile failed (retry in %.0fs)", *key, delay)
                if failures == 1:
                    post_event(Job.from_body(loop.body), Event("Warning", Reason.RECONCILE_ERROR.value,
                                                               f"{type(exc).__name__}: {exc}; retrying"))
            if delay == 0:
                continue
            prompt = await loop.sleep(delay)
            if runtime.debounce_s and not prompt and not loop.stop.is_set():
                await asyncio.sleep(runtime.debounce_s)  # let a burst of child events settle
    finally:
        runtime.jobs.ended(key, loop)
        if loop.deleted:
            await runtime.launcher.forget(Job.from_body(loop.body))
