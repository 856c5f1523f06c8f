"""The megatron-core training backend: one rank's GPTModel, distributed optimizer and device residency.

It implements `TrainBackend` with megatron-core's GPTModel (local layer spec: no Transformer
Engine or Apex; attention through torch's fused kernels, `attention.py`), built from a Hugging
Face Llama/Qwen2 config and loaded from its checkpoint directory when there is one; bf16 wrapped
in `Float16Module`; megatron's
DistributedDataParallel (flat bf16 parameter and fp32 gradient buffers) and its distributed
optimizer (fp32 main parameters, Adam moments). The critic is the same GPTModel with a
[hidden -> 1] value head in place of the output layer. Rows are re-laid out for megatron: each
row's real tokens (left-padded prompt, right-padded response) are moved to start at column 0,
so plain causal attention needs no padding mask and RoPE positions count real tokens. With
tensor parallel 1, policy passes take the final hidden states and run the output layer,
log-softmax and entropy only on positions of real response tokens, in chunks.

Offload (`offload/parking.py`, in place) parks the parameter buffers, the fp32 main parameters
and the Adam moments in pinned host buffers (allocated once, reused) and frees the device storage
where it is, so every view into a buffer (parameters, optimizer shards) stays valid; the gradient
buffers are freed without a copy, since `train` zeroes them before use, and nothing is copied that
did not change since the onload. Onload brings the parameters; the optimizer state comes back when `train` needs it, its
copy on a side stream in shares beside the micro-batches. Runs on CUDA only (megatron's RNG tracker and
buffers). Written against the API megatron-core 0.16.1 and 0.19.2 share.

Tensor and pipeline parallelism follow the spec: weights are sharded and staged on load and
gathered for export. Every pass, pipelined or not, runs through megatron's forward-backward
schedule (1F1B over the micro-batches when pipelined), and what the last stage computes
(log-probs, values, loss statistics) is broadcast to the other stages, so every rank returns the
same. When the role's process group is destroyed around a sleep, `release_process_groups` and
`attach_process_groups` take megatron's groups down and up with it, re-pointing the references
the layers, DDP buckets and optimizer keep. The loss is normalised as in the Torch backend: each
micro-batch's term of the whole batch's loss (`LossFn`), the terms' gradients summed over the
micro-batches and the data-parallel ranks. Must not depend on Ray or the PPO loop.
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module

from ppo_trainer.algorithms import entropy_from_logits, log_probs_from_logits
from ppo_trainer.algorithms.ppo import chunked_log_probs_and_entropy
from ppo_trainer.backends.base import (
    COMPILED_WIDTH_MULTIPLE,
    LossFn,
    check_backend_arguments,
    cpu_copy,
    kept_logits_bytes,
    load_optimizer_moments,
    summed_stats,
    to_device,
)
from ppo_trainer.backends.megatron import conversion
from ppo_trainer.backends.megatron.attention import layer_spec
from ppo_trainer.backends.megatron.config import gpt_model_kwargs, transformer_config_kwargs
from ppo_trainer.backends.megatron.fused_layer import fuse_layers
from ppo_trainer.batch import RolloutBatch
from ppo_trainer.distributed import (
    GroupKey,
    find_process_groups,
    group_key,
    merge_groups_of_the_same_ranks,
    repoint_process_groups,
)
from ppo_trainer.models.builtin import builtin_config, resolve_dtype, resolve_model_dir
from ppo_trainer.offload.parking import Parked, Parking
from ppo_trainer.rollout.layout import aligned_rows
from ppojob_api.spec import ModelSpec


def ensure_parallel_state(*, tensor: int, pipeline: int, seed: int | None) -> None:
    """torch.distributed (NCCL) and megatron's model-parallel groups, when the process has none yet.

    The default group is the caller's when it exists (a role's `RoleProcessGroup`), else built from
    a launcher's MASTER_ADDR/RANK/WORLD_SIZE when set, else a world of one. `seed` seeds megatron's
    CUDA RNG tracker (None: leave it, as when groups are rebuilt after a sleep).
    """
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group("nccl")
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=1, rank=0)
    if parallel_state.model_parallel_is_initialized():
        have = (parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_world_size())
        if have != (tensor, pipeline):
            raise ValueError(f"this process already runs (tensor, pipeline) parallel sizes {have}; a backend asked for"
                             f" {(tensor, pipeline)}")
    else:
        # Model-parallel ranks are contiguous (tensor first, then pipeline), data-parallel outermost:
        # the layout RoleWorker's data_rank assumes.
        # No gloo twins of the groups: they serve megatron's own checkpoint gathers, which this backend
        # does not use (`state_dict`), and every group is rebuilt and destroyed around each sleep.
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor, pipeline_model_parallel_size=pipeline, order="tp-cp-ep-pp-dp",
            create_gloo_process_groups=False,
        )
        merge_groups_of_the_same_ranks(parallel_state)  # one communicator per set of ranks, not per kind
    if seed is not None:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def megatron_process_groups() -> dict[GroupKey, dist.ProcessGroup]:
    """The groups megatron's parallel state holds now (and the default one), by `group_key`.
    Two groups of the same name and ranks would be interchangeable: the first is kept."""
    found: dict[GroupKey, dist.ProcessGroup] = {}
    for value in [dist.group.WORLD, *vars(parallel_state).values()]:
        for group in value if isinstance(value, list) else [value]:
            if isinstance(group, dist.ProcessGroup):
                found.setdefault(group_key(group), group)
    return found


class ValueHead(torch.nn.Module):
    """Linear(hidden, 1) with a bias, called the way GPTModel calls its output layer."""

    sequence_parallel = False

    def __init__(self, hidden: int, *, seed: int, device: torch.device, dtype: torch.dtype):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.empty(1, hidden).normal_(0.0, 0.02, generator=generator).to(device, dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, device=device, dtype=dtype))

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None):
        return F.linear(hidden, self.weight, self.bias), None


def read_hf_state(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face checkpoint directory (safetensors), on CPU."""
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{directory} holds no *.safetensors files; save the model with save_pretrained")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    return state


@contextmanager
def _hidden_states_out(layer: torch.nn.Module) -> Iterator[dict]:
    """While open, GPTModel's output layer passes the final hidden states through unchanged and
    records the weight it would have used (the tied embedding or its own) in the yielded dict."""
    used: dict = {}

    def passthrough(hidden, weight=None, **_):
        used["weight"] = weight if weight is not None else layer.weight
        return hidden, None

    layer.forward = passthrough
    try:
        yield used
    finally:
        del layer.forward


class MegatronBackend:
    """One rank of an actor, critic or reference model on megatron-core. A "ref" backend has no optimizer.

    Same constructor arguments as TorchBackend, plus `tensor_parallel` and `pipeline_parallel`
    (the spec's parallelism). `device` must be a CUDA device. `compile` runs the output layer's
    log-softmax and entropy through torch.compile and, at tensor parallel 1, every decoder layer
    as one compiled function of its weights (`fused_layer.py`; rows are then padded to widths of a
    multiple of 64, so that few shapes compile); under tensor parallelism the layers stay megatron's own.
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
        tensor_parallel: int = 1,
        pipeline_parallel: int = 1,
        compile: bool = False,
    ):
        check_backend_arguments(
            role=role, learning_rate=learning_rate, max_grad_norm=max_grad_norm,
            logits_temperature=logits_temperature, forward_micro_batch_size=forward_micro_batch_size,
        )
        if torch.device(device).type != "cuda" or not torch.cuda.is_available():
            raise ValueError(f"the megatron backend needs a CUDA device (got {device!r}); use the Torch backend on CPUs")
        self.role = role
        self.is_value_model = role == "critic"
        self.dtype = resolve_dtype(dtype if dtype is not None else model_spec.dtype)
        self.half = self.dtype in (torch.bfloat16, torch.float16)
        self.logits_temperature = logits_temperature
        self.forward_micro_batch_size = forward_micro_batch_size
        self.compile = compile
        ensure_parallel_state(tensor=tensor_parallel, pipeline=pipeline_parallel, seed=seed)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.kept_logits_bytes = kept_logits_bytes(self.device)
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.tp_size = tensor_parallel
        self.pp_rank, self.pp_size = parallel_state.get_pipeline_model_parallel_rank(), pipeline_parallel
        self.first_stage, self.last_stage = self.pp_rank == 0, self.pp_rank == pipeline_parallel - 1

        directory = resolve_model_dir(model_spec.path)
        if directory is None:
            hf_config = builtin_config(model_spec.path)
        else:
            from transformers import AutoConfig

            hf_config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
        if hf_config.vocab_size % tensor_parallel:
            raise ValueError(
                f"the model's vocabulary ({hf_config.vocab_size} tokens) does not split evenly over"
                f" {role}'s parallelism.tensor={tensor_parallel} (actor.parallelism or critic.parallelism): pad it to a multiple (resize_token_embeddings)"
                " or choose a tensor-parallel size that divides it"
            )
        self.shape = conversion.Shape.from_hf_config(hf_config, value_head=self.is_value_model)
        self.layers = conversion.stage_layers(hf_config.num_hidden_layers, stage=self.pp_rank, stages=pipeline_parallel)
        self.config = TransformerConfig(
            **transformer_config_kwargs(hf_config, tensor=tensor_parallel, pipeline=pipeline_parallel, dtype=self.dtype),
            activation_func=F.silu,
        )
        torch.manual_seed(seed)
        self.gpt = GPTModel(
            config=self.config,
            transformer_layer_spec=layer_spec(),
            pre_process=self.first_stage,
            post_process=self.last_stage,
            **gpt_model_kwargs(hf_config, value_head=self.is_value_model),
        )
        if self.is_value_model and self.last_stage:
            self.gpt.output_layer = ValueHead(hf_config.hidden_size, seed=seed, device=self.device, dtype=torch.float32)
        fused = compile and tensor_parallel == 1
        if fused:
            fuse_layers(self.gpt.decoder.layers)
        self.width_multiple = COMPILED_WIDTH_MULTIPLE if fused else 1
        self.gpt.to(self.device)  # torch-norm fallbacks are built on the CPU
        if directory is not None:
            self._load_hf(directory)
        module = Float16Module(self.config, self.gpt) if self.half else self.gpt
        self.optimizer = None
        self._held_groups: dict[int, GroupKey] = {}
        self._parking = Parking(role=role, device=self.device, weights=self._parked_weights, in_place=True,
                                optimizer_state=None if role == "ref" else self._parked_optimizer_state)
        if role == "ref":
            self.model = module.requires_grad_(False).eval()
            return
        self.model = DistributedDataParallel(
            config=self.config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True
            ),
            module=module,
        )
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=learning_rate,
                weight_decay=weight_decay,
                bf16=self.dtype == torch.bfloat16,
                fp16=self.dtype == torch.float16,
                params_dtype=self.dtype,
                use_distributed_optimizer=True,
                clip_grad=max_grad_norm,
            ),
            [self.model],
            use_gloo_process_groups=False,
        )

    def _load_hf(self, directory: Path) -> None:
        """Weights of a Hugging Face checkpoint directory, converted, staged and sliced for this rank."""
        full = conversion.hf_to_megatron(read_hf_state(directory), self.shape)
        staged = conversion.to_stage(full, self.shape, layers=self.layers, first=self.first_stage, last=self.last_stage)
        local = {name: conversion.shard(name, t, self.shape, rank=self.tp_rank, size=self.tp_size) for name, t in staged.items()}
        missing, unexpected = self.gpt.load_state_dict(local, strict=False)
        missing = [n for n in missing if not n.endswith("_extra_state") and not (self.is_value_model and n.startswith("output_layer."))]
        if missing or unexpected:
            raise ValueError(f"checkpoint {directory} does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")

    # ----- passes -----------------------------------------------------------------------------

    def forward(self, batch: RolloutBatch, *, with_entropy: bool = False) -> dict[str, torch.Tensor]:
        """No-grad pass: {"log_probs"[, "entropy"]} or {"values"}, [B, T] float32 on CPU, 0 on padding."""
        self._require_on_device("forward")
        self.model.eval()
        with torch.no_grad():
            parts = self._schedule(batch, self.forward_micro_batch_size, lambda outputs, rows: outputs,
                                   with_entropy=with_entropy, forward_only=True)
            keys = ["values"] if self.is_value_model else ["log_probs", *(["entropy"] if with_entropy else [])]
            shape = (batch.size, batch.response_length)
            outputs = {key: torch.cat([part[key] for part in parts]) if self.last_stage
                       else torch.empty(shape, dtype=torch.float32, device=self.device) for key in keys}
            if self.pp_size > 1:
                for key in keys:
                    dist.broadcast(outputs[key], src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                   group=parallel_state.get_pipeline_model_parallel_group())
        return {key: value.cpu() for key, value in outputs.items()}

    def train(self, batch: RolloutBatch, loss_fn: LossFn, *, micro_batch_size: int) -> dict[str, float]:
        """One optimizer step on the sum of loss_fn's terms over the micro-batches and the data-parallel
        ranks (`LossFn`); "loss" and the stats summed the same way, on every rank."""
        self._require_on_device("train")
        if self.optimizer is None:
            raise ValueError(f"the {self.role!r} backend has no optimizer; only actor and critic train")
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        self.model.train()
        self._parking.written()
        self._parking.bring_optimizer_state()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        micro_batches = math.ceil(batch.size / micro_batch_size)
        data_parallel = parallel_state.get_data_parallel_world_size()

        def term(outputs: dict[str, torch.Tensor], rows: torch.Tensor):
            # The schedule divides each micro-batch's loss by their count and DDP averages the
            # gradients over the data-parallel ranks: undo both, so that the terms add up.
            loss, stats = loss_fn(outputs, rows)
            return loss * (micro_batches * data_parallel), {"loss": loss.detach(), **stats}

        # The optimizer state's copy in parts beside the last micro-batches, each queued after the
        # micro-batch's forward pass and before its outputs' host-to-device copies (the same copy
        # engine), which wait for it while the forward pass runs.
        self._parking.side.split(micro_batches)
        parts = self._schedule(batch, micro_batch_size, term, with_entropy=not self.is_value_model,
                               forward_only=False, after_forward=self._parking.side.advance)
        finalize_model_grads([self.model])  # data-parallel reduce; the two copies of a tied embedding summed
        totals: dict[str, float] = {}
        if self.last_stage:
            keys, summed = summed_stats(parts, self.device)
            dist.all_reduce(summed, group=parallel_state.get_data_parallel_group())
            totals = dict(zip(keys, summed.tolist()))
        if self.pp_size > 1:
            carried = [totals]
            dist.broadcast_object_list(carried, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                       group=parallel_state.get_pipeline_model_parallel_group())
            totals = carried[0]
        self._parking.side.wait()
        updated, grad_norm, _ = self.optimizer.step()
        self._parking.settle()
        grad_norm = float(grad_norm) if grad_norm is not None else math.nan
        return {**totals, "grad_norm": grad_norm, "skipped": 0.0 if updated else 1.0}

    def _schedule(self, batch: RolloutBatch, micro_batch_size: int, consume, *, with_entropy: bool,
                  forward_only: bool, after_forward: Callable[[], None] | None = None) -> list:
        """Megatron's forward-backward schedule over the batch's micro-batches: on the last stage each
        micro-batch's outputs (`_outputs`) go to `consume(outputs, rows)`, whose results come back in
        order (a loss and its statistics when training). Other stages return []. `after_forward`
        runs once a micro-batch's forward pass is queued."""
        micro_batches = list(torch.arange(batch.size).split(micro_batch_size))

        def forward_step(data_iterator, model):
            rows = next(data_iterator)
            aligned = aligned_rows(batch, rows, width_multiple=self.width_multiple)
            ids = to_device(aligned.input_ids, self.device)
            positions = torch.arange(ids.shape[1], device=self.device).expand(len(rows), -1)
            extra = {"fp32_output": False} if self.half else {}
            head: dict = {}
            if self.last_stage and not self.is_value_model and self.tp_size == 1:
                with _hidden_states_out(self.gpt.output_layer) as head:
                    output = model(input_ids=ids, position_ids=positions, attention_mask=None, **extra)
            else:
                output = model(input_ids=ids, position_ids=positions, attention_mask=None, **extra)
            if after_forward is not None:
                after_forward()

            def last_stage(output, non_loss_data=False):
                outputs = self._outputs(output, head.get("weight"), batch, rows, aligned, with_entropy=with_entropy)
                return consume(outputs, rows)

            return output, last_stage

        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro_batches), model=self.model,
            num_microbatches=len(micro_batches), seq_length=batch.tokens.shape[1], micro_batch_size=micro_batch_size,
            forward_only=forward_only, collect_non_loss_data=forward_only,
        )

    def _outputs(self, output: torch.Tensor, head_weight: torch.Tensor | None, batch: RolloutBatch, rows: torch.Tensor,
                 aligned, *, with_entropy: bool) -> dict[str, torch.Tensor]:
        """The last stage's model output for `rows` -> {"log_probs"[, "entropy"]} or {"values"}, [b, T],
        zero where the response mask is 0.

        Rows go in aligned (`aligned_rows`): plain causal attention, positions are the columns. With
        `head_weight` the output is the final hidden states and the output layer is applied here.
        """
        t = batch.response_length
        at = to_device(aligned.predict_at, self.device)
        targets = to_device(aligned.targets, self.device)
        kept = aligned.kept
        if self.is_value_model:
            outputs = {"values": output.squeeze(-1).gather(1, at).float()}
        elif head_weight is not None:
            # The output layer, log-softmax and entropy only on positions of real response tokens.
            hidden = output.reshape(-1, output.shape[-1]).index_select(0, to_device(aligned.real_outputs(), self.device))
            real = to_device(aligned.real, self.device)
            log_probs, entropy = chunked_log_probs_and_entropy(
                hidden, head_weight, to_device(aligned.targets[aligned.real], self.device), temperature=self.logits_temperature,
                with_entropy=with_entropy, compiled=self.compile,
                kept_logits_bytes=self.kept_logits_bytes,
            )
            zeros = torch.zeros(real.shape, dtype=torch.float32, device=self.device)
            outputs = {"log_probs": zeros.masked_scatter(real, log_probs)}
            if with_entropy:
                outputs["entropy"] = zeros.masked_scatter(real, entropy)
        else:
            logits = output.gather(1, at[:, :, None].expand(-1, -1, output.shape[-1])).float() / self.logits_temperature
            outputs = {"log_probs": log_probs_from_logits(logits, targets)}
            if with_entropy:
                outputs["entropy"] = entropy_from_logits(logits)
        mask = to_device(batch.response_mask[rows], self.device).bool()
        zero = torch.zeros((), device=self.device)
        return {key: torch.where(mask, F.pad(value, (0, t - kept)), zero) for key, value in outputs.items()}

    # ----- residency ---------------------------------------------------------------------------

    def release_process_groups(self) -> None:
        """Before the default group is destroyed (the role goes to sleep): megatron drops its groups;
        which ones the model and optimizer hold is remembered, to re-point them after the rebuild."""
        self._held_groups = {id(g): group_key(g) for g in find_process_groups(self._group_holders())}
        parallel_state.destroy_model_parallel()

    def attach_process_groups(self) -> None:
        """After the default group is rebuilt (the role woke): megatron's groups again, and every
        reference the model and optimizer hold re-pointed from the destroyed groups to them."""
        ensure_parallel_state(tensor=self.tp_size, pipeline=self.pp_size, seed=None)
        repoint_process_groups(self._group_holders(), self._held_groups, megatron_process_groups())
        self._held_groups = {}

    def _group_holders(self) -> list[object]:
        return [self.model, self.gpt, self.optimizer]

    @property
    def offloaded(self) -> bool:
        return self._parking.offloaded

    @property
    def last_transfer(self) -> dict:
        """The latest move to or from host memory (`HostMirror.last_transfer`)."""
        return self._parking.last_transfer

    def offload(self) -> None:
        """Parameters and optimizer state to pinned host memory, gradient buffers freed; no-op when
        offloaded. After a turn that changed nothing (no `train`, no `load_state_dict` since the
        onload) the host copies still hold the values: the device storage is only freed."""
        self._parking.offload()

    def onload(self) -> None:
        """Parameters back on the device, gradient buffers allocated; no-op when already there. The
        fp32 main parameters and Adam moments follow when `train` needs them, their copy beside the
        micro-batches (a pass that only reads, such as the log-probs, never moves them)."""
        self._parking.onload()

    def offload_optimizer_state(self) -> None:
        """The fp32 main parameters and Adam moments to pinned host memory, the parameters and
        gradient buffers staying on the device; no-op when they are not there."""
        self._parking.offload_optimizer_state()

    def _parked_weights(self) -> Parked:
        """The parameters and gradients offload parks, in place; gradient buffers are freed without
        a copy, since `train` zeroes them before use. Optimizer tensors that are views into these
        buffers (fp32 models) move with them."""
        if self.optimizer is None:
            return Parked([param.data for param in self.model.parameters()])
        tensors, keep = [], []
        for buffer in self.model.buffers:
            tensors += [buffer.param_data, buffer.grad_data]
            keep += [True, False]
        return Parked(tensors, keep=keep)

    def _parked_optimizer_state(self) -> Parked:
        """The fp32 main parameters and Adam moments offload parks, in place."""
        return Parked(list(self._optimizer_tensors()))

    def _optimizer_tensors(self) -> Iterator[torch.Tensor]:
        """The main parameters and optimizer state on the device that do not live in the DDP
        buffers, in a fixed order (call it while the buffers are on the device)."""
        buffers = {b.param_data.untyped_storage().data_ptr() for b in self.model.buffers}
        buffers |= {b.grad_data.untyped_storage().data_ptr() for b in self.model.buffers}
        for inner in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            for group in inner.optimizer.param_groups:
                for param in group["params"]:
                    tensors = [param.data, *inner.optimizer.state.get(param, {}).values()]
                    for value in tensors:
                        if (isinstance(value, torch.Tensor) and value.device.type == "cuda"
                                and value.untyped_storage().data_ptr() not in buffers):
                            yield value

    def _require_on_device(self, what: str) -> None:
        self._parking.require_on_device(what)

    # ----- weights and checkpoints --------------------------------------------------------------

    def _local_state(self) -> dict[str, torch.Tensor]:
        return {n: t for n, t in self.gpt.state_dict(keep_vars=True).items() if not n.endswith("_extra_state")}

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights under Hugging Face names (gathered over tensor and pipeline parallelism; see the protocol)."""
        state = {name: tensor.detach() for name, tensor in self._local_state().items()}
        if self.tp_size > 1:
            group = parallel_state.get_tensor_model_parallel_group()
            for name, tensor in state.items():
                shards = [torch.empty_like(tensor) for _ in range(self.tp_size)]
                dist.all_gather(shards, tensor.contiguous(), group=group)
                state[name] = conversion.unshard(name, shards, self.shape)
        state = conversion.from_stage(state, self.shape, layers=self.layers, first=self.first_stage)
        if self.pp_size > 1:
            state = self._gather_stages(state)
        yield from conversion.megatron_to_hf(state, self.shape)

    def _gather_stages(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every pipeline stage's weights (full-model names) on every stage: each stage in turn
        broadcasts its names and shapes, then its tensors."""
        group = parallel_state.get_pipeline_model_parallel_group()
        everything: dict[str, torch.Tensor] = {}
        for stage, source in enumerate(dist.get_process_group_ranks(group)):
            mine = stage == self.pp_rank
            listing = [[(name, tensor.shape, tensor.dtype) for name, tensor in state.items()] if mine else None]
            dist.broadcast_object_list(listing, src=source, group=group)
            for name, shape, dtype in listing[0]:
                tensor = state[name].contiguous() if mine else torch.empty(shape, dtype=dtype, device=self.device)
                dist.broadcast(tensor, src=source, group=group)
                everything[name] = tensor
        return everything

    def _inner_optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers under megatron's (one per chained optimizer) over this rank's main parameters."""
        return [inner.optimizer for inner in getattr(self.optimizer, "chained_optimizers", [self.optimizer])]

    def state_dict(self) -> dict:
        """{"model": this rank's megatron weights, "optimizer": per inner optimizer, its torch state
        (Adam moments, steps) and its fp32 main parameters, or None for "ref"}, every tensor a CPU
        copy. The optimizer part is this rank's shard: it loads back into the same layout only."""
        model = {n: t.detach().to("cpu", copy=True) for n, t in self._local_state().items()}
        if self.optimizer is None:
            return {"model": model, "optimizer": None}
        self._parking.bring_optimizer_state()
        self._parking.settle()
        optimizer = [
            {"torch": cpu_copy(inner.state_dict()),
             "main_params": [p.detach().to("cpu", copy=True) for g in inner.param_groups for p in g["params"]]}
            for inner in self._inner_optimizers()
        ]
        return {"model": model, "optimizer": optimizer}

    def load_state_dict(self, state: dict) -> None:
        """Load a `state_dict()` while on the device. Without an optimizer part (an older checkpoint)
        the optimizer restarts from the loaded weights."""
        self._require_on_device("load_state_dict")
        if "model" not in state:
            raise ValueError("state has no 'model' entry; pass what MegatronBackend.state_dict() returned")
        self._parking.written()
        self._parking.bring_optimizer_state()
        self._parking.settle()
        with torch.no_grad():
            for name, tensor in self._local_state().items():
                tensor.copy_(state["model"][name])
        if self.optimizer is None:
            return
        saved = state.get("optimizer")
        if saved is None:
            self.optimizer.reload_model_params()
            return
        inners = self._inner_optimizers()
        sizes = [len([p for g in inner.param_groups for p in g["params"]]) for inner in inners]
        if [len(entry["main_params"]) for entry in saved] != sizes:
            raise ValueError(
                f"the checkpoint's optimizer state holds {[len(e['main_params']) for e in saved]} main parameters per"
                f" optimizer where this rank has {sizes}: it was written with another model or parallel layout"
            )
        with torch.no_grad():
            for inner, entry in zip(inners, saved):
                for param, value in zip((p for g in inner.param_groups for p in g["params"]), entry["main_params"]):
                    param.copy_(value)
                load_optimizer_moments(inner, entry["torch"])
