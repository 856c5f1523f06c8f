"""The tracker's progress and ETA: each step timed from the end of the one before, the first left out."""

from __future__ import annotations

import pytest

from ppo_trainer.checkpoint import TrainerState
from ppo_trainer.reporting.metrics import StepMetrics
from ppo_trainer.reporting.progress import ProgressTracker
from ppo_trainer.reporting.reporters import Recorder


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def poll():
    return [], {"actor": "Offloaded", "critic": "Offloaded", "rollout": "Asleep"}


def run_steps(durations: list[float], *, total: int, warmup: int, start: int = 0) -> list[dict]:
    """The `status.progress` reported after each step, the steps taking `durations` seconds."""
    clock, recorder = Clock(), Recorder()
    state = TrainerState(step=start, critic_only_steps_done=min(start, warmup))
    tracker = ProgressTracker(reporter=recorder, poll=poll, total_steps=total, critic_only_steps=warmup,
                              with_critic=True, state=state, attempt=0, clock=clock)
    reports = []
    for seconds in durations:
        critic_only = state.step < warmup
        clock.now += seconds
        state.step += 1
        state.critic_only_steps_done += critic_only
        tracker.step_done(StepMetrics(step=state.step - 1, critic_only=critic_only, reward_mean=0.0,
                                      response_tokens=10, samples=2, seconds=seconds), state=state)
        reports.append(recorder.progress[-1].to_status())
    return reports


def test_progress_percent_and_eta_after_each_step():
    reports = run_steps([40.0, 2.0, 5.0, 7.0], total=10, warmup=2)
    assert [r["percent"] for r in reports] == [10, 20, 30, 40]
    assert "estimatedRemainingSeconds" not in reports[0] and "eta" not in reports[0]  # only the compiling step
    assert reports[1]["estimatedRemainingSeconds"] == 16  # 8 PPO steps priced at the warm-up's 2 s
    assert reports[2]["estimatedRemainingSeconds"] == 35  # 7 PPO steps of 5 s
    assert reports[3]["estimatedRemainingSeconds"] == 36 and reports[3]["eta"] == "36s"  # 6 of (5+7)/2


def test_progress_eta_counts_the_time_between_steps():
    """A checkpoint written after a step is in the time of the next one, as in the run's wall time."""
    clock, recorder = Clock(), Recorder()
    state = TrainerState()
    tracker = ProgressTracker(reporter=recorder, poll=poll, total_steps=4, critic_only_steps=0,
                              with_critic=True, state=state, attempt=0, clock=clock)
    for step, (seconds, checkpoint) in enumerate([(10.0, 0.0), (3.0, 60.0), (3.0, 0.0)]):
        clock.now += seconds
        state.step = step + 1
        tracker.step_done(StepMetrics(step=step, critic_only=False, reward_mean=0.0, response_tokens=1, samples=1,
                                      seconds=seconds), state=state)
        clock.now += checkpoint
    assert tracker.step_seconds == [(False, 10.0), (False, 3.0), (False, 63.0)]
    assert recorder.progress[-1].estimated_remaining_seconds == pytest.approx(33.0)


def test_progress_after_a_resume_leaves_out_the_resumed_processs_first_step():
    reports = run_steps([50.0, 4.0, 4.0], total=24, warmup=2, start=20)
    assert [r["percent"] for r in reports] == [87, 91, 95]
    assert "eta" not in reports[0]
    assert reports[1]["estimatedRemainingSeconds"] == 8 and reports[2]["eta"] == "4s"


def test_progress_last_step_leaves_nothing_to_wait_for():
    reports = run_steps([5.0, 1.0], total=2, warmup=0)
    assert reports[-1]["percent"] == 100 and reports[-1]["estimatedRemainingSeconds"] == 0
    assert reports[-1]["eta"] == "0s"
