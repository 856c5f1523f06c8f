"""Atomic checkpoints: whole or absent, a crash mid-write leaves the previous one usable, keep the last N."""

from __future__ import annotations

import random

import pytest
import torch

from ppo_trainer.checkpoint import (
    CheckpointError,
    CheckpointManager,
    TrainerState,
    capture_rng,
    read_role_state,
    restore_rng,
    write_role_state,
)


def write(manager: CheckpointManager, step: int) -> None:
    temp = manager.begin(step)
    write_role_state(temp, role="actor", rank=0, state={"w": torch.full((2,), float(step))})
    manager.commit(temp, TrainerState(step=step, critic_only_steps_done=min(step, 2), sampler={"epoch": 0}))


def test_checkpoint_roundtrip_and_latest(tmp_path):
    manager = CheckpointManager(tmp_path, keep=3)
    assert manager.latest() is None
    write(manager, 1)
    write(manager, 2)
    latest = manager.latest()
    assert latest.name == "step-00000002"
    state = manager.load_state(latest)
    assert (state.step, state.critic_only_steps_done, state.sampler) == (2, 2, {"epoch": 0})
    assert torch.equal(read_role_state(latest, role="actor", rank=0)["w"], torch.full((2,), 2.0))


def test_checkpoint_keeps_last_n(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2)
    for step in range(1, 5):
        write(manager, step)
    assert [p.name for p in manager.all()] == ["step-00000003", "step-00000004"]


def test_checkpoint_crash_mid_write_leaves_previous_usable(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2)
    write(manager, 1)
    temp = manager.begin(2)  # the process dies here: roles wrote, the driver never committed
    write_role_state(temp, role="actor", rank=0, state={"w": torch.zeros(2)})
    (temp / "trainer.json").write_text('{"step": 2')  # even a torn trainer file
    assert manager.latest().name == "step-00000001"
    assert manager.load_state(manager.latest()).step == 1
    write(manager, 2)  # the next commit clears the leftovers
    assert not list(tmp_path.glob(".tmp-*"))


def test_checkpoint_missing_rank_file_is_a_clear_error(tmp_path):
    manager = CheckpointManager(tmp_path, keep=1)
    write(manager, 1)
    with pytest.raises(CheckpointError, match="critic-rank0.pt is missing"):
        read_role_state(manager.latest(), role="critic", rank=0)


def test_checkpoint_rng_roundtrip():
    saved = capture_rng()
    expected = (random.random(), torch.rand(3))
    random.random(), torch.rand(3)
    restore_rng(saved)
    assert random.random() == expected[0] and torch.equal(torch.rand(3), expected[1])
