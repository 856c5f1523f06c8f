"""Moving tensors between an accelerator and reusable pinned host buffers, and back.

Offload (training backends) and sleep (rollout engines) both park tensors in host memory and
bring them back. Pinned buffers are allocated once per tensor and reused, since pinning costs
far more than copying. On a CPU device the host copy is the tensor itself and nothing moves.
Must not depend on models, optimizers or the PPO loop: callers decide which tensors to move.
"""

from __future__ import annotations

import time
from collections.abc import Hashable

import torch


class HostMirror:
    """Pinned host buffers for one device, keyed by the caller; counts bytes and time per transfer."""

    def __init__(self, *, device: str | torch.device):
        self.device = torch.device(device)
        self._buffers: dict[Hashable, torch.Tensor] = {}
        self._bytes = 0
        self._started = 0.0

    def begin(self) -> None:
        self._bytes = 0
        self._started = time.perf_counter()

    def end(self, *, direction: str) -> dict:
        """Wait for the copies; after an offload give the freed device memory back to the driver.

        Returns {"direction", "bytes", "seconds"} for the transfer since `begin`.
        """
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            if direction in ("offload", "sleep"):
                torch.cuda.empty_cache()
        return {"direction": direction, "bytes": self._bytes, "seconds": time.perf_counter() - self._started}

    def to_host(self, key: Hashable, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor's host copy; tensors already on the host stay as they are."""
        if self.device.type == "cpu" or tensor.device.type == "cpu":
            return tensor
        host = self._buffers.get(key)
        if host is None or host.shape != tensor.shape or host.dtype != tensor.dtype:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._buffers[key] = host
        host.copy_(tensor, non_blocking=True)
        self._bytes += tensor.nbytes
        return host

    def to_device(self, key: Hashable, tensor: torch.Tensor) -> torch.Tensor:
        """Back on the device, if `to_host` parked it under `key`; anything else stays put
        (tensors that live on the host for good, such as AdamW's unfused `step` counters)."""
        host = self._buffers.get(key)
        if self.device.type == "cpu" or host is None or tensor.data_ptr() != host.data_ptr():
            return tensor
        self._bytes += tensor.nbytes
        return tensor.to(self.device, non_blocking=True)
