"""compile_cache: where a job's compiled artifacts go, and the seconds a process spent compiling."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from ppo_trainer.compile_cache import OVERRIDE_ENV, compile_cache_dir, compile_cache_env, compile_seconds


def test_compile_cache_dir_defaults_to_the_checkpoint_directory(tmp_path):
    assert compile_cache_dir(tmp_path / "ckpt", environ={}) == tmp_path / "ckpt" / "compile-cache"


def test_compile_cache_dir_override_wins_and_blank_is_ignored(tmp_path):
    moved = tmp_path / "node-local"
    assert compile_cache_dir(tmp_path / "ckpt", environ={OVERRIDE_ENV: str(moved)}) == moved
    assert compile_cache_dir(None, environ={OVERRIDE_ENV: str(moved)}) == moved
    assert compile_cache_dir(tmp_path / "ckpt", environ={OVERRIDE_ENV: "  "}) == tmp_path / "ckpt" / "compile-cache"


def test_compile_cache_dir_is_none_without_checkpoint_or_override():
    assert compile_cache_dir(None, environ={}) is None
    assert compile_cache_env(None) == {}


def test_compile_cache_env_is_what_torch_resolves_its_caches_to(tmp_path):
    """torch's own resolvers, in a fresh process with the variables, name the directories we chose."""
    directory = tmp_path / "ckpt" / "compile-cache"
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    code = ("import json; from torch._inductor.runtime.cache_dir_utils import cache_dir, triton_cache_dir;"
            "print(json.dumps([cache_dir(), triton_cache_dir(0)]))")
    out = subprocess.run([sys.executable, "-c", code], env=env | compile_cache_env(directory),
                         capture_output=True, text=True, check=True)
    inductor, triton = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(inductor) == directory
    assert Path(triton) == directory / "triton"


def test_compile_seconds_grows_when_torch_compiles_a_frame():
    before = compile_seconds()

    def double_then_sum(x):
        return (x * 2).sum()

    compiled = torch.compile(double_then_sum, backend="eager")  # Dynamo's own work, no code generation
    assert float(compiled(torch.ones(3))) == 6.0
    assert compile_seconds() > before
