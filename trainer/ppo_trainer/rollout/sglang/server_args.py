"""The command lines of an SGLang server and of the router in front of several, built from the spec.

Pure functions: the spec and where the server runs (model directory, host, port, base GPU id) in,
an argv out. Flag names are those of `sglang.srt.server_args` and `sglang_router.launch_router`
at the pinned versions (tests/unit/trainer/rollout/test_sglang_server_args.py checks them against
SGLang's own parser where it can be imported). A `ServerProgram` says what runs them: SGLang's own
server, or a program that takes the same flags and speaks the same protocol (the tests' CPU
stand-in, `tests/doubles/`). Depends on the API spec and the standard library only (no torch, no sglang).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from ppojob_api.spec import PPOJobSpec

SGLANG_SERVER_MODULE = "sglang.launch_server"
ROUTER_MODULE = "sglang_router.launch_router"

# The seed framework's routing policy for RL rollouts: prompts sharing a prefix go to one engine.
ROUTER_POLICY = "cache_aware"


@dataclass(frozen=True)
class ServerProgram:
    """The program an engine's server runs: `python -m MODULE <the spec's flags> ARGS`."""

    module: str = SGLANG_SERVER_MODULE
    args: tuple[str, ...] = ()
    """Flags of this program's own, after the spec's."""
    on_gpu: bool = True
    """False: a program for CPUs, which is given the model path as written (builtin:tiny too) and
    GPU id 0 unless told otherwise, instead of the Hugging Face directory and the bundle's GPU."""


SGLANG = ServerProgram()


@dataclass(frozen=True)
class ServerPlace:
    """Where one engine's server runs."""

    model_path: str
    """A Hugging Face directory for SGLang (a program for CPUs may also take builtin:tiny)."""
    host: str
    port: int
    base_gpu_id: int = 0
    """First GPU of the engine on its node, as the server process sees the devices."""
    engine_index: int = 0
    """Which engine this is; offsets the server's random seed so engines do not sample alike."""


def build_server_args(spec: PPOJobSpec, place: ServerPlace) -> list[str]:
    """The arguments of one server (without the program), e.g. ['--model-path', '/m', '--tp-size', '1', ...].

    With rollout offload on, the memory saver makes release/resume_memory_occupation free the
    GPU memory, and the CPU backup keeps the weights across a sleep: a step that does not sync
    weights (a critic-only warm-up step) still generates from the right weights after waking.
    """
    rollout = spec.rollout
    if place.port < 1 or place.port > 65535:
        raise ValueError(f"server port {place.port} is out of range 1..65535")
    if place.base_gpu_id < 0:
        raise ValueError(f"base GPU id {place.base_gpu_id} is negative; it is the engine's first GPU index")
    args = [
        "--model-path", place.model_path,
        "--host", place.host,
        "--port", str(place.port),
        "--tp-size", str(rollout.tensor_parallel),
        "--mem-fraction-static", repr(float(rollout.memory_fraction)),
        "--base-gpu-id", str(place.base_gpu_id),
        "--dtype", spec.model.dtype,
        "--random-seed", str(spec.seed + place.engine_index),
        # Prompts arrive as token ids and responses leave as token ids; the trainer tokenizes.
        "--skip-tokenizer-init",
    ]
    if spec.model.tokenizer:
        args += ["--tokenizer-path", spec.model.tokenizer]
    if spec.offload.rollout:
        args += ["--enable-memory-saver", "--enable-weights-cpu-backup"]
    return args


def server_command(args: list[str], *, program: ServerProgram = SGLANG, python: str | None = None) -> list[str]:
    """The full command line: `python -m sglang.launch_server ARGS` (or `program`'s module and flags)."""
    return [python or sys.executable, "-m", program.module, *args, *program.args]


def build_router_args(*, worker_urls: list[str], host: str, port: int, policy: str = ROUTER_POLICY) -> list[str]:
    """The router's arguments: the engines' URLs behind one address."""
    if len(worker_urls) < 2:
        raise ValueError(
            f"a router is for several engines; got {len(worker_urls)} worker URL(s): talk to a single engine directly"
        )
    return ["--host", host, "--port", str(port), "--policy", policy, "--worker-urls", *worker_urls]


def router_command(args: list[str], *, python: str | None = None) -> list[str]:
    return [python or sys.executable, "-m", ROUTER_MODULE, *args]
