"""A critic of its own through Ray on CPU: another size than the actor (builtin:tiny-narrow, 1 x 32,
under builtin:tiny, 2 x 64), the tiny task still learns, critic.save writes there, and critic.load
starts a new run's critic from it bit for bit."""

from __future__ import annotations

import torch
from trainer_specs import tiny_spec

from ppo_trainer.checkpoint import read_role_state
from ppo_trainer.reporting.metrics import StepMetrics, summarize_run
from ppo_trainer.reporting.reporters import Recorder
from ppo_trainer.roles.build import build_roles, compute_layout
from ppo_trainer.train import run_on, save_roles

STEPS = 24


def test_a_smaller_critic_learns_saves_and_loads_bit_for_bit(ray_session, tmp_path):
    saved = tmp_path / "critic"
    spec = tiny_spec(ppo={"numRollouts": STEPS, "numCriticOnlySteps": 2},
                     critic={"model": "builtin:tiny-narrow", "save": str(saved), "learningRate": 1e-2})
    roles = build_roles(spec, compute_layout(spec, use_gpus=False), timeout=120)
    try:
        state = run_on(roles, spec, reporter=Recorder(), checkpoint_dir=None)
    finally:
        roles.shutdown()
    summary = summarize_run([StepMetrics.from_dict(d) for d in state.history])
    print("smaller critic:", summary)
    assert summary["rewardFirst3Mean"] < 0.05
    assert summary["rewardLast3Mean"] > summary["rewardFirst3Mean"] + 0.3, summary
    # checkpoint.interval 0: the critic is saved once, after the last step
    assert sorted(p.name for p in saved.iterdir()) == [f"step-{STEPS:08d}"]
    written = read_role_state(saved / f"step-{STEPS:08d}", role="critic", rank=0)["backend"]
    assert written["model"]["value_head.weight"].shape == (1, 32)

    resumed = tiny_spec(critic={"model": "builtin:tiny-narrow", "load": str(saved)})
    roles = build_roles(resumed, compute_layout(resumed, use_gpus=False), timeout=120)
    (tmp_path / "started").mkdir()
    try:
        save_roles(roles, tmp_path / "started")
    finally:
        roles.shutdown()
    started = read_role_state(tmp_path / "started", role="critic", rank=0)["backend"]
    assert started["model"].keys() == written["model"].keys()
    for name, tensor in written["model"].items():
        assert torch.equal(started["model"][name].view(torch.uint8), tensor.view(torch.uint8)), name
