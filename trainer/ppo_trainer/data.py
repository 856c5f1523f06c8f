"""Prompts: the `Prompt` record (a text or a chat conversation), a synthetic task, and a resumable,
seeded batch sampler.

A ``PromptSampler`` is a pure function of (prompts, seed, state): its ``state_dict()`` saved in a
checkpoint and restored with ``load_state_dict()`` continues with exactly the batches that would
have come next. Prompt files are read in ``prompt_files.py``. Nothing here may depend on torch,
Ray, tokenizers or configuration objects.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["CHAT_ROLES", "SYNTHETIC_SET_SIZE", "ChatMessage", "Prompt", "PromptSampler", "synthetic_prompts"]

SYNTHETIC_SET_SIZE = 1024
"""How many prompts `synthetic` stands for (data.prompts, data.validation.prompts)."""

CHAT_ROLES = ("system", "user", "assistant")
"""The roles a chat prompt's messages may have."""


@dataclass(frozen=True)
class ChatMessage:
    """One turn of a chat prompt."""

    role: str
    """system, user or assistant."""
    content: str


@dataclass(frozen=True)
class Prompt:
    """One prompt and, for rule-based rewards, its reference answer."""

    text: str
    """The prompt as rewards and logs see it: the text itself, or a chat prompt's messages as
    ``role: content`` lines."""
    label: str | None = None
    """The reference answer (e.g. the final number), or None when the reward needs none."""
    messages: tuple[ChatMessage, ...] | None = None
    """A chat prompt's conversation, which the policy sees through its tokenizer's chat template;
    None for a text prompt."""

    @classmethod
    def chat(cls, messages: Sequence[ChatMessage], label: str | None = None) -> Prompt:
        """A chat prompt, its ``text`` the messages as ``role: content`` lines."""
        messages = tuple(messages)
        return cls(text="\n".join(f"{m.role}: {m.content}" for m in messages), label=label, messages=messages)


_SYNTHETIC_TEMPLATES = (
    "Write the letter {target} as many times as you can.",
    "Reply with a long run of the letter {target}.",
    "Repeat '{target}' over and over.",
    "Say {target}{target}{target}{target}...",
)


def synthetic_prompts(n: int, *, seed: int, target: str = "a") -> list[Prompt]:
    """``n`` prompts for the synthetic task (``rewards.SyntheticReward``), reproducible from ``seed``.

    Each is one of a few instructions to write ``target`` repeatedly, followed by a random tag of
    lowercase letters so that prompts differ; the label is ``target``.
    """
    if n < 1:
        raise ValueError(f"n={n} must be >= 1")
    rng = random.Random(f"synthetic-prompts:{seed}")
    prompts = []
    for _ in range(n):
        template = rng.choice(_SYNTHETIC_TEMPLATES)
        tag = "".join(rng.choice("bcdfghjklmnpqrstvwxyz") for _ in range(rng.randint(2, 6)))
        prompts.append(Prompt(text=f"{template.format(target=target)} [{tag}]", label=target))
    return prompts


class PromptSampler:
    """Yields batches of ``batch_size`` prompts from an endless stream of shuffled epochs.

    Epoch ``e`` visits every prompt once, in an order fixed by ``(seed, e)`` (or in file order
    with ``shuffle=False``); a batch that runs past the end of an epoch continues into the next,
    so every batch is full. The state is ``(epoch, position)``: the next prompt is at
    ``position`` in epoch ``epoch``'s order.
    """

    def __init__(
        self, prompts: Sequence[Prompt], batch_size: int, *, seed: int, shuffle: bool = True
    ) -> None:
        if not prompts:
            raise ValueError("PromptSampler needs at least one prompt; got an empty list")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        self.prompts = list(prompts)
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order_epoch = -1
        self._order: list[int] = []

    def _epoch_order(self, epoch: int) -> list[int]:
        if epoch != self._order_epoch:
            order = list(range(len(self.prompts)))
            if self.shuffle:
                random.Random(f"prompt-sampler:{self.seed}:{epoch}").shuffle(order)
            self._order_epoch, self._order = epoch, order
        return self._order

    def next_batch(self) -> list[Prompt]:
        """The next ``batch_size`` prompts; advances the state."""
        batch = []
        while len(batch) < self.batch_size:
            order = self._epoch_order(self.epoch)
            take = min(self.batch_size - len(batch), len(order) - self.position)
            batch.extend(self.prompts[i] for i in order[self.position : self.position + take])
            self.position += take
            if self.position == len(order):
                self.epoch, self.position = self.epoch + 1, 0
        return batch

    def __iter__(self) -> Iterator[list[Prompt]]:
        return self

    def __next__(self) -> list[Prompt]:
        return self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint stores to resume exactly: epoch, position, and what they refer to."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_prompts": len(self.prompts),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; ValueError when it was saved for another dataset, seed or order."""
        missing = sorted({"epoch", "position", "seed", "shuffle", "num_prompts"} - set(state))
        if missing:
            raise ValueError(
                f"PromptSampler state is missing {', '.join(missing)}; it must come from state_dict()"
            )
        for key, mine in (("seed", self.seed), ("shuffle", self.shuffle), ("num_prompts", len(self.prompts))):
            if state[key] != mine:
                raise ValueError(
                    f"PromptSampler state was saved with {key}={state[key]!r} but this sampler has "
                    f"{key}={mine!r}; resume with the same prompts, seed and shuffle setting"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < len(self.prompts):
            raise ValueError(
                f"PromptSampler state has epoch={epoch}, position={position}; expected epoch >= 0 and "
                f"0 <= position < {len(self.prompts)}"
            )
        self.epoch, self.position = epoch, position
