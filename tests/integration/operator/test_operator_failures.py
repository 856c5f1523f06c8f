"""Failures on the real local cluster: the operator killed between creations, a gang that cannot
be placed, lost pods with and without backoff left, a silent trainer, references that do not exist."""

from __future__ import annotations

import copy
import time

import pytest
import yaml
from operator_itest import apply, condition, kget, tiny_manifest, wait_for, wait_phase

pytestmark = [pytest.mark.cluster]


def children(cluster, ns, kind):
    return [o["metadata"]["name"] for o in kget(cluster, kind, ns, selector="ppojob.io/job-name=tiny") or []]


def test_sigkill_between_pod_group_and_raycluster_then_restart_makes_one_of_each(local_cluster, k8s_namespace, start_operator):
    ns = k8s_namespace
    operator = start_operator("--debug-pause-after-pod-group", "60", STANDIN_STEP_SECONDS="0.5")
    apply(local_cluster, ns, tiny_manifest(ppo={"numRollouts": 16}))
    wait_for("the pod group", lambda: children(local_cluster, ns, "podgroups.scheduling.x-k8s.io"))
    operator.kill()
    assert children(local_cluster, ns, "rayclusters") == []
    operator.start()  # same flags: the pod group exists now, so no pause is reached
    wait_phase(local_cluster, ns, "tiny", "CriticWarmup", "Training", timeout=90)
    assert children(local_cluster, ns, "podgroups.scheduling.x-k8s.io") == ["tiny-a0"]
    assert children(local_cluster, ns, "rayclusters") == ["tiny-a0"]
    assert len(operator.trainer_pids()) == 1
    job = wait_phase(local_cluster, ns, "tiny", "Succeeded", "Failed", timeout=120)
    assert job["status"]["phase"] == "Succeeded", job["status"]
    assert job["status"]["restarts"] == 0
    events = local_cluster.kubectl("get", "events", "-n", ns, "--field-selector", "reason=Created", "-o",
                                   "jsonpath={.items[*].message}").stdout
    assert "RayCluster tiny-a0" in events


def test_a_gang_that_cannot_be_placed_fails_in_time_and_holds_no_gpus(local_cluster, k8s_namespace, start_operator):
    ns = k8s_namespace
    start_operator()
    # 5 workers x 8 GPUs on 4 nodes of 8: the gang can never fit (a sample for each of its 40 data ranks).
    apply(local_cluster, ns, tiny_manifest(resources={"nodes": 5}, rollout={"batchSize": 40},
                                           scheduling={"scheduleTimeoutSeconds": 15}))
    scheduling = wait_phase(local_cluster, ns, "tiny", "Scheduling", timeout=60)
    assert condition(scheduling, "GangScheduled")["reason"] == "GangPending"
    job = wait_phase(local_cluster, ns, "tiny", "Failed", timeout=60)
    failed = condition(job, "Failed")
    assert failed["reason"] == "GangScheduleTimeout"
    assert "scheduleTimeoutSeconds (15s)" in failed["message"] and "pods placed" in failed["message"]
    assert "scheduler:" in failed["message"], failed["message"]  # the scheduler's own words
    wait_for("no RayCluster", lambda: children(local_cluster, ns, "rayclusters") == [])
    wait_for("no pods", lambda: children(local_cluster, ns, "pods") == [], timeout=60)
    described = local_cluster.kubectl("describe", "ppojob", "tiny", "-n", ns).stdout
    assert "GangScheduleTimeout" in described and "ClusterDeleted" in described


def _worker(cluster, ns, attempt):
    pods = kget(cluster, "pods", ns, selector=f"ppojob.io/job-name=tiny,ppojob.io/attempt={attempt},ppojob.io/role=train")
    return pods[0]["metadata"]["name"] if pods else None


def test_a_deleted_worker_pod_restarts_from_the_checkpoint(local_cluster, k8s_namespace, start_operator):
    ns = k8s_namespace
    operator = start_operator(STANDIN_STEP_SECONDS="0.5")
    apply(local_cluster, ns, tiny_manifest(ppo={"numRollouts": 30}, checkpoint={"interval": 2}))
    wait_for("a checkpoint", lambda: ((kget(local_cluster, "ppojob", ns, "tiny") or {}).get("status") or {})
             .get("progress", {}).get("lastCheckpoint"), timeout=90)
    local_cluster.kubectl("delete", "pod", _worker(local_cluster, ns, 0), "-n", ns, "--wait=false")
    # `Restarting` lasts only while the old pods go, about a second with the Ray pods' 1 s grace
    # period: too short to be sure to poll. The restart is read from the status, its words from the event.
    job = wait_for("the restart", lambda: (j := kget(local_cluster, "ppojob", ns, "tiny"))
                   and (j.get("status") or {}).get("restarts") == 1 and j, timeout=30)
    assert job["status"]["attempt"] == 1, job["status"]
    told = [e["message"] for e in kget(local_cluster, "events", ns) if e.get("reason") == "PodLost"]
    assert any(m.startswith("Restarting: restart 1/3 from step") for m in told), told
    job = wait_phase(local_cluster, ns, "tiny", "Succeeded", "Failed", timeout=120)
    assert job["status"]["phase"] == "Succeeded", job["status"]
    assert job["status"]["progress"]["attempt"] == 1 and job["status"]["children"]["rayCluster"] == "tiny-a1"
    # Finished: torn down. The operator writes Succeeded first and deletes in the same pass, so a
    # look right after the phase may still find the pod group (seen once in a CI run).
    wait_for("the pod group torn down", lambda: children(local_cluster, ns, "podgroups.scheduling.x-k8s.io") == [],
             timeout=30)
    log = (next(operator.state_dir.glob(f"{ns}/tiny-*/a1")) / "trainer.log").read_text()
    assert "--resume" in log and "from step 0" not in log


def test_a_deleted_worker_pod_with_no_backoff_left_fails_with_the_reason(local_cluster, k8s_namespace, start_operator):
    ns = k8s_namespace
    operator = start_operator(STANDIN_STEP_SECONDS="0.5")
    apply(local_cluster, ns, tiny_manifest(ppo={"numRollouts": 100}, runPolicy={"backoffLimit": 0}))
    wait_phase(local_cluster, ns, "tiny", "CriticWarmup", "Training", timeout=90)
    local_cluster.kubectl("delete", "pod", _worker(local_cluster, ns, 0), "-n", ns, "--wait=false")
    job = wait_phase(local_cluster, ns, "tiny", "Failed", timeout=30)
    assert job["status"]["reason"] == "BackoffLimitExceeded" and job["status"]["restarts"] == 0
    assert job["status"]["message"].startswith("PodLost: ") and "backoffLimit (0) reached" in job["status"]["message"]
    wait_for("no RayCluster", lambda: children(local_cluster, ns, "rayclusters") == [])
    wait_for("the trainer stopped", lambda: operator.trainer_pids() == [])


def test_a_trainer_that_stops_reporting_is_lost_not_running(local_cluster, k8s_namespace, start_operator):
    ns = k8s_namespace
    start_operator(STANDIN_HANG="1")  # --heartbeat-timeout 20 in the fixture
    apply(local_cluster, ns, tiny_manifest(runPolicy={"backoffLimit": 0}))
    wait_phase(local_cluster, ns, "tiny", "CriticWarmup", timeout=90)
    started = time.monotonic()
    job = wait_phase(local_cluster, ns, "tiny", "Failed", timeout=60)
    assert time.monotonic() - started < 45
    assert job["status"]["message"].startswith("TrainerLost: no heartbeat from the trainer for")


@pytest.mark.parametrize("spec, field", [
    ({"checkpoint": {"volumeClaim": "no-such-claim"}}, "spec.checkpoint.volumeClaim: PersistentVolumeClaim 'no-such-claim' not found"),
    ({"envFromSecret": "no-such-secret"}, "spec.envFromSecret: Secret 'no-such-secret' not found"),
])
def test_a_missing_reference_fails_invalid_spec_and_valid_jobs_go_on(local_cluster, k8s_namespace, start_operator, spec, field):
    ns = k8s_namespace
    operator = start_operator()
    apply(local_cluster, ns, tiny_manifest("broken", **spec))
    apply(local_cluster, ns, tiny_manifest())
    job = wait_phase(local_cluster, ns, "broken", "Failed", timeout=60)
    assert job["status"]["reason"] == "InvalidSpec" and job["status"]["message"].startswith(field)
    assert condition(job, "Valid")["status"] == "False"
    assert kget(local_cluster, "rayclusters", ns, selector="ppojob.io/job-name=broken") == []
    assert wait_phase(local_cluster, ns, "tiny", "Succeeded", timeout=120)
    assert operator.proc.poll() is None


def test_a_trainer_that_dies_is_a_failure_not_running(local_cluster, k8s_namespace, start_operator):
    ns = k8s_namespace
    start_operator(STANDIN_EXIT_CODE="7")  # the stand-in walks its steps, then exits 7 without `finished`
    apply(local_cluster, ns, tiny_manifest(ppo={"numRollouts": 3, "numCriticOnlySteps": 1}, runPolicy={"backoffLimit": 1}))
    job = wait_phase(local_cluster, ns, "tiny", "Failed", timeout=120)
    assert job["status"]["restarts"] == 1 and job["status"]["reason"] == "BackoffLimitExceeded"
    assert job["status"]["message"].startswith("TrainerFailed: the trainer exited with code 7")
    described = local_cluster.kubectl("describe", "ppojob", "tiny", "-n", ns).stdout
    assert "Warning  TrainerFailed" in described and "Warning  BackoffLimitExceeded" in described


def test_an_object_stored_before_a_schema_change_fails_invalid_spec(local_cluster, ppojob_crd, k8s_namespace, start_operator):
    """Stored while the CRD had no CEL rules (an older schema), then read by today's operator."""
    ns = k8s_namespace
    crd = yaml.safe_load(ppojob_crd.read_text())
    older = copy.deepcopy(crd)
    del older["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["x-kubernetes-validations"]
    try:
        local_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=yaml.safe_dump(older))
        wait_for("the older schema served", lambda: local_cluster.kubectl(
            "apply", "-n", ns, "-f", "-", check=False,
            input=yaml.safe_dump(tiny_manifest("old", ppo={"numRollouts": 2, "numCriticOnlySteps": 3}))).returncode == 0,
            timeout=30, interval=0.5)
    finally:
        local_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ppojob_crd))
    operator = start_operator()
    apply(local_cluster, ns, tiny_manifest())
    job = wait_phase(local_cluster, ns, "old", "Failed", timeout=60)
    assert job["status"]["reason"] == "InvalidSpec"
    assert job["status"]["message"].startswith("ppo.numCriticOnlySteps (3) must not exceed ppo.numRollouts (2)")
    assert kget(local_cluster, "rayclusters", ns, selector="ppojob.io/job-name=old") == []
    assert wait_phase(local_cluster, ns, "tiny", "Succeeded", timeout=120)
    assert operator.proc.poll() is None


def test_deleting_the_namespace_under_running_jobs_lets_the_namespace_go(local_cluster, k8s_namespace, start_operator):
    """The namespace of running jobs is deleted, the operator watching that namespace only (as with the
    chart's watchNamespaces): it must keep watching while the namespace terminates (its loops see
    their jobs deleted and stop their trainers), and the namespace must go. (Once, in a benchmark,
    ten jobs kept it for minutes with no watch of theirs open.)"""
    ns = k8s_namespace
    operator = start_operator(STANDIN_STEP_SECONDS="1")
    for name in ("n0", "n1", "n2"):
        apply(local_cluster, ns, tiny_manifest(name, ppo={"numRollouts": 200}, resources={"gpusPerNode": 0},
                                               scheduling={"gangScheduler": "None"}))
    for name in ("n0", "n1", "n2"):
        wait_phase(local_cluster, ns, name, "CriticWarmup", "Training", timeout=120)
    local_cluster.kubectl("delete", "namespace", ns, "--wait=false")
    wait_for("the namespace gone", lambda: kget(local_cluster, "namespace", ns, ns) is None, timeout=120, interval=1,
             context=lambda: [(j["metadata"]["name"], j["metadata"].get("finalizers"))
                              for j in kget(local_cluster, "ppojobs", ns) or []])
    wait_for("the trainers stopped", lambda: operator.trainer_pids() == [], timeout=30)
