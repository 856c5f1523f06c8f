"""Start, attach to and stop the local Kubernetes cluster: real binaries as processes on this machine.

The control plane listens on 127.0.0.1 (the API server also on the real node's bridge address, so
pods reach it); KWOK runs the fake GPU nodes and `node` the real one (kubelet, containerd, kube-proxy,
CoreDNS). Each component runs in its own process group with its log under <state>/logs/. Their pids
(and /proc start times, so a recycled pid is never mistaken for ours) are recorded in
<state>/cluster.json; `stop` signals exactly those process groups and nothing else, then removes
what the real node left on the host.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import io
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from . import build as builder
from . import debian, kueue, manifests, network_policies, node
from .pins import Pins, build_dir, default_state_dir, load_pins
from .pki import ensure_pki, kubeconfig_text, kubeconfig_token_text

HOST = "127.0.0.1"

# Fixed loopback ports, so that a second process (pytest, make, a shell) can find a running cluster.
PORTS: dict[str, int] = {
    "etcd": 23790,
    "etcd-peer": 23800,
    "kube-apiserver": 16443,
    "kube-controller-manager": 16457,
    "kube-scheduler": 16459,
    "gang-scheduler": 16460,
    "gang-controller-metrics": 16461,
    "gang-controller-probe": 16462,
    "kuberay-metrics": 16463,
    "kuberay-probe": 16464,
    "kwok": 16465,
}

GANG_SCHEDULER_NAME = "scheduler-plugins-scheduler"
SERVICE_CIDR = node.SERVICE_CIDR
POD_CIDR = "10.244.0.1/16"
"""Pod IPs KWOK hands out: nothing dials them (no pod runs), but they must not be loopback addresses,
which Endpoints and EndpointSlices refuse: the endpoint controllers would retry every Service's update
for its whole life, each failure a Warning Event (about 20 a job: a third of all API requests at 10 jobs).
The host routes them to a blackhole (node.KWOK_POD_CIDR): a connection to a Service of fake pods never
leaves the machine."""


class ClusterError(RuntimeError):
    """A component failed to start or become ready; the message names it and its log."""


class ToolError(subprocess.CalledProcessError):
    """kubectl or helm failed; unlike CalledProcessError its message includes the tool's stderr."""

    def __str__(self) -> str:
        return f"{super().__str__()}\nstderr: {(self.stderr or '').strip()}"


def _proc_start_time(pid: int) -> str | None:
    """Field 22 of /proc/<pid>/stat (start time in clock ticks), or None if no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _alive(record: dict) -> bool:
    """Our recorded process still runs (a zombie, killed but not yet reaped by its parent, does not)."""
    try:
        state = Path(f"/proc/{record['pid']}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z" and _proc_start_time(record["pid"]) == record["start_time"]


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


@contextlib.contextmanager
def _locked(state_dir: Path):
    """Serialise start/stop between processes that share a state dir (pytest sessions, make)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    with open(state_dir / "lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class LocalCluster:
    """A handle on the local cluster: started by this process (`start`) or found running (`attach`)."""

    state_dir: Path = field(default_factory=default_state_dir)
    pins: Pins = field(default_factory=load_pins)
    owns_processes: bool = False
    _popen: dict[str, subprocess.Popen] = field(default_factory=dict, repr=False)

    # ---- paths --------------------------------------------------------------------------------
    @property
    def bin_dir(self) -> Path:
        return build_dir(self.pins) / "bin"

    @property
    def kubeconfig(self) -> Path:
        """Admin kubeconfig (client certificate in group system:masters)."""
        return self.state_dir / "kubeconfig"

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def record_file(self) -> Path:
        return self.state_dir / "cluster.json"

    @property
    def node_paths(self) -> node.NodePaths:
        """The real node's folders (containerd, kubelet, CNI, configs) under the state dir."""
        return node.NodePaths(self.state_dir / "node")

    @property
    def containerd_address(self) -> Path:
        """The real node's containerd socket (`ctr --address`, `crictl --runtime-endpoint unix://...`)."""
        return self.node_paths.containerd_socket

    def crictl(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """crictl against the real node's containerd; text output captured."""
        return node.crictl(self.bin_dir, self.node_paths, *args, timeout=timeout)

    @property
    def server(self) -> str:
        return f"https://{HOST}:{PORTS['kube-apiserver']}"

    # ---- running tools ------------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        """os.environ with KUBECONFIG set to this cluster and its bin dir first on PATH."""
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        return env

    def _tool(
        self, tool: str, args: tuple[str, ...], check: bool, input: str | None, timeout: float
    ) -> subprocess.CompletedProcess:
        cmd = [str(self.bin_dir / tool), *args]
        result = subprocess.run(
            cmd, env=self.env(), input=input, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and result.returncode != 0:
            raise ToolError(result.returncode, cmd, result.stdout, result.stderr)
        return result

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess:
        """Run this cluster's kubectl as the admin; text output captured."""
        return self._tool("kubectl", args, check, input, timeout)

    def helm(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 300
    ) -> subprocess.CompletedProcess:
        """Run helm v3 (built with the cluster) against this cluster as the admin."""
        return self._tool("helm", args, check, input, timeout)

    def wait_established(self, *crds: str, timeout: float = 60) -> None:
        """Each named CRD (`ppojobs.ppojob.io`) serves its kind. Polled rather than `kubectl wait
        --for=condition=Established`, which fails at once ("accessor error") when it reads a CRD created
        a moment ago whose status has no conditions yet."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.kubectl("get", "crd", "-o", "json", check=False, timeout=20)
            items = json.loads(found.stdout)["items"] if found.returncode == 0 else []
            established = {
                crd["metadata"]["name"]
                for crd in items
                if any(c["type"] == "Established" and c["status"] == "True"
                       for c in (crd.get("status") or {}).get("conditions") or [])
            }
            pending = [name for name in crds if name not in established]
            if not pending:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"CRDs not established after {timeout:.0f} s: {', '.join(pending)}")
            time.sleep(0.5)

    def apply(self, yaml_text: str, *extra: str) -> subprocess.CompletedProcess:
        """`kubectl apply -f -` with the given manifest text."""
        return self.kubectl("apply", "-f", "-", *extra, input=yaml_text)

    def create_token(self, service_account: str, namespace: str = "default", duration: str = "1h") -> str:
        """A ServiceAccount token from the TokenRequest API (what `kubectl create token` does)."""
        return self.kubectl(
            "create", "token", service_account, "-n", namespace, f"--duration={duration}"
        ).stdout.strip()

    def kubeconfig_for_token(self, token: str, path: Path | str) -> Path:
        """Write a kubeconfig that authenticates with a bearer token only (e.g. a ServiceAccount's)."""
        path = Path(path)
        path.write_text(kubeconfig_token_text(self.server, self.state_dir / "pki", token))
        path.chmod(0o600)
        return path

    def add_fake_node(
        self,
        name: str,
        gpus: int | None = None,
        cpu: str | None = None,
        memory: str | None = None,
        labels: dict[str, str] | None = None,
        wait: float = 60,
    ) -> None:
        """Add a KWOK-managed fake node (defaults from versions.env) and wait until it is Ready."""
        p = self.pins.values
        self.apply(
            manifests.fake_node(
                name,
                int(gpus if gpus is not None else p.get("FAKE_NODE_GPUS", 8)),
                cpu or p.get("FAKE_NODE_CPU", "64"),
                memory or p.get("FAKE_NODE_MEMORY", "512Gi"),
                labels,
            )
        )
        self.kubectl("wait", "--for=condition=Ready", f"node/{name}", f"--timeout={int(wait)}s", timeout=wait + 30)

    def delete_node(self, name: str) -> None:
        self.kubectl("delete", "node", name, "--ignore-not-found", "--wait=true")

    def default_node_names(self) -> list[str]:
        return [manifests.node_name(i) for i in range(int(self.pins.values.get("FAKE_NODE_COUNT", 4)))]

    # ---- health -------------------------------------------------------------------------------
    def _admin_ssl(self) -> ssl.SSLContext:
        pki = self.state_dir / "pki"
        ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
        return ctx

    @staticmethod
    def _get(url: str, ctx: ssl.SSLContext | None = None, timeout: float = 3) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(url, context=ctx, timeout=timeout) as resp:
                return resp.status, resp.read().decode(errors="replace")
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode(errors="replace")
        except (urllib.error.URLError, OSError) as err:
            return 0, str(err)

    def apiserver_ready(self) -> bool:
        if not (self.state_dir / "pki" / "complete").exists():
            return False
        status, _ = self._get(f"{self.server}/readyz", self._admin_ssl())
        return status == 200

    def _insecure_ssl(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE  # components' self-signed serving certs, loopback health checks only
        return ctx

    def _checks(self) -> dict[str, callable]:
        """Readiness probe per component (after the API server is up)."""
        insecure = self._insecure_ssl()

        def https_ok(port: int) -> callable:
            return lambda: self._get(f"https://{HOST}:{port}/healthz", insecure)[0] == 200

        def http_ok(port: int, path: str) -> callable:
            return lambda: self._get(f"http://{HOST}:{port}{path}")[0] == 200

        return {
            "kube-controller-manager": https_ok(PORTS["kube-controller-manager"]),
            "kube-scheduler": https_ok(PORTS["kube-scheduler"]),
            "gang-scheduler": https_ok(PORTS["gang-scheduler"]),
            "gang-controller": http_ok(PORTS["gang-controller-probe"], "/readyz"),
            "kuberay-operator": http_ok(PORTS["kuberay-probe"], "/readyz"),
            "coredns": lambda: self._get(f"http://{HOST}:{node.NODE_PORTS['coredns-ready']}/ready")[0] == 200,
            "kube-proxy": http_ok(node.NODE_PORTS["kube-proxy-healthz"], "/healthz"),
            "kubelet": http_ok(node.NODE_PORTS["kubelet-healthz"], "/healthz"),
        }

    # ---- lifecycle ----------------------------------------------------------------------------
    def _read_record(self) -> dict | None:
        try:
            return json.loads(self.record_file.read_text())
        except (OSError, ValueError):
            return None

    def _write_record(self, record: dict) -> None:
        tmp = self.record_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        tmp.replace(self.record_file)

    def is_running(self) -> bool:
        record = self._read_record()
        if not record or not record.get("ready"):
            return False
        if not all(_alive(p) for p in record["processes"].values()):
            return False
        return self.apiserver_ready()

    @classmethod
    def attach(cls, state_dir: Path | str | None = None) -> LocalCluster:
        """A handle on a cluster already running from `state_dir` (e.g. `make cluster-up`); never stops it."""
        cluster = cls(state_dir=Path(state_dir) if state_dir else default_state_dir())
        if not cluster.is_running():
            raise ClusterError(
                f"no ready local cluster is recorded in {cluster.record_file}; "
                "start one with `python -m local_cluster up`"
            )
        record = cluster._read_record()
        if record.get("pins_key") != cluster.pins.key():
            raise ClusterError(
                f"the running cluster was built from other pins ({record.get('pins_key')}) than "
                f"versions.env ({cluster.pins.key()}); restart it: down, then up"
            )
        return cluster

    @classmethod
    def running(cls, state_dir: Path | str | None = None) -> LocalCluster | None:
        """`attach`, or None when no ready cluster is recorded."""
        try:
            return cls.attach(state_dir)
        except ClusterError:
            return None

    @classmethod
    def start(
        cls, state_dir: Path | str | None = None, timeout: float = 180, out=None, *, real_node: bool = True
    ) -> LocalCluster:
        """Build if needed, start every component, wait for readiness. The returned handle owns them.
        `real_node=False` leaves out the real node (KWOK nodes only: the scale benchmark)."""
        cluster = cls(state_dir=Path(state_dir) if state_dir else default_state_dir(), owns_processes=True)
        with _locked(cluster.state_dir):
            if cluster.is_running():  # another process started it meanwhile: use it, never stop it
                cluster.owns_processes = False
                return cluster
            cluster._start(timeout, out, real_node=real_node)
        return cluster

    def _say(self, out, text: str) -> None:
        if out is not None:
            print(text, file=out, flush=True)

    def _start(self, timeout: float, out, *, real_node: bool) -> None:
        t0 = self._t0 = time.monotonic()
        self._ready_at: dict[str, float] = {}
        builder.build(self.pins, out=out if out is not None else io.StringIO())
        self.state_dir.mkdir(parents=True, exist_ok=True)
        stale = self._read_record()
        if stale:
            self._stop_record(stale)
        node.clean_host(self.bin_dir, self.node_paths)  # what a killed run may have left
        if real_node:
            installed = debian.ensure_packages(node.HOST_PACKAGES, out)
            if installed:
                self._ready_at["Debian packages installed"] = round(installed, 1)
        # The API server advertises the bridge address: it must exist first (KWOK-only clusters too).
        node.ensure_network()
        busy = [f"{name} ({port})" for name, port in PORTS.items() if not _port_free(port)]
        if busy:
            raise ClusterError(
                f"ports on {HOST} already in use: {', '.join(busy)}; another cluster may be "
                "running (`python -m local_cluster down`) or another program holds them"
            )
        self.log_dir.mkdir(exist_ok=True)
        for old in self.log_dir.glob("*.log"):
            old.unlink()
        pki = ensure_pki(self.state_dir / "pki")
        self._write_configs(pki)
        data = self.state_dir / "etcd-data"
        shutil.rmtree(data, ignore_errors=True)
        record = {
            "pins_key": self.pins.key(),
            "bin_dir": str(self.bin_dir),
            "kubeconfig": str(self.kubeconfig),
            "ports": PORTS,
            "processes": {},
            "ready": False,
            "real_node": real_node,
        }
        self._write_record(record)
        deadline = time.monotonic() + timeout
        try:
            self._spawn("etcd", self._etcd_args(data), record)
            self._wait("etcd", lambda: self._get(f"http://{HOST}:{PORTS['etcd']}/health")[0] == 200, deadline)
            self._spawn("kube-apiserver", self._apiserver_args(pki), record)
            self._wait("kube-apiserver", self.apiserver_ready, deadline)
            t_api = time.monotonic()
            components = self._component_args(pki)
            # These need no CRD: start them while the CRDs are applied.
            for name in ("kube-controller-manager", "kube-scheduler", "kwok"):
                self._spawn(name, components.pop(name), record)
            if real_node:  # needs no CRD either
                self._start_real_node(pki, record, deadline)
            self.apply(manifests.fake_nodes(self.pins.values))
            self._apply_crds()
            self._ready_at["CRDs established"] = round(time.monotonic() - t0, 1)
            for name, args in components.items():  # the gang scheduler, its controller and KubeRay watch CRDs
                self._spawn(name, args, record)
            kueue.start(self, record, deadline, out)  # after KubeRay's CRDs: its RayCluster integration needs them
            for name, check in self._checks().items():
                if name in record["processes"]:
                    self._wait(name, check, deadline)
            self._wait("fake nodes Ready (kwok)", self._nodes_ready, deadline, log_name="kwok")
            if real_node:
                self._wait(f"real node {node.NODE_NAME} Ready (kubelet)", self._real_node_ready, deadline,
                           log_name="kubelet")
                network_policies.start(self, record, deadline, out)
            self._wait(
                "default ServiceAccount (kube-controller-manager)",
                self._default_sa_exists,
                deadline,
                log_name="kube-controller-manager",
            )
        except BaseException:
            self._stop_record(self._read_record() or record)
            raise
        record["ready"] = True
        record["started_s"] = round(time.monotonic() - t0, 1)
        record["apiserver_ready_s"] = round(t_api - t0, 1)
        record["ready_at_s"] = self._ready_at
        self._write_record(record)
        self._say(out, "ready at (s since start): " + ", ".join(f"{k} {v}" for k, v in self._ready_at.items()))
        self._say(
            out,
            f"local cluster ready in {record['started_s']}s (API server ready after {record['apiserver_ready_s']}s)",
        )
        self._say(out, f"kubeconfig: {self.kubeconfig}")

    def _spawn(self, name: str, args: list[str], record: dict, binary: Path | None = None) -> None:
        log = self.log_dir / f"{name}.log"
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PATH"] = f"{env.get('PATH', '')}{os.pathsep}/usr/sbin{os.pathsep}/sbin"  # runc, iptables, mount
        binary = binary or self.bin_dir / name
        with log.open("ab") as fh:
            proc = subprocess.Popen(
                [str(binary), *args],
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.state_dir,
                env=env,
                start_new_session=True,
            )
        self._popen[name] = proc
        record["processes"][name] = {
            "pid": proc.pid,
            "pgid": proc.pid,
            "start_time": _proc_start_time(proc.pid),
            "log": str(log),
            "cmd": [str(binary), *args],
        }
        self._write_record(record)

    def _wait(self, name: str, check, deadline: float, log_name: str | None = None) -> None:
        log = self.log_dir / f"{log_name or name}.log"
        try:
            self._wait_loop(name, check, deadline, log)
        finally:
            self._ready_at[name] = round(time.monotonic() - self._t0, 1)

    def _wait_loop(self, name: str, check, deadline: float, log: Path) -> None:
        while True:
            for pname, proc in self._popen.items():
                if proc.poll() is not None:
                    plog = self.log_dir / f"{pname}.log"
                    raise ClusterError(
                        f"{pname} exited with code {proc.returncode} while waiting for {name}; "
                        f"log: {plog}\n{_log_tail(plog)}"
                    )
            try:
                if check():
                    return
            except (subprocess.SubprocessError, OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise ClusterError(f"timed out waiting for {name} to become ready; log: {log}\n{_log_tail(log)}")
            time.sleep(0.25)

    def _start_real_node(self, pki: Path, record: dict, deadline: float) -> None:
        """containerd (its leftover pods removed, the pause image loaded), CoreDNS, kube-proxy, kubelet."""
        from . import images

        paths = self.node_paths
        conf = self.state_dir / "config"
        kubeconfigs = {"kubelet": conf / "kubelet.kubeconfig", "kube-proxy": conf / "kube-proxy.kubeconfig",
                       "coredns": self.kubeconfig}
        node.write_configs(paths, pki, sandbox_image=images.PAUSE_IMAGE, kubeconfigs=kubeconfigs)
        args = node.process_args(paths, kubeconfigs)
        self._spawn("containerd", args.pop("containerd"), record, binary=Path(shutil.which("containerd") or "containerd"))
        self._wait("containerd", lambda: self.crictl("info", timeout=10).returncode == 0, deadline)
        node.remove_pods(self.bin_dir, paths)
        images.ensure_pause_image(paths.containerd_socket)
        self._ready_at["pause image loaded"] = round(time.monotonic() - self._t0, 1)
        for name, command in args.items():
            self._spawn(name, command, record)

    def _real_node_ready(self) -> bool:
        out = self.kubectl("get", "node", node.NODE_NAME, "-o", "json", check=False, timeout=20)
        if out.returncode != 0:
            return False
        conditions = json.loads(out.stdout).get("status", {}).get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    def _nodes_ready(self) -> bool:
        out = self.kubectl("get", "nodes", "-o", "json", check=False, timeout=20)
        if out.returncode != 0:
            return False
        items = json.loads(out.stdout)["items"]
        wanted = set(self.default_node_names())
        ready = {
            n["metadata"]["name"]
            for n in items
            if any(c["type"] == "Ready" and c["status"] == "True" for c in n.get("status", {}).get("conditions", []))
        }
        return wanted <= ready

    def _default_sa_exists(self) -> bool:
        return (
            self.kubectl("get", "serviceaccount", "default", "-n", "default", check=False, timeout=20).returncode == 0
        )

    def _apply_crds(self) -> None:
        paths = manifests.crd_files(self.pins)
        args = ["apply", "--server-side", "--force-conflicts"]
        for path in paths:
            args += ["-f", str(path)]
        self.kubectl(*args)
        self.wait_established(*manifests.CRD_NAMES)

    # ---- configuration ------------------------------------------------------------------------
    def _write_configs(self, pki: Path) -> None:
        self.kubeconfig.write_text(kubeconfig_text(self.server, pki, "admin", "ppojob-admin"))
        self.kubeconfig.chmod(0o600)
        conf = self.state_dir / "config"
        conf.mkdir(exist_ok=True)
        for client in ("controller-manager", "scheduler", "kubelet", "kube-proxy"):
            (conf / f"{client}.kubeconfig").write_text(kubeconfig_text(self.server, pki, client, client))
        (conf / "kube-scheduler.yaml").write_text(manifests.scheduler_config(conf / "scheduler.kubeconfig", None))
        (conf / "gang-scheduler.yaml").write_text(manifests.scheduler_config(self.kubeconfig, GANG_SCHEDULER_NAME))

    def _etcd_args(self, data: Path) -> list[str]:
        client, peer = f"http://{HOST}:{PORTS['etcd']}", f"http://{HOST}:{PORTS['etcd-peer']}"
        return [
            "--name=local",
            f"--data-dir={data}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=local={peer}",
            "--unsafe-no-fsync=true",
            "--log-level=warn",
        ]

    def _apiserver_args(self, pki: Path) -> list[str]:
        return [
            f"--etcd-servers=http://{HOST}:{PORTS['etcd']}",
            # All addresses: loopback for this machine's clients, the bridge for pods (the `kubernetes`
            # Service's endpoint is the advertised bridge address).
            "--bind-address=0.0.0.0",
            f"--advertise-address={node.BRIDGE_ADDRESS}",
            f"--secure-port={PORTS['kube-apiserver']}",
            f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
            f"--kubelet-certificate-authority={pki / 'ca.crt'}",
            "--kubelet-preferred-address-types=InternalIP",
            f"--tls-cert-file={pki / 'apiserver.crt'}",
            f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            "--authorization-mode=Node,RBAC",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--allow-privileged=true",
            f"--cert-dir={self.state_dir / 'certs' / 'apiserver'}",
            "--profiling=false",
        ]

    def _component_args(self, pki: Path) -> dict[str, list[str]]:
        conf = self.state_dir / "config"
        certs = self.state_dir / "certs"
        cm_kc = conf / "controller-manager.kubeconfig"
        sched_kc = conf / "scheduler.kubeconfig"
        return {
            "kube-controller-manager": [
                f"--kubeconfig={cm_kc}",
                f"--authentication-kubeconfig={cm_kc}",
                f"--authorization-kubeconfig={cm_kc}",
                f"--bind-address={HOST}",
                f"--secure-port={PORTS['kube-controller-manager']}",
                f"--cert-dir={certs / 'kube-controller-manager'}",
                "--leader-elect=false",
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={pki / 'sa.key'}",
                f"--root-ca-file={pki / 'ca.crt'}",
                f"--cluster-signing-cert-file={pki / 'ca.crt'}",
                f"--cluster-signing-key-file={pki / 'ca.key'}",
                "--controllers=*",
                # A stopped kubelet shows as a NotReady node in 30 s, not 50 (KWOK renews its leases every 10 s).
                "--node-monitor-grace-period=30s",
                "--profiling=false",
            ],
            "kube-scheduler": [
                f"--config={conf / 'kube-scheduler.yaml'}",
                f"--authentication-kubeconfig={sched_kc}",
                f"--authorization-kubeconfig={sched_kc}",
                f"--bind-address={HOST}",
                f"--secure-port={PORTS['kube-scheduler']}",
                f"--cert-dir={certs / 'kube-scheduler'}",
            ],
            "gang-scheduler": [
                f"--config={conf / 'gang-scheduler.yaml'}",
                f"--authentication-kubeconfig={self.kubeconfig}",
                f"--authorization-kubeconfig={self.kubeconfig}",
                f"--bind-address={HOST}",
                f"--secure-port={PORTS['gang-scheduler']}",
                f"--cert-dir={certs / 'gang-scheduler'}",
                # A gang the coscheduling plugin rejected waits in the unschedulable queue for a Pod or
                # PodGroup event only (not a node's arrival), or for this flush: 5 minutes by default,
                # on a local cluster where nothing else creates pods. Real clusters have the churn.
                "--pod-max-in-unschedulable-pods-duration=30s",
            ],
            "gang-controller": [
                f"--metricsAddr={HOST}:{PORTS['gang-controller-metrics']}",
                f"--probeAddr={HOST}:{PORTS['gang-controller-probe']}",
                "--enableLeaderElection=false",
            ],
            "kuberay-operator": [
                f"--metrics-addr={HOST}:{PORTS['kuberay-metrics']}",
                f"--health-probe-bind-address={HOST}:{PORTS['kuberay-probe']}",
                "--enable-leader-election=false",
                "--batch-scheduler=scheduler-plugins",
                "--log-stdout-encoder=console",
            ],
            "kwok": [
                f"--kubeconfig={self.kubeconfig}",
                f"--manage-nodes-with-annotation-selector={manifests.KWOK_ANNOTATION}=fake",
                f"--server-address={HOST}:{PORTS['kwok']}",
                f"--node-ip={HOST}",
                f"--cidr={POD_CIDR}",
                "--node-lease-duration-seconds=40",
                *[f"--config={path}" for path in manifests.kwok_stage_files(self.pins)],
            ],
        }

    # ---- restarting one component (fault injection) -------------------------------------------
    def _health(self, name: str):
        if name == "etcd":
            return lambda: self._get(f"http://{HOST}:{PORTS['etcd']}/health")[0] == 200
        if name == "kube-apiserver":
            return self.apiserver_ready
        return self._checks().get(name, lambda: True)

    @contextlib.contextmanager
    def stopped(self, *names: str, timeout: float = 120):
        """These components crashed (SIGKILL, in reverse order) for the duration of the block; on
        leaving it, started again with the same command lines (etcd keeps its data dir), in order,
        each waited on until healthy."""
        with _locked(self.state_dir):
            record = self._read_record()
            if not record or not record.get("ready"):
                raise ClusterError(f"no ready local cluster is recorded in {self.record_file}")
            unknown = [n for n in names if n not in record["processes"]]
            if unknown:
                raise ClusterError(f"no such component: {', '.join(unknown)}; known: {', '.join(record['processes'])}")
            for name in reversed(names):
                self._kill_component(name, record["processes"][name])
        try:
            yield
        finally:
            with _locked(self.state_dir):
                deadline = time.monotonic() + timeout
                for name in names:
                    binary, *args = record["processes"][name]["cmd"]
                    self._spawn(name, args, record, binary=Path(binary))
                    self._wait_loop(name, self._health(name), deadline, self.log_dir / f"{name}.log")

    def restart(self, *names: str, down_s: float = 0.0, timeout: float = 120) -> float:
        """Crash and restart these components (`stopped`); `down_s`: how long they stay down.
        Returns the seconds from the kill to all healthy again."""
        killed = time.monotonic()
        with self.stopped(*names, timeout=timeout):
            time.sleep(down_s)
        return time.monotonic() - killed

    def restart_apiserver(self, down_s: float = 0.0) -> float:
        return self.restart("kube-apiserver", down_s=down_s)

    def restart_etcd(self, down_s: float = 0.0) -> float:
        """etcd and the API server on it, as a control-plane node restart; the data is kept."""
        return self.restart("etcd", "kube-apiserver", down_s=down_s)

    def compact_etcd(self) -> int:
        """Compact etcd's history up to now (what the API server does every 5 minutes): a watch that
        resumes from an older resourceVersion gets 410 Gone and must list again. Returns the revision."""
        url = f"http://{HOST}:{PORTS['etcd']}/v3/kv"
        key = base64.b64encode(b"/registry/").decode()
        revision = int(self._post_json(f"{url}/range", {"key": key, "limit": 1})["header"]["revision"])
        self._post_json(f"{url}/compaction", {"revision": revision, "physical": True})
        return revision

    def etcd_put(self, key: str, value: bytes) -> int:
        """Write a value straight into etcd, past the API server's validation and admission (e.g. an
        object under /registry/<group>/<plural>/<namespace>/<name>, in the storage's JSON encoding).
        Returns the revision (the object's resourceVersion)."""
        body = {"key": base64.b64encode(key.encode()).decode(), "value": base64.b64encode(value).decode()}
        return int(self._post_json(f"http://{HOST}:{PORTS['etcd']}/v3/kv/put", body)["header"]["revision"])

    @staticmethod
    def _post_json(url: str, body: dict) -> dict:
        """etcd's JSON gateway of its gRPC API (plain http on loopback)."""
        request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def _kill_component(self, name: str, process: dict) -> None:
        if _alive(process):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process["pgid"], signal.SIGKILL)
        child = self._popen.pop(name, None)
        if child is not None:
            child.wait(timeout=10)  # our own child: reap it
        deadline = time.monotonic() + 10
        while _alive(process) and time.monotonic() < deadline:
            time.sleep(0.05)
        port = PORTS.get(name)
        while port is not None and not _port_free(port) and time.monotonic() < deadline:
            time.sleep(0.05)

    # ---- stopping -----------------------------------------------------------------------------
    def _stop_record(self, record: dict, grace: float = 10) -> list[str]:
        """Stop the recorded process groups that are still ours (pid + start time match), newest first;
        the real node's kubelet before them all, and its pods through the CRI while containerd runs;
        then what the node left on the host."""
        processes = record.get("processes", {})
        stopped = []
        if "kubelet" in processes:
            stopped += self._stop_processes({"kubelet": processes["kubelet"]}, grace)
            if "containerd" in processes and _alive(processes["containerd"]):
                node.remove_pods(self.bin_dir, self.node_paths)
        stopped += self._stop_processes({k: v for k, v in processes.items() if k != "kubelet"}, grace)
        node.clean_host(self.bin_dir, self.node_paths)
        self._popen.clear()
        try:
            self.record_file.unlink()
        except FileNotFoundError:
            pass
        return stopped

    def _stop_processes(self, processes: dict[str, dict], grace: float) -> list[str]:
        stopped = []
        procs = list(processes.items())[::-1]
        for name, p in procs:
            if _alive(p):
                try:
                    os.killpg(p["pgid"], signal.SIGTERM)
                    stopped.append(name)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        for name, p in procs:
            proc = self._popen.pop(name, None)
            while _alive(p) and time.monotonic() < deadline:
                if proc is not None:
                    proc.poll()
                time.sleep(0.1)
            if _alive(p):
                try:
                    os.killpg(p["pgid"], signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if proc is not None:
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
        return stopped

    def stop(self) -> list[str]:
        """Stop the processes recorded for this state dir. Returns the names of those that were running."""
        with _locked(self.state_dir):
            record = self._read_record()
            return self._stop_record(record) if record else []
