"""`offload/parking.py`: a training backend's offload decides what moves and when, whichever backend
lists the tensors. Its mirrors are recording stand-ins here (on a CPU a real HostMirror moves nothing):
what each is asked to copy, and whether it may reuse its host copy (the stale-copy rule). The real
mirrors' moves: tests/gpu/test_host_mirror.py; both backends through it: tests/unit/trainer/backends/test_backend_contract.py."""

from __future__ import annotations

import pytest
import torch

from ppo_trainer.offload import parking as parking_module
from ppo_trainer.offload.parking import Parked, Parking

LOG: list[tuple] = []
"""The stand-in mirrors' calls and the listings, in order."""


class RecordingMirror:
    """Stands in for a HostMirror: logs each call to LOG."""

    def __init__(self, *, device, in_place: bool = False):
        self.in_place = in_place
        self.name = None  # set by `make`
        self.last_transfer = {"direction": None, "bytes": 0, "seconds": 0.0, "sync_seconds": 0.0, "copies": 0,
                              "path": None}
        self.parked_bytes = 8

    def to_host(self, tensors, put=None, *, keep=None, direction="offload", unchanged=False):
        LOG.append(("to_host", self.name, unchanged))
        self.last_transfer = {**self.last_transfer, "direction": direction, "bytes": 0 if unchanged else 8}

    def to_device(self, tensors=None, put=None, *, direction="onload"):
        LOG.append(("to_device", self.name))
        self.last_transfer = {**self.last_transfer, "direction": direction, "bytes": 8, "path": "engines"}

    def stage_on_device(self, tensors=None, put=None):
        LOG.append(("stage", self.name))
        return lambda part, parts, by_kernel=False: 8


@pytest.fixture
def make(monkeypatch):
    monkeypatch.setattr(parking_module, "HostMirror", RecordingMirror)
    LOG.clear()

    def build(*, optimizer: bool = True) -> Parking:
        def listing(name):
            def listed() -> Parked:
                LOG.append(("list", name))
                return Parked([torch.zeros(1)], put=lambda index, moved: None)
            return listed

        parking = Parking(role="actor", device="cpu", weights=listing("weights"),
                          optimizer_state=listing("optimizer") if optimizer else None)
        parking._weights.mirror.name = "weights"
        if optimizer:
            parking._optimizer.mirror.name = "optimizer"
        return parking

    return build


def moves() -> list[tuple]:
    """The mirrors' calls so far (listings left out), and the log emptied."""
    calls = [entry for entry in LOG if entry[0] != "list"]
    LOG.clear()
    return calls


def test_the_trained_weights_are_copied_after_the_optimizer_state_left_alone(make):
    """What the actor does: train, its optimizer state to the host before the weight sync, then
    sleep. The optimizer state's move does not make the weights' host copy current."""
    parking = make()
    parking.written()  # a training step
    parking.offload_optimizer_state()
    assert moves() == [("to_host", "optimizer", False)]
    parking.offload()
    assert moves() == [("to_host", "weights", False)]  # copied, not skipped
    parking.onload()
    assert moves() == [("to_device", "weights")]
    parking.offload()  # a read-only turn: the host copy still holds the weights
    assert moves() == [("to_host", "weights", True)]
    parking.onload()
    parking.bring_optimizer_state()  # a checkpoint read: the optimizer state back, nothing written
    parking.settle()
    moves()
    parking.offload()
    assert moves() == [("to_host", "weights", True), ("to_host", "optimizer", True)]
    parking.onload()
    parking.written()
    parking.bring_optimizer_state()
    parking.offload()
    assert moves()[-2:] == [("to_host", "weights", False), ("to_host", "optimizer", False)]


def test_every_part_is_listed_before_any_moves(make):
    """A listing may read where another part's tensors live (Megatron's optimizer state is told from
    the views into its weights' buffers by their addresses): both are listed first."""
    parking = make()
    parking.offload()
    assert LOG == [("list", "weights"), ("list", "optimizer"),
                                   ("to_host", "weights", False), ("to_host", "optimizer", False)]


def test_the_optimizer_state_comes_back_only_when_brought_and_moves_once(make):
    parking = make()
    parking.offload()
    parking.onload()
    moves()
    parking.bring_optimizer_state()
    parking.bring_optimizer_state()
    assert moves() == [("stage", "optimizer")]
    before = parking.last_transfer
    parking.settle()
    assert parking.last_transfer is not before and parking.last_transfer["beside_compute"]
    parking.offload_optimizer_state()
    parking.offload_optimizer_state()
    assert moves() == [("to_host", "optimizer", True)]


def test_calls_that_move_nothing_leave_the_record_and_an_offloaded_backend_refuses_passes(make):
    parking = make()
    parking.offload()
    offloaded = parking.last_transfer
    assert offloaded["direction"] == "offload" and offloaded["bytes"] == 16  # both parts, summed
    parking.offload()
    parking.offload_optimizer_state()
    parking.settle()
    assert parking.last_transfer is offloaded and parking.offloaded
    with pytest.raises(RuntimeError, match="forward\\(\\) on an offloaded actor backend; call onload"):
        parking.require_on_device("forward")
    parking.onload()
    parking.onload()
    assert moves()[-1] == ("to_device", "weights") and not parking.offloaded
    parking.require_on_device("forward")


def test_a_backend_without_an_optimizer_parks_its_weights_alone(make):
    parking = make(optimizer=False)
    parking.written()
    parking.offload_optimizer_state()
    parking.bring_optimizer_state()
    assert moves() == []
    parking.offload()
    assert moves() == [("to_host", "weights", False)]
