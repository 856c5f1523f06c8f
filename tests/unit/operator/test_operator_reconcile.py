"""The reconcile path with recording fakes of the API and the launcher: what it writes, and when not."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
from datetime import timedelta

import pytest
from operator_factory import NOW, cluster, make_ppojob, pod_group, pods

from ppo_operator.builders.common import BuildOptions
from ppo_operator.decisions import Policy
from ppo_operator.kube import KubeError
from ppo_operator.observed import ReportRecord, TrainerRecord, TrainerState
from ppo_operator.reconcile import AUDIT_AFTER_S, Children, JobGone, JobMemory, Reconciler, freshest


def apply_merge_patch(target: dict, patch: dict) -> dict:
    """What the API server does with a JSON merge patch (RFC 7386)."""
    result = dict(target)
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = apply_merge_patch(result[key], value)
        else:
            result[key] = value
    return result


class FakeKube:
    def __init__(self):
        self.calls: list[tuple] = []
        self.rv = 100
        self.present: dict[str, set[str]] = {}  # what list_uids finds, by kind
        self.created: list[dict] = []
        self.listed: dict[str, list[dict]] = {}  # what list finds, by kind

    async def ensure_created(self, manifest):
        self.calls.append(("create", manifest["kind"], manifest["metadata"]["name"]))
        self.created.append(manifest)
        return True

    async def ensure_deleted(self, resource, namespace, name):
        self.calls.append(("delete", resource.kind, name))
        return True

    async def exists(self, resource, namespace, name):
        self.calls.append(("get", resource.kind, name))
        return name != "missing"

    async def list_uids(self, resource, namespace, label_selector):
        self.calls.append(("list", resource.kind, label_selector))
        return self.present.get(resource.kind, set())

    async def list(self, resource, namespace, label_selector):
        self.calls.append(("list", resource.kind, label_selector))
        return self.listed.get(resource.kind, [])

    async def patch_status(self, resource, namespace, name, patch):
        self.calls.append(("patch", "status", name))
        self.rv += 1
        stored = copy.deepcopy(self.body)
        stored["status"] = apply_merge_patch(stored.get("status", {}), patch["status"])
        stored["metadata"]["resourceVersion"] = str(self.rv)
        self.body = stored
        return stored


class FakeLauncher:
    poll_seconds = 2.0

    def __init__(self, state=TrainerState.NOT_STARTED):
        self.record = TrainerRecord(state, "local:1" if state != TrainerState.NOT_STARTED else "")
        self.launched: list[int] = []
        self.stopped: list = []

    async def observe(self, job, attempt):
        return self.record

    async def launch(self, job, attempt):
        self.launched.append(attempt)
        self.record = TrainerRecord(TrainerState.RUNNING, "local:1")
        return self.record

    async def stop_others(self, job, keep_attempt):
        self.stopped.append(keep_attempt)
        return []


SCHEDULING = Children(pods=pods(0, 3, placed=False, unschedulable="Unschedulable: waiting"),
                      clusters=(cluster(0, ready=False),), pod_groups=(pod_group(0),))
"""A gang whose pods and cluster exist, not yet placed."""


JOB_OWN_CREATES = [
    ("create", "ServiceAccount", "tiny-trainer"), ("create", "Role", "tiny-trainer"),
    ("create", "RoleBinding", "tiny-trainer"), ("create", "ConfigMap", "tiny-progress"),
    ("create", "Secret", "tiny-ray-token"), ("create", "NetworkPolicy", "tiny-ray-ingress"),
]
"""The job's own children, ensured once per loop, before the pod group and the RayCluster."""


def make(body, launcher=None):
    kube, launcher = FakeKube(), launcher or FakeLauncher()
    kube.body = body
    events = []
    reconciler = Reconciler(kube=kube, launcher=launcher, policy=Policy(), options=BuildOptions(),
                            post_event=lambda job, event: events.append(event), clock=lambda: NOW)
    return reconciler, kube, launcher, events


def test_first_reconcile_writes_status_then_creates_identity_pod_group_and_cluster_in_order():
    reconciler, kube, _, events = make(make_ppojob())
    memory = JobMemory(progress_seen={})
    asyncio.run(reconciler.reconcile(kube.body, Children(), memory))
    assert kube.calls == [
        ("patch", "status", "tiny"), *JOB_OWN_CREATES,
        ("create", "PodGroup", "tiny-a0"), ("create", "RayCluster", "tiny-a0"),
    ]
    assert [(e.reason, e.message) for e in events] == [
        ("Created", "created PodGroup tiny-a0 (minMember 3) and RayCluster tiny-a0")
    ]


def test_nothing_is_patched_or_created_when_nothing_changed():
    reconciler, kube, _, _ = make(make_ppojob())
    memory = JobMemory(progress_seen={})
    children = SCHEDULING
    asyncio.run(reconciler.reconcile(kube.body, children, memory))  # writes Scheduling, ensures the identity
    kube.calls.clear()
    asyncio.run(reconciler.reconcile(kube.body, children, memory))
    assert kube.calls == []


def test_a_restarted_operator_ensures_the_identity_once_more_without_a_status_write():
    reconciler, kube, _, _ = make(make_ppojob())
    children = SCHEDULING
    asyncio.run(reconciler.reconcile(kube.body, children, JobMemory(progress_seen={})))
    assert kube.body["status"]["children"]["serviceAccount"] == "tiny-trainer"
    kube.calls.clear()
    # The status names the ServiceAccount, but a new daemon cannot know that it was created before
    # a crash: it ensures it again (answered 409 by a real API server), and writes nothing.
    asyncio.run(reconciler.reconcile(kube.body, children, JobMemory(progress_seen={})))
    assert kube.calls == JOB_OWN_CREATES


def test_each_job_gets_a_random_ray_token_of_its_own():
    tokens = []
    for name in ("tiny", "other"):
        reconciler, kube, _, _ = make(make_ppojob(name=name))
        asyncio.run(reconciler.reconcile(kube.body, Children(), JobMemory(progress_seen={})))
        (secret,) = [m for m in kube.created if m["kind"] == "Secret"]
        tokens.append(secret["stringData"]["token"])
    assert all(len(token) == 64 and int(token, 16) >= 0 for token in tokens)  # 256 random bits, hex
    assert tokens[0] != tokens[1]


def test_a_report_that_moves_the_phase_is_one_status_write_carrying_the_report():
    status = {"phase": "CriticWarmup", "attempt": 0, "restarts": 0,
              "children": {"rayCluster": "tiny-a0", "podGroup": "tiny-a0", "serviceAccount": "tiny-trainer"},
              "progress": {"attempt": 0, "criticOnlyStepsDone": 1, "criticOnlySteps": 2, "step": 1}}
    body = make_ppojob(status=status)
    reconciler, kube, _, events = make(body, FakeLauncher(TrainerState.RUNNING))
    ready = Children(pods=pods(0, 3), clusters=(cluster(0),), pod_groups=(pod_group(0),))
    memory = JobMemory(progress_seen=dict(status["progress"]), identity_ready=True)
    asyncio.run(reconciler.reconcile(kube.body, ready, memory))
    kube.calls.clear()
    report = {"attempt": 0, "criticOnlyStepsDone": 2, "criticOnlySteps": 2, "step": 2, "warmup": "2/2"}
    others = ReportRecord(owner_uid="an-earlier-job-of-this-name", progress={"attempt": 0, "finished": True})
    ours = ReportRecord(owner_uid=body["metadata"]["uid"], progress=report)
    reported = dataclasses.replace(ready, reports=(others, ours))
    asyncio.run(reconciler.reconcile(kube.body, reported, memory))
    assert kube.calls == [("patch", "status", "tiny")]
    assert kube.body["status"]["phase"] == "Training" and kube.body["status"]["progress"] == report
    assert "CriticWarmupDone" in [e.reason for e in events]
    kube.calls.clear()
    asyncio.run(reconciler.reconcile(kube.body, reported, memory))  # the same report again: nothing to write
    assert kube.calls == []


def test_a_routine_report_waits_for_the_fold_interval_and_is_folded_then_without_another_event():
    progress = {"attempt": 0, "criticOnlyStepsDone": 2, "criticOnlySteps": 2, "step": 2, "stage": "Generate"}
    status = {"phase": "Training", "attempt": 0, "restarts": 0,
              "children": {"rayCluster": "tiny-a0", "podGroup": "tiny-a0", "serviceAccount": "tiny-trainer"},
              "progress": progress}
    body = make_ppojob(status=status)
    reconciler, kube, _, _ = make(body, FakeLauncher(TrainerState.RUNNING))
    ready = Children(pods=pods(0, 3), clusters=(cluster(0),), pod_groups=(pod_group(0),))
    memory = JobMemory(progress_seen=dict(progress), identity_ready=True)

    def report(progress):
        return dataclasses.replace(ready, reports=(ReportRecord(owner_uid=body["metadata"]["uid"], progress=progress),))

    asyncio.run(reconciler.reconcile(kube.body, report(progress), memory))  # a fresh loop settles what it finds
    folded_at = memory.folded_at
    kube.calls.clear()
    routine = {**progress, "step": 3, "stage": "ActorTrain"}
    reconciler.clock = lambda: NOW + timedelta(seconds=4)
    wakeup = asyncio.run(reconciler.reconcile(kube.body, report(routine), memory))
    assert kube.calls == [] and kube.body["status"]["progress"]["step"] == 2  # held
    assert folded_at == NOW and 0 < wakeup <= reconciler.fold_interval() - 4
    reconciler.clock = lambda: NOW + timedelta(seconds=10)
    asyncio.run(reconciler.reconcile(kube.body, report(routine), memory))
    assert kube.calls == [("patch", "status", "tiny")] and kube.body["status"]["progress"] == routine
    kube.calls.clear()
    done = {**routine, "step": 4, "finished": True}  # what the operator acts on goes at once
    reconciler.clock = lambda: NOW + timedelta(seconds=11)
    asyncio.run(reconciler.reconcile(kube.body, report(done), memory))
    assert kube.calls[0] == ("patch", "status", "tiny") and kube.body["status"]["phase"] == "Succeeded"
    assert kube.body["status"]["progress"] == done


def test_a_report_the_schema_refuses_is_left_out_and_does_not_stop_the_operators_own_writes():
    status = {"phase": "Training", "attempt": 0, "restarts": 0,
              "children": {"rayCluster": "tiny-a0", "podGroup": "tiny-a0", "serviceAccount": "tiny-trainer"},
              "progress": {"attempt": 0, "criticOnlyStepsDone": 2, "criticOnlySteps": 2, "step": 3, "stage": "Generate"}}
    body = make_ppojob(status=status)
    launcher = FakeLauncher(TrainerState.RUNNING)
    reconciler, kube, _, events = make(body, launcher)
    stored = kube.patch_status

    async def schema(resource, namespace, name, patch):
        if (patch["status"].get("progress") or {}).get("stage") == "Failed":  # not a stage the CRD knows
            kube.calls.append(("refused", "status", name))
            raise KubeError(422, "Unprocessable Entity", '{"message": "status.progress.stage: Unsupported value"}')
        return await stored(resource, namespace, name, patch)

    kube.patch_status = schema
    ready = Children(pods=pods(0, 3), clusters=(cluster(0),), pod_groups=(pod_group(0),))
    memory = JobMemory(progress_seen=dict(status["progress"]), identity_ready=True)
    bad = {**status["progress"], "step": 4, "stage": "Failed", "error": "lost a node"}
    reported = dataclasses.replace(ready, reports=(ReportRecord(owner_uid=body["metadata"]["uid"], progress=bad),))
    assert asyncio.run(reconciler.reconcile(kube.body, reported, memory)) == 0.0  # again at once, without it
    assert [(e.type, e.reason) for e in events] == [("Warning", "ReportRefused")]
    assert "Unsupported value" in events[0].message
    asyncio.run(reconciler.reconcile(kube.body, reported, memory))  # the operator's own status is stored
    assert kube.calls[-1][:2] == ("patch", "status") and kube.body["status"]["progress"]["stage"] == "Generate"
    launcher.record = TrainerRecord(TrainerState.FAILED, "local:1", "the trainer exited with code 1")
    asyncio.run(reconciler.reconcile(kube.body, reported, memory))  # and so is its next decision
    assert kube.calls[-1][:2] != ("refused", "status") and kube.body["status"]["phase"] != "Training"
    assert "exited with code 1" in kube.body["status"]["message"]
    assert kube.body["status"]["progress"]["stage"] == "Generate"
    fixed = {**bad, "stage": "Generate"}  # the next report is folded again
    reported = dataclasses.replace(ready, reports=(ReportRecord(owner_uid=body["metadata"]["uid"], progress=fixed),))
    asyncio.run(reconciler.reconcile(kube.body, reported, memory))
    assert kube.body["status"]["progress"]["step"] == 4
    assert [e.reason for e in events].count("ReportRefused") == 1


def test_the_trainer_is_launched_once_and_the_status_follows():
    body = make_ppojob()
    reconciler, kube, launcher, _ = make(body)
    memory = JobMemory(progress_seen={}, identity_ready=True)
    children = Children(pods=pods(0, 3), clusters=(cluster(0),), pod_groups=(pod_group(0),))
    delay = asyncio.run(reconciler.reconcile(kube.body, children, memory))
    assert launcher.launched == [0] and delay == 0.0
    asyncio.run(reconciler.reconcile(kube.body, children, memory))
    assert launcher.launched == [0] and kube.body["status"]["phase"] == "CriticWarmup"


def test_a_missing_volume_claim_fails_the_job_naming_the_field_and_creates_nothing():
    reconciler, kube, _, events = make(make_ppojob(checkpoint={"volumeClaim": "missing"}))
    asyncio.run(reconciler.reconcile(kube.body, Children(), JobMemory(progress_seen={})))
    assert [c[0] for c in kube.calls] == ["get", "patch"]
    assert kube.body["status"]["phase"] == "Failed"
    assert kube.body["status"]["message"].startswith("spec.checkpoint.volumeClaim: PersistentVolumeClaim 'missing' not found")
    assert events[0].type == "Warning" and events[0].reason == "InvalidSpec"


def test_our_own_write_wins_until_the_watch_catches_up():
    stale = make_ppojob()
    written = {**stale, "metadata": {**stale["metadata"], "resourceVersion": "101"}}
    assert freshest(stale, written) is written
    newer = {**stale, "metadata": {**stale["metadata"], "resourceVersion": "102"}}
    assert freshest(newer, written) is newer and freshest(stale, None) is stale


def test_a_status_the_api_server_refuses_is_told_once_in_an_event_and_nothing_is_created():
    body = make_ppojob(ppo={"numRollouts": "many"})
    reconciler, kube, _, events = make(body)

    async def refuse(resource, namespace, name, patch):
        kube.calls.append(("patch", "status", name))
        raise KubeError(422, "Unprocessable Entity", '{"message": "spec: invalid data, expected int, got string"}')

    kube.patch_status = refuse
    memory = JobMemory(progress_seen={})
    assert asyncio.run(reconciler.reconcile(body, Children(), memory)) is None
    assert asyncio.run(reconciler.reconcile(body, Children(), memory)) is None  # woken again: told once
    assert kube.calls == [("patch", "status", "tiny")] * 2
    assert [(e.type, e.reason) for e in events] == [("Warning", "InvalidSpec")]
    assert events[0].message.startswith("spec.ppo.numRollouts: ") and "expected int, got string" in events[0].message


def test_a_job_whose_status_cannot_be_written_because_it_is_gone_ends_its_loop():
    reconciler, kube, _, _ = make(make_ppojob())

    async def gone(resource, namespace, name, patch):
        raise KubeError(404, "Not Found", '{"message": "ppojobs.ppojob.io \\"tiny\\" not found"}')

    kube.patch_status = gone
    with pytest.raises(JobGone, match="team-a/tiny"):
        asyncio.run(reconciler.reconcile(kube.body, Children(), JobMemory(progress_seen={})))
    assert creates(kube) == []


def creates(kube) -> list[tuple]:
    return [c for c in kube.calls if c[0] in ("create", "delete") and c[1] in ("PodGroup", "RayCluster")]


def test_a_create_the_watches_have_not_shown_yet_is_not_sent_again():
    reconciler, kube, _, _ = make(make_ppojob())
    memory = JobMemory(progress_seen={}, identity_ready=True)
    asyncio.run(reconciler.reconcile(kube.body, Children(), memory))
    asyncio.run(reconciler.reconcile(kube.body, Children(), memory))  # woken before the watch saw them
    assert creates(kube) == [("create", "PodGroup", "tiny-a0"), ("create", "RayCluster", "tiny-a0")]
    shown = Children(clusters=(cluster(0, ready=False),), pod_groups=(pod_group(0),))
    asyncio.run(reconciler.reconcile(kube.body, shown, memory))
    assert memory.unseen == {}
    kube.calls.clear()
    asyncio.run(reconciler.reconcile(kube.body, Children(), memory))  # both gone (deleted by someone): again
    assert creates(kube) == [("create", "PodGroup", "tiny-a0"), ("create", "RayCluster", "tiny-a0")]


def test_an_unseen_create_is_sent_again_after_a_while_and_a_failed_one_at_once():
    reconciler, kube, _, _ = make(make_ppojob())
    memory = JobMemory(progress_seen={}, identity_ready=True)
    asyncio.run(reconciler.reconcile(kube.body, Children(), memory))
    reconciler.clock = lambda: NOW + timedelta(seconds=31)
    kube.calls.clear()
    asyncio.run(reconciler.reconcile(kube.body, Children(), memory))
    assert creates(kube) == [("create", "PodGroup", "tiny-a0"), ("create", "RayCluster", "tiny-a0")]

    reconciler, kube, _, _ = make(make_ppojob())
    memory = JobMemory(progress_seen={}, identity_ready=True)

    async def refuse(manifest):
        kube.calls.append(("create", manifest["kind"], manifest["metadata"]["name"]))
        raise KubeError(500, "Internal Server Error", "etcd timeout")

    kube.ensure_created = refuse
    with contextlib.suppress(KubeError):
        asyncio.run(reconciler.reconcile(kube.body, Children(), memory))
    assert memory.unseen == {}


def test_a_delete_the_watches_have_not_shown_yet_is_not_sent_again():
    body = make_ppojob(status={"phase": "Succeeded", "attempt": 0})
    reconciler, kube, _, _ = make(body)
    memory = JobMemory(progress_seen={}, identity_ready=True)
    children = Children(clusters=(cluster(0),), pod_groups=(pod_group(0),))
    for _ in range(2):
        asyncio.run(reconciler.reconcile(kube.body, children, memory))
    assert creates(kube) == [("delete", "RayCluster", "tiny-a0"), ("delete", "PodGroup", "tiny-a0")]
    asyncio.run(reconciler.reconcile(kube.body, Children(), memory))
    assert memory.unseen == {}


def test_children_of_an_earlier_attempt_that_the_api_server_no_longer_has_stop_holding_the_restart():
    """kopf lists again after a watch's 410 Gone but never drops what the new list lacks: a pod of
    attempt 0 deleted in that gap stays in its index. After AUDIT_AFTER_S the restart asks the API
    server, drops what it no longer has, and goes on; what it still has is waited for."""
    body = make_ppojob(status={"phase": "Restarting", "attempt": 1, "restarts": 1})
    reconciler, kube, _, _ = make(body)
    memory = JobMemory(progress_seen={}, identity_ready=True)
    gone = pods(0, 2)
    children = Children(pods=gone + pods(1, 2), clusters=(cluster(1),), pod_groups=(pod_group(1, phase="Running"),))
    kube.present = {"Pod": {p.uid for p in pods(1, 2)}}
    wakeup = asyncio.run(reconciler.reconcile(kube.body, children, memory))
    assert kube.body["status"]["phase"] == "Restarting" and wakeup <= AUDIT_AFTER_S
    assert not [c for c in kube.calls if c[0] == "list"]  # not before AUDIT_AFTER_S

    reconciler.clock = lambda: NOW + timedelta(seconds=AUDIT_AFTER_S + 1)
    assert asyncio.run(reconciler.reconcile(kube.body, children, memory)) == 0.0
    assert ("list", "Pod", "ppojob.io/job-name=tiny") in kube.calls
    assert memory.phantoms == {p.uid for p in gone}
    asyncio.run(reconciler.reconcile(kube.body, children, memory))
    assert kube.body["status"]["phase"] != "Restarting"


def test_children_of_an_earlier_attempt_that_still_exist_are_waited_for_and_asked_about_again_later():
    body = make_ppojob(status={"phase": "Restarting", "attempt": 1, "restarts": 1})
    reconciler, kube, _, _ = make(body)
    memory = JobMemory(progress_seen={}, identity_ready=True)
    children = Children(pods=pods(0, 2) + pods(1, 2), clusters=(cluster(1),), pod_groups=(pod_group(1),))
    kube.present = {"Pod": {p.uid for p in children.pods}}
    for seconds in (0, AUDIT_AFTER_S + 1, AUDIT_AFTER_S + 2, 2 * AUDIT_AFTER_S + 2):
        reconciler.clock = lambda seconds=seconds: NOW + timedelta(seconds=seconds)
        asyncio.run(reconciler.reconcile(kube.body, children, memory))
    assert len([c for c in kube.calls if c[0] == "list"]) == 2 and memory.phantoms == set()
    assert kube.body["status"]["phase"] == "Restarting"


def test_the_trainers_identity_is_revoked_once_when_the_job_ends():
    """Succeeded (or Failed): the ServiceAccount, Role, RoleBinding and progress ConfigMap go at once (the
    tokens die with them), after the status that no longer names them is stored; later passes do not
    delete them again."""
    status = {"phase": "Training", "attempt": 0, "restarts": 0,
              "children": {"rayCluster": "tiny-a0", "podGroup": "tiny-a0", "serviceAccount": "tiny-trainer"},
              "progress": {"attempt": 0, "finished": True, "steps": "5/5"}}
    reconciler, kube, _, _ = make(make_ppojob(status=status), FakeLauncher(TrainerState.RUNNING))
    memory = JobMemory(progress_seen={}, identity_ready=True)
    children = Children(clusters=(cluster(0),), pod_groups=(pod_group(0),))
    asyncio.run(reconciler.reconcile(kube.body, children, memory))
    assert kube.body["status"]["phase"] == "Succeeded" and "serviceAccount" not in kube.body["status"]["children"]
    deletes = [c for c in kube.calls if c[0] == "delete"]
    assert deletes[-4:] == [("delete", "RoleBinding", "tiny-trainer"), ("delete", "Role", "tiny-trainer"),
                            ("delete", "ServiceAccount", "tiny-trainer"), ("delete", "ConfigMap", "tiny-progress")]
    assert kube.calls.index(("patch", "status", "tiny")) < kube.calls.index(deletes[-1])
    kube.calls.clear()
    asyncio.run(reconciler.reconcile(kube.body, Children(), memory))
    assert [c for c in kube.calls if c[0] == "delete"] == []


def pod_body(record) -> dict:
    """A pod as the API server lists it, for a record of operator_factory.pods."""
    placed = "2026-01-01T11:01:00Z"
    return {
        "metadata": {"name": record.name, "uid": record.uid, "creationTimestamp": "2026-01-01T11:00:00Z",
                     "labels": {"ppojob.io/job-name": "tiny", "ppojob.io/attempt": str(record.attempt),
                                "ppojob.io/role": record.role}},
        "spec": {"nodeName": record.node},
        "status": {"phase": record.phase, "conditions": [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": placed},
            {"type": "Ready", "status": "True", "lastTransitionTime": placed}]},
    }


def test_pods_the_index_lacks_are_asked_of_the_api_server_before_a_restart():
    """A replica that has just taken over (kopf peering) may reconcile before its pod index has listed
    a running job's pods and RayCluster: the API server is asked, and a gang that is all there is not
    lost."""
    reconciler, kube, _, _ = make(make_ppojob(), FakeLauncher(TrainerState.RUNNING))
    memory = JobMemory(progress_seen={}, identity_ready=True)
    placed = Children(pods=pods(0, 3), clusters=(cluster(0),), pod_groups=(pod_group(0, phase="Running"),))
    asyncio.run(reconciler.reconcile(kube.body, placed, memory))
    assert kube.body["status"]["phase"] == "CriticWarmup" and not [c for c in kube.calls if c[0] == "list"]
    unlisted = dataclasses.replace(placed, pods=(), clusters=())
    cluster_body = {"metadata": {"name": "tiny-a0", "uid": "uid-cluster-a0", "labels": {"ppojob.io/attempt": "0"}},
                    "status": {"state": "ready"}}
    kube.listed = {"Pod": [pod_body(p) for p in pods(0, 3)], "RayCluster": [cluster_body]}
    asyncio.run(reconciler.reconcile(kube.body, unlisted, memory))
    assert {("list", "Pod", "ppojob.io/job-name=tiny"), ("list", "RayCluster", "ppojob.io/job-name=tiny")} <= set(kube.calls)
    assert (kube.body["status"]["phase"], kube.body["status"]["restarts"]) == ("CriticWarmup", 0)
    kube.listed = {"Pod": [], "RayCluster": [cluster_body]}  # the pods are gone indeed
    asyncio.run(reconciler.reconcile(kube.body, unlisted, memory))
    assert (kube.body["status"]["phase"], kube.body["status"]["reason"]) == ("Restarting", "PodLost")
