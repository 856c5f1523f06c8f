"""No gang scheduler: the default scheduler places pods one by one (development, single-pod jobs).

A partial placement can then hold GPUs; the schedule timeout still fails the job and deletes the
RayCluster, so nothing is held for ever. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ppo_operator.gang.base import GangBackend
from ppojob_api.vocabulary import GangScheduler


class NoGangBackend(GangBackend):
    scheduler = GangScheduler.NONE
    default_scheduler_name = None

    def describe_pending(self, pod_group: Mapping[str, Any] | None) -> str:
        return "no gang scheduler: pods are placed one by one by the default scheduler"
