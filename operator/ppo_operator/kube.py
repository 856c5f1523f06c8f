"""The operator's writes to the Kubernetes API: idempotent ensure/delete steps and the status patch.

Reads come from kopf's watch-fed indices, never from here (except the one-off reference check of
a volume claim or secret, the Ray token a launcher reads once per job, and the phantom audit:
`list_uids`). `ensure_created` treats 409 AlreadyExists as success and `ensure_deleted`
treats 404 NotFound as success, so each step can be repeated after a crash. Requests are made
with aiohttp on the operator's event loop (the `kubernetes` client only finds the credentials,
as kopf's login does); every request is counted by verb and resource (`Kube.counts`) for the
API-cost figures. Depends on aiohttp, the kubernetes client's config and `gang.GroupResource`.
"""

from __future__ import annotations

import base64
import collections
import json
import logging
import ssl
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes import client, config

from ppo_operator.gang import GroupResource
from ppojob_api.vocabulary import GROUP, KIND, PLURAL, VERSION

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"
PPOJOBS = GroupResource(GROUP, VERSION, PLURAL, KIND)
SECRETS = GroupResource("", "v1", "secrets", "Secret")


class KubeError(RuntimeError):
    def __init__(self, status: int, reason: str, body: str):
        self.status, self.reason, self.body = status, reason, body
        super().__init__(f"HTTP {status} {reason}: {body[:500]}")


def resource_path(resource: GroupResource, namespace: str, name: str | None = None, sub: str | None = None) -> str:
    root = f"/apis/{resource.group}/{resource.version}" if resource.group else f"/api/{resource.version}"
    path = f"{root}/namespaces/{namespace}/{resource.plural}"
    if name:
        path += f"/{name}"
    if sub:
        path += f"/{sub}"
    return path


def path_kind(path: str) -> str:
    """'/apis/g/v/namespaces/ns/plural/name/status' -> 'plural/status' (for request counts)."""
    parts = path.partition("?")[0].strip("/").split("/")
    rest = parts[parts.index("namespaces") + 2:] if "namespaces" in parts else parts[-1:]
    return "/".join([rest[0], *rest[2:]]) if rest else path


def resource_of(manifest: Mapping[str, Any], plural: str) -> GroupResource:
    group, _, version = manifest["apiVersion"].rpartition("/")
    return GroupResource(group, version, plural, manifest["kind"])


PLURALS = {
    "ServiceAccount": "serviceaccounts", "Role": "roles", "RoleBinding": "rolebindings",
    "RayCluster": "rayclusters", "PodGroup": "podgroups", "ConfigMap": "configmaps",
    "Secret": "secrets", "NetworkPolicy": "networkpolicies",
}


class Kube:
    """An API client for the reconcile: async requests on the operator's event loop.

    Two lanes, each its own connection pool: status writes (`patch_status`) and everything else
    (creates, deletes, reads, tokens). A status write records a decision and shows the trainer's
    progress; under load a create or delete can hold a connection for seconds, and a status write
    must not queue behind hundreds of them. No threads: with a thread per request, at 500 jobs a
    status write spent most of its time waiting for the GIL behind the other requests' threads
    (docs/scale.md).
    """

    def __init__(self, configuration: client.Configuration, *, connections: int = 64, status_connections: int = 64):
        self.configuration = configuration
        self.connections, self.status_connections = connections, status_connections
        self.counts: collections.Counter[str] = collections.Counter()
        self._sessions: dict[bool, aiohttp.ClientSession] = {}

    @classmethod
    def from_environment(cls, *, connections: int = 64, status_connections: int = 64) -> Kube:
        """In-cluster config inside a pod, else KUBECONFIG (the same choice kopf makes)."""
        return cls(_configuration(), connections=connections, status_connections=status_connections)

    # -- the one request primitive -------------------------------------------------------------
    def _session(self, status_lane: bool) -> aiohttp.ClientSession:
        """The lane's session, made on first use inside the running event loop."""
        session = self._sessions.get(status_lane)
        if session is None or session.closed:
            limit = self.status_connections if status_lane else self.connections
            connector = aiohttp.TCPConnector(ssl=self._tls(), limit=limit)
            session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30))
            self._sessions[status_lane] = session
        return session

    def _tls(self) -> ssl.SSLContext | bool:
        c = self.configuration
        if not c.verify_ssl:
            return False
        context = ssl.create_default_context(cafile=c.ssl_ca_cert)
        if c.cert_file:
            context.load_cert_chain(c.cert_file, c.key_file)
        return context

    def _headers(self, content_type: str) -> dict[str, str]:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        # Where the kubernetes config loaders put a token (refreshed in a pod by their hook).
        token = self.configuration.get_api_key_with_prefix("BearerToken", alias="authorization")
        if token:
            headers["Authorization"] = token
        return headers

    async def request(self, method: str, path: str, body: Any = None, content_type: str = "application/json", *,
                      status_lane: bool = False) -> Any:
        self.counts[f"{method} {path_kind(path)}"] += 1
        data = None if body is None else json.dumps(body)
        async with self._session(status_lane).request(method, self.configuration.host + path, data=data,
                                                      headers=self._headers(content_type)) as response:
            payload = await response.read()
        if not 200 <= response.status < 300:
            raise KubeError(response.status, response.reason or "", payload.decode(errors="replace"))
        return json.loads(payload) if payload else None

    # -- idempotent steps ----------------------------------------------------------------------
    async def ensure_created(self, manifest: Mapping[str, Any]) -> bool:
        """Create; True if created now, False if it already existed (success either way)."""
        resource = resource_of(manifest, PLURALS[manifest["kind"]])
        try:
            await self.request("POST", resource_path(resource, manifest["metadata"]["namespace"]), dict(manifest))
            return True
        except KubeError as exc:
            if exc.status == 409:
                return False
            raise

    async def ensure_deleted(self, resource: GroupResource, namespace: str, name: str, *,
                             grace_period_seconds: int | None = None) -> bool:
        """Delete with background propagation (and this grace period, shorter than one already
        running); True if deleted now, False if already gone."""
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}
        if grace_period_seconds is not None:
            body["gracePeriodSeconds"] = grace_period_seconds
        try:
            await self.request("DELETE", resource_path(resource, namespace, name), body)
            return True
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise

    async def get(self, resource: GroupResource, namespace: str, name: str) -> dict:
        return await self.request("GET", resource_path(resource, namespace, name))

    async def exists(self, resource: GroupResource, namespace: str, name: str) -> bool:
        try:
            await self.get(resource, namespace, name)
            return True
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise

    async def list(self, resource: GroupResource, namespace: str, label_selector: str) -> list[dict]:
        """The objects of a kind that carry the labels, as the API server has them now."""
        path = f"{resource_path(resource, namespace)}?labelSelector={urllib.parse.quote(label_selector)}"
        return (await self.request("GET", path))["items"]

    async def list_uids(self, resource: GroupResource, namespace: str, label_selector: str) -> set[str]:
        return {item["metadata"]["uid"] for item in await self.list(resource, namespace, label_selector)}

    async def patch_status(self, resource: GroupResource, namespace: str, name: str, patch: Mapping[str, Any]) -> dict:
        """Merge-patch the status subresource (in the status lane); returns the object as stored."""
        return await self.request("PATCH", resource_path(resource, namespace, name, "status"), dict(patch), MERGE_PATCH,
                                  status_lane=True)

    async def request_token(self, namespace: str, service_account: str, body: Mapping[str, Any]) -> str:
        sa = GroupResource("", "v1", "serviceaccounts", "ServiceAccount")
        result = await self.request("POST", resource_path(sa, namespace, service_account, "token"), dict(body))
        return result["status"]["token"]

    # -- what a kubeconfig for the trainer needs -----------------------------------------------
    @property
    def server(self) -> str:
        return self.configuration.host

    def ca_data(self) -> str | None:
        ca_file = self.configuration.ssl_ca_cert
        return base64.b64encode(Path(ca_file).read_bytes()).decode() if ca_file else None

    @property
    def verifies_tls(self) -> bool:
        return bool(self.configuration.verify_ssl)

    async def close(self) -> None:
        for session in self._sessions.values():
            await session.close()
        self._sessions.clear()


def _configuration() -> client.Configuration:
    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        config.load_kube_config(client_configuration=configuration)
    return configuration
