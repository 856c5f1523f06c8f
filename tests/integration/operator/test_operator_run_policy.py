"""Run policy on the real local cluster: suspend and resume, deletion that leaves nothing (also while\nno operator runs), TTL."""

from __future__ import annotations

import json

import pytest
from operator_itest import apply, condition, kget, tiny_manifest, wait_for, wait_phase

pytestmark = [pytest.mark.cluster]

OWNED = ("rayclusters", "podgroups.scheduling.x-k8s.io", "pods", "serviceaccounts", "roles", "rolebindings")


def owned(cluster, ns, name="tiny"):
    return {kind: [o["metadata"]["name"] for o in kget(cluster, kind, ns, selector=f"ppojob.io/job-name={name}") or []]
            for kind in OWNED}


def test_suspend_tears_the_cluster_down_keeps_progress_and_resume_continues(local_cluster, k8s_namespace, start_operator):
    ns = k8s_namespace
    operator = start_operator(STANDIN_STEP_SECONDS="0.5")
    apply(local_cluster, ns, tiny_manifest(ppo={"numRollouts": 20}, checkpoint={"interval": 2}))
    wait_for("a checkpoint", lambda: ((kget(local_cluster, "ppojob", ns, "tiny") or {}).get("status") or {})
             .get("progress", {}).get("lastCheckpoint"), timeout=90)
    local_cluster.kubectl("patch", "ppojob", "tiny", "-n", ns, "--type=merge", "-p", json.dumps({"spec": {"runPolicy": {"suspend": True}}}))
    job = wait_phase(local_cluster, ns, "tiny", "Suspended", timeout=30)
    assert condition(job, "Suspended")["status"] == "True"
    kept = job["status"]["progress"]["lastCheckpoint"]["step"]
    wait_for("no RayCluster, pod group or pods", lambda: all(not owned(local_cluster, ns)[k] for k in OWNED[:3]), timeout=60)
    wait_for("the trainer stopped", lambda: operator.trainer_pids() == [])
    local_cluster.kubectl("patch", "ppojob", "tiny", "-n", ns, "--type=merge", "-p", json.dumps({"spec": {"runPolicy": {"suspend": False}}}))
    job = wait_phase(local_cluster, ns, "tiny", "Succeeded", "Failed", timeout=120)
    assert job["status"]["phase"] == "Succeeded", job["status"]
    assert (job["status"]["attempt"], job["status"]["restarts"]) == (1, 0)
    assert condition(job, "Suspended")["reason"] == "Resumed"
    log = (next(operator.state_dir.glob(f"{ns}/tiny-*/a1")) / "trainer.log").read_text()
    assert "--resume" in log and f"from step {kept}" in log


def test_delete_leaves_nothing_behind(local_cluster, k8s_namespace, start_operator):
    ns = k8s_namespace
    operator = start_operator(STANDIN_STEP_SECONDS="1")
    apply(local_cluster, ns, tiny_manifest(ppo={"numRollouts": 100}))
    wait_phase(local_cluster, ns, "tiny", "CriticWarmup", "Training", timeout=90)
    assert all(owned(local_cluster, ns)[k] for k in OWNED)
    pids = operator.trainer_pids()
    assert len(pids) == 1
    assert "finalizers" not in kget(local_cluster, "ppojob", ns, "tiny")["metadata"]  # its deletion waits for nobody
    local_cluster.kubectl("delete", "ppojob", "tiny", "-n", ns, "--timeout=60s")
    wait_for("every child gone", lambda: not any(owned(local_cluster, ns).values()), timeout=60)
    wait_for("the trainer stopped and its files gone",
             lambda: operator.trainer_pids() == [] and not list(operator.state_dir.glob(f"{ns}/tiny-*")))


def test_a_job_deleted_while_no_operator_runs_has_its_trainer_stopped_by_the_next_one(
    local_cluster, k8s_namespace, start_operator
):
    ns = k8s_namespace
    operator = start_operator(STANDIN_STEP_SECONDS="1")
    apply(local_cluster, ns, tiny_manifest(ppo={"numRollouts": 100}))
    wait_phase(local_cluster, ns, "tiny", "CriticWarmup", "Training", timeout=90)
    operator.kill()
    local_cluster.kubectl("delete", "ppojob", "tiny", "-n", ns, "--timeout=30s")  # nothing blocks it
    assert len(operator.trainer_pids()) == 1  # the development launcher's trainer outlives its job...
    operator.start()  # ...until the next operator starts
    wait_for("the trainer stopped and its files gone",
             lambda: operator.trainer_pids() == [] and not list(operator.state_dir.glob(f"{ns}/tiny-*")), timeout=30)
    assert "deleted while no operator ran" in operator.log()


def test_the_finalizer_of_an_earlier_version_is_taken_off(local_cluster, k8s_namespace, start_operator):
    ns = k8s_namespace
    start_operator()
    manifest = tiny_manifest(ppo={"numRollouts": 3, "numCriticOnlySteps": 1})
    manifest["metadata"]["finalizers"] = ["ppojob.io/operator"]
    apply(local_cluster, ns, manifest)
    wait_for("the finalizer off", lambda: not kget(local_cluster, "ppojob", ns, "tiny")["metadata"].get("finalizers"),
             timeout=30)
    assert wait_phase(local_cluster, ns, "tiny", "Succeeded", timeout=90)


def test_ttl_deletes_a_finished_job(local_cluster, k8s_namespace, start_operator):
    ns = k8s_namespace
    start_operator()
    apply(local_cluster, ns, tiny_manifest(ppo={"numRollouts": 3, "numCriticOnlySteps": 1}, runPolicy={"ttlSecondsAfterFinished": 3}))
    wait_phase(local_cluster, ns, "tiny", "Succeeded", timeout=90)
    wait_for("the job deleted by its TTL", lambda: kget(local_cluster, "ppojob", ns, "tiny") is None, timeout=30)
    wait_for("every child gone", lambda: not any(owned(local_cluster, ns).values()), timeout=60)
