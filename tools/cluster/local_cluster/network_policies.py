"""The real node's NetworkPolicy enforcer: kube-router's network policy controller alone
(`--run-firewall`; its router and service proxy stay off), which turns each NetworkPolicy into
iptables chains and ipsets on this host for the pods of the real node. The bridge CNI plugin
enforces nothing by itself; KWOK's fake pods carry no traffic.

Why not SIG Network's kube-network-policies (v0.7.0, v0.8.0): it hands each new connection to user
space with nftables' `queue` statement, and this kernel is built without it (`# CONFIG_NFT_QUEUE is
not set`): `nft add rule inet t c ct state new queue num 100 bypass` fails with "Could not process
rule: No such file or directory". The kernel has NFQUEUE only as an iptables target, and
kube-network-policies has no iptables mode. kube-router's controller needs what the kernel has:
iptables (`physdev`, `addrtype`, `conntrack`, REJECT) and ipsets.

Built apart (build.build_apart), in a module and a cache directory keyed by KUBE_ROUTER_VERSION
alone: kube-router v2.1.0 requires k8s.io/* v0.29, older than the control plane's. `start` runs it
as one of the cluster's processes once the real node has registered; `ensure_running` adds it to a
cluster started without it. Depends on `build`, `pins`, and the cluster's process helpers.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

from . import build as builder
from .pins import Pins

if TYPE_CHECKING:
    from .cluster import LocalCluster

NAME = "kube-router"
MODULE = "github.com/cloudnativelabs/kube-router/v2"
PACKAGE = f"{MODULE}/cmd/kube-router"
RECIPE = "1"
"""Bump when the way kube-router is built changes: forces a rebuild."""

HOST_PACKAGES = {"ipset": Path("/usr/sbin/ipset")}
"""What it needs from Debian (debian.ensure_packages) beside the real node's iptables."""

FORWARD_CHAIN = "KUBE-ROUTER-FORWARD"
_CHAIN_PREFIXES = ("KUBE-ROUTER-", "KUBE-POD-FW-", "KUBE-NWPLCY-")
_IPSET_PREFIXES = ("KUBE-SRC-", "KUBE-DST-")


def build_dir(pins: Pins) -> Path:
    return builder.apart_dir(NAME, pins["KUBE_ROUTER_VERSION"], RECIPE)


def binary(pins: Pins) -> Path:
    return build_dir(pins) / "bin" / NAME


def build(pins: Pins, *, force: bool = False, out=None) -> dict:
    """Build kube-router unless cached; its version stamped so that `kube-router --version` names the pin."""
    version = pins["KUBE_ROUTER_VERSION"]
    return builder.build_apart(NAME, module=MODULE, version=version, package=PACKAGE, root=build_dir(pins),
                               ldflags=f"-s -w -X {MODULE}/pkg/version.Version={version}", force=force, out=out)


def process_args(*, kubeconfig: Path, node_name: str, service_cidr: str) -> list[str]:
    """The controller for the node's own pods (those whose hostIP is the node's InternalIP). No
    health or metrics server: both would listen on every address of the machine."""
    return [
        f"--kubeconfig={kubeconfig}",
        f"--hostname-override={node_name}",
        "--run-firewall=true",
        "--run-router=false",
        "--run-service-proxy=false",
        f"--service-cluster-ip-range={service_cidr}",
        "--health-port=0",
        "--metrics-port=0",
        "--v=1",
    ]


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def enforcing() -> bool:
    """Its controller runs: FORWARD jumps to its chain (made just before its first full sync)."""
    return any(rule.endswith(f"-j {FORWARD_CHAIN}") for rule in _run("iptables", "-S", "FORWARD").stdout.splitlines())


def start(cluster: LocalCluster, record: dict, deadline: float, out=None) -> None:
    """Built if needed, started, and waited on until its chains are in place. It reads the node's
    address when it starts: the kubelet must have registered the node."""
    from . import debian, node  # node imports this module for its clean-up

    debian.ensure_packages(HOST_PACKAGES, out)
    build(cluster.pins, out=out)
    args = process_args(kubeconfig=cluster.kubeconfig, node_name=node.NODE_NAME, service_cidr=node.SERVICE_CIDR)
    cluster._spawn(NAME, args, record, binary=binary(cluster.pins))
    cluster._wait(NAME, enforcing, deadline)


def ensure_running(cluster: LocalCluster, timeout: float = 300) -> None:
    """The enforcer on a running cluster that was started without it (or whose enforcer died): built,
    started and recorded, so that `down` stops it with the rest."""
    from .cluster import ClusterError, _alive, _locked  # cluster imports this module

    with _locked(cluster.state_dir):
        record = cluster._read_record()
        if not (record or {}).get("real_node"):
            raise ClusterError("the local cluster runs without its real node: no pod there for a policy to guard")
        process = record["processes"].get(NAME)
        if process is not None and _alive(process) and enforcing():
            return
        cluster._t0, cluster._ready_at = time.monotonic(), {}
        start(cluster, record, time.monotonic() + timeout)


def remove_rules() -> None:
    """What it leaves on the host once stopped: the jumps to its chains, its chains, its ipsets."""
    saved = _run("iptables-save", "-t", "filter").stdout
    kept = without_its_rules(saved)
    if kept != saved:
        subprocess.run(["iptables-restore", "-T", "filter"], input=kept, text=True, capture_output=True, check=True)
    if HOST_PACKAGES["ipset"].exists():
        for name in _run("ipset", "list", "-n").stdout.split():
            if name.startswith(_IPSET_PREFIXES):
                _run("ipset", "destroy", name)


def without_its_rules(saved: str) -> str:
    """`iptables-save` output less its chains (`:KUBE-POD-FW-…`), the rules in them (`-A KUBE-…`) and
    the jumps to them (`-j KUBE-…`): what `iptables-restore` puts back once it is gone."""

    def its(line: str) -> bool:
        words = line.split()
        if words and words[0].startswith(":"):
            return words[0][1:].startswith(_CHAIN_PREFIXES)
        if words[:1] == ["-A"] and words[1].startswith(_CHAIN_PREFIXES):
            return True
        return "-j" in words and words[words.index("-j") + 1].startswith(_CHAIN_PREFIXES)

    return "".join(line for line in saved.splitlines(keepends=True) if not its(line))
