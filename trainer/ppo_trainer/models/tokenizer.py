"""Tokenizers behind one small protocol: a built-in byte-level one and a Hugging Face adapter.

The trainer only needs text <-> token ids, a prompt's ids as the policy sees it, the EOS and PAD
ids, and the vocabulary size; this module keeps every other tokenizer detail behind `Tokenizer`.
A text prompt goes through the chat template as one user message when the tokenizer has one; a
chat prompt's messages always do, and a tokenizer without a chat template refuses them. It must
not depend on models, Ray or the PPO loop; transformers is imported only when a Hugging Face
tokenizer is loaded.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ppo_trainer.data import Prompt
from ppojob_api.spec import ModelSpec


@runtime_checkable
class Tokenizer(Protocol):
    eos_token_id: int
    pad_token_id: int
    vocab_size: int
    """Number of token ids the model's embedding must cover."""

    def encode(self, text: str) -> list[int]:
        """Plain text to ids, without special tokens."""
        ...

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """A prompt as the policy should see it (BOS, or the chat template when there is one);
        ValueError for a chat prompt without a chat template."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Ids to text, special tokens dropped."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then BOS, EOS and PAD: the built-in tiny model's vocabulary."""

    bos_token_id = 256
    eos_token_id = 257
    pad_token_id = 258
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        if prompt.messages is not None:
            raise ValueError(NO_CHAT_TEMPLATE.format(tokenizer="the built-in byte tokenizer"))
        return [self.bos_token_id, *self.encode(prompt.text)]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer loaded from a local directory, seen through `Tokenizer`.

    With `chat_template=True` and a tokenizer that has a chat template, `encode_prompt` renders a
    chat prompt's messages, or a text prompt as one user message, and appends the assistant's
    header (`add_generation_prompt`), as an instruct model expects.
    """

    def __init__(self, *, hf_tokenizer: Any, chat_template: bool = True):
        if hf_tokenizer.eos_token_id is None:
            raise ValueError("tokenizer has no eos_token; set eos_token in its tokenizer_config.json")
        self.hf_tokenizer = hf_tokenizer
        self.use_chat_template = chat_template and bool(getattr(hf_tokenizer, "chat_template", None))
        self.eos_token_id = int(hf_tokenizer.eos_token_id)
        pad = hf_tokenizer.pad_token_id
        self.pad_token_id = int(pad) if pad is not None else self.eos_token_id
        self.vocab_size = len(hf_tokenizer)

    def encode(self, text: str) -> list[int]:
        return list(self.hf_tokenizer.encode(text, add_special_tokens=False))

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        if not self.use_chat_template:
            if prompt.messages is not None:
                raise ValueError(NO_CHAT_TEMPLATE.format(tokenizer=f"tokenizer {self.hf_tokenizer.name_or_path!r}"))
            return list(self.hf_tokenizer.encode(prompt.text, add_special_tokens=True))
        messages = (
            [{"role": m.role, "content": m.content} for m in prompt.messages]
            if prompt.messages is not None
            else [{"role": "user", "content": prompt.text}]
        )
        from jinja2 import TemplateError

        try:
            rendered = self.hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except TemplateError as exc:  # e.g. a template that wants user and assistant to alternate
            raise ValueError(
                f"the chat template of tokenizer {self.hf_tokenizer.name_or_path!r} refuses the messages"
                f" {[m['role'] for m in messages]}: {exc}"
            ) from None
        # The template writes the special tokens (BOS and the like) itself.
        return self.encode(rendered)

    def decode(self, ids: list[int]) -> str:
        return self.hf_tokenizer.decode(list(ids), skip_special_tokens=True)


NO_CHAT_TEMPLATE = (
    "chat prompts (lists of {{role, content}} messages) need a tokenizer with a chat template, and {tokenizer}"
    " has none: use an instruct model (or set model.tokenizer to a tokenizer directory whose"
    " tokenizer_config.json or chat_template.jinja holds one), or give the prompts as plain strings"
)


def load_tokenizer(model_spec: ModelSpec, *, chat_template: bool = True) -> Tokenizer:
    """The tokenizer of `model_spec`: `tokenizer` when set, else the one beside the model `path`."""
    from ppo_trainer.models.sources import resolve_model_dir

    source = model_spec.tokenizer or model_spec.path
    directory = resolve_model_dir(source)
    if directory is None:
        return ByteTokenizer()
    return load_hf_tokenizer(directory, chat_template=chat_template)


def load_hf_tokenizer(directory: str | Path, *, chat_template: bool = True) -> HFTokenizer:
    from transformers import AutoTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    return HFTokenizer(hf_tokenizer=hf_tokenizer, chat_template=chat_template)


def vocabulary_fingerprint(tokenizer: Tokenizer) -> str:
    """A digest of what token ids mean (every token's id, EOS, PAD): two models trained on one
    batch's ids must read them alike."""
    digest = hashlib.sha256(f"{type(tokenizer).__name__}:{tokenizer.eos_token_id}:{tokenizer.pad_token_id}".encode())
    if isinstance(tokenizer, HFTokenizer):
        for token, index in sorted(tokenizer.hf_tokenizer.get_vocab().items(), key=lambda item: item[1]):
            digest.update(f"{index}:{token}\n".encode())
    else:
        digest.update(str(tokenizer.vocab_size).encode())
    return digest.hexdigest()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_same_tokenizer(actor: ModelSpec, critic: ModelSpec) -> None:
    """Raise unless the critic's model reads token ids as the actor's tokenizer writes them. A
    critic directory without tokenizer files of its own takes the actor's `model.tokenizer`, when set."""
    from ppo_trainer.models.sources import resolve_model_dir

    directory = resolve_model_dir(critic.path)
    if (critic.tokenizer is None and directory is not None
            and not any((directory / name).exists() for name in TOKENIZER_FILES)):
        if actor.tokenizer is not None:
            return
        raise ValueError(
            f"critic.model {critic.path!r} holds no tokenizer ({', '.join(TOKENIZER_FILES)}) to check against the"
            " actor's: add the actor's tokenizer files to it, or set model.tokenizer, which the critic then reads too"
        )
    actor_tokenizer, critic_tokenizer = load_tokenizer(actor), load_tokenizer(critic)
    if vocabulary_fingerprint(actor_tokenizer) != vocabulary_fingerprint(critic_tokenizer):
        raise ValueError(
            f"critic.model {critic.path!r} has another tokenizer than the actor's"
            f" ({critic.tokenizer or critic.path!r}: {critic_tokenizer.vocab_size} tokens, EOS"
            f" {critic_tokenizer.eos_token_id}; the actor's {actor.tokenizer or actor.path!r}:"
            f" {actor_tokenizer.vocab_size} tokens, EOS {actor_tokenizer.eos_token_id}): the critic values the"
            " actor's token ids, so choose a critic of the same model family (same tokenizer)"
        )
