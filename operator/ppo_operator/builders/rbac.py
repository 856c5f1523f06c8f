"""The trainer's least-privilege identity: a ServiceAccount per job, and the one object it writes.

The trainer reports its progress to a ConfigMap of its job's (`build_progress_configmap`), not to
the PPOJob: a ConfigMap write costs the API server a fraction of a PPOJob write (no schema, no
large managedFields), and the operator folds each report into the status write it makes anyway,
so a report that moves the phase is one PPOJob write, not two. The Role grants `get` on the job
and `get`/`patch` on that ConfigMap, limited by resourceNames: a trainer can report its own
progress and nothing else. Pure.
"""

from __future__ import annotations

from typing import Any

from ppo_operator import names
from ppo_operator.builders.common import child_metadata
from ppo_operator.job import Job
from ppojob_api.vocabulary import GROUP, PLURAL


def build_service_account(job: Job) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": child_metadata(job, names.service_account_name(job.name)),
        "automountServiceAccountToken": True,
    }


def build_role(job: Job) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": child_metadata(job, names.service_account_name(job.name)),
        "rules": [
            {"apiGroups": [GROUP], "resources": [PLURAL], "resourceNames": [job.name], "verbs": ["get"]},
            {
                "apiGroups": [""],
                "resources": ["configmaps"],
                "resourceNames": [names.progress_configmap_name(job.name)],
                "verbs": ["get", "patch"],
            },
        ],
    }


def build_progress_configmap(job: Job) -> dict[str, Any]:
    """Empty until the trainer's first report (the operator then shows the status.progress it has)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_metadata(job, names.progress_configmap_name(job.name)),
        "data": {},
    }


def build_role_binding(job: Job) -> dict[str, Any]:
    name = names.service_account_name(job.name)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": child_metadata(job, name),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": job.namespace}],
    }


def build_token_request(*, expiration_seconds: int) -> dict[str, Any]:
    """A TokenRequest for the job's ServiceAccount (development mode's local trainer)."""
    return {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": {"audiences": [], "expirationSeconds": expiration_seconds},
    }


def build_kubeconfig(*, server: str, ca_data: str | None, token: str, namespace: str, insecure: bool = False) -> dict[str, Any]:
    """A kubeconfig holding only the job's ServiceAccount token (what the local trainer gets)."""
    cluster: dict[str, Any] = {"server": server}
    if ca_data:
        cluster["certificate-authority-data"] = ca_data
    if insecure:
        cluster["insecure-skip-tls-verify"] = True
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "ppojob", "cluster": cluster}],
        "users": [{"name": "trainer", "user": {"token": token}}],
        "contexts": [{"name": "trainer", "context": {"cluster": "ppojob", "user": "trainer", "namespace": namespace}}],
        "current-context": "trainer",
    }
