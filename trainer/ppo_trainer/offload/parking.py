"""A training backend's offload: the backend says which tensors it parks, the rest is here.

A backend rank parks two parts, each through a `HostMirror` of its own: its weights (parameters and
gradients) and its optimizer state. `offload` parks both and frees the device; `onload` brings the
weights back, and the optimizer state stays on the host until a pass needs it:
`bring_optimizer_state` gives it its device memory and prepares its copy on `side` (queued in
shares beside a training pass's micro-batches, or at once by `settle`, before a checkpoint is read
or loaded). `offload_optimizer_state` parks it alone, the weights staying on the device (what the
actor does before a weight sync).

The stale-copy rule: a part's host copy is reused, and nothing copied to the host, only while
nothing has written to that part on the device since it last moved. The backend calls `written()`
when a training step or a load writes them; a part parked since (the optimizer state alone,
before a weight sync) does not make the other current, so the trained weights are still copied
at the next offload. `last_transfer` describes the latest move in `HostMirror.last_transfer`'s
terms (an offload of both parts: their sums); a call that moves nothing leaves it as it was.
Must not depend on models, optimizers or the PPO loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ppo_trainer.offload.host_mirror import HostMirror, Put
from ppo_trainer.offload.side_stream import SideStreamCopy


@dataclass
class Parked:
    """The tensors of one part, as its backend lists them while they are on the device (swapped:
    also while they are on the host, to bring them back)."""

    tensors: list[torch.Tensor]
    put: Put | None = None
    """Swapped: `put(index, moved)` swaps the moved copy in for tensor number `index`. None: in place."""
    keep: list[bool] | None = None
    """In place: False for a tensor whose values need not survive (zeroed when it comes back)."""


class _Part:
    def __init__(self, mirror: HostMirror, listing: Callable[[], Parked]):
        self.mirror, self.listing = mirror, listing
        self.changed = True  # since it last moved: nothing is on the host yet

    def back(self) -> tuple:
        """What the mirror takes to bring the part back: swapped, the tensors as they are now and
        their setters; in place, nothing (the mirror holds what it parked)."""
        if self.mirror.in_place:
            return ()
        parked = self.listing()
        return parked.tensors, parked.put


class Parking:
    """One backend rank's weights and optimizer state, on the device or parked in host memory.

    `weights` and `optimizer_state` list each part's tensors (`Parked`), called while they are on
    the device (swapped, also to bring them back); `optimizer_state` is None for a backend without
    an optimizer. `in_place`: tensors are freed and refilled where they are (`HostMirror`)."""

    def __init__(self, *, role: str, device: str | torch.device, weights: Callable[[], Parked],
                 optimizer_state: Callable[[], Parked] | None = None, in_place: bool = False):
        self.role = role
        device = torch.device(device)
        self._weights = _Part(HostMirror(device=device, in_place=in_place), weights)
        self._optimizer = (
            _Part(HostMirror(device=device, in_place=in_place), optimizer_state) if optimizer_state is not None else None
        )
        self.side = SideStreamCopy(device=device)
        """The optimizer state's copy back, beside a training pass: `split`, `advance`, `wait`."""
        self.offloaded = False
        self.optimizer_on_device = True
        self.last_transfer: dict = dict(self._weights.mirror.last_transfer)

    def written(self) -> None:
        """A training step or a load is writing the weights and the optimizer state on the device:
        the host copies of both are stale."""
        for part in self._parts():
            part.changed = True

    def require_on_device(self, what: str) -> None:
        if self.offloaded:
            raise RuntimeError(f"{what}() on an offloaded {self.role} backend; call onload() first")

    def offload(self) -> None:
        """Weights and optimizer state (when on the device) to host memory; no-op when offloaded."""
        if not self.offloaded:
            self._to_host(weights=True)
            self.offloaded = True

    def onload(self) -> None:
        """The weights back on the device; no-op when there. The optimizer state stays parked."""
        if not self.offloaded:
            return
        part = self._weights
        with torch.no_grad():
            part.mirror.to_device(*part.back(), direction="onload")
        part.changed = False
        self.last_transfer = dict(part.mirror.last_transfer)
        self.offloaded = False

    def offload_optimizer_state(self) -> None:
        """The optimizer state alone to host memory, the weights staying; no-op when it is not on the device."""
        if not self.offloaded and self._optimizer is not None and self.optimizer_on_device:
            self._to_host(weights=False)

    def bring_optimizer_state(self) -> None:
        """The optimizer state's device memory, and its copy prepared on `side`; no-op when it is there."""
        part = self._optimizer
        if part is None or self.optimizer_on_device:
            return
        copy = part.mirror.stage_on_device(*part.back())
        if copy is not None:
            self.side.prepare(copy, part.mirror.parked_bytes)
        self.optimizer_on_device = True

    def settle(self) -> None:
        """Wait until the optimizer state's copy back is done (queued now if it was not); its record
        becomes `last_transfer` when there was one."""
        self.last_transfer = self.side.settle(self.last_transfer)

    def _parts(self) -> list[_Part]:
        return [self._weights] + ([self._optimizer] if self._optimizer is not None else [])

    def _to_host(self, *, weights: bool) -> None:
        self.settle()  # a copy still in flight lands before its tensors move
        parts = [self._weights] if weights else []
        if self._optimizer is not None and self.optimizer_on_device:
            parts.append(self._optimizer)
        # Every part listed before any moves: a listing may read where another part's tensors live.
        listed = [(part, part.listing()) for part in parts]
        records = []
        with torch.no_grad():
            for part, parked in listed:
                part.mirror.to_host(parked.tensors, parked.put, keep=parked.keep, direction="offload",
                                    unchanged=not part.changed)
                part.changed = False
                records.append(part.mirror.last_transfer)
        self.optimizer_on_device = False
        self.last_transfer = {key: "offload" if key == "direction" else None if key == "path"
                              else sum(record[key] for record in records) for key in records[0]}
