"""The per-token policy losses on hand-computed tokens: decoupled and dual clipping, GSPO's
sequence ratio, CISPO's clipped weight, and a log-ratio far past float32's exp."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_mem.rl.policy_losses import clipped_surrogate, cispo_loss, gspo_loss, policy_loss

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
