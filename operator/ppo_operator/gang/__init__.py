"""Gang schedulers behind one interface (`GangBackend`); `backend_for` picks one by the spec's name.

Depends on the API package only; each scheduler lives in a module of its own.
"""

from __future__ import annotations

from collections.abc import Mapping

from ppo_operator.gang.base import Gang, GangBackend, GroupResource
from ppo_operator.gang.coscheduling import CoschedulingBackend
from ppo_operator.gang.kueue import KueueBackend
from ppo_operator.gang.none import NoGangBackend
from ppojob_api.vocabulary import GangScheduler

BACKENDS: dict[GangScheduler, type[GangBackend]] = {
    GangScheduler.COSCHEDULING: CoschedulingBackend,
    GangScheduler.KUEUE: KueueBackend,
    GangScheduler.NONE: NoGangBackend,
}


def backend_for(
    scheduler: GangScheduler, scheduler_names: Mapping[GangScheduler, str] | None = None
) -> GangBackend:
    """The backend of a scheduler; `scheduler_names` overrides the schedulerName its pods ask for."""
    return BACKENDS[scheduler]((scheduler_names or {}).get(scheduler))


def pod_group_resources() -> list[GroupResource]:
    """Every pod-group type some backend creates (to watch and to clean up)."""
    return [b.pod_group_resource for b in BACKENDS.values() if b.pod_group_resource is not None]


__all__ = ["Gang", "GangBackend", "GroupResource", "backend_for", "pod_group_resources"]
