"""The roles' one dependency on Ray: rollout workers seen as weight-sync targets, and this node's address.

In the Disaggregated layout actor rank 0 drives `rollout/weight_sync.py:DistributedWeightSync`,
the one implementation of the weight-update group's handshake, with one `RayWorkerTarget` per
rollout worker: each call (init the group, a bucket of update_weights_from_distributed, destroy,
pause, flush, continue) is a Ray call on the worker, which answers it with its engine's end of
the group (SGLang servers over HTTP, or the built-in torch engine in the worker's own process).
Names, shapes and dtypes travel through Ray; the tensors travel through the group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray

from ppo_trainer.rollout.weight_sync import DistributedWeightSync, WeightSyncTarget


def node_ip() -> str:
    """The address other nodes reach this process's node at."""
    return ray.util.get_node_ip_address()


def _on_engine_end(worker: Any, method: Callable, kwargs: dict[str, Any]) -> Any:
    """Runs inside the rollout worker's process: `method` of `WeightSyncTarget` on the worker's end."""
    return getattr(worker.weight_sync, method.__name__)(**kwargs)


class RayWorkerTarget:
    """A `WeightSyncTarget` over a rollout worker's Ray handle (roles/rollout.py:RolloutWorker): each
    call runs on the worker's `weight_sync`, in its process (Ray's `__ray_call__`)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self._ranks: int | None = None

    def _call(self, method: Callable, **kwargs: Any) -> Any:
        return ray.get(self.handle.__ray_call__.remote(_on_engine_end, method, kwargs))

    @property
    def ranks(self) -> int:
        if self._ranks is None:
            self._ranks = int(ray.get(self.handle.__ray_call__.remote(lambda worker: worker.weight_sync.ranks)))
        return self._ranks

    def init_weights_update_group(self, **kwargs: Any) -> None:
        self._call(WeightSyncTarget.init_weights_update_group, **kwargs)

    def update_weights_from_distributed(self, **kwargs: Any) -> None:
        self._call(WeightSyncTarget.update_weights_from_distributed, **kwargs)

    def destroy_weights_update_group(self, **kwargs: Any) -> None:
        self._call(WeightSyncTarget.destroy_weights_update_group, **kwargs)

    def pause_generation(self) -> None:
        self._call(WeightSyncTarget.pause_generation)

    def flush_cache(self) -> None:
        self._call(WeightSyncTarget.flush_cache)

    def continue_generation(self) -> None:
        self._call(WeightSyncTarget.continue_generation)


def build_weight_sync(workers: list[Any], *, backend: str) -> DistributedWeightSync:
    """Actor rank 0's end of the weight-update group with every rollout worker, hosted on this node."""
    return DistributedWeightSync(
        targets=[RayWorkerTarget(handle) for handle in workers], master_address=node_ip(), backend=backend
    )
