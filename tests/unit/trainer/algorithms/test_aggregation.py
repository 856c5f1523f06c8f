"""Loss aggregation against plain loops: each mode on a whole batch, and the terms of any split of it
(micro-batches, data-parallel shards of rows) adding up to the same loss and gradient. Seeded, float64."""

from __future__ import annotations

import pytest
import torch

from ppo_trainer.algorithms import (
    LOSS_AGGREGATIONS,
    BatchCounts,
    aggregate_loss,
    batch_counts,
    policy_loss,
    value_loss,
)

LENGTHS = [5, 1, 0, 3, 6, 2, 6, 4]  # ragged, with a length-1 and an empty response
T = 6


def make_mask(lengths=LENGTHS) -> torch.Tensor:
    mask = torch.zeros(len(lengths), T, dtype=torch.float64)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1.0
    return mask


def randn(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def poison_padding(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask.bool(), x, torch.full_like(x, float("nan")))


def ref_aggregate(x, mask, mode: str) -> float:
    """The mode's definition on a whole batch, one token at a time."""
    rows = [[float(x[b, t]) for t in range(x.shape[1]) if mask[b, t]] for b in range(x.shape[0])]
    tokens = [v for row in rows for v in row]
    sequences = [row for row in rows if row]
    if mode == "TokenMean":
        return sum(tokens) / len(tokens)
    if mode == "SequenceMeanTokenMean":
        return sum(sum(row) / len(row) for row in sequences) / len(sequences)
    return sum(sum(row) for row in sequences) / len(sequences)


def splits(batch_size: int):
    """Row index sets of one batch: whole; micro-batches of 1 and 3; 2 and 3 data-parallel shards of
    rows r::R, each in micro-batches of 2."""
    rows = torch.arange(batch_size)
    yield "whole", [rows]
    yield "micro-batch 1", list(rows.split(1))
    yield "micro-batch 3", list(rows.split(3))
    for ranks in (2, 3):
        yield f"{ranks} ranks x micro-batch 2", [part for r in range(ranks) for part in rows[r::ranks].split(2)]


def test_batch_counts_count_valid_tokens_and_non_empty_rows():
    assert batch_counts(make_mask()) == BatchCounts(tokens=sum(LENGTHS), sequences=7)
    assert batch_counts(torch.zeros(2, 3)) == BatchCounts(tokens=0, sequences=0)


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
def test_aggregate_loss_terms_of_every_split_add_up_to_the_mode_on_the_whole_batch(mode):
    mask = make_mask()
    x = poison_padding(randn(len(LENGTHS), T, seed=1), mask).requires_grad_()
    counts = batch_counts(mask)
    expected = ref_aggregate(x.detach(), mask, mode)
    gradients = []
    for name, parts in splits(len(LENGTHS)):
        x.grad = None
        total = sum(aggregate_loss(x[rows], mask[rows], mode=mode, counts=counts) for rows in parts)
        total.backward()
        assert total.item() == pytest.approx(expected, rel=1e-12), name
        gradients.append(x.grad.clone())
    for grad in gradients[1:]:
        torch.testing.assert_close(grad, gradients[0], rtol=1e-12, atol=0)
    assert torch.all(gradients[0][mask == 0] == 0)


def test_aggregate_loss_gradient_weights_by_mode():
    """TokenMean: 1/N per token; SequenceMeanTokenMean: 1/(S * length); SequenceMeanTokenSum: 1/S."""
    mask = make_mask()
    lengths = mask.sum(-1, keepdim=True)
    counts = batch_counts(mask)
    expected = {
        "TokenMean": mask / counts.tokens,
        "SequenceMeanTokenMean": mask / (counts.sequences * lengths.clamp(min=1)),
        "SequenceMeanTokenSum": mask / counts.sequences,
    }
    for mode, weights in expected.items():
        x = torch.zeros(len(LENGTHS), T, dtype=torch.float64, requires_grad=True)
        aggregate_loss(x, mask, mode=mode, counts=counts).backward()
        torch.testing.assert_close(x.grad, weights, rtol=1e-12, atol=0)


def test_aggregate_loss_of_an_empty_batch_is_zero_with_a_zero_gradient():
    x = torch.ones(2, 3, requires_grad=True)
    for mode in LOSS_AGGREGATIONS:
        loss = aggregate_loss(x, torch.zeros(2, 3), mode=mode, counts=BatchCounts(tokens=0, sequences=0))
        loss.backward()
        assert loss.item() == 0.0 and torch.all(x.grad == 0)


def test_aggregate_loss_unknown_mode_lists_the_choices():
    with pytest.raises(ValueError, match=r"'MeanOfMeans'.*TokenMean, SequenceMeanTokenMean, SequenceMeanTokenSum"):
        aggregate_loss(torch.zeros(1, 1), torch.ones(1, 1), mode="MeanOfMeans", counts=BatchCounts(1, 1))


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
def test_policy_loss_and_its_statistics_add_up_over_splits(mode):
    mask = make_mask()
    shape = mask.shape
    old_logp = poison_padding(-randn(*shape, seed=2).abs(), mask)
    logp = poison_padding(old_logp + 0.5 * randn(*shape, seed=3), mask).requires_grad_()
    adv = poison_padding(randn(*shape, seed=4), mask)
    counts = batch_counts(mask)
    kwargs = {"clip_eps": 0.2, "dual_clip": 3.0, "aggregation": mode}
    whole_loss, whole_stats = policy_loss(logp, old_logp, adv, mask, **kwargs)
    (whole_grad,) = torch.autograd.grad(whole_loss, logp)
    for name, parts in splits(len(LENGTHS)):
        terms = [policy_loss(logp[r], old_logp[r], adv[r], mask[r], counts=counts, **kwargs) for r in parts]
        total = sum(loss for loss, _ in terms)
        (grad,) = torch.autograd.grad(total, logp)
        assert total.item() == pytest.approx(whole_loss.item(), rel=1e-12), name
        torch.testing.assert_close(grad, whole_grad, rtol=1e-12, atol=1e-15)
        for key, value in whole_stats.items():
            assert sum(stats[key] for _, stats in terms).item() == pytest.approx(value.item(), rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
def test_value_loss_adds_up_over_splits_and_matches_the_loop(mode):
    mask = make_mask()
    shape = mask.shape
    old_values = poison_padding(randn(*shape, seed=5), mask)
    values = poison_padding(old_values + randn(*shape, seed=6), mask).requires_grad_()
    returns = poison_padding(randn(*shape, seed=7), mask)
    counts = batch_counts(mask)
    v_clipped = old_values + torch.clamp(values.detach() - old_values, -0.2, 0.2)
    per_token = 0.5 * torch.maximum((values.detach() - returns) ** 2, (v_clipped - returns) ** 2)
    expected = ref_aggregate(per_token, mask, mode)
    grads = []
    for name, parts in splits(len(LENGTHS)):
        total = sum(value_loss(values[r], old_values[r], returns[r], mask[r], clip_range=0.2, aggregation=mode,
                               counts=counts)[0] for r in parts)
        assert total.item() == pytest.approx(expected, rel=1e-12), name
        grads.append(torch.autograd.grad(total, values)[0])
    for grad in grads[1:]:
        torch.testing.assert_close(grad, grads[0], rtol=1e-12, atol=1e-15)
