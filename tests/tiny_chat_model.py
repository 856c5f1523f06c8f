"""A tiny chat model directory for tests: a random-init Llama and a byte-level tokenizer with a chat template.

The tokenizer is a real Hugging Face one (`tokenizers` byte-level BPE without merges: every UTF-8
byte one token) with ChatML markers as special tokens and a ChatML chat template, so chat prompts
go through `apply_chat_template` as they do for an instruct model. Small enough for a CPU run.
"""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<pad>")


def chat_tokenizer(*, chat_template: str | None = CHAT_TEMPLATE):
    """A `PreTrainedTokenizerFast` over bytes, EOS <|im_end|>; without a chat template when given None."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<pad>",
                                        additional_special_tokens=["<|im_start|>"])
    tokenizer.chat_template = chat_template
    return tokenizer


def write_chat_model(directory: Path, *, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    """A Hugging Face model directory (config, weights, tokenizer) in `directory`; returns it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = chat_tokenizer(chat_template=chat_template)
    tokenizer.save_pretrained(str(directory))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(str(directory))
    return directory
