"""TensorBoard event files of a run, read back with TensorBoard's own reader."""

from __future__ import annotations

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ppo_trainer.reporting.metrics import StepMetrics
from ppo_trainer.reporting.tensorboard import TensorBoardReporter


def step_metrics(step: int, *, critic_only: bool) -> StepMetrics:
    ppo = None if critic_only else 0.1 * step
    return StepMetrics(step=step, critic_only=critic_only, reward_mean=0.25 * step, response_tokens=100, samples=4,
                       seconds=2.0, stage_seconds={"generate": 1.5, "critic_train": 0.5}, value_loss=1.0 / (step + 1),
                       value_clipfrac=0.05, policy_loss=ppo, clipfrac=ppo, kl=ppo, entropy=2.0 - 0.1 * step,
                       rollout_log_ratio_mean=-1e-4 * step, rollout_log_ratio_abs_max=1e-3, rollout_k3=1e-6 * step,
                       staleness=0 if critic_only else 1)


def read(run_dir) -> dict[str, list[tuple[int, float]]]:
    accumulator = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def write(run_dir, history: list[StepMetrics]) -> None:
    reporter = TensorBoardReporter(run_dir)
    for metrics in history:
        reporter.event("step", line=metrics.summary_line(10), **metrics.to_dict())
    reporter.close()


def test_scalars_name_every_metric_and_leave_out_unset_ones():
    warmup, ppo = step_metrics(0, critic_only=True), step_metrics(3, critic_only=False)
    assert set(ppo.scalars()) == {
        "reward/mean", "loss/value", "loss/policy", "kl/reference", "clipfrac/policy", "clipfrac/value",
        "policy/entropy", "rollout_mismatch/log_ratio_mean", "rollout_mismatch/log_ratio_abs_max",
        "rollout_mismatch/k3", "throughput/tokens_per_second", "time/step_seconds", "warmup/critic_only",
        "time/generate_seconds", "time/critic_train_seconds", "policy/staleness",
    }
    assert set(ppo.scalars()) - set(warmup.scalars()) == {"loss/policy", "kl/reference", "clipfrac/policy"}
    assert ppo.scalars()["throughput/tokens_per_second"] == 50.0 and warmup.scalars()["warmup/critic_only"] == 1.0
    assert ppo.scalars()["policy/staleness"] == 1.0 and warmup.scalars()["policy/staleness"] == 0.0


def test_event_files_hold_one_scalar_per_metric_per_step(tmp_path):
    history = [step_metrics(step, critic_only=step < 2) for step in range(5)]
    write(tmp_path, history)
    written = read(tmp_path)
    expected = {tag for m in history for tag in m.scalars()}
    assert set(written) == expected
    for tag in expected:
        steps = [m.step for m in history if tag in m.scalars()]
        assert [step for step, _ in written[tag]] == steps, tag
        assert [v for _, v in written[tag]] == pytest.approx([m.scalars()[tag] for m in history if tag in m.scalars()],
                                                             rel=1e-6), tag


def test_a_resumed_run_shows_each_step_once(tmp_path):
    write(tmp_path, [step_metrics(step, critic_only=False) for step in range(4)])  # the attempt that failed after 4
    write(tmp_path, [step_metrics(step, critic_only=False) for step in range(2, 6)])  # resumed at step 2
    assert [step for step, _ in read(tmp_path)["reward/mean"]] == [0, 1, 2, 3, 4, 5]


def test_nothing_is_written_before_the_first_step(tmp_path):
    reporter = TensorBoardReporter(tmp_path)
    reporter.event("note", line="resumed")
    reporter.close()
    assert list(tmp_path.iterdir()) == []
