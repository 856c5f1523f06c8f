"""A counting reverse proxy in front of the local API server, to measure the operator's requests.

The operator is given a kubeconfig pointing at http://127.0.0.1:<port>; the proxy forwards each
request to the real API server over TLS, as the admin (client certificate) or, when the request
carries its own bearer token (the trainer's), with that token only. Responses are streamed, so
watches work. `counts` holds (who, verb, resource) -> requests, `who` being operator or trainer.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import threading
from pathlib import Path

import aiohttp
from aiohttp import web

HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


def verb_and_resource(method: str, path: str, query: str) -> tuple[str, str]:
    parts = path.strip("/").split("/")
    if "namespaces" in parts and len(parts) > parts.index("namespaces") + 2:
        rest = parts[parts.index("namespaces") + 2:]
    else:
        rest = parts[3:] if parts[:1] == ["apis"] else parts[2:]
    named = len(rest) >= 2
    resource = "/".join([rest[0], *rest[2:]]) if rest else path
    verb = {"GET": "get" if named else ("watch" if "watch=" in query else "list"), "POST": "create",
            "PATCH": "patch", "PUT": "update", "DELETE": "delete"}.get(method, method)
    return verb, resource


class CountingProxy:
    def __init__(self, server: str, pki: Path):
        self.server, self.pki = server.rstrip("/"), pki
        self.counts: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _ssl(self, with_cert: bool) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        if with_cert:
            context.load_cert_chain(str(self.pki / "admin.crt"), str(self.pki / "admin.key"))
        return context

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        token = request.headers.get("Authorization")
        who = "trainer" if token else "operator"
        self.counts[(who, *verb_and_resource(request.method, request.path, request.query_string))] += 1
        session = self._token_session if token else self._admin_session
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        body = await request.read()
        async with session.request(request.method, f"{self.server}{request.path_qs}", headers=headers,
                                   data=body or None, timeout=aiohttp.ClientTimeout(total=None)) as upstream:
            # aiohttp decompresses the upstream body: its Content-Encoding must not be passed on.
            response = web.StreamResponse(status=upstream.status, headers={
                k: v for k, v in upstream.headers.items() if k.lower() not in HOP | {"content-encoding"}})
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def start():
            self._admin_session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self._ssl(True)))
            self._token_session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self._ssl(False)))
            app = web.Application(client_max_size=64 * 2**20)
            app.router.add_route("*", "/{tail:.*}", self._handle)
            self._runner = web.AppRunner(app, access_log=None)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]
            self._ready.set()

        self._loop.run_until_complete(start())
        self._loop.run_forever()

    def start(self) -> CountingProxy:
        self._thread.start()
        self._ready.wait(10)
        return self

    def kubeconfig(self, path: Path) -> Path:
        path.write_text(
            "apiVersion: v1\nkind: Config\n"
            f"clusters:\n- name: proxy\n  cluster:\n    server: http://127.0.0.1:{self.port}\n"
            "users:\n- name: proxy\n  user: {}\n"
            "contexts:\n- name: proxy\n  context:\n    cluster: proxy\n    user: proxy\n"
            "current-context: proxy\n"
        )
        return path

    def snapshot(self) -> collections.Counter:
        return collections.Counter(self.counts)

    def stop(self) -> None:
        async def stop():
            await self._runner.cleanup()
            await self._admin_session.close()
            await self._token_session.close()

        # Open watches of a still-running operator keep requests alive: do not wait for them.
        asyncio.run_coroutine_threadsafe(stop(), self._loop)
