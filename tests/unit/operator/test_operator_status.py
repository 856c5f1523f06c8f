"""compute_status through every phase, each failure, and the rule that an unchanged world patches nothing."""

from __future__ import annotations

from datetime import timedelta

import pytest
from operator_factory import NOW, cluster, make_job, make_ppojob, pod_group, pods

from ppo_operator.decisions import Policy
from ppo_operator.job import Job, format_time
from ppo_operator.observed import Observed, PodRecord, TrainerRecord, TrainerState
from ppo_operator.status import (
    compute_status,
    hold_routine_progress,
    merge_patch,
    operator_status,
    status_changed,
    status_patch,
)

RUNNING = TrainerRecord(TrainerState.RUNNING, "local:4242", "")


def cond(status, type_):
    return next(c for c in status["conditions"] if c["type"] == type_)


def advance(body, new_status, **changes):
    """The job as the next watch event shows it, after the operator's status patch."""
    body = {**body, "status": {**body.get("status", {}), **new_status}}
    body["status"].update(changes)
    return body


def run(body, observed, now=NOW, policy=None):
    return compute_status(Job.from_body(body), observed, now, policy=policy)


def test_a_new_job_is_pending_with_its_gang_clock_started():
    status = run(make_ppojob(), Observed())
    assert status["phase"] == "Pending" and status["attempt"] == 0 and status["restarts"] == 0
    assert status["startTime"] == format_time(NOW) and status["observedGeneration"] == 1
    # Every child it is about to create, the trainer's ServiceAccount too: one status write, not two.
    assert status["children"] == {"rayCluster": "tiny-a0", "podGroup": "tiny-a0", "serviceAccount": "tiny-trainer"}
    assert cond(status, "Valid")["status"] == "True"
    gang = cond(status, "GangScheduled")
    assert (gang["status"], gang["reason"], gang["lastTransitionTime"]) == ("False", "GangPending", format_time(NOW))


def test_a_gang_not_placed_is_scheduling_in_the_schedulers_words():
    body = make_ppojob()
    body = advance(body, run(body, Observed()))
    observed = Observed(
        clusters=(cluster(0, ready=False),), pod_groups=(pod_group(0, phase="Scheduling"),),
        pods=pods(0, 3, placed=False, unschedulable="Unschedulable: 0/4 nodes are available: 4 Insufficient nvidia.com/gpu."),
    )
    status = run(body, observed, NOW + timedelta(seconds=5))
    assert status["phase"] == "Scheduling" and status["reason"] == "GangPending"
    assert "0/3 pods placed" in status["message"]
    assert "coscheduling: pod group Scheduling, 0/3 pods scheduled" in status["message"]
    assert "4 Insufficient nvidia.com/gpu" in status["message"]
    assert cond(status, "GangScheduled")["lastTransitionTime"] == format_time(NOW)


def test_a_gang_not_placed_within_its_timeout_fails_with_the_schedulers_reason():
    body = make_ppojob(scheduling={"scheduleTimeoutSeconds": 60})
    body = advance(body, run(body, Observed()))
    observed = Observed(clusters=(cluster(0, ready=False),), pods=pods(0, 3, placed=False, unschedulable="Unschedulable: 0/4 nodes"))
    status = run(body, observed, NOW + timedelta(seconds=61))
    assert status["phase"] == "Failed" and status["reason"] == "GangScheduleTimeout" and status["restarts"] == 0
    assert "scheduleTimeoutSeconds (60s)" in status["message"] and "0/4 nodes" in status["message"]
    assert cond(status, "Failed")["reason"] == "GangScheduleTimeout"
    assert status["completionTime"] == format_time(NOW + timedelta(seconds=61))


def _placed(body, now=NOW):
    body = advance(body, run(body, Observed(), now))
    return body


def test_placed_gang_then_cluster_then_trainer_then_warmup_then_training_then_success():
    body = _placed(make_ppojob())
    placed_at = NOW + timedelta(seconds=3)
    gang = pods(0, 3, scheduled_at=placed_at, created=NOW + timedelta(seconds=1))
    # Placed, cluster not ready.
    status = run(body, Observed(clusters=(cluster(0, ready=False),), pods=gang), NOW + timedelta(seconds=4))
    assert (status["phase"], status["reason"]) == ("Initializing", "ClusterNotReady")
    assert cond(status, "GangScheduled")["lastTransitionTime"] == format_time(placed_at)
    body = advance(body, status)
    # Ready, trainer not started.
    ready = Observed(clusters=(cluster(0),), pods=gang, identity_ready=True)
    status = run(body, ready, NOW + timedelta(seconds=5))
    assert (status["phase"], status["reason"]) == ("Initializing", "TrainerPending")
    assert status["children"]["serviceAccount"] == "tiny-trainer"
    body = advance(body, status)
    # Trainer started, warm-up 1 of 2.
    running = Observed(clusters=(cluster(0),), pods=gang, identity_ready=True, trainer=RUNNING)
    body["status"]["progress"] = {"criticOnlyStepsDone": 1, "criticOnlySteps": 2, "heartbeatTime": format_time(NOW)}
    status = run(body, running, NOW + timedelta(seconds=6))
    assert status["phase"] == "CriticWarmup" and cond(status, "CriticWarmup")["status"] == "True"
    assert cond(status, "TrainerRunning")["message"] == "trainer local:4242 (attempt 0)"
    assert status["children"]["submission"] == "local:4242"
    body = advance(body, status)
    # Warm-up done.
    body["status"]["progress"] = {"criticOnlyStepsDone": 2, "criticOnlySteps": 2, "step": 3, "heartbeatTime": format_time(NOW)}
    status = run(body, running, NOW + timedelta(seconds=7))
    assert status["phase"] == "Training" and cond(status, "CriticWarmup")["reason"] == "CriticWarmupDone"
    body = advance(body, status)
    # Finished.
    body["status"]["progress"].update(finished=True, steps="5/5", lastExport={"step": 5, "path": "/c/export/final"})
    status = run(body, running, NOW + timedelta(seconds=8))
    assert (status["phase"], status["message"]) == ("Succeeded", "5/5 steps done; exported to /c/export/final")
    assert cond(status, "Succeeded")["status"] == "True" and cond(status, "TrainerRunning")["status"] == "False"
    assert (cond(status, "GangScheduled")["status"], cond(status, "GangScheduled")["reason"]) == ("False", "ClusterDeleted")
    assert cond(status, "CriticWarmup")["reason"] == "CriticWarmupDone"  # not rewritten at the end
    assert status["completionTime"] == format_time(NOW + timedelta(seconds=8))
    assert "serviceAccount" not in status["children"]  # revoked with the end of the job
    assert status_patch(Job.from_body(body), status)["status"]["children"] == {"serviceAccount": None}


def _running_body(**spec):
    body = _placed(make_ppojob(**spec))
    gang = pods(0, 3, scheduled_at=NOW, created=NOW - timedelta(seconds=2))
    running = Observed(clusters=(cluster(0),), pods=gang, identity_ready=True, trainer=RUNNING)
    body = advance(body, run(body, running, NOW + timedelta(seconds=1)))
    assert body["status"]["phase"] == "CriticWarmup"
    return body, gang


def test_the_trainers_evaluation_is_folded_into_the_status_as_reported():
    body, gang = _running_body()
    report = {"attempt": 0, "step": 4, "criticOnlyStepsDone": 2, "criticOnlySteps": 2, "heartbeatTime": format_time(NOW),
              "evaluation": {"step": 4, "rewardMean": 0.42, "passRate": 0.3, "samples": 64}}
    running = Observed(clusters=(cluster(0),), pods=gang, identity_ready=True, trainer=RUNNING)
    status = compute_status(Job.from_body(body).with_report(report), running, NOW + timedelta(seconds=2))
    assert status["phase"] == "Training" and status["progress"]["evaluation"] == report["evaluation"]
    body = advance(body, status)
    later = {**report, "step": 5, "evaluation": {"step": 5, "rewardMean": 0.5, "samples": 64}}
    status = compute_status(Job.from_body(body).with_report(later), running, NOW + timedelta(seconds=3))
    assert status["progress"]["evaluation"] == {"step": 5, "rewardMean": 0.5, "samples": 64}  # no stale pass rate


def test_a_deleted_pod_restarts_the_job_from_its_checkpoint():
    body, gang = _running_body()
    body["status"]["progress"] = {"lastCheckpoint": {"step": 2, "path": "/c/2"}, "heartbeatTime": format_time(NOW)}
    lost = Observed(clusters=(cluster(0),), pods=gang[:2], identity_ready=True, trainer=RUNNING)
    status = run(body, lost, NOW + timedelta(seconds=10))
    assert (status["phase"], status["reason"], status["restarts"], status["attempt"]) == ("Restarting", "PodLost", 1, 1)
    assert status["message"] == "restart 1/3 from step 2: 1 of 3 pods gone"
    assert {cond(status, t)["status"] for t in ("GangScheduled", "ClusterReady", "TrainerRunning")} == {"Unknown"}


def test_a_replaced_pod_counts_as_lost():
    body, gang = _running_body()
    replacement = PodRecord(**{**gang[2].__dict__, "name": "new", "created": NOW + timedelta(seconds=5)})
    observed = Observed(clusters=(cluster(0),), pods=(*gang[:2], replacement), identity_ready=True, trainer=RUNNING)
    status = run(body, observed, NOW + timedelta(seconds=10))
    assert status["phase"] == "Restarting" and "pod new replaced" in status["message"]


def test_a_second_head_pod_is_neither_lost_nor_a_member_of_the_gang():
    """KubeRay made the head twice: the newer one is a duplicate (the operator deletes it), not a
    replacement, so the job runs on; and it does not stand in for a member that is not placed."""
    body, gang = _running_body()
    duplicate = PodRecord(**{**gang[0].__dict__, "name": "tiny-a0-head-2", "created": NOW + timedelta(seconds=5)})
    for shown in (duplicate, PodRecord(**{**duplicate.__dict__, "deleting": True})):
        observed = Observed(clusters=(cluster(0),), pods=(*gang, shown), identity_ready=True, trainer=RUNNING)
        status = run(body, observed, NOW + timedelta(seconds=10))
        assert (status["phase"], status["restarts"]) == ("CriticWarmup", 0), status
        assert cond(status, "PodsReady")["message"] == "all 3 pods are ready"
    unplaced = PodRecord(**{**gang[2].__dict__, "node": None, "scheduled_at": None})
    pending = Observed(clusters=(cluster(0),), pods=(gang[0], duplicate, gang[1], unplaced), identity_ready=True)
    assert run(make_ppojob(), pending)["phase"] == "Scheduling"
    # Without the older head, the newer one is what is left of the gang: a replacement, so lost.
    gone = PodRecord(**{**gang[0].__dict__, "deleting": True})
    observed = Observed(clusters=(cluster(0),), pods=(gone, duplicate, *gang[1:]), identity_ready=True, trainer=RUNNING)
    assert run(body, observed, NOW + timedelta(seconds=10))["reason"] == "PodLost"


def test_a_lost_pod_with_no_backoff_left_fails_with_the_reason():
    body, gang = _running_body(runPolicy={"backoffLimit": 0})
    lost = Observed(clusters=(cluster(0),), pods=gang[:2], identity_ready=True, trainer=RUNNING)
    status = run(body, lost, NOW + timedelta(seconds=10))
    assert (status["phase"], status["reason"]) == ("Failed", "BackoffLimitExceeded")
    assert status["message"] == "PodLost: 1 of 3 pods gone; runPolicy.backoffLimit (0) reached"


def test_restarting_lasts_while_the_previous_attempt_is_torn_down():
    body, gang = _running_body()
    lost = Observed(clusters=(cluster(0),), pods=gang[:2], identity_ready=True, trainer=RUNNING)
    body = advance(body, run(body, lost, NOW + timedelta(seconds=10)))
    tearing_down = Observed(clusters=(cluster(0), cluster(1, ready=False)), pods=gang[:2], identity_ready=True)
    status = run(body, tearing_down, NOW + timedelta(seconds=11))
    assert status["phase"] == "Restarting"
    clean = Observed(clusters=(cluster(1, ready=False),), identity_ready=True)
    status = run(body, clean, NOW + timedelta(seconds=12))
    assert status["phase"] == "Scheduling" and status["children"]["rayCluster"] == "tiny-a1"
    assert cond(status, "GangScheduled")["lastTransitionTime"] == format_time(NOW + timedelta(seconds=12))


def test_a_restarted_attempt_is_initializing_until_its_own_trainer_reports():
    body, gang = _running_body()
    body["status"]["progress"] = {"attempt": 0, "criticOnlyStepsDone": 2, "criticOnlySteps": 2, "step": 3,
                                  "heartbeatTime": format_time(NOW)}
    assert run(body, Observed(clusters=(cluster(0),), pods=gang, identity_ready=True, trainer=RUNNING))["phase"] == "Training"
    lost = Observed(clusters=(cluster(0),), pods=gang[:2], identity_ready=True, trainer=RUNNING)
    body = advance(body, run(body, lost, NOW + timedelta(seconds=10)))
    assert body["status"]["attempt"] == 1
    placed = NOW + timedelta(seconds=12)
    second = Observed(clusters=(cluster(1),), pods=pods(1, 3, scheduled_at=placed, created=placed), identity_ready=True,
                      trainer=RUNNING)
    body = advance(body, run(body, second, placed))
    status = run(body, second, NOW + timedelta(seconds=13))
    assert (status["phase"], status["reason"]) == ("Initializing", "TrainerStarted")  # not the old attempt's Training
    assert status["message"] == "the trainer of attempt 1 started; waiting for its first report"
    body = advance(body, status)
    body["status"]["progress"] = {**body["status"]["progress"], "attempt": 1, "heartbeatTime": format_time(NOW)}
    assert run(body, second, NOW + timedelta(seconds=14))["phase"] == "Training"


def test_a_silent_trainer_is_lost_not_running():
    body, gang = _running_body()
    body["status"]["progress"] = {"heartbeatTime": format_time(NOW + timedelta(seconds=5))}
    running = Observed(clusters=(cluster(0),), pods=gang, identity_ready=True, trainer=RUNNING)
    policy = Policy(heartbeat_timeout_s=60)
    assert run(body, running, NOW + timedelta(seconds=64), policy)["phase"] == "CriticWarmup"
    status = run(body, running, NOW + timedelta(seconds=66), policy)
    assert (status["phase"], status["reason"]) == ("Restarting", "TrainerLost")
    assert "no heartbeat from the trainer for 61s (limit 60s)" in status["message"]


def test_a_dead_trainer_process_is_a_failure_with_its_error():
    body, gang = _running_body()
    body["status"]["progress"] = {"error": "CUDA out of memory"}
    dead = Observed(clusters=(cluster(0),), pods=gang, identity_ready=True,
                    trainer=TrainerRecord(TrainerState.FAILED, "local:4242", "exit code 1"))
    status = run(body, dead, NOW + timedelta(seconds=2))
    assert (status["phase"], status["reason"]) == ("Restarting", "TrainerFailed")
    assert "exit code 1; trainer reported: CUDA out of memory" in status["message"]


def test_a_vanished_trainer_is_lost():
    body, gang = _running_body()
    gone = Observed(clusters=(cluster(0),), pods=gang, identity_ready=True,
                    trainer=TrainerRecord(TrainerState.NOT_STARTED, "", "no pid file"))
    assert run(body, gone, NOW + timedelta(seconds=2))["reason"] == "TrainerLost"


@pytest.mark.parametrize(
    "spec, observed, fragment",
    [
        ({"ppo": {"numRollouts": 1, "numCriticOnlySteps": 2}}, Observed(), "ppo.numCriticOnlySteps (2) must not exceed"),
        ({"critic": {"lr": 1e-5}}, Observed(), "spec.critic.lr: was removed; use critic.learningRate"),
        ({"scheduling": {"gangScheduler": "Kueue"}}, Observed(), "spec.scheduling.queue: gangScheduler Kueue needs"),
        ({}, Observed(reference_problem="spec.checkpoint.volumeClaim: PersistentVolumeClaim ckpt not found"), "volumeClaim"),
    ],
)
def test_what_the_schema_cannot_catch_fails_as_invalid_spec_naming_the_field(spec, observed, fragment):
    status = run(make_ppojob(**spec), observed)
    assert (status["phase"], status["reason"]) == ("Failed", "InvalidSpec")
    assert fragment in status["message"] and fragment in cond(status, "Valid")["message"]


def test_suspend_keeps_progress_and_resume_starts_a_new_attempt():
    body, gang = _running_body()
    body["spec"]["runPolicy"] = {"suspend": True}
    body["status"]["progress"] = {"step": 3}
    running = Observed(clusters=(cluster(0),), pods=gang, identity_ready=True, trainer=RUNNING)
    status = run(body, running, NOW + timedelta(seconds=20))
    assert (status["phase"], status["attempt"]) == ("Suspended", 0)
    assert cond(status, "Suspended")["status"] == "True"
    body = advance(body, status)
    assert body["status"]["progress"] == {"step": 3}
    body["spec"]["runPolicy"] = {"suspend": False}
    status = run(body, Observed(identity_ready=True), NOW + timedelta(seconds=30))
    assert (status["phase"], status["attempt"], status["restarts"]) == ("Pending", 1, 0)
    assert cond(status, "Suspended")["reason"] == "Resumed"
    assert status["startTime"] == format_time(NOW + timedelta(seconds=30))
    assert cond(status, "GangScheduled")["lastTransitionTime"] == format_time(NOW + timedelta(seconds=30))


def test_active_deadline_fails_the_job():
    body, gang = _running_body(runPolicy={"activeDeadlineSeconds": 30})
    running = Observed(clusters=(cluster(0),), pods=gang, identity_ready=True, trainer=RUNNING)
    status = run(body, running, NOW + timedelta(seconds=31))
    assert (status["phase"], status["reason"]) == ("Failed", "DeadlineExceeded")


def test_a_finished_job_is_never_changed_again():
    body = advance(make_ppojob(), {"phase": "Succeeded", "conditions": [], "attempt": 0, "restarts": 0,
                                   "observedGeneration": 1, "completionTime": format_time(NOW)})
    job = Job.from_body(body)
    assert not status_changed(job, compute_status(job, Observed(), NOW + timedelta(hours=1)))


def test_nothing_observed_changed_means_nothing_to_patch():
    body = make_ppojob()
    observed = Observed(clusters=(cluster(0, ready=False),), pods=pods(0, 3, placed=False, unschedulable="Unschedulable"))
    first = run(body, observed)
    body = advance(body, first)
    second = run(body, observed, NOW + timedelta(seconds=30))
    assert not status_changed(Job.from_body(body), second)
    assert status_patch(Job.from_body(body), second) == {"status": {}}


def test_a_new_message_keeps_the_transition_time():
    body = make_ppojob()
    body = advance(body, run(body, Observed(clusters=(cluster(0, ready=False),), pods=pods(0, 3, placed=False, unschedulable="a"))))
    status = run(body, Observed(clusters=(cluster(0, ready=False),), pods=pods(0, 3, placed=False, unschedulable="b")), NOW + timedelta(seconds=9))
    assert cond(status, "GangScheduled")["lastTransitionTime"] == format_time(NOW)
    assert "b" in cond(status, "GangScheduled")["message"]


def test_a_report_moves_the_phase_and_shows_in_the_same_status_write():
    """The trainer's report (its ConfigMap) is folded into the status write that acts on it: one write."""
    body = _placed(make_ppojob())
    gang = pods(0, 3, scheduled_at=NOW, created=NOW)
    running = Observed(clusters=(cluster(0),), pods=gang, identity_ready=True, trainer=RUNNING)
    body = advance(body, run(body, running, NOW + timedelta(seconds=5)),
                   progress={"criticOnlyStepsDone": 1, "criticOnlySteps": 2, "error": "an older attempt's"})
    job = Job.from_body(body)
    report = {"criticOnlyStepsDone": 2, "criticOnlySteps": 2, "step": 2, "heartbeatTime": format_time(NOW)}
    status = compute_status(job.with_report(report), running, NOW + timedelta(seconds=6))
    assert status["phase"] == "Training" and status["progress"] == report
    assert status_patch(job, status)["status"]["progress"] == {"criticOnlyStepsDone": 2, "step": 2,
                                                               "heartbeatTime": format_time(NOW), "error": None}
    assert not status_changed(Job.from_body(advance(body, status)).with_report(report), status)
    # Before the trainer's first report the status keeps what it has (e.g. an earlier version's trainer wrote it).
    assert compute_status(job, running, NOW + timedelta(seconds=6))["progress"] == job.status["progress"]


def test_status_patch_nulls_removed_keys():
    job = make_job(status={"phase": "Pending", "reason": "Created"})
    assert status_patch(job, {"phase": "Scheduling"}) == {"status": {"phase": "Scheduling", "reason": None}}


def test_merge_patch_patches_nested_objects_key_by_key_and_replaces_lists_whole():
    old = {"children": {"rayCluster": "a", "serviceAccount": "t"}, "conditions": [{"type": "A"}], "gone": 1, "same": 2}
    new = {"children": {"rayCluster": "b"}, "conditions": [{"type": "B"}], "same": 2, "added": {"x": 1}}
    assert merge_patch(old, new) == {"gone": None, "children": {"rayCluster": "b", "serviceAccount": None},
                                     "conditions": [{"type": "B"}], "added": {"x": 1}}
    assert merge_patch(new, new) == {}


def test_a_routine_report_is_held_back_until_the_interval_passes_or_a_write_carries_it():
    stored = {"attempt": 0, "criticOnlyStepsDone": 2, "step": 3, "stage": "Generate"}
    job = make_job(status={"phase": "Training", "reason": "Training", "progress": stored})
    folded_at = NOW - timedelta(seconds=4)
    routine = {**stored, "step": 4, "stage": "ActorTrain"}

    def hold(new, now=NOW, folded=folded_at):
        return hold_routine_progress(job, new, folded_at=folded, now=now, interval_s=10.0)

    unchanged = operator_status(job.status)
    held, wait = hold({**unchanged, "progress": routine})
    assert held == unchanged and wait == 6.0  # nothing to write now; folded in 6 s
    assert hold({**unchanged, "progress": routine}, now=NOW + timedelta(seconds=6)) == ({**unchanged, "progress": routine}, None)
    assert hold({**unchanged, "progress": routine}, folded=None)[1] is None  # a fresh loop folds at once
    moved = {**unchanged, "phase": "Failed", "progress": routine}
    assert hold(moved) == (moved, None)  # written anyway: the report rides along
    for urgent in ({**routine, "finished": True}, {**routine, "lastCheckpoint": {"step": 4, "path": "/c"}},
                   {**routine, "error": "boom"}, {**routine, "attempt": 1}):
        assert hold({**unchanged, "progress": urgent}) == ({**unchanged, "progress": urgent}, None)
    assert hold(unchanged) == (unchanged, None)  # no report (yet): nothing to hold


def test_the_first_report_is_never_held():
    job = make_job(status={"phase": "Initializing", "reason": "TrainerStarted"})
    new = {**operator_status(job.status), "progress": {"attempt": 0, "step": 0}}
    assert hold_routine_progress(job, new, folded_at=NOW, now=NOW, interval_s=10.0) == (new, None)


def test_a_pod_whose_node_stopped_reporting_is_said_in_pods_ready_without_a_restart():
    body, gang = _running_body()
    assert cond(body["status"], "PodsReady")["status"] == "True"
    unready = (gang[0], PodRecord(**{**gang[1].__dict__, "ready": False}), gang[2])
    status = run(body, Observed(clusters=(cluster(0),), pods=unready, identity_ready=True, trainer=RUNNING),
                 NOW + timedelta(seconds=2))
    condition = cond(status, "PodsReady")
    assert (condition["status"], condition["reason"]) == ("False", "PodsNotReady")
    assert condition["message"] == "pod tiny-a0-train-1 on node kwok-gpu-1 is not ready"
    assert status["phase"] == "CriticWarmup" and status["restarts"] == 0  # the trainer may well carry on
    body = advance(body, status)
    back = run(body, Observed(clusters=(cluster(0),), pods=gang, identity_ready=True, trainer=RUNNING),
               NOW + timedelta(seconds=3))
    assert cond(back, "PodsReady")["status"] == "True"
