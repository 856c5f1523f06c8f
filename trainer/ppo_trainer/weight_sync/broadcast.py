"""The broadcast path (Disaggregated): actor rank 0 broadcasts over one process group with the engines, in buckets.

Rank 0 of the weight-update group is the actor's source rank; the engines' ranks are 1..n, in
the order of the receivers. The group is built the way SGLang builds its end
(`init_custom_process_group`: a tcp:// rendezvous hosted by rank 0, the store prefixed by the
group name, a process group made outside the default one), so the actor and a real SGLang server
meet on the same keys. NCCL on GPUs, gloo on CPUs.

- Sending end, actor rank 0 (`BroadcastSender`; the other ranks read their shards and send
  nothing): its `wake` hook connects the group (`GroupSender`) right after the rank wakes, its
  `sleep` hook disconnects it right before the rank sleeps (the seed framework's fix: a group left
  open across the actor's sleep makes the next sync fail or hang), each a reported transition of
  `actor.weight_sync` (Disconnected/Connected); `send` pauses the engines, sends the weights
  bucket by bucket (one `Bucket` message naming its tensors, then one broadcast per tensor, in
  that order), and resumes them, flushing their prefix caches.
- Receiving end, in the rollout worker: `ServerReceiver` for an engine in front of servers
  (SGLang: each server's tensor-parallel ranks join the group themselves, told over HTTP, and take
  each bucket straight from the group), `InProcessReceiver` for an engine in the worker's own
  process (the built-in torch engine: one rank; each bucket is received here and loaded).
- The two ends speak in messages (`Ranks`, `Join`, `Bucket`, `Leave`, `Pause`, `Resume`): a
  receiver in another process is reached through `RemoteReceiver`, one Ray call of the worker's
  `receive_weights` per message. Names, shapes and dtypes travel as messages; tensors through the group.
- Driver: wake the engines (an engine takes new weights awake), then every actor rank sends.
Ray is imported only where one end calls the other: the group's recipe serves processes without it
(the SGLang test double, `tests/doubles/sglang_server.py`).
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world, rendezvous

from ppo_trainer.distributed import process_group_backend
from ppo_trainer.offload import Listener, Residency
from ppo_trainer.rollout.base import ServedEngine
from ppo_trainer.rollout.sglang.client import DEFAULT_GROUP, SGLangClient
from ppo_trainer.weight_sync.base import NamedWeights, Sender, WeightSyncPath

NAME = "broadcast"
DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024


# --- the group: SGLang's recipe, used by both ends -----------------------------------------------

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


def receive_bucket(
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


# --- the messages from the sending end to a receiving end ----------------------------------------

@dataclass(frozen=True)
class Ranks:
    """How many ranks of the group the receiver holds (answered with an int)."""


@dataclass(frozen=True)
class Join:
    """Join the group as ranks rank_offset.. of world_size (SGLang's /init_weights_update_group)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str


@dataclass(frozen=True)
class Bucket:
    """Receive one bucket, one broadcast from rank 0 per tensor in the order named, and load it
    (SGLang's /update_weights_from_distributed). Dtypes are torch names without 'torch.'."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str


@dataclass(frozen=True)
class Leave:
    """Destroy this end of the group (SGLang's /destroy_weights_update_group)."""

    group_name: str


@dataclass(frozen=True)
class Pause:
    """Stop generating before the buckets come (SGLang's /pause_generation)."""


@dataclass(frozen=True)
class Resume:
    """Generate again: after the last bucket with `flush` (the prefix caches hold old weights' work:
    /flush_cache, then /continue_generation even if the flush fails), after a failed send without."""

    flush: bool


# --- the receiving ends, in the rollout worker ---------------------------------------------------

class InProcessReceiver:
    """The group's end for an engine in this process (one rank): each bucket is received here and
    handed to `load` (the engine's `update_weights`). Generation and weight updates of an in-process
    engine never overlap, so pausing and resuming have nothing to do."""

    def __init__(self, *, load: Callable[[list[tuple[str, torch.Tensor]]], None], device: torch.device | str) -> None:
        self.load = load
        self.device = torch.device(device)
        self.groups: dict[str, dist.ProcessGroup] = {}

    def receive(self, message: Any) -> Any:
        match message:
            case Ranks():
                return 1
            case Join():
                if message.group_name in self.groups:
                    raise RuntimeError(
                        f"weight-update group {message.group_name} exists; destroy it before building it again"
                    )
                self.groups[message.group_name] = open_weights_group(
                    master_address=message.master_address,
                    master_port=message.master_port,
                    rank=message.rank_offset,
                    world_size=message.world_size,
                    group_name=message.group_name,
                    backend=message.backend,
                )
            case Bucket():
                group = self.groups.get(message.group_name)
                if group is None:
                    raise RuntimeError(
                        f"weight-update group {message.group_name} is not connected (groups: {list(self.groups)}): "
                        "the actor must connect before broadcasting"
                    )
                self.load(receive_bucket(group, names=message.names, dtypes=message.dtypes, shapes=message.shapes,
                                         device=self.device))
            case Leave():
                group = self.groups.pop(message.group_name, None)
                if group is None:
                    raise RuntimeError(f"weight-update group {message.group_name} does not exist")
                close_weights_group(group)
            case Pause() | Resume():
                pass
            case _:
                raise TypeError(f"not a broadcast message: {message!r}")
        return None


class ServerReceiver:
    """The group's end for an engine in front of servers (SGLang): each message becomes the same
    call on every server at once, over HTTP; server i holds ranks rank_offset + i * tensor_parallel.."""

    def __init__(self, servers: list[SGLangClient], *, tensor_parallel: int = 1) -> None:
        if not servers:
            raise ValueError("ServerReceiver needs at least one server")
        self.servers = list(servers)
        self.tensor_parallel = tensor_parallel
        self._pool = ThreadPoolExecutor(max_workers=len(self.servers), thread_name_prefix="weights-to-servers")

    def receive(self, message: Any) -> Any:
        match message:
            case Ranks():
                return len(self.servers) * self.tensor_parallel
            case Join():
                self._on_each(lambda i, server: server.init_weights_update_group(
                    master_address=message.master_address,
                    master_port=message.master_port,
                    rank_offset=message.rank_offset + i * self.tensor_parallel,
                    world_size=message.world_size,
                    group_name=message.group_name,
                    backend=message.backend,
                ))
            case Bucket():
                self._on_each(lambda _, server: server.update_weights_from_distributed(
                    names=message.names, dtypes=message.dtypes, shapes=message.shapes, group_name=message.group_name
                ))
            case Leave():
                self._on_each(lambda _, server: server.destroy_weights_update_group(group_name=message.group_name))
            case Pause():
                self._on_each(lambda _, server: server.pause_generation())
            case Resume(flush=flush):
                if flush:
                    try:
                        self._on_each(lambda _, server: server.flush_cache())
                    except BaseException:
                        # The failure is what the step reports; the servers must still not stay paused.
                        self._on_each(lambda _, server: server.continue_generation(), quiet=True)
                        raise
                self._on_each(lambda _, server: server.continue_generation())
            case _:
                raise TypeError(f"not a broadcast message: {message!r}")
        return None

    def _on_each(self, call: Callable[[int, SGLangClient], Any], *, quiet: bool = False) -> None:
        """`call(i, server)` for every server at once; raise the first failure (after all finished) unless `quiet`."""
        _wait_all([self._pool.submit(call, i, server) for i, server in enumerate(self.servers)], swallow=quiet)


def receiver_for(engine: Any, *, device: str | torch.device) -> InProcessReceiver | ServerReceiver:
    """The receiving end for `engine`: its servers when it runs them (`ServedEngine`), else itself on `device`."""
    if isinstance(engine, ServedEngine):
        return ServerReceiver(engine.servers, tensor_parallel=engine.tensor_parallel)
    return InProcessReceiver(load=engine.update_weights, device=device)


class RemoteReceiver:
    """A rollout worker's receiving end seen from the actor: each message is one call of the worker's
    `receive_weights`, through Ray."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def receive(self, message: Any) -> Any:
        import ray

        return ray.get(self.handle.receive_weights.remote(message))


# --- the sending end, in actor rank 0 ------------------------------------------------------------

class GroupSender:
    """Actor rank 0's end of the weight-update group with `receivers` (anything with `receive(message)`)."""

    def __init__(
        self,
        *,
        receivers: list[Any],
        master_address: str,
        group_name: str = DEFAULT_GROUP,
        backend: str = "nccl",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = 300.0,
    ) -> None:
        if not receivers:
            raise ValueError("GroupSender needs at least one receiver")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self.receivers = list(receivers)
        self.master_address = master_address
        self.group_name = group_name
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self._ranks: list[int] | None = None
        self._group: dist.ProcessGroup | None = None
        self._pool = ThreadPoolExecutor(max_workers=len(self.receivers) + 1, thread_name_prefix="weight-sync")

    @property
    def connected(self) -> bool:
        return self._group is not None

    @property
    def world_size(self) -> int:
        return 1 + sum(self._receiver_ranks())

    def _receiver_ranks(self) -> list[int]:
        if self._ranks is None:
            self._ranks = [int(r.receive(Ranks())) for r in self.receivers]
        return self._ranks

    def connect(self) -> None:
        """Build the group with every receiver (a no-op when connected)."""
        if self._group is not None:
            return
        port, world = free_port(), self.world_size
        joins, offset = [], 1
        for receiver, ranks in zip(self.receivers, self._receiver_ranks()):
            join = Join(master_address=self.master_address, master_port=port, rank_offset=offset, world_size=world,
                        group_name=self.group_name, backend=self.backend)
            joins.append(self._pool.submit(receiver.receive, join))
            offset += ranks
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
        # A receiver that refuses fails fast here, instead of after the rendezvous timeout.
        done, _ = wait([mine, *joins], return_when=FIRST_EXCEPTION)
        failed = [f for f in (*joins, mine) if f in done and f.exception() is not None]
        if failed:
            if mine.done() and mine.exception() is None:
                close_weights_group(mine.result())
            raise failed[0].exception()
        self._group = mine.result()

    def disconnect(self) -> None:
        """Destroy the group on every receiver and here (a no-op when not connected)."""
        if self._group is None:
            return
        group, self._group = self._group, None
        try:
            self._on_all(Leave(group_name=self.group_name))
        finally:
            close_weights_group(group)

    def broadcast(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Send the weights to every receiver: pause, buckets, resume (flushing the prefix caches)."""
        if self._group is None:
            raise RuntimeError(
                "weight-sync group is not connected: call connect() after the actor wakes, before broadcasting"
            )
        device = "cpu" if self.backend == "gloo" else None
        named = [(name, t.detach().to(device or t.device).contiguous()) for name, t in named_tensors]
        self._on_all(Pause())
        try:
            self._send(named)
        except BaseException:
            # The failure is what the step reports; the servers must still not stay paused.
            self._on_all(Resume(flush=False), swallow=True)
            raise
        self._on_all(Resume(flush=True))

    def _send(self, named: list[tuple[str, torch.Tensor]]) -> None:
        for bucket in buckets(named, bucket_bytes=self.bucket_bytes):
            message = Bucket(
                names=[name for name, _ in bucket],
                dtypes=[str(t.dtype).removeprefix("torch.") for _, t in bucket],
                shapes=[list(t.shape) for _, t in bucket],
                group_name=self.group_name,
            )
            receiving = [self._pool.submit(receiver.receive, message) for receiver in self.receivers]
            try:
                for _, tensor in bucket:
                    dist.broadcast(tensor, group_src=0, group=self._group)
            except Exception:
                _wait_all(receiving, swallow=True)
                raise
            _wait_all(receiving)

    def _on_all(self, message: Any, *, swallow: bool = False) -> None:
        _wait_all([self._pool.submit(receiver.receive, message) for receiver in self.receivers], swallow=swallow)


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


class BroadcastSender(Sender):
    """Actor rank 0's end: `group` follows the rank's residency, as its `actor.weight_sync` link."""

    def __init__(self, group: GroupSender, *, rank: int, listener: Listener) -> None:
        self.group = group
        self.link = Residency.for_link("actor.weight_sync", rank=rank, listener=listener)

    def wake(self) -> None:
        self.link.wake(self.group.connect)

    def sleep(self) -> None:
        self.link.sleep(self.group.disconnect)

    def send(self, named_weights: NamedWeights) -> None:
        self.link.require_awake("broadcast weights")
        self.group.broadcast(named_weights)


class Broadcast(WeightSyncPath):
    name = NAME

    def sender(self, *, rank: int, device: str, engines: list[Any], listener: Listener) -> Sender:
        if rank != 0:
            return Sender()
        import ray

        group = GroupSender(receivers=[RemoteReceiver(handle) for handle in engines],
                            master_address=ray.util.get_node_ip_address(), backend=process_group_backend(device))
        return BroadcastSender(group, rank=rank, listener=listener)

    def receiver(self, *, engine: Any, device: str, wake: Callable[[], Any]) -> InProcessReceiver | ServerReceiver:
        return receiver_for(engine, device=device)

    def sync(self, *, actor, rollout) -> None:
        rollout.call(rollout.worker_class.wake)  # an engine takes new weights awake
        actor.call(actor.worker_class.send_weights)
