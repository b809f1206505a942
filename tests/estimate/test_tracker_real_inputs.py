"""Operators of real tensors under the fake-mode tracker: integers stay real (the run's token ids
and lengths), a large floating result of real inputs runs fake, and both count the same bytes."""

from __future__ import annotations

import torch

from lightning_mem.estimate.tracker import REAL_FLOAT_INPUT_NUMEL, MemoryLedger, TrackingMode
from torch._subclasses.fake_tensor import FakeTensor


def _mask(rows: int, length: int) -> torch.Tensor:
    # transformers' sdpa turns a real boolean [rows, 1, L, L] mask into a float one with torch.where
    return torch.ones(length, length, dtype=torch.bool).tril().expand(rows, 1, length, length).contiguous()


def _where(mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    ledger = MemoryLedger(set())
    zero, low = torch.tensor(0.0, dtype=torch.bfloat16), torch.tensor(-1.0e4, dtype=torch.bfloat16)
    with TrackingMode(ledger, fake=True):
        out = torch.where(mask, zero, low)
        bytes_live = ledger.device_bytes
    return out, bytes_live


def test_a_large_float_made_of_real_masks_runs_fake_and_counts_its_bytes():
    mask = _mask(2, 1024)
    assert mask.numel() > REAL_FLOAT_INPUT_NUMEL
    out, live = _where(mask)
    assert isinstance(out, FakeTensor)
    assert out.shape == mask.shape and out.dtype == torch.bfloat16 and out.device.type == "cpu"
    assert live == mask.numel() * 2  # the bf16 result: the same bytes a real one holds


def test_a_small_float_of_real_inputs_is_computed_for_real():
    mask = _mask(1, 64)
    out, live = _where(mask)
    assert not isinstance(out, FakeTensor)
    assert torch.equal(out[0, 0, 0, :2], torch.tensor([0.0, -1.0e4], dtype=torch.bfloat16))
    assert live == mask.numel() * 2


def test_large_integer_and_boolean_results_stay_real():
    mask = _mask(2, 1024)
    ids = torch.arange(mask.numel(), dtype=torch.int64).view(mask.shape)
    with TrackingMode(MemoryLedger(set()), fake=True):
        both = mask & mask
        shifted = ids + 1
        where_ids = torch.where(mask, ids, torch.zeros((), dtype=torch.int64))
    assert not any(isinstance(t, FakeTensor) for t in (both, shifted, where_ids))
    assert int(both.sum()) == int(mask.sum())
    assert int(shifted[1, 0, 5, 7]) == int(ids[1, 0, 5, 7]) + 1
    assert int(where_ids[0, 0, 0, 1]) == 0 and int(where_ids[0, 0, 1, 1]) == int(ids[0, 0, 1, 1])


def test_a_fake_tensors_device_is_answered_without_the_fake_mode():
    with TrackingMode(MemoryLedger(set()), fake=True) as mode:
        t = torch.empty(4, 4)
        assert isinstance(t, FakeTensor)
        assert t.device == torch.device("cpu")
        assert (t @ t).device == torch.device("cpu")
    assert mode.fake_mode is not None


def test_the_runs_own_cache_of_fake_results_gives_new_tensors_of_the_fake_modes_layout():
    ledger = MemoryLedger(set())
    with TrackingMode(ledger, fake=True) as mode:
        a, b = torch.empty(8, 16), torch.empty(16, 4)
        first = a @ b
        cached = len(mode._op_cache)
        assert any(key[0] is torch.ops.aten.mm.default for key in mode._op_cache)
        base = ledger.device_bytes
        second = a @ b  # the same layouts: from the run's cache
        assert len(mode._op_cache) == cached
        assert ledger.device_bytes == base + 8 * 4 * 4  # a new tensor, counted
        chunks = torch.empty(6, 4).split(2)  # outputs sharing the input's storage: not cached
    assert isinstance(second, FakeTensor) and second.fake_mode is mode.fake_mode
    assert (second.shape, second.stride(), second.dtype) == (first.shape, first.stride(), first.dtype)
    assert second.untyped_storage()._cdata != first.untyped_storage()._cdata
    assert not any(key[0] is torch.ops.aten.split.Tensor for key in mode._op_cache)
    assert len(chunks) == 3
