"""Certificates and keys for the local cluster, made with the openssl command line.

One CA signs the API server's serving certificate (127.0.0.1, localhost, the bridge address pods
reach it on, the `kubernetes` Service's ClusterIP), the real node's kubelet serving certificate,
and a client certificate per identity: the admin (group system:masters, so it may impersonate
anyone), the controller-manager and the scheduler (their built-in RBAC users), the real node's
kubelet (system:node:<name>, for the Node authorizer), kube-proxy (bound to system:node-proxier
by the built-in RBAC) and the API server's client to the kubelet. A separate RSA key pair signs and
verifies ServiceAccount tokens.
"""

from __future__ import annotations

import base64
import shutil
import subprocess
from pathlib import Path

from .node import BRIDGE_ADDRESS, NODE_NAME

# Bump when the set of certificates or their names change: an older folder is made anew.
PKI_VERSION = "2"
KUBERNETES_SERVICE_IP = "10.96.0.1"  # the first address of node.SERVICE_CIDR
ADMIN_USER = "ppojob-admin"

# file stem -> (common name, organisation or None)
CLIENTS: dict[str, tuple[str, str | None]] = {
    "admin": (ADMIN_USER, "system:masters"),
    "controller-manager": ("system:kube-controller-manager", None),
    "scheduler": ("system:kube-scheduler", None),
    "kubelet": (f"system:node:{NODE_NAME}", "system:nodes"),
    "kube-proxy": ("system:kube-proxy", None),
    "apiserver-kubelet-client": ("kube-apiserver-kubelet-client", "system:masters"),
}
SERVER = "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n"


class PKIError(RuntimeError):
    """openssl failed or is missing."""


def _openssl(*args: str, cwd: Path) -> None:
    result = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise PKIError(f"`openssl {' '.join(args)}` failed in {cwd}: {result.stderr.strip()}")


def _sign(pki: Path, stem: str, subject: str, extensions: str) -> None:
    (pki / f"{stem}.ext").write_text(extensions)
    _openssl(
        "req",
        "-new",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        f"{stem}.key",
        "-out",
        f"{stem}.csr",
        "-subj",
        subject,
        cwd=pki,
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        f"{stem}.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "3650",
        "-sha256",
        "-extfile",
        f"{stem}.ext",
        "-out",
        f"{stem}.crt",
        cwd=pki,
    )
    (pki / f"{stem}.csr").unlink()
    (pki / f"{stem}.ext").unlink()


def ensure_pki(pki: Path) -> Path:
    """Create the CA, serving, client and service-account keys once; reuse them afterwards."""
    marker = pki / "complete"
    if marker.exists() and marker.read_text().strip() == PKI_VERSION:
        return pki
    if shutil.which("openssl") is None:
        raise PKIError("`openssl` is not on PATH (Debian package openssl): needed for the cluster's certificates")
    if pki.exists():
        shutil.rmtree(pki)
    pki.mkdir(parents=True)
    _openssl(
        "req",
        "-x509",
        "-new",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "3650",
        "-subj",
        "/CN=ppojob-local-cluster-ca",
        cwd=pki,
    )
    _sign(
        pki,
        "apiserver",
        "/CN=kube-apiserver",
        SERVER + f"subjectAltName=IP:127.0.0.1,IP:{BRIDGE_ADDRESS},IP:{KUBERNETES_SERVICE_IP},DNS:localhost,"
        "DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local\n",
    )
    _sign(pki, "kubelet-serving", f"/CN={NODE_NAME}", SERVER + f"subjectAltName=IP:{BRIDGE_ADDRESS},DNS:{NODE_NAME}\n")
    for stem, (cn, org) in CLIENTS.items():
        subject = f"/CN={cn}" + (f"/O={org}" if org else "")
        _sign(
            pki,
            stem,
            subject,
            "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n",
        )
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=pki)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)
    for path in pki.iterdir():
        if path.suffix == ".key":
            path.chmod(0o600)
    marker.write_text(PKI_VERSION + "\n")
    return pki


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def kubeconfig_text(server: str, pki: Path, client: str, user: str) -> str:
    """A self-contained kubeconfig (data embedded) for `server` as the client certificate `client`."""
    return (
        "apiVersion: v1\nkind: Config\n"
        f"clusters:\n- name: ppojob-local\n  cluster:\n    server: {server}\n"
        f"    certificate-authority-data: {_b64(pki / 'ca.crt')}\n"
        f"users:\n- name: {user}\n  user:\n"
        f"    client-certificate-data: {_b64(pki / (client + '.crt'))}\n"
        f"    client-key-data: {_b64(pki / (client + '.key'))}\n"
        f"contexts:\n- name: ppojob-local\n  context:\n    cluster: ppojob-local\n    user: {user}\n"
        "current-context: ppojob-local\n"
    )


def kubeconfig_token_text(server: str, pki: Path, token: str) -> str:
    """A kubeconfig that authenticates with a bearer token only."""
    return (
        "apiVersion: v1\nkind: Config\n"
        f"clusters:\n- name: ppojob-local\n  cluster:\n    server: {server}\n"
        f"    certificate-authority-data: {_b64(pki / 'ca.crt')}\n"
        f"users:\n- name: token\n  user:\n    token: {token}\n"
        "contexts:\n- name: ppojob-local\n  context:\n    cluster: ppojob-local\n    user: token\n"
        "current-context: ppojob-local\n"
    )
