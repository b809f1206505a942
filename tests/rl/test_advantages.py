"""RLOO, REINFORCE++ and REINFORCE++-baseline on hand-computed groups."""

from __future__ import annotations

import pytest
import torch

from lightning_mem.rl.advantages import (
    discounted_returns,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)

GROUPS = torch.tensor([0, 0, 0, 1, 1, 1])
MASK = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1], [1, 0], [0, 0]])  # the last row fully masked


def test_rloo_baseline_is_the_mean_of_the_others():
    scores = torch.tensor([1.0, 0.0, 0.5, 0.3, 0.3, 0.3])  # group 1 all alike
    adv = rloo_advantages(scores, GROUPS, MASK)
    # 1 - (0 + 0.5)/2 = 0.75; 0 - 0.75 = -0.75; 0.5 - 0.5 = 0
    torch.testing.assert_close(adv[:3, 0], torch.tensor([0.75, -0.75, 0.0]))
    assert adv[1, 1] == 0 and (adv[3:] == 0).all()  # padding, and the all-equal group exactly 0


def test_rloo_group_of_one_is_an_error():
    with pytest.raises(ValueError, match="group_size"):
        rloo_advantages(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 1]), torch.ones(3, 1))


def test_discounted_returns():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [2.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    torch.testing.assert_close(discounted_returns(rewards, mask, gamma=0.5), torch.tensor([[0.25, 0.5, 1.0], [2.0, 0, 0]]))


def test_reinforce_pp_whitens_the_returns_over_the_batch():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [3.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 0]])
    adv = reinforce_pp_advantages(rewards, mask, gamma=1.0)
    returns = torch.tensor([1.0, 1.0, 0.0, 0.0, 3.0])  # the 5 real tokens
    expected = (returns - returns.mean()) / returns.std()
    torch.testing.assert_close(adv[mask.bool()], expected, atol=1e-6, rtol=1e-5)
    assert adv[2, 1] == 0


def test_reinforce_pp_baseline_centres_per_group_then_whitens_per_batch():
    scores = torch.tensor([1.0, 0.0, 0.5, 0.3, 0.3, 0.9])
    adv = reinforce_pp_baseline_advantages(scores, GROUPS, MASK)
    centred = torch.tensor([0.5, -0.5, 0.0, -0.2, -0.2, 0.4])
    per_token = centred.unsqueeze(1).expand(6, 2)[MASK.bool()]
    expected = (per_token - per_token.mean()) / per_token.std()
    torch.testing.assert_close(adv[MASK.bool()], expected, atol=1e-6, rtol=1e-5)
    assert (adv[5] == 0).all()


def test_reinforce_pp_baseline_all_alike_is_exactly_zero():
    scores = torch.full((6,), 0.45)  # 0.45 has no exact binary form: float noise must not become +-1
    assert (reinforce_pp_baseline_advantages(scores, GROUPS, MASK).abs() < 1e-6).all()
