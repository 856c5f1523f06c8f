"""Kueue: the RayCluster itself is the unit of admission; Kueue makes its own Workload for it.

No pod group is created here: the RayCluster carries `kueue.x-k8s.io/queue-name` and is created
suspended; Kueue unsuspends it once the whole cluster fits the queue's quota (all pods at once),
and the default scheduler places the pods. Needs spec.scheduling.queue (a LocalQueue). Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ppo_operator.gang.base import GangBackend
from ppojob_api.spec import PPOJobSpec
from ppojob_api.vocabulary import GangScheduler

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"


class KueueBackend(GangBackend):
    scheduler = GangScheduler.KUEUE
    default_scheduler_name = None

    def check(self, spec: PPOJobSpec) -> str | None:
        if not spec.scheduling.queue:
            return "spec.scheduling.queue: gangScheduler Kueue needs the name of a LocalQueue in the job's namespace"
        return None

    def cluster_labels(self, spec: PPOJobSpec) -> dict[str, str]:
        labels = {QUEUE_LABEL: spec.scheduling.queue or ""}
        if spec.scheduling.priority_class_name:
            labels[PRIORITY_LABEL] = spec.scheduling.priority_class_name
        return labels

    def cluster_suspended(self) -> bool:
        return True

    def describe_pending(self, pod_group: Mapping[str, Any] | None) -> str:
        return "kueue: waiting for the RayCluster's workload to be admitted by its queue"
