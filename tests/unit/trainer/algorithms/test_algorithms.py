"""The PPO math against plain loop references: seeded, on CPU, in float64."""

from __future__ import annotations

import math

import pytest
import torch

from ppo_trainer.algorithms import (
    K3_BOUND,
    KL_ESTIMATORS,
    LOG_RATIO_BOUND,
    entropy_from_logits,
    gae,
    kl_penalty,
    kl_shaped_rewards,
    log_probs_from_logits,
    masked_mean,
    masked_moments,
    masked_sum,
    masked_whiten,
    policy_loss,
    value_loss,
)

# ---------------------------------------------------------------------------------------------
# Fixtures: right-padded batches with ragged lengths, including length-1 and empty responses.


def make_mask(lengths: list[int], T: int) -> torch.Tensor:
    mask = torch.zeros(len(lengths), T, dtype=torch.float64)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1.0
    return mask


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


CASES = {
    "ragged": ([5, 1, 3, 5], 5),
    "length_one": ([1, 1, 1], 1),
    "with_empty_row": ([0, 4, 2], 4),
    "full": ([6, 6], 6),
}


@pytest.fixture(params=list(CASES), ids=list(CASES))
def mask(request) -> torch.Tensor:
    lengths, T = CASES[request.param]
    return make_mask(lengths, T)


def poison_padding(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """NaN where the mask is 0: a correct masked function must never read these."""
    return torch.where(mask.bool(), x, torch.full_like(x, float("nan")))


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


# ---------------------------------------------------------------------------------------------
# Masked reductions


def ref_masked_sum_mean(x, mask):
    total, count = 0.0, 0
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            if mask[b, t]:
                total += float(x[b, t])
                count += 1
    return total, (total / count if count else 0.0)


def test_masked_sum_and_mean_match_loop_and_ignore_padding(mask):
    x = poison_padding(randn(*mask.shape, seed=0), mask)
    total, mean = ref_masked_sum_mean(x, mask)
    close(masked_sum(x, mask), torch.tensor(total, dtype=torch.float64))
    close(masked_mean(x, mask), torch.tensor(mean, dtype=torch.float64))


def test_masked_mean_along_dim_matches_loop():
    mask = make_mask([3, 0, 1], 3)
    x = poison_padding(randn(3, 3, seed=1), mask)
    per_row = masked_mean(x, mask, dim=1)
    for b in range(3):
        _, mean = ref_masked_sum_mean(x[b : b + 1], mask[b : b + 1])
        assert per_row[b].item() == pytest.approx(mean, rel=1e-12)
    assert per_row[1].item() == 0.0  # empty row: 0, not NaN
    close(masked_sum(x, mask, dim=0), torch.nan_to_num(x * mask, nan=0.0).sum(0))


def test_masked_mean_accepts_bool_mask():
    mask = make_mask([2, 1], 3)
    x = randn(2, 3, seed=2)
    close(masked_mean(x, mask.bool()), masked_mean(x, mask))


def test_masked_mean_shape_mismatch_names_the_tensors():
    with pytest.raises(ValueError, match=r"x \(2, 3\), mask \(2, 4\)"):
        masked_mean(torch.zeros(2, 3), torch.ones(2, 4))


@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten_matches_loop(mask, shift_mean):
    if not mask.any():
        pytest.skip("no valid entries")
    x = poison_padding(3.0 + 2.0 * randn(*mask.shape, seed=3), mask)
    valid = [float(x[b, t]) for b in range(x.shape[0]) for t in range(x.shape[1]) if mask[b, t]]
    mean = sum(valid) / len(valid)
    var = sum((v - mean) ** 2 for v in valid) / len(valid)
    expected = torch.zeros_like(x)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            if mask[b, t]:
                w = (float(x[b, t]) - mean) / math.sqrt(var + 1e-8)
                expected[b, t] = w if shift_mean else w + mean
    close(masked_whiten(x, mask, shift_mean=shift_mean), expected)


def test_masked_whiten_gives_zero_mean_unit_variance_on_valid_entries():
    mask = make_mask([7, 3, 5], 7)
    out = masked_whiten(5.0 + 4.0 * randn(3, 7, seed=4), mask)
    assert masked_mean(out, mask).abs().item() < 1e-12
    assert masked_mean(out**2, mask).item() == pytest.approx(1.0, rel=1e-6)
    assert (out[mask == 0] == 0).all()


@pytest.mark.parametrize("ranks", [2, 3])
def test_masked_whiten_of_shards_with_summed_moments_equals_whitening_the_whole_batch(ranks):
    """Data-parallel ranks whiten their rows r::R with the sum of every rank's moments: the
    advantages are the same as with one rank whitening the whole batch."""
    mask = make_mask([5, 1, 0, 3, 6, 2, 6, 4, 3], 6)
    x = poison_padding(3.0 + 2.0 * randn(9, 6, seed=31), mask)
    whole = masked_whiten(x, mask)
    shards = [torch.arange(r, 9, ranks) for r in range(ranks)]
    moments = sum(masked_moments(x[rows], mask[rows]) for rows in shards)
    torch.testing.assert_close(moments, masked_moments(x, mask), rtol=1e-12, atol=0)
    for rows in shards:
        close(masked_whiten(x[rows], mask[rows], moments=moments), whole[rows])
        assert not torch.allclose(masked_whiten(x[rows], mask[rows]), whole[rows])  # its own moments differ


def test_masked_moments_count_sum_and_squares():
    mask = make_mask([2, 1], 2)
    x = torch.tensor([[1.0, 2.0], [3.0, float("nan")]])
    assert masked_moments(x, mask).tolist() == [3.0, 6.0, 14.0]


# ---------------------------------------------------------------------------------------------
# KL estimators and KL-shaped rewards


def ref_kl(lp: float, ref: float, estimator: str) -> float:
    log_r = ref - lp
    return {"k1": -log_r, "k2": 0.5 * log_r**2, "k3": math.exp(log_r) - log_r - 1.0}[estimator]


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_kl_penalty_matches_formulas(estimator):
    logp, ref_logp = -randn(3, 4, seed=5).abs(), -randn(3, 4, seed=6).abs()
    out = kl_penalty(logp, ref_logp, estimator=estimator)
    expected = torch.tensor(
        [[ref_kl(float(logp[b, t]), float(ref_logp[b, t]), estimator) for t in range(4)] for b in range(3)],
        dtype=torch.float64,
    )
    close(out, expected)
    if estimator != "k1":
        assert (out >= 0).all()


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_kl_penalty_is_zero_for_identical_policies(estimator):
    logp = -randn(2, 3, seed=7).abs()
    assert (kl_penalty(logp, logp.clone(), estimator=estimator) == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_k3_reward_stays_finite_and_bounded_for_extreme_log_ratios(dtype):
    """Past a log-ratio of ~88, exp overflows float32: without a clamp the reward is -inf, or NaN
    with kl_coef 0. The k3 term is bounded by K3_BOUND; its gradient is finite too."""
    ref_logp = torch.tensor([[0.0, -1e4, -200.0, -95.0, -1.0]], dtype=dtype)
    logp = torch.tensor([[-1e4, 0.0, -1.0, -1.0, -1.0]], dtype=dtype, requires_grad=True)
    mask = torch.ones(1, 5)
    k3 = kl_penalty(logp, ref_logp, estimator="k3")
    assert torch.isfinite(k3).all() and (k3 >= 0).all() and (k3 <= K3_BOUND).all()
    assert k3[0, -1].item() == 0.0 and k3[0, 0].item() == K3_BOUND
    k3.sum().backward()
    assert torch.isfinite(logp.grad).all()
    for kl_coef in (0.0, 0.1):
        rewards = kl_shaped_rewards(torch.ones(1), logp.detach(), ref_logp, mask, kl_coef=kl_coef, estimator="k3")
        advantages, returns = gae(rewards.float(), torch.zeros(1, 5), mask, gamma=1.0, lam=0.95)
        for tensor in (rewards, advantages, returns, masked_whiten(advantages, mask)):
            assert torch.isfinite(tensor).all(), kl_coef


def test_kl_penalty_unknown_estimator_lists_choices():
    with pytest.raises(ValueError, match=r"'k4'.*k1, k2, k3"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), estimator="k4")


def test_kl_estimators_approach_true_kl_on_samples():
    # Sample from pi; the mean of k1 and k3 estimates KL(pi || ref) without bias.
    gen = torch.Generator().manual_seed(8)
    pi = torch.softmax(torch.randn(6, generator=gen, dtype=torch.float64), 0)
    ref = torch.softmax(torch.randn(6, generator=gen, dtype=torch.float64), 0)
    true_kl = float((pi * (pi.log() - ref.log())).sum())
    samples = torch.multinomial(pi, 200_000, replacement=True, generator=gen)
    logp, ref_logp = pi.log()[samples][None], ref.log()[samples][None]
    for estimator in ("k1", "k3"):
        assert kl_penalty(logp, ref_logp, estimator=estimator).mean().item() == pytest.approx(
            true_kl, abs=0.01
        )


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_kl_shaped_rewards_match_loop(mask, estimator):
    B, T = mask.shape
    scores = randn(B, seed=9)
    logp = poison_padding(-randn(B, T, seed=10).abs(), mask)
    ref_logp = poison_padding(-randn(B, T, seed=11).abs(), mask)
    expected = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        valid = [t for t in range(T) if mask[b, t]]
        for t in valid:
            expected[b, t] = -0.05 * ref_kl(float(logp[b, t]), float(ref_logp[b, t]), estimator)
        if valid:
            expected[b, valid[-1]] += float(scores[b])
    out = kl_shaped_rewards(scores, logp, ref_logp, mask, kl_coef=0.05, estimator=estimator)
    close(out, expected)


def test_kl_shaped_rewards_without_kl_put_the_score_on_the_last_token():
    mask = make_mask([3, 1, 0], 4)
    out = kl_shaped_rewards(
        torch.tensor([1.0, 2.0, 3.0]),
        torch.zeros(3, 4),
        torch.ones(3, 4),
        mask.float(),
        kl_coef=0.0,
        estimator="k1",
    )
    expected = torch.tensor([[0, 0, 1.0, 0], [2.0, 0, 0, 0], [0, 0, 0, 0]])
    torch.testing.assert_close(out, expected)


def test_kl_shaped_rewards_wrong_score_shape_is_explained():
    with pytest.raises(ValueError, match=r"scores have shape \(3,\); expected \(2,\)"):
        kl_shaped_rewards(
            torch.zeros(3),
            torch.zeros(2, 4),
            torch.zeros(2, 4),
            torch.ones(2, 4),
            kl_coef=0.1,
            estimator="k1",
        )


# ---------------------------------------------------------------------------------------------
# GAE


def ref_gae(rewards, values, mask, gamma, lam):
    """The textbook backward loop over each row's valid tokens; 0 after the last one."""
    B, T = rewards.shape
    adv = torch.zeros(B, T, dtype=torch.float64)
    ret = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        valid = [t for t in range(T) if mask[b, t]]
        last_gae = 0.0
        for i in reversed(range(len(valid))):
            t = valid[i]
            next_value = float(values[b, valid[i + 1]]) if i + 1 < len(valid) else 0.0
            delta = float(rewards[b, t]) + gamma * next_value - float(values[b, t])
            last_gae = delta + gamma * lam * last_gae
            adv[b, t] = last_gae
            ret[b, t] = last_gae + float(values[b, t])
    return adv, ret


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.5, 0.7)])
def test_gae_matches_loop(mask, gamma, lam):
    rewards = poison_padding(randn(*mask.shape, seed=12), mask)
    values = poison_padding(randn(*mask.shape, seed=13), mask)
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    ref_adv, ref_ret = ref_gae(rewards, values, mask, gamma, lam)
    close(adv, ref_adv)
    close(ret, ref_ret)


def test_gae_length_one_response_is_reward_minus_value():
    adv, ret = gae(torch.tensor([[2.0]]), torch.tensor([[0.5]]), torch.ones(1, 1), gamma=0.99, lam=0.95)
    assert adv.item() == pytest.approx(1.5)
    assert ret.item() == pytest.approx(2.0)


def test_gae_with_gamma_lam_one_returns_reward_to_go():
    mask = make_mask([4, 2], 4)
    rewards = randn(2, 4, seed=14) * mask
    _, ret = gae(rewards, randn(2, 4, seed=15), mask, gamma=1.0, lam=1.0)
    reward_to_go = rewards.flip(1).cumsum(1).flip(1) * mask
    close(ret, reward_to_go)


def test_gae_skips_holes_in_a_mask():
    # Not right-padded: the masked token in the middle is skipped, as the reference does.
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    rewards, values = randn(1, 5, seed=16), randn(1, 5, seed=17)
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    ref_adv, ref_ret = ref_gae(rewards, values, mask, 0.9, 0.8)
    close(adv, ref_adv)
    close(ret, ref_ret)


def test_gae_passes_gradients_to_values():
    mask = make_mask([3, 2], 3)
    values = randn(2, 3, seed=18).requires_grad_()
    _, ret = gae(randn(2, 3, seed=19), values, mask, gamma=0.9, lam=0.9)
    ret.sum().backward()
    assert torch.isfinite(values.grad).all()


def test_critic_returns_and_actor_advantages_come_from_the_same_shaped_rewards():
    # The seed framework's critic saw rewards without KL while the actor's had it; here one
    # reward tensor gives both, so returns - values == advantages exactly, KL term included.
    mask = make_mask([4, 2], 4)
    rewards = kl_shaped_rewards(
        torch.tensor([1.0, -1.0], dtype=torch.float64),
        -randn(2, 4, seed=20).abs(),
        -randn(2, 4, seed=21).abs(),
        mask,
        kl_coef=0.1,
        estimator="k3",
    )
    values = randn(2, 4, seed=22)
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=0.95)
    close(ret - values * mask, adv)
    no_kl = torch.zeros_like(rewards)
    no_kl[0, 3], no_kl[1, 1] = 1.0, -1.0
    assert not torch.allclose(gae(no_kl, values, mask, gamma=1.0, lam=0.95)[1], ret)


# ---------------------------------------------------------------------------------------------
# Policy loss


def ref_policy_loss(logp, old_logp, adv, mask, clip_eps, clip_eps_high, dual_clip):
    losses, clipped, dual, kls = [], [], [], []
    for b in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if not mask[b, t]:
                continue
            a = float(adv[b, t])
            log_ratio = float(logp[b, t]) - float(old_logp[b, t])
            ratio = math.exp(log_ratio)
            pg_loss1 = -a * ratio
            pg_loss2 = -a * min(max(ratio, 1 - clip_eps), 1 + clip_eps_high)
            loss = max(pg_loss1, pg_loss2)
            is_dual = False
            if dual_clip is not None and a < 0 and loss > -dual_clip * a:
                loss, is_dual = -dual_clip * a, True
            losses.append(loss)
            clipped.append(pg_loss2 > pg_loss1)
            dual.append(is_dual)
            kls.append(ratio - 1 - log_ratio)

    def mean(xs):
        return sum(map(float, xs)) / len(xs) if xs else 0.0

    return mean(losses), {"clipfrac": mean(clipped), "approx_kl": mean(kls), "dual_clipfrac": mean(dual)}


@pytest.mark.parametrize(
    "clip_eps,clip_eps_high,dual_clip",
    [(0.2, None, None), (0.2, 0.28, None), (0.1, 0.3, 3.0), (0.2, None, 1.5)],
)
def test_policy_loss_matches_loop(mask, clip_eps, clip_eps_high, dual_clip):
    shape = mask.shape
    old_logp = poison_padding(-randn(*shape, seed=23).abs(), mask)
    logp = poison_padding(old_logp + 0.5 * randn(*shape, seed=24), mask)  # ratios well outside the clip
    adv = poison_padding(2.0 * randn(*shape, seed=25), mask)
    loss, stats = policy_loss(
        logp, old_logp, adv, mask, clip_eps=clip_eps, clip_eps_high=clip_eps_high, dual_clip=dual_clip
    )
    high = clip_eps if clip_eps_high is None else clip_eps_high
    ref_loss, ref_stats = ref_policy_loss(logp, old_logp, adv, mask, clip_eps, high, dual_clip)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-9, abs=1e-12)
    assert set(stats) == {"clipfrac", "approx_kl", "dual_clipfrac"}
    for key, value in ref_stats.items():
        assert stats[key].item() == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_policy_loss_dual_clip_by_hand():
    # A = -1, ratio = e^2 ~ 7.39: clipped loss max(7.39, 0.8) = 7.39; dual clip c=3 bounds it at 3.
    logp, old_logp = torch.tensor([[2.0, 2.0]]), torch.zeros(1, 2)
    adv = torch.tensor([[-1.0, 1.0]])
    loss, stats = policy_loss(logp, old_logp, adv, torch.ones(1, 2), clip_eps=0.2, dual_clip=3.0)
    # token 2: A = +1, ratio clipped to 1.2: loss -1.2
    assert loss.item() == pytest.approx((3.0 - 1.2) / 2)
    assert stats["dual_clipfrac"].item() == pytest.approx(0.5)
    assert stats["clipfrac"].item() == pytest.approx(0.5)  # only the positive token takes the clipped branch


def test_policy_loss_asymmetric_clip_by_hand():
    # ratio 1.25 with A = +1: clipped at 1 + 0.2 but not at 1 + 0.28.
    logp, old_logp, adv, mask = (
        torch.tensor([[math.log(1.25)]]),
        torch.zeros(1, 1),
        torch.ones(1, 1),
        torch.ones(1, 1),
    )
    assert policy_loss(logp, old_logp, adv, mask, clip_eps=0.2)[0].item() == pytest.approx(-1.2)
    assert policy_loss(logp, old_logp, adv, mask, clip_eps=0.2, clip_eps_high=0.28)[
        0
    ].item() == pytest.approx(-1.25)
    # ratio 0.75 with A = -1: the low side uses clip_eps only.
    low = torch.tensor([[math.log(0.75)]])
    assert policy_loss(low, old_logp, -adv, mask, clip_eps=0.2, clip_eps_high=0.28)[
        0
    ].item() == pytest.approx(0.8)


def test_policy_loss_at_ratio_one_is_minus_mean_advantage_and_gradient_is_masked():
    mask = make_mask([3, 1], 3)
    old_logp = -randn(2, 3, seed=26).abs()
    logp = old_logp.clone().requires_grad_()
    adv = randn(2, 3, seed=27)
    loss, stats = policy_loss(logp, old_logp, adv, mask, clip_eps=0.2)
    assert loss.item() == pytest.approx(-masked_mean(adv, mask).item())
    assert stats["clipfrac"].item() == 0.0 and stats["approx_kl"].item() == 0.0
    loss.backward()
    close(logp.grad, -adv * mask / mask.sum())


def test_policy_loss_clipped_tokens_get_no_gradient():
    logp = torch.tensor([[math.log(2.0)]], dtype=torch.float64, requires_grad=True)
    loss, _ = policy_loss(
        logp,
        torch.zeros(1, 1, dtype=torch.float64),
        torch.ones(1, 1, dtype=torch.float64),
        torch.ones(1, 1),
        clip_eps=0.2,
    )
    loss.backward()
    assert logp.grad.item() == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_policy_loss_and_gradients_stay_finite_for_extreme_log_ratios(dtype, dual_clip):
    """exp(logp - old_logp) overflows past ~88 in float32: the log-ratio is clamped at
    LOG_RATIO_BOUND first, so loss, statistics and gradient are finite for both signs of A."""
    log_ratio = torch.tensor([[1e4, 200.0, 89.0, -89.0, -1e4, 0.1], [-200.0, 1e4, 95.0, -95.0, 30.0, -30.0]])
    old_logp = torch.full_like(log_ratio, -5.0)
    logp = (old_logp + log_ratio).to(dtype).requires_grad_()
    adv = torch.tensor([[1.0, -1.0, -2.0, 1.0, -1.0, 1.0], [1.0, -1.0, 1.0, -1.0, -1.0, 1.0]], dtype=dtype)
    loss, stats = policy_loss(logp, old_logp.to(dtype), adv, torch.ones(2, 6), clip_eps=0.2, dual_clip=dual_clip)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in stats.values())
    assert torch.isfinite(logp.grad).all()
    # Beyond the bound a token's gradient is 0: its ratio is far outside the clip anyway.
    beyond = log_ratio.abs() > LOG_RATIO_BOUND
    assert torch.all(logp.grad[beyond] == 0) and torch.any(logp.grad[~beyond] != 0)


@pytest.mark.parametrize("dual_clip", [1.0, 0.5, -2.0])
def test_policy_loss_rejects_dual_clip_not_above_one(dual_clip):
    with pytest.raises(ValueError, match=rf"dual_clip={dual_clip} must be > 1"):
        policy_loss(
            torch.zeros(1, 1),
            torch.zeros(1, 1),
            torch.zeros(1, 1),
            torch.ones(1, 1),
            clip_eps=0.2,
            dual_clip=dual_clip,
        )


def test_policy_loss_rejects_non_positive_clip_eps():
    with pytest.raises(ValueError, match="clip_eps"):
        policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), clip_eps=0.0)


# ---------------------------------------------------------------------------------------------
# Value loss


def ref_value_loss(values, old_values, returns, mask, clip_range):
    losses, clipped = [], []
    for b in range(values.shape[0]):
        for t in range(values.shape[1]):
            if not mask[b, t]:
                continue
            v, old, ret = float(values[b, t]), float(old_values[b, t]), float(returns[b, t])
            unclipped = (v - ret) ** 2
            if clip_range is None:
                losses.append(0.5 * unclipped)
                clipped.append(False)
                continue
            v_clipped = old + min(max(v - old, -clip_range), clip_range)
            v_loss_clipped = (v_clipped - ret) ** 2
            losses.append(0.5 * max(unclipped, v_loss_clipped))
            clipped.append(v_loss_clipped > unclipped)
    n = len(losses)
    return (sum(losses) / n if n else 0.0), (sum(clipped) / n if n else 0.0)


@pytest.mark.parametrize("clip_range", [None, 0.2, 1.0])
def test_value_loss_matches_loop(mask, clip_range):
    shape = mask.shape
    old_values = poison_padding(randn(*shape, seed=28), mask)
    values = poison_padding(old_values + randn(*shape, seed=29), mask)
    returns = poison_padding(randn(*shape, seed=30), mask)
    loss, stats = value_loss(values, old_values, returns, mask, clip_range=clip_range)
    ref_loss, ref_clipfrac = ref_value_loss(values, old_values, returns, mask, clip_range)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-9, abs=1e-12)
    assert stats["clipfrac"].item() == pytest.approx(ref_clipfrac, abs=1e-12)


def test_value_loss_clipping_by_hand():
    # old 0, new 1, return 2, c = 0.2: unclipped (1-2)^2 = 1, clipped (0.2-2)^2 = 3.24 -> 0.5 * 3.24.
    loss, stats = value_loss(
        torch.ones(1, 1), torch.zeros(1, 1), torch.full((1, 1), 2.0), torch.ones(1, 1), clip_range=0.2
    )
    assert loss.item() == pytest.approx(1.62)
    assert stats["clipfrac"].item() == 1.0


def test_value_loss_rejects_non_positive_clip_range():
    with pytest.raises(ValueError, match="clip_range=0"):
        value_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), clip_range=0)


# ---------------------------------------------------------------------------------------------
# Logits helpers


def test_entropy_from_logits_matches_loop():
    logits = randn(2, 3, 5, seed=31)
    out = entropy_from_logits(logits)
    assert out.shape == (2, 3)
    for b in range(2):
        for t in range(3):
            z = [float(v) for v in logits[b, t]]
            m = max(z)
            p = [math.exp(v - m) for v in z]
            s = sum(p)
            p = [v / s for v in p]
            assert out[b, t].item() == pytest.approx(-sum(v * math.log(v) for v in p), rel=1e-10)


def test_entropy_from_logits_uniform_and_masked_vocab():
    assert entropy_from_logits(torch.zeros(1, 1, 8)).item() == pytest.approx(math.log(8))
    logits = torch.tensor([[[0.0, 0.0, float("-inf"), float("-inf")]]])
    assert entropy_from_logits(logits).item() == pytest.approx(math.log(2))


def test_entropy_from_logits_upcasts_bf16():
    out = entropy_from_logits(torch.zeros(1, 2, 16, dtype=torch.bfloat16))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.full((1, 2), math.log(16)))


def test_log_probs_from_logits_matches_loop():
    logits = randn(2, 4, 7, seed=32)
    tokens = torch.randint(0, 7, (2, 4), generator=torch.Generator().manual_seed(33))
    out = log_probs_from_logits(logits, tokens)
    for b in range(2):
        for t in range(4):
            z = [float(v) for v in logits[b, t]]
            lse = max(z) + math.log(sum(math.exp(v - max(z)) for v in z))
            assert out[b, t].item() == pytest.approx(z[int(tokens[b, t])] - lse, rel=1e-10)


def test_log_probs_from_logits_is_stable_for_huge_logits():
    logits = torch.tensor([[[1e4, 0.0, -1e4]]], dtype=torch.float32)
    out = log_probs_from_logits(logits, torch.tensor([[0]]))
    assert out.item() == pytest.approx(0.0, abs=1e-6)
    assert torch.isfinite(log_probs_from_logits(logits, torch.tensor([[2]]))).all()


def test_log_probs_from_logits_shape_mismatch_is_explained():
    with pytest.raises(ValueError, match=r"tokens have shape \(2, 3\); expected \(2, 4\)"):
        log_probs_from_logits(torch.zeros(2, 4, 5), torch.zeros(2, 3, dtype=torch.long))


@pytest.mark.parametrize("kept_logits_bytes", [0, 2 * 8 * 50 * 8, 10**9])  # none, two chunks of 8 rows, all
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_log_probs_and_entropy_match_the_full_logits_values_and_gradients(temperature, kept_logits_bytes):
    from ppo_trainer.algorithms.ppo import chunked_log_probs_and_entropy

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, generator=generator, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(50, generator=generator, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 50, (37,), generator=generator)
    a, b = torch.randn(37, generator=generator, dtype=torch.float64), torch.randn(37, generator=generator, dtype=torch.float64)

    logits = (hidden @ weight.T + bias) / temperature
    ref_lp = log_probs_from_logits(logits[None], tokens[None])[0]
    ref_ent = entropy_from_logits(logits[None])[0]
    ref_grads = torch.autograd.grad((ref_lp * a).sum() + (ref_ent * b).sum(), (hidden, weight, bias))

    lp, ent = chunked_log_probs_and_entropy(hidden, weight, tokens, bias=bias, temperature=temperature, chunk_size=8,
                                            kept_logits_bytes=kept_logits_bytes)
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(ent, ref_ent)
    grads = torch.autograd.grad((lp * a).sum() + (ent * b).sum(), (hidden, weight, bias))
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want)

    with torch.no_grad():
        lp_only, none = chunked_log_probs_and_entropy(hidden, weight, tokens, bias=bias, temperature=temperature,
                                                      with_entropy=False, chunk_size=100)
    assert none is None
    torch.testing.assert_close(lp_only, ref_lp.detach())
    with pytest.raises(ValueError, match="tokens"):
        chunked_log_probs_and_entropy(hidden, weight, tokens[:3])
