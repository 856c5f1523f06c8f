"""Colocated weight sync on a GPU: the actor's weights handed to the engine on the same device by CUDA IPC.

An actor rank and the rollout engine that share its GPU are two processes. Sending the weights
through Ray's object store copies them to host memory and back (about a gigabyte per step for a
0.5B model in bf16, seconds at the object store's rates). Instead the actor shares its tensors'
device memory (torch's CUDA IPC handles: a few hundred bytes each, pickled through Ray) and the
engine copies them device to device. The actor keeps the tensors alive, and itself awake, until
the engine has copied them: `share_weights`, the engine's copy, then the actor lets go. Depends on
torch only (no Ray, no model); CUDA only.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import reduce_tensor


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
