"""The job loops follow kopf's peering: a replica that a peer of higher priority outranks stands by
(reconciles nothing, even at its deadlines) and serves again once that peer is gone or dead."""

from __future__ import annotations

import asyncio
import datetime

from test_operator_handlers import body, make_runtime, start

from ppo_operator.kube import KubeError
from ppo_operator.leadership import Leadership, peering_paths, serves

NOW = datetime.datetime(2026, 12, 2, 12, 0, tzinfo=datetime.UTC)


def peer(priority: int, seconds_ago: float = 1, lifetime: int = 60) -> dict:
    return {"priority": priority, "lifetime": lifetime,
            "lastseen": (NOW - datetime.timedelta(seconds=seconds_ago)).isoformat()}


def test_a_live_peer_of_higher_or_equal_priority_outranks_this_replica():
    me = "me/1"
    assert serves({me: peer(10)}, me, 10, NOW)
    assert serves({me: peer(10), "other": peer(5)}, me, 10, NOW)
    assert not serves({me: peer(10), "other": peer(20)}, me, 10, NOW)
    assert not serves({me: peer(10), "other": peer(10)}, me, 10, NOW)  # kopf pauses both on a tie


def test_a_dead_peer_counts_for_nothing_and_one_without_lastseen_is_alive():
    assert serves({"other": peer(20, seconds_ago=61, lifetime=60)}, "me", 10, NOW)
    assert not serves({"other": peer(20, seconds_ago=59, lifetime=60)}, "me", 10, NOW)
    assert not serves({"other": {"priority": 20}}, "me", 10, NOW)


def test_the_peering_objects_are_kopfs_cluster_wide_one_or_one_per_namespace():
    assert peering_paths("op", []) == ("/apis/kopf.dev/v1/clusterkopfpeerings/op",)
    assert peering_paths("op", ["a", "b"]) == ("/apis/kopf.dev/v1/namespaces/a/kopfpeerings/op",
                                               "/apis/kopf.dev/v1/namespaces/b/kopfpeerings/op")


class PeeringObject:
    """A stand-in for the API server's one peering object (a unit test has no API server)."""

    def __init__(self, status: dict | None):
        self.status, self.reads = status, 0

    async def request(self, method: str, path: str):
        self.reads += 1
        if self.status is None:
            raise KubeError(404, "Not Found", "")
        return {"metadata": {"name": "op"}, "status": self.status}


def live_peer(priority: int) -> dict:
    return {"priority": priority, "lifetime": 60, "lastseen": datetime.datetime.now(datetime.UTC).isoformat()}


def test_an_outranked_replica_reconciles_nothing_until_the_higher_peer_leaves():
    async def scenario():
        peering = PeeringObject({"me": live_peer(10), "other": live_peer(20)})
        leadership = Leadership(peering, paths=peering_paths("op", []), identity="me", priority=10, interval_s=0.02)
        runtime, reconciler, _ = make_runtime(leadership=leadership)
        runtime.reconciler.delay = 0.01  # a loop that would reconcile at every short deadline
        leadership.start()
        loop = runtime.jobs.seen(("ns", "a"), body(), start(runtime))
        await asyncio.sleep(0.2)
        runtime.jobs.wake(("ns", "a"), prompt=True)  # wakes do not help either
        await asyncio.sleep(0.1)
        assert reconciler.passes == 0 and peering.reads >= 3
        del peering.status["other"]  # the higher peer exits (kopf removes its entry)
        await asyncio.sleep(0.2)
        assert reconciler.passes > 0
        await runtime.jobs.stop_all(1)
        await leadership.stop()
        assert loop.task.done()

    asyncio.run(scenario())


def test_a_serving_replica_stops_reconciling_once_outranked_and_when_its_peering_object_is_gone():
    async def scenario():
        peering = PeeringObject({"me": live_peer(10)})
        leadership = Leadership(peering, paths=peering_paths("op", []), identity="me", priority=10, interval_s=0.02)
        runtime, reconciler, _ = make_runtime(leadership=leadership)
        runtime.reconciler.delay = 0.01
        leadership.start()
        runtime.jobs.seen(("ns", "a"), body(), start(runtime))
        await asyncio.sleep(0.2)
        assert reconciler.passes > 0
        peering.status["other"] = live_peer(20)  # a replica of higher priority joins
        await asyncio.sleep(0.1)
        paused_at = reconciler.passes
        await asyncio.sleep(0.2)
        assert reconciler.passes == paused_at and not leadership.is_serving()
        del peering.status["other"]
        await asyncio.sleep(0.1)
        assert leadership.is_serving() and reconciler.passes > paused_at
        peering.status = None  # the peering object deleted: kopf pauses, and so do the loops
        await asyncio.sleep(0.1)
        assert not leadership.is_serving()
        await runtime.jobs.stop_all(1)
        await leadership.stop()

    asyncio.run(scenario())


def test_a_standalone_operator_always_serves():
    assert Leadership().is_serving()
