"""What the trainer's tests read of a role's ranks from inside their processes (Ray's `__ray_call__`).

The product keeps this state to itself; a test reaches it here: each function runs its reader on
every rank of a `RoleGroup` at once (waking a multi-rank role is collective) and returns one
answer per rank. The readers travel by value, so Ray's workers need not import this module.
"""

from __future__ import annotations

import hashlib
import sys

import ray
import torch
from ray import cloudpickle

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _on_every_rank(group, reader) -> list:
    return ray.get([handle.__ray_call__.remote(reader) for handle in group.handles])


def _digest(worker) -> str:
    """A hash of the rank's whole state (model and optimizer): tells whether it changed."""
    digest = hashlib.sha256()

    def visit(prefix: str, value) -> None:
        if isinstance(value, torch.Tensor):
            digest.update(prefix.encode())
            digest.update(value.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(value, dict):
            for key in sorted(value, key=str):
                visit(f"{prefix}.{key}", value[key])
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                visit(f"{prefix}.{i}", item)

    with worker.turn("hash its state"):
        visit("", worker.backend.state_dict())
    return digest.hexdigest()


def weights_digests(group) -> list[str]:
    """Each rank's hash of its model and optimizer state."""
    return _on_every_rank(group, _digest)


def _link_state(worker) -> str | None:
    link = getattr(worker.sender, "link", None)
    return link.state if link is not None else None


def link_states(group) -> list[str | None]:
    """Each actor rank's weight-sync link (Connected, Disconnected; None: a rank that holds none)."""
    return _on_every_rank(group, _link_state)


def _weights(worker) -> dict[str, torch.Tensor]:
    from ppo_trainer.weight_sync.base import drain

    with worker.turn("read weights"):
        weights = worker.backend.named_weights()
        if worker.rank != 0:
            drain(weights)  # gathering shards is collective
            return {}
        return {name: tensor.detach().to("cpu", copy=True) for name, tensor in weights}


def role_weights(group) -> dict[str, torch.Tensor]:
    """A role's weights under Hugging Face names (`named_weights`) as CPU tensors, as rank 0 reads them
    (every rank takes its turn)."""
    return _on_every_rank(group, _weights)[0]


def _record_received(worker) -> None:
    import ppo_trainer.roles.actor as actor_module
    from ppo_trainer.roles.handoff import CriticValues, gather_values

    def recording(outputs, ids):
        values, returns = gather_values(outputs, ids)
        worker.received_values = CriticValues(sample_ids=ids, values=values, returns=returns)
        return values, returns

    worker.received_values = None
    actor_module.gather_values = recording


def record_received_values(group) -> None:
    """From now on each actor rank keeps the critic's values and returns its `train` took, by sample id."""
    _on_every_rank(group, _record_received)


def received_values(group) -> list:
    """The `CriticValues` each actor rank's last `train` took since `record_received_values`."""
    return _on_every_rank(group, lambda worker: worker.received_values)
