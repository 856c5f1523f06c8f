"""The real node: a kubelet with containerd and runc, bridge networking, kube-proxy and CoreDNS, beside
the KWOK nodes, so that pods on it run real containers on this machine.

Network. One Linux bridge, `ppojob0` with the host address 10.89.0.1/16, is made before the API
server starts: the API server, the kubelet and CoreDNS listen on that address, so pods reach them.
The bridge CNI plugin puts each pod on it with host-local addresses and two routes only (its own
subnet, and the service range through the host), no default route: nothing a container sends can
leave the machine. kube-proxy (iptables) makes the service range work; the `kubernetes` Service
points at the API server's bridge address. KWOK's fake pod addresses are a blackhole route, so a
connection to a Service of fake pods never leaves either.

Kubernetes runs the node: the kubelet registers `real-0` with the taint `ppojob.io/real-node` and
the label `ppojob.io/real-node=true`, so the fake-GPU tests keep landing on KWOK nodes and a
real-pod test opts in with a toleration and a node selector. It has no GPUs.

Everything the node leaves on the host is cleaned up by `stop_node`/`clean_host`: its pods (through
the CRI, so the CNI releases addresses and network namespaces), the kubelet's mounts under the
state dir, its cgroups, kube-proxy's iptables rules, the bridge and routes. Depends on nothing of the
repo's product code.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from . import network_policies

NODE_NAME = "real-0"
NODE_LABEL = "ppojob.io/real-node"
NODE_TAINT = {"key": NODE_LABEL, "value": "true", "effect": "NoSchedule"}
BRIDGE = "ppojob0"
BRIDGE_ADDRESS = "10.89.0.1"
POD_SUBNET = "10.89.0.0/16"
POD_RANGE_START = "10.89.1.1"
SERVICE_CIDR = "10.96.0.0/16"
KWOK_POD_CIDR = "10.244.0.0/16"
CLUSTER_DOMAIN = "cluster.local"
CNI_BIN_DIR = Path("/usr/lib/cni")
ISOLATION_CHAIN = "PPOJOB-ISOLATION"
INPUT_CHAIN = "PPOJOB-INPUT"
API_SERVER_PORT = 16443  # cluster.PORTS["kube-apiserver"]: it binds every address, for the bridge's sake
CGROUP_ROOT = Path("/sys/fs/cgroup")

# Fixed ports (besides the control plane's in cluster.PORTS).
NODE_PORTS: dict[str, int] = {
    "kubelet": 16466,  # on the bridge address: the API server's logs/exec/port-forward
    "kubelet-healthz": 16467,
    "kube-proxy-healthz": 16468,
    "kube-proxy-metrics": 16469,
    "coredns-health": 16470,
    "coredns-ready": 16471,
}

# What the node needs from Debian (debian.ensure_packages), and the file that shows each is there.
HOST_PACKAGES = {
    "containerd": Path("/usr/bin/containerd"),
    "runc": Path("/usr/sbin/runc"),
    "containernetworking-plugins": CNI_BIN_DIR / "bridge",
    "iptables": Path("/usr/sbin/iptables"),
    "conntrack": Path("/usr/sbin/conntrack"),
    "buildah": Path("/usr/bin/buildah"),
}


class NodeError(RuntimeError):
    """The host cannot run the real node; the message says what is missing and how to get it."""


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        raise NodeError(f"`{' '.join(cmd)}` failed ({result.returncode}): {result.stderr.strip() or result.stdout.strip()}")
    return result


# ---- host network ---------------------------------------------------------------------------------
def _sysctl(key: str, value: str) -> None:
    Path("/proc/sys", *key.split(".")).write_text(value)


def _guard(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """iptables in the table of the node's own guard chains: mangle, which the kernel traverses before
    filter. The policy enforcer keeps its jumps first in filter's INPUT and FORWARD and accepts there
    what a policy allows; the guards must see every packet before it."""
    return _run("iptables", "-t", "mangle", *args, check=check)


def _guard_has(*rule: str) -> bool:
    return _guard("-C", *rule, check=False).returncode == 0


def ensure_network() -> None:
    """The bridge with the host address, the routes, forwarding and the isolation chain; idempotent."""
    if _run("ip", "link", "show", BRIDGE, check=False).returncode != 0:
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
    if f"inet {BRIDGE_ADDRESS}/" not in _run("ip", "-4", "addr", "show", BRIDGE).stdout:
        _run("ip", "addr", "add", f"{BRIDGE_ADDRESS}/16", "dev", BRIDGE)
    _run("ip", "link", "set", BRIDGE, "up")
    # A ClusterIP is rewritten to a pod's address after the first route lookup: the service range
    # must route somewhere local for that lookup to succeed.
    _run("ip", "route", "replace", SERVICE_CIDR, "dev", BRIDGE)
    _run("ip", "route", "replace", "blackhole", KWOK_POD_CIDR)
    # kube-proxy's service rules need forwarding (pod -> host -> pod) and bridged traffic through iptables.
    _sysctl("net.ipv4.ip_forward", "1")
    _sysctl("net.bridge.bridge-nf-call-iptables", "1")
    if _guard("-n", "-L", ISOLATION_CHAIN, check=False).returncode != 0:
        _guard("-N", ISOLATION_CHAIN)
        _guard("-A", ISOLATION_CHAIN, "-i", BRIDGE, "!", "-o", BRIDGE, "-j", "DROP")
        _guard("-A", ISOLATION_CHAIN, "-o", BRIDGE, "!", "-i", BRIDGE, "-j", "DROP")
    if not _guard_has("FORWARD", "-j", ISOLATION_CHAIN):
        _guard("-I", "FORWARD", "1", "-j", ISOLATION_CHAIN)
    # The API server listens on every address so that both loopback and the bridge reach it; the
    # machine's own interfaces do not.
    if _guard("-n", "-L", INPUT_CHAIN, check=False).returncode != 0:
        _guard("-N", INPUT_CHAIN)
        _guard("-A", INPUT_CHAIN, "-i", "lo", "-j", "RETURN")
        _guard("-A", INPUT_CHAIN, "-i", BRIDGE, "-j", "RETURN")
        _guard("-A", INPUT_CHAIN, "-p", "tcp", "--dport", str(API_SERVER_PORT), "-j", "DROP")
    if not _guard_has("INPUT", "-j", INPUT_CHAIN):
        _guard("-I", "INPUT", "1", "-j", INPUT_CHAIN)


def remove_network() -> None:
    _run("ip", "link", "delete", BRIDGE, check=False)
    _run("ip", "route", "delete", "blackhole", KWOK_POD_CIDR, check=False)
    _run("ip", "route", "delete", SERVICE_CIDR, check=False)
    for parent, chain in (("FORWARD", ISOLATION_CHAIN), ("INPUT", INPUT_CHAIN)):
        while _guard_has(parent, "-j", chain):
            _guard("-D", parent, "-j", chain)
        _guard("-F", chain, check=False)
        _guard("-X", chain, check=False)
    _sysctl("net.ipv4.ip_forward", "0")


# ---- configuration --------------------------------------------------------------------------------
@dataclass(frozen=True)
class NodePaths:
    """Where the real node keeps its state, under the cluster's state dir."""

    root: Path

    @property
    def containerd(self) -> Path:
        return self.root / "containerd"

    @property
    def containerd_socket(self) -> Path:
        return self.containerd / "containerd.sock"

    @property
    def endpoint(self) -> str:
        return f"unix://{self.containerd_socket}"

    @property
    def kubelet_root(self) -> Path:
        return self.root / "kubelet"

    @property
    def config(self) -> Path:
        return self.root / "config"

    @property
    def cni_conf_dir(self) -> Path:
        return self.root / "cni" / "net.d"

    @property
    def pod_logs(self) -> Path:
        return self.root / "pod-logs"


def containerd_config(paths: NodePaths, *, sandbox_image: str) -> str:
    """containerd 1.6 (config version 2): CRI with runc (cgroupfs, as the kubelet), overlayfs, our CNI."""
    c = paths.containerd
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
root = "{c / 'root'}"
state = "{c / 'state'}"

[grpc]
  address = "{paths.containerd_socket}"

[ttrpc]
  address = "{paths.containerd_socket}.ttrpc"

[plugins."io.containerd.internal.v1.opt"]
  path = "{c / 'opt'}"

[{cri}]
  sandbox_image = "{sandbox_image}"
  # No process here may lower oom_score_adj (no CAP_SYS_RESOURCE in any bounding set): without
  # this, runc fails every sandbox with "can't get final child's PID from pipe".
  restrict_oom_score_adj = true
  enable_selinux = false

[{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"

[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[{cri}.containerd.runtimes.runc.options]
  SystemdCgroup = false
  Root = "{c / 'runc'}"

[{cri}.cni]
  bin_dir = "{CNI_BIN_DIR}"
  conf_dir = "{paths.cni_conf_dir}"
  max_conf_num = 1
"""


def cni_config(paths: NodePaths) -> str:
    """bridge + host-local (routes to the pod subnet and the service range only) + portmap."""
    network = {
        "cniVersion": "1.0.0",
        "name": "ppojob",
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": False,  # the host address is ours (made before the API server); no default route
                "ipMasq": False,
                "hairpinMode": True,  # a pod reaching itself through its own Service
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": POD_SUBNET, "rangeStart": POD_RANGE_START, "gateway": BRIDGE_ADDRESS}]],
                    "routes": [{"dst": SERVICE_CIDR, "gw": BRIDGE_ADDRESS}],
                    "dataDir": str(paths.root / "cni" / "ipam"),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }
    return json.dumps(network, indent=2) + "\n"


def kubelet_config(paths: NodePaths, pki: Path) -> str:
    """KubeletConfiguration: cgroup v1 with cgroupfs, x509 + webhook auth, our DNS, no image GC."""
    return f"""apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: {BRIDGE_ADDRESS}
port: {NODE_PORTS['kubelet']}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: {NODE_PORTS['kubelet-healthz']}
tlsCertFile: {pki / 'kubelet-serving.crt'}
tlsPrivateKeyFile: {pki / 'kubelet-serving.key'}
authentication:
  anonymous:
    enabled: false
  webhook:
    enabled: true
  x509:
    clientCAFile: {pki / 'ca.crt'}
authorization:
  mode: Webhook
# These machines mount cgroup v1; kubelet 1.34 runs on it only when told to.
failCgroupV1: false
cgroupDriver: cgroupfs
containerRuntimeEndpoint: {paths.endpoint}
podLogsDir: {paths.pod_logs}
clusterDomain: {CLUSTER_DOMAIN}
clusterDNS:
- {BRIDGE_ADDRESS}
# Pods never see the host's resolver: names outside the cluster do not resolve.
resolvConf: {paths.config / 'resolv.conf'}
registerWithTaints:
- key: {NODE_TAINT['key']}
  value: "{NODE_TAINT['value']}"
  effect: {NODE_TAINT['effect']}
failSwapOn: false
# No registry can be reached: an image collected here could never be pulled again.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: 200Mi
  nodefs.available: 1%
  imagefs.available: 1%
serializeImagePulls: false
staticPodPath: ""
"""


def kube_proxy_config(kubeconfig: Path) -> str:
    return f"""apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection:
  kubeconfig: {kubeconfig}
hostnameOverride: {NODE_NAME}
mode: iptables
clusterCIDR: {POD_SUBNET}
healthzBindAddress: 127.0.0.1:{NODE_PORTS['kube-proxy-healthz']}
metricsBindAddress: 127.0.0.1:{NODE_PORTS['kube-proxy-metrics']}
# NodePorts on the bridge only, never on the machine's own interface.
nodePortAddresses:
- {BRIDGE_ADDRESS}/32
conntrack:
  maxPerCore: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
"""


def corefile(kubeconfig: Path) -> str:
    """Cluster names only (services, pods, reverse lookups); anything else is refused, never forwarded."""
    return f"""{CLUSTER_DOMAIN}:53 in-addr.arpa:53 ip6.arpa:53 {{
    bind {BRIDGE_ADDRESS}
    errors
    health 127.0.0.1:{NODE_PORTS['coredns-health']}
    ready 127.0.0.1:{NODE_PORTS['coredns-ready']}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig} ppojob-local
        pods insecure
    }}
    cache 5
}}
"""


def write_configs(paths: NodePaths, pki: Path, *, sandbox_image: str, kubeconfigs: dict[str, Path]) -> None:
    for folder in (paths.config, paths.cni_conf_dir, paths.pod_logs, paths.kubelet_root, paths.containerd):
        folder.mkdir(parents=True, exist_ok=True)
    (paths.config / "containerd.toml").write_text(containerd_config(paths, sandbox_image=sandbox_image))
    for old in paths.cni_conf_dir.glob("*"):
        old.unlink()
    (paths.cni_conf_dir / "10-ppojob.conflist").write_text(cni_config(paths))
    (paths.config / "kubelet.yaml").write_text(kubelet_config(paths, pki))
    (paths.config / "kube-proxy.yaml").write_text(kube_proxy_config(kubeconfigs["kube-proxy"]))
    (paths.config / "Corefile").write_text(corefile(kubeconfigs["coredns"]))
    (paths.config / "resolv.conf").write_text(f"nameserver {BRIDGE_ADDRESS}\n")


def process_args(paths: NodePaths, kubeconfigs: dict[str, Path]) -> dict[str, list[str]]:
    """Command lines (after the binary) of the node's processes, in start order."""
    return {
        "containerd": ["--config", str(paths.config / "containerd.toml"), "--log-level", "warn"],
        "coredns": ["-conf", str(paths.config / "Corefile")],
        "kube-proxy": [f"--config={paths.config / 'kube-proxy.yaml'}"],
        "kubelet": [
            f"--config={paths.config / 'kubelet.yaml'}",
            f"--kubeconfig={kubeconfigs['kubelet']}",
            f"--root-dir={paths.kubelet_root}",
            f"--hostname-override={NODE_NAME}",
            f"--node-ip={BRIDGE_ADDRESS}",
            f"--node-labels={NODE_LABEL}=true,type=real",
        ],
    }


# ---- clean-up -------------------------------------------------------------------------------------
def crictl(bin_dir: Path, paths: NodePaths, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(bin_dir / "crictl"), "--runtime-endpoint", paths.endpoint, "--timeout", "30s", *args],
        capture_output=True, text=True, timeout=timeout, check=False,
    )


def remove_pods(bin_dir: Path, paths: NodePaths) -> None:
    """Stop and remove every pod sandbox through the CRI (containerd must run): the CNI gives back
    their addresses and network namespaces."""
    if paths.containerd_socket.exists():
        crictl(bin_dir, paths, "rmp", "--all", "--force", timeout=120)


def _mounts_under(root: Path) -> list[str]:
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point == str(root) or point.startswith(f"{root}/"):
            found.append(point)
    return found


def clean_host(bin_dir: Path, paths: NodePaths) -> None:
    """What the node leaves on the host once its processes are gone: mounts under its folder
    (deepest first), its cgroups, kube-proxy's and the policy enforcer's rules, runc state, the bridge."""
    for _ in range(3):
        mounts = sorted(set(_mounts_under(paths.root)), key=len, reverse=True)
        if not mounts:
            break
        for point in mounts:
            _run("umount", "-l", point, check=False)
    kube_proxy = bin_dir / "kube-proxy"
    if kube_proxy.exists():
        _run(str(kube_proxy), "--cleanup", check=False)
    for controller in CGROUP_ROOT.iterdir() if CGROUP_ROOT.is_dir() else ():
        top = controller / "kubepods"
        if not top.is_dir():
            continue
        # A cgroup folder goes with rmdir once it has no processes and no child cgroups: deepest first.
        for folder in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                folder.rmdir()
        with contextlib.suppress(OSError):
            top.rmdir()
    shutil.rmtree(paths.containerd / "state", ignore_errors=True)
    shutil.rmtree(paths.containerd / "runc", ignore_errors=True)
    shutil.rmtree(paths.root / "cni" / "ipam", ignore_errors=True)
    network_policies.remove_rules()
    remove_network()
