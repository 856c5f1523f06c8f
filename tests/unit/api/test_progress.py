"""The report pacing rule shared by the trainer (what it sends) and the operator (what it folds), and the
trainer's progress and ETA from its measured step times."""

from __future__ import annotations

import pytest

from ppojob_api.progress import (
    estimate_remaining_seconds,
    format_duration,
    percent_done,
    routine_interval,
    urgency,
)

BASE = {"attempt": 1, "step": 3, "criticOnlyStepsDone": 2, "stage": "Generate", "finished": False}


def test_progress_urgency_names_what_the_operator_acts_on():
    assert urgency(None, BASE) == "first report"
    assert urgency({}, BASE) == "first report"  # a status with no progress yet
    assert urgency(BASE, {**BASE, "step": 4}) is None  # a routine step waits for the interval
    assert urgency(BASE, {**BASE, "stage": "ActorTrain", "actor": "OnDevice"}) is None
    assert urgency(BASE, {**BASE, "heartbeatTime": "2026-11-30T00:00:00Z"}) is None
    assert urgency(BASE, {**BASE, "criticOnlyStepsDone": 3}) == "warm-up step"
    assert urgency(BASE, {**BASE, "error": "boom"}) == "error"
    assert urgency({**BASE, "error": "boom"}, {**BASE, "error": "boom", "step": 4}) is None  # told once
    assert urgency(BASE, {**BASE, "finished": True}) == "finished"
    assert urgency(BASE, {**BASE, "lastCheckpoint": {"step": 3, "path": "/c"}}) == "checkpoint"
    assert urgency(BASE, {**BASE, "lastExport": {"step": 3, "path": "/c/export/step-00000003"}}) == "export"
    assert urgency(BASE, {**BASE, "attempt": 2}) == "new attempt"


def test_progress_routine_interval_stretches_while_the_api_server_is_slow():
    assert routine_interval(10.0, 0.01) == 10.0  # a quick API server: the interval as set
    assert routine_interval(10.0, 0.4) == 20.0  # 50 times the last write's time
    assert routine_interval(10.0, 5.0) == 30.0  # never past the heartbeat's period
    assert routine_interval(60.0, 5.0) == 60.0  # an interval set longer than that stays
    assert routine_interval(10.0, 5.0, slowdown=0.0) == 10.0  # off


# A run's measured steps as (critic_only, seconds): the first compiles, two warm-up steps, then PPO steps.
STEP_SECONDS = [(True, 40.0), (True, 2.0), (False, 5.0), (False, 7.0)]


def test_eta_leaves_out_the_first_step_and_prices_each_kind_by_its_own_mean():
    assert estimate_remaining_seconds(STEP_SECONDS, critic_only_left=0, ppo_left=10) == pytest.approx(60.0)
    assert estimate_remaining_seconds(STEP_SECONDS, critic_only_left=2, ppo_left=10) == pytest.approx(64.0)
    # with the first step in, 10 PPO steps would read 135 s (the mean of all four)
    assert estimate_remaining_seconds(STEP_SECONDS[:2], critic_only_left=1, ppo_left=0) == pytest.approx(2.0)


def test_eta_of_a_kind_not_measured_yet_is_priced_as_the_steps_measured():
    warmup_only = [(True, 30.0), (True, 2.0), (True, 4.0)]
    assert estimate_remaining_seconds(warmup_only, critic_only_left=1, ppo_left=5) == pytest.approx(18.0)


def test_eta_is_unknown_after_the_first_step_and_zero_at_the_end():
    assert estimate_remaining_seconds([], critic_only_left=0, ppo_left=24) is None
    assert estimate_remaining_seconds([(True, 40.0)], critic_only_left=1, ppo_left=22) is None
    assert estimate_remaining_seconds(STEP_SECONDS, critic_only_left=0, ppo_left=0) == 0.0
    assert estimate_remaining_seconds([], critic_only_left=0, ppo_left=0) == 0.0


def test_percent_done_rounds_down_and_stays_in_range():
    assert [percent_done(done, 24) for done in (0, 1, 12, 23, 24)] == [0, 4, 50, 95, 100]
    assert percent_done(30, 24) == 100
    assert percent_done(0, 0) == 100


@pytest.mark.parametrize("seconds, words", [
    (0, "0s"), (0.4, "0s"), (44.6, "45s"), (200, "3m20s"), (3600, "1h00m"), (3900, "1h05m"),
    (86400 * 2 + 3 * 3600 + 59, "2d03h"), (-5, "0s"),
])
def test_format_duration_reads_as_kubectl_ages(seconds, words):
    assert format_duration(seconds) == words
