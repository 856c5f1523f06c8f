"""The actor's side of the Disaggregated weight sync: one process group with the rollout servers, broadcast in buckets.

Rank 0 is the actor's source rank; the servers' tensor-parallel ranks are 1..n, in the order of
the targets. The group is built the way SGLang builds its end (`init_custom_process_group`: a
tcp:// rendezvous hosted by rank 0, the store prefixed by the group name, a process group made
outside the default one), so the actor and a real SGLang server meet on the same keys; the
built-in HTTP server builds its end with `open_weights_group` too. NCCL on GPUs, gloo on CPUs.

`connect` after the actor wakes, `disconnect` before it sleeps (the seed framework's fix: a group
left open across the actor's sleep makes the next sync fail or hang); `broadcast` pauses the
servers, sends the weights bucket by bucket (one /update_weights_from_distributed per bucket,
naming its tensors; one broadcast per tensor, in that order), flushes their prefix caches and
lets them continue. Must not depend on Ray or on the PPO loop: targets are anything with the
methods of `WeightSyncTarget` (an `SGLangRolloutEngine` is one; so is a `WeightsReceiver`, the
engine end of the same group for an engine in the receiving process, such as the built-in torch
engine in a rollout worker, so that one handshake serves both kinds of engine).
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world, rendezvous

DEFAULT_GROUP = "weight_update_group"
DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024


def open_weights_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float = 300.0,
) -> dist.ProcessGroup:
    """Join the weight-update group as `rank` (SGLang's recipe); returns once all ranks joined."""
    if not group_name:
        raise ValueError("group_name is empty; name the weight-update group (SGLang's default: weight_update_group)")
    timeout = datetime.timedelta(seconds=timeout_s)
    host = f"[{master_address}]" if ":" in master_address else master_address
    store, rank, world_size = next(rendezvous(f"tcp://{host}:{master_port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(
        world_size, rank, [], backend, PrefixStore(group_name, store), group_name=group_name, timeout=timeout
    )
    # Ranks of this group are its own: rank 0 is the source whatever the process's default group says.
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def close_weights_group(group: dist.ProcessGroup) -> None:
    dist.destroy_process_group(group)


class WeightSyncTarget(Protocol):
    """One or more rollout servers, seen from the actor."""

    @property
    def ranks(self) -> int:
        """How many ranks of the group it holds (its servers' tensor-parallel sizes, summed)."""
        ...

    def init_weights_update_group(
        self, *, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> None: ...

    def update_weights_from_distributed(
        self, *, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str
    ) -> None: ...

    def destroy_weights_update_group(self, *, group_name: str) -> None: ...

    def pause_generation(self) -> None: ...

    def flush_cache(self) -> None: ...

    def continue_generation(self) -> None: ...


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def buckets(named: list[tuple[str, torch.Tensor]], *, bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive tensors grouped so that each group holds at most `bucket_bytes` (a larger tensor goes alone)."""
    groups: list[list[tuple[str, torch.Tensor]]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if not groups or size + nbytes > bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, tensor))
        size += nbytes
    return groups


def receive_weights(
    group: dist.ProcessGroup, *, names: list[str], dtypes: list[str], shapes: list[list[int]], device: torch.device
) -> list[tuple[str, torch.Tensor]]:
    """The receiving end of one bucket: one broadcast from rank 0 per tensor, in the order named."""
    received = []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        tensor = torch.empty(shape, dtype=torch_dtype(dtype), device=device)
        dist.broadcast(tensor, group_src=0, group=group)
        received.append((name, tensor))
    return received


def torch_dtype(name: str) -> torch.dtype:
    """torch.float32 from 'float32' or 'torch.float32' (how dtypes travel in weight-update requests)."""
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype {name!r} is not a torch dtype name (e.g. float32, bfloat16)")
    return dtype


class WeightsReceiver:
    """The engine end of the weight-update group for an engine living in this process (one rank).

    It answers the calls a rollout server answers over HTTP, with the same group recipe, and hands
    each received bucket to `load` (the engine's `update_weights`). Generation and weight updates
    of an in-process engine never overlap, so pause, flush and continue have nothing to do.
    """

    ranks = 1

    def __init__(self, *, load: Callable[[list[tuple[str, torch.Tensor]]], None], device: torch.device | str) -> None:
        self.load = load
        self.device = torch.device(device)
        self.groups: dict[str, dist.ProcessGroup] = {}

    def init_weights_update_group(
        self, *, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> None:
        if group_name in self.groups:
            raise RuntimeError(f"weight-update group {group_name} exists; destroy it before building it again")
        self.groups[group_name] = open_weights_group(
            master_address=master_address,
            master_port=master_port,
            rank=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        )

    def update_weights_from_distributed(
        self, *, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str
    ) -> None:
        group = self.groups.get(group_name)
        if group is None:
            raise RuntimeError(
                f"weight-update group {group_name} is not connected (groups: {list(self.groups)}): "
                "the actor must connect before broadcasting"
            )
        self.load(receive_weights(group, names=names, dtypes=dtypes, shapes=shapes, device=self.device))

    def destroy_weights_update_group(self, *, group_name: str) -> None:
        group = self.groups.pop(group_name, None)
        if group is None:
            raise RuntimeError(f"weight-update group {group_name} does not exist")
        close_weights_group(group)

    def pause_generation(self) -> None:
        pass

    def flush_cache(self) -> None:
        pass

    def continue_generation(self) -> None:
        pass


class DistributedWeightSync:
    """Actor rank 0's end of the weight-update group with `targets`."""

    def __init__(
        self,
        *,
        targets: list[WeightSyncTarget],
        master_address: str,
        group_name: str = DEFAULT_GROUP,
        backend: str = "nccl",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = 300.0,
    ) -> None:
        if not targets:
            raise ValueError("DistributedWeightSync needs at least one rollout target")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self.targets = list(targets)
        self.master_address = master_address
        self.group_name = group_name
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self._group: dist.ProcessGroup | None = None
        self._pool = ThreadPoolExecutor(max_workers=len(self.targets) + 1, thread_name_prefix="weight-sync")

    @property
    def connected(self) -> bool:
        return self._group is not None

    @property
    def world_size(self) -> int:
        return 1 + sum(t.ranks for t in self.targets)

    def connect(self) -> None:
        """Build the group with every target (a no-op when connected)."""
        if self._group is not None:
            return
        port, world = free_port(), self.world_size
        joins, offset = [], 1
        for target in self.targets:
            joins.append(
                self._pool.submit(
                    target.init_weights_update_group,
                    master_address=self.master_address,
                    master_port=port,
                    rank_offset=offset,
                    world_size=world,
                    group_name=self.group_name,
                    backend=self.backend,
                )
            )
            offset += target.ranks
        mine = self._pool.submit(
            open_weights_group,
            master_address=self.master_address,
            master_port=port,
            rank=0,
            world_size=world,
            group_name=self.group_name,
            backend=self.backend,
            timeout_s=self.timeout_s,
        )
        # A target that refuses fails fast here, instead of after the rendezvous timeout.
        done, _ = wait([mine, *joins], return_when=FIRST_EXCEPTION)
        failed = [f for f in (*joins, mine) if f in done and f.exception() is not None]
        if failed:
            if mine.done() and mine.exception() is None:
                close_weights_group(mine.result())
            raise failed[0].exception()
        self._group = mine.result()

    def disconnect(self) -> None:
        """Destroy the group on every target and here (a no-op when not connected)."""
        if self._group is None:
            return
        group, self._group = self._group, None
        try:
            _wait_all([self._pool.submit(t.destroy_weights_update_group, group_name=self.group_name) for t in self.targets])
        finally:
            close_weights_group(group)

    def broadcast(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Send the weights to every target: pause, buckets, flush the prefix caches, continue."""
        if self._group is None:
            raise RuntimeError(
                "weight-sync group is not connected: call connect() after the actor wakes, before broadcasting"
            )
        device = "cpu" if self.backend == "gloo" else None
        named = [(name, t.detach().to(device or t.device).contiguous()) for name, t in named_tensors]
        self._on_all("pause_generation")
        try:
            self._send(named)
            self._on_all("flush_cache")
        except BaseException:
            # The failure is what the step reports; the servers must still not stay paused.
            _wait_all([self._pool.submit(t.continue_generation) for t in self.targets], swallow=True)
            raise
        self._on_all("continue_generation")

    def _send(self, named: list[tuple[str, torch.Tensor]]) -> None:
        for bucket in buckets(named, bucket_bytes=self.bucket_bytes):
            receiving = [
                self._pool.submit(
                    target.update_weights_from_distributed,
                    names=[name for name, _ in bucket],
                    dtypes=[str(t.dtype).removeprefix("torch.") for _, t in bucket],
                    shapes=[list(t.shape) for _, t in bucket],
                    group_name=self.group_name,
                )
                for target in self.targets
            ]
            try:
                for _, tensor in bucket:
                    dist.broadcast(tensor, group_src=0, group=self._group)
            except Exception:
                _wait_all(receiving, swallow=True)
                raise
            _wait_all(receiving)

    def _on_all(self, method: str) -> None:
        _wait_all([self._pool.submit(getattr(t, method)) for t in self.targets])


def _wait_all(futures: list[Future], *, swallow: bool = False) -> None:
    """Wait for every future; raise the first failure (after all finished) unless `swallow`."""
    errors = []
    for future in futures:
        try:
            future.result()
        except Exception as exc:  # noqa: BLE001 - collected, re-raised below
            errors.append(exc)
    if errors and not swallow:
        raise errors[0]
