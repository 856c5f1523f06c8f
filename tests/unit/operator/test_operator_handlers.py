"""The kopf wiring: the indices a job's loop reads are the ones registered, under the same names
(a kopf handler's default id is its qualified name, which nested functions would not match); each
job's loop starts with its first event, reconciles the latest body, and stops with the job."""

from __future__ import annotations

import asyncio
import contextlib

import kopf
import pytest
from operator_factory import cluster, pod_group, pods

from ppo_operator import handlers
from ppo_operator.gang import pod_group_resources
from ppo_operator.observed import summarize_report
from ppo_operator.reconcile import JobGone


def test_the_job_loop_reads_every_registered_index_by_its_id():
    registry = kopf.OperatorRegistry()
    resources = tuple(pod_group_resources())
    handlers.register(registry, pod_group_resources=resources)
    index_ids = {h.id for h in registry._indexing.get_all_handlers()}  # kopf keeps no public listing
    assert "ppojob" in {h.id for h in registry._watching.get_all_handlers()}
    runtime = handlers.Runtime(reconciler=None, launcher=None, pod_group_resources=resources)
    key = ("team-a", "tiny")
    records = {
        "ppojob_pods": pods(0, 2),
        "ppojob_rayclusters": (cluster(0),),
        handlers.pod_group_index(resources[0]): (pod_group(0),),
        "ppojob_reports": (summarize_report({"metadata": {}, "data": {}}),),
    }
    assert set(records) <= index_ids
    children = runtime.children(key, {name: {key: value} for name, value in records.items()})
    assert (len(children.pods), len(children.clusters), len(children.pod_groups), len(children.reports)) == (2, 1, 1, 1)


def test_no_handler_makes_kopf_put_a_finalizer_on_a_ppojob():
    """A finalizer costs three PPOJob writes a job and leaves jobs stuck when the operator is gone first."""
    registry = kopf.OperatorRegistry()
    handlers.register(registry, pod_group_resources=tuple(pod_group_resources()))
    assert registry._spawning.get_all_handlers() == [] and registry._changing.get_all_handlers() == []


def body(uid: str = "u1") -> kopf.Body:
    return kopf.Body({"metadata": {"name": "a", "namespace": "ns", "uid": uid}})


class CountingReconciler:
    def __init__(self, delay: float | None = None):
        self.passes, self.delay, self.bodies = 0, delay, []  # delay None: sleep until woken

    async def reconcile(self, body, children, memory) -> float | None:
        self.passes += 1
        self.bodies.append(body)
        return self.delay


class ForgettingLauncher:
    def __init__(self):
        self.forgotten = []

    async def forget(self, job) -> None:
        self.forgotten.append(job.uid)


def make_runtime(**kwargs) -> tuple[handlers.Runtime, CountingReconciler, ForgettingLauncher]:
    reconciler, launcher = CountingReconciler(), ForgettingLauncher()
    return handlers.Runtime(reconciler=reconciler, launcher=launcher, pod_group_resources=(), **kwargs), reconciler, launcher


def start(runtime, key=("ns", "a")):
    return lambda loop: handlers.run_job(runtime, loop, key, {})


def test_a_jobs_events_start_one_loop_that_reconciles_the_latest_body_and_a_deletion_forgets_it():
    async def scenario():
        runtime, reconciler, launcher = make_runtime()
        key = ("ns", "a")
        loop = runtime.jobs.seen(key, body(), start(runtime))
        await asyncio.sleep(0.05)
        assert reconciler.passes == 1
        newer = kopf.Body({**body(), "status": {"phase": "Training"}})
        assert runtime.jobs.seen(key, newer, start(runtime)) is loop  # the same loop, woken at once
        await asyncio.sleep(0.05)
        assert reconciler.passes == 2 and reconciler.bodies[-1] is newer
        runtime.jobs.gone(key)
        await asyncio.wait_for(loop.task, 1)
        assert launcher.forgotten == ["u1"]
        runtime.jobs.wake(key)  # a child of a job that has no loop any more: nothing to do, no error

    asyncio.run(scenario())


def test_a_job_created_again_under_its_name_while_its_deletion_went_unseen_gets_a_new_loop():
    async def scenario():
        runtime, _, launcher = make_runtime()
        old = runtime.jobs.seen(("ns", "a"), body("u1"), start(runtime))
        await asyncio.sleep(0.05)
        new = runtime.jobs.seen(("ns", "a"), body("u2"), start(runtime))
        await asyncio.wait_for(old.task, 1)
        assert new is not old and launcher.forgotten == ["u1"] and not new.task.done()
        await runtime.jobs.stop_all(1)

    asyncio.run(scenario())


def test_the_operator_exiting_stops_every_loop_and_keeps_their_trainers():
    async def scenario():
        runtime, _, launcher = make_runtime()
        loops = [runtime.jobs.seen(("ns", name), body(name), start(runtime, ("ns", name))) for name in "ab"]
        await asyncio.sleep(0.05)
        await runtime.jobs.stop_all(1)
        assert all(loop.task.done() for loop in loops) and launcher.forgotten == []

    asyncio.run(scenario())


class EmptyIndex(kopf.Index):
    """An index as kopf hands it to a handler (kopf's own needs its indexer)."""

    def __getitem__(self, key):
        raise KeyError(key)

    def __iter__(self):
        return iter(())

    def __len__(self) -> int:
        return 0


def test_a_jobs_loop_keeps_the_indices_and_not_the_rest_of_its_first_event(monkeypatch):
    """kopf's other arguments (the event, its body, spec, patch, logger) hold that event's whole object:
    kept for the job's life, they would be one more copy of every PPOJob in memory."""
    registry = kopf.OperatorRegistry()
    handlers.register(registry, pod_group_resources=())
    (handler,) = [h for h in registry._watching.get_all_handlers() if h.id == "ppojob"]
    kept = {}

    async def run_job(runtime, loop, key, indices):
        kept.update(indices)

    monkeypatch.setattr(handlers, "run_job", run_job)
    pods_index = EmptyIndex()

    async def scenario():
        runtime, _, _ = make_runtime()
        await handler.fn(event={"type": "ADDED", "object": dict(body())}, body=body(), namespace="ns", name="a",
                         memo=kopf.Memo(runtime=runtime), ppojob_pods=pods_index, spec={}, patch={}, logger=None)
        await asyncio.sleep(0)
        await runtime.jobs.stop_all(1)

    asyncio.run(scenario())
    assert kept == {"ppojob_pods": pods_index}


def test_a_loop_that_finds_its_job_gone_forgets_it():
    async def scenario():
        runtime, reconciler, launcher = make_runtime()

        async def gone(body, children, memory):
            raise JobGone("ns/a")

        reconciler.reconcile = gone
        loop = runtime.jobs.seen(("ns", "a"), body(), start(runtime))
        await asyncio.wait_for(loop.task, 1)
        assert launcher.forgotten == ["u1"]
        new = runtime.jobs.seen(("ns", "a"), body("u2"), start(runtime))  # the name is free for a new loop
        assert new is not loop
        await runtime.jobs.stop_all(1)

    asyncio.run(scenario())


def test_the_loop_reconciles_a_report_at_once_and_lets_child_bursts_settle():
    async def scenario():
        runtime, reconciler, _ = make_runtime(debounce_s=30)
        key = ("ns", "a")
        loop = runtime.jobs.seen(key, body(), start(runtime))
        await asyncio.sleep(0.05)
        assert reconciler.passes == 1
        runtime.jobs.seen(key, body(), start(runtime))  # the trainer's report
        await asyncio.sleep(0.05)
        assert reconciler.passes == 2
        runtime.jobs.wake(key, prompt=True)  # the trainer's progress ConfigMap changed: at once too
        await asyncio.sleep(0.05)
        assert reconciler.passes == 3
        runtime.jobs.wake(key)  # a pod changed: wait out the burst
        await asyncio.sleep(0.05)
        assert reconciler.passes == 3
        loop.task.cancel()  # it is in the debounce's sleep
        with contextlib.suppress(asyncio.CancelledError):
            await loop.task

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
    """kopf's namespace scanning would stop watching a terminating namespace before its PPOJobs are
    deleted, so their loops would never see it (the integration test deletes such a namespace)."""
    assert configured_settings(namespaced=namespaced).scanning.disabled is namespaced
