"""The offload state machine: explicit, idempotent transitions, each reported; illegal uses refused."""

from __future__ import annotations

import pytest

from ppo_trainer.offload import OffloadError, Residency


def make(listener_log: list) -> tuple[Residency, list[str]]:
    actions: list[str] = []
    residency = Residency.for_train_role("critic", rank=1, listener=listener_log.append)
    return residency, actions


def test_offload_sleep_and_wake_run_their_action_once_and_report():
    log: list = []
    residency, actions = make(log)
    assert residency.state == "OnDevice"
    assert residency.sleep(lambda: actions.append("offload")) is True
    assert residency.wake(lambda: actions.append("onload")) is True
    assert actions == ["offload", "onload"]
    assert [(t.role, t.rank, t.from_state, t.to_state) for t in log] == [
        ("critic", 1, "OnDevice", "Offloaded"),
        ("critic", 1, "Offloaded", "OnDevice"),
    ]
    assert all(t.seconds >= 0 for t in log)


def test_offload_double_sleep_is_a_noop_not_a_crash():
    log: list = []
    residency, actions = make(log)
    residency.sleep(lambda: actions.append("offload"))
    assert residency.sleep(lambda: actions.append("offload again")) is False
    assert actions == ["offload"] and len(log) == 1 and residency.state == "Offloaded"


def test_offload_double_wake_is_a_noop():
    log: list = []
    residency, actions = make(log)
    assert residency.wake(lambda: actions.append("onload")) is False
    assert actions == [] and log == []


def test_offload_use_while_asleep_raises_a_clear_error():
    residency, _ = make([])
    residency.sleep(lambda: None)
    with pytest.raises(OffloadError, match=r"critic\[1\] cannot train while Offloaded: wake it first"):
        residency.require_awake("train")
    residency.wake(lambda: None)
    residency.require_awake("train")


def test_offload_failed_action_leaves_state_unchanged():
    log: list = []
    residency, _ = make(log)

    def broken() -> None:
        raise RuntimeError("device busy")

    with pytest.raises(RuntimeError, match="device busy"):
        residency.sleep(broken)
    assert residency.state == "OnDevice" and log == []


def test_offload_state_names_per_kind():
    rollout = Residency.for_rollout()
    link = Residency.for_link("actor.weight_sync")
    assert (rollout.state, link.state) == ("Awake", "Disconnected")
    link.wake(lambda: None)
    assert link.state == "Connected"


def test_offload_every_listener_sees_every_transition():
    first, second = [], []
    residency = Residency.for_rollout(listener=first.append)
    residency.add_listener(second.append)
    residency.sleep(lambda: None)
    assert len(first) == len(second) == 1 and str(first[0]).startswith("rollout[0] Awake -> Asleep")
