"""PPOJobs under the real Kueue of the local cluster (KWOK GPU nodes): admitted when they fit their
queue's quota, queued in Kueue's words with no pod while they do not, failing at once on a queue or
a size Kueue could never admit, and preempted by a job of higher priority without a restart: the
job waits in the same RayCluster and attempt, and its trainer resumes from its checkpoint once
quota frees. The ClusterQueue, LocalQueue and priorities are examples/kueue/, as users apply them."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import pytest
import yaml
from fault_itest import RAYCLUSTERS, CreationRecorder
from operator_itest import EXAMPLES, apply, condition, kget, tiny_manifest, wait_for, wait_phase

from local_cluster import kueue

pytestmark = [pytest.mark.cluster]

GANG_SCHEDULERS = ("--gang-schedulers", "Coscheduling,Kueue,None")
STEP_SECONDS = "0.3"


def documents(path):
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


@pytest.fixture
def queue(local_cluster, k8s_namespace):
    """examples/kueue/ on the cluster, Kueue running; the ClusterQueue is this test's own (its name
    suffixed with the namespace), so that no other test's workloads share its quota. Returns the
    LocalQueue's name."""
    kueue.ensure_running(local_cluster)
    cluster_queue = f"ppo-team-{k8s_namespace}"[:63]
    objects = []
    for doc in documents(EXAMPLES / "kueue" / "queues.yaml"):
        if doc["kind"] == "ClusterQueue":
            doc["metadata"]["name"] = cluster_queue
            doc["spec"]["namespaceSelector"] = {"matchLabels": {"kubernetes.io/metadata.name": k8s_namespace}}
        objects.append(doc)
    (local_queue,) = documents(EXAMPLES / "kueue" / "local-queue.yaml")
    local_queue["spec"]["clusterQueue"] = cluster_queue
    local_cluster.apply(yaml.safe_dump_all(objects))
    apply(local_cluster, k8s_namespace, local_queue)
    wait_for("the LocalQueue active", lambda: any(
        c["type"] == "Active" and c["status"] == "True"
        for c in ((kget(local_cluster, "localqueues", k8s_namespace, local_queue["metadata"]["name"]) or {})
                  .get("status") or {}).get("conditions", [])), timeout=60)
    yield local_queue["metadata"]["name"]
    local_cluster.kubectl("delete", "clusterqueue", cluster_queue, "--wait=false", "--ignore-not-found", check=False)


def kueue_job(name, queue_name, *, gpus=8, nodes=1, priority=None, steps=30, interval=2):
    scheduling = {"gangScheduler": "Kueue", "queue": queue_name}
    if priority:
        scheduling["priorityClassName"] = priority
    return tiny_manifest(
        name, scheduling=scheduling, ppo={"numRollouts": steps, "numCriticOnlySteps": 1},
        checkpoint={"interval": interval},
        resources={"nodes": nodes, "gpusPerNode": gpus},
    )


def pods_of(cluster, ns, name):
    return kget(cluster, "pods", ns, selector=f"ppojob.io/job-name={name}") or []


def running(cluster, ns, name, count=2):
    pods = pods_of(cluster, ns, name)
    return len(pods) == count and all(p["status"].get("phase") == "Running" for p in pods)


def status_of(cluster, ns, name):
    return (kget(cluster, "ppojob", ns, name) or {}).get("status") or {}


def parse(timestamp):
    return datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)


def test_a_job_that_fits_is_admitted_and_one_that_does_not_waits_without_pods_until_quota_frees(
        local_cluster, k8s_namespace, start_operator, queue):
    ns = k8s_namespace
    start_operator(*GANG_SCHEDULERS, STANDIN_STEP_SECONDS=STEP_SECONDS)
    apply(local_cluster, ns, kueue_job("first", queue, steps=30))
    first = wait_phase(local_cluster, ns, "first", "CriticWarmup", "Training", timeout=120)
    admitted = condition(first, "Admitted")
    assert (admitted["status"], admitted["reason"]) == ("True", "Admitted"), admitted
    assert f"through LocalQueue {queue}" in admitted["message"] and "queued since" in admitted["message"]
    table = local_cluster.kubectl("get", "ppojobs", "-n", ns, "-o", "wide").stdout.splitlines()
    assert table[0].split()[:3] == ["NAME", "PHASE", "ADMISSION"] and table[1].split()[2] == "Admitted", table

    apply(local_cluster, ns, kueue_job("second", queue, steps=3))
    second = wait_for("the second job queued in Kueue's words", lambda: (
        (s := status_of(local_cluster, ns, "second")).get("phase") == "Queued" and "quota" in s.get("message", "") and s),
        timeout=60)
    assert second["reason"] == "Queued" and second["message"].startswith(f"LocalQueue {queue}: "), second
    assert "insufficient unused quota for nvidia.com/gpu" in second["message"], second["message"]
    assert (condition({"status": second}, "Admitted")["status"], condition({"status": second}, "Admitted")["reason"]) == (
        "False", "Pending")
    assert pods_of(local_cluster, ns, "second") == []
    assert kget(local_cluster, "raycluster", ns, "second-a0")["spec"]["suspend"] is True

    freed = time.monotonic()
    done = wait_phase(local_cluster, ns, "first", "Succeeded", "Failed", timeout=120)
    assert done["status"]["phase"] == "Succeeded", done["status"]
    assert pods_of(local_cluster, ns, "second") == [], "no pod while the quota was used"
    second = wait_phase(local_cluster, ns, "second", "Succeeded", "Failed", timeout=120)["status"]
    assert second["phase"] == "Succeeded" and second["restarts"] == 0, second
    print(f"[kueue] second job: queued, then admitted and done {time.monotonic() - freed:.1f}s after the first finished")


def test_a_missing_local_queue_a_bad_queue_name_and_a_job_larger_than_the_cluster_queue_say_which_field(
        local_cluster, k8s_namespace, start_operator, queue):
    ns = k8s_namespace
    start_operator(*GANG_SCHEDULERS)
    refused = local_cluster.kubectl("apply", "-n", ns, "-f", "-", check=False,
                                    input=yaml.safe_dump(kueue_job("badname", "Team_A")))
    assert refused.returncode != 0 and "spec.scheduling.queue" in refused.stderr, refused.stderr

    apply(local_cluster, ns, kueue_job("noqueue", "no-such-queue"))
    status = wait_phase(local_cluster, ns, "noqueue", "Failed", timeout=60)["status"]
    assert status["reason"] == "InvalidSpec"
    assert status["message"] == (f"spec.scheduling.queue: LocalQueue 'no-such-queue' not found in namespace {ns};"
                                 " create it or fix the name"), status["message"]
    assert kget(local_cluster, "raycluster", ns, "noqueue-a0") is None

    apply(local_cluster, ns, kueue_job("toolarge", queue, nodes=2))
    status = wait_phase(local_cluster, ns, "toolarge", "Failed", timeout=60)["status"]
    assert status["reason"] == "QueueCapacityExceeded", status
    assert status["message"].startswith(f"spec.resources: the job asks for more than the ClusterQueue of LocalQueue {queue}")
    assert "> maximum capacity" in status["message"], status["message"]
    assert pods_of(local_cluster, ns, "toolarge") == []


def test_a_higher_priority_job_preempts_a_running_one_which_resumes_from_its_checkpoint_without_a_restart(
        local_cluster, k8s_namespace, start_operator, queue):
    ns = k8s_namespace
    operator = start_operator(*GANG_SCHEDULERS, STANDIN_STEP_SECONDS=STEP_SECONDS)
    clusters = CreationRecorder(local_cluster, ns, *RAYCLUSTERS)
    apply(local_cluster, ns, kueue_job("low", queue, priority="ppo-low", steps=60, interval=2))
    wait_for("the low job past its first checkpoint", lambda: (
        (status_of(local_cluster, ns, "low").get("progress") or {}).get("lastCheckpoint", {}).get("step", 0) >= 4),
        timeout=120)

    apply(local_cluster, ns, kueue_job("high", queue, priority="ppo-high", steps=10))
    low = wait_phase(local_cluster, ns, "low", "Queued", timeout=60)["status"]
    assert (low["reason"], low["restarts"], low["attempt"], low["evictions"]) == ("Evicted", 0, 0, 1), low
    assert "evicted by Kueue: Preempted to accommodate a workload" in low["message"], low["message"]
    assert "not a restart" in low["message"]
    admitted = condition({"status": low}, "Admitted")
    assert (admitted["status"], admitted["reason"]) == ("False", "Preempted"), admitted
    checkpoint = low["progress"]["lastCheckpoint"]["step"]
    wait_for("the low job's pods gone", lambda: pods_of(local_cluster, ns, "low") == [], timeout=60)
    preempted_at = parse(admitted["lastTransitionTime"])
    wait_for("the high job's pods Running", lambda: running(local_cluster, ns, "high"), timeout=60, interval=0.1)
    to_high = (datetime.now(UTC) - preempted_at).total_seconds()
    assert kget(local_cluster, "raycluster", ns, "low-a0")["spec"]["suspend"] is True

    high = wait_phase(local_cluster, ns, "high", "Succeeded", "Failed", timeout=120)["status"]
    assert high["phase"] == "Succeeded", high
    freed_at = parse(high["completionTime"])
    wait_for("the low job's pods Running again", lambda: running(local_cluster, ns, "low"), timeout=60, interval=0.1)
    to_low_pods = (datetime.now(UTC) - freed_at).total_seconds()
    wait_for("the low job stepping again", lambda: (
        status_of(local_cluster, ns, "low").get("progress") or {}).get("step", 0) > checkpoint, timeout=60, interval=0.1)
    to_low_steps = (datetime.now(UTC) - freed_at).total_seconds()

    low = wait_phase(local_cluster, ns, "low", "Succeeded", "Failed", timeout=120)["status"]
    assert (low["phase"], low["restarts"], low["attempt"], low["evictions"]) == ("Succeeded", 0, 0, 1), low
    # Kueue's, not the operator's: one RayCluster for the low job (never made again), unsuspended by Kueue.
    assert set(clusters.of_job("low")) == {"low-a0"} and len(clusters.of_job("low")["low-a0"]) == 1
    assert not [key for key in operator.requests() if "rayclusters" in key and key.startswith(("PATCH", "PUT"))]
    (resumed_log,) = operator.state_dir.glob(f"{ns}/low-*/a0e1/trainer.log")
    assert "--resume" in resumed_log.read_text().splitlines()[0]
    print(f"[kueue] preemption to the high-priority job's pods Running: {to_high:.1f}s; quota freed to the "
          f"low-priority job's pods Running again: {to_low_pods:.1f}s, to its trainer stepping past step {checkpoint}: "
          f"{to_low_steps:.1f}s (KWOK pods, trainer stand-in)")
    clusters.stop()


def test_kueues_webhooks_answer_the_api_server_for_queued_rayclusters_only(local_cluster, k8s_namespace):
    kueue.ensure_running(local_cluster)
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        config = local_cluster.kubectl("get", kind.lower(), kueue.WEBHOOK_CONFIGURATIONS[kind], "-o", "yaml").stdout
        hooks = [h for h in yaml.safe_load(config)["webhooks"] if "rayclusters" in str(h["rules"])]
        assert hooks and all(h["objectSelector"] == {"matchExpressions": [
            {"key": kueue.QUEUE_LABEL, "operator": "Exists"}]} for h in hooks)
    # Kueue's own mutating webhook suspends a queued RayCluster as it is created (a server-side dry run
    # goes through admission, webhooks included, and stores nothing).
    manifest = {"apiVersion": "ray.io/v1", "kind": "RayCluster",
                "metadata": {"name": "queued", "labels": {kueue.QUEUE_LABEL: "ppo"}},
                "spec": {"headGroupSpec": {"rayStartParams": {}, "template": {"spec": {"containers": [
                    {"name": "ray-head", "image": "ppojob/trainer:0.1.0",
                     "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}}]}}}}}
    created = local_cluster.kubectl("create", "--dry-run=server", "-o", "yaml", "-n", k8s_namespace, "-f", "-",
                                    input=yaml.safe_dump(manifest)).stdout
    assert yaml.safe_load(created)["spec"]["suspend"] is True
    del manifest["metadata"]["labels"]
    created = local_cluster.kubectl("create", "--dry-run=server", "-o", "yaml", "-n", k8s_namespace, "-f", "-",
                                    input=yaml.safe_dump(manifest)).stdout
    assert not yaml.safe_load(created)["spec"].get("suspend")
