"""The objects of the scale benchmark, built alike on both sides so that the comparison is fair.

Both a PPOJob and its KubeRay counterpart, a RayJob, ask for the same pods: a head (1 CPU, 1 GiB,
no GPU) and one worker (1 CPU, 1 GiB, 1 GPU), on the same pool of fake nodes, gang-scheduled by
coscheduling with a PodGroup of minMember 2. The RayJob adds the submitter pod KubeRay creates.
Its PodGroup is created by the benchmark (`build_rayjob_pod_group`): KubeRay v1.5.0 creates pod
groups for RayClusters only, and its RayJob controller refuses to run at all with
`--batch-scheduler=scheduler-plugins` ("currently only RayCluster is supported, got *v1.RayJob").
Pure; depends on PyYAML and the example manifest.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import yaml

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny-ppojob.yaml"
POOL_LABEL = "ppojob.io/bench-pool"
POOL = "scale"
JOB_LABEL = "ppojob.io/bench-job"
"""Our label on each RayJob and (through KubeRay, which copies it) its RayCluster and pods."""
POD_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"
GANG_SCHEDULER = "scheduler-plugins-scheduler"
RAY_VERSION = "2.60.0"
IMAGE = "ppojob/trainer:0.1.0"
HEAD = {"cpu": "1", "memory": "1Gi"}
WORKER = {"cpu": "1", "memory": "1Gi", "nvidia.com/gpu": "1"}
SUBMITTER = {"cpu": "500m", "memory": "256Mi"}
PODS_PER_NODE = 110


def job_name(index: int) -> str:
    return f"j{index:04d}"


def ppojob(name: str, *, steps: int, warmup: int) -> dict[str, Any]:
    """The tiny example reshaped: 1 worker with 1 GPU on the pool, `steps` steps, `warmup` critic-only."""
    manifest = yaml.safe_load(EXAMPLE.read_text())
    manifest["metadata"] = {"name": name}
    spec = manifest["spec"]
    spec["ppo"] = {**spec["ppo"], "numRollouts": steps, "numCriticOnlySteps": warmup}
    spec["checkpoint"] = {**spec["checkpoint"], "interval": 0}
    spec["resources"] = {"nodes": 1, "gpusPerNode": 1, "cpusPerNode": WORKER["cpu"], "memoryPerNode": WORKER["memory"],
                         "sharedMemory": "1Gi", "nodeSelector": {POOL_LABEL: POOL}}
    return manifest


def _ray_pod(name: str, container: str, resources: dict[str, str]) -> dict[str, Any]:
    """A Ray pod template as the operator builds one: gang label, gang scheduler, pool, /dev/shm."""
    return {
        "metadata": {"labels": {JOB_LABEL: name, POD_GROUP_LABEL: name}},
        "spec": {
            "schedulerName": GANG_SCHEDULER,
            "nodeSelector": {POOL_LABEL: POOL},
            "containers": [{"name": container, "image": IMAGE, "resources": {"requests": resources, "limits": resources},
                            "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}]}],
            "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}}],
        },
    }


def rayjob(name: str) -> dict[str, Any]:
    """KubeRay's RayJob v1 (K8sJobMode: a submitter Job once the RayCluster is ready), torn down when it ends."""
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {"name": name, "labels": {JOB_LABEL: name}},
        "spec": {
            "entrypoint": "ppo-train /etc/ppojob/ppojob.yaml --address auto",
            "submissionMode": "K8sJobMode",
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": 0,
            "rayClusterSpec": {
                "rayVersion": RAY_VERSION,
                "enableInTreeAutoscaling": False,
                "headGroupSpec": {"rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0"},
                                  "template": _ray_pod(name, "ray-head", HEAD)},
                "workerGroupSpecs": [{"groupName": "train", "replicas": 1, "minReplicas": 1, "maxReplicas": 1,
                                      "rayStartParams": {}, "template": _ray_pod(name, "ray-worker", WORKER)}],
            },
            "submitterPodTemplate": {
                "metadata": {"labels": {JOB_LABEL: name}},
                "spec": {"restartPolicy": "Never", "nodeSelector": {POOL_LABEL: POOL},
                         "containers": [{"name": "ray-job-submitter", "image": IMAGE,
                                         "resources": {"requests": SUBMITTER, "limits": SUBMITTER}}]},
            },
        },
    }


def rayjob_pod_group(name: str, owner: dict[str, Any]) -> dict[str, Any]:
    """The PodGroup the operator would make for the same gang (minMember 2, 1 GPU), owned by the RayJob."""
    reference = {"apiVersion": "ray.io/v1", "kind": "RayJob", "name": owner["metadata"]["name"],
                 "uid": owner["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}
    return {
        "apiVersion": "scheduling.x-k8s.io/v1alpha1",
        "kind": "PodGroup",
        "metadata": {"name": name, "labels": {JOB_LABEL: name}, "ownerReferences": [reference]},
        "spec": {"minMember": 2, "scheduleTimeoutSeconds": 600, "minResources": {"nvidia.com/gpu": "1"}},
    }


def gc_probe(uid: str) -> dict[str, Any]:
    """A ConfigMap owned by a PPOJob that does not exist: the garbage collector deletes it as soon
    as it can look PPOJobs up, which it cannot for up to 30 s after their CRD is created."""
    owner = {"apiVersion": "ppojob.io/v1alpha1", "kind": "PPOJob", "name": "gc-probe", "uid": uid}
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "ppojob-gc-probe", "namespace": "default", "ownerReferences": [owner]}}


def pool_shape(max_jobs: int) -> tuple[int, int]:
    """(nodes, GPUs per node) holding every job of both kinds at once: 3 pods and 1 GPU per job, 110 pods a node."""
    nodes = max(2, math.ceil(3 * max_jobs / (PODS_PER_NODE - 10)))
    return nodes, math.ceil(max_jobs / nodes) + 2


def with_namespace(manifest: dict[str, Any], namespace: str) -> dict[str, Any]:
    manifest = copy.deepcopy(manifest)
    manifest["metadata"]["namespace"] = namespace
    return manifest
