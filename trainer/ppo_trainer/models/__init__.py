"""Models and tokenizers for the torch backend and engine: policy, value model, tokenizer, SmolLM2.

Re-exports the public names. Importing this package imports transformers; nothing here may
depend on Ray, the PPO loop or a training backend.
"""

from ppo_trainer.models.builtin import (
    ValueModel,
    build_policy,
    build_value_model,
    builtin_config,
    resolve_dtype,
    tiny_config,
)
from ppo_trainer.models.smollm import ensure_smollm2, find_gguf, smollm2_dir
from ppo_trainer.models.sources import BUILTINS, SMOLLM2, TINY, TINY_NARROW, resolve_model_dir
from ppo_trainer.models.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    check_same_tokenizer,
    load_hf_tokenizer,
    load_tokenizer,
)

__all__ = [
    "BUILTINS",
    "SMOLLM2",
    "TINY",
    "TINY_NARROW",
    "ByteTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "ValueModel",
    "build_policy",
    "build_value_model",
    "builtin_config",
    "check_same_tokenizer",
    "ensure_smollm2",
    "find_gguf",
    "load_hf_tokenizer",
    "load_tokenizer",
    "resolve_dtype",
    "resolve_model_dir",
    "smollm2_dir",
    "tiny_config",
]
