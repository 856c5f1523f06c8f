"""gpu_workloads: the model shapes and FLOPs the GPU benches report against the bf16 ceiling."""

import torch
from gpu_workloads import MODELS, forward_flops, parameter_count
from torch.utils.flop_counter import FlopCounterMode
from transformers import Qwen2Config, Qwen2ForCausalLM


def test_parameter_count_equals_the_built_models():
    config = MODELS["qwen2-test"]
    model = Qwen2ForCausalLM(Qwen2Config(**config))
    assert parameter_count(config) == sum(p.numel() for p in model.parameters())


def test_the_3b_shape_has_qwen2_5_3b_s_published_size():
    assert 3.08e9 < parameter_count(MODELS["qwen2.5-3b"]) < 3.10e9  # Qwen2.5-3B: 3.09B parameters


def test_forward_flops_equal_torch_s_count_of_the_matrix_products():
    """Torch's FLOP counter over the trunk (eager attention: the full square) and the output layer
    on the response positions; ours counts the causal half of the attention square."""
    config = MODELS["qwen2-test"]
    model = Qwen2ForCausalLM(Qwen2Config(**config, attn_implementation="eager")).eval()
    prompt, response = 5, 7
    ids = torch.randint(0, 1000, (1, prompt + response))
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        hidden = model.model(input_ids=ids).last_hidden_state
        model.lm_head(hidden[:, prompt:])
    counts = counter.get_flop_counts()["Global"]
    attention = sum(v for op, v in counts.items() if "bmm" in str(op))  # QK^T and AV, every head, full square
    matmuls = counter.get_total_flops() - attention
    ours = forward_flops(config, attention_mask=torch.ones(1, prompt + response),
                         response_mask=torch.ones(1, response), policy=True)
    assert attention > 0
    assert ours == matmuls + attention / 2


def test_forward_flops_skip_padding_and_the_critic_head_is_one_value():
    config = MODELS["qwen2-test"]
    padded = forward_flops(config, attention_mask=torch.tensor([[0, 0, 1, 1, 1, 0]]),
                           response_mask=torch.tensor([[1.0, 0.0]]), policy=False)
    dense = forward_flops(config, attention_mask=torch.tensor([[1, 1, 1]]),
                          response_mask=torch.tensor([[1.0]]), policy=False)
    assert padded == dense
    policy = forward_flops(config, attention_mask=torch.tensor([[1, 1, 1]]), response_mask=torch.tensor([[1.0]]),
                           policy=True)
    assert policy - dense == 2 * config["hidden_size"] * (config["vocab_size"] - 1)
