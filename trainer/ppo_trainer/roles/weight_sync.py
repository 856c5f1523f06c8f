"""How new actor weights reach the rollout engines: one `WeightSync`, chosen once from the layout.

`build_weight_sync(layout, actor=..., rollout=...)` picks the path a run's layout allows, and
`Roles.sync_weights` is then one call, `sync()`:
- `CudaIpcWeightSync` (Colocate, Torch engines on GPUs): every actor rank shares its device
  tensors with the engine on its GPU, which copies them device to device (`rollout/cuda_ipc.py`).
- `ObjectStoreWeightSync` (Colocate otherwise): actor rank 0 exports CPU tensors into Ray's object
  store and every engine loads them (an SGLang engine hands them to its servers over HTTP,
  /update_weights_from_tensor).
- `BroadcastWeightSync` (Disaggregated): the engines wake, then actor rank 0 broadcasts over the
  weight-update group it holds with every engine (`rollout/weight_sync.py`; SGLang's servers answer
  the group's HTTP calls, the built-in engine a `WeightsReceiver`).
Every actor rank takes part in each (waking a multi-rank role is collective). Driver side: Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import ray

from ppo_trainer.roles.actor import ActorWorker
from ppo_trainer.roles.group import RoleGroup
from ppo_trainer.roles.rollout import RolloutWorker


class WeightSync(Protocol):
    def sync(self) -> None:
        """The actor's current weights to every engine; returns once every engine serves them."""
        ...


@dataclass(frozen=True)
class CudaIpcWeightSync:
    actor: RoleGroup
    rollout: RoleGroup

    def sync(self) -> None:
        shared = self.actor.call(ActorWorker.share_weights)
        try:
            ray.get([engine.update_weights_shared.remote(s) for engine, s in zip(self.rollout.handles, shared)])
        finally:
            self.actor.call(ActorWorker.release_weights)


@dataclass(frozen=True)
class ObjectStoreWeightSync:
    actor: RoleGroup
    rollout: RoleGroup

    def sync(self) -> None:
        exported = self.actor.async_call(ActorWorker.export_weights)  # rank 0's tensors; the others' turn
        ray.get(self.rollout.async_call(RolloutWorker.update_weights, exported[0]) + list(exported))


@dataclass(frozen=True)
class BroadcastWeightSync:
    actor: RoleGroup
    rollout: RoleGroup

    def sync(self) -> None:
        self.rollout.call(RolloutWorker.wake)  # an engine takes new weights awake
        self.actor.call(ActorWorker.broadcast_weights)


def build_weight_sync(*, cuda_ipc: bool, colocate: bool, actor: RoleGroup, rollout: RoleGroup) -> WeightSync:
    if cuda_ipc:
        return CudaIpcWeightSync(actor, rollout)
    if colocate:
        return ObjectStoreWeightSync(actor, rollout)
    return BroadcastWeightSync(actor, rollout)
