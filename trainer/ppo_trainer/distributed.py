"""The process group of a training role's ranks: torch.distributed's default group while awake.

Rank 0 hosts a rendezvous store on a port the OS picks (`host`) and the caller publishes that
address to every rank (`attach`; the roles pass it through Ray). The store lives as long as the
rank; the process group does not: `connect` builds it (gloo on CPU, NCCL on GPU) under a fresh
key prefix, one per build, so a rank never meets the keys of an earlier group, and `disconnect`
destroys it, so a sleeping role holds no communicator (the seed framework destroys its groups
before offloading and rebuilds them after). Destroying NCCL communicators takes about half a
second of host time at one rank, so `disconnect` hands the destroy to a thread (`Teardown`) and
returns: it overlaps the role's offload and whatever runs next, and the next `connect` waits for it
(and raises what it raised). Both are collective (every rank of the role makes
them together; one that does not come fails the others after `timeout_s`) and are the two
transitions of a `Residency` (Connected/Disconnected), reported like every other. A backend that
builds groups of its own on top of the default one (megatron's model-parallel groups) hooks in
with `on_connect` (after the build) and `on_disconnect` (before the destroy).

Objects built while a group lived keep references to it (megatron's layers, DDP buckets and
optimizer do); `repoint_process_groups` walks such objects and replaces every destroyed group by
its rebuilt twin, matched by `group_key` (the group's description and ranks).
`merge_groups_of_the_same_ranks` lets groups of the same members share one group (and so one
communicator).

`sum_gradients` is what a backend calls between backward and the optimizer step: each rank's
loss is its share of the whole batch's (`algorithms/aggregation.py`), so the gradients add up
over the default group; `all_reduce_sum` adds up other figures the same way (advantage moments,
loss statistics). Both do nothing when there is no group. Depends on torch and the offload state
machine only; never on Ray or the PPO loop.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Iterable, Mapping

import torch
import torch.distributed as dist

from ppo_trainer.offload import Listener, Residency

BUCKET_BYTES = 64 * 1024 * 1024
"""Gradients are all-reduced in flat buffers of at most this size (one collective per bucket)."""


def process_group_backend(device: str) -> str:
    return "nccl" if str(device).startswith("cuda") else "gloo"


class Teardown:
    """A destroy running on its own thread; `join` waits for it and raises what it raised."""

    def __init__(self, destroy: Callable[[], None], *, name: str) -> None:
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._run, args=(destroy,), name=name, daemon=True)
        self._thread.start()

    def _run(self, destroy: Callable[[], None]) -> None:
        try:
            destroy()
        except Exception as error:  # noqa: BLE001 - re-raised on the caller's thread by join
            self._error = error

    def join(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise RuntimeError(f"destroying the process group failed on {self._thread.name}") from self._error


class RoleProcessGroup:
    """Rank `rank` of a role's `world_size` ranks (one rank is a group too: a megatron role needs one)."""

    def __init__(
        self, *, role: str, rank: int, world_size: int, device: str, listener: Listener | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"a process group needs at least 1 rank, got world_size={world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
        self.role = role
        self.rank = rank
        self.world_size = world_size
        self.backend = process_group_backend(device)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.residency = Residency.for_link(f"{role}.process_group", rank=rank, listener=listener)
        self.on_connect: Callable[[], None] | None = None
        self.on_disconnect: Callable[[], None] | None = None
        self._store: dist.Store | None = None
        self._builds = 0
        self._teardown: Teardown | None = None

    @property
    def connected(self) -> bool:
        return self.residency.awake

    @property
    def has_rendezvous(self) -> bool:
        return self._store is not None

    def host(self, address: str) -> tuple[str, int]:
        """Rank 0: serve the rendezvous store on `address` and a free port; returns (address, port) to publish."""
        if self.rank != 0:
            raise ValueError(f"{self.role}[{self.rank}]: only rank 0 hosts the process group's store")
        if self._store is None:
            self._store = dist.TCPStore(address, 0, self.world_size, True, timeout=self.timeout, wait_for_workers=False)
        return address, int(self._store.port)

    def attach(self, address: str, port: int) -> None:
        """Every other rank: become a client of rank 0's store (rank 0 already serves it)."""
        if self.rank != 0 and self._store is None:
            self._store = dist.TCPStore(address, port, self.world_size, False, timeout=self.timeout)

    def connect(self) -> bool:
        """Build the group with the other ranks (a no-op when connected)."""
        return self.residency.wake(self._build)

    def disconnect(self) -> bool:
        """Destroy the group (a no-op when not connected); the communicators go down on a thread."""
        return self.residency.sleep(self._destroy)

    def finish_teardown(self) -> None:
        """Wait until the last destroyed group is gone (`connect` does before it builds the next)."""
        teardown, self._teardown = self._teardown, None
        if teardown is not None:
            teardown.join()

    def _build(self) -> None:
        self.finish_teardown()
        if self._store is None:
            raise RuntimeError(
                f"{self.role}[{self.rank}]: the process group has no rendezvous yet: rank 0 must host() it "
                "and every rank attach() to it before the role wakes (roles/build.py does this after building the ranks)"
            )
        if dist.is_initialized():
            raise RuntimeError(
                f"{self.role}[{self.rank}]: this process already has a default process group; the role's "
                "group must be the only one (destroy the other before waking the role)"
            )
        self._builds += 1
        store = dist.PrefixStore(f"{self.role}/process_group/{self._builds}/", self._store)
        dist.init_process_group(
            self.backend, store=store, rank=self.rank, world_size=self.world_size, timeout=self.timeout
        )
        if self.on_connect is not None:
            self.on_connect()

    def _destroy(self) -> None:
        if self.on_disconnect is not None:
            self.on_disconnect()  # the backend's own groups, while the default one still lives
        self._teardown = Teardown(dist.destroy_process_group, name=f"{self.role}[{self.rank}] process group teardown")


GroupKey = tuple[str, tuple[int, ...]]


def group_key(group: dist.ProcessGroup) -> GroupKey:
    """What identifies a group across a rebuild: its description and its ranks (call it while it lives)."""
    return group.group_desc, tuple(dist.get_process_group_ranks(group))


def merge_groups_of_the_same_ranks(namespace: object) -> int:
    """Point every process group among `namespace`'s attributes (lists of groups included) to the
    first one of the same backend and ranks, the default group first; returns how many were
    re-pointed. Groups of the same members are interchangeable (torch orders a group's ranks, so
    each member has the same rank in both), and NCCL builds a communicator per group at its first
    collective: megatron builds one group per kind of parallelism, and at one rank each of its
    seven held 2.7 GB of an H200's memory and took 1.9 s to destroy (NCCL 2.28), where one does
    the same work."""
    kept: dict[tuple[str, tuple[int, ...]], dist.ProcessGroup] = {}

    def first_of_its_ranks(group: dist.ProcessGroup) -> dist.ProcessGroup:
        key = (str(dist.get_backend(group)), tuple(dist.get_process_group_ranks(group)))
        return kept.setdefault(key, group)

    first_of_its_ranks(dist.group.WORLD)
    merged = 0
    for name, value in list(vars(namespace).items()):
        if isinstance(value, dist.ProcessGroup):
            chosen = first_of_its_ranks(value)
            if chosen is not value:
                setattr(namespace, name, chosen)
                merged += 1
        elif isinstance(value, list) and value and all(isinstance(g, dist.ProcessGroup) for g in value):
            chosen_groups = [first_of_its_ranks(g) for g in value]
            merged += sum(new is not old for new, old in zip(chosen_groups, value))
            value[:] = chosen_groups
    return merged


def find_process_groups(roots: Iterable[object], *, packages: tuple[str, ...] = ("megatron.",)) -> list[dist.ProcessGroup]:
    """Every process group that `roots` hold (see `repoint_process_groups` for what is walked)."""
    found: dict[int, dist.ProcessGroup] = {}

    def record(group: dist.ProcessGroup) -> dist.ProcessGroup:
        found[id(group)] = group
        return group

    _walk(roots, record, packages)
    return list(found.values())


def repoint_process_groups(
    roots: Iterable[object], old_keys: Mapping[int, GroupKey], new_groups: Mapping[GroupKey, dist.ProcessGroup],
    *, packages: tuple[str, ...] = ("megatron.",),
) -> int:
    """Replace, inside `roots`, each group whose id is in `old_keys` by the group of `new_groups` with
    the same key; returns how many references changed. Walked: lists, tuples, dicts (keys too),
    sets, torch modules and optimizers, and objects of classes from `packages`. A held group with no
    twin is an error; one held where the walk does not go (a slot, a closure) fails at its next
    collective, as any use of a destroyed group does."""

    def replace(group: dist.ProcessGroup) -> dist.ProcessGroup:
        key = old_keys.get(id(group))
        if key is None:
            return group
        if key not in new_groups:
            raise RuntimeError(f"process group {key[0]!r} (ranks {list(key[1])}) was not rebuilt; nothing can replace it")
        return new_groups[key]

    return _walk(roots, replace, packages)


def _walk(roots: Iterable[object], visit_group: Callable[[dist.ProcessGroup], dist.ProcessGroup], packages) -> int:
    """Visit every process group reachable from `roots`, putting back what `visit_group` returns."""
    seen: set[int] = set()
    changed = 0

    def descends(value: object) -> bool:
        return isinstance(value, (torch.nn.Module, torch.optim.Optimizer)) or type(value).__module__.startswith(packages)

    def visit(value):
        nonlocal changed
        if isinstance(value, dist.ProcessGroup):
            new = visit_group(value)
            changed += new is not value
            return new
        if isinstance(value, (torch.Tensor, str, bytes, int, float, bool, type(None))) or id(value) in seen:
            return value
        seen.add(id(value))
        if isinstance(value, list):
            value[:] = [visit(item) for item in value]
        elif isinstance(value, tuple):
            items = [visit(item) for item in value]
            if any(new is not old for new, old in zip(items, value)):
                return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        elif isinstance(value, dict):
            for key in list(value):
                item = value[key]
                new_key, new_item = visit(key), visit(item)
                if new_key is not key:
                    del value[key]
                if new_key is not key or new_item is not item:
                    value[new_key] = new_item
        elif isinstance(value, set):
            items = [visit(item) for item in value]
            value.clear()
            value.update(items)
        elif descends(value) and hasattr(value, "__dict__"):
            for name, item in list(vars(value).items()):
                new = visit(item)
                if new is not item:
                    object.__setattr__(value, name, new)
        return value

    for root in roots:
        visit(root)
    return changed


def _has_peers() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def sum_gradients(parameters: Iterable[torch.nn.Parameter], *, bucket_bytes: int = BUCKET_BYTES) -> None:
    """Replace each trainable parameter's gradient by its sum over the default group's ranks.

    A parameter without a gradient counts as a zero gradient (every rank reduces the same tensors,
    in the same order). A no-op without a default group or with a single rank.
    """
    if not _has_peers():
        return
    params = [p for p in parameters if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    for bucket in _buckets(params, bucket_bytes=bucket_bytes):
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        dist.all_reduce(flat)
        for p, chunk in zip(bucket, flat.split([p.numel() for p in bucket])):
            p.grad.copy_(chunk.view_as(p.grad))


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` summed over the default group's ranks, on `tensor`'s device (a new tensor); `tensor`
    itself without a group or with a single rank. NCCL reduces on the current CUDA device."""
    if not _has_peers():
        return tensor
    on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else tensor.device
    reduced = tensor.to(on, copy=True)
    dist.all_reduce(reduced)
    return reduced.to(tensor.device)


def _buckets(params: list[torch.nn.Parameter], *, bucket_bytes: int) -> list[list[torch.nn.Parameter]]:
    """Consecutive parameters of one dtype and device, at most `bucket_bytes` per bucket (a larger one alone)."""
    buckets: list[list[torch.nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        last = buckets[-1][-1] if buckets else None
        if last is None or size + nbytes > bucket_bytes or (last.dtype, last.device) != (p.dtype, p.device):
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets
