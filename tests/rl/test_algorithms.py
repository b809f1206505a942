"""PPO / GAE / GRPO / KL arithmetic against values worked out by hand (shown in the comments)."""

import math

import pytest
import torch

from lightning_mem.rl.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    clipped_policy_loss,
    clipped_value_loss,
    gae_advantages,
    grpo_advantages,
    kl_estimate,
    masked_sum,
    masked_mean,
    masked_mean_var,
    rewards_with_kl_penalty,
    whiten,
)


def t(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


# -- KL estimators ------------------------------------------------------------------------------


def test_kl_estimators_by_hand():
    logp, ref = t([-1.0, -2.0]), t([-1.5, -1.0])
    # log_ratio = logp - ref = [0.5, -1.0]
    close(kl_estimate(logp, ref, "k1"), [[0.5, -1.0]])
    close(kl_estimate(logp, ref, "k2"), [[0.125, 0.5]])
    # k3 = exp(-x) - 1 + x: exp(-0.5) - 0.5 = 0.10653; exp(1) - 2 = 0.71828
    close(kl_estimate(logp, ref, "k3"), [[math.exp(-0.5) - 0.5, math.e - 2]])
    close(kl_estimate(logp, ref, "abs"), [[0.5, 1.0]])
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_estimate(logp, ref, "k4")


def test_k1_and_k3_are_unbiased_estimates_of_the_true_kl():
    # pi = (0.7, 0.3), ref = (0.4, 0.6): KL(pi||ref) = 0.7 ln(7/4) + 0.3 ln(3/6) = 0.18382
    true_kl = 0.7 * math.log(0.7 / 0.4) + 0.3 * math.log(0.3 / 0.6)
    logp, ref = torch.log(torch.tensor([0.7, 0.3])), torch.log(torch.tensor([0.4, 0.6]))
    probs = torch.tensor([0.7, 0.3])
    for estimator in ("k1", "k3"):
        expectation = (probs * kl_estimate(logp, ref, estimator)).sum()
        assert float(expectation) == pytest.approx(true_kl, abs=1e-6), estimator


# -- rewards and GAE ----------------------------------------------------------------------------


def test_kl_penalty_on_every_token_and_score_on_the_last():
    kl = t([0.1, 0.2, 0.3], [0.4, 0.5, 0.0])
    mask = t([1, 1, 1], [1, 1, 0])
    rewards = rewards_with_kl_penalty(torch.tensor([1.0, 2.0]), kl, mask, kl_coef=0.5)
    # row 0: -0.05, -0.1, -0.15 + 1 ; row 1: -0.2, -0.25 + 2, (padding) 0
    close(rewards, [[-0.05, -0.1, 0.85], [-0.2, 1.75, 0.0]])


def test_gae_by_hand():
    # One response of 3 tokens, gamma = 0.9, lam = 0.8.
    rewards, values, mask = t([0.0, 0.0, 1.0]), t([0.5, 0.6, 0.7]), t([1, 1, 1])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    # delta_2 = 1 - 0.7 = 0.3                      A_2 = 0.3
    # delta_1 = 0 + 0.9*0.7 - 0.6 = 0.03           A_1 = 0.03 + 0.72*0.3 = 0.246
    # delta_0 = 0 + 0.9*0.6 - 0.5 = 0.04           A_0 = 0.04 + 0.72*0.246 = 0.21712
    close(adv, [[0.21712, 0.246, 0.3]])
    close(ret, [[0.71712, 0.846, 1.0]])


def test_gae_stops_at_the_end_of_each_response():
    # Row 1 ends after two tokens: its last real token sees V = 0 after it, whatever the padding holds.
    rewards = t([0.0, 1.0, 0.0], [0.0, 2.0, 9.0])
    values = t([0.2, 0.4, 0.0], [0.2, 0.4, 5.0])
    mask = t([1, 1, 0], [1, 1, 0])
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    # lam = gamma = 1: A_t = sum of rewards from t - V_t. Row 0: [1 - 0.2, 1 - 0.4]; row 1: [2 - 0.2, 2 - 0.4]
    close(adv, [[0.8, 0.6, 0.0], [1.8, 1.6, 0.0]])
    close(ret, [[1.0, 1.0, 0.0], [2.0, 2.0, 0.0]])


def test_whitening_is_global_over_unmasked_tokens():
    values, mask = t([1.0, 2.0, 100.0], [3.0, 0.0, 0.0]), t([1, 1, 0], [1, 0, 0])
    # tokens 1, 2, 3: mean 2, unbiased var 1 -> -1, 0, 1; padding 0
    out = whiten(values, mask, eps=0.0)
    close(out, [[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    kept_mean = whiten(values, mask, eps=0.0, shift_mean=False)
    close(kept_mean, [[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]])


def test_masked_statistics_across_ranks_equal_the_pooled_ones():
    # Two "ranks" holding [1, 2] and [3, 5]: the reduce adds the other rank's sums.
    a, b = t([1.0, 2.0]), t([3.0, 5.0])
    ones = torch.ones_like(a)
    other = torch.stack([(b * ones).sum(), (b * b * ones).sum(), ones.sum()]).double()
    mean, var = masked_mean_var(a, ones, reduce=lambda s: s + other)
    # pooled 1, 2, 3, 5: mean 2.75, var = ((1.75)^2 + 0.75^2 + 0.25^2 + 2.25^2) / 3 = 8.75 / 3
    assert float(mean) == pytest.approx(2.75)
    assert float(var) == pytest.approx(8.75 / 3)
    assert float(masked_mean(a, ones)) == pytest.approx(1.5)


# -- GRPO ---------------------------------------------------------------------------------------


def test_grpo_normalises_within_each_group():
    scores = torch.tensor([1.0, 0.0, 0.0, 0.5, 0.5, 0.5])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    mask = torch.ones(6, 2)
    adv = grpo_advantages(scores, groups, mask, eps=0.0)
    # group 0: mean 1/3, unbiased std sqrt(1/3): (1 - 1/3)/0.57735 = 1.1547, (0 - 1/3)/0.57735 = -0.57735
    # group 1: all equal -> 0
    expected = [1.1547005, -0.5773503, -0.5773503, 0.0, 0.0, 0.0]
    assert adv[:, 0].tolist() == pytest.approx(expected, abs=1e-6)
    assert torch.equal(adv[:, 0], adv[:, 1])  # the whole response gets its advantage
    centred = grpo_advantages(scores, groups, mask, scale=False)
    close(centred[:3, 0], [2 / 3, -1 / 3, -1 / 3])


def test_grpo_masks_padding_and_rejects_groups_of_one():
    adv = grpo_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), t([1, 1, 0], [1, 0, 0]), eps=0.0)
    # mean 0.5, std sqrt(0.5) = 0.7071: +-0.7071
    close(adv, [[0.7071068, 0.7071068, 0.0], [-0.7071068, 0.0, 0.0]])
    with pytest.raises(ValueError, match="at least two responses per prompt"):
        grpo_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 1]), torch.ones(2, 1))


# -- losses -------------------------------------------------------------------------------------


def test_clipped_policy_loss_by_hand():
    old = t([0.0, 0.0, 0.0, 0.0])
    # ratios exp(log r): 1.5, 0.5, 1.1, 1.5 ; advantages +1, +1, -2, -1 ; eps = 0.2
    new = torch.log(t([1.5, 0.5, 1.1, 1.5]))
    adv = t([1.0, 1.0, -2.0, -1.0])
    mask = t([1, 1, 1, 1])
    terms = clipped_policy_loss(new, old, adv, mask, clip_ratio=0.2)
    # token 0: max(-1.5, -1.2) = -1.2 (clipped); token 1: max(-0.5, -0.8) = -0.5
    # token 2: max(2.2, 2.2) = 2.2;              token 3: max(1.5, 1.2) = 1.5
    assert float(terms.loss_sum) == pytest.approx(-1.2 - 0.5 + 2.2 + 1.5, abs=1e-6)
    assert float(terms.clipped_tokens) == 1.0
    # approx KL(old||new) per token: r - 1 - log r
    expected_kl = sum(r - 1 - math.log(r) for r in (1.5, 0.5, 1.1, 1.5))
    assert float(terms.approx_kl_sum) == pytest.approx(expected_kl, abs=1e-6)


def test_clipped_policy_loss_gradient_vanishes_only_where_clipped():
    new = torch.log(t([1.5, 0.5])).requires_grad_(True)
    terms = clipped_policy_loss(new, torch.zeros(1, 2), t([1.0, 1.0]), torch.ones(1, 2), clip_ratio=0.2)
    terms.loss_sum.backward()
    # token 0 clipped (ratio 1.5 > 1.2 with A > 0): no gradient; token 1: d(-A r)/d log r = -r = -0.5
    close(new.grad, [[0.0, -0.5]])


def test_clipped_value_loss_by_hand():
    old, returns = t([1.0, 1.0]), t([2.0, 0.0])
    values = t([1.5, 1.1])
    terms = clipped_value_loss(values, old, returns, torch.ones(1, 2), clip_range=0.2)
    # token 0: unclipped (1.5-2)^2 = 0.25; clipped V = 1.2 -> (1.2-2)^2 = 0.64 -> 0.64 (clipped)
    # token 1: unclipped (1.1-0)^2 = 1.21; clipped V = 1.1 -> 1.21 -> 1.21
    assert float(terms.loss_sum) == pytest.approx(0.5 * (0.64 + 1.21))
    assert float(terms.clipped_tokens) == 1.0
    plain = clipped_value_loss(values, old, returns, torch.ones(1, 2), clip_range=None)
    assert float(plain.loss_sum) == pytest.approx(0.5 * (0.25 + 1.21))


# -- KL controllers -----------------------------------------------------------------------------


def test_adaptive_kl_controller_by_hand():
    ctl = AdaptiveKLController(coef=0.1, target=6.0, horizon=1000)
    ctl.update(current_kl=9.0, n_steps=100)  # error = clip(9/6 - 1) = 0.2 (clipped from 0.5)
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 100 / 1000))
    ctl.update(current_kl=5.4, n_steps=100)  # error = -0.1
    assert ctl.value == pytest.approx(0.1 * 1.02 * 0.99)
    restored = AdaptiveKLController(coef=0.5, target=6.0, horizon=1000)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value
    fixed = FixedKLController(0.05)
    fixed.update(100.0, 1000)
    assert fixed.value == 0.05


def test_grpo_identical_scores_give_exactly_zero():
    # Eight partial-credit scores of 0.45: the fp32 mean is off by one ulp and the fp32 std is
    # ~3e-8, which used to give -0.0289 per sample. The group has nothing to prefer: exactly 0.
    scores = torch.full((8,), 0.45)
    groups = torch.zeros(8, dtype=torch.long)
    for scale in (True, False):
        adv = grpo_advantages(scores, groups, torch.ones(8, 5), scale=scale)
        assert torch.equal(adv, torch.zeros(8, 5)), (scale, adv[:, 0])
    # ... and next to a group that does differ, in the same batch.
    mixed = torch.cat([scores, torch.tensor([0.45, 0.4, 0.35, 0.45])])
    adv = grpo_advantages(mixed, torch.tensor([0] * 8 + [1] * 4), torch.ones(12, 1))
    assert torch.equal(adv[:8], torch.zeros(8, 1))
    assert adv[8:].abs().min() > 0.1


# -- non-finite values on padding ----------------------------------------------------------------
#
# A padded position may hold anything (inf from an overflowed logit, NaN from an uninitialised
# buffer). Every masked reduction selects it away: the result, and the gradient of every real
# position, equal those of the same tensors with zeros on the padding.

MASK = t([1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1])


def _poisoned(x, value):
    """x with ``value`` written on every padded position of MASK."""
    return torch.where(MASK.bool(), x, torch.tensor(value))


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 4, generator=g) for _ in range(4)]


MASKED_FUNCTIONS = {
    "masked_sum": lambda a, b, c, d: masked_sum(a, MASK),
    "masked_mean": lambda a, b, c, d: masked_mean(a, MASK),
    "masked_var": lambda a, b, c, d: masked_mean_var(a, MASK)[1],
    "whiten": lambda a, b, c, d: whiten(a, MASK),
    "whiten_keep_mean": lambda a, b, c, d: whiten(a, MASK, shift_mean=False),
    "kl_k1": lambda a, b, c, d: kl_estimate(a, b, "k1", mask=MASK),
    "kl_k3": lambda a, b, c, d: kl_estimate(a, b, "k3", mask=MASK),
    "kl_penalty": lambda a, b, c, d: rewards_with_kl_penalty(torch.tensor([1.0, 0.0, 0.5]), a, MASK, 0.1),
    "gae_advantages": lambda a, b, c, d: gae_advantages(a, b, MASK, gamma=0.9, lam=0.8)[0],
    "gae_returns": lambda a, b, c, d: gae_advantages(a, b, MASK, gamma=0.9, lam=0.8)[1],
    "policy_loss": lambda a, b, c, d: clipped_policy_loss(a, b, c, MASK, clip_ratio=0.2).loss_sum,
    "policy_clipped": lambda a, b, c, d: clipped_policy_loss(a, b, c, MASK).clipped_tokens,
    "policy_approx_kl": lambda a, b, c, d: clipped_policy_loss(a, b, c, MASK).approx_kl_sum,
    "value_loss": lambda a, b, c, d: clipped_value_loss(a, b, c, MASK, clip_range=0.2).loss_sum,
    "value_loss_unclipped": lambda a, b, c, d: clipped_value_loss(a, b, c, MASK, clip_range=None).loss_sum,
    "value_clipped": lambda a, b, c, d: clipped_value_loss(a, b, c, MASK, clip_range=0.2).clipped_tokens,
}


@pytest.mark.parametrize("poison", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("name", sorted(MASKED_FUNCTIONS))
def test_non_finite_padding_changes_nothing(name, poison):
    fn = MASKED_FUNCTIONS[name]
    clean = [x.clone().requires_grad_() for x in _inputs()]
    dirty_leaves = [x.clone().requires_grad_() for x in _inputs()]
    expected = fn(*[_poisoned(x, 0.0) for x in clean])
    actual = fn(*[_poisoned(x, poison) for x in dirty_leaves])
    # Padded output positions are 0 in both (gae's returns, whitened values...), so the whole
    # tensor compares, bit for bit.
    assert torch.isfinite(actual).all(), actual
    torch.testing.assert_close(actual, expected, atol=0, rtol=0)
    if expected.requires_grad:
        expected.sum().backward()
        actual.sum().backward()
        for c, d in zip(clean, dirty_leaves):
            if c.grad is None:
                assert d.grad is None or torch.equal(d.grad, torch.zeros_like(d.grad))
                continue
            assert torch.isfinite(d.grad).all(), (name, d.grad)
            torch.testing.assert_close(d.grad, c.grad, atol=0, rtol=0)


def test_grpo_ignores_padding_rows_holding_nan():
    mask = t([1, 1, 0], [1, 0, 0])
    adv = grpo_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), mask)
    assert torch.isfinite(adv).all() and adv[0, 2] == 0 and adv[1, 1] == 0
