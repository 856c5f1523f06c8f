"""How per-token losses become one loss that does not depend on how the batch is split.

A training step's batch is cut into micro-batches (gradient accumulation) and data-parallel
shards. Each micro-batch contributes a *term*: its per-token losses summed (per sequence, then
over sequences, as the mode says) and divided by a count of the WHOLE batch (`BatchCounts`, over
every micro-batch of every rank, taken once per step). The terms of all micro-batches of all
ranks add up to the loss of the whole batch, so summing their gradients gives the update of one
big batch whatever the micro-batch size and the number of ranks. (A mean per micro-batch, weighted
by its share of rows, is neither a token mean nor a sequence mean once response lengths differ.)

Modes (`ppo.lossAggregation`):
    TokenMean              sum over the batch's tokens / the batch's tokens
    SequenceMeanTokenMean  sum over sequences of (the sequence's token mean) / the batch's sequences
    SequenceMeanTokenSum   sum over sequences of (the sequence's token sum) / the batch's sequences
Sequences count when they have at least one valid token. Pure tensor functions; nothing here may
depend on Ray, process groups or configuration objects.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["LOSS_AGGREGATIONS", "TOKEN_MEAN", "BatchCounts", "aggregate_loss", "batch_counts"]

TOKEN_MEAN = "TokenMean"
LOSS_AGGREGATIONS = (TOKEN_MEAN, "SequenceMeanTokenMean", "SequenceMeanTokenSum")


@dataclass(frozen=True)
class BatchCounts:
    """What every micro-batch's term is divided by: counts of the whole batch of one optimizer step."""

    tokens: int
    """Valid response tokens, over every micro-batch and every data-parallel rank."""
    sequences: int
    """Rows with at least one valid token, likewise."""


def batch_counts(mask: Tensor) -> BatchCounts:
    """Counts of a whole batch from its response mask ``[B, T]`` (take it before splitting the batch)."""
    valid = mask.bool()
    return BatchCounts(tokens=int(valid.sum()), sequences=int(valid.any(dim=-1).sum()))


def aggregate_loss(per_token: Tensor, mask: Tensor, *, mode: str, counts: BatchCounts) -> Tensor:
    """This micro-batch's term of the whole batch's loss (a scalar; see the module docstring).

    per_token, mask: ``[b, T]`` for the micro-batch's rows; `counts` of the whole batch. Entries
    outside the mask never contribute, even when NaN or inf. An empty batch gives 0.
    """
    if tuple(per_token.shape) != tuple(mask.shape):
        raise ValueError(f"per_token {tuple(per_token.shape)} and mask {tuple(mask.shape)} must have the same shape")
    valid = mask.bool()
    summed = torch.where(valid, per_token * mask.to(per_token.dtype), torch.zeros_like(per_token))
    if mode == TOKEN_MEAN:
        return summed.sum() / max(counts.tokens, 1)
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; valid choices: {', '.join(LOSS_AGGREGATIONS)}")
    per_sequence = summed.sum(dim=-1)
    if mode == "SequenceMeanTokenMean":
        lengths = mask.to(per_token.dtype).sum(dim=-1)
        per_sequence = torch.where(lengths > 0, per_sequence / lengths.clamp(min=1), torch.zeros_like(per_sequence))
    return per_sequence.sum() / max(counts.sequences, 1)
