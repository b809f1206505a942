"""Packed rows (``data.packing``) compute what the same examples compute unpacked.

- best-fit-decreasing keeps every example once, within the budget, and fills rows;
- the packed layout: restarting position ids, each example's first label masked, no attention mask;
  rows of ``max_length`` (several a micro-batch, each row's end padded) or one row (flash varlen);
- the SFT recipe's loss and its gradients on packed rows equal those on the right-padded batch of
  the same examples (fp32, 1e-5): full fine-tuning under sdpa and eager, LoRA, a 4-bit (QLoRA) base;
- a token of one example does not move when another example of its row changes (isolation);
- the datamodule: same examples and step token counts as unpacked, a random (not length-sorted)
  data order, one error for packing without a token budget or with an attention that cannot isolate.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_mem.data import SFTDataModule
from lightning_mem.data.packing import (
    PackedBatchSampler,
    best_fit_decreasing,
    check_packing_attention,
    collate_packed,
    flatten_rows,
    largest_packed_batch,
    next_fit_rows,
)
from lightning_mem.data.sft import collate_right_padded
from lightning_mem.settings import SettingError
from recipes.sft import SFTModule
from tests.helpers import ARITH, TINY_MODEL

VOCAB = 307  # tiny-llama's


# -- the plan ---------------------------------------------------------------------------------------


def test_best_fit_decreasing_keeps_every_example_within_the_budget():
    lengths = [6, 5, 4, 3, 2, 12]
    bins = best_fit_decreasing(range(len(lengths)), lengths, capacity=10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert [5] in bins  # longer than the budget: a row of its own, not dropped
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins if b != [5])
    # 6+4, 5+3+2 and the long one: the optimum, where next-fit in this order takes 4 rows.
    assert len(bins) == 3
    with pytest.raises(ValueError, match="capacity"):
        best_fit_decreasing([0], [1], capacity=0)


def test_packed_sampler_fills_rows_in_random_order_on_two_ranks():
    g = torch.Generator().manual_seed(0)
    # Long-tailed lengths: mostly short, a few a whole row (the datamodule truncates to max_length,
    # the rows' length).
    lengths = (torch.distributions.LogNormal(3.0, 0.8).sample((2000,)).clamp(2, 128)).long().tolist()
    weights = [n - 1 for n in lengths]
    ranks = [PackedBatchSampler(lengths, max_tokens=512, row_length=128, num_replicas=2, rank=r, seed=3,
                                weights=weights, accumulate_grad_batches=2) for r in range(2)]
    served = [list(iter(s)) for s in ranks]
    seen = sorted(i for batches in served for b in batches for i in b)
    assert seen == list(range(len(lengths)))  # every example once per epoch, over both ranks
    assert all(sum(lengths[i] for i in b) <= 512 for batches in served for b in batches)
    # A micro-batch is at most 4 rows of 128 as collated (an example over 128 alone in its row).
    for b in (b for batches in served for b in batches):
        rows = next_fit_rows([lengths[i] for i in b], 128)
        assert len(rows) <= 4 and max(rows) <= 128
    assert ranks[0].fill() > 0.95 and ranks[0].padding_efficiency() > 0.95
    # Every step's weight is the label tokens of its micro-batches on both ranks.
    first_step = served[0][:2] + served[1][:2]
    assert served[0][0].step_weight == sum(weights[i] for b in first_step for i in b)
    # Not a length-sorted order: the rows' longest examples, in the order served, are no ramp.
    longest = torch.tensor([max(lengths[i] for i in b) for b in served[0]], dtype=torch.float)
    steps = torch.arange(len(longest), dtype=torch.float)
    assert abs(torch.corrcoef(torch.stack([steps, longest]))[0, 1]) < 0.3
    del g


def test_packed_layout():
    examples = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8, 9], "labels": [8, 9]},
                {"input_ids": [1, 2, 3, 4], "labels": [1, 2, 3, 4]}]
    batch = collate_packed(examples)
    assert batch.keys() == {"input_ids", "labels", "position_ids", "row_tokens"}  # no attention mask: see the module
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9, -100, 2, 3, 4]]  # never a target across a boundary
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    # Rows of 5: the third example starts a row; the first row's end is padding (a segment of its own).
    rows = collate_packed(examples, row_length=5)
    assert rows["input_ids"].tolist() == [[5, 6, 7, 8, 9], [1, 2, 3, 4, 0]]
    assert rows["labels"].tolist() == [[-100, 6, 7, -100, 9], [-100, 2, 3, 4, -100]]
    assert rows["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]]
    assert rows["row_tokens"].tolist() == [5, 4]
    flat = flatten_rows(rows)
    for key in ("input_ids", "labels", "position_ids"):
        assert flat[key].tolist() == batch[key].tolist(), key
    largest = largest_packed_batch(11, max_tokens=10, max_length=4)  # two full rows of 4
    assert largest["position_ids"].tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert int(largest["step_label_tokens"]) == 2 * 3
    assert largest_packed_batch(11, max_tokens=3, max_length=4)["input_ids"].shape == (1, 3)


def test_next_fit_rows_of_a_micro_batch_are_at_most_its_packed_rows():
    # The sampler lists a micro-batch row after row; the collator splits it again by next-fit.
    g = torch.Generator().manual_seed(1)
    for _ in range(200):
        lengths = torch.randint(1, 40, (30,), generator=g).tolist()
        packed = best_fit_decreasing(range(len(lengths)), lengths, capacity=40)
        listed = [lengths[i] for row in packed for i in row]
        assert len(next_fit_rows(listed, 40)) <= len(packed)


# -- equality with the unpacked batch ---------------------------------------------------------------


def _examples(seed: int = 0, lengths=(17, 5, 30, 2, 11)) -> list[dict[str, list[int]]]:
    """Examples of different lengths, each with a prompt (-100 labels) before its completion."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(3, VOCAB, (n,), generator=g).tolist()
        prompt = n // 3
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return out


def _llama(attn: str = "sdpa") -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         attn_implementation=attn)
    return LlamaForCausalLM(config)


def _module(model: torch.nn.Module, chunk_size: int | None = 7) -> SFTModule:
    module = SFTModule(name_or_path=str(TINY_MODEL), logits_chunk_size=chunk_size)
    module.model = model
    return module


def _loss_and_grads(module: SFTModule, batch: dict) -> tuple[float, int, dict[str, torch.Tensor]]:
    loss_sum, tokens = module.loss(batch)
    loss_sum.backward()
    grads = {n: p.grad.clone() for n, p in module.model.named_parameters() if p.grad is not None}
    module.model.zero_grad(set_to_none=True)
    return float(loss_sum.detach()), int(tokens), grads


def _assert_packed_equals_unpacked(module: SFTModule, examples: list[dict], row_length: int | None = None) -> None:
    want_loss, want_tokens, want = _loss_and_grads(module, collate_right_padded(examples, pad_token_id=0))
    batch = collate_packed(examples, row_length)
    if row_length is not None:
        assert batch["input_ids"].shape[0] > 1  # several rows, padded at their ends
    got_loss, got_tokens, got = _loss_and_grads(module, batch)
    assert got_tokens == want_tokens == sum(sum(x != -100 for x in e["labels"][1:]) for e in examples)
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    assert got.keys() == want.keys() and got
    for name, g in want.items():  # relative to each gradient's norm: fp32 sums in another order
        assert float((got[name] - g).norm() / g.norm().clamp(min=1e-12)) <= 1e-5, name


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_rows_of_max_length_and_their_flattened_row_equal_unpacked(attn):
    # Rows of 32: 17+5 | 30+2 | 11 (two rows end in padding); flattened: the one row varlen flash reads.
    module, examples = _module(_llama(attn)), _examples(seed=3)
    _assert_packed_equals_unpacked(module, examples, row_length=32)
    want_loss, _, want = _loss_and_grads(module, collate_packed(examples, 32))
    got_loss, _, got = _loss_and_grads(module, flatten_rows(collate_packed(examples, 32)))
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    for name, g in want.items():
        assert float((got[name] - g).norm() / g.norm().clamp(min=1e-12)) <= 1e-5, name


@pytest.mark.parametrize(("attn", "chunk_size"), [("sdpa", 7), ("eager", None)])
def test_full_fine_tuning_packed_equals_unpacked(attn, chunk_size):
    _assert_packed_equals_unpacked(_module(_llama(attn), chunk_size), _examples())


def test_lora_packed_equals_unpacked():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                lora_dropout=0.0, init_lora_weights=False))
    _assert_packed_equals_unpacked(_module(model), _examples(seed=1))


def test_qlora_packed_equals_unpacked(tmp_path):
    from peft import LoraConfig, get_peft_model

    from lightning_mem.quantization import QuantizationSettings, load_quantized_causal_lm, materialize_random_weights

    base = materialize_random_weights(str(TINY_MODEL), tmp_path / "base", seed=0)
    model = load_quantized_causal_lm(str(base), QuantizationSettings(compute_dtype="float32"))
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"],
                                             lora_dropout=0.0, init_lora_weights=False))
    _assert_packed_equals_unpacked(_module(model), _examples(seed=2))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_token_does_not_move_when_another_example_changes(attn):
    model = _llama(attn).eval()
    first, second = _examples(lengths=(12, 9))[:2]
    changed = {"input_ids": [(t * 7 + 1) % VOCAB for t in first["input_ids"]] + [4, 4, 4], "labels": [-100] * 15}

    def second_logits(examples: list[dict]) -> torch.Tensor:
        batch = collate_packed(examples)
        # use_cache=False as the recipes' score_tokens passes it: with a KV cache, transformers
        # builds no packed mask (masking_utils._preprocess_mask_arguments).
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        return logits[0, -len(second["input_ids"]):]

    alone = second_logits([second])
    torch.testing.assert_close(second_logits([first, second]), alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second_logits([changed, second]), alone, rtol=1e-5, atol=1e-5)


# -- the datamodule and the recipe's checks ---------------------------------------------------------


def _data(**kwargs) -> SFTDataModule:
    data = SFTDataModule(train_file=str(ARITH / "train.jsonl"), tokenizer=str(TINY_MODEL), max_length=64,
                         max_tokens_per_batch=512, **kwargs)
    data.setup("fit")
    return data


def test_datamodule_packs_every_example_with_the_unpacked_step_tokens():
    packed, padded = _data(packing=True), _data()
    rows = list(packed.train_dataloader())
    assert all(set(b) == {"input_ids", "labels", "position_ids", "row_tokens", "step_label_tokens", "target_positions",
                          "target_ids", "label_tokens"} for b in rows)
    # Rows of max_length (64), as many as the budget (512) holds, and nearly full.
    assert all(b["input_ids"].shape[0] <= 8 and b["input_ids"].shape[1] <= 64 for b in rows)
    assert sum(int(b["row_tokens"].sum()) for b in rows) / sum(b["input_ids"].numel() for b in rows) > 0.95
    label_tokens = sum(int((b["labels"] != -100).sum()) for b in rows)
    assert label_tokens == sum(padded.train_set.label_tokens)  # the same targets, none across a boundary
    assert sum(int(b["step_label_tokens"]) for b in rows) == label_tokens  # one micro-batch a step here
    # Rows of 64 hold 2-3 of these short examples: about as many micro-batches as length-sorted
    # padding needs (whose rows are all alike), in random order.
    assert len(rows) <= 1.05 * len(padded.train_dataloader())


def test_packing_needs_a_token_budget_and_an_isolating_attention():
    with pytest.raises(SettingError, match="`packing`: true needs `max_tokens_per_batch`"):
        SFTDataModule(train_file=str(ARITH / "train.jsonl"), tokenizer=str(TINY_MODEL), batch_size=4, packing=True)
    check_packing_attention("sdpa", key="model.attn_implementation", packing_key="data.packing")
    with pytest.raises(SettingError, match=r"`model.attn_implementation` \('paged_attention'\).*`data.packing: true`"):
        check_packing_attention("paged_attention", key="model.attn_implementation", packing_key="data.packing")


@pytest.mark.parametrize("split", [dict(tensor_parallel_size=2), dict(context_parallel_size=2)])
def test_packing_with_a_model_split_is_refused_naming_both_keys(split):
    from types import SimpleNamespace

    from lightning_mem.ranks import check_packing_splits

    key = next(iter(split))
    trainer = SimpleNamespace(strategy=SimpleNamespace(**split))
    with pytest.raises(ValueError, match=rf"`data.packing: true` with `trainer.strategy.init_args.{key}: 2`"):
        check_packing_splits(trainer, packing_key="data.packing")
    check_packing_splits(SimpleNamespace(strategy=SimpleNamespace()), packing_key="data.packing")  # no split
