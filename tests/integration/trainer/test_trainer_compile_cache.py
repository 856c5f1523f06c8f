"""Compile caches in the product's path, through Ray on CPU: every role's process compiles into
`compile-cache/` under the job's checkpoint directory (PPO_COMPILE_CACHE_DIR moves it), and each
step reports the seconds the training roles spent compiling."""

from __future__ import annotations

import os

import ray
from trainer_specs import tiny_spec

from ppo_trainer.compile_cache import OVERRIDE_ENV
from ppo_trainer.reporting.metrics import StepMetrics, summarize_run
from ppo_trainer.reporting.reporters import Recorder
from ppo_trainer.roles.build import build_roles, compute_layout
from ppo_trainer.train import run_on


def probes():
    """Functions run inside a role's process by `__ray_call__` (made here, so that Ray ships them by
    value: the workers cannot import this test module)."""

    def cache_environment(_worker) -> tuple[str | None, str | None]:
        return os.environ.get("TORCHINDUCTOR_CACHE_DIR"), os.environ.get("TRITON_CACHE_DIR")

    def compile_a_frame(_worker) -> float:
        import torch

        compiled = torch.compile(lambda x: (x * 3).sum(), backend="eager")  # Dynamo's own work: its timers run
        return float(compiled(torch.ones(4)))

    return cache_environment, compile_a_frame


def test_role_processes_compile_under_the_checkpoint_directory_and_steps_report_it(ray_session, tmp_path,
                                                                                   monkeypatch):
    monkeypatch.delenv(OVERRIDE_ENV, raising=False)
    cache_environment, compile_a_frame = probes()
    checkpoints = tmp_path / "checkpoints"
    spec = tiny_spec(ppo={"numRollouts": 2}, checkpoint={"interval": 1})
    roles = build_roles(spec, compute_layout(spec, use_gpus=False), timeout=120, checkpoint_dir=str(checkpoints))
    try:
        handles = [h for g in roles.groups for h in g.handles]  # engines, actor, critic, reference
        cache = checkpoints / "compile-cache"
        assert ray.get([h.__ray_call__.remote(cache_environment) for h in handles]) == (
            [(str(cache), str(cache / "triton"))] * len(handles))

        assert roles.take_compile_seconds() == 0.0  # builtin:tiny on a CPU compiles nothing by itself
        assert ray.get(roles.critic.handles[0].__ray_call__.remote(compile_a_frame)) == 12.0
        compiled = roles.take_compile_seconds()
        assert compiled > 0.0
        assert roles.take_compile_seconds() == 0.0  # seconds since the last call, not since the start

        recorder = Recorder()
        state = run_on(roles, spec, reporter=recorder, checkpoint_dir=str(checkpoints))
    finally:
        roles.shutdown()
    history = [StepMetrics.from_dict(d) for d in state.history]
    assert [m.compile_seconds for m in history] == [0.0, 0.0]  # the critic's compile came before the run
    assert summarize_run(history)["compileSeconds"] == 0.0
    steps = [fields for kind, fields in recorder.events if kind == "step"]
    assert [s["compile_seconds"] for s in steps] == [0.0, 0.0]
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("step-")) == [
        "step-00000001", "step-00000002"]


def test_ppo_compile_cache_dir_moves_the_caches_of_every_role(ray_session, tmp_path, monkeypatch):
    moved = tmp_path / "node-local-cache"
    monkeypatch.setenv(OVERRIDE_ENV, str(moved))
    cache_environment, _ = probes()
    spec = tiny_spec()
    roles = build_roles(spec, compute_layout(spec, use_gpus=False), timeout=120,
                        checkpoint_dir=str(tmp_path / "checkpoints"))
    try:
        handles = [h for g in roles.groups for h in g.handles]
        assert ray.get([h.__ray_call__.remote(cache_environment) for h in handles]) == (
            [(str(moved), str(moved / "triton"))] * len(handles))
    finally:
        roles.shutdown()
