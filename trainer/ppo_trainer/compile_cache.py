"""Where compiled artifacts live, so that a restarted job finds them, and how long a process spent compiling.

torch.compile's FX graph and AOT-autograd caches and the Triton kernels it builds go under one
directory. By default that is `compile-cache/` in the job's checkpoint directory (the checkpoint
volume outlives the pods, so a job restarted from its checkpoint starts with warm caches);
`PPO_COMPILE_CACHE_DIR` moves it (a node-local disk, a shared cache of many jobs). The cache
is keyed by torch itself on the graph, the torch and Triton versions and the device, so a stale
entry is never used, only ignored. The variables must be in a process's environment before it
compiles anything: they go into the environment of the Ray workers that run the roles. Must not
depend on Ray or the PPO loop.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

OVERRIDE_ENV = "PPO_COMPILE_CACHE_DIR"
DIRECTORY_NAME = "compile-cache"
COMPILE_TIMERS = ("_compile.compile_inner", "compile_fx.<locals>.bw_compiler")
"""torch's timers of a frame's whole compile (Dynamo, AOT autograd, Inductor) and of a backward
graph's compile, which AOT autograd runs lazily at the first backward pass, outside the frame's."""


def compile_cache_dir(checkpoint_dir: str | Path | None, environ: Mapping[str, str] = os.environ) -> Path | None:
    """The cache directory: `PPO_COMPILE_CACHE_DIR` when set (non-empty), else `compile-cache/`
    under the checkpoint directory; None when there is neither (the compilers' own defaults)."""
    override = environ.get(OVERRIDE_ENV, "").strip()
    if override:
        return Path(override).expanduser()
    if checkpoint_dir is None:
        return None
    return Path(checkpoint_dir) / DIRECTORY_NAME


def compile_cache_env(directory: Path | None) -> dict[str, str]:
    """The environment variables that put Inductor's caches and Triton's kernel cache under
    `directory` (nothing when None)."""
    if directory is None:
        return {}
    return {"TORCHINDUCTOR_CACHE_DIR": str(directory), "TRITON_CACHE_DIR": str(directory / "triton")}


def compile_seconds() -> float:
    """Seconds this process has spent in torch.compile so far (0 when it compiled nothing)."""
    import sys

    if "torch._dynamo" not in sys.modules:  # nothing was compiled; importing Dynamo would cost seconds
        return 0.0
    from torch._dynamo.utils import compilation_time_metrics

    return float(sum(sum(compilation_time_metrics.get(name, ())) for name in COMPILE_TIMERS))
