"""Typed records that flow through one PPO step: what rollout produces, what training consumes.

Layout of a batch of B sequences: each prompt is LEFT-padded to P tokens, each response is
RIGHT-padded to T tokens, so `tokens` is [B, P+T] and position P+t holds response token t. The
logits at position P+t-1 predict response token t. Depends on torch only.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch


@dataclass(frozen=True)
class RolloutBatch:
    """A generated and scored batch; everything on CPU."""

    tokens: torch.Tensor
    """[B, P+T] int64: left-padded prompt, then right-padded response."""
    attention_mask: torch.Tensor
    """[B, P+T] int64: 1 for real tokens (prompt or response), 0 for padding."""
    response_mask: torch.Tensor
    """[B, T] float32: 1 for real response tokens (up to and including EOS)."""
    prompt_length: int
    """P: the padded prompt length."""
    rollout_log_probs: torch.Tensor
    """[B, T] float32: log-probabilities of the sampled tokens under the rollout engine."""
    scores: torch.Tensor
    """[B] float32: sequence rewards from the reward function."""
    prompts: list[str] = field(default_factory=list)
    responses: list[str] = field(default_factory=list)

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def response_length(self) -> int:
        return int(self.response_mask.shape[1])

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_mask.sum().item())

    def shard(self, rank: int, world_size: int) -> RolloutBatch:
        """Rows rank::world_size, so that rank i of the actor and rank i of the critic see the same rows."""
        rows = torch.arange(rank, self.size, world_size)
        return replace(
            self,
            tokens=self.tokens[rows],
            attention_mask=self.attention_mask[rows],
            response_mask=self.response_mask[rows],
            rollout_log_probs=self.rollout_log_probs[rows],
            scores=self.scores[rows],
            prompts=[self.prompts[i] for i in rows.tolist()] if self.prompts else [],
            responses=[self.responses[i] for i in rows.tolist()] if self.responses else [],
        )
