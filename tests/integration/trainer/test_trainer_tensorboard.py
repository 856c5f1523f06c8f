"""A tiny run through Ray on CPU leaves TensorBoard event files with one scalar per metric per step."""

from __future__ import annotations

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from trainer_specs import tiny_spec

from ppo_trainer.reporting.metrics import StepMetrics
from ppo_trainer.reporting.reporters import FanOut, Recorder
from ppo_trainer.reporting.tensorboard import TensorBoardReporter
from ppo_trainer.train import run_on

STEPS, WARMUP = 6, 2


def test_tiny_run_writes_every_metric_of_every_step(roles, tmp_path):
    spec = tiny_spec(ppo={"numRollouts": STEPS, "numCriticOnlySteps": WARMUP})
    recorder = Recorder()
    reporter = FanOut(recorder, TensorBoardReporter(tmp_path))
    run_on(roles, spec, reporter=reporter, checkpoint_dir=None)
    reporter.close()
    history = [StepMetrics.from_dict({k: v for k, v in fields.items() if k != "line"})
               for kind, fields in recorder.events if kind == "step"]
    assert [m.step for m in history] == list(range(STEPS))

    accumulator = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    accumulator.Reload()
    written = {tag: accumulator.Scalars(tag) for tag in accumulator.Tags()["scalars"]}
    expected = {tag for m in history for tag in m.scalars()}
    for tag in ("reward/mean", "loss/value", "loss/policy", "kl/reference", "clipfrac/policy", "clipfrac/value",
                "policy/entropy", "rollout_mismatch/k3", "rollout_mismatch/log_ratio_abs_max",
                "throughput/tokens_per_second", "time/step_seconds", "time/generate_seconds",
                "time/critic_train_seconds", "time/actor_train_seconds", "time/weight_sync_seconds"):
        assert tag in expected, tag  # the run measured it
    assert set(written) == expected
    for tag in expected:
        measured = [(m.step, m.scalars()[tag]) for m in history if tag in m.scalars()]
        assert [e.step for e in written[tag]] == [step for step, _ in measured], tag
        assert [e.value for e in written[tag]] == pytest.approx([v for _, v in measured], rel=1e-6, abs=1e-12), tag
    # the actor's metrics only where it trained: after the critic-only warm-up
    assert [e.step for e in written["loss/policy"]] == list(range(WARMUP, STEPS))
