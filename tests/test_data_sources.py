"""Data sources and row shapes: save_to_disk folders, hub ids (through a stand-in), TRL's
conversational rows, column mappings, mixed rows, truncation warnings, and bad files named."""

import json
import logging

import pytest

from lightning_mem.data import (
    IGNORE_INDEX,
    DataFormatError,
    PromptDataModule,
    SFTDataModule,
    read_rows,
    row_to_conversation,
    row_to_prompt_messages,
    tokenize_example,
    tokenize_rows,
)
from lightning_mem.settings import settings_at
from tests.helpers import TINY_MODEL

ROWS = [{"prompt": f"{a} + {b} =", "completion": str(a + b)} for a in range(4) for b in range(3)]
MESSAGES = [
    {"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["completion"]}]}
    for r in ROWS
]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _sft(**kwargs):
    # Built and set up as the recipes' CLI does, so that errors name the config's `data.` keys.
    with settings_at("data"):
        dm = SFTDataModule(tokenizer=str(TINY_MODEL), max_length=64, batch_size=4, **kwargs)
    dm.config_key = "data"
    dm.setup("fit")
    return dm


def _examples(dataset):
    # The cached examples as lists, to compare with the Python tokenization's (tokenize_rows).
    return [{k: v.tolist() for k, v in dataset[i].items()} for i in range(len(dataset))]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The examples the shipped JSONL path makes of ROWS: every other source must equal them."""
    path = _jsonl(tmp_path_factory.mktemp("ref") / "rows.jsonl", ROWS)
    return _examples(_sft(train_file=str(path)).train_set)


# -- datasets save_to_disk folders (what a hub download looks like on disk) ------------------------


def test_save_to_disk_dataset_folder_loads_like_the_jsonl(tmp_path, reference):
    import datasets

    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "ds"))
    assert _examples(_sft(train_file=str(tmp_path / "ds")).train_set) == reference


def test_save_to_disk_datasetdict_uses_the_named_splits(tmp_path, reference):
    import datasets

    folder = tmp_path / "dd"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS), "validation": datasets.Dataset.from_list(ROWS[:4])}
    ).save_to_disk(str(folder))
    dm = _sft(train_file=str(folder), val_split="validation")
    assert _examples(dm.train_set) == reference
    assert _examples(dm.val_set) == reference[:4]
    with pytest.raises(DataFormatError, match=r"`data.train_split`: .*dd holds the splits \['train', 'validation'\], not 'dev'"):
        _sft(train_file=str(folder), train_split="dev")


def test_val_split_of_a_source_without_splits_names_the_key(tmp_path):
    import datasets

    path = _jsonl(tmp_path / "rows.jsonl", ROWS)
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "ds"))  # one Dataset: no splits either
    for source in (path, tmp_path / "ds"):
        with pytest.raises(ValueError, match=r"`data.val_split` picks a split .* has no splits: set `data.val_file`"), settings_at("data"):
            SFTDataModule(train_file=str(source), tokenizer=str(TINY_MODEL), val_split="validation")


# -- hub ids: the real call is datasets.load_dataset(id, name=subset, split=split) ------------------


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    """Stands in for the hub: records the load_dataset calls and returns ROWS (no network); the
    tokenized cache goes under tmp_path rather than the user's datasets cache."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path)
    calls = []

    def load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split, kwargs))
        if path == "no/such-dataset":
            raise FileNotFoundError("Couldn't find any data file")
        rows = ROWS if split == "train" else ROWS[:4]
        return datasets.Dataset.from_list([{"question": r["prompt"], "answer": r["completion"]} for r in rows])

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


def test_hub_dataset_with_subset_splits_and_columns(fake_hub, reference):
    dm = _sft(dataset="org/arith", subset="easy", val_split="test", columns={"prompt": "question", "completion": "answer"})
    assert fake_hub == [("org/arith", "easy", "train", {}), ("org/arith", "easy", "test", {})]
    assert _examples(dm.train_set) == reference and _examples(dm.val_set) == reference[:4]


def test_hub_dataset_for_prompts(fake_hub):
    dm = PromptDataModule(dataset="org/arith", columns={"prompt": "question"}, tokenizer=str(TINY_MODEL), batch_size=2)
    dm.setup("fit")
    assert fake_hub == [("org/arith", None, "train", {})]
    assert len(dm.train_set) == len(ROWS) and dm.train_set.rows[0]["answer"] == "0"


def test_hub_load_failure_names_the_key(fake_hub):
    with pytest.raises(DataFormatError, match=r"`data.dataset`: could not load 'no/such-dataset' \(subset=None, split='train'\)"):
        _sft(dataset="no/such-dataset")


def test_source_settings_name_their_keys(tmp_path):
    path = _jsonl(tmp_path / "rows.jsonl", ROWS)
    with pytest.raises(ValueError, match=r"set exactly one of `data.train_file` .* and `data.dataset`"), settings_at("data"):
        SFTDataModule(tokenizer=str(TINY_MODEL))
    with pytest.raises(ValueError, match=r"set exactly one of `data.train_file`"), settings_at("data"):
        SFTDataModule(train_file=str(path), dataset="org/arith", tokenizer=str(TINY_MODEL))
    with pytest.raises(ValueError, match=r"`data.subset` .* set `data.dataset` too"), settings_at("data"):
        PromptDataModule(train_file=str(path), subset="easy", tokenizer=str(TINY_MODEL))
    with pytest.raises(ValueError, match=r"`data.columns` must map"), settings_at("data"):
        SFTDataModule(train_file=str(path), columns={"prompt": 3}, tokenizer=str(TINY_MODEL))


# -- row shapes --------------------------------------------------------------------------------------


def test_column_mapping_renames_fields_and_names_a_missing_one(tmp_path, reference):
    path = _jsonl(tmp_path / "qa.jsonl", [{"question": r["prompt"], "answer": r["completion"]} for r in ROWS])
    assert _examples(_sft(train_file=str(path), columns={"prompt": "question", "completion": "answer"}).train_set) == reference
    with pytest.raises(DataFormatError, match=r"`data.columns.completion`: .*qa.jsonl:1 has no field 'solution'"):
        _sft(train_file=str(path), columns={"prompt": "question", "completion": "solution"})


def test_conversational_prompt_completion_learns_the_completion_only():
    tokenizer = _sft_tokenizer()
    history = [
        {"role": "user", "content": "1 + 1 ="},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "2 + 2 ="},
    ]
    row = {"prompt": history, "completion": [{"role": "assistant", "content": "4"}]}
    messages, first = row_to_conversation(row)
    assert messages == history + row["completion"] and first == 3
    conv, _ = tokenize_example(messages, tokenizer, 128, first)
    # The same conversation as `messages` learns both answers; as prompt/completion only the last.
    full, _ = tokenize_example(messages, tokenizer, 128)
    assert conv["input_ids"] == full["input_ids"]
    learned = [t for t in conv["labels"] if t != IGNORE_INDEX]
    learned_full = [t for t in full["labels"] if t != IGNORE_INDEX]
    assert len(learned) < len(learned_full) and learned_full[-len(learned):] == learned
    # Single turn: conversational and plain-string rows give the same example.
    plain = row_to_conversation({"prompt": "2 + 2 =", "completion": "4"})
    conv1 = row_to_conversation({"prompt": [{"role": "user", "content": "2 + 2 ="}],
                                 "completion": [{"role": "assistant", "content": "4"}]})
    assert tokenize_example(*plain[:1], tokenizer, 64, plain[1]) == tokenize_example(conv1[0], tokenizer, 64, conv1[1])


def test_conversational_prompt_for_rl_and_its_errors():
    prompt = [{"role": "system", "content": "Number only."}, {"role": "user", "content": "2 + 2 ="}]
    assert row_to_prompt_messages({"prompt": prompt, "completion": [{"role": "assistant", "content": "4"}]}) == prompt
    with pytest.raises(DataFormatError, match=r"f:1: a prompt's `prompt` must end before the assistant's answer"):
        row_to_prompt_messages({"prompt": [*prompt, {"role": "assistant", "content": "4"}], "_where": "f:1"})
    with pytest.raises(DataFormatError, match=r"f:2: `completion` has no assistant turn"):
        row_to_conversation({"prompt": prompt, "completion": [{"role": "user", "content": "?"}], "_where": "f:2"})
    with pytest.raises(DataFormatError, match=r"f:3: each message in `prompt` needs string `role` and `content`"):
        row_to_conversation({"prompt": [{"role": "user"}], "completion": "4", "_where": "f:3"})


def _sft_tokenizer():
    from lightning_mem.models import load_tokenizer

    return load_tokenizer(str(TINY_MODEL))


def _mixed_rows():
    # messages rows and prompt/completion rows alternate: Arrow gives each the other's column as None.
    return [MESSAGES[i] if i % 2 else ROWS[i] for i in range(len(ROWS))]


def test_json_array_mixing_messages_and_prompt_rows(tmp_path, reference):
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps(_mixed_rows()))
    assert _examples(_sft(train_file=str(path)).train_set) == reference


def test_parquet_mixing_messages_and_prompt_rows(tmp_path, reference):
    import datasets

    path = tmp_path / "mixed.parquet"
    rows = _mixed_rows()
    columns = {k: [r.get(k) for r in rows] for k in ("messages", "prompt", "completion")}
    datasets.Dataset.from_dict(columns).to_parquet(str(path))
    assert _examples(_sft(train_file=str(path)).train_set) == reference


def test_json_file_holding_json_lines_is_read(tmp_path, reference):
    path = _jsonl(tmp_path / "lines.json", ROWS)
    assert _examples(_sft(train_file=str(path)).train_set) == reference


# -- truncation is a warning with the counts ---------------------------------------------------------


def test_truncation_warns_once_with_the_counts(tmp_path, caplog):
    rows = [*ROWS, {"prompt": "1 + 1 " * 30, "completion": "2"}, {"prompt": "1 +", "completion": " 1" * 40}]
    path = _jsonl(tmp_path / "long.jsonl", rows)
    with caplog.at_level(logging.INFO, logger="lightning_mem.data"):
        dm = _sft(train_file=str(path), val_file=str(path))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2  # one for train, one for val: nothing repeated
    assert f"14 rows, 2 truncated to max_length=64, 1 dropped" in warnings[0]
    assert "raise `data.max_length`" in warnings[0]
    assert dm.stats["train"].truncated == 2 and dm.stats["train"].dropped == 1


def test_no_warning_when_nothing_is_cut(tmp_path, caplog):
    path = _jsonl(tmp_path / "rows.jsonl", ROWS)
    with caplog.at_level(logging.INFO, logger="lightning_mem.data"):
        _sft(train_file=str(path))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_prompts_dropped_as_too_long_warn(tmp_path, caplog):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "What is 1 + 1?"}] * 2 + [{"prompt": "1 + 1 " * 50}])
    dm = PromptDataModule(str(path), tokenizer=str(TINY_MODEL), batch_size=2, max_prompt_length=20)
    with caplog.at_level(logging.INFO, logger="lightning_mem.data"):
        dm.setup("fit")
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "3 rows, 1 dropped as longer than max_prompt_length=20" in warning


# -- bad files are named -----------------------------------------------------------------------------


def test_non_utf8_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps(ROWS[0]).encode() + b"\n" + '{"prompt": "caf\u00e9", "completion": "x"}\n'.encode("latin-1"))
    with pytest.raises(DataFormatError, match=r"latin1\.jsonl:2: not valid UTF-8 \(byte 0xe9\)"):
        read_rows(path)


def test_non_utf8_json_names_file_and_line(tmp_path):
    path = tmp_path / "latin1.json"
    path.write_bytes(b'[\n{"prompt": "1", "completion": "1"},\n{"prompt": "caf\xe9", "completion": "x"}\n]')
    with pytest.raises(DataFormatError, match=r"latin1\.json:3: not valid UTF-8"):
        read_rows(path)


def test_malformed_json_names_file_line_and_column(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[\n{"prompt": "1", "completion": "1"},\n{"prompt": "2" "completion": "2"}\n]')
    with pytest.raises(DataFormatError, match=r"bad\.json:3:16: not valid JSON \(Expecting ',' delimiter\)"):
        read_rows(path)


def test_garbage_parquet_names_the_file(tmp_path):
    path = tmp_path / "junk.parquet"
    path.write_bytes(b"this is not parquet at all" * 10)
    with pytest.raises(DataFormatError, match=r"junk\.parquet: not a readable Parquet file"):
        read_rows(path)


def test_directory_given_as_data_file_says_so(tmp_path):
    (tmp_path / "folder").mkdir()
    with pytest.raises(DataFormatError, match=r"`data.train_file`: '.*folder' is a directory, not a data file"), settings_at("data"):
        SFTDataModule(train_file=str(tmp_path / "folder"), tokenizer=str(TINY_MODEL))


def test_rows_keep_their_where_for_later_errors(tmp_path, reference):
    import datasets

    datasets.Dataset.from_list(ROWS + [{"prompt": "x", "completion": None}]).save_to_disk(str(tmp_path / "ds"))
    rows = read_rows(tmp_path / "ds")
    with pytest.raises(DataFormatError, match=r"ds:row 12: row needs `messages` or `prompt` and `completion`"):
        tokenize_rows(rows, _sft_tokenizer(), 64)


# -- the tokenized cache ------------------------------------------------------------------------------


def test_second_setup_reuses_the_cache_and_gives_the_python_tokenization(tmp_path, monkeypatch):
    import lightning_mem.data.sft as sft

    calls = []
    real = sft.tokenize_batch
    monkeypatch.setattr(sft, "tokenize_batch", lambda *a, **k: calls.append(1) or real(*a, **k))
    path = _jsonl(tmp_path / "rows.jsonl", [*ROWS, {"prompt": "x " * 60, "completion": "long"}])
    first = _sft(train_file=str(path), cache_dir=str(tmp_path / "cache"))
    assert calls and first.stats["train"].dropped == 1
    calls.clear()
    second = _sft(train_file=str(path), cache_dir=str(tmp_path / "cache"))
    assert calls == []  # a second start reads the cache, it does not tokenize
    expected, _ = tokenize_rows(read_rows(path), first.tokenizer, 64)
    assert _examples(second.train_set) == expected and second.stats["train"].dropped_where == [f"{path}:13"]
    assert second.train_set.lengths.dtype.name == "int32"


def test_malformed_line_is_named_with_two_tokenizing_processes(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS) + "\n{not json\n")
    with pytest.raises(DataFormatError, match=r"bad\.jsonl:14: not valid JSON"):
        _sft(train_file=str(path), num_proc=2)
