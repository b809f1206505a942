import pytest

from lightning_mem.batching import TokenBudgetSampler, pack_by_token_budget, padded_tokens, split_batches_to_multiple


def test_pack_respects_budget_and_keeps_every_index():
    lengths = [5, 9, 3, 12, 7, 7, 2, 11, 4, 6]
    batches = pack_by_token_budget(range(len(lengths)), lengths, max_tokens=24)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert all(padded_tokens([lengths[i] for i in b]) <= 24 for b in batches)


def test_oversized_sample_gets_its_own_batch():
    assert pack_by_token_budget([0, 1, 2], [4, 50, 4], max_tokens=16) == [[0], [1], [2]]


def test_split_to_multiple_keeps_samples():
    batches = split_batches_to_multiple([[0, 1, 2, 3], [4, 5], [6]], 2)
    assert len(batches) == 4 and sorted(i for b in batches for i in b) == list(range(7))


def test_sampler_ranks_disjoint_equal_count_and_complete():
    lengths = [3 + (i * 7) % 29 for i in range(301)]
    ranks = [TokenBudgetSampler(lengths, max_tokens=128, num_replicas=2, rank=r, seed=1) for r in range(2)]
    per_rank = [list(s) for s in ranks]
    assert len(per_rank[0]) == len(per_rank[1]) == len(ranks[0])
    seen = [i for batches in per_rank for b in batches for i in b]
    assert sorted(seen) == list(range(len(lengths)))
    assert all(padded_tokens([lengths[i] for i in b]) <= 128 for batches in per_rank for b in batches)
    assert ranks[0].padding_efficiency() > 0.8  # sorting within windows keeps padding low


def test_epochs_reshuffle_deterministically_and_skip_resumes():
    lengths = [10] * 40
    sampler = TokenBudgetSampler(lengths, batch_size=4, seed=3)
    sampler.set_epoch(1)
    epoch1 = list(sampler)
    sampler.set_epoch(2)
    assert list(sampler) != epoch1
    # A resumed run positioned 3 batches into epoch 1 continues from there, whatever set_epoch says.
    again = TokenBudgetSampler(lengths, batch_size=4, seed=3)
    again.set_epoch(5)
    again.position_fn = lambda: len(again) + 3
    assert list(again) == epoch1[3:]


def test_exactly_one_of_budget_and_batch_size():
    with pytest.raises(ValueError, match="exactly one"):
        TokenBudgetSampler([1, 2], max_tokens=8, batch_size=2)
