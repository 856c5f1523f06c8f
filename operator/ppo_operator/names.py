"""Deterministic names and labels of everything the operator creates for a PPOJob.

A name is a function of the job's name and the attempt, never of time or randomness, so that a
reconcile repeated after a crash at any point finds (409 AlreadyExists) what it made before
instead of making a second copy. Pure; depends on the standard library and the vocabulary only.
"""

from __future__ import annotations

import hashlib

from ppojob_api.vocabulary import LABEL_ATTEMPT, LABEL_JOB_NAME, LABEL_MANAGED_BY, MANAGED_BY

# RayCluster names end up in label values and in `<cluster>-head-svc` (both at most 63 characters);
# keep the job part short enough for the suffixes KubeRay and we append.
_MAX_BASE = 40
_MAX_LABEL = 63


def _shorten(name: str, limit: int) -> str:
    if len(name) <= limit:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:6]
    return f"{name[: limit - 7].rstrip('-.')}-{digest}"


def base_name(job_name: str) -> str:
    """The job's name, shortened with a stable hash suffix when too long for child names."""
    return _shorten(job_name, _MAX_BASE)


def job_label_value(job_name: str) -> str:
    """The value of ppojob.io/job-name on children (label values are at most 63 characters)."""
    return _shorten(job_name, _MAX_LABEL)


def raycluster_name(job_name: str, attempt: int) -> str:
    return f"{base_name(job_name)}-a{attempt}"


def pod_group_name(job_name: str, attempt: int) -> str:
    """The gang's pod group is named like the RayCluster whose pods it holds."""
    return raycluster_name(job_name, attempt)


def service_account_name(job_name: str) -> str:
    """The trainer's identity; one per job (not per attempt), as are its Role, RoleBinding and progress ConfigMap."""
    return f"{base_name(job_name)}-trainer"


def progress_configmap_name(job_name: str) -> str:
    """Where the trainer reports its progress; one per job, as its identity."""
    return f"{base_name(job_name)}-progress"


def ray_token_secret_name(job_name: str) -> str:
    """The Secret holding the job's Ray token; one per job, so every attempt's cluster shares it."""
    return f"{base_name(job_name)}-ray-token"


def network_policy_name(job_name: str) -> str:
    """The NetworkPolicy that says who may reach the job's Ray pods; one per job."""
    return f"{base_name(job_name)}-ray-ingress"


def submission_id(job_uid: str, attempt: int) -> str:
    """Ray job-submission id: the same for the same attempt, so a resubmission is refused, not doubled."""
    return f"ppojob-{job_uid}-a{attempt}"


def trainer_config_path(job_uid: str, attempt: int) -> str:
    """Where the attempt's entrypoint writes the trainer's config in the head container; one per
    attempt, so its trainer process is found by this argument."""
    return f"/tmp/{submission_id(job_uid, attempt)}.yaml"


TRAINER_PID_FILE = "/tmp/ppo-trainer.pid"
"""Where the trainer on a Ray head writes its pid (`ppo-train --pid-file`), for the head's preStop hook."""


def job_labels(job_name: str) -> dict[str, str]:
    return {LABEL_JOB_NAME: job_label_value(job_name), LABEL_MANAGED_BY: MANAGED_BY}


def attempt_labels(job_name: str, attempt: int) -> dict[str, str]:
    return {**job_labels(job_name), LABEL_ATTEMPT: str(attempt)}
