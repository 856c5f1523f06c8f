"""The critic's values to the actor by sample id, whatever the two roles' data-parallel sizes.

A role's data rank d of D holds the rows d::D of the step's merged batch (`RolloutBatch.shard`);
a row's index there is its sample id. Each critic rank returns `CriticValues`: its sample ids
with their values and returns, exactly as computed. The driver hands every actor rank the refs of
the critic data ranks that can hold its samples (`ranks_sharing_samples`, decided from the two
sizes alone, so the driver never needs the data); Ray resolves them before the actor's task runs, and
the actor picks its rows by id (`gather_values`), a copy of the same bits. The actor's and the reference's log-probs go
the other way the same way (`gather_rows`), so both roles use the same rewards. Pure functions of
tensors; no Ray, no model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class CriticValues:
    """What a critic rank hands on: `values` BEFORE its update (the actor's baseline) and the
    `returns` it trained on, float32 on CPU, one row per sample id."""

    sample_ids: torch.Tensor
    """[B_rank] int64: rows of the step's merged batch."""
    values: torch.Tensor
    """[B_rank, T] float32."""
    returns: torch.Tensor
    """[B_rank, T] float32."""
    metrics: dict[str, float] = field(default_factory=dict)


def shard_sample_ids(batch_size: int, *, data_rank: int, data_size: int) -> torch.Tensor:
    """The sample ids data rank `data_rank` of `data_size` holds: data_rank, data_rank + data_size, ..."""
    return torch.arange(data_rank, batch_size, data_size)


def ranks_sharing_samples(*, data_rank: int, data_size: int, other_data_size: int) -> list[int]:
    """The data ranks of another role (`other_data_size` of them) that may hold samples of data rank
    `data_rank` of `data_size`: the critic ranks an actor rank takes values from, and the actor
    ranks a critic rank takes log-probs from.

    Sample s is on rank s % D here and s % O there; both hold it exactly when s = d (mod D) and
    s = o (mod O), which some s solves iff gcd(D, O) divides o - d.
    """
    if not 0 <= data_rank < data_size:
        raise ValueError(f"data rank {data_rank} is not in 0..{data_size - 1}")
    step = math.gcd(data_size, other_data_size)
    return [o for o in range(other_data_size) if (o - data_rank) % step == 0]


def gather_rows(sources: Sequence[tuple[torch.Tensor, torch.Tensor]], sample_ids: torch.Tensor) -> torch.Tensor:
    """The rows of `sample_ids`, in that order, from (sample ids, [n, T] tensor) pairs of another
    role's ranks: the actor's log-probs for a critic rank of another data-parallel size."""
    outputs = [CriticValues(sample_ids=ids, values=tensor, returns=tensor) for ids, tensor in sources]
    return gather_values(outputs, sample_ids)[0]


def gather_values(outputs: Sequence[CriticValues], sample_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Values and returns of `sample_ids`, in that order, taken row for row from the critic outputs."""
    if not outputs:
        raise ValueError("no critic outputs to take values from: pass the refs ranks_sharing_samples names")
    owner: dict[int, tuple[int, int]] = {}
    for index, output in enumerate(outputs):
        for row, sample in enumerate(output.sample_ids.tolist()):
            owner[sample] = (index, row)
    missing = [s for s in sample_ids.tolist() if s not in owner]
    if missing:
        held = sorted(owner)
        raise ValueError(
            f"the critic outputs hold samples {held[:8]}{'...' if len(held) > 8 else ''} but not {missing[:8]}: "
            "the actor and the critic sharded different batches"
        )
    widths = {o.values.shape[1] for o in outputs}
    if len(widths) != 1:
        raise ValueError(f"critic outputs of different response lengths {sorted(widths)}: they come from different batches")
    values = torch.empty((len(sample_ids), widths.pop()), dtype=outputs[0].values.dtype)
    returns = torch.empty_like(values)
    for position, sample in enumerate(sample_ids.tolist()):
        index, row = owner[sample]
        values[position] = outputs[index].values[row]
        returns[position] = outputs[index].returns[row]
    return values, returns
