"""Building the policy and value networks from a ModelSpec (paths as `models/sources.py` resolves them).

The critic (`ValueModel`) is a causal LM's trunk with a scalar head: by default the actor's,
with `critic.model` a model of its own (another size or architecture, the same tokenizer). Must
not depend on Ray, the PPO loop or a training backend.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from ppo_trainer.models.sources import TINY, TINY_NARROW, resolve_model_dir
from ppo_trainer.models.tokenizer import ByteTokenizer
from ppojob_api.spec import ModelSpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"model.dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


# (layers, hidden width, attention heads, key-value heads) of the random-init built-ins.
RANDOM_SHAPES = {TINY: (2, 64, 4, 2), TINY_NARROW: (1, 32, 4, 2)}


def builtin_config(path: str) -> LlamaConfig | None:
    """The configuration of a random-init built-in over the byte tokenizer (None for any other path)."""
    shape = RANDOM_SHAPES.get(path)
    if shape is None:
        return None
    layers, hidden, heads, kv_heads = shape
    tokenizer = ByteTokenizer()
    return LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )


def tiny_config() -> LlamaConfig:
    """builtin:tiny: a 2-layer, 64-wide Llama over the byte tokenizer, ~0.1M parameters."""
    return builtin_config(TINY)


def build_policy(
    model_spec: ModelSpec,
    *,
    seed: int,
    device: str | torch.device,
    dtype: str | torch.dtype | None = None,
) -> PreTrainedModel:
    """The causal LM of `model_spec` on `device`, in train mode; random init is seeded by `seed`.

    The global RNG is left untouched, so building a model never shifts a caller's sampling.
    """
    torch_dtype = resolve_dtype(dtype if dtype is not None else model_spec.dtype)
    directory = resolve_model_dir(model_spec.path)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if directory is None:
            model = LlamaForCausalLM(builtin_config(model_spec.path))
        else:
            model = AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True)
    model.config.use_cache = False
    model.to(device=device)
    # The parameters only: the rotary embedding's inverse frequencies stay float32, as Hugging Face
    # and SGLang keep them; rounded to bfloat16 they turn every position's angle (a logit of
    # SmolLM2-135M moved by up to 0.5 against the same weights loaded by transformers).
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.to(torch_dtype)
    return model.train()


class ValueModel(nn.Module):
    """A causal LM's trunk with a scalar head: values[b, i] = head(hidden state at position i).

    The head is Linear(hidden, 1) with weights ~ N(0, 0.02) and a zero bias, drawn from `seed`.
    """

    def __init__(self, *, trunk: PreTrainedModel, seed: int):
        super().__init__()
        self.trunk = trunk
        self.value_head = nn.Linear(trunk.config.hidden_size, 1)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            weight = torch.empty(self.value_head.weight.shape).normal_(mean=0.0, std=0.02)
        param = next(trunk.parameters())
        with torch.no_grad():
            self.value_head.weight.copy_(weight)
            self.value_head.bias.zero_()
        self.value_head.to(device=param.device, dtype=param.dtype)

    def forward(self, *, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, L] -> [B, L] values, in the trunk's dtype: rows start at column 0 (`aligned_rows`), so
        attention is plain causal and positions are the columns."""
        hidden = self.trunk(input_ids=input_ids, use_cache=False).last_hidden_state
        return self.value_head(hidden).squeeze(-1)


def build_value_model(
    model_spec: ModelSpec,
    *,
    seed: int,
    device: str | torch.device,
    dtype: str | torch.dtype | None = None,
    policy: PreTrainedModel | None = None,
) -> ValueModel:
    """The critic: a deep copy of `policy`'s trunk (built from `model_spec` and `seed` when not
    given) with a fresh value head. To start from a saved critic, load its state dict afterwards.
    """
    if policy is None:
        policy = build_policy(model_spec, seed=seed, device=device, dtype=dtype)
    trunk = copy.deepcopy(policy.get_decoder())
    return ValueModel(trunk=trunk, seed=seed).train()
