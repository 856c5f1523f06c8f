"""A Hugging Face Llama/Qwen2 config -> the arguments of megatron-core's TransformerConfig and GPTModel.

Plain dictionaries, so the mapping is tested on a CPU without megatron. The fused kernels that
need Transformer Engine or Apex are turned off (megatron falls back to torch implementations).
Must not import megatron.
"""

from __future__ import annotations

import torch

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


def rope_theta(config) -> float:
    """The rotary base, from `rope_theta` (transformers 4) or `rope_parameters` (transformers 5)."""
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope scaling {rope_type!r} is not supported by the megatron backend; use plain RoPE")
    theta = parameters.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError("the model config has no rope_theta")
    return float(theta)


def check_supported(config) -> None:
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model type {config.model_type!r} is not supported by the megatron backend; "
            f"use one of {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if config.model_type == "llama" and (getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False)):
        raise ValueError("Llama models with attention_bias or mlp_bias are not supported by the megatron backend")
    if getattr(config, "use_sliding_window", False):
        raise ValueError("sliding-window attention is not supported by the megatron backend")


def transformer_config_kwargs(config, *, tensor: int, pipeline: int, dtype: torch.dtype) -> dict:
    """Keyword arguments of megatron.core.transformer.TransformerConfig (activation_func aside:
    the gated MLP's SiLU is added by the backend, which imports torch.nn.functional there)."""
    check_supported(config)
    if config.num_key_value_heads % tensor:
        raise ValueError(
            f"{config.num_key_value_heads} key/value heads do not split over tensor parallel size {tensor}"
        )
    half = dtype in (torch.bfloat16, torch.float16)
    return {
        "num_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "ffn_hidden_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_query_groups": config.num_key_value_heads,
        "kv_channels": getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        "normalization": "RMSNorm",
        "layernorm_epsilon": config.rms_norm_eps,
        "gated_linear_unit": True,
        "add_bias_linear": False,
        "add_qkv_bias": config.model_type == "qwen2",
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "tensor_model_parallel_size": tensor,
        "pipeline_model_parallel_size": pipeline,
        "bf16": dtype == torch.bfloat16,
        "fp16": dtype == torch.float16,
        "params_dtype": dtype,
        "pipeline_dtype": dtype,
        # Each micro-batch is cut to its own longest row: pipeline stages exchange shapes first
        # (megatron refuses that with its default MoE dispatcher, unused here: no experts).
        "variable_seq_lengths": True,
        "moe_token_dispatcher_type": "alltoall",
        "attention_softmax_in_fp32": half,
        # SwiGLU through megatron's own fused function (torch.compile'd): on an H200 at the Qwen2.5-0.5B
        # shape a no-grad pass takes 0.46 s instead of 0.82 s, a training pass 1.40 s instead of 1.58 s.
        "bias_activation_fusion": True,
        "bias_dropout_fusion": False,
        "masked_softmax_fusion": False,
        "apply_rope_fusion": False,
        "gradient_accumulation_fusion": False,
        "persist_layer_norm": False,
    }


def gpt_model_kwargs(config, *, value_head: bool) -> dict:
    """Keyword arguments of megatron.core.models.gpt.GPTModel besides config and layer spec."""
    return {
        "vocab_size": config.vocab_size,
        "max_sequence_length": config.max_position_embeddings,
        "position_embedding_type": "rope",
        "rotary_base": rope_theta(config),
        "rotary_percent": 1.0,
        "share_embeddings_and_output_weights": bool(getattr(config, "tie_word_embeddings", False)) and not value_head,
        "parallel_output": False,
    }
