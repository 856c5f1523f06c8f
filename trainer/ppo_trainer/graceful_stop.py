"""A stop with time to checkpoint: the driver's SIGTERM flag, and the Ray pods' preStop hook that sends it.

A Ray pod's PID 1 is KubeRay's `bash -c "... ray start --block"`, which has no SIGTERM handler, so
the kubelet's SIGTERM is lost and its grace period only delays the SIGKILL. The operator gives each
Ray container a preStop hook instead, `python -m ppo_trainer.graceful_stop head|worker`, run when
the pod is deleted (suspend, preemption, eviction, `kubectl delete pod`) and bounded by the pod's
grace period (spec.checkpoint.terminationGracePeriodSeconds):

- head: SIGTERM to the trainer (the pid it wrote to --pid-file), then wait until it has exited;
- worker: wait until the job's actors on this pod have exited (the driver's exit takes them, so
  they serve the trainer's last step and checkpoint first);

then `ray stop --force`, which ends `ray start --block` and with it the container: the pod goes as
soon as the checkpoint is written. In the driver, `StopRequest` turns SIGTERM into a flag that the
loop reads between steps: the step in progress finishes, a checkpoint is written, and the trainer
exits with EXIT_STOPPED. The hook's side needs the standard library only.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

EXIT_STOPPED = 128 + signal.SIGTERM
"""The trainer's exit code after a stop it was asked for (as a shell reports a SIGTERM)."""
POLL_S = 0.2
RAY_PROCESS_TITLES = ("ray::IDLE", "ray::SPILL_", "ray::RESTORE_", "ray::DELETE_", "ray::DashboardAgent",
                      "ray::RuntimeEnvAgent")
"""Titles (prefixes) of Ray's own processes on a node: idle and IO workers, the agents
(`ray._private.ray_constants`). Any other `ray::<Class>` process holds an actor."""


class TrainerStopped(Exception):
    """The trainer was asked to stop (SIGTERM) and stopped between two steps, its progress saved."""


class StopRequest:
    """Whether the trainer has been asked to stop; `install` makes SIGTERM ask."""

    def __init__(self) -> None:
        self.signal_name: str | None = None

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def request(self, signal_name: str = "SIGTERM") -> None:
        self.signal_name = signal_name

    def install(self) -> StopRequest:
        """Handle SIGTERM (main thread only): a flag set, nothing interrupted."""
        signal.signal(signal.SIGTERM, lambda signum, frame: self.request(signal.Signals(signum).name))
        return self


def write_pid_file(path: str | Path) -> None:
    """This process' pid, for the head's preStop hook (renamed into place, never read half-written)."""
    path = Path(path)
    temp = path.with_name(f".{path.name}.{os.getpid()}")
    temp.write_text(str(os.getpid()))
    os.replace(temp, path)


def is_running(pid: int) -> bool:
    """The process exists and is not a zombie waiting for its parent."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def job_actors() -> list[int]:
    """The pids of this container's Ray worker processes that hold an actor (titled ray::<Class>)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            title = (proc / "cmdline").read_bytes().split(b"\0", 1)[0].decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        if title.startswith("ray::") and not title.startswith(RAY_PROCESS_TITLES):
            found.append(int(proc.name))
    return found


def stop_head(pid_file: Path) -> str:
    """SIGTERM to the trainer, then wait for its exit; what happened."""
    try:
        pid = int(pid_file.read_text())
    except (OSError, ValueError):
        return f"no trainer ({pid_file} unreadable)"
    if not is_running(pid):
        return f"the trainer {pid} had exited"
    started = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    while is_running(pid):
        time.sleep(POLL_S)
    return f"the trainer {pid} exited {time.monotonic() - started:.1f}s after its SIGTERM"


def stop_worker(actors: Callable[[], list[int]] = job_actors) -> str:
    """Wait until `actors` finds none (this container's job actors)."""
    started = time.monotonic()
    while actors():
        time.sleep(POLL_S)
    return f"the job's actors here were gone after {time.monotonic() - started:.1f}s"


def tell(line: str) -> None:
    """Into the container's log (PID 1's stdout): the kubelet shows a hook's own output only when it fails."""
    try:
        with open("/proc/1/fd/1", "a") as log:
            print(line, file=log)
    except OSError:
        print(line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ppo_trainer.graceful_stop", description=__doc__.split("\n\n")[0])
    parser.add_argument("role", choices=("head", "worker"))
    parser.add_argument("--pid-file", type=Path, help="(head) where the trainer wrote its pid")
    args = parser.parse_args(argv)
    if args.role == "head" and args.pid_file is None:
        parser.error("head needs --pid-file, the trainer's --pid-file")
    what = stop_head(args.pid_file) if args.role == "head" else stop_worker()
    tell(f"preStop: {what}; ray stop --force")
    ray = Path(sys.executable).with_name("ray")
    return subprocess.run([str(ray), "stop", "--force"], stdout=subprocess.DEVNULL, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
