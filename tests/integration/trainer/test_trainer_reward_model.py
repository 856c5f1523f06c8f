"""reward.type Model through real Ray on CPU: a 2-step run of builtin:tiny scored by a tiny reward model
in the rollout worker, which sleeps with the engine (offload.rollout) and wakes only to score, its
residency in the status; the batch's scores are the reward model's own scores of its responses."""

from __future__ import annotations

import math

import pytest
from tests.fixtures.tiny_reward_model import save_tiny_reward_model
from trainer_specs import tiny_spec

from ppo_trainer.data import Prompt
from ppo_trainer.reporting.reporters import Recorder
from ppo_trainer.reward_model import RewardModel
from ppo_trainer.roles.build import build_roles, compute_layout
from ppo_trainer.roles.rollout import RolloutWorker
from ppo_trainer.train import run_on

SAMPLES, MICRO_BATCH = 8, 3


def test_a_run_scored_by_the_reward_model_sleeps_it_with_the_engine(ray_session, tmp_path):
    path = str(save_tiny_reward_model(tmp_path / "rm"))
    spec = tiny_spec(reward={"type": "Model", "model": {"path": path, "microBatchSize": MICRO_BATCH, "maxLength": 96}},
                     rollout={"batchSize": SAMPLES, "maxNewTokens": 8}, actor={"microBatchSize": SAMPLES},
                     offload={"rollout": True})
    roles = build_roles(spec, compute_layout(spec, use_gpus=False), timeout=120)
    try:
        recorder = Recorder()
        run_on(roles, spec, reporter=recorder, checkpoint_dir=None)

        steps = [fields for kind, fields in recorder.events if kind == "step"]
        assert len(steps) == 2 and all(math.isfinite(step["reward_mean"]) for step in steps)
        moves = [(f["frm"], f["to"]) for kind, f in recorder.events if kind == "transition" and f["role"] == "reward"]
        # Asleep after each step's generation; awake again only to score the second step's batch (not for the sync).
        assert moves == [("Awake", "Asleep"), ("Asleep", "Awake"), ("Awake", "Asleep")]
        reported = [p.to_status() for p in recorder.progress]
        assert {status["reward"] for status in reported} == {"Awake", "Asleep"}
        assert reported[-1]["offload"].endswith("rollout=Awake reward=Asleep")  # the engine woke for the last sync

        prompts = [Prompt(text=f"question {i}: ") for i in range(5)]
        ((batch, _),) = roles.rollout.call(RolloutWorker.generate, roles.rollout.split(prompts),
                                           seed=roles.rollout.seeds(11))
        local = RewardModel(path, device="cpu", dtype="float32", micro_batch_size=MICRO_BATCH, max_length=96)
        assert batch.prompts == [p.text for p in prompts]
        assert batch.scores.tolist() == pytest.approx(local.score(batch.prompts, batch.responses), abs=1e-5)
    finally:
        roles.shutdown()
