"""Volcano: a PodGroup scheduling.volcano.sh/v1beta1, pods annotated with its name, scheduler `volcano`.

Volcano admits the group into its queue (spec.scheduling.queue, else `default`) and places
minMember pods together; its PodGroup's Unschedulable condition says why not. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ppo_operator.gang.base import Gang, GangBackend, GroupResource
from ppojob_api.spec import PPOJobSpec
from ppojob_api.vocabulary import GangScheduler

GROUP_NAME_ANNOTATION = "scheduling.k8s.io/group-name"


class VolcanoBackend(GangBackend):
    scheduler = GangScheduler.VOLCANO
    default_scheduler_name = "volcano"
    pod_group_resource = GroupResource("scheduling.volcano.sh", "v1beta1", "podgroups", "PodGroup")

    def build_pod_group(
        self, *, spec: PPOJobSpec, gang: Gang, metadata: Mapping[str, Any]
    ) -> dict[str, Any]:
        group_spec: dict[str, Any] = {"minMember": gang.min_member, "queue": spec.scheduling.queue or "default"}
        if gang.gpus:
            group_spec["minResources"] = {"nvidia.com/gpu": str(gang.gpus)}
        if spec.scheduling.priority_class_name:
            group_spec["priorityClassName"] = spec.scheduling.priority_class_name
        return {
            "apiVersion": self.pod_group_resource.api_version,
            "kind": self.pod_group_resource.kind,
            "metadata": dict(metadata),
            "spec": group_spec,
        }

    def pod_annotations(self, gang: Gang) -> dict[str, str]:
        return {GROUP_NAME_ANNOTATION: gang.name}

    def describe_pending(self, pod_group: Mapping[str, Any] | None) -> str:
        if not pod_group:
            return "volcano: pod group not observed yet"
        status = pod_group.get("status") or {}
        for condition in status.get("conditions") or []:
            if condition.get("type") == "Unschedulable" and condition.get("status") == "True":
                return f"volcano: {condition.get('reason', 'Unschedulable')}: {condition.get('message', '')}"
        return f"volcano: pod group {status.get('phase') or 'Pending'}"
