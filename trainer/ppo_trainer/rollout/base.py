"""The seam between the PPO loop and a rollout engine (the built-in torch engine, SGLang).

An engine turns token prompts into sampled responses with their log-probabilities, takes new
weights from the actor, and can release its memory (sleep) and take it back (wake up). An engine
in front of server processes (SGLang) is also a `ServedEngine`: a weight-sync path may then have
its servers take the weights themselves (`weight_sync/broadcast.py`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0


@dataclass(frozen=True)
class Generation:
    """Responses for a list of prompts, right-padded to T = the longest response."""

    response_tokens: torch.Tensor
    """[B, T] int64, padded with the pad token."""
    response_mask: torch.Tensor
    """[B, T] float32: 1 up to and including the EOS token (or max_new_tokens)."""
    log_probs: torch.Tensor
    """[B, T] float32: log-probabilities of the sampled tokens (after temperature), 0 on padding."""


class RolloutEngine(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> Generation: ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new policy weights (Hugging Face names) into the served model."""
        ...

    def sleep(self) -> None:
        """Release the weights' and KV cache's device memory."""
        ...

    def wake_up(self) -> None: ...


@runtime_checkable
class ServedEngine(Protocol):
    """An engine in front of server processes, each speaking SGLang's HTTP API (`SGLangClient`)."""

    servers: list[Any]
    """One client per server."""
    tensor_parallel: int
    """Devices (and ranks of a weight-update group) per server."""
