"""A RoleGroup: the N ranks of one role as Ray actors, called together, rank i fed rank i's data.

Methods are named by the worker class's own function, never by a string:
`group.async_call(ActorWorker.log_probs, *batch)` submits it on every rank and returns their
ObjectRefs without waiting (a method the group's class lacks is a TypeError before anything is
sent). An argument wrapped in `PerRank` (one entry per rank, as every group call returns) is
split so that rank i gets entry i; everything else goes to every rank. `spread`, one list per
rank, appends that rank's list to its positional arguments: how each actor rank receives the
critic ranks' values it needs. Top-level ObjectRef arguments are resolved by Ray before the task
runs, so a rank receives the data while the driver only ever holds refs. `setup_process_group`
publishes the rendezvous address of a role's process group: rank 0 hosts it on its node and
every rank attaches to it (a Megatron rank then builds its model on it). `node_ip` is where
other nodes reach this process's node.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray


def node_ip() -> str:
    """The address other nodes reach this process's node at."""
    return ray.util.get_node_ip_address()


class PerRank(list):
    """One value (usually an ObjectRef) per rank of a group; rank i of the callee gets entry i."""


class RoleGroup:
    def __init__(self, role: str, handles: list[Any], worker_class: type) -> None:
        self.role = role
        self.handles = handles
        self.worker_class = worker_class

    @property
    def world_size(self) -> int:
        return len(self.handles)

    def _for_rank(self, value: Any, rank: int, name: str) -> Any:
        if not isinstance(value, PerRank):
            return value
        if len(value) != self.world_size:
            raise ValueError(f"{self.role}: argument {name} has {len(value)} per-rank entries for {self.world_size} ranks")
        return value[rank]

    def _method_name(self, method: Callable) -> str:
        name = getattr(method, "__name__", None)
        if name is None or getattr(self.worker_class, name, None) is not method:
            raise TypeError(f"{self.role}: {method!r} is not a method of {self.worker_class.__name__}")
        return name

    def async_call(
        self, method: Callable, *args: Any, num_returns: int = 1, spread: PerRank | None = None, **kwargs: Any
    ) -> PerRank | tuple[PerRank, ...]:
        """Submit `method` on every rank; returns the refs per rank (a tuple of PerRank with num_returns > 1)."""
        name = self._method_name(method)
        refs = []
        for rank, handle in enumerate(self.handles):
            rank_args = [self._for_rank(a, rank, f"#{i}") for i, a in enumerate(args)]
            if spread is not None:
                rank_args.extend(self._for_rank(spread, rank, "spread"))
            rank_kwargs = {k: self._for_rank(v, rank, k) for k, v in kwargs.items()}
            remote = getattr(handle, name)
            if num_returns != 1:
                remote = remote.options(num_returns=num_returns)
            refs.append(remote.remote(*rank_args, **rank_kwargs))
        if num_returns == 1:
            return PerRank(refs)
        return tuple(PerRank(r[i] for r in refs) for i in range(num_returns))

    def call(self, method: Callable, *args: Any, **kwargs: Any) -> list[Any]:
        """Run `method` on every rank and wait for the results."""
        return ray.get(self.async_call(method, *args, **kwargs))

    def split(self, items: list[Any]) -> PerRank:
        """`items` in contiguous, near-equal parts, one per rank (the first ranks take one more)."""
        size, extra = divmod(len(items), self.world_size)
        bounds = [rank * size + min(rank, extra) for rank in range(self.world_size + 1)]
        return PerRank(items[bounds[rank]:bounds[rank + 1]] for rank in range(self.world_size))

    def seeds(self, base: int) -> PerRank:
        """A distinct seed per rank, so that ranks sample different continuations: rank 0 keeps
        `base`, the others are spaced far beyond any step count added to it."""
        return PerRank(base + rank * 1_000_000_007 for rank in range(self.world_size))

    def setup_process_group(self) -> None:
        """Rank 0 hosts the group's store on its node; every rank attaches (awake ranks build the group).
        Nothing to do for a role without one, or one whose single rank set up its own."""
        leader = self.handles[0]
        host = ray.get(leader.__ray_call__.remote(lambda _worker: node_ip()))
        address = ray.get(leader.host_process_group.remote(host))
        if address is not None:
            self.call(self.worker_class.join_process_group, *address)

    def kill(self) -> None:
        for handle in self.handles:
            ray.kill(handle)
