"""Context parallelism's pieces that need no process group: how a batch splits, and the Ulysses
attention function's registration and single-rank behaviour. The split runs themselves (gathers,
all-to-alls, equal gradients) are gloo runs in ``tests/strategies/test_model_parallel.py``."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, AutoConfig, LlamaForCausalLM
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from lightning_mem.context_parallel import (
    SequenceLayout,
    attach_layout,
    layout_of,
    register_ulysses,
    shard_sequences,
    ulysses_attention,
)
from tests.helpers import TINY_MODEL


def test_a_batch_is_padded_to_the_group_and_each_rank_takes_a_contiguous_slice_at_its_positions():
    ids = torch.arange(1, 2 * 7 + 1).reshape(2, 7)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    layout = SequenceLayout(size=2, rank=1, multiple=2)  # context 2, sequence parallelism 2: multiples of 4
    shard = shard_sequences(ids, mask, layout, pad_token_id=0)
    assert (shard.width, shard.length, shard.start, shard.stop) == (8, 7, 4, 8)
    assert shard.input_ids.tolist() == [[5, 6, 7, 0], [12, 13, 14, 0]]  # the pad column is this rank's
    assert shard.position_ids.tolist() == [[4, 5, 6, 7]] * 2  # global positions for the rotary embedding


def test_every_scored_position_belongs_to_exactly_one_rank_in_order():
    width = 9
    positions = torch.tensor([0, 3, 4, 8, 9 + 1, 9 + 5, 9 + 7])  # flat b * width + t
    ids, mask = torch.ones(2, width, dtype=torch.long), torch.ones(2, width, dtype=torch.long)
    shards = [shard_sequences(ids, mask, SequenceLayout(size=3, rank=r)) for r in range(3)]  # width 9: slices of 3
    owners = shards[0].owners(positions, width)
    assert owners.tolist() == [0, 1, 1, 2, 0, 1, 2]
    for rank, shard in enumerate(shards):
        local = shard.local_positions(positions, width)
        mine = positions[owners == rank]
        # Flat indices into the rank's [B, 3] slice that point at the same (row, column).
        rows, cols = local // 3, local % 3 + shard.start
        assert (rows * width + cols).tolist() == mine.tolist()


def test_a_left_padded_batch_is_refused_under_context_parallelism_only():
    ids = torch.ones(2, 4, dtype=torch.long)
    left = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    with pytest.raises(ValueError, match="context parallelism needs right-padded sequences"):
        shard_sequences(ids, left, SequenceLayout(size=2, rank=0))
    shard_sequences(ids, left, SequenceLayout(multiple=2))  # sequence parallelism alone keeps the mask


def test_ulysses_is_registered_with_its_kernels_mask_and_is_the_kernel_without_a_layout():
    name = register_ulysses("eager")
    assert name == "ulysses_sdpa" and name in AttentionInterface() and name in ALL_MASK_ATTENTION_FUNCTIONS
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    sdpa = AttentionInterface()["sdpa"]
    want, _ = sdpa(module, q, k, v, None, scaling=0.5)
    got, _ = ulysses_attention(module, q, k, v, None, kernel="sdpa", scaling=0.5)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_strategy_attaches_the_layout_and_switches_attention():
    model = LlamaForCausalLM(AutoConfig.from_pretrained(TINY_MODEL))
    assert layout_of(model) is None
    layout = SequenceLayout(size=2, rank=0)
    attach_layout(model, layout)
    assert layout_of(model) is layout and model.config._attn_implementation == "ulysses_sdpa"
    # A plain forward (generation, a reward model) is the kernel's: same logits as before the switch.
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        switched = model(input_ids=ids).logits
        model.set_attn_implementation("sdpa")
        plain = model(input_ids=ids).logits
    torch.testing.assert_close(switched, plain, rtol=0, atol=0)
