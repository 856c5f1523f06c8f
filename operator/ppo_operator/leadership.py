"""Whether this replica serves its jobs: the job loops follow kopf's peering, as kopf's watches do.

With `--peering`, kopf pauses its own watches while a live peer of higher (or equal) priority is
listed in the peering object. The job loops are asyncio tasks of ours, not kopf's, so kopf's pause
does not reach them: a paused replica would go on reconciling on indices that no longer move, and
at its next deadline take a trainer whose reports it no longer sees for lost (a job restarted in a
hand-over, found by the real-pod fault tests). So each loop waits on `Leadership.wait_serving`,
and `Leadership` reads the same peering objects by kopf's rule: a peer is alive until its
`lastseen` plus `lifetime`; this replica serves while no other live peer has a priority >= its own.
kopf keeps its pause toggle internal; the peering object's status ({identity: {priority, lastseen,
lifetime}}) is what every replica reads and writes. Depends on `kube`.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from ppo_operator.kube import Kube, KubeError

log = logging.getLogger(__name__)

PEERING_GROUP, PEERING_VERSION = "kopf.dev", "v1"


def serves(peers: Mapping[str, Mapping[str, Any]], identity: str, priority: int, now: datetime.datetime) -> bool:
    """kopf's rule over one peering object's status: no other live peer of a priority >= ours."""
    for peer, info in peers.items():
        if peer == identity or not isinstance(info, Mapping):
            continue
        lastseen = info.get("lastseen")
        seen = datetime.datetime.fromisoformat(lastseen) if lastseen else now  # kopf: no lastseen is alive now
        if seen.tzinfo is None:
            seen = seen.replace(tzinfo=datetime.UTC)
        if seen + datetime.timedelta(seconds=int(info.get("lifetime", 60))) <= now:
            continue  # dead: kopf ignores it (and cleans it up)
        if int(info.get("priority", 0)) >= priority:
            return False
    return True


def peering_paths(name: str, namespaces: Sequence[str]) -> tuple[str, ...]:
    """The peering objects kopf uses: one cluster-wide, or one in each served namespace."""
    root = f"/apis/{PEERING_GROUP}/{PEERING_VERSION}"
    if not namespaces:
        return (f"{root}/clusterkopfpeerings/{name}",)
    return tuple(f"{root}/namespaces/{ns}/kopfpeerings/{name}" for ns in namespaces)


class Leadership:
    """Serving or standing by. Standalone (no peering): always serving.

    With peering it starts standing by, as kopf does, until the peering objects say otherwise, then
    re-reads them every `interval_s` seconds. An object that cannot be read means standing by (kopf
    pauses too when its peering object is missing).
    """

    def __init__(self, kube: Kube | None = None, *, paths: Sequence[str] = (), identity: str = "",
                 priority: int = 0, interval_s: float = 2.0):
        self.kube, self.paths, self.identity, self.priority = kube, tuple(paths), identity, priority
        self.interval_s = interval_s
        self._serving = asyncio.Event()
        self._task: asyncio.Task | None = None
        if not self.paths:
            self._serving.set()

    def is_serving(self) -> bool:
        return self._serving.is_set()

    async def wait_serving(self) -> None:
        await self._serving.wait()

    def start(self) -> None:
        if self.paths and self._task is None:
            self._task = asyncio.create_task(self._follow(), name="peering follower")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def check(self) -> bool:
        """Read the peering objects once; serving if every one of them says so."""
        now = datetime.datetime.now(datetime.UTC)
        for path in self.paths:
            try:
                body = await self.kube.request("GET", path)
            except (TimeoutError, KubeError, OSError) as exc:
                log.warning("peering object %s unreadable (%s): standing by", path, exc)
                return False
            if not serves((body or {}).get("status") or {}, self.identity, self.priority, now):
                return False
        return True

    async def _follow(self) -> None:
        while True:
            serving = await self.check()
            if serving != self._serving.is_set():
                log.info("peering: this replica %s its jobs", "now serves" if serving else "stands by; it pauses")
                (self._serving.set if serving else self._serving.clear)()
            await asyncio.sleep(self.interval_s)
