"""The torch training backend: one rank's model, AdamW optimizer and device residency.

It implements `TrainBackend` with plain PyTorch on any device (cpu here, cuda on GPUs):
micro-batched forward passes over the RolloutBatch layout, gradient accumulation, grad-norm
clipping, one optimizer step per `train` call, and offload/onload of its parameters, gradients and
optimizer state, each swapped for a view of a pinned host buffer (`offload/parking.py` does the
moving: the optimizer state back only when `train` needs it, in shares beside its micro-batches;
nothing that did not change since the onload back to the host). With
several data-parallel ranks (torch.distributed's default group, which roles/base.py builds while
the role is awake) the accumulated gradients are summed over the ranks before clipping (each
micro-batch's loss is its term of the whole batch's loss), so the ranks take identical steps,
the step of one rank on the whole batch. It knows no PPO: the loss comes from the caller. Must
not depend on Ray or the PPO loop, nor build process groups itself.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from ppo_trainer.algorithms.ppo import chunked_log_probs_and_entropy
from ppo_trainer.backends.base import (
    COMPILED_WIDTH_MULTIPLE,
    VALUE_MODEL_NAMES,
    LossFn,
    check_backend_arguments,
    cpu_copy,
    kept_logits_bytes,
    load_optimizer_moments,
    summed_stats,
    to_device,
)
from ppo_trainer.batch import RolloutBatch
from ppo_trainer.distributed import all_reduce_sum, sum_gradients
from ppo_trainer.models.builtin import build_policy, build_value_model, resolve_dtype
from ppo_trainer.offload.parking import Parked, Parking
from ppo_trainer.rollout.layout import aligned_rows
from ppojob_api.spec import ModelSpec


class TorchBackend:
    """One rank of an actor, critic or reference model. A "ref" backend has no optimizer.

    `logits_temperature` divides the policy's logits before log-probs and entropy, so that they
    describe the same distribution the rollout engine sampled from (its `temperature`).
    `forward_micro_batch_size` bounds the rows of one no-grad pass in `forward`.
    `compile` runs each decoder layer and the output layer's log-softmax and entropy through
    `torch.compile` (fused norms, rotary, activations and softmax); rows are then padded to widths
    of a multiple of 64, so that few shapes compile. Layer by layer rather than the whole trunk:
    the layers are alike, so one layer's graph serves them all (compiled once, cached once), where
    the whole trunk's graph is as many times larger as there are layers.
    """

    def __init__(
        self,
        *,
        model_spec: ModelSpec,
        role: str,
        learning_rate: float,
        max_grad_norm: float,
        device: str | torch.device,
        seed: int,
        dtype: str | torch.dtype | None = None,
        weight_decay: float = 0.0,
        logits_temperature: float = 1.0,
        forward_micro_batch_size: int = 16,
        compile: bool = False,
    ):
        check_backend_arguments(
            role=role, learning_rate=learning_rate, max_grad_norm=max_grad_norm,
            logits_temperature=logits_temperature, forward_micro_batch_size=forward_micro_batch_size,
        )
        self.role = role
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype if dtype is not None else model_spec.dtype)
        self.max_grad_norm = max_grad_norm
        self.logits_temperature = logits_temperature
        self.forward_micro_batch_size = forward_micro_batch_size
        self.is_value_model = role == "critic"
        if self.is_value_model:
            self.model: torch.nn.Module = build_value_model(
                model_spec, seed=seed, device=self.device, dtype=self.dtype
            )
        else:
            self.model = build_policy(model_spec, seed=seed, device=self.device, dtype=self.dtype)
        self.compile = compile
        self.kept_logits_bytes = kept_logits_bytes(self.device)
        self.width_multiple = COMPILED_WIDTH_MULTIPLE if compile else 1
        if compile:
            for layer in (self.model.trunk if self.is_value_model else self.model.get_decoder()).layers:
                layer.compile()
        self.optimizer: torch.optim.Optimizer | None = None
        if role == "ref":
            self.model.requires_grad_(False).eval()
        else:
            self.optimizer = torch.optim.AdamW(
                self.model.parameters(),
                lr=learning_rate,
                weight_decay=weight_decay,
                fused=self.device.type == "cuda",
            )
        self._parking = Parking(role=role, device=self.device, weights=self._parked_weights,
                                optimizer_state=self._parked_optimizer_state if self.optimizer is not None else None)

    @property
    def offloaded(self) -> bool:
        return self._parking.offloaded

    @property
    def last_transfer(self) -> dict[str, Any]:
        """The latest move to or from host memory (`HostMirror.last_transfer`)."""
        return self._parking.last_transfer

    # ----- passes -----------------------------------------------------------------------------

    def forward(self, batch: RolloutBatch, *, with_entropy: bool = False) -> dict[str, torch.Tensor]:
        """No-grad pass: {"log_probs"[, "entropy"]} or {"values"}, [B, T] float32 on CPU, 0 on padding.

        Column t is about response token t: its log-prob given the prefix, or the value of the
        state before it (the hidden state at position P+t-1).
        """
        self._require_on_device("forward")
        was_training = self.model.training
        self.model.eval()
        parts: dict[str, list[torch.Tensor]] = {}
        with torch.no_grad():
            for rows in torch.arange(batch.size).split(self.forward_micro_batch_size):
                for key, value in self._outputs(batch, rows, with_entropy=with_entropy).items():
                    parts.setdefault(key, []).append(value.float())
        self.model.train(was_training)
        # One copy to the host after the last micro-batch: a copy per micro-batch would wait for each.
        return {key: torch.cat(chunks).cpu() for key, chunks in parts.items()}

    def train(self, batch: RolloutBatch, loss_fn: LossFn, *, micro_batch_size: int) -> dict[str, float]:
        """One optimizer step on the sum of loss_fn's terms over the micro-batches and the ranks.

        loss_fn receives this backend's outputs for the micro-batch ([b, T], on the backend's
        device; policies get "log_probs" and "entropy") and the batch row indices, and returns the
        micro-batch's term of the whole batch's loss (`LossFn`). With several data-parallel ranks
        (each rank's `batch` is its shard) the gradients are summed over them. Returns "loss" and
        loss_fn's stats summed over the micro-batches and the ranks, plus "grad_norm" (before
        clipping) and "skipped" (1.0 when a non-finite gradient norm skipped the step).
        """
        self._require_on_device("train")
        if self.optimizer is None:
            raise ValueError(f"the {self.role!r} backend has no optimizer; only actor and critic train")
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        self.model.train()
        self._parking.written()
        self._parking.bring_optimizer_state()
        self.optimizer.zero_grad(set_to_none=True)
        parts: list[dict[str, torch.Tensor]] = []
        micro_batches = torch.arange(batch.size).split(micro_batch_size)
        self._parking.side.split(len(micro_batches))
        for rows in micro_batches:
            loss, stats = loss_fn(self._outputs(batch, rows, with_entropy=not self.is_value_model), rows)
            # The optimizer state's copy in parts beside the last micro-batches' backward passes,
            # each queued after the micro-batch's own host-to-device copies (the same copy engine).
            self._parking.side.advance()
            loss.backward()
            parts.append({"loss": loss.detach(), **stats})
        sum_gradients(self.model.parameters())
        max_norm = self.max_grad_norm if self.max_grad_norm > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        finite = math.isfinite(grad_norm)
        if finite:
            self._parking.side.wait()
            self.optimizer.step()
        self._parking.settle()
        self.optimizer.zero_grad(set_to_none=True)
        keys, summed = summed_stats(parts, torch.device("cpu"))
        summed = all_reduce_sum(summed)
        return {**dict(zip(keys, summed.tolist())), "grad_norm": grad_norm, "skipped": 0.0 if finite else 1.0}

    def _outputs(
        self, batch: RolloutBatch, rows: torch.Tensor, *, with_entropy: bool
    ) -> dict[str, torch.Tensor]:
        """Model outputs for `rows`, [b, T], zero where the response mask is 0.

        Rows go in aligned (`aligned_rows`): plain causal attention, no padding mask.
        """
        t = batch.response_length
        aligned = aligned_rows(batch, rows, width_multiple=self.width_multiple)
        input_ids = to_device(aligned.input_ids, self.device)
        at = to_device(aligned.predict_at, self.device)
        if self.is_value_model:
            outputs = {"values": self.model(input_ids=input_ids).gather(1, at).float()}
        else:
            # Hidden states of the positions that predict real response tokens only; the output
            # layer, log-softmax and entropy run over them in chunks (no [b, T, V] logits).
            hidden = self.model.get_decoder()(input_ids=input_ids, use_cache=False).last_hidden_state
            hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, to_device(aligned.real_outputs(), self.device))
            real = to_device(aligned.real, self.device)
            head = self.model.get_output_embeddings()
            log_probs, entropy = chunked_log_probs_and_entropy(
                hidden, head.weight, to_device(aligned.targets[aligned.real], self.device), bias=head.bias,
                temperature=self.logits_temperature, with_entropy=with_entropy, compiled=self.compile,
                kept_logits_bytes=self.kept_logits_bytes,
            )
            zeros = torch.zeros(real.shape, dtype=torch.float32, device=self.device)
            outputs = {"log_probs": zeros.masked_scatter(real, log_probs)}
            if with_entropy:
                outputs["entropy"] = zeros.masked_scatter(real, entropy)
        mask = to_device(batch.response_mask[rows], self.device).bool()
        return {
            key: torch.where(mask, F.pad(value, (0, t - aligned.kept)), torch.zeros((), device=self.device))
            for key, value in outputs.items()
        }

    # ----- residency ---------------------------------------------------------------------------

    def offload(self) -> None:
        """Parameters, gradients and optimizer state to host memory (pinned for CUDA); no-op when
        already offloaded. On a CPU device the host copy is the tensor itself: nothing moves. After
        a turn that changed nothing (no `train`, no `load_state_dict` since the onload: a log-probs
        pass, the reference) the host copies still hold the values: nothing is copied, the device
        memory is only freed."""
        self._parking.offload()

    def onload(self) -> None:
        """Parameters back to the device; no-op when already there. The optimizer state follows
        when `train` needs it, its copy in shares beside the micro-batches (a pass that only reads, such
        as the log-probs, never moves it)."""
        self._parking.onload()

    def offload_optimizer_state(self) -> None:
        """The optimizer state to host memory, the parameters and gradients staying on the device;
        no-op when it is not there."""
        self._parking.offload_optimizer_state()

    def _parked_weights(self) -> Parked:
        """The parameters and gradients an offload moves, each swapped for its moved copy. Built in
        a function of its own so that no loop variable outlives it: one left holding a device view
        would keep the whole device buffer alive past the mirror's release."""
        tensors, setters = [], []
        for param in self.model.parameters():
            tensors.append(param.data)
            setters.append(lambda t, p=param: setattr(p, "data", t))
            if param.grad is not None:
                tensors.append(param.grad)
                setters.append(lambda t, p=param: setattr(p, "grad", t))
        return Parked(tensors, put=lambda index, moved: setters[index](moved))

    def _parked_optimizer_state(self) -> Parked:
        """The optimizer state's tensors, each swapped for its moved copy (see `_parked_weights`)."""
        tensors, setters = [], []
        for param in self.model.parameters():
            state = self.optimizer.state.get(param, {})
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    tensors.append(value)
                    setters.append(lambda t, s=state, k=key: s.__setitem__(k, t))
        return Parked(tensors, put=lambda index, moved: setters[index](moved))

    def _require_on_device(self, what: str) -> None:
        self._parking.require_on_device(what)

    def attach_process_groups(self) -> None:
        """Nothing to take up: data parallelism sums gradients over the default group as it is."""

    def release_process_groups(self) -> None:
        """Nothing to let go of (see `attach_process_groups`)."""

    # ----- weights and checkpoints --------------------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The parameters under their Hugging Face names (live tensors, not copies); a value model's
        trunk under `model.` and its head as `score` (`VALUE_MODEL_NAMES`)."""
        for name, param in self.model.named_parameters():
            if self.is_value_model:
                prefix, rest = name.split(".", 1)
                name = f"{VALUE_MODEL_NAMES[prefix]}.{rest}"
            yield name, param.detach()

    def state_dict(self) -> dict:
        """{"model": ..., "optimizer": ... or None}, every tensor a CPU copy."""
        self._parking.bring_optimizer_state()
        self._parking.settle()
        model = {key: value.detach().to("cpu", copy=True) for key, value in self.model.state_dict().items()}
        optimizer = cpu_copy(self.optimizer.state_dict()) if self.optimizer is not None else None
        return {"model": model, "optimizer": optimizer}

    def load_state_dict(self, state: dict) -> None:
        """Load a `state_dict()` while on the device; a "ref" backend ignores the optimizer part."""
        self._require_on_device("load_state_dict")
        if "model" not in state:
            raise ValueError("state has no 'model' entry; pass what TorchBackend.state_dict() returned")
        self._parking.written()
        self._parking.bring_optimizer_state()
        self._parking.settle()
        self.model.load_state_dict(state["model"])
        if self.optimizer is not None and state.get("optimizer") is not None:
            load_optimizer_moments(self.optimizer, state["optimizer"])

