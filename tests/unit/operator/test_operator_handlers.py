"""The kopf wiring: the indices the daemon reads are the ones registered, under the same names
(a kopf handler's default id is its qualified name, which nested functions would not match)."""

from __future__ import annotations

import asyncio

import kopf
from operator_factory import cluster, pod_group, pods

from ppo_operator import handlers
from ppo_operator.gang import pod_group_resources


def test_the_daemon_reads_every_registered_index_by_its_id():
    registry = kopf.OperatorRegistry()
    resources = tuple(pod_group_resources())
    handlers.register(registry, pod_group_resources=resources)
    index_ids = {h.id for h in registry._indexing.get_all_handlers()}  # kopf keeps no public listing
    assert {h.id for h in registry._spawning.get_all_handlers()} == {"ppojob"}
    runtime = handlers.Runtime(reconciler=None, launcher=None, pod_group_resources=resources)
    key = ("team-a", "tiny")
    records = {
        "ppojob_pods": pods(0, 2),
        "ppojob_rayclusters": (cluster(0),),
        handlers.pod_group_index(resources[0]): (pod_group(0),),
    }
    assert set(records) <= index_ids
    children = runtime.children(key, {name: {key: value} for name, value in records.items()})
    assert (len(children.pods), len(children.clusters), len(children.pod_groups)) == (2, 1, 1)


def test_wakers_wake_the_daemon_of_that_job_only():
    async def scenario():
        wakers = handlers.Wakers()
        mine, other = wakers.register(("ns", "a")), wakers.register(("ns", "b"))
        wakers.wake(("ns", "a"))
        assert mine.is_set() and not other.is_set()
        wakers.unregister(("ns", "a"), mine)
        wakers.wake(("ns", "a"))  # no daemon any more: nothing to do, no error

    asyncio.run(scenario())
