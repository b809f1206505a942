import numpy as np
import pytest

from lightning_mem.batching import (
    TokenBudgetSampler,
    pack_by_token_budget,
    pad_batches_to_multiple,
    padded_tokens,
    split_batches_to_multiple,
)


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


def test_issue_example_serves_every_sample():
    # Three samples that each fill the budget cannot go 2 + 1 to two ranks without one rank
    # idling: the third used to be dropped; now the shortest is served a second time.
    served = [list(TokenBudgetSampler([8000, 7000, 6000], max_tokens=8192, num_replicas=2, rank=r, shuffle=False))
              for r in range(2)]
    assert len(served[0]) == len(served[1]) == 2
    flat = sorted(i for batches in served for b in batches for i in b)
    assert flat == [0, 1, 2, 2]


def test_property_every_sample_served_once_per_epoch_equal_steps():
    # A seeded random search over lengths, budgets, batch sizes, rank counts and epochs.
    import random
    import warnings

    rng = random.Random(1234)
    for case in range(400):
        n = rng.randint(1, 60)
        lengths = [rng.randint(1, rng.choice([8, 64, 512])) for _ in range(n)]
        replicas = rng.randint(1, 8)
        by_budget = rng.random() < 0.7
        kwargs = {"max_tokens": rng.randint(1, 600)} if by_budget else {"batch_size": rng.randint(1, 9)}
        shuffle, seed, epoch = rng.random() < 0.5, rng.randint(0, 99), rng.randint(0, 3)
        window = rng.choice([1, 4, 512])
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            samplers = [
                TokenBudgetSampler(lengths, num_replicas=replicas, rank=r, shuffle=shuffle, seed=seed,
                                   sort_window=window, **kwargs)
                for r in range(replicas)
            ]
        for s in samplers:
            s.set_epoch(epoch)
        served = [list(s) for s in samplers]
        ctx = f"case {case}: n={n} replicas={replicas} {kwargs}"
        assert len({len(batches) for batches in served}) == 1, ctx
        assert all(len(batches) == len(s) for batches, s in zip(served, samplers)), ctx
        assert all(b for batches in served for b in batches), ctx  # no empty batch
        counts = [0] * n
        for batches in served:
            for b in batches:
                for i in b:
                    counts[i] += 1
        pad = samplers[0].num_padding_batches
        assert pad < replicas, ctx
        assert all(c >= 1 for c in counts), ctx  # nobody is dropped
        assert sum(counts) == n + pad, ctx  # exactly once, plus the documented padding
        if pad:
            # Padding only when splitting cannot help: every batch holds one sample.
            assert all(len(b) == 1 for b in samplers[0].batches), ctx
        if by_budget:
            budget = kwargs["max_tokens"]
            assert all(
                len(b) == 1 or padded_tokens([lengths[i] for i in b]) <= budget for batches in served for b in batches
            ), ctx
        else:
            assert all(len(b) <= kwargs["batch_size"] for batches in served for b in batches), ctx


def test_padding_is_announced_once_on_rank_zero():
    with pytest.warns(UserWarning, match="served twice"):
        TokenBudgetSampler([9, 9, 9], max_tokens=10, num_replicas=2, rank=0)


# -- the plan's memory per row (issue #45): numpy arrays, not a Python int per row ----------------


def _reference_plan(lengths, max_tokens, sort_window, seed, world):
    """The plan as the list-based packer makes it (the code before the numpy plan)."""
    import torch

    order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed)).tolist()
    batches = []
    for start in range(0, len(order), sort_window):
        window = sorted(order[start : start + sort_window], key=lambda i: -lengths[i])  # stable
        batches += pack_by_token_budget(window, lengths, max_tokens)
    return pad_batches_to_multiple(split_batches_to_multiple(batches, world, lengths), world, lengths)


@pytest.mark.parametrize("max_tokens, sort_window", [(128, 512), (40, 7), (1000, 1)])
def test_the_numpy_plan_is_the_list_packers_plan(max_tokens, sort_window):
    lengths = [1 + (i * 37) % 61 for i in range(997)]
    sampler = TokenBudgetSampler(lengths, max_tokens=max_tokens, num_replicas=2, seed=5, sort_window=sort_window)
    assert list(sampler.batches) == _reference_plan(lengths, max_tokens, sort_window, 5, 2)


@pytest.mark.parametrize("kind", ["max_tokens", "batch_size", "prompts"])
def test_the_plan_holds_eight_bytes_a_row_and_a_batch(kind):
    """At ten million rows a list of lists held a Python int per row in every rank (about 36 bytes
    each); the plan is two arrays: 4 bytes a sample served (int32) plus 8 bytes a batch (and one)."""
    from lightning_mem.batching import BatchPlan
    from lightning_mem.data.prompts import FullBatchSampler

    rows = 10_007
    lengths = np.array([1 + (i * 13) % 200 for i in range(rows)], dtype=np.int32)  # as the cache holds them
    if kind == "prompts":
        sampler = FullBatchSampler(lengths, batch_size=8, num_replicas=2, seed=0)
    else:
        options = {"max_tokens": 512} if kind == "max_tokens" else {"batch_size": 8}
        sampler = TokenBudgetSampler(lengths, num_replicas=2, seed=0, weights=lengths, **options)
    plan = sampler.batches
    assert type(plan) is BatchPlan and plan.flat.dtype == np.int32 and plan.offsets.dtype == np.int64
    served = int(plan.sizes().sum())
    assert plan.nbytes == 4 * served + 8 * (len(plan) + 1)
    assert served == (rows // 8 // 2 * 2 * 8 if kind == "prompts" else rows)
    assert sampler.lengths.dtype == np.int32  # the cache's column, shared: no copy per sampler
    if kind != "prompts":
        assert sampler.batch_weights.dtype == np.float64 and sampler.batch_weights.nbytes == 8 * len(plan)
