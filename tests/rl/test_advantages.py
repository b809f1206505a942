"""RLOO, REINFORCE++, REINFORCE++-baseline, ReMax, OPO and pass@k GRPO on hand-computed groups,
and the last three against their papers' formulas, sample by sample, on random groups."""

from __future__ import annotations

import pytest
import torch

from lightning_mem.rl.advantages import (
    discounted_returns,
    grpo_passk_advantages,
    opo_advantages,
    remax_advantages,
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


def test_remax_is_the_return_minus_the_greedy_answers_score():
    # per-token rewards: a KL penalty of -0.1 per token and the score on the last one
    rewards = torch.tensor([[-0.1, -0.1, 0.9], [-0.1, 0.4, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = remax_advantages(rewards, torch.tensor([0.5, 1.0]), mask)
    # returns [0.7, 0.8, 0.9] - 0.5 and [0.3, 0.4] - 1.0
    torch.testing.assert_close(adv, torch.tensor([[0.2, 0.3, 0.4], [-0.7, -0.6, 0.0]]))


def test_remax_matches_the_formula_on_random_rewards():
    g = torch.Generator().manual_seed(0)
    rewards, mask = torch.randn(6, 5, generator=g), (torch.rand(6, 5, generator=g) > 0.3).long().cummin(dim=1).values
    baseline = torch.randn(6, generator=g)
    adv = remax_advantages(rewards, baseline, mask)
    for i in range(6):
        for t in range(5):
            expected = sum(float(rewards[i, s]) for s in range(t, 5) if mask[i, s]) - float(baseline[i]) if mask[i, t] else 0.0
            assert float(adv[i, t]) == pytest.approx(expected, abs=1e-5)


def test_opo_baseline_is_the_length_weighted_group_mean():
    scores = torch.tensor([1.0, 0.0, 0.5, 0.3, 0.3, 0.9])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]])
    adv = opo_advantages(scores, GROUPS, mask)
    b0 = (3 * 1.0 + 1 * 0.0 + 2 * 0.5) / 6  # 4/6; not the plain mean 0.5
    b1 = (3 * 0.3 + 1 * 0.3 + 2 * 0.9) / 6
    expected = torch.tensor([1.0 - b0, -b0, 0.5 - b0, 0.3 - b1, 0.3 - b1, 0.9 - b1])
    torch.testing.assert_close(adv[:, 0], expected)
    assert adv[1, 1] == 0 and adv[5, 2] == 0
    with pytest.raises(ValueError, match="group_size"):
        opo_advantages(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 1]), torch.ones(3, 1))


def test_opo_matches_the_formula_on_random_groups():
    g = torch.Generator().manual_seed(1)
    groups = torch.arange(12) // 4
    scores = torch.rand(12, generator=g)
    mask = (torch.arange(7)[None, :] < torch.randint(1, 8, (12, 1), generator=g)).long()
    adv = opo_advantages(scores, groups, mask)
    for i in range(12):
        same = [j for j in range(12) if groups[j] == groups[i]]
        b = sum(float(mask[j].sum()) * float(scores[j]) for j in same) / sum(float(mask[j].sum()) for j in same)
        torch.testing.assert_close(adv[i][mask[i].bool()], torch.full((int(mask[i].sum()),), float(scores[i]) - b))


def test_grpo_passk_credits_only_the_best_answer_by_its_lead():
    scores = torch.tensor([1.0, 0.2, 0.5, 0.3, 0.3, 0.3])  # group 1: a tie at the top
    adv = grpo_passk_advantages(scores, GROUPS, MASK, scale=False)
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.5, 0.0, 0.0, 0.0, 0.0, 0.0]))
    scaled = grpo_passk_advantages(scores, GROUPS, MASK)
    std = torch.tensor([1.0, 0.2, 0.5]).std().item()
    assert scaled[0, 0].item() == pytest.approx(0.5 / (std + 1e-6)) and (scaled[1:] == 0).all()
    with pytest.raises(ValueError, match="group_size"):
        grpo_passk_advantages(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 1]), torch.ones(3, 1))


def test_grpo_passk_matches_the_formula_on_random_groups():
    g = torch.Generator().manual_seed(2)
    groups = torch.arange(16) // 4
    scores = torch.rand(16, generator=g)
    adv = grpo_passk_advantages(scores, groups, torch.ones(16, 2))
    for i in range(16):
        same = sorted((float(scores[j]) for j in range(16) if groups[j] == groups[i]), reverse=True)
        group = torch.tensor(same, dtype=torch.float64)
        expected = (same[0] - same[1]) / (float(group.std()) + 1e-6) if float(scores[i]) == same[0] else 0.0
        assert adv[i].tolist() == pytest.approx([expected, expected], rel=1e-5)
