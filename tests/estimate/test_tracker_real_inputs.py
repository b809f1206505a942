"""Operators of real tensors under the fake-mode tracker: integers stay real (the run's token ids
and lengths), a large floating result of real inputs runs fake, and both count the same bytes."""

from __future__ import annotations

import torch

from lightning_mem.estimate.tracker import REAL_FLOAT_INPUT_NUMEL, REAL_INT_NUMEL, MemoryLedger, TrackingMode
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


def test_a_boolean_mask_broadcast_past_the_real_limit_runs_fake_and_counts_its_bytes():
    # transformers' sdpa mask: [rows, 1, L, L] from L-long ranges and the [rows, L] padding mask,
    # gigabytes for a packed row of 16k tokens; only fake attention reads it.
    rows, length = 2, 4096
    q = torch.arange(length).view(1, 1, length, 1)
    kv = torch.arange(length).view(1, 1, 1, length)
    padding = torch.ones(rows, 1, 1, length, dtype=torch.bool)
    ledger = MemoryLedger(set())
    with TrackingMode(ledger, fake=True):
        causal = kv <= q  # L x L = REAL_INT_NUMEL elements: still made for real
        mask = causal & padding
        live = ledger.device_bytes
    assert causal.numel() == REAL_INT_NUMEL and not isinstance(causal, FakeTensor)
    assert bool(causal[0, 0, 5, 3]) and not bool(causal[0, 0, 3, 5])
    assert isinstance(mask, FakeTensor) and mask.numel() > REAL_INT_NUMEL
    assert mask.shape == (rows, 1, length, length) and mask.dtype == torch.bool and mask.device.type == "cpu"
    assert live == causal.numel() + mask.numel()  # one byte a boolean, as a real one holds


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


def test_fake_tensors_made_by_the_tracker_equal_the_constructors():
    from lightning_mem.estimate.fake_ops import FakeMaker as _FakeMaker

    mode = TrackingMode(MemoryLedger(set()), fake=True).fake_mode
    make = _FakeMaker(mode)
    cpu = torch.device("cpu")
    for requires_grad in (False, True):
        meta = torch.empty_strided((3, 5), (1, 3), dtype=torch.bfloat16, device="meta", requires_grad=requires_grad)
        fast, slow = make(meta, cpu), FakeTensor(mode, meta, cpu)
        assert type(fast) is FakeTensor and fast.__dict__ == slow.__dict__
        assert torch._C._dispatch_keys(fast) == torch._C._dispatch_keys(slow)
        assert (fast.shape, fast.stride(), fast.dtype, fast.device, fast.requires_grad) == (
            slow.shape, slow.stride(), slow.dtype, slow.device, slow.requires_grad)


def test_the_tracker_dispatch_is_not_wrapped_by_dynamo():
    # TorchDispatchMode wraps a subclass's __torch_dispatch__ in torch._disable_dynamo unless told not to.
    assert not hasattr(TrackingMode.__dict__["__torch_dispatch__"], "__wrapped__")


def _layout(t):
    return (type(t), tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad)


def test_the_meta_path_gives_the_fake_modes_results_and_is_cached_on_layouts():
    """Mixed real and fake inputs (GAE's torch.where over a real mask, a KV cache's index_copy_ at
    real positions), in-place operators and copy_ run by their meta kernels: the same layout as the
    fake mode's result, a written input returned as itself, the second call from the run's cache."""
    aten = torch.ops.aten
    ledger = MemoryLedger(set())
    tracking = TrackingMode(ledger, fake=True)
    with tracking:
        values = torch.empty(64, requires_grad=True)
        cache = torch.empty(4, 16, 8, dtype=torch.bfloat16)
        states = torch.empty(4, 2, 8, dtype=torch.bfloat16)
        weights = torch.empty(8, 8)
    mask = torch.ones(64, dtype=torch.bool)
    zero = torch.zeros(())
    positions = torch.tensor([3, 4])
    calls = [
        (aten.where.self, (mask, values, zero)),
        (aten.mul.Tensor, (values, zero)),
        (aten.index_copy_.default, (cache, 1, positions, states)),
        (aten.add_.Tensor, (weights, weights)),
        (aten.copy_.default, (weights, torch.ones(8, 8))),
        (aten.mm.default, (weights, weights)),
    ]
    for func, args in calls:
        expected = tracking.fake_mode.__torch_dispatch__(func, (), args, {})
        with tracking:
            got = func(*args)
            cached = len(tracking._op_cache)
            again = func(*args)
            assert len(tracking._op_cache) == cached, func  # the second call: a hit
        assert tracking._runs_meta[func], func
        if func._schema.is_mutable:
            assert got is args[0] and again is args[0], func
        else:
            assert isinstance(got, FakeTensor) and _layout(got) == _layout(expected), func
            assert _layout(again) == _layout(expected) and again is not got, func


def test_a_real_tensor_written_with_fake_values_keeps_its_own_values():
    real = torch.arange(4.0)
    with TrackingMode(MemoryLedger(set()), fake=True):
        fake = torch.empty(4)
        out = real.add_(fake)
    assert out is real and not isinstance(real, FakeTensor)
    assert torch.equal(real, torch.arange(4.0))
