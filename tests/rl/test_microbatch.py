"""Token-budget micro-batches for the RL passes."""

import pytest

from lightning_mem.batching import padded_tokens
from lightning_mem.batching import split_to_count
from lightning_mem.rl.microbatch import micro_batches


def test_packs_longest_first_within_the_budget():
    lengths = [5, 20, 7, 19, 6, 8]
    batches = micro_batches(lengths, max_tokens=40)
    # sorted: 20, 19 | 8, 7, 6, 5 -> padded 2 x 20 = 40, 4 x 8 = 32
    assert batches == [[1, 3], [5, 2, 4, 0]]
    assert all(padded_tokens([lengths[i] for i in b]) <= 40 for b in batches)
    assert sorted(i for b in batches for i in b) == list(range(6))
    assert micro_batches(lengths, None) == [[1, 3, 5, 2, 4, 0]]


def test_ranks_agree_on_the_largest_count():
    lengths = [5, 20, 7, 19, 6, 8]
    # Another rank needed 4 micro-batches: this one splits its most expensive ones to match.
    batches = micro_batches(lengths, max_tokens=40, agree_on_count=lambda n: max(n, 4))
    assert len(batches) == 4
    assert sorted(i for b in batches for i in b) == list(range(6))
    # The 2 x 20-token batch (40 padded tokens) was split first, then the 4 x 8 one (32).
    assert batches == [[1], [3], [5, 2], [4, 0]]


def test_split_to_count_refuses_what_cannot_be_done():
    with pytest.raises(ValueError, match="3 samples cannot make 4 micro-batches"):
        split_to_count([[0, 1], [2]], 4, [1, 1, 1])
    with pytest.raises(ValueError, match="cannot reach 1 micro-batches from 2"):
        split_to_count([[0], [1]], 1, [1, 1])
