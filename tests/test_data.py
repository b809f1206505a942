import json

import pytest
import torch

from lightning_mem.data import (
    IGNORE_INDEX,
    DataFormatError,
    SFTDataModule,
    check_data_file,
    collate_right_padded,
    read_rows,
    row_to_messages,
    tokenize_example,
    tokenize_rows,
)
from lightning_mem.models import load_tokenizer
from tests.helpers import ARITH, TINY_MODEL


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(TINY_MODEL))


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_loss_mask_covers_exactly_the_assistant_answer_and_eos(tokenizer):
    messages = [{"role": "user", "content": "What is 12 + 7?"}, {"role": "assistant", "content": "19"}]
    example, truncated = tokenize_example(messages, tokenizer, max_length=64)
    assert not truncated
    learned = [t for t in example["labels"] if t != IGNORE_INDEX]
    assert tokenizer.decode(learned) == "19<|eos|>"
    # Labels equal the inputs where they are kept.
    assert all(lab in (IGNORE_INDEX, tok) for lab, tok in zip(example["labels"], example["input_ids"]))


def test_multi_turn_masks_every_assistant_turn(tokenizer):
    messages = [
        {"role": "user", "content": "1 + 1 ="},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "2 + 2 ="},
        {"role": "assistant", "content": "4"},
    ]
    example, _ = tokenize_example(messages, tokenizer, max_length=64)
    learned = [t for t in example["labels"] if t != IGNORE_INDEX]
    assert tokenizer.decode(learned) == "2<|eos|>4<|eos|>"


def test_prompt_completion_rows_equal_their_chat_form(tokenizer):
    a = row_to_messages({"prompt": "3 + 4 =", "completion": "7"})
    b = row_to_messages({"messages": [{"role": "user", "content": "3 + 4 ="}, {"role": "assistant", "content": "7"}]})
    assert tokenize_example(a, tokenizer, 64) == tokenize_example(b, tokenizer, 64)


def test_truncation_is_counted_and_empty_rows_dropped(tokenizer):
    rows = [
        {"prompt": "What is 1 + 1?", "completion": "2", "_where": "f:1"},
        {"prompt": "x " * 40, "completion": "long", "_where": "f:2"},
    ]
    examples, stats = tokenize_rows(rows, tokenizer, max_length=16)
    assert (stats.rows, stats.truncated, stats.dropped) == (2, 1, 1)
    assert stats.dropped_where == ["f:2"] and len(examples) == 1
    assert all(len(e["input_ids"]) <= 16 for e in examples)


def test_malformed_jsonl_line_is_named(tmp_path):
    path = _write(tmp_path / "bad.jsonl", [json.dumps({"prompt": "a", "completion": "b"}), "{not json"])
    with pytest.raises(DataFormatError, match=r"bad\.jsonl:2: not valid JSON"):
        read_rows(path)


def test_row_without_messages_or_prompt_is_named(tmp_path, tokenizer):
    path = _write(tmp_path / "rows.jsonl", [json.dumps({"prompt": "a", "completion": "b"}), json.dumps({"text": "x"})])
    with pytest.raises(DataFormatError, match=r"rows\.jsonl:2: row needs `messages` or `prompt` and `completion`.*\['text'\]"):
        tokenize_rows(read_rows(path), tokenizer, 32)


def test_missing_file_names_the_key(tmp_path):
    with pytest.raises(FileNotFoundError, match="`data.train_file`.*does not exist"):
        check_data_file(tmp_path / "nope.jsonl", key="data.train_file")


def test_parquet_rows_are_read(tmp_path, tokenizer):
    import datasets

    datasets.Dataset.from_list([{"prompt": "2 + 2 =", "completion": "4"}]).to_parquet(str(tmp_path / "d.parquet"))
    rows = read_rows(tmp_path / "d.parquet")
    examples, _ = tokenize_rows(rows, tokenizer, 32)
    assert len(examples) == 1


def test_collate_pads_right_with_ignored_labels():
    batch = collate_right_padded([{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8], "labels": [8]}], 0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


def test_datamodule_token_budget_batches(tokenizer):
    dm = SFTDataModule(
        train_file=str(ARITH / "val.jsonl"), tokenizer=str(TINY_MODEL), max_length=64, max_tokens_per_batch=256
    )
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    assert sum(b["input_ids"].shape[0] for b in batches) == 200
    assert all(b["input_ids"].numel() <= 256 for b in batches)
    assert torch.all((batches[0]["labels"] != IGNORE_INDEX).sum(1) > 0)


def test_datamodule_refuses_budget_below_max_length():
    with pytest.raises(ValueError, match="max_tokens_per_batch"):
        SFTDataModule(train_file=str(ARITH / "val.jsonl"), tokenizer=str(TINY_MODEL), max_length=64, max_tokens_per_batch=32)
