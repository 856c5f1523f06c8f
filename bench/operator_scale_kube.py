"""The benchmark's own view of the API server: a small async client (admin certificate) and watches
that keep the first time each job's objects were seen in each state.

Times are `time.monotonic()` (CLOCK_MONOTONIC, shared by every process on the machine, so the
stand-in's report times compare with them). A watch that ends is resumed from its last
resourceVersion, and relisted after 410 Gone: first sightings are kept across both. Depends on
aiohttp only.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import aiohttp


class ApiError(RuntimeError):
    def __init__(self, status: int, text: str):
        self.status = status
        super().__init__(f"HTTP {status}: {text[:300]}")


def admin_ssl(pki: Path) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    context.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
    return context


def collection_path(group: str, version: str, plural: str, namespace: str | None = None) -> str:
    root = f"/apis/{group}/{version}" if group else f"/api/{version}"
    return f"{root}/namespaces/{namespace}/{plural}" if namespace else f"{root}/{plural}"


class Api:
    """The admin's requests: `session` for the benchmark's writes and reads, `watch_session` for its
    watches, so that a watch the API server ends is resumed at once, not behind 64 slow deletes."""

    def __init__(self, server: str, pki: Path):
        self.server, self.pki = server, pki
        self.session: aiohttp.ClientSession | None = None
        self.watch_session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Self:
        context = admin_ssl(self.pki)
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context, limit=64),
                                             timeout=aiohttp.ClientTimeout(total=None))
        # Watch lines are whole objects: allow large ones.
        self.watch_session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context, limit=0),
                                                   timeout=aiohttp.ClientTimeout(total=None), read_bufsize=2**22)
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.session.close()
        await self.watch_session.close()

    async def request(self, method: str, path: str, body: Any = None, ok: tuple[int, ...] = (), *,
                      watching: bool = False) -> Any:
        session = self.watch_session if watching else self.session
        async with session.request(method, f"{self.server}{path}", json=body,
                                   timeout=aiohttp.ClientTimeout(total=120)) as response:
            text = await response.text()
            if response.status >= 300 and response.status not in ok:
                raise ApiError(response.status, text)
            return json.loads(text) if text and response.content_type == "application/json" else text

    async def create(self, path: str, body: Mapping[str, Any]) -> dict:
        return await self.request("POST", path, dict(body))

    async def delete(self, path: str) -> None:
        await self.request("DELETE", path, {"propagationPolicy": "Background"}, ok=(404,))

    async def items(self, path: str, selector: str | None = None) -> list[dict]:
        query = f"?labelSelector={selector}" if selector else ""
        return (await self.request("GET", f"{path}{query}"))["items"]

    async def metrics(self) -> str:
        return await self.request("GET", "/metrics")


@dataclass
class Sightings:
    """First times (monotonic) per job: keyed by (job, what), e.g. ("j0001", "raycluster")."""

    first: dict[tuple[str, str], float] = field(default_factory=dict)
    running_pods: dict[str, set[str]] = field(default_factory=dict)
    live: dict[str, set[str]] = field(default_factory=dict)
    """Objects of each kind that exist now (name sets), to know when deletion is done."""

    def saw(self, job: str, what: str, when: float) -> None:
        self.first.setdefault((job, what), when)

    def at(self, job: str, what: str) -> float | None:
        return self.first.get((job, what))


# A watch's handler: (event type, object, monotonic time seen) -> None
Handler = Callable[[str, dict, float], None]


async def watch(api: Api, path: str, handler: Handler, stop: asyncio.Event, connections: Counter[str]) -> None:
    """List, then watch from the list's resourceVersion until `stop`; resume or relist on any end.
    `connections[path]` counts the watch requests (one per 300 s, more if the API server ends them)."""
    version = None
    while not stop.is_set():
        try:
            if version is None:
                listing = await api.request("GET", path, watching=True)
                seen = time.monotonic()
                for item in listing["items"]:
                    handler("ADDED", item, seen)
                version = listing["metadata"]["resourceVersion"]
            url = f"{api.server}{path}?watch=1&resourceVersion={version}&timeoutSeconds=300&allowWatchBookmarks=true"
            connections[path] += 1
            async with api.watch_session.get(url) as response:
                if response.status == 410:
                    version = None
                    continue
                async for line in response.content:
                    event = json.loads(line)
                    if event["type"] == "ERROR":
                        version = None if event["object"].get("code") == 410 else version
                        break
                    version = event["object"]["metadata"]["resourceVersion"]
                    if event["type"] != "BOOKMARK":
                        handler(event["type"], event["object"], time.monotonic())
        except (TimeoutError, aiohttp.ClientError, ApiError, ValueError):
            await asyncio.sleep(0.2)
