"""The kopf wiring: the indices the daemon reads are the ones registered, under the same names
(a kopf handler's default id is its qualified name, which nested functions would not match)."""

from __future__ import annotations

import asyncio
import contextlib

import kopf
import pytest
from operator_factory import cluster, pod_group, pods

from ppo_operator import handlers
from ppo_operator.gang import pod_group_resources


def test_the_daemon_reads_every_registered_index_by_its_id():
    registry = kopf.OperatorRegistry()
    resources = tuple(pod_group_resources())
    handlers.register(registry, pod_group_resources=resources)
    index_ids = {h.id for h in registry._indexing.get_all_handlers()}  # kopf keeps no public listing
    assert {h.id for h in registry._spawning.get_all_handlers()} == {"ppojob"}
    runtime = handlers.Runtime(reconciler=None, launcher=None, pod_group_resources=resources)
    key = ("team-a", "tiny")
    records = {
        "ppojob_pods": pods(0, 2),
        "ppojob_rayclusters": (cluster(0),),
        handlers.pod_group_index(resources[0]): (pod_group(0),),
    }
    assert set(records) <= index_ids
    children = runtime.children(key, {name: {key: value} for name, value in records.items()})
    assert (len(children.pods), len(children.clusters), len(children.pod_groups)) == (2, 1, 1)


def test_wakers_wake_the_daemon_of_that_job_only():
    async def scenario():
        wakers = handlers.Wakers()
        mine, other = wakers.register(("ns", "a")), wakers.register(("ns", "b"))
        wakers.wake(("ns", "a"))
        assert mine.is_set() and not other.is_set()
        wakers.unregister(("ns", "a"), mine)
        wakers.wake(("ns", "a"))  # no daemon any more: nothing to do, no error

    asyncio.run(scenario())


def test_a_wake_by_the_job_itself_is_prompt_and_a_wake_by_a_child_is_not():
    async def scenario():
        wakers, stopped = handlers.Wakers(), asyncio.Event()
        event = wakers.register(("ns", "a"))
        wakers.wake(("ns", "a"))
        assert await wakers.sleep(event, stopped, 1) is False
        wakers.wake(("ns", "a"))
        wakers.wake(("ns", "a"), prompt=True)
        assert await wakers.sleep(event, stopped, 1) is True
        assert await wakers.sleep(event, stopped, 0.01) is False  # timed out: the flag went with the wake
        assert not event.is_set()

    asyncio.run(scenario())


class Stopped(asyncio.Event):
    """What run_job uses of kopf.DaemonStopped: false until set, wait(), reason."""

    reason = None

    def __bool__(self) -> bool:
        return self.is_set()


class CountingReconciler:
    def __init__(self, delay: float | None = None):
        self.passes, self.delay = 0, delay  # delay None: sleep until woken

    async def reconcile(self, body, children, memory) -> float | None:
        self.passes += 1
        return self.delay


def test_the_daemon_reconciles_a_report_at_once_and_lets_child_bursts_settle():
    async def scenario():
        reconciler = CountingReconciler()
        runtime = handlers.Runtime(reconciler=reconciler, launcher=None, pod_group_resources=(), debounce_s=30)
        stopped = Stopped()
        key = ("ns", "a")
        daemon = asyncio.ensure_future(handlers.run_job(runtime, {"metadata": {}}, key, stopped, None, {}))
        await asyncio.sleep(0.05)
        assert reconciler.passes == 1
        runtime.wakers.wake(key, prompt=True)  # the trainer's report
        await asyncio.sleep(0.05)
        assert reconciler.passes == 2
        runtime.wakers.wake(key)  # a pod changed: wait out the burst
        await asyncio.sleep(0.05)
        assert reconciler.passes == 2
        daemon.cancel()  # it is in the debounce's sleep
        with contextlib.suppress(asyncio.CancelledError):
            await daemon

    asyncio.run(scenario())


class NoCopy(dict):
    """A part of an object that kopf's diff-base must not copy (it throws it away)."""

    def __deepcopy__(self, memo):
        raise AssertionError("copied a part the essence drops")


def watched_pod(status: dict, managed: list) -> dict:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "p", "namespace": "ns", "uid": "u1", "resourceVersion": "9",
                     "labels": {"ppojob.io/job-name": "tiny"},
                     "annotations": {"keep": "me", "ppojob.io/last-handled-configuration": "{}",
                                     "kubectl.kubernetes.io/last-applied-configuration": "{}"},
                     "ownerReferences": [{"kind": "RayCluster", "name": "c", "uid": "u0"}],
                     "managedFields": managed},
        "spec": {"containers": [{"name": "ray-head", "image": "rayproject/ray"}]},
        "status": status,
    }


def test_the_lean_diff_base_is_kopfs_own_essence_without_copying_status_or_managed_fields():
    lean, kopfs = handlers.LeanDiffBaseStorage(prefix="ppojob.io"), kopf.AnnotationsDiffBaseStorage(prefix="ppojob.io")
    plain = watched_pod({"phase": "Running"}, [{"manager": "kwok"}])
    assert lean.build(body=kopf.Body(plain)) == kopfs.build(body=kopf.Body(plain))
    assert lean.build(body=kopf.Body(plain))["metadata"] == {"labels": {"ppojob.io/job-name": "tiny"},
                                                              "annotations": {"keep": "me"}}
    lean.build(body=kopf.Body(watched_pod(NoCopy(phase="Running"), [NoCopy(manager="kwok")])))
    with contextlib.suppress(AssertionError):
        kopfs.build(body=kopf.Body(watched_pod(NoCopy(phase="Running"), [NoCopy(manager="kwok")])))
        raise RuntimeError("kopf's own storage no longer copies the whole object: LeanDiffBaseStorage can go")


def configured_settings(**register: object) -> kopf.OperatorSettings:
    """kopf's settings after the operator's startup handler ran."""
    registry = kopf.OperatorRegistry()
    handlers.register(registry, pod_group_resources=(), **register)
    settings = kopf.OperatorSettings()
    for handler in registry._activities.get_all_handlers():
        if handler.id == "configure":
            handler.fn(settings=settings)
    return settings


def test_the_operator_uses_the_lean_diff_base():
    settings = configured_settings()
    assert isinstance(settings.persistence.diffbase_storage, handlers.LeanDiffBaseStorage)


@pytest.mark.parametrize("namespaced", [True, False])
def test_an_operator_given_namespaces_keeps_watching_them_while_they_terminate(namespaced):
    """kopf's namespace scanning would stop watching a terminating namespace before its PPOJobs'
    finalizers are off (the integration test deletes such a namespace)."""
    assert configured_settings(namespaced=namespaced).scanning.disabled is namespaced
