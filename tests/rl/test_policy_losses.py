"""The per-token policy losses on hand-computed tokens: decoupled and dual clipping, GSPO's
sequence ratio, CISPO's clipped weight, and a log-ratio far past float32's exp."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_mem.rl.policy_losses import (
    cispo_loss,
    clip_cov_loss,
    clipped_surrogate,
    geo_mean_loss,
    gspo_loss,
    kl_cov_loss,
    policy_loss,
)

LOG = math.log


def _lp(ratios):
    """Log-probs whose ratio to old log-probs of 0 is ``ratios``."""
    return torch.tensor([[LOG(r) for r in ratios]], requires_grad=True), torch.zeros(1, len(ratios))


def test_decoupled_clip_uses_each_side_its_own_range():
    # ratios 0.7, 1.25, 1.5 with A = +1, and 0.7 with A = -1; eps_low 0.2, eps_high 0.28 (DAPO)
    logprobs, old = _lp([0.7, 1.25, 1.5, 0.7])
    adv = torch.tensor([[1.0, 1.0, 1.0, -1.0]])
    t = clipped_surrogate(logprobs, old, adv, torch.ones(1, 4), clip_low=0.2, clip_high=0.28)
    torch.testing.assert_close(t.loss, torch.tensor([[-0.7, -1.25, -1.28, 0.8]]))
    assert t.clipped_high.tolist() == [[False, False, True, False]]  # 1.5 > 1.28 with A > 0
    assert t.clipped_low.tolist() == [[False, False, False, True]]  # 0.7 < 0.8 with A < 0
    t.loss.sum().backward()
    # clipped tokens pass no gradient; d(-A r)/d log r = -A r elsewhere
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.7, -1.25, 0.0, 0.0]]))


def test_dual_clip_bounds_a_negative_advantage_with_a_huge_ratio():
    logprobs, old = _lp([5.0, 2.0, 5.0])
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    t = clipped_surrogate(logprobs, old, adv, torch.ones(1, 3), clip_c=3.0)
    # A < 0: max(5, 1.2) = 5 is cut to 3; 2 stays (below c); A > 0 is untouched (-min(5, 1.2) = -1.2)
    torch.testing.assert_close(t.loss, torch.tensor([[3.0, 2.0, -1.2]]))
    assert t.dual_clipped.tolist() == [[True, False, False]]
    t.loss.sum().backward()
    assert logprobs.grad[0, 0] == 0.0 and logprobs.grad[0, 1] == pytest.approx(2.0)


def test_ratio_overflow_stays_finite():
    # log-ratio 200: exp overflows float32; the clamp keeps loss and gradient finite
    logprobs = torch.tensor([[200.0, -200.0]], requires_grad=True)
    old = torch.zeros(1, 2)
    adv = torch.tensor([[-1.0, 1.0]])
    for kind in ("vanilla", "gspo", "cispo"):
        t = policy_loss(kind, logprobs, old, adv, torch.ones(1, 2), clip_low=0.2, clip_high=0.2)
        t.loss.sum().backward()
        assert torch.isfinite(t.loss).all() and torch.isfinite(logprobs.grad).all(), kind
        logprobs.grad = None


def test_fully_masked_row_gives_zero_loss_and_no_nan():
    logprobs = torch.tensor([[0.1, 0.2], [float("inf"), float("nan")]], requires_grad=True)
    old = torch.zeros(2, 2)
    mask = torch.tensor([[1, 1], [0, 0]])
    for kind in ("vanilla", "gspo", "cispo"):
        t = policy_loss(kind, logprobs, old, torch.ones(2, 2), mask, clip_low=0.2, clip_high=0.2)
        t.loss.sum().backward()
        assert (t.loss[1] == 0).all() and torch.isfinite(logprobs.grad).all(), kind
        logprobs.grad = None


def test_gspo_uses_the_geometric_mean_ratio_for_every_token():
    # token ratios 2 and 0.5: geometric mean 1, so no clip and the loss is -A per token
    logprobs, old = _lp([2.0, 0.5])
    adv = torch.full((1, 2), 2.0)
    t = gspo_loss(logprobs, old, adv, torch.ones(1, 2), clip_low=3e-4, clip_high=4e-4)
    torch.testing.assert_close(t.loss, torch.tensor([[-2.0, -2.0]]))
    t.loss.sum().backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-2.0, -2.0]]))  # -A * s_i per token
    # ratios 2 and 2 (s = 2 > 1 + 4e-4) with A > 0: the whole sequence is clipped, no gradient
    logprobs, old = _lp([2.0, 2.0])
    t = gspo_loss(logprobs, old, adv, torch.ones(1, 2), clip_low=3e-4, clip_high=4e-4)
    torch.testing.assert_close(t.loss, torch.full((1, 2), -2.0 * 1.0004))
    assert t.clipped_high.all()
    t.loss.sum().backward()
    assert (logprobs.grad == 0).all()


def test_gspo_single_token_response_is_the_token_ratio():
    logprobs, old = _lp([1.1])
    t = gspo_loss(logprobs, old, torch.ones(1, 1), torch.ones(1, 1), clip_low=0.2, clip_high=0.2)
    torch.testing.assert_close(t.loss, torch.tensor([[-1.1]]))


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    # ratio 1.5 capped to 1.28 as a weight: loss -1.28 * A * log pi, gradient -1.28 * A
    logprobs = torch.tensor([[LOG(0.3) + LOG(1.5), LOG(0.3) + LOG(0.5)]], requires_grad=True)
    old = torch.full((1, 2), LOG(0.3))
    adv = torch.tensor([[1.0, -1.0]])
    t = cispo_loss(logprobs, old, adv, torch.ones(1, 2), clip_low=1.0, clip_high=0.28)
    expected = torch.tensor([[-1.28 * logprobs[0, 0].item(), 0.5 * logprobs[0, 1].item()]])
    torch.testing.assert_close(t.loss, expected)
    t.loss.sum().backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.28, 0.5]]))
    assert t.clipped_high.tolist() == [[True, False]] and not t.clipped_low.any()


def test_dual_clip_is_refused_for_sequence_losses():
    logprobs, old = _lp([1.0])
    with pytest.raises(ValueError, match="dual clip"):
        policy_loss("gspo", logprobs, old, torch.ones(1, 1), torch.ones(1, 1), clip_low=0.2, clip_high=0.2, clip_c=3.0)


# ---------------------------------------------------------------------------------------------
# The paper's formulas, token by token in scalar arithmetic (autograd through them gives the
# reference gradient), against the vectorised losses on hand-worked and random inputs.
# ---------------------------------------------------------------------------------------------

EPS_LOW, EPS_HIGH, C = 0.2, 0.25, 3.0
#: The four ratio regions: below 1 - eps_low, inside, between 1 + eps_high and c, above c.
REGIONS = ((0.3, 0.75), (0.85, 1.2), (1.3, 2.8), (3.3, 8.0))


def _region_log_ratios(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Log-ratios whose tokens cycle through the four regions (each region in every column)."""
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(rows, cols, dtype=torch.float64)
    for i in range(rows):
        for t in range(cols):
            lo, hi = REGIONS[(i + t) % 4]
            out[i, t] = math.log(lo + (hi - lo) * torch.rand((), generator=g, dtype=torch.float64).item())
    return out


def _random_batch(seed: int, rows: int = 8, cols: int = 6):
    """Log-probs (leaf), old log-probs, per-token advantages of both signs, and a ragged mask."""
    g = torch.Generator().manual_seed(seed + 1)
    old = -torch.rand(rows, cols, generator=g, dtype=torch.float64) * 3 - 0.1
    logprobs = (old + _region_log_ratios(rows, cols, seed)).requires_grad_()
    adv = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    mask = torch.ones(rows, cols, dtype=torch.long)
    for i in range(rows):
        mask[i, 1 + i % cols:] = 0
    return logprobs, old, adv, mask


def _ppo_token(log_ratio, a, eps_low=EPS_LOW, eps_high=EPS_HIGH):
    r = torch.exp(log_ratio)
    return torch.maximum(-a * r, -a * torch.clamp(r, 1 - eps_low, 1 + eps_high))


def _cov_by_hand(logprobs, adv, mask):
    logprobs = logprobs.detach()
    real = [(i, t) for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t]]
    mean_a = sum(float(adv[i, t]) for i, t in real) / len(real)
    mean_lp = sum(float(logprobs[i, t]) for i, t in real) / len(real)
    return {(i, t): (float(adv[i, t]) - mean_a) * (float(logprobs[i, t]) - mean_lp) for i, t in real}


def _compare(terms, reference, logprobs, mask):
    """Loss values on real tokens, and the gradient of the summed loss, against the reference's."""
    real = mask.bool()
    torch.testing.assert_close(terms.loss[real], reference[real], rtol=1e-9, atol=1e-10)
    assert (terms.loss[~real] == 0).all()
    (grad,) = torch.autograd.grad(terms.loss.sum(), logprobs)
    (expected,) = torch.autograd.grad(reference[real].sum(), logprobs)
    torch.testing.assert_close(grad, expected, rtol=1e-9, atol=1e-10)
    return grad


def test_gspo_clamp_is_verls_log_ratio_ten_from_above():
    # The example: one 2-token response, log-ratios [12, 12], A = -1: loss e^10, no gradient.
    logprobs = torch.tensor([[12.0, 12.0]], dtype=torch.float64, requires_grad=True)
    t = gspo_loss(logprobs, torch.zeros(1, 2, dtype=torch.float64), -torch.ones(1, 2, dtype=torch.float64),
                  torch.ones(1, 2), clip_low=0.2, clip_high=0.2)
    torch.testing.assert_close(t.loss, torch.full((1, 2), math.exp(10), dtype=torch.float64))
    t.loss.sum().backward()
    assert (logprobs.grad == 0).all()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_matches_the_papers_formula_in_every_region(seed):
    # Each response's geometric-mean ratio sits in one of the four regions (token ratios spread around it).
    g = torch.Generator().manual_seed(seed)
    rows, cols = 8, 5
    old = -torch.rand(rows, cols, generator=g, dtype=torch.float64) - 0.5
    target = torch.tensor([math.log(sum(REGIONS[i % 4]) / 2) for i in range(rows)], dtype=torch.float64)
    logprobs = (old + target[:, None] + 0.3 * torch.randn(rows, cols, generator=g, dtype=torch.float64)).requires_grad_()
    # one advantage per response: rows 0-3 positive, 4-7 negative, so each region meets both signs
    sign = torch.tensor([1.0] * 4 + [-1.0] * 4, dtype=torch.float64)
    adv = (sign * (0.5 + torch.rand(rows, generator=g, dtype=torch.float64)))[:, None].expand(rows, cols)
    mask = torch.ones(rows, cols, dtype=torch.long)
    for i in range(rows):
        mask[i, 2 + i % 3:] = 0
    reference = torch.zeros(rows, cols, dtype=torch.float64)
    for i in range(rows):
        n = int(mask[i].sum())
        log_s = sum(logprobs[i, t] - old[i, t] for t in range(n)) / n  # (1/|o|) sum log r
        for t in range(n):  # s_i,t = sg[s_i] pi / sg[pi]
            log_sit = log_s.detach() + logprobs[i, t] - logprobs[i, t].detach()
            reference[i, t] = _ppo_token(torch.clamp(log_sit, max=10.0), adv[i, t])
    t = gspo_loss(logprobs, old, adv, mask, clip_low=EPS_LOW, clip_high=EPS_HIGH)
    grad = _compare(t, reference, logprobs, mask)
    assert (grad[:, 0] == 0).any() and (grad[:, 0] != 0).any()  # both clipped and live responses


def test_clip_cov_hand_worked():
    # 4 tokens, ratio 1 everywhere (no PPO clip); A = [2, -2, 0, 0], log pi = [-1, -3, -2, -2]:
    # means 0 and -2, cov = [2 * 1, -2 * -1, 0, 0] = [2, 2, 0, 0]; with (lb, ub) = (1, 5) the candidates
    # are tokens 0 and 1; ratio 0.25 of 4 tokens = 1 is taken out.
    lp = torch.tensor([[-1.0, -3.0], [-2.0, -2.0]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[2.0, -2.0], [0.0, 0.0]], dtype=torch.float64)
    t = clip_cov_loss(lp, lp.detach(), adv, torch.ones(2, 2), clip_low=0.2, clip_high=0.2, ratio=0.25,
                      generator=torch.Generator().manual_seed(0))
    chosen = t.clipped
    assert int(chosen.sum()) == 1 and not chosen[1].any()
    expected = torch.where(chosen, 0.0, -adv)  # -A r with r = 1
    torch.testing.assert_close(t.loss.detach(), expected)
    t.loss.sum().backward()
    torch.testing.assert_close(lp.grad, torch.where(chosen, 0.0, -adv))  # d(-A r)/d log pi = -A r
    # An upper bound below 2 leaves no candidate: plain PPO.
    t = clip_cov_loss(lp, lp.detach(), adv, torch.ones(2, 2), clip_low=0.2, clip_high=0.2, ratio=0.25, upper=1.5)
    assert not t.clipped.any()


@pytest.mark.parametrize("seed", [0, 1])
def test_clip_cov_matches_the_papers_rule_in_every_region(seed):
    logprobs, old, adv, mask = _random_batch(seed)
    ratio, lower, upper = 0.2, -0.5, 0.8
    t = clip_cov_loss(logprobs, old, adv, mask, clip_low=EPS_LOW, clip_high=EPS_HIGH, ratio=ratio, lower=lower,
                      upper=upper, generator=torch.Generator().manual_seed(seed))
    cov = _cov_by_hand(logprobs, adv, mask)
    ppo = {k: _ppo_token(logprobs[k] - old[k], adv[k]) for k in cov}
    r = torch.exp(logprobs.detach() - old)
    clipped_by_ppo = {k for k in cov if float(-adv[k] * torch.clamp(r[k], 1 - EPS_LOW, 1 + EPS_HIGH)) > float(-adv[k] * r[k])}
    candidates = {k for k, c in cov.items() if lower < c < upper and k not in clipped_by_ppo}
    chosen = {(i, j) for i, j in torch.nonzero(t.clipped).tolist()} - clipped_by_ppo
    assert len(chosen) == min(max(int(ratio * len(cov)), 1), len(candidates)) > 0
    assert chosen <= candidates
    reference = torch.zeros_like(t.loss)
    for k, v in ppo.items():
        reference[k] = 0.0 * v if k in chosen else v
    _compare(t, reference, logprobs, mask)
    assert t.clipped_low.any() and t.clipped_high.any()  # the regions below and above the range were there


def test_kl_cov_hand_worked():
    # log-ratios [0.5, -0.5, 0.1, 0.0], A = [2, -2, 1, -1], log pi = [-0.5, -2.5, -1.4, -1.6] (mean -1.5):
    # cov = (2 - 0)(1) = 2, (-2)(-1) = 2, (1)(0.1) = 0.1, (-1)(-0.1) = 0.1; k = 1 of the top: token 0
    # (topk's first of the tied pair). l = -A r + 0.1 |log r| there.
    old = torch.tensor([[-1.0, -2.0, -1.5, -1.6]], dtype=torch.float64)
    lp = (old + torch.tensor([[0.5, -0.5, 0.1, 0.0]], dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([[2.0, -2.0, 1.0, -1.0]], dtype=torch.float64)
    t = kl_cov_loss(lp, old, adv, torch.ones(1, 4), ratio=0.25, coef=0.1)
    assert int(t.clipped.sum()) == 1 and t.clipped[0, :2].any()
    r = torch.exp(lp.detach() - old)
    expected = -adv * r + 0.1 * 0.5 * t.clipped
    torch.testing.assert_close(t.loss.detach(), expected)
    t.loss.sum().backward()
    # d/dlog pi: -A r, plus 0.1 * sign(log r) on the penalised token
    torch.testing.assert_close(lp.grad, -adv * r + 0.1 * torch.sign(lp.detach() - old) * t.clipped)


@pytest.mark.parametrize("seed", [0, 1])
def test_kl_cov_matches_the_papers_formula_in_every_region(seed):
    logprobs, old, adv, mask = _random_batch(seed)
    ratio, coef = 0.15, 0.3
    t = kl_cov_loss(logprobs, old, adv, mask, ratio=ratio, coef=coef)
    cov = _cov_by_hand(logprobs, adv, mask)
    k = max(int(ratio * len(cov)), 1)
    top = set(sorted(cov, key=cov.get, reverse=True)[:k])
    assert {(i, j) for i, j in torch.nonzero(t.clipped).tolist()} == top
    reference = torch.zeros_like(t.loss)
    for key in cov:
        lr = logprobs[key] - old[key]
        reference[key] = -adv[key] * torch.exp(lr) + (coef * torch.abs(lr) if key in top else 0.0)
    _compare(t, reference, logprobs, mask)


def test_geo_mean_hand_worked():
    # One response, A = +1 on both tokens, log-ratios [0.3, -0.1] with eps 0.2 (log space): the first
    # is capped at 0.2 (A > 0, above), the second kept: ratio exp((0.2 - 0.1) / 2), loss -e^0.05.
    old = torch.zeros(1, 2, dtype=torch.float64)
    lp = torch.tensor([[0.3, -0.1]], dtype=torch.float64, requires_grad=True)
    t = geo_mean_loss(lp, old, torch.ones(1, 2, dtype=torch.float64), torch.ones(1, 2), clip_low=0.2, clip_high=0.2)
    torch.testing.assert_close(t.loss, torch.full((1, 2), -math.exp(0.05), dtype=torch.float64))
    assert t.clipped_high.tolist() == [[True, False]]
    # seq-mean-token-mean: the response's loss once; its gradient reaches the kept token only.
    (t.loss.sum() / 2).backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -math.exp(0.05) / 2]], dtype=torch.float64))
    # A < 0: the same log-ratio 0.3 is not capped (the pessimistic side), -0.3 is floored at -0.2.
    lp = torch.tensor([[0.3, -0.3]], dtype=torch.float64)
    t = geo_mean_loss(lp, old, -torch.ones(1, 2, dtype=torch.float64), torch.ones(1, 2), clip_low=0.2, clip_high=0.2)
    torch.testing.assert_close(t.loss, torch.full((1, 2), math.exp(0.05), dtype=torch.float64))
    assert t.clipped_low.tolist() == [[False, True]] and not t.clipped_high.any()


@pytest.mark.parametrize("seed", [0, 1])
def test_geo_mean_matches_the_papers_formula_in_every_region(seed):
    logprobs, old, _, mask = _random_batch(seed)
    g = torch.Generator().manual_seed(seed + 7)
    adv = torch.randn(8, 1, generator=g, dtype=torch.float64).expand(8, 6)  # one advantage per response
    t = geo_mean_loss(logprobs, old, adv, mask, clip_low=EPS_LOW, clip_high=EPS_HIGH)
    reference = torch.zeros_like(t.loss)
    for i in range(mask.shape[0]):
        n = int(mask[i].sum())
        a = float(adv[i, 0])
        kept = []
        for j in range(n):
            d = logprobs[i, j] - old[i, j]
            if a > 0:
                kept.append(torch.minimum(d, torch.clamp(d, -EPS_LOW, EPS_HIGH)))
            elif a < 0:
                kept.append(torch.maximum(d, torch.clamp(d, -EPS_LOW, EPS_HIGH)))
            else:
                kept.append(0.0 * d)
        loss = -a * torch.exp(sum(kept) / n)
        for j in range(n):
            reference[i, j] = loss
    _compare(t, reference, logprobs, mask)
    assert t.clipped_low.any() and t.clipped_high.any()


def test_new_losses_stay_finite_past_float32s_exp():
    logprobs = torch.tensor([[200.0, -200.0], [150.0, 3.0]], requires_grad=True)
    adv = torch.tensor([[-1.0, 1.0], [-1.0, -1.0]])
    for kind, options in (("clip_cov", {}), ("kl_cov", {}), ("geo_mean", {})):
        t = policy_loss(kind, logprobs, torch.zeros(2, 2), adv, torch.ones(2, 2), clip_low=0.2, clip_high=0.2, **options)
        t.loss.sum().backward()
        assert torch.isfinite(t.loss).all() and torch.isfinite(logprobs.grad).all(), kind
        logprobs.grad = None
