"""Kueue: the RayCluster itself is the unit of admission; Kueue makes its own Workload for it.

No pod group is created here: the RayCluster carries `kueue.x-k8s.io/queue-name` and is created
suspended; Kueue unsuspends it once the whole cluster fits the queue's quota (all pods at once),
and the default scheduler places the pods. To preempt it, Kueue suspends it again (KubeRay deletes
its pods) and admits it again later. Needs spec.scheduling.queue (a LocalQueue); priorityClassName
names a WorkloadPriorityClass, Kueue's priority, which is not a pod's PriorityClass. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ppo_operator.gang.base import GangBackend, GroupResource
from ppojob_api.spec import PPOJobSpec
from ppojob_api.vocabulary import GangScheduler

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
WORKLOADS = GroupResource("kueue.x-k8s.io", "v1beta2", "workloads", "Workload")
LOCAL_QUEUES = GroupResource("kueue.x-k8s.io", "v1beta2", "localqueues", "LocalQueue")
# Kueue's flavor assigner (sigs.k8s.io/kueue pkg/scheduler/flavorassigner) gives a reason per flavor
# it tried: "... > maximum capacity (N)" where the request exceeds what the flavor could hold even
# with the ClusterQueue empty and all it may borrow, "insufficient unused quota ..." where it would
# fit once quota frees.
EXCEEDS_CAPACITY = "> maximum capacity"
FITS_LATER = "insufficient unused quota"


def never_fits(kueue_message: str) -> bool:
    """Kueue's reason for not admitting a workload says no flavor of its ClusterQueue could ever hold it."""
    return EXCEEDS_CAPACITY in kueue_message and FITS_LATER not in kueue_message


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

    def pod_priority_class(self, spec: PPOJobSpec) -> str | None:
        return None

    def describe_pending(self, pod_group: Mapping[str, Any] | None) -> str:
        return "kueue: admitted; the default scheduler places the pods"
