"""build_pod_group: the gang's pod group for one attempt, created before the RayCluster. Pure."""

from __future__ import annotations

from typing import Any

from ppo_operator.builders.common import child_metadata, gang_of
from ppo_operator.gang import GangBackend
from ppo_operator.job import Job
from ppojob_api.spec import PPOJobSpec


def build_pod_group(job: Job, spec: PPOJobSpec, *, attempt: int, backend: GangBackend) -> dict[str, Any] | None:
    """The whole pod-group manifest, or None when the scheduler needs none (Kueue, None)."""
    gang = gang_of(job, spec, attempt)
    return backend.build_pod_group(
        spec=spec, gang=gang, metadata=child_metadata(job, gang.name, attempt=attempt)
    )
