"""`Kube` against a local HTTP server: its lanes (a status write has connections of its own, so it
never waits behind creates and deletes that a loaded API server holds for seconds), the token it
sends, its errors, and the counts it keeps."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web
from kubernetes import client

from ppo_operator.gang import GroupResource
from ppo_operator.kube import Kube, KubeError

PPOJOBS = GroupResource("ppojob.io", "v1alpha1", "ppojobs", "PPOJob")
PODGROUPS = GroupResource("scheduling.x-k8s.io", "v1alpha1", "podgroups", "PodGroup")


class FakeApiServer:
    """Answers PATCH at once and holds every DELETE until `release` is set; records what came."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.seen: list[tuple[str, str, str | None, dict | None]] = []

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else None
        self.seen.append((request.method, request.path, request.headers.get("Authorization"), body))
        if request.method == "DELETE":
            await self.release.wait()
            if request.path.endswith("/gone"):
                return web.json_response({"reason": "NotFound"}, status=404)
        if request.method == "POST":
            return web.json_response({"reason": "AlreadyExists"}, status=409)
        if request.method == "GET":
            return web.json_response({"message": "forbidden"}, status=403)
        return web.json_response({"metadata": {"resourceVersion": "7"}})


async def serve(fake: FakeApiServer) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fake.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


def kube_for(server: str, *, connections: int, status_connections: int) -> Kube:
    """As `config.load_kube_config` leaves a kubeconfig with a token user (and the in-cluster loader)."""
    configuration = client.Configuration(host=server, api_key={"BearerToken": "Bearer t0k3n"})
    return Kube(configuration, connections=connections, status_connections=status_connections)


def test_status_writes_do_not_wait_behind_other_writes():
    async def scenario():
        fake = FakeApiServer()
        runner, server = await serve(fake)
        kube = kube_for(server, connections=2, status_connections=1)
        try:
            deletes = [asyncio.ensure_future(kube.ensure_deleted(PODGROUPS, "ns", f"g{i}")) for i in range(4)]
            await asyncio.sleep(0.2)  # both connections of the other lane now held, two deletes queued
            stored = await asyncio.wait_for(kube.patch_status(PPOJOBS, "ns", "job", {"status": {"phase": "Training"}}), 2)
            assert not any(d.done() for d in deletes)
            fake.release.set()
            assert await asyncio.gather(*deletes) == [True] * 4
            return fake, kube, stored
        finally:
            fake.release.set()
            await kube.close()
            await runner.cleanup()

    fake, kube, stored = asyncio.run(scenario())
    assert stored == {"metadata": {"resourceVersion": "7"}}
    patch = [s for s in fake.seen if s[0] == "PATCH"]
    assert patch == [("PATCH", "/apis/ppojob.io/v1alpha1/namespaces/ns/ppojobs/job/status", "Bearer t0k3n",
                      {"status": {"phase": "Training"}})]
    assert kube.counts == {"DELETE podgroups": 4, "PATCH ppojobs/status": 1}


def test_idempotent_steps_take_already_done_as_done_and_other_errors_raise():
    async def scenario():
        fake = FakeApiServer()
        fake.release.set()
        runner, server = await serve(fake)
        kube = kube_for(server, connections=4, status_connections=1)
        try:
            created = await kube.ensure_created({"apiVersion": "v1", "kind": "ServiceAccount",
                                                 "metadata": {"name": "sa", "namespace": "ns"}})
            deleted = await kube.ensure_deleted(PODGROUPS, "ns", "gone")
            try:
                await kube.exists(PODGROUPS, "ns", "x")
            except KubeError as exc:
                return created, deleted, exc
            return created, deleted, None
        finally:
            await kube.close()
            await runner.cleanup()

    created, deleted, error = asyncio.run(scenario())
    assert created is False and deleted is False  # 409 on create, 404 on delete: already so
    assert error is not None and error.status == 403 and json.loads(error.body)["message"] == "forbidden"
