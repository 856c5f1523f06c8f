"""build_raycluster: the KubeRay RayCluster of one attempt, its pods members of the job's gang.

Head (runs the trainer, the Ray driver; no GPUs) plus a `train` worker group of resources.nodes
pods with gpusPerNode GPUs (actor and critic share them), plus a `rollout` group in the
Disaggregated placement. Every pod: the gang's labels and schedulerName, the job's
ServiceAccount, a memory-backed /dev/shm of resources.sharedMemory for Ray's object store, the
checkpoint volume when one is named, Ray's token auth with the job's token, and the `restricted`
Pod Security Standard (non-root as the image's user, no privilege escalation, no capabilities,
seccomp RuntimeDefault; KubeRay copies the container's securityContext to the workers'
wait-gcs-ready init container), and a preStop hook with spec.checkpoint.terminationGracePeriodSeconds
to run it in, so that a stopped trainer finishes its step and checkpoints. Only the head mounts a ServiceAccount token: the trainer's
reporter, in the Ray driver on the head, is the one caller of the Kubernetes API.
Pure; depends on the API package, `names`, `gang`, `job`.
"""

from __future__ import annotations

from typing import Any

from ppo_operator import names
from ppo_operator.builders.common import BuildOptions, child_metadata, gang_of, rollout_shape, trainer_env
from ppo_operator.builders.ray_token import ray_token_env
from ppo_operator.gang import Gang, GangBackend
from ppo_operator.job import Job
from ppojob_api.spec import PPOJobSpec
from ppojob_api.vocabulary import LABEL_ROLE, ROLE_HEAD

GPU = "nvidia.com/gpu"
SHM_VOLUME = "dshm"
CHECKPOINT_VOLUME = "checkpoints"
TRAINER_UID = 1000
"""The trainer image's user `ray` and its group (images/trainer/Dockerfile)."""


def _pre_stop(role: str) -> dict[str, Any]:
    """A Ray pod's SIGTERM is lost (its PID 1, KubeRay's `bash -c ... ray start --block`, has no
    handler), so its preStop hook stops it instead (`ppo_trainer.graceful_stop`): the head's sends
    the trainer SIGTERM and waits while it finishes its step and checkpoints, a worker's waits while
    the job's actors serve it; both then end the container, so the pod goes once the checkpoint is
    written, within spec.checkpoint.terminationGracePeriodSeconds."""
    command = ["python", "-m", "ppo_trainer.graceful_stop"]
    command += ["head", "--pid-file", names.TRAINER_PID_FILE] if role == ROLE_HEAD else ["worker"]
    return {"preStop": {"exec": {"command": command}}}


def _resources(cpu: str, memory: str, gpus: int) -> dict[str, Any]:
    amounts: dict[str, Any] = {"cpu": cpu, "memory": memory}
    if gpus:
        amounts[GPU] = str(gpus)
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _env(job: Job, attempt: int) -> list[dict[str, Any]]:
    return [{"name": name, "value": value} for name, value in trainer_env(job, attempt).items()] + ray_token_env(job)


def _pod_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": TRAINER_UID,
        "runAsGroup": TRAINER_UID,
        "fsGroup": TRAINER_UID,  # the checkpoint claim is writable by the trainer
        # Ownership is fixed once, not walked through every checkpoint at each pod start.
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _container_security_context() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def _pod_template(
    job: Job, spec: PPOJobSpec, *, attempt: int, role: str, container: str, resources: dict[str, Any],
    gang: Gang, backend: GangBackend,
) -> dict[str, Any]:
    mounts = [{"name": SHM_VOLUME, "mountPath": "/dev/shm"}]
    volumes: list[dict[str, Any]] = [
        {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": spec.resources.shared_memory}}
    ]
    if spec.checkpoint.volume_claim:
        mounts.append({"name": CHECKPOINT_VOLUME, "mountPath": spec.checkpoint.path})
        volumes.append(
            {"name": CHECKPOINT_VOLUME, "persistentVolumeClaim": {"claimName": spec.checkpoint.volume_claim}}
        )
    ray_container: dict[str, Any] = {
        "name": container,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "resources": resources,
        "env": _env(job, attempt),
        "volumeMounts": mounts,
        "securityContext": _container_security_context(),
        "lifecycle": _pre_stop(role),
    }
    if spec.env_from_secret:
        ray_container["envFrom"] = [{"secretRef": {"name": spec.env_from_secret}}]
    pod_spec: dict[str, Any] = {
        "serviceAccountName": names.service_account_name(job.name),
        "automountServiceAccountToken": role == ROLE_HEAD,
        "securityContext": _pod_security_context(),
        "terminationGracePeriodSeconds": spec.checkpoint.termination_grace_period_seconds,
        "containers": [ray_container],
        "volumes": volumes,
    }
    if backend.scheduler_name:
        pod_spec["schedulerName"] = backend.scheduler_name
    if priority_class := backend.pod_priority_class(spec):
        pod_spec["priorityClassName"] = priority_class
    if spec.resources.node_selector:
        pod_spec["nodeSelector"] = dict(spec.resources.node_selector)
    if spec.resources.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in spec.resources.tolerations]
    metadata: dict[str, Any] = {
        "labels": {**names.attempt_labels(job.name, attempt), LABEL_ROLE: role, **backend.pod_labels(gang)}
    }
    return {"metadata": metadata, "spec": pod_spec}


def _worker_group(name: str, replicas: int, template: dict[str, Any]) -> dict[str, Any]:
    return {
        "groupName": name,
        "replicas": replicas,
        "minReplicas": replicas,
        "maxReplicas": replicas,
        "rayStartParams": {},
        "template": template,
    }


def build_raycluster(
    job: Job, spec: PPOJobSpec, *, attempt: int, backend: GangBackend, options: BuildOptions
) -> dict[str, Any]:
    """The whole RayCluster manifest of one attempt."""
    gang = gang_of(job, spec, attempt)
    common = {"job": job, "spec": spec, "attempt": attempt, "gang": gang, "backend": backend}
    res = spec.resources
    head = _pod_template(
        role=ROLE_HEAD, container="ray-head",
        resources=_resources(options.head_cpu, options.head_memory, 0), **common,
    )
    workers = [
        _worker_group(
            "train", res.nodes,
            _pod_template(
                role="train", container="ray-worker",
                resources=_resources(res.cpus_per_node, res.memory_per_node, res.gpus_per_node), **common,
            ),
        )
    ]
    rollout = rollout_shape(spec)
    if rollout.pods:
        workers.append(
            _worker_group(
                "rollout", rollout.pods,
                _pod_template(
                    role="rollout", container="ray-worker",
                    resources=_resources(res.cpus_per_node, res.memory_per_node, rollout.gpus_per_pod), **common,
                ),
            )
        )
    metadata = child_metadata(job, names.raycluster_name(job.name, attempt), attempt=attempt)
    metadata["labels"].update(backend.cluster_labels(spec))
    cluster_spec: dict[str, Any] = {
        "rayVersion": options.ray_version,
        "enableInTreeAutoscaling": False,
        # The head runs the driver only: no Ray tasks or actors land on it. Its dashboard listens
        # on every interface, as the operator reaches it through the head Service; the token and
        # the job's NetworkPolicy guard it.
        "headGroupSpec": {"rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0"}, "template": head},
        "workerGroupSpecs": workers,
    }
    if backend.cluster_suspended():
        cluster_spec["suspend"] = True
    return {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": metadata, "spec": cluster_spec}
