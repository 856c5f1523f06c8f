"""What every child shares: metadata (name, labels, owner) and the shape of the job's gang.

Pure; depends on the API package, `names` and `job`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ppo_operator import names
from ppo_operator.gang import Gang
from ppo_operator.job import Job
from ppojob_api.spec import PPOJobSpec
from ppojob_api.vocabulary import ENV_PROGRESS_CONFIGMAP, Placement


@dataclasses.dataclass(frozen=True)
class BuildOptions:
    """Operator-wide settings of the manifests (flags of `ppo-operator`), not per job."""

    ray_version: str = "2.60.0"
    """RayCluster spec.rayVersion; must match the Ray inside the trainer image."""
    head_cpu: str = "2"
    head_memory: str = "8Gi"
    trainer_command: tuple[str, ...] = ("ppo-train",)
    """The trainer's command line before its CONFIG argument."""
    operator_namespace: str | None = None
    """The namespace of the operator's own pods, which each job's NetworkPolicy admits to the head's
    dashboard; None: the operator runs outside the cluster and the policy admits the job's pods only."""
    operator_pod_labels: tuple[tuple[str, str], ...] = ()
    """Labels that select the operator's pods in that namespace (the chart's selector labels)."""


def child_metadata(job: Job, name: str, *, attempt: int | None = None) -> dict[str, Any]:
    """Name, namespace, the job's labels (and attempt), and the job as controlling owner."""
    labels = names.job_labels(job.name) if attempt is None else names.attempt_labels(job.name, attempt)
    return {
        "name": name,
        "namespace": job.namespace,
        "labels": labels,
        "ownerReferences": [job.owner_reference()],
    }


@dataclasses.dataclass(frozen=True)
class RolloutShape:
    pods: int
    gpus_per_pod: int


def rollout_shape(spec: PPOJobSpec) -> RolloutShape:
    """Pods of the rollout engines' own (Disaggregated): as few as fit rollout.gpus on gpusPerNode nodes."""
    if spec.placement != Placement.DISAGGREGATED or spec.rollout.gpus == 0:
        return RolloutShape(0, 0)
    per_node = spec.resources.gpus_per_node or spec.rollout.gpus
    pods = math.ceil(spec.rollout.gpus / per_node)
    return RolloutShape(pods, math.ceil(spec.rollout.gpus / pods))


def gang_of(job: Job, spec: PPOJobSpec, attempt: int) -> Gang:
    """Every pod of the job (head, train workers, rollout workers) must start together."""
    rollout = rollout_shape(spec)
    return Gang(
        name=names.pod_group_name(job.name, attempt),
        min_member=1 + spec.resources.nodes + rollout.pods,
        gpus=spec.resources.total_gpus + rollout.pods * rollout.gpus_per_pod,
    )


def trainer_env(job: Job, attempt: int) -> dict[str, str]:
    """What the trainer reads of its job from the environment, wherever it is launched."""
    return {
        "PPOJOB_NAME": job.name,
        "PPOJOB_NAMESPACE": job.namespace,
        "PPOJOB_ATTEMPT": str(attempt),
        ENV_PROGRESS_CONFIGMAP: names.progress_configmap_name(job.name),
    }
