"""kopf handlers: they decide nothing themselves, they feed the indices and wake the job's daemon.

Watches (server-side filtered by the label ppojob.io/job-name): pods, RayClusters and each enabled
scheduler's pod groups go into in-memory indices keyed by (namespace, job); any event on them, or
on the PPOJob itself (the trainer's progress reports included), wakes that job's daemon, which
runs `Reconciler.reconcile`. A daemon sleeps until woken or until its next deadline: no polling of
the API server. Depends on kopf, `reconcile`, `observed`.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import kopf

from ppo_operator.events import Event
from ppo_operator.gang import GroupResource
from ppo_operator.job import Job
from ppo_operator.launchers import Launcher
from ppo_operator.observed import summarize_pod, summarize_pod_group, summarize_raycluster
from ppo_operator.reconcile import Children, JobMemory, Reconciler, job_key
from ppojob_api.vocabulary import GROUP, LABEL_JOB_NAME, PLURAL, VERSION, Reason

log = logging.getLogger(__name__)

FINALIZER = "ppojob.io/operator"
CHILD = {LABEL_JOB_NAME: kopf.PRESENT}


class Wakers:
    """One asyncio.Event per running daemon, found by (namespace, job label).

    A wake by a child (pods, RayCluster, pod group) comes in bursts, so the daemon lets the burst
    settle (`Runtime.debounce_s`) before it reconciles; a wake by the job itself (a trainer's
    report, a spec change) is `prompt`: the daemon reconciles at once, as its status shows it.
    """

    def __init__(self) -> None:
        self._events: dict[tuple[str, str], set[asyncio.Event]] = collections.defaultdict(set)
        self._prompt: set[asyncio.Event] = set()

    def register(self, key: tuple[str, str]) -> asyncio.Event:
        event = asyncio.Event()
        self._events[key].add(event)
        return event

    def unregister(self, key: tuple[str, str], event: asyncio.Event) -> None:
        self._events[key].discard(event)
        self._prompt.discard(event)
        if not self._events[key]:
            del self._events[key]

    def wake(self, key: tuple[str, str], *, prompt: bool = False) -> None:
        for event in self._events.get(key, ()):
            event.set()
            if prompt:
                self._prompt.add(event)

    async def sleep(self, event: asyncio.Event, stopped: kopf.DaemonStopped, timeout: float | None) -> bool:
        """Until woken, stopped, or timeout seconds (None: no timeout); True if a wake was prompt."""
        waiters = {asyncio.ensure_future(event.wait()), asyncio.ensure_future(stopped.wait())}
        try:
            await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
        event.clear()
        prompt = event in self._prompt
        self._prompt.discard(event)
        return prompt


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
    wakers: Wakers = dataclasses.field(default_factory=Wakers)
    debounce_s: float = 0.05
    """How long a daemon woken by its children waits for the rest of their burst (not for the job's own events)."""

    def children(self, key: tuple[str, str], indices: Mapping[str, Any]) -> Children:
        def records(index_name: str) -> tuple:
            index = indices.get(index_name)
            return tuple(index.get(key, ())) if index is not None else ()

        return Children(
            pods=records("ppojob_pods"),
            clusters=records("ppojob_rayclusters"),
            pod_groups=tuple(r for res in self.pod_group_resources for r in records(pod_group_index(res))),
        )


def pod_group_index(resource: GroupResource) -> str:
    return f"ppojob_podgroups_{resource.group.replace('.', '_')}"


def post_event(job: Job, event: Event) -> None:
    ref = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "PPOJob",
           "metadata": {"name": job.name, "namespace": job.namespace, "uid": job.uid}}
    kopf.event(ref, type=event.type, reason=event.reason, message=event.message[:1000])


def register(registry: kopf.OperatorRegistry, *, pod_group_resources: Iterable[GroupResource],
             namespaced: bool = False) -> None:
    """Register every handler into `registry` (pod groups only of the enabled gang schedulers).
    `namespaced`: the operator serves the namespaces it was given, not the whole cluster."""
    pod_group_resources = tuple(pod_group_resources)

    @kopf.on.startup(registry=registry, id="configure")
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.persistence.finalizer = FINALIZER
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
        settings.persistence.diffbase_storage = LeanDiffBaseStorage(prefix=GROUP)
        # Given namespaces are watched until the operator stops. With scanning on, kopf stops
        # watching a namespace as soon as it sees it terminating with no blocking condition yet,
        # before the namespace controller has deleted the PPOJobs: their finalizers then stay and
        # the namespace never goes. (The cost: CRDs created after the start are not picked up.)
        settings.scanning.disabled = namespaced
        settings.posting.level = logging.INFO
        settings.watching.label_selectors["v1", "pods"] = LABEL_JOB_NAME
        settings.watching.label_selectors["ray.io", "rayclusters"] = LABEL_JOB_NAME
        for resource in pod_group_resources:
            settings.watching.label_selectors[resource.group, resource.plural] = LABEL_JOB_NAME

    @kopf.on.cleanup(registry=registry, id="close_api")
    async def close_api(memo: kopf.Memo, **_: Any) -> None:
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

    watched = [("v1", "pods"), ("ray.io", "v1", "rayclusters")]
    for resource in pod_group_resources:
        kopf.index(resource.group, resource.version, resource.plural, labels=CHILD, registry=registry,
                   id=pod_group_index(resource))(_index_pod_group)
        watched.append((resource.group, resource.version, resource.plural))

    for selector in watched:
        kopf.on.event(*selector, labels=CHILD, registry=registry, id=f"wake_{'_'.join(selector).replace('.', '_')}")(
            _wake_parent
        )

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry, id="wake_job")
    async def wake_job(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
        memo.runtime.wakers.wake(job_key(namespace, name), prompt=True)

    @kopf.daemon(GROUP, VERSION, PLURAL, registry=registry, cancellation_timeout=10.0, id="ppojob")
    async def ppojob(body: kopf.Body, namespace: str, name: str, stopped: kopf.DaemonStopped,
                     memo: kopf.Memo, logger: logging.Logger, **kwargs: Any) -> None:
        await run_job(memo.runtime, body, job_key(namespace, name), stopped, logger, kwargs)


async def _index_pod_group(namespace: str, labels: Mapping[str, str], body: kopf.Body, **_: Any):
    return {(namespace, labels[LABEL_JOB_NAME]): summarize_pod_group(body)}


async def _wake_parent(namespace: str, labels: Mapping[str, str], memo: kopf.Memo, **_: Any) -> None:
    memo.runtime.wakers.wake((namespace, labels[LABEL_JOB_NAME]))


async def run_job(runtime: Runtime, body: kopf.Body, key: tuple[str, str], stopped: kopf.DaemonStopped,
                  logger: logging.Logger, indices: Mapping[str, Any]) -> None:
    """A job's lifetime in this operator: reconcile, sleep until woken or due, repeat; never crash."""
    wake = runtime.wakers.register(key)
    memory = JobMemory(progress_seen=dict((body.get("status") or {}).get("progress") or {}))
    failures = 0
    try:
        while not stopped:
            try:
                delay = await runtime.reconciler.reconcile(body, runtime.children(key, indices), memory)
                failures = 0
            except Exception as exc:  # a bad object or a flaky API must never stop the others
                failures += 1
                delay = min(60.0, 2.0 ** failures)
                logger.exception("reconcile failed (retry in %.0fs)", delay)
                if failures == 1:
                    post_event(Job.from_body(body), Event("Warning", Reason.RECONCILE_ERROR.value,
                                                          f"{type(exc).__name__}: {exc}; retrying"))
            if delay == 0:
                continue
            prompt = await runtime.wakers.sleep(wake, stopped, delay)
            if runtime.debounce_s and not prompt and not stopped:
                await asyncio.sleep(runtime.debounce_s)  # let a burst of child events settle
    finally:
        runtime.wakers.unregister(key, wake)
        if stopped.reason and stopped.reason & kopf.DaemonStoppingReason.RESOURCE_DELETED:
            await runtime.launcher.forget(Job.from_body(body))
