"""Coscheduling (kubernetes-sigs/scheduler-plugins): a PodGroup scheduling.x-k8s.io/v1alpha1.

Pods join the group with the label `scheduling.x-k8s.io/pod-group` and are placed by the
scheduler-plugins scheduler, which holds them at Permit until minMember of them fit, and gives up
on the group after scheduleTimeoutSeconds. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ppo_operator.gang.base import Gang, GangBackend, GroupResource
from ppojob_api.spec import PPOJobSpec
from ppojob_api.vocabulary import GangScheduler

POD_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"


class CoschedulingBackend(GangBackend):
    scheduler = GangScheduler.COSCHEDULING
    default_scheduler_name = "scheduler-plugins-scheduler"
    pod_group_resource = GroupResource("scheduling.x-k8s.io", "v1alpha1", "podgroups", "PodGroup")

    def build_pod_group(
        self, *, spec: PPOJobSpec, gang: Gang, metadata: Mapping[str, Any]
    ) -> dict[str, Any]:
        group_spec: dict[str, Any] = {
            "minMember": gang.min_member,
            "scheduleTimeoutSeconds": spec.scheduling.schedule_timeout_seconds,
        }
        if gang.gpus:
            group_spec["minResources"] = {"nvidia.com/gpu": str(gang.gpus)}
        return {
            "apiVersion": self.pod_group_resource.api_version,
            "kind": self.pod_group_resource.kind,
            "metadata": dict(metadata),
            "spec": group_spec,
        }

    def pod_labels(self, gang: Gang) -> dict[str, str]:
        return {POD_GROUP_LABEL: gang.name}

    def describe_pending(self, pod_group: Mapping[str, Any] | None) -> str:
        if not pod_group:
            return "coscheduling: pod group not observed yet"
        status = pod_group.get("status") or {}
        min_member = (pod_group.get("spec") or {}).get("minMember", "?")
        phase = status.get("phase") or "Pending"
        return f"coscheduling: pod group {phase}, {status.get('scheduled', 0)}/{min_member} pods scheduled"
