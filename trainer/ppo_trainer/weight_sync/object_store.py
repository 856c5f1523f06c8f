"""The object-store path (Colocate otherwise: CPUs, or SGLang engines on GPUs): CPU tensors through Ray.

Actor rank 0 returns its weights as CPU tensors; the driver hands that one ObjectRef to every
rollout worker, and Ray resolves it before each worker's task runs, so the driver never holds the
weights. The other ranks take their turn (reading tensor-parallel shards is collective) and
return nothing. A worker wakes its engine and loads them (an SGLang engine passes them on to its
servers, /update_weights_from_tensor). With train-side offload the actor's turn ends, and it
sleeps, before any engine wakes: on a shared GPU the two never hold their weights there at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ppo_trainer.offload import Listener
from ppo_trainer.weight_sync.base import NamedWeights, Sender, WeightSyncPath

NAME = "object_store"


class ObjectStoreSender(Sender):
    """Actor rank 0's end: its weights as CPU tensors, for the driver to hand to the engines."""

    def send(self, named_weights: NamedWeights) -> dict[str, torch.Tensor]:
        return {name: tensor.detach().to("cpu", copy=True) for name, tensor in named_weights}


class ObjectStoreReceiver:
    """A rollout worker's end: wake, load the CPU tensors."""

    def __init__(self, *, engine: Any, wake: Callable[[], Any]) -> None:
        self.engine, self.wake = engine, wake

    def receive(self, weights: dict[str, torch.Tensor]) -> None:
        self.wake()
        self.engine.update_weights(weights.items())


class ObjectStore(WeightSyncPath):
    name = NAME

    def sender(self, *, rank: int, device: str, engines: list[Any], listener: Listener) -> Sender:
        return ObjectStoreSender() if rank == 0 else Sender()

    def receiver(self, *, engine: Any, device: str, wake: Callable[[], Any]) -> ObjectStoreReceiver:
        return ObjectStoreReceiver(engine=engine, wake=wake)

    def sync(self, *, actor, rollout) -> None:
        import ray

        exported = actor.async_call(actor.worker_class.send_weights)  # rank 0's tensors; the others' turn
        ray.get(rollout.async_call(rollout.worker_class.receive_weights, exported[0]) + list(exported))
