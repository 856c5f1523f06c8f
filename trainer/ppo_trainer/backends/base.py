"""The seam between the PPO roles and a training backend (torch today, megatron on GPUs).

A backend owns one rank's model, optimizer and device residency, and the mechanics of forward
and backward passes (micro-batching, gradient accumulation, clipping, the optimizer step). It
knows nothing of PPO: the roles (ppo_trainer/roles) pass it a loss function. Heavy imports
stay inside each backend's own module. One contract test runs against every backend.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from ppo_trainer.batch import RolloutBatch

# loss_fn(model_output, micro_batch_rows) -> (scalar loss, stats). model_output is [b, T]
# per-token log-probs plus entropy for a policy ({"log_probs", "entropy"}), or values for a
# critic ({"values"}); micro_batch_rows indexes the rows of the batch being trained on.
# The loss is the micro-batch's TERM of the whole batch's loss: the terms of every micro-batch of
# every data-parallel rank add up to it (algorithms/aggregation.py), and so do the stats. A
# backend sums the terms' gradients over its micro-batches and over the ranks, so the update is
# the same for any micro-batch size and rank count.
# model_output lives on the backend's device (cuda on GPUs) while the batch stays on CPU: a
# loss_fn moves what it reads from the batch to `model_output[...].device`. The stats are 0-dim
# tensors beside the loss: a backend sums them there and reads them once, after the last
# micro-batch (reading one per micro-batch would wait for the GPU each time).
LossFn = Callable[[dict[str, torch.Tensor], torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]


ROLES = ("actor", "critic", "ref")

VALUE_MODEL_NAMES = {"trunk": "model", "value_head": "score"}
"""A value model's parts -> their names in transformers' <Arch>ForTokenClassification (num_labels=1),
the class its Hugging Face weights load into: the trunk is the causal LM's `model`, the head `score`."""

COMPILED_WIDTH_MULTIPLE = 64
"""Compiled backends pad rows to widths of a multiple of this: few distinct shapes compile."""


KEPT_LOGITS_SHARE = 8
"""A training pass keeps up to 1/8 of its GPU's memory of output-layer logits for the backward
instead of recomputing them (`chunked_log_probs_and_entropy`'s `kept_logits_bytes`): 17 GB on an
H200, where workload A's micro-batch of 64 rows keeps all of its 10 GB. The budget counts the bf16
logits only; the pass's peak grew by about 1.45x that (13.6 GiB for 9.3 GiB, Megatron on an H100)."""


def kept_logits_bytes(device: torch.device) -> int:
    """How many bytes of logits a training pass on `device` keeps (KEPT_LOGITS_SHARE); none on a
    CPU, where the recompute is cheap beside host memory that every process shares."""
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).total_memory // KEPT_LOGITS_SHARE


def check_backend_arguments(
    *, role: str, learning_rate: float, max_grad_norm: float, logits_temperature: float, forward_micro_batch_size: int
) -> None:
    """The constructor arguments every backend shares: a ValueError naming the bad one and the fix."""
    if role not in ROLES:
        raise ValueError(f"role {role!r} is unknown; use one of {', '.join(ROLES)}")
    if role != "ref" and not learning_rate > 0:
        raise ValueError(f"learning_rate must be > 0 for role {role!r}, got {learning_rate}")
    if max_grad_norm < 0:
        raise ValueError(f"max_grad_norm must be >= 0 (0 turns clipping off), got {max_grad_norm}")
    if not logits_temperature > 0:
        raise ValueError(f"logits_temperature must be > 0 (use 1.0 for greedy rollouts), got {logits_temperature}")
    if forward_micro_batch_size < 1:
        raise ValueError(f"forward_micro_batch_size must be >= 1, got {forward_micro_batch_size}")


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU `tensor` on `device`. To a GPU from pinned memory without waiting: a blocking copy waits
    for the device's queued work, and the GPU then idles while the host catches up."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def summed_stats(parts: list[dict[str, torch.Tensor]], device: torch.device) -> tuple[list[str], torch.Tensor]:
    """The micro-batches' loss and stats (`LossFn`) summed key by key in float64: the keys, sorted,
    and the sums in one tensor on `device`, to reduce over the ranks and read once."""
    keys = sorted(parts[0])
    return keys, torch.stack([sum(part[key].detach().double() for part in parts) for key in keys]).to(device)


def cpu_copy(tree: Any) -> Any:
    """A state dict (nested dicts and lists) with every tensor copied to the CPU, for checkpoints."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {key: cpu_copy(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [cpu_copy(value) for value in tree]
    return tree


def load_optimizer_moments(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """Load a saved optimizer state's moments and step counts while keeping this optimizer's own
    hyperparameters (lr, betas, eps, weight decay...): they come from the spec this run was started
    with, which must win over the ones the checkpoint was written with."""
    configured = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
    optimizer.load_state_dict(saved)
    for group, settings in zip(optimizer.param_groups, configured):
        group.update(settings)


class TrainBackend(Protocol):
    """One rank of a policy (actor, reference) or value model (critic)."""

    is_value_model: bool

    def forward(self, batch: RolloutBatch, *, with_entropy: bool = False) -> dict[str, torch.Tensor]:
        """No-grad pass over the whole batch: {"log_probs": [B, T]} (+"entropy") or {"values": [B, T]},
        float32 on CPU."""
        ...

    def train(self, batch: RolloutBatch, loss_fn: LossFn, *, micro_batch_size: int) -> dict[str, float]:
        """One optimizer step on the sum of loss_fn's terms over the micro-batches and the data-parallel
        ranks; returns "loss" and loss_fn's stats summed the same way (the whole batch's, on every
        rank), "grad_norm" and "skipped"."""
        ...

    def offload(self) -> None:
        """Move parameters, gradients and optimizer state to host memory and free the device."""
        ...

    def onload(self) -> None:
        """Bring the parameters back to the device (the optimizer state may follow when `train`
        needs it); every pass works after it."""
        ...

    def offload_optimizer_state(self) -> None:
        """Move the optimizer state to host memory, the parameters staying on the device (all a
        weight sync after a training pass reads); the next `train` brings it back."""
        ...

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights under Hugging Face names (collective: every rank of the role calls it): a
        policy's as its causal LM's, the names a rollout engine expects; a value model's as a token
        classifier's with one label (`VALUE_MODEL_NAMES`), as `export.py` writes it."""
        ...

    def state_dict(self) -> dict:
        """Model and optimizer state, on CPU, for a checkpoint."""
        ...

    def load_state_dict(self, state: dict) -> None: ...

    def attach_process_groups(self) -> None:
        """After the role's process group is (re)built: take up the groups the backend uses inside it
        (Megatron's model-parallel groups); a no-op for a backend that uses the default group as is."""
        ...

    def release_process_groups(self) -> None:
        """Before the role's process group is destroyed: let go of those groups (a no-op where none)."""
        ...
