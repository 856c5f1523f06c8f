"""A job under Kueue, as compute_status and plan_actions see it: queued in Kueue's words, admitted,
evicted (preempted) without a restart, admitted again into the same RayCluster; a job that can
never fit its ClusterQueue fails naming the field."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta

from operator_factory import NOW, cluster, make_ppojob, pods

from ppo_operator.builders.common import BuildOptions
from ppo_operator.builders.submission import should_resume
from ppo_operator.decisions import Policy
from ppo_operator.job import Job, format_time
from ppo_operator.observed import (
    KueueCondition,
    Observed,
    TrainerRecord,
    TrainerState,
    WorkloadRecord,
    summarize_workload,
)
from ppo_operator.plan import plan_actions
from ppo_operator.status import compute_status

KUEUE = {"scheduling": {"gangScheduler": "Kueue", "queue": "ppo", "priorityClassName": "ppo-low"}}
QUEUED_AT = datetime(2026, 1, 1, 11, 0, 5, tzinfo=UTC)
ADMITTED_AT = datetime(2026, 1, 1, 11, 0, 30, tzinfo=UTC)
# Kueue's words for a pod set that fits one flavor once quota frees, and another never (cpu-node has no GPU).
NOT_NOW = ("couldn't assign flavors to pod set workers: insufficient unused quota for nvidia.com/gpu in flavor gpu-nodes, "
           "8 more needed, insufficient quota for nvidia.com/gpu in flavor cpu-node, previously considered podsets "
           "requests (0) + current podset request (8) > maximum capacity (0)")
NEVER = ("couldn't assign flavors to pod set workers: insufficient quota for nvidia.com/gpu in flavor gpu-nodes, previously "
         "considered podsets requests (0) + current podset request (16) > maximum capacity (8), insufficient quota for "
         "nvidia.com/gpu in flavor cpu-node, previously considered podsets requests (0) + current podset request (16) > "
         "maximum capacity (0)")
PREEMPTED = "Preempted to accommodate a workload (UID: u2, JobUID: j2) due to prioritization in the ClusterQueue"
RUNNING = TrainerRecord(TrainerState.RUNNING, "local:4242", "")


def suspended(attempt: int = 0):
    return dataclasses.replace(cluster(attempt, ready=False), suspended=True, state="suspended")


def workload(*, admitted=False, pending=None, evicted=None):
    return WorkloadRecord(
        name="raycluster-tiny-a0-1a2b3", cluster="tiny-a0", queue="ppo", cluster_queue="ppo-team" if admitted else "",
        created=QUEUED_AT, admitted=KueueCondition("Admitted", "The workload is admitted", ADMITTED_AT) if admitted else None,
        pending=KueueCondition("Pending", pending, QUEUED_AT) if pending else None,
        evicted=KueueCondition("Preempted", evicted, NOW) if evicted else None,
    )


def run(body, observed, now=NOW):
    return compute_status(Job.from_body(body), observed, now, policy=Policy())


def advance(body, status):
    return {**body, "status": status}


def cond(status, type_):
    return next(c for c in status["conditions"] if c["type"] == type_)


def admitted_and_training():
    """A Kueue job admitted, placed, ready and training; its status as written."""
    body = make_ppojob(**KUEUE)
    body = advance(body, run(body, Observed()))
    body = advance(body, run(body, Observed(clusters=(suspended(),), workloads=(workload(pending=NOT_NOW),))))
    placed = Observed(clusters=(cluster(0),), pods=pods(0, 3), workloads=(workload(admitted=True),), trainer=RUNNING)
    body = advance(body, run(body, placed, NOW + timedelta(seconds=1)))
    body = advance(body, run(body, placed, NOW + timedelta(seconds=2)))
    return body


def test_a_job_that_does_not_fit_now_is_queued_in_kueues_words_with_no_gang_clock():
    body = make_ppojob(**KUEUE)
    body = advance(body, run(body, Observed()))
    status = run(body, Observed(clusters=(suspended(),), workloads=(workload(pending=NOT_NOW),)), NOW + timedelta(days=1))
    assert (status["phase"], status["reason"]) == ("Queued", "Queued")
    assert status["message"] == f"LocalQueue ppo: {NOT_NOW}"
    admitted = cond(status, "Admitted")
    assert (admitted["status"], admitted["reason"], admitted["lastTransitionTime"]) == ("False", "Pending", format_time(QUEUED_AT))
    # A day in the queue is no gang timeout: the gang's clock starts at admission.
    assert cond(status, "GangScheduled")["status"] == "Unknown"


def test_a_queued_cluster_without_a_workload_says_kueue_has_not_made_one():
    body = make_ppojob(**KUEUE)
    body = advance(body, run(body, Observed()))
    status = run(body, Observed(clusters=(suspended(),)))
    assert status["phase"] == "Queued" and "waiting for Kueue to make the Workload of RayCluster tiny-a0" in status["message"]


def test_a_job_larger_than_its_whole_cluster_queue_fails_naming_the_field():
    body = make_ppojob(**KUEUE)
    body = advance(body, run(body, Observed()))
    status = run(body, Observed(clusters=(suspended(),), workloads=(workload(pending=NEVER),)))
    assert (status["phase"], status["reason"]) == ("Failed", "QueueCapacityExceeded")
    assert status["message"].startswith("spec.resources: the job asks for more than the ClusterQueue of LocalQueue ppo")
    assert "> maximum capacity (8)" in status["message"]


def test_an_admitted_job_says_when_and_where_in_kueues_words_and_runs():
    status = admitted_and_training()["status"]
    admitted = cond(status, "Admitted")
    assert (admitted["status"], admitted["reason"], admitted["lastTransitionTime"]) == ("True", "Admitted", format_time(ADMITTED_AT))
    assert "admitted by ClusterQueue ppo-team through LocalQueue ppo" in admitted["message"]
    assert f"queued since {format_time(QUEUED_AT)}" in admitted["message"]
    assert status["phase"] == "CriticWarmup"


def test_an_evicted_job_is_queued_again_without_a_restart_and_resumes_in_the_same_cluster():
    body = admitted_and_training()
    body["status"]["progress"] = {"attempt": 0, "step": 5, "lastCheckpoint": {"step": 4, "path": "/c/step-4"}}
    evicted = Observed(clusters=(suspended(),), workloads=(workload(evicted=PREEMPTED),), trainer=RUNNING)
    status = run(body, evicted, NOW + timedelta(seconds=3))
    assert (status["phase"], status["reason"]) == ("Queued", "Evicted")
    assert (status["restarts"], status["attempt"], status["evictions"]) == (0, 0, 1)
    assert PREEMPTED in status["message"] and "resumes from step 4" in status["message"]
    assert (cond(status, "Admitted")["status"], cond(status, "Admitted")["reason"]) == ("False", "Preempted")
    assert {cond(status, t)["status"] for t in ("GangScheduled", "ClusterReady", "TrainerRunning")} == {"Unknown"}
    assert "Failed" not in {c["type"] for c in status["conditions"]}
    body = advance(body, status)
    # Counted once, however often it is seen; the plan keeps the RayCluster and stops the trainer.
    assert run(body, evicted, NOW + timedelta(seconds=4))["evictions"] == 1
    plan = plan_actions(Job.from_body(body), status, evicted, NOW, policy=Policy(), options=BuildOptions())
    assert plan.deletions == () and plan.raycluster is None and plan.keep_trainer is None and plan.launch_attempt is None
    assert should_resume(Job.from_body(body), 0)
    # Admitted again: the same attempt's RayCluster, new pods; the trainer starts again (the old one is gone).
    again = Observed(clusters=(cluster(0),), pods=pods(0, 3, created=NOW + timedelta(seconds=20),
                                                       scheduled_at=NOW + timedelta(seconds=21)),
                     workloads=(workload(admitted=True),), trainer=TrainerRecord())
    status = run(body, again, NOW + timedelta(seconds=22))
    assert (status["phase"], status["reason"], status["attempt"], status["restarts"]) == ("Initializing", "TrainerPending", 0, 0)
    assert cond(status, "Admitted")["status"] == "True" and cond(status, "GangScheduled")["status"] == "True"
    plan = plan_actions(Job.from_body(advance(body, status)), status, again, NOW, policy=Policy(), options=BuildOptions())
    assert plan.launch_attempt == 0 and plan.deletions == ()


def test_a_workloads_record_reads_kueues_conditions_and_owner():
    body = {
        "metadata": {"name": "raycluster-tiny-a0-1a2b3", "uid": "w1", "creationTimestamp": "2026-01-01T11:00:05Z",
                     "ownerReferences": [{"kind": "RayCluster", "name": "tiny-a0", "controller": True}]},
        "spec": {"queueName": "ppo"},
        "status": {"admission": {"clusterQueue": "ppo-team"}, "conditions": [
            {"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved", "message": "", "lastTransitionTime": "2026-01-01T11:00:30Z"},
            {"type": "Admitted", "status": "True", "reason": "Admitted", "message": "The workload is admitted", "lastTransitionTime": "2026-01-01T11:00:30Z"},
            {"type": "Evicted", "status": "False", "reason": "QuotaReserved", "message": "", "lastTransitionTime": "2026-01-01T11:00:30Z"},
        ]},
    }
    assert summarize_workload(body) == WorkloadRecord(
        name="raycluster-tiny-a0-1a2b3", cluster="tiny-a0", queue="ppo", cluster_queue="ppo-team", created=QUEUED_AT,
        admitted=KueueCondition("Admitted", "The workload is admitted", ADMITTED_AT), pending=None, evicted=None, uid="w1",
    )


def test_a_restart_is_no_eviction_and_its_new_cluster_is_queued_afresh():
    body = admitted_and_training()
    lost = Observed(clusters=(cluster(0),), pods=pods(0, 2), workloads=(workload(admitted=True),), trainer=RUNNING)
    status = run(body, lost, NOW + timedelta(seconds=3))
    assert (status["phase"], status["restarts"], status["attempt"]) == ("Restarting", 1, 1)
    assert cond(status, "Admitted")["status"] == "Unknown"
    body = advance(body, status)
    queued = Observed(clusters=(suspended(1),), workloads=(dataclasses.replace(workload(pending=NOT_NOW), cluster="tiny-a1"),))
    status = run(body, queued, NOW + timedelta(seconds=4))
    assert (status["phase"], status["reason"], status.get("evictions", 0)) == ("Queued", "Queued", 0)
