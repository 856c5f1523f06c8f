"""Starting and stopping rollout server processes: one per engine on its bundle, a router before several.

`ServerProcess` runs one command line (an engine's server or the router) in
its own process group, under a guard that takes the group down if the launching worker dies,
with its output in a log file, waits until /health answers 200 (failing
early, with the log's tail, when the process exits), tells after the fact why it died, and
stops it (SIGTERM to its process group, SIGKILL after a grace period). `launch_engine_server`
is called from the process that holds an engine's placement-group bundle (the rollout role's
Ray actor): it computes the base GPU id from the GPUs Ray gave that bundle, picks a free port on
the node, builds the arguments from the spec and starts the server. `launch_router` puts
sglang_router in front of several servers. Ray is imported only inside `bundle_gpu_ids`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

from ppo_trainer.rollout.sglang.client import DEFAULT_RETRY, RetryPolicy, SGLangClient
from ppo_trainer.rollout.sglang.server_args import (
    SGLANG,
    ServerPlace,
    ServerProgram,
    build_router_args,
    build_server_args,
    router_command,
    server_command,
)
from ppojob_api.spec import PPOJobSpec

LOG_TAIL_LINES = 20

# Runs a server command as its child, in the server's process group, and dies as the child died
# (same exit code or signal); if the process that launched it (the rollout worker) goes away
# without stopping it, e.g. killed, it kills the whole group, so no server outlives its worker.
ORPHAN_GUARD = """
import os, signal, subprocess, sys
launcher, command = int(sys.argv[1]), sys.argv[2:]
child = subprocess.Popen(command)
signal.signal(signal.SIGTERM, lambda *_: child.terminate())
while True:
    try:
        child.wait(timeout=0.5)
        break
    except subprocess.TimeoutExpired:
        if os.getppid() != launcher:
            os.killpg(0, signal.SIGKILL)
if child.returncode < 0:
    if -child.returncode not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(-child.returncode, signal.SIG_DFL)
    os.kill(os.getpid(), -child.returncode)
sys.exit(child.returncode)
"""


class ServerStartError(RuntimeError):
    """A server process did not become healthy: it exited, or did not answer in time."""


class ServerProcess:
    """One server process: start, wait until healthy, explain its death, stop."""

    def __init__(self, *, name: str, command: list[str], url: str, log_path: Path, env: dict[str, str] | None = None):
        self.name = name
        self.command = list(command)
        self.url = url
        self.log_path = Path(log_path)
        self.env = env
        self._process: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def start(self) -> ServerProcess:
        if self._process is not None:
            raise RuntimeError(f"{self.name} was already started (pid {self._process.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(
                [sys.executable, "-c", ORPHAN_GUARD, str(os.getpid()), *self.command],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(self.env or {})},
                start_new_session=True,  # its own process group: stop() reaches the server's children
            )
        return self

    def wait_healthy(self, *, timeout_s: float = 600.0, poll_s: float = 0.25) -> ServerProcess:
        """Return once GET /health answers 200; raise ServerStartError if the process exits or time runs out."""
        client = SGLangClient(self.url)
        deadline = time.monotonic() + timeout_s
        while True:
            death = self.death_notice()
            if death:
                raise ServerStartError(f"{self.name} at {self.url} did not start: {death}")
            if client.health(timeout_s=min(5.0, timeout_s)):
                return self
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"{self.name} at {self.url} did not answer /health within {timeout_s:.0f}s; "
                    f"last log lines ({self.log_path}):\n{self.log_tail()}"
                )
            time.sleep(poll_s)

    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def death_notice(self) -> str | None:
        """None while running; else its exit code and the tail of its log."""
        if self._process is None or self._process.poll() is None:
            return None
        return (
            f"process {self._process.pid} exited with code {self._process.returncode}; "
            f"last log lines ({self.log_path}):\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            with open(self.log_path, errors="replace") as log:
                return "".join(deque(log, maxlen=lines)).rstrip()
        except FileNotFoundError:
            return "(no log)"

    def client(self, *, retry: RetryPolicy = DEFAULT_RETRY, timeout_s: float = 600.0) -> SGLangClient:
        """A client of this server whose errors say how the process died, when it did."""
        return SGLangClient(self.url, retry=retry, timeout_s=timeout_s, describe_death=self.death_notice)

    def stop(self, *, grace_s: float = 10.0) -> None:
        """SIGTERM to the server's process group, SIGKILL after `grace_s`; a no-op when it has exited."""
        process = self._process
        if process is None or process.poll() is not None:
            return
        _signal_group(process, signal.SIGTERM)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(process, signal.SIGKILL)
            process.wait(timeout=grace_s)


def _signal_group(process: subprocess.Popen, sig: signal.Signals) -> None:
    try:
        os.killpg(process.pid, sig)  # the group start_new_session made: the server and its own children
    except ProcessLookupError:
        pass


def free_port(host: str = "") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def compute_base_gpu_id(*, bundle_gpu_ids: list[int], visible_devices: str | None) -> int:
    """The engine's first GPU as its server process will number the devices.

    Ray gives the bundle's GPUs as physical ids and, unless told not to, narrows
    CUDA_VISIBLE_DEVICES to them, so the server sees them from 0: the base is the first id's
    position in the visible list. Without narrowing (every GPU visible), the base is the id itself.
    """
    if not bundle_gpu_ids:
        raise ValueError("the engine's bundle holds no GPU; SGLang needs one (rollout.gpus, resources.gpusPerNode)")
    first = int(bundle_gpu_ids[0])
    if not visible_devices:
        return first
    visible = [d.strip() for d in visible_devices.split(",") if d.strip()]
    if str(first) not in visible:
        raise ValueError(f"GPU {first} of the engine's bundle is not in CUDA_VISIBLE_DEVICES={visible_devices!r}")
    return visible.index(str(first))


def bundle_gpu_ids() -> list[int]:
    """The GPUs Ray assigned to the calling actor (its bundle's share)."""
    import ray

    return [int(g) for g in ray.get_gpu_ids()]


def resolve_sglang_model_path(spec: PPOJobSpec) -> str:
    """The Hugging Face directory SGLang loads for `spec.model.path`."""
    from ppo_trainer.models.sources import resolve_model_dir

    directory = resolve_model_dir(spec.model.path)
    if directory is None:
        raise ValueError(
            f"model.path {spec.model.path} has no Hugging Face directory for SGLang to load: use "
            "builtin:smollm2-135m or a model directory, or rollout.engine Torch"
        )
    return str(directory)


def launch_engine_server(
    spec: PPOJobSpec,
    *,
    engine_index: int,
    host: str,
    log_dir: Path,
    program: ServerProgram = SGLANG,
    base_gpu_id: int | None = None,
    timeout_s: float = 600.0,
) -> ServerProcess:
    """Start engine `engine_index`'s server on this node and wait until it is healthy.

    SGLang (`program`'s default) needs the calling process to hold the engine's bundle; its base GPU
    id comes from that bundle unless given. A program for CPUs is given the model path as written.
    """
    if not program.on_gpu:
        model_path, base = spec.model.path, base_gpu_id or 0
    else:
        model_path = resolve_sglang_model_path(spec)
        base = base_gpu_id if base_gpu_id is not None else compute_base_gpu_id(
            bundle_gpu_ids=bundle_gpu_ids(), visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES")
        )
    port = free_port(host)
    place = ServerPlace(model_path=model_path, host=host, port=port, base_gpu_id=base, engine_index=engine_index)
    server = ServerProcess(
        name=f"rollout engine {engine_index}",
        command=server_command(build_server_args(spec, place), program=program),
        url=f"http://{_url_host(host)}:{port}",
        log_path=Path(log_dir) / f"rollout-engine-{engine_index}.log",
    )
    server.start()
    try:
        return server.wait_healthy(timeout_s=timeout_s)
    except BaseException:
        server.stop()
        raise


def launch_router(*, worker_urls: list[str], host: str, log_dir: Path, timeout_s: float = 120.0) -> ServerProcess:
    """Start sglang_router in front of `worker_urls` and wait until it is healthy."""
    port = free_port(host)
    router = ServerProcess(
        name="rollout router",
        command=router_command(build_router_args(worker_urls=worker_urls, host=host, port=port)),
        url=f"http://{_url_host(host)}:{port}",
        log_path=Path(log_dir) / "rollout-router.log",
    )
    router.start()
    try:
        return router.wait_healthy(timeout_s=timeout_s)
    except BaseException:
        router.stop()
        raise


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
