"""A decoder layer of megatron's GPTModel as one function of its weights, for torch.compile.

Megatron's local layer (no Transformer Engine) runs each piece as its own module and kernels:
rotary embedding by cos, sin, split, negate and concatenate per call, the biases and residuals
apart, Python dispatch around every piece; compiling the layer as it is recompiles without end
(Dynamo loses the frames that megatron's linear autograd function resumes). At tensor parallel 1
none of that module machinery is needed: `decoder_layer` computes the same layer from the same
parameters (the grouped `linear_qkv`, `linear_fc1` = [gate; up], RMSNorm, causal attention
through torch's fused kernels), so torch.compile fuses the norms, rotary embedding, SwiGLU and
residuals, and one graph serves every layer (the weights are arguments). Gradients reach the
layer's own parameters, so megatron's DDP hooks, gradient buffers and distributed optimizer work
as with its own forward. Must not import megatron: the function is tested on a CPU.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F


class LayerWeights(NamedTuple):
    """One megatron TransformerLayer's parameters (local spec, Llama/Qwen2 shape); `qkv_bias` None without biases."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    proj: torch.Tensor
    pre_mlp_norm: torch.Tensor
    fc1: torch.Tensor
    fc2: torch.Tensor

    @classmethod
    def of(cls, layer: torch.nn.Module) -> LayerWeights:
        attention, mlp = layer.self_attention, layer.mlp
        return cls(layer.input_layernorm.weight, attention.linear_qkv.weight, attention.linear_qkv.bias,
                   attention.linear_proj.weight, layer.pre_mlp_layernorm.weight, mlp.linear_fc1.weight,
                   mlp.linear_fc2.weight)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding over the last dimension, halves paired (megatron's and Llama's layout)."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


def decoder_layer(hidden: torch.Tensor, freqs: torch.Tensor, w: LayerWeights, *, heads: int, groups: int,
                  eps: float) -> torch.Tensor:
    """hidden [s, b, h] -> [s, b, h]: megatron's pre-norm decoder layer at tensor parallel 1 over
    causal, unmasked rows (positions 0..s-1). `freqs` [>= s, 1, 1, d] are the rotary angles
    megatron's RotaryEmbedding gives, float32."""
    s, b, width = hidden.shape
    head_dim = w.proj.shape[1] // heads
    per_group = heads // groups
    x = F.rms_norm(hidden, (width,), w.input_norm, eps)
    mixed = F.linear(x, w.qkv, w.qkv_bias).view(s, b, groups, (per_group + 2) * head_dim)
    query, key, value = mixed.split([per_group * head_dim, head_dim, head_dim], dim=3)
    query = query.reshape(s, b, heads, head_dim)
    angles = freqs[:s]
    cos, sin = angles.cos().to(hidden.dtype), angles.sin().to(hidden.dtype)
    query, key = rotate(query, cos, sin), rotate(key, cos, sin)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
    attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != groups)
    hidden = hidden + F.linear(attended.permute(2, 0, 1, 3).reshape(s, b, heads * head_dim), w.proj)
    x = F.rms_norm(hidden, (width,), w.pre_mlp_norm, eps)
    gate, up = F.linear(x, w.fc1).chunk(2, dim=-1)
    return hidden + F.linear(F.silu(gate) * up, w.fc2)


def _layer_forward(layer: torch.nn.Module, run, hidden_states: torch.Tensor, attention_mask=None, *,
                   rotary_pos_emb=None, **rest):
    """A TransformerLayer's forward (as TransformerBlock calls it) through `run` (`decoder_layer`)."""
    unsupported = [name for name in ("context", "attention_bias", "inference_context", "packed_seq_params")
                   if rest.get(name) is not None]
    if attention_mask is not None or unsupported or rotary_pos_emb is None:
        raise ValueError(f"the fused decoder layer takes aligned rows with rotary embeddings only; got attention_mask"
                         f" {attention_mask is not None}, rotary embeddings {rotary_pos_emb is not None}, {unsupported}")
    freqs = rotary_pos_emb[0] if isinstance(rotary_pos_emb, tuple) else rotary_pos_emb
    config = layer.config
    out = run(hidden_states, freqs, LayerWeights.of(layer), heads=config.num_attention_heads,
              groups=config.num_query_groups, eps=config.layernorm_epsilon)
    return out, None


def fuse_layers(layers) -> None:
    """Every megatron TransformerLayer in `layers` computes its forward through `decoder_layer`,
    compiled once for all of them. Tensor parallel 1 only: the caller checks."""
    run = torch.compile(decoder_layer)
    for layer in layers:
        layer.forward = functools.partial(_layer_forward, layer, run)
