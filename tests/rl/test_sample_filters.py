"""DAPO's zero-variance group filter, the truncation test and the soft overlong penalty."""

from __future__ import annotations

import torch

from lightning_mem.rl.sample_filters import groups_filtered, overlong_penalty, truncated, varied_groups


def test_groups_that_scored_all_alike_are_dropped():
    scores = torch.tensor([1.0, 0.0, 0.45, 0.45, 0.45, 7.0])
    groups = torch.tensor([0, 0, 1, 1, 1, 2])  # group 2 has one answer: nothing to compare, dropped
    keep = varied_groups(scores, groups)
    assert keep.tolist() == [True, True, False, False, False, False]
    dropped, total = groups_filtered(keep, groups)
    assert (dropped.item(), total.item()) == (2.0, 3.0)


def test_truncated_means_full_length_without_an_end_token():
    eos = 9
    ids = torch.tensor([[1, 2, 3], [1, 9, 0], [1, 2, 9], [4, 0, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]])
    assert truncated(ids, mask, [eos], max_new_tokens=3).tolist() == [True, False, False, False]


def test_overlong_penalty_ramps_over_the_buffer():
    lengths = torch.tensor([0, 12, 13, 14, 16, 20])
    # L_max 16, buffer 4: no penalty up to 12, then -(len - 12) / 4, -1 at 16 and beyond
    torch.testing.assert_close(overlong_penalty(lengths, max_new_tokens=16, buffer=4, factor=0.5),
                               0.5 * torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
