"""The operator as a real `ppo-operator` process (development mode: trainers are local stand-in
processes, trainer_standin.py) that a test can SIGKILL, pause, resume and restart."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from local_cluster import GANG_SCHEDULER_NAME

STANDIN = Path(__file__).with_name("trainer_standin.py")
OPERATOR = Path(sys.executable).with_name("ppo-operator")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


class OperatorProcess:
    """`ppo-operator --launcher local` watching one namespace; start/kill/restart, and its log."""

    def __init__(self, cluster, namespace: str, workdir: Path, extra: list[str], env: dict[str, str]):
        self.cluster, self.namespace, self.workdir, self.extra, self.extra_env = cluster, namespace, workdir, extra, env
        self.state_dir = workdir / "operator-state"
        self.stats_file = workdir / "api-requests.json"
        self.log_path = workdir / "operator.log"
        self.proc: subprocess.Popen | None = None
        self.port = _free_port()

    def command(self) -> list[str]:
        return [
            str(OPERATOR), "--namespace", self.namespace, "--launcher", "local",
            "--state-dir", str(self.state_dir), "--trainer-command", f"{sys.executable} {STANDIN}",
            "--heartbeat-timeout", "20", "--scheduler-name", f"Coscheduling={GANG_SCHEDULER_NAME}",
            "--gang-schedulers", "Coscheduling,None", "--liveness", f"http://127.0.0.1:{self.port}/healthz",
            "--stats-file", str(self.stats_file), *self.extra,
        ]

    def start(self, *extra: str) -> OperatorProcess:
        env = {**self.cluster.env(), **self.extra_env}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([*self.command(), *extra], env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ppo-operator exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=1):
                    return self
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"ppo-operator not live within 60s:\n{self.log()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL: no cleanup, as a crash."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def pause(self) -> None:
        """SIGSTOP: it reads no watch stream and writes nothing until `resume` (its trainers go on)."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.resume()  # a paused process cannot act on SIGTERM
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()

    def requests(self) -> dict[str, int]:
        """The operator's own API writes by verb and resource (written on exit or SIGUSR1)."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(0.3)
        return json.loads(self.stats_file.read_text()) if self.stats_file.exists() else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def trainer_pids(self) -> list[int]:
        """Pids of the trainer sessions this operator started that are still alive."""
        pids = []
        for pid_file in self.state_dir.glob("*/*/a*/pid"):
            pid = int(pid_file.read_text().split()[0])
            if not (pid_file.parent / "exit").exists() and _alive(pid):
                pids.append(pid)
        return pids

    def stop_trainers(self) -> None:
        """Kill the stand-in sessions this operator started (by their recorded pids only)."""
        for pid in self.trainer_pids():
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
