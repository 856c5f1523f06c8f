"""The processes of one benchmark phase: ppo-operator, a KubeRay operator of our own, the trainer
stand-in; their CPU seconds and peak memory from /proc; and the cluster's KubeRay held paused.

Why a KubeRay of our own: the local cluster's KubeRay runs with `--batch-scheduler=scheduler-plugins`,
with which KubeRay v1.5.0's RayJob controller fails every RayJob ("currently only RayCluster is
supported, got *v1.RayJob"). So for both phases of a size the cluster's KubeRay is paused
(SIGSTOP, SIGCONT afterwards, its pid checked against its recorded start time) and the same
binary runs fresh per phase without a batch scheduler, watching the phase's namespace only: the
same KubeRay for PPOJob and RayJob, and its CPU and peak RSS belong to that phase alone.
Depends on the standard library and `local_cluster`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
OPERATOR = Path(sys.executable).with_name("ppo-operator")
STANDIN = Path(__file__).with_name("operator_scale_standin.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stat_fields(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU of the process itself (not its children)."""
    fields = _stat_fields(pid)
    return None if fields is None else (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def peak_rss_mib(pid: int) -> float | None:
    """VmHWM: the most resident memory the process ever had (each process here lives one phase)."""
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return None


@dataclass
class Child:
    """A process this benchmark started (its own session), stopped by its pid only."""

    name: str
    proc: subprocess.Popen
    log: Path

    @classmethod
    def start(cls, name: str, args: list[str], log: Path, env: dict[str, str]) -> Child:
        with open(log, "ab") as out:
            proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        return cls(name, proc, log)

    def wait_http(self, url: str, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log}")
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1):
                return
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not ready at {url} within {timeout}s; see {self.log}")

    def usage(self) -> dict[str, float | None]:
        return {"cpu_s": cpu_seconds(self.proc.pid), "peak_rss_mib": peak_rss_mib(self.proc.pid)}

    def stop(self, grace: float = 20) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_kuberay(cluster, namespace: str, log: Path) -> tuple[Child, int]:
    """KubeRay v1.5.0 (the cluster's binary) without a batch scheduler, for one namespace; (child, metrics port)."""
    metrics, probe = free_port(), free_port()
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    child = Child.start("kuberay-operator", [
        str(cluster.bin_dir / "kuberay-operator"), f"--metrics-addr=127.0.0.1:{metrics}",
        f"--health-probe-bind-address=127.0.0.1:{probe}", "--enable-leader-election=false",
        f"--watch-namespace={namespace}", "--log-stdout-encoder=console",
    ], log, env)
    child.wait_http(f"http://127.0.0.1:{probe}/readyz")
    return child, metrics


def start_operator(cluster, namespace: str, workdir: Path, trainer_command: str, extra: list[str]) -> tuple[Child, int]:
    """ppo-operator in development mode for one namespace, trainers through `trainer_command`; (child, metrics port)."""
    metrics, live = free_port(), free_port()
    env = {**cluster.env()}
    child = Child.start("ppo-operator", [
        str(OPERATOR), "--namespace", namespace, "--launcher", "local", "--state-dir", str(workdir / "operator-state"),
        "--trainer-command", trainer_command, "--scheduler-name", "Coscheduling=scheduler-plugins-scheduler",
        "--gang-schedulers", "Coscheduling,None", "--head-cpu", "1", "--head-memory", "1Gi",
        "--metrics-port", str(metrics), "--liveness", f"http://127.0.0.1:{live}/healthz", *extra,
    ], workdir / "operator.log", env)
    child.wait_http(f"http://127.0.0.1:{live}/healthz")
    return child, metrics


def start_standin(workdir: Path, *, every: float, steps: int, warmup: int, min_interval: float,
                  slowdown: float) -> tuple[Child, Path, Path]:
    """The multiplexed trainer stand-in; (child, spool dir, report log)."""
    spool, reports = workdir / "spool", workdir / "reports.jsonl"
    spool.mkdir(parents=True, exist_ok=True)
    child = Child.start("stand-in", [
        sys.executable, str(STANDIN), "--spool", str(spool), "--log", str(reports),
        "--every", str(every), "--steps", str(steps), "--warmup", str(warmup), "--min-interval", str(min_interval),
        "--slowdown", str(slowdown),
    ], workdir / "standin.log", dict(os.environ))
    return child, spool, reports


def profile(target: Child, out: Path) -> Child:
    """py-spy (from the venv) sampling `target` without pausing it until it exits: collapsed stacks in `out`."""
    return Child.start("py-spy", [str(Path(sys.executable).with_name("py-spy")), "record", "--pid", str(target.proc.pid),
                                  "--rate", "50", "--nonblocking", "--format", "raw", "--output", str(out)],
                       out.with_suffix(".log"), dict(os.environ))


def cluster_pid(cluster, name: str) -> int | None:
    """A component of the local cluster, if its recorded pid still is the process recorded (start time matches)."""
    record = json.loads(cluster.record_file.read_text())["processes"][name]
    fields = _stat_fields(record["pid"])
    return record["pid"] if fields is not None and fields[19] == record["start_time"] else None


CONTROL_PLANE = ("kube-apiserver", "etcd")


@contextlib.contextmanager
def control_plane_priority(cluster, nice: int) -> Iterator[int]:
    """Every thread of the API server and etcd at `nice` for the block, and at their process's own
    nice again after; yields the nice in effect (0 when not permitted: raising a process's
    priority needs CAP_SYS_NICE)."""
    pids = [pid for name in CONTROL_PLANE if (pid := cluster_pid(cluster, name)) is not None]
    started = {pid: os.getpriority(os.PRIO_PROCESS, pid) for pid in pids}

    def renice(pid: int, value: int) -> None:
        for tid in os.listdir(f"/proc/{pid}/task"):  # nice is per thread; new ones inherit their creator's
            with contextlib.suppress(ProcessLookupError):
                os.setpriority(os.PRIO_PROCESS, int(tid), value)

    applied = 0
    if nice and pids:
        with contextlib.suppress(PermissionError):  # then they stay as they are, and `applied` says so
            for pid in pids:
                renice(pid, nice)
            applied = nice
    try:
        yield applied
    finally:
        for pid, value in started.items():
            with contextlib.suppress(FileNotFoundError, PermissionError):
                renice(pid, value)


def control_plane_cpu(cluster) -> dict[str, float | None]:
    """CPU seconds so far of the API server and etcd: what every client's requests and watches cost them."""
    return {name: cpu_seconds(pid) if (pid := cluster_pid(cluster, name)) is not None else None
            for name in CONTROL_PLANE}


@contextlib.contextmanager
def cluster_kuberay_paused(cluster) -> Iterator[None]:
    """SIGSTOP the cluster's KubeRay for the block, SIGCONT it after, whatever happens."""
    pid = cluster_pid(cluster, "kuberay-operator")
    if pid is not None:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGCONT)


def resume_cluster_kuberay(cluster) -> None:
    """Repair a run that died while the cluster's KubeRay was paused."""
    pid = cluster_pid(cluster, "kuberay-operator")
    if pid is not None:
        os.kill(pid, signal.SIGCONT)


def stop_trainer_sessions(state_dir: Path) -> int:
    """Kill the per-job `sleep` sessions the operator left (by their recorded pid and start time only)."""
    stopped = 0
    for pid_file in state_dir.glob("*/*/a*/pid"):
        pid, start = pid_file.read_text().split()
        fields = _stat_fields(int(pid))
        if fields is not None and fields[19] == start and fields[0] not in ("Z", "X"):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(int(pid), signal.SIGKILL)
                stopped += 1
    return stopped
