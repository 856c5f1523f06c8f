"""The operator's writes to the Kubernetes API: idempotent ensure/delete steps and the status patch.

Reads come from kopf's watch-fed indices, never from here (except the one-off reference check of
a volume claim or secret, and the phantom audit: `list_uids`). `ensure_created` treats 409 AlreadyExists as success and `ensure_deleted`
treats 404 NotFound as success, so each step can be repeated after a crash. The blocking
`kubernetes` client runs in a small thread pool; every request is counted by verb and resource
(`Kube.counts`) for the API-cost figures. Depends on the kubernetes client and `gang.GroupResource`.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import concurrent.futures
import json
import logging
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kubernetes import client, config

from ppo_operator.gang import GroupResource

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"


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
    "RayCluster": "rayclusters", "PodGroup": "podgroups",
}


class Kube:
    """An API client for the reconcile: async methods over the blocking kubernetes client.

    Two lanes, each its own threads and its own connection pool: status writes (`patch_status`)
    and everything else (creates, deletes, reads, tokens). A status write records a decision and
    shows the trainer's progress; under load a create or delete can hold a thread and a
    connection for seconds, and a status write must not queue behind hundreds of them.
    """

    def __init__(self, api_client: client.ApiClient, *, workers: int = 16,
                 status_api_client: client.ApiClient | None = None, status_workers: int = 16):
        self.api = api_client
        self.status_api = status_api_client or api_client
        self.counts: collections.Counter[str] = collections.Counter()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kube")
        self._status_pool = concurrent.futures.ThreadPoolExecutor(max_workers=status_workers,
                                                                  thread_name_prefix="kube-status")

    @classmethod
    def from_environment(cls, *, workers: int = 16, status_workers: int = 16) -> Kube:
        """In-cluster config inside a pod, else KUBECONFIG (the same choice kopf makes); a client per lane."""
        return cls(client.ApiClient(_configuration(workers)), workers=workers,
                   status_api_client=client.ApiClient(_configuration(status_workers)), status_workers=status_workers)

    # -- the one request primitive -------------------------------------------------------------
    @staticmethod
    def _request(api: client.ApiClient, method: str, path: str, body: Any = None,
                 content_type: str = "application/json") -> Any:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        _, url, headers, _, _ = api.param_serialize(method, path, header_params=headers, auth_settings=["BearerToken"])
        response = api.call_api(method, url, header_params=headers, body=body, _request_timeout=30)
        data = response.read() or b""
        if not 200 <= response.status < 300:
            raise KubeError(response.status, response.reason or "", data.decode(errors="replace"))
        return json.loads(data) if data else None

    async def request(self, method: str, path: str, body: Any = None, content_type: str = "application/json", *,
                      status_lane: bool = False) -> Any:
        self.counts[f"{method} {path_kind(path)}"] += 1
        pool, api = (self._status_pool, self.status_api) if status_lane else (self._pool, self.api)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(pool, self._request, api, method, path, body, content_type)

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

    async def ensure_deleted(self, resource: GroupResource, namespace: str, name: str) -> bool:
        """Delete with background propagation; True if deleted now, False if already gone."""
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}
        try:
            await self.request("DELETE", resource_path(resource, namespace, name), body)
            return True
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise

    async def exists(self, resource: GroupResource, namespace: str, name: str) -> bool:
        try:
            await self.request("GET", resource_path(resource, namespace, name))
            return True
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise

    async def list_uids(self, resource: GroupResource, namespace: str, label_selector: str) -> set[str]:
        """The uids of the objects of a kind that carry the labels, as the API server has them now."""
        path = f"{resource_path(resource, namespace)}?labelSelector={urllib.parse.quote(label_selector)}"
        return {item["metadata"]["uid"] for item in (await self.request("GET", path))["items"]}

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
        return self.api.configuration.host

    def ca_data(self) -> str | None:
        ca_file = self.api.configuration.ssl_ca_cert
        return base64.b64encode(Path(ca_file).read_bytes()).decode() if ca_file else None

    @property
    def verifies_tls(self) -> bool:
        return bool(self.api.configuration.verify_ssl)

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self._status_pool.shutdown(wait=False)


def _configuration(connections: int) -> client.Configuration:
    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        config.load_kube_config(client_configuration=configuration)
    configuration.connection_pool_maxsize = connections
    return configuration
