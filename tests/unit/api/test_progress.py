"""The report pacing rule shared by the trainer (what it sends) and the operator (what it folds)."""

from __future__ import annotations

from ppojob_api.progress import routine_interval, urgency

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
    assert urgency(BASE, {**BASE, "attempt": 2}) == "new attempt"


def test_progress_routine_interval_stretches_while_the_api_server_is_slow():
    assert routine_interval(10.0, 0.01) == 10.0  # a quick API server: the interval as set
    assert routine_interval(10.0, 0.4) == 20.0  # 50 times the last write's time
    assert routine_interval(10.0, 5.0) == 30.0  # never past the heartbeat's period
    assert routine_interval(60.0, 5.0) == 60.0  # an interval set longer than that stays
    assert routine_interval(10.0, 5.0, slowdown=0.0) == 10.0  # off
