"""Held-out evaluation through Ray on CPU: a run trains the same with it as without it, bit for bit, and
its evaluations reach the step metrics, TensorBoard, the status and the run summary.

The same shared roles, reset to their initial state, run 3 steps without data.validation and 3 steps
with an evaluation after each (sampled at temperature 1, so the engines' generators are used); every
training figure of every step must be equal, not close.
"""

from __future__ import annotations

import time
from itertools import pairwise

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from trainer_specs import tiny_spec

from ppo_trainer.evaluation import Evaluator
from ppo_trainer.reporting.metrics import StepMetrics, summarize_run
from ppo_trainer.reporting.reporters import FanOut, Recorder
from ppo_trainer.reporting.tensorboard import TensorBoardReporter
from ppo_trainer.roles.rollout import RolloutWorker
from ppo_trainer.train import restore_roles, run_on

STEPS, HELD_OUT = 3, 16
VALIDATION = {"prompts": "synthetic", "count": HELD_OUT, "interval": 1, "temperature": 1.0}
TRAINING_FIGURES = ("reward_mean", "response_tokens", "samples", "value_loss", "value_clipfrac", "policy_loss",
                    "clipfrac", "kl", "entropy", "rollout_log_ratio_mean", "rollout_log_ratio_abs_max", "rollout_k3")


def reset(roles, initial) -> None:
    """The shared roles back to their initial weights, optimizers and RNG, engines included (as the `roles` fixture)."""
    restore_roles(roles, initial)
    roles.sync_weights(version=0)
    roles.rollout.call(RolloutWorker.wake)
    roles.poll()


def run(roles, initial, spec, run_dir) -> tuple[list[StepMetrics], Recorder]:
    reset(roles, initial)
    recorder = Recorder()
    reporter = FanOut(recorder, TensorBoardReporter(run_dir))
    state = run_on(roles, spec, reporter=reporter, checkpoint_dir=None)
    reporter.close()
    return [StepMetrics.from_dict(record) for record in state.history], recorder


def test_evaluation_leaves_the_training_run_bit_for_bit_unchanged(shared_roles, tmp_path):
    roles, initial = shared_roles
    plain, _ = run(roles, initial, tiny_spec(ppo={"numRollouts": STEPS}), tmp_path / "plain")
    evaluated, recorder = run(roles, initial, tiny_spec(ppo={"numRollouts": STEPS}, data={"validation": VALIDATION}),
                              tmp_path / "evaluated")

    for without, with_ in zip(plain, evaluated, strict=True):
        assert {f: getattr(with_, f) for f in TRAINING_FIGURES} == {f: getattr(without, f) for f in TRAINING_FIGURES}
    assert all(m.eval_reward_mean is None for m in plain)
    assert [m.eval_samples for m in evaluated] == [HELD_OUT] * STEPS
    assert all(0.0 <= m.eval_reward_mean <= 1.0 and m.eval_seconds > 0 for m in evaluated)
    # the synthetic reward is a fraction: a pass rate only when every score happened to be 0 or 1
    assert all(m.eval_pass_rate in (None, m.eval_reward_mean) for m in evaluated)
    print(f"evaluations of {HELD_OUT} prompts (at most 16 new tokens each):",
          [round(m.eval_seconds, 3) for m in evaluated], "s; steps:", [round(m.seconds, 3) for m in evaluated], "s")

    accumulator = EventAccumulator(str(tmp_path / "evaluated"), size_guidance={"scalars": 0})
    accumulator.Reload()
    written = accumulator.Scalars("eval/reward_mean")
    assert [e.step for e in written] == [m.step for m in evaluated]
    assert [e.value for e in written] == pytest.approx([m.eval_reward_mean for m in evaluated], rel=1e-6)  # float32

    stages = [p.stage.value for p in recorder.progress]
    assert sum(now == "Evaluate" != before for before, now in pairwise(stages)) == STEPS  # once a step
    last = recorder.progress[-1].to_status()
    assert last["evaluation"] == evaluated[-1].evaluation().to_status()
    assert (last["evaluation"]["step"], last["evaluation"]["samples"]) == (STEPS, HELD_OUT)
    assert summarize_run(evaluated)["evaluations"] == STEPS

    # Its own seed: the same weights score the same, and the final weights score otherwise than the initial ones.
    evaluator = Evaluator.from_spec(tiny_spec(ppo={"numRollouts": STEPS}, data={"validation": VALIDATION}))
    assert evaluator.evaluate(roles.rollout, step=STEPS).reward_mean == evaluated[-1].eval_reward_mean
    reset(roles, initial)
    started = time.perf_counter()
    assert evaluator.evaluate(roles.rollout, step=0).reward_mean != evaluated[-1].eval_reward_mean
    print(f"one evaluation on the initial weights: {time.perf_counter() - started:.3f} s")
