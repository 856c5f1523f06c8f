"""Hugging Face Llama/Qwen2 weights <-> megatron-core GPTModel weights (local layer spec), pure torch.

Megatron packs a layer's attention input projection into one `linear_qkv` whose rows are grouped
by key/value head: for each group g, the rows of its query heads, then k_g, then v_g. The gated
MLP's `linear_fc1` is [gate; up]. Under tensor parallelism each rank holds a contiguous slice of
the column-parallel weights (whole key/value groups of `linear_qkv`; the gate and up halves of
`linear_fc1` sliced separately), a column slice of the row-parallel ones (`linear_proj`,
`linear_fc2`), a vocabulary slice of the embedding and output layer, and full norms. The critic's
value head sits where the output layer would (`output_layer.weight` [1, hidden] and `.bias`),
replicated. Under pipeline parallelism stage s of S holds layers [s*L/S, (s+1)*L/S), numbered from
0 in its own state dict; the first stage holds the embedding, the last the final norm and the output
layer (with tied embeddings and S > 1, the last stage keeps its own copy of the embedding there,
which megatron keeps equal by summing the two copies' gradients). Must not import megatron: these
functions are tested on a CPU.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from ppo_trainer.backends.base import VALUE_MODEL_NAMES

LAYER = re.compile(r"^(?:model|trunk)\.layers\.(\d+)\.(.+)$")
MEGATRON_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# Per-layer names that map one to one (Hugging Face suffix -> megatron suffix).
LAYER_RENAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}
COLUMN_PARALLEL = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias", "mlp.linear_fc1.weight")
ROW_PARALLEL = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
VOCAB_PARALLEL = ("embedding.word_embeddings.weight", "output_layer.weight")


@dataclass(frozen=True)
class Shape:
    """The attention geometry that the packing needs."""

    heads: int
    kv_heads: int
    head_dim: int
    tied_embeddings: bool
    value_head: bool = False
    """The critic: `output_layer` is the [1, hidden] value head (with a bias), never tied."""

    @classmethod
    def from_hf_config(cls, config, *, value_head: bool = False) -> Shape:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)) and not value_head,
            value_head=value_head,
        )

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads


def pack_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: Shape) -> torch.Tensor:
    """Hugging Face q/k/v weights ([H*D, h], [G*D, h] x2) or biases -> megatron's grouped linear_qkv."""
    rest = q.shape[1:]
    grouped = (
        q.reshape(shape.kv_heads, shape.group * shape.head_dim, *rest),
        k.reshape(shape.kv_heads, shape.head_dim, *rest),
        v.reshape(shape.kv_heads, shape.head_dim, *rest),
    )
    return torch.cat(grouped, dim=1).reshape(-1, *rest)


def unpack_qkv(qkv: torch.Tensor, shape: Shape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `pack_qkv`."""
    rest = qkv.shape[1:]
    per_group = qkv.reshape(shape.kv_heads, (shape.group + 2) * shape.head_dim, *rest)
    q, k, v = per_group.split([shape.group * shape.head_dim, shape.head_dim, shape.head_dim], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def hf_to_megatron(state: Mapping[str, torch.Tensor], shape: Shape) -> dict[str, torch.Tensor]:
    """A Hugging Face causal LM's (or ValueModel's) state dict -> full (unsharded) megatron names.

    Keys may start with `model.` (a causal LM) or `trunk.` (a ValueModel). For the critic
    (`shape.value_head`) the LM head is dropped and `value_head.*` becomes `output_layer.*` when
    present (a fresh critic has none: the backend keeps its own initial head).
    """
    out: dict[str, torch.Tensor] = {}
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in state.items():
        match = LAYER.match(name)
        if match:
            layers.setdefault(int(match.group(1)), {})[match.group(2)] = tensor
        elif name in ("model.embed_tokens.weight", "trunk.embed_tokens.weight"):
            out["embedding.word_embeddings.weight"] = tensor
        elif name in ("model.norm.weight", "trunk.norm.weight"):
            out["decoder.final_layernorm.weight"] = tensor
        elif name == "lm_head.weight":
            if not shape.tied_embeddings and not shape.value_head:
                out["output_layer.weight"] = tensor
        elif name in ("value_head.weight", "value_head.bias") and shape.value_head:
            out["output_layer." + name.split(".")[1]] = tensor
        elif name.endswith("rotary_emb.inv_freq"):
            continue  # recomputed by both sides
        else:
            raise ValueError(f"checkpoint weight {name!r} has no megatron counterpart (a Llama/Qwen2 model?)")
    for index, parts in sorted(layers.items()):
        prefix = f"decoder.layers.{index}."
        for hf_suffix, mg_suffix in LAYER_RENAMES.items():
            out[prefix + mg_suffix] = parts.pop(hf_suffix)
        attn = "self_attn."
        out[prefix + "self_attention.linear_qkv.weight"] = pack_qkv(
            parts.pop(attn + "q_proj.weight"), parts.pop(attn + "k_proj.weight"), parts.pop(attn + "v_proj.weight"), shape
        )
        if attn + "q_proj.bias" in parts:
            out[prefix + "self_attention.linear_qkv.bias"] = pack_qkv(
                parts.pop(attn + "q_proj.bias"), parts.pop(attn + "k_proj.bias"), parts.pop(attn + "v_proj.bias"), shape
            )
        out[prefix + "mlp.linear_fc1.weight"] = torch.cat([parts.pop("mlp.gate_proj.weight"), parts.pop("mlp.up_proj.weight")])
        if parts:
            raise ValueError(f"layer {index} has weights with no megatron counterpart: {sorted(parts)}")
    return out


def megatron_to_hf(state: Mapping[str, torch.Tensor], shape: Shape) -> Iterator[tuple[str, torch.Tensor]]:
    """Full megatron weights -> (Hugging Face name, tensor) of the causal LM (tied weights once), or
    for the critic (`shape.value_head`) of the token classifier with one label: the value head as `score`."""
    inverse = {mg: hf for hf, mg in LAYER_RENAMES.items()}
    for name, tensor in state.items():
        match = MEGATRON_LAYER.match(name)
        if shape.value_head and name.startswith("output_layer."):
            yield f"{VALUE_MODEL_NAMES['value_head']}.{name.split('.', 1)[1]}", tensor
        elif name == "embedding.word_embeddings.weight":
            yield "model.embed_tokens.weight", tensor
        elif name == "decoder.final_layernorm.weight":
            yield "model.norm.weight", tensor
        elif name == "output_layer.weight":
            yield "lm_head.weight", tensor
        elif match is None:
            raise ValueError(f"megatron weight {name!r} has no Hugging Face counterpart")
        else:
            prefix, suffix = f"model.layers.{match.group(1)}.", match.group(2)
            if suffix in inverse:
                yield prefix + inverse[suffix], tensor
            elif suffix.startswith("self_attention.linear_qkv."):
                kind = suffix.rsplit(".", 1)[1]
                for proj, part in zip("qkv", unpack_qkv(tensor, shape)):
                    yield f"{prefix}self_attn.{proj}_proj.{kind}", part
            elif suffix == "mlp.linear_fc1.weight":
                gate, up = tensor.chunk(2)
                yield prefix + "mlp.gate_proj.weight", gate
                yield prefix + "mlp.up_proj.weight", up
            else:
                raise ValueError(f"megatron weight {name!r} has no Hugging Face counterpart")


def _kind(name: str, shape: Shape) -> str:
    suffix = MEGATRON_LAYER.sub(r"\2", name)
    if shape.value_head and name.startswith("output_layer."):
        return "replicated"
    if suffix in COLUMN_PARALLEL:
        return "gated" if suffix == "mlp.linear_fc1.weight" else "column"
    if suffix in ROW_PARALLEL:
        return "row"
    if name in VOCAB_PARALLEL:
        return "column"
    return "replicated"


def shard(name: str, tensor: torch.Tensor, shape: Shape, *, rank: int, size: int) -> torch.Tensor:
    """Tensor-parallel rank `rank`'s slice of a full megatron weight."""
    kind = _kind(name, shape)
    if size == 1 or kind == "replicated":
        return tensor
    if kind == "gated":
        return torch.cat([half.chunk(size)[rank] for half in tensor.chunk(2)])
    dim = 1 if kind == "row" else 0
    if tensor.shape[dim] % size:
        raise ValueError(f"{name} has {tensor.shape[dim]} rows/columns, not divisible by tensor parallel size {size}")
    return tensor.chunk(size, dim=dim)[rank]


def unshard(name: str, shards: list[torch.Tensor], shape: Shape) -> torch.Tensor:
    """The full weight from every tensor-parallel rank's slice (the inverse of `shard`)."""
    kind = _kind(name, shape)
    if len(shards) == 1 or kind == "replicated":
        return shards[0]
    if kind == "gated":
        halves = [part.chunk(2) for part in shards]
        return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
    return torch.cat(shards, dim=1 if kind == "row" else 0)


def stage_layers(num_layers: int, *, stage: int, stages: int) -> range:
    """The global indices of the layers pipeline stage `stage` of `stages` holds (an even split)."""
    if num_layers % stages:
        raise ValueError(
            f"the model's {num_layers} layers do not split evenly over parallelism.pipeline={stages} (actor.parallelism or critic.parallelism):"
            f" choose a pipeline size that divides {num_layers}"
        )
    per_stage = num_layers // stages
    return range(stage * per_stage, (stage + 1) * per_stage)


def _renumber(name: str, offset: int) -> str:
    match = MEGATRON_LAYER.match(name)
    return name if match is None else f"decoder.layers.{int(match.group(1)) + offset}.{match.group(2)}"


def to_stage(state: Mapping[str, torch.Tensor], shape: Shape, *, layers: range, first: bool, last: bool) -> dict[str, torch.Tensor]:
    """Full megatron weights -> what one pipeline stage holds, its layers numbered from 0 (`layers`:
    `stage_layers`). A last stage that is not also the first gets the tied embedding as its output layer."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        match = MEGATRON_LAYER.match(name)
        if match is not None:
            if int(match.group(1)) in layers:
                out[_renumber(name, -layers.start)] = tensor
        elif name.startswith("embedding."):
            if first:
                out[name] = tensor
            if last and not first and shape.tied_embeddings:
                out["output_layer.weight"] = tensor
        elif last:
            out[name] = tensor
    return out


def from_stage(state: Mapping[str, torch.Tensor], shape: Shape, *, layers: range, first: bool) -> dict[str, torch.Tensor]:
    """One pipeline stage's weights under the full model's names (the inverse of `to_stage`); the
    last stage's copy of a tied embedding is left out (the first stage's is the weight)."""
    tied_copy = shape.tied_embeddings and not first
    return {_renumber(name, layers.start): tensor for name, tensor in state.items()
            if not (tied_copy and name == "output_layer.weight")}
