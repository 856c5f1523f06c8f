"""The CUDA IPC path (Colocate, Torch engines on GPUs): each actor rank hands its weights to the engine on its GPU.

An actor rank and the rollout engine that share its GPU are two processes. Sending the weights
through Ray's object store copies them to host memory and back (about a gigabyte per step for a
0.5B model in bf16, seconds at the object store's rates). Instead every actor rank shares its
tensors' device memory (torch's CUDA IPC handles: a few hundred bytes each, pickled through Ray)
with the engine on its GPU (rank i's, engine i: placement puts them in one bundle), which copies
them device to device. The sender keeps the tensors alive, and its rank awake, until the engine
has copied them, then lets go (`torch.cuda.ipc_collect`) before the rank may sleep. CUDA only;
Ray is imported only where one end calls the other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import reduce_tensor

from ppo_trainer.offload import Listener
from ppo_trainer.weight_sync.base import NamedWeights, Sender, WeightSyncPath

NAME = "cuda_ipc"


def device_uuid(device: str | torch.device) -> str:
    """The GPU's UUID: the same physical device whatever index a process sees it under."""
    return str(torch.cuda.get_device_properties(torch.device(device)).uuid)


@dataclass(frozen=True)
class SharedWeights:
    """Handles to one process's device tensors, to be opened by another process on the same GPU."""

    device_uuid: str
    handles: list[tuple[str, tuple[Any, tuple]]]
    """(name, (rebuild function, its arguments)) per tensor, as torch.multiprocessing pickles CUDA tensors."""


def share_weights(named_tensors: Iterable[tuple[str, torch.Tensor]], device: str | torch.device) -> tuple[
    SharedWeights, list[torch.Tensor]
]:
    """Handles to the tensors, and the tensors themselves: the caller keeps them alive until the
    receiver has copied them (the handles point into their memory)."""
    kept, handles = [], []
    for name, tensor in named_tensors:
        if tensor.device.type != "cuda":
            raise ValueError(f"{name} is on {tensor.device}; CUDA IPC shares CUDA tensors only")
        tensor = tensor.detach()
        kept.append(tensor)
        handles.append((name, reduce_tensor(tensor)))
    return SharedWeights(device_uuid(device), handles), kept


def open_shared_weights(shared: SharedWeights, device: str | torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) views of the sharing process's memory, one at a time; copy each and let it go."""
    mine = device_uuid(device)
    if shared.device_uuid != mine:
        raise RuntimeError(
            f"weights shared on GPU {shared.device_uuid} cannot be opened on GPU {mine}: CUDA IPC needs the actor "
            "rank and its colocated engine on the same device (placement Colocate puts them in one bundle)"
        )
    for name, (rebuild, args) in shared.handles:
        yield name, rebuild(*args)


class CudaIpcSender(Sender):
    """An actor rank's end: share, let the engine on this GPU copy, let go."""

    def __init__(self, engine: Any, device: str) -> None:
        self.engine = engine
        self.device = device

    def send(self, named_weights: NamedWeights) -> None:
        import ray

        shared, kept = share_weights(named_weights, self.device)
        try:
            ray.get(self.engine.receive_weights.remote(shared))
        finally:
            del kept
            torch.cuda.ipc_collect()  # memory the engine held open goes back before the offload frees it


class CudaIpcReceiver:
    """A rollout worker's end: wake, copy the actor rank's weights straight from its device memory;
    done (synchronized, views dropped) when `receive` returns, so the actor may free them."""

    def __init__(self, *, engine: Any, device: str, wake: Callable[[], Any]) -> None:
        self.engine, self.device, self.wake = engine, device, wake

    def receive(self, shared: SharedWeights) -> None:
        self.wake()
        self.engine.update_weights(open_shared_weights(shared, self.device))
        torch.cuda.synchronize()


class CudaIpc(WeightSyncPath):
    name = NAME

    def sender(self, *, rank: int, device: str, engines: list[Any], listener: Listener) -> Sender:
        if rank >= len(engines):
            raise ValueError(
                f"CUDA IPC: actor rank {rank} has no engine on its GPU ({len(engines)} engines); "
                "leave actor.parallelism.data unset"
            )
        return CudaIpcSender(engines[rank], device)

    def receiver(self, *, engine: Any, device: str, wake: Callable[[], Any]) -> CudaIpcReceiver:
        return CudaIpcReceiver(engine=engine, device=device, wake=wake)

    def sync(self, *, actor, rollout) -> None:
        actor.call(actor.worker_class.send_weights)  # every rank: share, its engine copies, let go
