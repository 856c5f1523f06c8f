"""Development mode: the trainer as a process on this machine, one per (job uid, attempt).

For the local cluster, whose pods run no containers. The process is started in its own session,
so it outlives an operator restart; its state lives in files under --state-dir:

    <state-dir>/<namespace>/<name>-<uid>/a<attempt>/{launch.lock, pid, exit, trainer.log, ppojob.yaml, kubeconfig}
    <state-dir>/<namespace>/<name>-<uid>/run/      (shared by attempts: checkpoints, so --resume works)

`launch.lock` is created with O_EXCL before anything is started, so two operators (or one
restarted mid-launch) never start two trainers for one attempt. The trainer gets a kubeconfig with
a TokenRequest token of the job's ServiceAccount: it can patch its own PPOJob's status, nothing else.
A shell wrapper records the exit code in `exit`. Depends on the standard library, kube, builders.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import yaml

from ppo_operator import names
from ppo_operator.builders.common import BuildOptions
from ppo_operator.builders.rbac import build_kubeconfig, build_token_request
from ppo_operator.builders.submission import trainer_args, trainer_manifest
from ppo_operator.job import Job
from ppo_operator.kube import Kube
from ppo_operator.observed import TrainerRecord, TrainerState

WRAPPER = '"$@"; code=$?; echo $code > exit.tmp && mv exit.tmp exit; exit $code'
LAUNCH_GRACE_S = 30.0


def _process_start(pid: int) -> str | None:
    """The process' start time in clock ticks (to tell it from a later process with the same pid)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def _spawn(args: list[str], folder: Path, env: dict[str, str]) -> subprocess.Popen:
    """Start the wrapped trainer in a session of its own, its output appended to trainer.log."""
    with open(folder / "trainer.log", "ab") as log:
        log.write(f"$ {shlex.join(args)}\n".encode())
        log.flush()
        return subprocess.Popen(
            ["sh", "-c", WRAPPER, "sh", *args], cwd=folder, env=env, stdin=subprocess.DEVNULL,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )


class LocalLauncher:
    poll_seconds = 2.0

    def __init__(self, kube: Kube, *, state_dir: Path, options: BuildOptions, token_seconds: int = 86400):
        self.kube, self.state_dir, self.options, self.token_seconds = kube, state_dir, options, token_seconds
        self._children: dict[int, subprocess.Popen] = {}

    def job_dir(self, job: Job) -> Path:
        return self.state_dir / job.namespace / f"{job.name}-{job.uid}"

    def attempt_dir(self, job: Job, attempt: int) -> Path:
        return self.job_dir(job) / f"a{attempt}"

    def _reap(self) -> None:
        for pid, child in list(self._children.items()):
            if child.poll() is not None:
                del self._children[pid]

    def _read_pid(self, folder: Path) -> tuple[int, str] | None:
        try:
            pid, start = (folder / "pid").read_text().split()
            return int(pid), start
        except (FileNotFoundError, ValueError):
            return None

    async def observe(self, job: Job, attempt: int) -> TrainerRecord:
        self._reap()
        folder = self.attempt_dir(job, attempt)
        if not (folder / "launch.lock").exists():
            return TrainerRecord(TrainerState.NOT_STARTED, "", "no trainer launched for this attempt")
        exit_file, recorded = folder / "exit", self._read_pid(folder)
        handle = f"local:{recorded[0]}" if recorded else "local:?"
        if exit_file.exists():
            code = exit_file.read_text().strip()
            if code == "0":
                return TrainerRecord(TrainerState.SUCCEEDED, handle, "the trainer exited with code 0")
            return TrainerRecord(TrainerState.FAILED, handle, f"the trainer exited with code {code}{self._tail(folder)}")
        if recorded is None:
            age = time.time() - (folder / "launch.lock").stat().st_mtime
            if age < LAUNCH_GRACE_S:
                return TrainerRecord(TrainerState.UNKNOWN, handle, "being launched")
            return TrainerRecord(TrainerState.FAILED, handle, "the launch was interrupted before the trainer started")
        pid, start = recorded
        if _process_start(pid) == start:
            return TrainerRecord(TrainerState.RUNNING, handle, f"process {pid}")
        return TrainerRecord(TrainerState.FAILED, handle, f"the trainer process {pid} is gone without an exit code (killed){self._tail(folder)}")

    def _tail(self, folder: Path) -> str:
        with contextlib.suppress(FileNotFoundError):
            lines = (folder / "trainer.log").read_text(errors="replace").strip().splitlines()
            if lines:
                return f"; last output: {lines[-1][-300:]}"
        return ""

    async def launch(self, job: Job, attempt: int) -> TrainerRecord:
        folder = self.attempt_dir(job, attempt)
        folder.mkdir(parents=True, exist_ok=True)
        try:
            os.close(os.open(folder / "launch.lock", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return await self.observe(job, attempt)  # launched before (by us, or before a restart)
        token = await self.kube.request_token(
            job.namespace, names.service_account_name(job.name), build_token_request(expiration_seconds=self.token_seconds)
        )
        kubeconfig = build_kubeconfig(
            server=self.kube.server, ca_data=self.kube.ca_data(), token=token, namespace=job.namespace,
            insecure=not self.kube.verifies_tls,
        )
        (folder / "kubeconfig").write_text(yaml.safe_dump(kubeconfig))
        (folder / "kubeconfig").chmod(0o600)
        (folder / "ppojob.yaml").write_text(yaml.safe_dump(trainer_manifest(job), sort_keys=True))
        run_dir = self.job_dir(job) / "run"
        args = trainer_args(config=str(folder / "ppojob.yaml"), run_dir=str(run_dir), resume=attempt > 0, options=self.options)
        env = {
            **{k: v for k, v in os.environ.items() if k not in ("KUBECONFIG",)},
            "KUBECONFIG": str(folder / "kubeconfig"),
            "PPOJOB_NAME": job.name, "PPOJOB_NAMESPACE": job.namespace, "PPOJOB_ATTEMPT": str(attempt),
        }
        child = await asyncio.to_thread(_spawn, args, folder, env)
        self._children[child.pid] = child
        start = None
        for _ in range(50):  # /proc appears at once; be patient on a loaded machine
            start = _process_start(child.pid)
            if start:
                break
            await asyncio.sleep(0.01)
        (folder / "pid").write_text(f"{child.pid} {start or 0}\n")
        return TrainerRecord(TrainerState.RUNNING, f"local:{child.pid}", f"process {child.pid}")

    async def stop_others(self, job: Job, keep_attempt: int | None) -> list[int]:
        stopped = []
        folder = self.job_dir(job)
        if not folder.exists():
            return stopped
        for attempt_dir in sorted(folder.glob("a*")):
            attempt = int(attempt_dir.name[1:]) if attempt_dir.name[1:].isdigit() else None
            if attempt is None or attempt == keep_attempt:
                continue
            if self._kill(attempt_dir):
                stopped.append(attempt)
        return stopped

    def _kill(self, folder: Path) -> bool:
        recorded = self._read_pid(folder)
        if recorded is None or (folder / "exit").exists():
            return False
        pid, start = recorded
        if _process_start(pid) != start:
            return False
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)  # the session: the wrapper, the trainer and its Ray
        self._reap()
        return True

    async def forget(self, job: Job) -> None:
        await self.stop_others(job, None)
        shutil.rmtree(self.job_dir(job), ignore_errors=True)
