"""`tune_gc`: CPython's full collections (which stop the whole operator) run on a timer, not every
few seconds as the watched objects churn."""

from __future__ import annotations

import gc
import threading

from ppo_operator.main import parse_args, tune_gc


def test_full_collections_run_on_the_timer_only():
    saved = gc.get_threshold()
    full = threading.Event()

    def on_gc(phase, info):
        if phase == "stop" and info["generation"] == 2:
            full.set()

    gc.callbacks.append(on_gc)
    stop = tune_gc(0.05)
    try:
        assert gc.get_threshold()[2] >= 1_000_000  # CPython's own trigger is off
        assert gc.get_freeze_count() > 0  # the imports are out of the scans
        assert full.wait(5), "no full collection from the timer"
    finally:
        stop.set()
        gc.callbacks.remove(on_gc)
        gc.set_threshold(*saved)
        gc.unfreeze()


def test_zero_keeps_cpythons_own_collections():
    saved = gc.get_threshold()
    assert tune_gc(0) is None
    assert gc.get_threshold() == saved and gc.get_freeze_count() == 0
    assert parse_args([]).gc_full_every == 300.0
