"""Hugging Face <-> megatron weight conversion and config mapping, on tiny shapes, with no megatron.

The converted weights, run through the backend's fused decoder layer (`fused_layer.py`: megatron's
layout, grouped linear_qkv split per key/value group, linear_fc1 = [gate; up]), must reproduce the
Hugging Face model's logits.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from ppo_trainer.backends.megatron import conversion, fused_layer
from ppo_trainer.backends.megatron.config import gpt_model_kwargs, transformer_config_kwargs


def tiny(kind: str, *, tied: bool):
    common = {
        "vocab_size": 98, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 64, "tie_word_embeddings": tied, "rms_norm_eps": 1e-6,
    }
    config = Qwen2Config(**common) if kind == "qwen2" else LlamaConfig(**common)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return (Qwen2ForCausalLM if kind == "qwen2" else LlamaForCausalLM)(config).eval()


def rms(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def megatron_layout_forward(state: dict, config, shape: conversion.Shape, ids: torch.Tensor) -> torch.Tensor:
    """Logits from megatron-named weights, each layer through the backend's fused decoder layer,
    over megatron's [s, b, h] layout with the rotary angles as megatron's RotaryEmbedding gives them."""
    h = state["embedding.word_embeddings.weight"][ids].transpose(0, 1)  # [s, b, h]
    d = shape.head_dim
    inv_freq = 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, d, 2).float() / d))
    angles = torch.arange(h.shape[0]).float()[:, None] * inv_freq[None]
    freqs = torch.cat([angles, angles], -1)[:, None, None, :]  # [s, 1, 1, d]
    for i in range(config.num_hidden_layers):
        p = f"decoder.layers.{i}."
        weights = fused_layer.LayerWeights(
            state[p + "input_layernorm.weight"], state[p + "self_attention.linear_qkv.weight"],
            state.get(p + "self_attention.linear_qkv.bias"), state[p + "self_attention.linear_proj.weight"],
            state[p + "pre_mlp_layernorm.weight"], state[p + "mlp.linear_fc1.weight"], state[p + "mlp.linear_fc2.weight"],
        )
        h = fused_layer.decoder_layer(h, freqs, weights, heads=shape.heads, groups=shape.kv_heads,
                                      eps=config.rms_norm_eps)
    h = rms(h.transpose(0, 1), state["decoder.final_layernorm.weight"], config.rms_norm_eps)
    head = state["embedding.word_embeddings.weight"] if shape.tied_embeddings else state["output_layer.weight"]
    return F.linear(h, head)


@pytest.mark.parametrize("kind,tied", [("qwen2", True), ("llama", False)])
def test_megatron_layout_forward_of_converted_weights_equals_the_hugging_face_logits(kind, tied):
    model = tiny(kind, tied=tied)
    shape = conversion.Shape.from_hf_config(model.config)
    state = conversion.hf_to_megatron(model.state_dict(), shape)
    ids = torch.randint(0, 98, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        got = megatron_layout_forward(state, model.config, shape, ids)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert ("output_layer.weight" in state) != tied
    assert ("decoder.layers.0.self_attention.linear_qkv.bias" in state) == (kind == "qwen2")


@pytest.mark.parametrize("kind,tied", [("qwen2", True), ("llama", False)])
def test_megatron_to_hf_inverts_hf_to_megatron(kind, tied):
    model = tiny(kind, tied=tied)
    shape = conversion.Shape.from_hf_config(model.config)
    back = dict(conversion.megatron_to_hf(conversion.hf_to_megatron(model.state_dict(), shape), shape))
    params = dict(model.named_parameters())  # tied weights appear once, as the engine expects
    assert sorted(back) == sorted(params)
    for name, tensor in params.items():
        assert torch.equal(back[name], tensor), name


def test_pack_qkv_groups_query_heads_with_their_key_value_head():
    shape = conversion.Shape(heads=4, kv_heads=2, head_dim=1, tied_embeddings=False)
    q, k, v = torch.tensor([0.0, 1, 2, 3]), torch.tensor([10.0, 11]), torch.tensor([20.0, 21])
    assert conversion.pack_qkv(q, k, v, shape).tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert [t.tolist() for t in conversion.unpack_qkv(conversion.pack_qkv(q, k, v, shape), shape)] == [
        q.tolist(), k.tolist(), v.tolist()
    ]


@pytest.mark.parametrize("size", [1, 2])
def test_tensor_parallel_shards_reassemble_and_keep_whole_groups(size):
    model = tiny("qwen2", tied=True)
    shape = conversion.Shape.from_hf_config(model.config)
    state = conversion.hf_to_megatron(model.state_dict(), shape)
    for name, tensor in state.items():
        shards = [conversion.shard(name, tensor, shape, rank=r, size=size) for r in range(size)]
        assert torch.equal(conversion.unshard(name, shards, shape), tensor), name
    qkv = state["decoder.layers.0.self_attention.linear_qkv.weight"]
    first = conversion.shard("decoder.layers.0.self_attention.linear_qkv.weight", qkv, shape, rank=0, size=2)
    assert torch.equal(first, qkv[: qkv.shape[0] // 2])  # key/value group 0 and its query heads
    fc1 = state["decoder.layers.0.mlp.linear_fc1.weight"]
    gate, up = fc1.chunk(2)
    half = conversion.shard("decoder.layers.0.mlp.linear_fc1.weight", fc1, shape, rank=1, size=2)
    assert torch.equal(half, torch.cat([gate.chunk(2)[1], up.chunk(2)[1]]))


@pytest.mark.parametrize("tied", [True, False])
def test_pipeline_stages_split_the_layers_and_reassemble(tied):
    model = tiny("qwen2", tied=tied)
    shape = conversion.Shape.from_hf_config(model.config)
    state = conversion.hf_to_megatron(model.state_dict(), shape)
    stages = []
    for stage in range(2):
        layers = conversion.stage_layers(2, stage=stage, stages=2)
        held = conversion.to_stage(state, shape, layers=layers, first=stage == 0, last=stage == 1)
        assert {n.split(".")[2] for n in held if n.startswith("decoder.layers.")} == {"0"}  # numbered from 0
        stages.append(conversion.from_stage(held, shape, layers=layers, first=stage == 0))
    first, last = stages
    assert "embedding.word_embeddings.weight" in first and "decoder.final_layernorm.weight" in last
    assert torch.equal(first["decoder.layers.0.input_layernorm.weight"], state["decoder.layers.0.input_layernorm.weight"])
    assert torch.equal(last["decoder.layers.1.input_layernorm.weight"], state["decoder.layers.1.input_layernorm.weight"])
    assert {**first, **last}.keys() == state.keys() and not first.keys() & last.keys()
    held_last = conversion.to_stage(state, shape, layers=range(1, 2), first=False, last=True)
    # The last stage's output layer is its copy of the tied embedding, or the LM head.
    head = state["embedding.word_embeddings.weight"] if tied else state["output_layer.weight"]
    assert torch.equal(held_last["output_layer.weight"], head)


def test_a_layer_count_that_does_not_split_over_the_pipeline_names_the_field():
    with pytest.raises(ValueError, match=r"parallelism.pipeline=4 \(actor.parallelism or critic.parallelism\).*divides 6"):
        conversion.stage_layers(6, stage=0, stages=4)
    assert conversion.stage_layers(24, stage=1, stages=2) == range(12, 24)


def test_critic_conversion_drops_the_lm_head_and_maps_the_value_head():
    model = tiny("llama", tied=False)
    shape = conversion.Shape.from_hf_config(model.config, value_head=True)
    state = {**model.state_dict(), "value_head.weight": torch.ones(1, 32), "value_head.bias": torch.zeros(1)}
    converted = conversion.hf_to_megatron(state, shape)
    assert converted["output_layer.weight"].shape == (1, 32) and "output_layer.bias" in converted
    assert conversion.shard("output_layer.weight", converted["output_layer.weight"], shape, rank=1, size=2).shape == (1, 32)
    # Back to Hugging Face names: a token classifier with one label, the value head as `score`.
    back = dict(conversion.megatron_to_hf(converted, shape))
    assert torch.equal(back["score.weight"], state["value_head.weight"]) and "score.bias" in back
    assert set(back) == {name for name in state if name.startswith("model.")} | {"score.weight", "score.bias"}


def test_unknown_weights_are_rejected_by_name():
    shape = conversion.Shape(heads=4, kv_heads=2, head_dim=8, tied_embeddings=True)
    with pytest.raises(ValueError, match="model.mystery.weight"):
        conversion.hf_to_megatron({"model.mystery.weight": torch.zeros(1)}, shape)


def test_config_mapping_for_the_qwen2_5_0_5b_shape():
    config = Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )
    kwargs = transformer_config_kwargs(config, tensor=2, pipeline=1, dtype=torch.bfloat16)
    assert (kwargs["num_layers"], kwargs["hidden_size"], kwargs["ffn_hidden_size"]) == (24, 896, 4864)
    assert (kwargs["num_attention_heads"], kwargs["num_query_groups"], kwargs["kv_channels"]) == (14, 2, 64)
    assert kwargs["add_qkv_bias"] and not kwargs["add_bias_linear"] and kwargs["gated_linear_unit"]
    assert kwargs["bf16"] and kwargs["params_dtype"] == torch.bfloat16 and kwargs["tensor_model_parallel_size"] == 2
    assert kwargs["normalization"] == "RMSNorm" and kwargs["layernorm_epsilon"] == 1e-6
    model = gpt_model_kwargs(config, value_head=False)
    assert model["rotary_base"] == 1e6 and model["share_embeddings_and_output_weights"]
    assert not gpt_model_kwargs(config, value_head=True)["share_embeddings_and_output_weights"]
    with pytest.raises(ValueError, match="tensor parallel size 4"):
        transformer_config_kwargs(config, tensor=4, pipeline=1, dtype=torch.bfloat16)


def test_config_mapping_rejects_unsupported_models():
    with pytest.raises(ValueError, match="attention_bias"):
        transformer_config_kwargs(LlamaConfig(attention_bias=True), tensor=1, pipeline=1, dtype=torch.float32)
