"""The seam between the operator and a gang scheduler: one small interface, one module per scheduler.

A backend says how a job's pods become one gang: the pod-group object to create first (or None
when the scheduler makes its own, as Kueue does), the labels and schedulerName that
make a pod join it, what goes on the RayCluster itself, and how to put the scheduler's state into
words for a condition. Everything here is pure; no API calls. Depends on the API package only.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping
from typing import Any

from ppojob_api.spec import PPOJobSpec
from ppojob_api.vocabulary import GangScheduler


@dataclasses.dataclass(frozen=True)
class GroupResource:
    """A Kubernetes resource type, as the operator watches and deletes it."""

    group: str
    version: str
    plural: str
    kind: str

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


@dataclasses.dataclass(frozen=True)
class Gang:
    """What a gang is made of: its group's name and the pods that must start together."""

    name: str
    min_member: int
    gpus: int


class GangBackend(abc.ABC):
    """One gang scheduler. Subclasses set `scheduler`, `default_scheduler_name`, `pod_group_resource`."""

    scheduler: GangScheduler
    default_scheduler_name: str | None = None
    pod_group_resource: GroupResource | None = None

    def __init__(self, scheduler_name: str | None = None):
        self.scheduler_name = scheduler_name or self.default_scheduler_name

    def check(self, spec: PPOJobSpec) -> str | None:
        """A problem with the spec that only this scheduler cares about, naming the field."""
        return None

    def build_pod_group(
        self, *, spec: PPOJobSpec, gang: Gang, metadata: Mapping[str, Any]
    ) -> dict[str, Any] | None:
        """The whole pod-group manifest to create before the RayCluster, or None."""
        return None

    def pod_labels(self, gang: Gang) -> dict[str, str]:
        return {}

    def cluster_labels(self, spec: PPOJobSpec) -> dict[str, str]:
        """Labels on the RayCluster itself (Kueue's queue name)."""
        return {}

    def pod_priority_class(self, spec: PPOJobSpec) -> str | None:
        """The PriorityClass of the job's pods: spec.scheduling.priorityClassName, unless the
        scheduler reads that name as a priority of its own."""
        return spec.scheduling.priority_class_name

    def cluster_suspended(self) -> bool:
        """Create the RayCluster suspended, for a scheduler that admits it by unsuspending it."""
        return False

    def describe_pending(self, pod_group: Mapping[str, Any] | None) -> str:
        """The scheduler's own account of a gang not yet placed, from its pod group's status."""
        return ""

    @property
    def label(self) -> str:
        return self.scheduler.value
