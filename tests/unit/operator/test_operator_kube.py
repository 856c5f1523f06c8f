"""`Kube`'s lanes: a status write has threads and connections of its own, so it never waits behind
creates and deletes that a loaded API server holds for seconds."""

from __future__ import annotations

import asyncio
import threading

from ppo_operator.gang import GroupResource
from ppo_operator.kube import Kube

PPOJOBS = GroupResource("ppojob.io", "v1alpha1", "ppojobs", "PPOJob")
PODGROUPS = GroupResource("scheduling.x-k8s.io", "v1alpha1", "podgroups", "PodGroup")


class Response:
    status, reason = 200, "OK"

    def read(self) -> bytes:
        return b'{"metadata": {"resourceVersion": "7"}}'


class FakeApiClient:
    """The two calls `Kube` makes of a kubernetes ApiClient; `hold` blocks every request until set."""

    def __init__(self, hold: threading.Event | None = None):
        self.hold, self.calls = hold, []

    def param_serialize(self, method, path, header_params, auth_settings):
        return method, path, header_params, None, None

    def call_api(self, method, url, header_params, body, _request_timeout):
        self.calls.append((method, url, threading.current_thread().name))
        if self.hold is not None:
            assert self.hold.wait(10), "held request never released"
        return Response()


def test_status_writes_do_not_wait_behind_other_writes():
    release = threading.Event()
    writes, statuses = FakeApiClient(hold=release), FakeApiClient()
    kube = Kube(writes, workers=2, status_api_client=statuses, status_workers=1)

    async def scenario():
        deletes = [asyncio.ensure_future(kube.ensure_deleted(PODGROUPS, "ns", f"g{i}")) for i in range(4)]
        await asyncio.sleep(0.05)  # both write threads now held, two deletes queued behind them
        stored = await asyncio.wait_for(kube.patch_status(PPOJOBS, "ns", "job", {"status": {"phase": "Training"}}), 2)
        assert not any(d.done() for d in deletes)
        release.set()
        await asyncio.gather(*deletes)
        return stored

    try:
        assert asyncio.run(scenario()) == {"metadata": {"resourceVersion": "7"}}
    finally:
        release.set()
        kube.close()
    assert statuses.calls == [("PATCH", "/apis/ppojob.io/v1alpha1/namespaces/ns/ppojobs/job/status", "kube-status_0")]
    assert {c[0] for c in writes.calls} == {"DELETE"} and all(c[2].startswith("kube_") for c in writes.calls)
    assert kube.counts == {"DELETE podgroups": 4, "PATCH ppojobs/status": 1}
