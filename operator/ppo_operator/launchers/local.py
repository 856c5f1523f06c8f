"""Development mode: the trainer as a process on this machine, one per (job uid, attempt).

For the local cluster, whose pods run no containers. The process is started in its own session,
so it outlives an operator restart; its state lives in files under --state-dir:

    <state-dir>/<namespace>/<name>-<uid>/a<attempt>[e<evictions>]/{launch.lock, pid, exit, trainer.log, ppojob.yaml, kubeconfig}
    <state-dir>/<namespace>/<name>-<uid>/run/      (shared by attempts: checkpoints, so --resume works)

A shell wrapper records its own pid (with its /proc start time) in `pid` before it starts the
trainer, and the exit code in `exit` after. The launch holds an flock on `launch.lock` from before
it looks for `pid` until the wrapper has written it, and the wrapper inherits the lock: so two
operators, or one restarted mid-launch, never start two trainers for one attempt, and a launch
killed before the spawn leaves no lock and no pid (the attempt is simply launched again, not
failed). The trainer gets a kubeconfig with a TokenRequest token of the job's ServiceAccount: it can
patch its own PPOJob's status, nothing else. Depends on the standard library, kube, builders.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import yaml

from ppo_operator import names
from ppo_operator.builders.common import BuildOptions, trainer_env
from ppo_operator.builders.rbac import build_kubeconfig, build_token_request
from ppo_operator.builders.submission import should_resume, trainer_args, trainer_manifest
from ppo_operator.job import Job
from ppo_operator.kube import PPOJOBS, Kube, KubeError
from ppo_operator.observed import TrainerRecord, TrainerState

# $$ is the wrapper (the session leader); field 22 of its stat is its start time (comm "sh" has no spaces).
WRAPPER = (
    'echo "$$ $(cut -d" " -f22 /proc/$$/stat)" > pid.tmp && mv pid.tmp pid || exit 1; '
    '"$@"; code=$?; echo $code > exit.tmp && mv exit.tmp exit; exit $code'
)
log = logging.getLogger(__name__)

UID_LENGTH = 36
"""A Kubernetes uid is a UUID in its 36-character form: the tail of a job's folder name."""
PID_WAIT_S = 10.0
REAP_EVERY_S = 1.0
"""How often exited trainers are reaped (a zombie already reads as exited): polling every child on
each reconcile costs time in proportion to the number of jobs."""


def _process_start(pid: int) -> str | None:
    """The process' start time in clock ticks (to tell it from a later process with the same pid)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def _spawn(args: list[str], folder: Path, env: dict[str, str], lock_fd: int) -> subprocess.Popen:
    """Start the wrapped trainer in a session of its own, its output appended to trainer.log; the
    wrapper inherits the launch lock, so it holds it at least until it has written its pid."""
    with open(folder / "trainer.log", "ab") as log:
        log.write(f"$ {shlex.join(args)}\n".encode())
        log.flush()
        return subprocess.Popen(
            ["sh", "-c", WRAPPER, "sh", *args], cwd=folder, env=env, stdin=subprocess.DEVNULL,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, pass_fds=(lock_fd,),
        )


@contextlib.contextmanager
def _launch_lock(folder: Path):
    """The attempt's launch lock, if nobody holds it (yields None otherwise): an operator launching,
    or a wrapper that may not have written its pid yet."""
    fd = os.open(folder / "launch.lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield None
            return
        yield fd
    finally:
        os.close(fd)


class LocalLauncher:
    poll_seconds = 2.0

    def __init__(self, kube: Kube, *, state_dir: Path, options: BuildOptions, token_seconds: int = 86400):
        self.kube, self.state_dir, self.options, self.token_seconds = kube, state_dir, options, token_seconds
        self._children: dict[int, subprocess.Popen] = {}
        self._reaped_at = float("-inf")

    def job_dir(self, job: Job) -> Path:
        return self.state_dir / job.namespace / f"{job.name}-{job.uid}"

    def attempt_dir(self, job: Job, attempt: int) -> Path:
        """One folder per trainer run: an attempt that Kueue evicted and admitted again runs a new one."""
        evictions = int(job.status.get("evictions") or 0)
        return self.job_dir(job) / (f"a{attempt}e{evictions}" if evictions else f"a{attempt}")

    def _reap(self) -> None:
        now = time.monotonic()
        if now - self._reaped_at < REAP_EVERY_S:
            return
        self._reaped_at = now
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
        recorded = self._read_pid(folder)
        if recorded is None:
            return self._unlaunched(folder)
        pid, start = recorded
        handle, exit_file = f"local:{pid}", folder / "exit"
        if exit_file.exists():
            code = exit_file.read_text().strip()
            if code == "0":
                return TrainerRecord(TrainerState.SUCCEEDED, handle, "the trainer exited with code 0")
            return TrainerRecord(TrainerState.FAILED, handle, f"the trainer exited with code {code}{self._tail(folder)}")
        if _process_start(pid) == start:
            return TrainerRecord(TrainerState.RUNNING, handle, f"process {pid}")
        return TrainerRecord(TrainerState.FAILED, handle, f"the trainer process {pid} is gone without an exit code (killed){self._tail(folder)}")

    @staticmethod
    def _unlaunched(folder: Path) -> TrainerRecord:
        """No pid yet: being launched while someone holds the lock, else never started (a launch that
        was killed before its spawn left nothing behind)."""
        if not folder.exists():
            return TrainerRecord(TrainerState.NOT_STARTED, "", "no trainer launched for this attempt")
        with _launch_lock(folder) as fd:
            if fd is None:
                return TrainerRecord(TrainerState.UNKNOWN, "local:?", "being launched")
        return TrainerRecord(TrainerState.NOT_STARTED, "", "no trainer launched for this attempt")

    def _tail(self, folder: Path) -> str:
        with contextlib.suppress(FileNotFoundError):
            lines = (folder / "trainer.log").read_text(errors="replace").strip().splitlines()
            if lines:
                return f"; last output: {lines[-1][-300:]}"
        return ""

    async def launch(self, job: Job, attempt: int) -> TrainerRecord:
        folder = self.attempt_dir(job, attempt)
        folder.mkdir(parents=True, exist_ok=True)
        with _launch_lock(folder) as fd:
            launched = fd is None or self._read_pid(folder) is not None  # by us, or before a restart
            if not launched:
                args, env = await self._prepare(job, attempt, folder)
                child = await asyncio.to_thread(_spawn, args, folder, env, fd)
                self._children[child.pid] = child
                deadline = time.monotonic() + PID_WAIT_S  # the wrapper writes it first thing; patience under load
                while self._read_pid(folder) is None and child.poll() is None and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
        if launched:
            return await self.observe(job, attempt)
        return TrainerRecord(TrainerState.RUNNING, f"local:{child.pid}", f"process {child.pid}")

    async def _prepare(self, job: Job, attempt: int, folder: Path) -> tuple[list[str], dict[str, str]]:
        """The trainer's files (kubeconfig with the job's token, manifest), its arguments and environment."""
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
        args = trainer_args(config=str(folder / "ppojob.yaml"), run_dir=str(run_dir), resume=should_resume(job, attempt),
                            options=self.options)
        env = {
            **{k: v for k, v in os.environ.items() if k not in ("KUBECONFIG",)},
            "KUBECONFIG": str(folder / "kubeconfig"),
            **trainer_env(job, attempt),
        }
        return args, env

    async def stop_others(self, job: Job, keep_attempt: int | None) -> list[int]:
        return self._stop_attempts(self.job_dir(job), keep_attempt)

    def _stop_attempts(self, folder: Path, keep_attempt: int | None) -> list[int]:
        stopped: list[int] = []
        if not folder.exists():
            return stopped
        for attempt_dir in sorted(folder.glob("a*")):
            number = attempt_dir.name[1:].split("e")[0]
            attempt = int(number) if number.isdigit() else None
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
        self._drop(self.job_dir(job))

    def _drop(self, folder: Path) -> None:
        """Every trainer of the job's folder killed, then the folder removed."""
        self._stop_attempts(folder, None)
        shutil.rmtree(folder, ignore_errors=True)

    async def sweep(self) -> list[str]:
        """The folders (<namespace>/<name>-<uid>) of jobs that no longer exist: their trainers
        killed, the folders dropped. A namespace this operator may not list is left alone."""
        dropped = []
        for namespace_dir in sorted(p for p in self.state_dir.glob("*") if p.is_dir()):
            try:
                live = await self.kube.list_uids(PPOJOBS, namespace_dir.name, "")
            except KubeError as exc:
                log.warning("cannot list the PPOJobs of %s to sweep its trainers: %s", namespace_dir.name, exc)
                continue
            for job_dir in sorted(p for p in namespace_dir.iterdir() if p.is_dir()):
                if job_dir.name[-UID_LENGTH:] not in live:
                    self._drop(job_dir)
                    dropped.append(f"{namespace_dir.name}/{job_dir.name}")
        return dropped
