"""The weight-sync group of the Disaggregated layout: actor rank 0 broadcasts to the rollout engines.

A torch.distributed gloo group (rank 0 = actor rank 0, ranks 1..n = the engines), built from a
TCP store that the actor hosts, without touching any default process group. `connect` builds it
(the engines join through a Ray call), `disconnect` destroys it on both sides; the actor does the
first after it wakes and the second before it sleeps (the seed framework's fix). `broadcast`
sends the named weights: their names, shapes and dtypes through Ray, the data through the group.
Gloo works on CPU tensors; a GPU build swaps in NCCL here without touching the roles.
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Iterable

import ray
import torch
import torch.distributed as dist

TIMEOUT = datetime.timedelta(seconds=120)
WeightMeta = list[tuple[str, tuple[int, ...], str]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class ActorSide:
    """Rank 0 of the group, living in actor rank 0."""

    def __init__(self, engines: list) -> None:
        self.engines = engines
        self._store = None
        self._group = None

    def connect(self) -> None:
        host, port, world = ray.util.get_node_ip_address(), _free_port(), len(self.engines) + 1
        self._store = dist.TCPStore(host, port, world, True, timeout=TIMEOUT, wait_for_workers=False)
        joined = [engine.join_link.remote(host, port, rank, world) for rank, engine in enumerate(self.engines, 1)]
        self._group = dist.ProcessGroupGloo(self._store, 0, world, TIMEOUT)
        ray.get(joined)

    def disconnect(self) -> None:
        ray.get([engine.leave_link.remote() for engine in self.engines])
        self._group, self._store = None, None

    def broadcast(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        tensors = [(name, tensor.detach().to("cpu").contiguous()) for name, tensor in named]
        meta: WeightMeta = [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in tensors]
        received = [engine.receive_weights.remote(meta) for engine in self.engines]
        for _, tensor in tensors:
            self._group.broadcast(tensor, 0).wait()
        ray.get(received)


class EngineSide:
    """Ranks 1..n of the group, one per rollout engine."""

    def __init__(self) -> None:
        self._store = None
        self._group = None

    @property
    def connected(self) -> bool:
        return self._group is not None

    def join(self, host: str, port: int, rank: int, world: int) -> None:
        self._store = dist.TCPStore(host, port, world, False, timeout=TIMEOUT)
        self._group = dist.ProcessGroupGloo(self._store, rank, world, TIMEOUT)

    def leave(self) -> None:
        self._group, self._store = None, None

    def receive(self, meta: WeightMeta) -> list[tuple[str, torch.Tensor]]:
        if self._group is None:
            raise RuntimeError("weight-sync group is not connected: the actor must connect before broadcasting")
        received = []
        for name, shape, dtype in meta:
            tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            self._group.broadcast(tensor, 0).wait()
            received.append((name, tensor))
        return received
