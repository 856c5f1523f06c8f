"""The rollout/training log-prob mismatch and truncated importance sampling against plain loops."""

from __future__ import annotations

import math

import pytest
import torch

from ppo_trainer.algorithms import (
    LOG_RATIO_BOUND,
    log_prob_mismatch,
    policy_loss,
    summarize_mismatch,
    truncated_importance_weights,
)

LENGTHS = [4, 1, 0, 3, 4]


def make_mask() -> torch.Tensor:
    mask = torch.zeros(len(LENGTHS), 4, dtype=torch.float64)
    for row, n in enumerate(LENGTHS):
        mask[row, :n] = 1.0
    return mask


def randn(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def log_probs(seed: int, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, rollout) log-probs: rollout close to train, NaN on padding (never read)."""
    train = -randn(*mask.shape, seed=seed).abs() - 0.1
    rollout = train + 0.3 * randn(*mask.shape, seed=seed + 1)
    nan = torch.full_like(train, float("nan"))
    return torch.where(mask.bool(), train, nan), torch.where(mask.bool(), rollout, nan)


def ref_mismatch(train, rollout, mask) -> dict[str, float]:
    ratios = [float(train[b, t] - rollout[b, t]) for b in range(mask.shape[0]) for t in range(mask.shape[1])
              if mask[b, t]]
    return {
        "rollout_log_ratio_mean": sum(ratios) / len(ratios),
        "rollout_log_ratio_abs_max": max(abs(r) for r in ratios),
        "rollout_k3": sum(math.exp(r) - 1 - r for r in ratios) / len(ratios),  # KL(rollout || train), sampled by rollout
    }


def test_mismatch_of_one_rank_and_of_shards_combined_match_the_loop():
    mask = make_mask()
    train, rollout = log_probs(1, mask)
    expected = ref_mismatch(train, rollout, mask)
    whole = summarize_mismatch([log_prob_mismatch(train, rollout, mask)])
    shards = summarize_mismatch([log_prob_mismatch(train[r::2], rollout[r::2], mask[r::2]) for r in range(2)])
    for got in (whole, shards):
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            assert got[key] == pytest.approx(value, rel=1e-12), key


def test_mismatch_is_zero_when_the_engine_and_the_trainer_agree_and_for_no_tokens():
    mask = make_mask()
    train, _ = log_probs(2, mask)
    same = summarize_mismatch([log_prob_mismatch(train, train.clone(), mask)])
    assert same == {"rollout_log_ratio_mean": 0.0, "rollout_log_ratio_abs_max": 0.0, "rollout_k3": 0.0}
    empty = torch.zeros(2, 3)
    assert summarize_mismatch([log_prob_mismatch(empty, empty, empty)])["rollout_k3"] == 0.0
    assert summarize_mismatch([]) == {"rollout_log_ratio_mean": 0.0, "rollout_log_ratio_abs_max": 0.0,
                                      "rollout_k3": 0.0}


@pytest.mark.parametrize("cap", [1.0, 2.0, 10.0])
def test_truncated_importance_weights_match_the_loop(cap):
    mask = make_mask()
    train, rollout = log_probs(3, mask)
    weights = truncated_importance_weights(train, rollout, mask, cap=cap)
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            expected = min(math.exp(float(train[b, t] - rollout[b, t])), cap) if mask[b, t] else 0.0
            assert weights[b, t].item() == pytest.approx(expected, rel=1e-12)
    assert weights.max().item() <= cap


def test_truncated_importance_weights_are_finite_for_extreme_log_ratios_and_carry_no_gradient():
    train = torch.tensor([[0.0, -1e4, -1.0]], requires_grad=True)
    rollout = torch.tensor([[-1e4, 0.0, -1.0]])
    weights = truncated_importance_weights(train, rollout, torch.ones(1, 3), cap=2.0)
    assert weights.tolist() == [[2.0, pytest.approx(math.exp(-LOG_RATIO_BOUND)), 1.0]]
    assert not weights.requires_grad


def test_truncated_importance_weights_reject_a_cap_below_one():
    with pytest.raises(ValueError, match="cap=0.5 must be >= 1"):
        truncated_importance_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), cap=0.5)


def test_corrected_policy_loss_weights_each_tokens_clipped_loss_like_the_loop():
    """TIS: each token's PPO loss max(-A r, -A clip(r)) times min(pi_old / pi_rollout, cap), token mean."""
    mask = make_mask()
    old, rollout = log_probs(4, mask)
    logp = torch.where(mask.bool(), old + 0.4 * randn(*mask.shape, seed=6), old).requires_grad_()
    adv = randn(*mask.shape, seed=7)
    weights = truncated_importance_weights(old, rollout, mask, cap=1.5)
    loss, _ = policy_loss(logp, old, adv, mask, clip_eps=0.2, token_weights=weights)
    terms = []
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if not mask[b, t]:
                continue
            a, ratio = float(adv[b, t]), math.exp(float(logp.detach()[b, t] - old[b, t]))
            tis = min(math.exp(float(old[b, t] - rollout[b, t])), 1.5)
            terms.append(tis * max(-a * ratio, -a * min(max(ratio, 0.8), 1.2)))
    assert loss.item() == pytest.approx(sum(terms) / len(terms), rel=1e-12)
    loss.backward()
    unweighted = torch.autograd.grad(policy_loss(logp, old, adv, mask, clip_eps=0.2)[0], logp)[0]
    torch.testing.assert_close(logp.grad, unweighted * weights, rtol=1e-12, atol=1e-15)
