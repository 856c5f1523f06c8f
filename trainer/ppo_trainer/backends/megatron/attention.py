"""Megatron-core's core attention through torch's `scaled_dot_product_attention`.

Without Transformer Engine, megatron's local layer spec computes attention unfused: a batched
matmul into a [b * heads, s, s] score buffer, a masked softmax in float32, a second matmul. The
backend feeds aligned rows (no padding mask), so causal attention is all that is needed and
torch's fused kernels (flash attention in bf16) do it in one call. `layer_spec` puts this module
in the local spec's place; it takes the same arguments as megatron's DotProductAttention.
"""

from __future__ import annotations

import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from torch import Tensor


class SdpaCoreAttention(MegatronModule):
    """Causal attention: query [sq, b, heads, d], key and value [sk, b, groups, d] -> [sq, b, heads * d]."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None, **_):
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SdpaCoreAttention computes causal attention only, not {attn_mask_type}")
        if (attention_dropout if attention_dropout is not None else config.attention_dropout) != 0.0:
            raise ValueError("SdpaCoreAttention has no attention dropout; set attention_dropout to 0")
        self.softmax_scale = softmax_scale  # None: 1/sqrt(d), as megatron's default

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type: AttnMaskType | None = None, attention_bias: Tensor | None = None,
                packed_seq_params=None) -> Tensor:
        if attention_mask is not None or attention_bias is not None or packed_seq_params is not None:
            raise ValueError("SdpaCoreAttention takes aligned rows only: no attention mask, bias or packed sequences")
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, d]
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=q.shape[1] != k.shape[1]
        )
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)


def layer_spec() -> ModuleSpec:
    """megatron-core's local GPT layer spec (RMSNorm) with SdpaCoreAttention as its core attention."""
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = SdpaCoreAttention
    return spec
