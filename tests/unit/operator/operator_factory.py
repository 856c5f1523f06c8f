"""make_ppojob(**overrides): the one factory of PPOJob bodies (and observations) for the operator's unit tests."""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from typing import Any

import pytest

from ppo_operator.job import Job
from ppo_operator.observed import ClusterRecord, PodGroupRecord, PodRecord

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)

BASE_SPEC: dict[str, Any] = {
    "image": "ppojob/trainer:test",
    "resources": {"nodes": 2, "gpusPerNode": 4, "cpusPerNode": "8", "memoryPerNode": "32Gi", "sharedMemory": "4Gi"},
    "ppo": {"numRollouts": 5, "numCriticOnlySteps": 2},
}


def _merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    result = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = _merge(result[key], value)
        else:
            result[key] = copy.deepcopy(value)
    return result


def make_ppojob(
    *, name: str = "tiny", namespace: str = "team-a", uid: str = "1234-abcd", generation: int = 1,
    status: dict[str, Any] | None = None, deleting: bool = False, **spec_overrides: Any,
) -> dict[str, Any]:
    """A PPOJob body as the API server returns it; keyword arguments override spec sections."""
    metadata: dict[str, Any] = {
        "name": name, "namespace": namespace, "uid": uid, "generation": generation,
        "resourceVersion": "100", "creationTimestamp": "2026-01-01T11:00:00Z",
    }
    if deleting:
        metadata["deletionTimestamp"] = "2026-01-01T12:00:00Z"
    return {
        "apiVersion": "ppojob.io/v1alpha1",
        "kind": "PPOJob",
        "metadata": metadata,
        "spec": _merge(BASE_SPEC, spec_overrides),
        "status": copy.deepcopy(status or {}),
    }


def make_job(**overrides: Any) -> Job:
    return Job.from_body(make_ppojob(**overrides))


@pytest.fixture
def now() -> datetime:
    return NOW


def pods(attempt: int, count: int, *, placed: bool = True, scheduled_at: datetime | None = None,
         created: datetime | None = None, unschedulable: str = "", phase: str = "Running"):
    """Records of a gang's pods (head first), as the pod index summarizes them."""
    roles = ["head"] + ["train"] * (count - 1)
    return tuple(
        PodRecord(
            name=f"tiny-a{attempt}-{role}-{i}", attempt=attempt, role=role, phase=phase if placed else "Pending",
            node=f"kwok-gpu-{i}" if placed else None, created=created or datetime(2026, 1, 1, 11, 0, tzinfo=UTC),
            scheduled_at=(scheduled_at or datetime(2026, 1, 1, 11, 1, tzinfo=UTC)) if placed else None,
            unschedulable="" if placed else unschedulable, deleting=False, uid=f"uid-a{attempt}-{role}-{i}",
        )
        for i, role in enumerate(roles)
    )


def cluster(attempt: int, *, ready: bool = True):
    return ClusterRecord(name=f"tiny-a{attempt}", attempt=attempt, ready=ready, state="ready" if ready else "",
                         suspended=False, deleting=False, uid=f"uid-cluster-a{attempt}")


def pod_group(attempt: int, *, phase: str = "Pending", scheduled: int = 0):
    return PodGroupRecord(name=f"tiny-a{attempt}", attempt=attempt, api_version="scheduling.x-k8s.io/v1alpha1",
                          kind="PodGroup", summary={"spec": {"minMember": 3}, "status": {"phase": phase, "scheduled": scheduled}},
                          deleting=False, uid=f"uid-group-a{attempt}")
