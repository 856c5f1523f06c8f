"""End to end through Ray on CPU: the tiny model's mean reward on the synthetic task rises clearly."""

from __future__ import annotations

from trainer_specs import tiny_spec

from ppo_trainer.reporting.metrics import StepMetrics, summarize_run
from ppo_trainer.reporting.reporters import Recorder
from ppo_trainer.train import run_on

STEPS = 24


def test_learning_reward_rises_on_synthetic_task(roles):
    spec = tiny_spec(ppo={"numRollouts": STEPS, "numCriticOnlySteps": 2})
    state = run_on(roles, spec, reporter=Recorder(), checkpoint_dir=None)
    history = [StepMetrics.from_dict(d) for d in state.history]
    summary = summarize_run(history)
    print("learning run:", summary)
    assert summary["rewardFirst3Mean"] < 0.05
    assert summary["rewardLast3Mean"] > summary["rewardFirst3Mean"] + 0.3, summary
