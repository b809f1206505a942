"""The reward model's pieces: where a reward is read, the scorer against Hugging Face's own
classifier forward (padded and packed), the Bradley-Terry loss at hand-worked values, the metrics,
the LoRA targets of a classifier, and the one-output check a PPO run makes on a reward model."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from lightning_mem.data.chat import encode_rendered, render_with_spans
from lightning_mem.data.packing import collate_packed
from lightning_mem.lora import LoraSettings, resolve_target_modules
from lightning_mem.padding import pad_sequences
from lightning_mem.reward_modeling import (
    SequenceScorer,
    bradley_terry,
    check_unsplit,
    pair_metrics,
    read_positions,
)
from lightning_mem.rl.reward import check_reward_model_source, reward_model_outputs
from lightning_mem.settings import SettingError, SettingNotSupported
from tests.helpers import TINY_MODEL

CONVERSATIONS = [
    [{"role": "user", "content": "What is 14 + 3?"}, {"role": "assistant", "content": "17"}],
    [{"role": "user", "content": "Compute 11 + 5."}, {"role": "assistant", "content": "sixteen, I think"}],
    [{"role": "user", "content": "9 - 4 ="}, {"role": "assistant", "content": "5"}],
]


def classifier() -> torch.nn.Module:
    config = AutoConfig.from_pretrained(TINY_MODEL, num_labels=1)
    return AutoModelForSequenceClassification.from_config(config).eval()


def encoded(tokenizer) -> list[list[int]]:
    return [encode_rendered(render_with_spans(c, tokenizer)[0], tokenizer)["input_ids"] for c in CONVERSATIONS]


def test_read_positions_is_the_last_token_that_is_not_pad():
    # Two padded rows of 5 (pad 0); row 0 ends in its own pad-valued token (pad == eos): read before it.
    ids = torch.tensor([[7, 8, 9, 0, 0], [7, 8, 9, 4, 0]])
    ends = torch.tensor([3, 8])  # row 0's last real token is the eos at column 3 (== pad); row 1's at column 3
    assert read_positions(ids, ends, pad_token_id=0).tolist() == [2, 8]
    assert read_positions(ids, ends, pad_token_id=None).tolist() == [3, 8]
    assert read_positions(ids, ends, pad_token_id=5).tolist() == [3, 8]  # nothing is pad: the ends themselves


@pytest.mark.parametrize("pad_is_eos", [False, True], ids=["pad_not_eos", "pad_is_eos"])
def test_scorer_equals_hugging_face_forward_on_padded_rows(pad_is_eos):
    """The tiny template ends an answer with eos. With pad = eos (Llama 3 Instruct's case) Hugging
    Face reads the token before it; the scorer reads where Hugging Face reads, either way."""
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    model = classifier()
    model.config.pad_token_id = tokenizer.eos_token_id if pad_is_eos else tokenizer.pad_token_id
    sequences = encoded(tokenizer)
    assert all(s[-1] == tokenizer.eos_token_id for s in sequences)
    ids, mask = pad_sequences(sequences, model.config.pad_token_id)
    width = ids.shape[1]
    ends = torch.tensor([i * width + len(s) - 1 for i, s in enumerate(sequences)])
    positions = read_positions(ids, ends, model.config.pad_token_id)
    assert torch.equal(positions == ends, torch.full_like(ends, not pad_is_eos))
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits[:, 0]
        got = SequenceScorer(model)(ids, mask, positions)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert got.dtype == torch.float32 and got.shape == (len(sequences),)


def test_packed_rows_score_as_padded_rows_and_project_only_the_read_positions():
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    model = classifier()
    model.config.pad_token_id = tokenizer.pad_token_id
    scorer = SequenceScorer(model)
    sequences = encoded(tokenizer)
    ids, mask = pad_sequences(sequences, tokenizer.pad_token_id)
    ends = torch.tensor([i * ids.shape[1] + len(s) - 1 for i, s in enumerate(sequences)])
    packed = collate_packed([{"input_ids": s, "labels": s} for s in sequences])  # one row, positions restarting
    packed_ends = torch.cumsum(torch.tensor([len(s) for s in sequences]), 0) - 1
    projected = []
    scorer.head.register_forward_hook(lambda module, args, out: projected.append(args[0].shape[0]))
    with torch.no_grad():
        padded = scorer(ids, mask, read_positions(ids, ends, tokenizer.pad_token_id))
        row = scorer(packed["input_ids"], None, read_positions(packed["input_ids"], packed_ends, tokenizer.pad_token_id),
                     position_ids=packed["position_ids"])
    torch.testing.assert_close(row, padded, rtol=1e-5, atol=1e-5)
    assert projected == [3, 3]  # the head saw one row per sequence, not every position


def test_bradley_terry_at_hand_worked_values():
    chosen, rejected = torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0.0, 0.0, -1.0])
    # -log sigmoid(d): d = 1 -> 0.313262, 0 -> ln 2, 3 -> 0.048587
    torch.testing.assert_close(bradley_terry(chosen, rejected), torch.tensor([0.313262, math.log(2), 0.048587]),
                               rtol=0, atol=1e-6)
    # a margin of 0.5 on the first pair: d = 0.5 -> 0.474077
    margin = torch.tensor([0.5, 0.0, 0.0])
    assert bradley_terry(chosen, rejected, margin)[0].item() == pytest.approx(0.474077, abs=1e-6)
    # centring adds 0.01 * (r_c + r_r)^2: 0.01, 0, 0.01
    centred = bradley_terry(chosen, rejected, center_coefficient=0.01) - bradley_terry(chosen, rejected)
    torch.testing.assert_close(centred, torch.tensor([0.01, 0.0, 0.01]), rtol=0, atol=1e-7)


def test_pair_metrics_count_a_tie_as_wrong():
    metrics = pair_metrics(torch.tensor([1.0, 0.5, 2.0, 0.0]), torch.tensor([0.0, 0.5, 3.0, -1.0]))
    assert metrics["accuracy"].item() == 0.5  # pairs 0 and 3 right, the tie (pair 1) and pair 2 not
    assert metrics["margin"].item() == pytest.approx((1 + 0 - 1 + 1) / 4)
    assert (metrics["min_reward"].item(), metrics["max_reward"].item()) == (-1.0, 3.0)
    assert metrics["mean_reward"].item() == pytest.approx(6.0 / 8)


def test_all_linear_leaves_the_score_head_to_train_whole():
    with torch.device("meta"):
        model = classifier()
    targets = resolve_target_modules(model, LoraSettings().target_modules)
    assert "score" not in targets and {"q_proj", "down_proj"} <= set(targets)


def test_a_split_strategy_is_refused_by_name():
    class Split:
        tensor_parallel_size, context_parallel_size = 1, 2

    with pytest.raises(SettingNotSupported, match=r"^`context_parallel_size`=2: the reward model recipe"):
        check_unsplit(Split())


def _folder(tmp_path, **config):
    folder = tmp_path / "rm"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    return str(folder)


def test_a_classifier_with_two_outputs_is_refused_in_one_line(tmp_path):
    two = _folder(tmp_path, architectures=["LlamaForSequenceClassification"], id2label={"0": "A", "1": "B"})
    with pytest.raises(SettingError, match=r"^`model.reward_model.name_or_path`: .*/rm is a LlamaForSequenceClassification"
                                           r" with 2 outputs \(its config.json\); a reward model scores with one"):
        check_reward_model_source(two, key="model.reward_model.name_or_path")


def test_one_output_and_causal_lm_folders_pass(tmp_path):
    assert reward_model_outputs(str(TINY_MODEL)) is None  # a causal LM's config: the head would be new
    one = _folder(tmp_path, architectures=["LlamaForSequenceClassification"], num_labels=1)
    assert reward_model_outputs(one) == ("LlamaForSequenceClassification", 1)
    check_reward_model_source(one)
