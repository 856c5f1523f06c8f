"""The GPU issue's two model shapes and the FLOPs of a pass over a batch of them.

Workload A is the Qwen2.5-0.5B shape, workload B the Qwen2.5-3B shape (both with tied
embeddings, random bf16 weights in the benches). FLOPs count the matrix products of the real
tokens only (padding excluded), causal attention as half of the square, and the output layer on
the response positions only (the policy's vocabulary, or the critic's one value). Needs only
torch tensors for the masks; no GPU, no Ray.
"""

from __future__ import annotations

_QWEN2_5_COMMON = {
    "vocab_size": 151936, "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "bos_token_id": 151643, "eos_token_id": 151643,
}
MODELS = {
    "qwen2.5-0.5b": _QWEN2_5_COMMON | {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                                       "num_attention_heads": 14, "num_key_value_heads": 2},
    "qwen2.5-3b": _QWEN2_5_COMMON | {"hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
                                     "num_attention_heads": 16, "num_key_value_heads": 2},
    # A critic of its own for workload A's actor: half the layers, narrower, the same vocabulary.
    "qwen2.5-0.5b-narrow": _QWEN2_5_COMMON | {"hidden_size": 640, "intermediate_size": 3456, "num_hidden_layers": 12,
                                              "num_attention_heads": 10, "num_key_value_heads": 2},
    # A CPU dry run of the benches' wiring: the same vocabulary, two narrow layers.
    "qwen2-test": _QWEN2_5_COMMON | {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                     "num_attention_heads": 4, "num_key_value_heads": 2},
}
EOS = 151643


def parameter_count(config: dict) -> int:
    """Weights of the causal LM (tied embeddings counted once; norms included)."""
    h, heads, kv, ffn = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"], config["intermediate_size"]
    d = h // heads
    attention = h * (heads + 2 * kv) * d + (heads + 2 * kv) * d + heads * d * h  # q, k, v with biases; o
    layer = attention + 3 * h * ffn + 2 * h
    embeddings = config["vocab_size"] * h * (1 if config["tie_word_embeddings"] else 2)
    return config["num_hidden_layers"] * layer + embeddings + h


def forward_flops(config: dict, *, attention_mask, response_mask, policy: bool) -> float:
    """Model FLOPs of one forward pass: `attention_mask` [B, P+T] (1 on real tokens) and
    `response_mask` [B, T] (1 on real response tokens); `policy` puts the vocabulary on the
    response positions, otherwise a single value."""
    h, heads, kv, ffn = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"], config["intermediate_size"]
    d = h // heads
    per_layer = h * (heads + 2 * kv) * d + heads * d * h + 3 * h * ffn
    lengths = attention_mask.sum(dim=1).double()
    responses = float(response_mask.sum())
    layers = config["num_hidden_layers"]
    dense = 2 * float(lengths.sum()) * layers * per_layer
    attention = 2 * float((lengths**2).sum()) * heads * d * layers  # QK^T and AV, causal: half of 2 * 2 * L^2
    head = 2 * responses * h * (config["vocab_size"] if policy else 1)
    return dense + attention + head
