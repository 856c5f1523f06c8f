"""A RoleGroup: the N ranks of one role as Ray actors, called together, rank i fed rank i's data.

`async_call(method, *args, **kwargs)` submits `method` on every rank and returns their
ObjectRefs without waiting. An argument wrapped in `PerRank` (a list with one entry per rank,
as every group call returns) is split so that rank i gets entry i; everything else goes to every
rank. Top-level ObjectRef arguments are resolved by Ray before the task runs, so a rank of the
actor receives the critic's output for the same rank while the driver only ever holds refs.
`setup_process_group` publishes the rendezvous address of a role's process group: rank 0 hosts
it on its node and every rank attaches to it (a Megatron rank then builds its model on it).
"""

from __future__ import annotations

from typing import Any

import ray


class PerRank(list):
    """One value (usually an ObjectRef) per rank of a group; rank i of the callee gets entry i."""


class RoleGroup:
    def __init__(self, role: str, handles: list[Any]) -> None:
        self.role = role
        self.handles = handles

    @property
    def world_size(self) -> int:
        return len(self.handles)

    def _for_rank(self, value: Any, rank: int, name: str) -> Any:
        if not isinstance(value, PerRank):
            return value
        if len(value) != self.world_size:
            raise ValueError(
                f"{self.role}: argument {name} has {len(value)} per-rank entries for {self.world_size} ranks; "
                "actor and critic must have the same data-parallel layout"
            )
        return value[rank]

    def async_call(self, method: str, *args: Any, num_returns: int = 1, **kwargs: Any) -> PerRank | tuple[PerRank, ...]:
        """Submit `method` on every rank; returns the refs per rank (a tuple of PerRank with num_returns > 1)."""
        refs = []
        for rank, handle in enumerate(self.handles):
            rank_args = [self._for_rank(a, rank, f"#{i}") for i, a in enumerate(args)]
            rank_kwargs = {k: self._for_rank(v, rank, k) for k, v in kwargs.items()}
            remote = getattr(handle, method)
            if num_returns != 1:
                remote = remote.options(num_returns=num_returns)
            refs.append(remote.remote(*rank_args, **rank_kwargs))
        if num_returns == 1:
            return PerRank(refs)
        return tuple(PerRank(r[i] for r in refs) for i in range(num_returns))

    def split(self, items: list[Any]) -> PerRank:
        """`items` in contiguous, near-equal parts, one per rank (the first ranks take one more)."""
        size, extra = divmod(len(items), self.world_size)
        bounds = [rank * size + min(rank, extra) for rank in range(self.world_size + 1)]
        return PerRank(items[bounds[rank]:bounds[rank + 1]] for rank in range(self.world_size))

    def seeds(self, base: int) -> PerRank:
        """A distinct seed per rank, so that ranks sample different continuations: rank 0 keeps
        `base`, the others are spaced far beyond any step count added to it."""
        return PerRank(base + rank * 1_000_000_007 for rank in range(self.world_size))

    def async_train(self, *args: Any, external_data: PerRank | None = None, num_returns: int = 1, **kwargs: Any):
        """Train every rank; `external_data` (the critic's refs) goes rank to rank, resolved by Ray."""
        if external_data is not None:
            if not isinstance(external_data, PerRank):
                raise TypeError("external_data must be the PerRank list of refs another group's call returned")
            kwargs["external_data"] = external_data
        return self.async_call("train", *args, num_returns=num_returns, **kwargs)

    def setup_process_group(self) -> None:
        """Rank 0 hosts the group's store on its node; every rank attaches (awake ranks build the group).
        Nothing to do for a role without one, or one whose single rank set up its own."""
        leader = self.handles[0]
        host = ray.get(leader.__ray_call__.remote(lambda _worker: ray.util.get_node_ip_address()))
        address = ray.get(leader.host_process_group.remote(host))
        if address is not None:
            self.call("join_process_group", *address)

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Run `method` on every rank and wait for the results."""
        return ray.get(self.async_call(method, *args, **kwargs))

    def kill(self) -> None:
        for handle in self.handles:
            ray.kill(handle)
