"""What every weight-sync path is made of: an actor rank's `Sender`, a rollout worker's `Receiver`, the driver's `sync`.

A `WeightSyncPath` builds both ends and runs the driver's part. The roles hold one end each and
never ask which path it is: `ActorWorker` builds its rank's sender, calls its `wake` right after
the rank wakes and its `sleep` right before it sleeps, and `send_weights` hands it the weights
during the rank's turn; `RolloutWorker` builds its receiver around its engine and
`receive_weights` hands it whatever the other end sends. The driver's `sync` calls the roles
through their `RoleGroup`s by those two methods. Depends on torch only (no Ray, no roles).
"""

from __future__ import annotations

import collections
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch

from ppo_trainer.offload import Listener

NamedWeights = Iterable[tuple[str, torch.Tensor]]


def drain(weights: NamedWeights) -> None:
    """A rank that sends nothing still reads the weights to their end: gathering tensor-parallel
    shards and pipeline stages is collective."""
    collections.deque(weights, maxlen=0)


class Sender:
    """An actor rank's end of a path. This one sends nothing: it is every rank of a path whose
    source is rank 0 but rank 0, and every rank of an actor built without a path."""

    def wake(self) -> None:
        """Called right after the actor rank wakes (its weights on the device)."""

    def sleep(self) -> None:
        """Called right before the actor rank sleeps."""

    def send(self, named_weights: NamedWeights) -> Any:
        """Send the rank's weights (the rank is awake); returns what the driver's `sync` hands the
        receivers, if anything."""
        drain(named_weights)
        return None


class Receiver(Protocol):
    """A rollout worker's end of a path, around its engine."""

    def receive(self, payload: Any) -> Any:
        """Take what the sender sent: new weights, or one step of their transfer."""
        ...


class WeightSyncPath(ABC):
    """One way for the actor's weights to reach the engines: both ends, and the driver's part."""

    name: str

    @abstractmethod
    def sender(self, *, rank: int, device: str, engines: list[Any], listener: Listener) -> Sender:
        """Actor rank `rank`'s end; `engines`: the rollout workers' Ray handles, in rank order;
        `listener`: where the rank's transitions go."""

    @abstractmethod
    def receiver(self, *, engine: Any, device: str, wake: Callable[[], Any]) -> Receiver:
        """The end of a rollout worker that runs `engine` on `device`; `wake` wakes the worker."""

    @abstractmethod
    def sync(self, *, actor: Any, rollout: Any) -> None:
        """Driver side: the actor's current weights to every engine; returns once they serve them.
        `actor`, `rollout`: the two roles' `RoleGroup`s (`roles/group.py`)."""
