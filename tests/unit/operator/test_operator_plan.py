"""plan_actions and next_wakeup: what to create, delete, launch; when to look again without a watch event."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

from operator_factory import NOW, cluster, make_ppojob, pod_group, pods

from ppo_operator.builders.common import BuildOptions
from ppo_operator.decisions import Policy
from ppo_operator.gang import pod_group_resources
from ppo_operator.job import Job, format_time
from ppo_operator.observed import Observed
from ppo_operator.plan import PODS, RAYCLUSTERS, Deletion, next_wakeup, plan_actions

POLICY, OPTIONS = Policy(), BuildOptions()


def plan(status, observed, **spec):
    job = Job.from_body(make_ppojob(status=status, **spec))
    return plan_actions(job, status, observed, NOW, policy=POLICY, options=OPTIONS)


def test_a_pending_job_gets_identity_then_pod_group_and_cluster():
    p = plan({"phase": "Pending", "attempt": 0}, Observed())
    assert p.ensure_identity and p.pod_group["kind"] == "PodGroup" and p.raycluster["kind"] == "RayCluster"
    assert p.deletions == () and p.launch_attempt is None and p.keep_trainer == 0


def test_after_a_crash_between_creations_only_the_missing_child_is_planned():
    p = plan({"phase": "Pending", "attempt": 0}, Observed(pod_groups=(pod_group(0),), identity_ready=True))
    assert not p.ensure_identity and p.pod_group is None and p.raycluster["metadata"]["name"] == "tiny-a0"


def test_nothing_to_do_when_everything_exists():
    p = plan({"phase": "Training", "attempt": 0}, Observed(pod_groups=(pod_group(0),), clusters=(cluster(0),), identity_ready=True))
    assert not p.creates and p.deletions == ()


def test_children_of_older_attempts_are_deleted_and_the_new_ones_created():
    observed = Observed(pod_groups=(pod_group(0),), clusters=(cluster(0),), identity_ready=True)
    p = plan({"phase": "Restarting", "attempt": 1}, observed)
    pod_groups = next(r for r in pod_group_resources() if r.group == "scheduling.x-k8s.io")
    assert p.deletions == (
        Deletion(RAYCLUSTERS, "tiny-a0", "attempt 1 replaces it"), Deletion(pod_groups, "tiny-a0", "attempt 1 replaces it"),
    )
    assert p.raycluster["metadata"]["name"] == "tiny-a1" and p.keep_trainer == 1


def test_a_second_head_pod_is_deleted_once_and_the_first_kept():
    gang = pods(0, 2)
    second = dataclasses.replace(gang[0], name="tiny-a0-head-9", created=NOW)
    observed = Observed(pod_groups=(pod_group(0),), clusters=(cluster(0),), pods=(second, *gang), identity_ready=True)
    p = plan({"phase": "Initializing", "attempt": 0}, observed)
    assert p.deletions == (Deletion(PODS, "tiny-a0-head-9", "a second head pod of RayCluster tiny-a0 (KubeRay stops"
                                                            " reconciling a cluster with two heads)"),)
    going = dataclasses.replace(observed, pods=(dataclasses.replace(second, deleting=True), *gang))
    assert plan({"phase": "Initializing", "attempt": 0}, going).deletions == ()


def test_the_trainer_is_launched_once_the_status_asks_for_it():
    observed = Observed(pod_groups=(pod_group(0),), clusters=(cluster(0),), identity_ready=True)
    assert plan({"phase": "Initializing", "reason": "TrainerPending", "attempt": 0}, observed).launch_attempt == 0


def test_finished_and_suspended_jobs_hold_no_cluster_and_no_trainer():
    observed = Observed(pod_groups=(pod_group(0),), clusters=(cluster(0),))
    for phase in ("Failed", "Succeeded", "Suspended"):
        p = plan({"phase": phase, "attempt": 0}, observed)
        assert [d.name for d in p.deletions] == ["tiny-a0", "tiny-a0"] and p.keep_trainer is None and not p.creates


def test_ttl_deletes_the_job_when_it_expires():
    status = {"phase": "Succeeded", "attempt": 0, "completionTime": format_time(NOW - timedelta(seconds=30))}
    assert plan(status, Observed(), runPolicy={"ttlSecondsAfterFinished": 30}).delete_job
    assert not plan(status, Observed(), runPolicy={"ttlSecondsAfterFinished": 31}).delete_job
    assert not plan(status, Observed()).delete_job


def test_next_wakeup_is_the_nearest_deadline():
    spec, _ = Job.from_body(make_ppojob(scheduling={"scheduleTimeoutSeconds": 60}, runPolicy={"activeDeadlineSeconds": 50})).parse()
    status = {
        "phase": "Scheduling", "startTime": format_time(NOW),
        "conditions": [{"type": "GangScheduled", "status": "False", "lastTransitionTime": format_time(NOW)}],
    }
    assert next_wakeup(spec, status, {}, NOW + timedelta(seconds=10), policy=POLICY) == 40
    running = {"phase": "Training", "conditions": [{"type": "TrainerRunning", "status": "True", "lastTransitionTime": format_time(NOW)}]}
    hb = {"heartbeatTime": format_time(NOW + timedelta(seconds=100))}
    assert next_wakeup(spec, running, hb, NOW + timedelta(seconds=110), policy=Policy(heartbeat_timeout_s=60)) == 50
    assert next_wakeup(spec, {"phase": "Succeeded"}, {}, NOW, policy=POLICY) is None
