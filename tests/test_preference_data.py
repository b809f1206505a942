"""Preference pairs (``PreferenceDataModule``, issue 52): each row shape tokenized as SFT tokenizes
the same prompt and completion; the truncation rule and its counts; one error per bad row, naming
file and line; the micro-batch's keys against values computed row by row, padded and packed; the
step totals over micro-batches and two replicas; resume; ``largest_batch``; the in-order pass for a
reference cache; the CLI; no Python object per pair in the sampler; the shipped demo pairs."""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lightning_mem.batching import TokenBudgetSampler
from lightning_mem.data import (
    IGNORE_INDEX,
    DataFormatError,
    PairCollator,
    PreferenceDataModule,
    PreferenceDataset,
    row_to_conversation,
    tokenize_example,
)
from lightning_mem.data.preference import flatten_pair_rows
from lightning_mem.settings import SettingError, settings_at
from tests.helpers import ARITH, REPO, TINY_MODEL

USER = lambda text: {"role": "user", "content": text}  # noqa: E731
BOT = lambda text: {"role": "assistant", "content": text}  # noqa: E731

#: One row of each shape, with a system prompt and a margin on some; pair i is line i + 1.
SHAPES = [
    {"prompt": "What is 12 + 7?", "chosen": "19", "rejected": "18"},
    {"prompt": [USER("What is 3 + 4?")], "chosen": [BOT("7")], "rejected": [BOT("8")], "margin": 1.5},
    {"chosen": [USER("1 + 1 ="), BOT("2"), USER("2 + 2 ="), BOT("4")],
     "rejected": [USER("1 + 1 ="), BOT("2"), USER("2 + 2 ="), BOT("5")]},
    {"system": "Answer with a number.", "prompt": "Compute 9 - 3.", "chosen": "6", "rejected": "twelve"},
]
#: The same prompts and completions as SFT prompt/completion rows.
AS_SFT = [
    ({"prompt": "What is 12 + 7?", "completion": c} for c in ("19", "18")),
    ({"prompt": [USER("What is 3 + 4?")], "completion": [BOT(c)]} for c in ("7", "8")),
    ({"prompt": [USER("1 + 1 ="), BOT("2"), USER("2 + 2 =")], "completion": [BOT(c)]} for c in ("4", "5")),
    ({"system": "Answer with a number.", "prompt": "Compute 9 - 3.", "completion": c} for c in ("6", "twelve")),
]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _pref(**kwargs) -> PreferenceDataModule:
    # Built and set up as the recipes' CLI does, so that errors name the config's `data.` keys.
    options = {"tokenizer": str(TINY_MODEL), "max_length": 64, "batch_size": 4, **kwargs}
    with settings_at("data"):
        dm = PreferenceDataModule(**options)
    dm.config_key = "data"
    dm.setup("fit")
    return dm


def _lists(pair):
    return {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in pair.items()}


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    path = _jsonl(tmp_path_factory.mktemp("shapes") / "pairs.jsonl", SHAPES)
    return _pref(train_file=str(path))


# -- rows --------------------------------------------------------------------------------------------


def test_each_side_is_tokenized_as_the_sft_row_and_the_reward_model_encodes_it(shapes):
    from lightning_mem.rl.reward import RewardModel

    tok = shapes.tokenizer
    head = torch.nn.Linear(1, 1)
    head.config = SimpleNamespace(pad_token_id=tok.pad_token_id)
    reward_model = RewardModel(head, tok)
    assert len(shapes.train_set) == 4
    for i, sft_rows in enumerate(AS_SFT):
        pair = _lists(shapes.train_set[i])
        assert pair["pair_index"] == i and pair["margin"] == (1.5 if i == 1 else 0.0)
        for side, sft_row in zip(("chosen", "rejected"), sft_rows):
            messages, first = row_to_conversation(sft_row)
            expected, _ = tokenize_example(messages, tok, 64, first)
            assert {"input_ids": pair[f"{side}_ids"], "labels": pair[f"{side}_labels"]} == expected
            # What a reward model scores for the same prompt and response is the same ids.
            assert reward_model._encode(messages[:first], messages[-1]["content"]) == pair[f"{side}_ids"]
    learned = lambda side: tok.decode([t for t in _lists(shapes.train_set[0])[side] if t != IGNORE_INDEX])  # noqa: E731
    assert (learned("chosen_labels"), learned("rejected_labels")) == ("19<|eos|>", "18<|eos|>")


def test_whole_conversations_take_their_common_prefix_as_the_prompt(shapes):
    pair = _lists(shapes.train_set[2])
    tok = shapes.tokenizer
    # The shared first answer ("2") is context: only the diverging last turn is scored.
    assert tok.decode([t for t in pair["chosen_labels"] if t != IGNORE_INDEX]) == "4<|eos|>"
    assert tok.decode([t for t in pair["rejected_labels"] if t != IGNORE_INDEX]) == "5<|eos|>"
    prompt = pair["chosen_ids"][:-2]
    assert pair["rejected_ids"][:-2] == prompt and "<|assistant|>\n2<|eos|>" in tok.decode(prompt)


def test_truncation_rule_counts_and_one_warning(tmp_path, caplog):
    rows = [
        {"prompt": "1 + 1 =", "chosen": "2", "rejected": "3"},  # whole
        {"prompt": "2 + 2 =", "chosen": "4" * 40, "rejected": "5"},  # chosen cut, kept
        {"prompt": "x " * 40, "chosen": "2", "rejected": "3"},  # the prompt fills max_length: dropped
        {"prompt": "3 + 3 =", "chosen": "6" * 30 + "1", "rejected": "6" * 30 + "2"},  # identical after the cut
        {"prompt": "4 + 4 =", "chosen": "8", "rejected": "9"},  # whole
    ]
    path = _jsonl(tmp_path / "long.jsonl", rows)
    with caplog.at_level(logging.INFO, logger="lightning_mem.data"):
        dm = _pref(train_file=str(path), max_length=24)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert ("5 pairs, 3 with a side truncated to max_length=24, 2 dropped (1 with a side left without completion"
            " tokens, 1 whose sides became identical)") in warning
    assert "raise `data.max_length`" in warning
    stats = dm.stats["train"]
    assert (stats.rows, stats.truncated, stats.dropped, stats.identical) == (5, 3, 1, 1)
    assert stats.dropped_where == [f"{path}:3", f"{path}:4"]
    kept = [_lists(dm.train_set[i]) for i in range(len(dm.train_set))]
    assert [p["pair_index"] for p in kept] == [0, 1, 2]  # positions among the kept pairs
    assert dm.tokenizer.decode(kept[2]["chosen_labels"][-2:]) == "8<|eos|>"
    # The cut keeps each side's first max_length tokens: the long chosen side ends without its eos.
    cut = kept[1]
    assert len(cut["chosen_ids"]) == 24 and cut["chosen_labels"][-1] == dm.tokenizer.convert_tokens_to_ids("4")
    assert len(cut["rejected_ids"]) < 24


BAD_ROWS = [
    ({"prompt": "1 + 1 =", "chosen": "2"}, r"a preference row needs `chosen` and `rejected` \(and `prompt`.*\['chosen', 'prompt'\]"),
    ({"chosen": "2", "rejected": "3"}, r"without `prompt`, `chosen` and `rejected` must be whole conversations"),
    ({"prompt": "1 + 1 =", "chosen": "2", "rejected": "2"}, r"`chosen` equals `rejected`"),
    ({"prompt": "1 + 1 =", "chosen": [BOT("2")], "rejected": "2"}, r"`chosen` equals `rejected`"),
    ({"prompt": "1 + 1 =", "chosen": "2", "rejected": " "}, r"`rejected` is an empty completion"),
    ({"prompt": [USER("1 + 1 =")], "chosen": [USER("2")], "rejected": [BOT("3")]}, r"`chosen` has no assistant turn"),
    ({"prompt": "1 + 1 =", "chosen": [BOT("")], "rejected": [BOT("3")]}, r"`chosen` has an assistant turn with empty content"),
    ({"chosen": [USER("a"), BOT("2")], "rejected": [USER("b"), BOT("3")]}, r"`chosen` and `rejected` share no first message"),
    ({"chosen": [USER("a"), BOT("2")], "rejected": [USER("a"), BOT("2"), USER("more"), BOT("3")]},
     r"`chosen` is an empty completion"),
    ({"chosen": [USER("a"), BOT("2")], "rejected": [USER("a"), BOT("2")]}, r"`chosen` equals `rejected`"),
    ({"prompt": "1 + 1 =", "chosen": "2", "rejected": "3", "margin": "big"}, r"`margin` must be a finite number, got 'big'"),
    ({"prompt": "1 + 1 =", "chosen": "2", "rejected": "3", "margin": float("nan")}, r"`margin` must be a finite number, got nan"),
]


@pytest.mark.parametrize("row, message", BAD_ROWS)
def test_a_bad_row_is_one_error_naming_file_and_line(tmp_path, row, message):
    path = _jsonl(tmp_path / "bad.jsonl", [SHAPES[0], row])
    with pytest.raises(DataFormatError, match=rf"bad\.jsonl:2: {message}"):
        _pref(train_file=str(path))


def test_a_bad_row_is_named_with_two_tokenizing_processes(tmp_path):
    path = _jsonl(tmp_path / "bad.jsonl", [SHAPES[i % 4] for i in range(12)] + [BAD_ROWS[2][0]])
    with pytest.raises(DataFormatError, match=r"bad\.jsonl:13: `chosen` equals `rejected`"):
        _pref(train_file=str(path), num_proc=2)


def test_budget_below_two_sides_names_both_keys():
    with pytest.raises(SettingError, match=r"`data.max_tokens_per_batch` \(100\) is below twice `data.max_length` \(128\)"):
        with settings_at("data"):
            PreferenceDataModule(train_file=str(ARITH / "preference_train.jsonl"), tokenizer=str(TINY_MODEL),
                                 max_length=64, max_tokens_per_batch=100)


def test_parquet_and_json_sources_with_renamed_columns_give_the_same_pairs(tmp_path, shapes):
    import pyarrow as pa
    import pyarrow.parquet as pq

    # Parquet needs one schema: the string rows, under other names.
    flat = [{"question": r["prompt"], "good": r["chosen"], "bad": r["rejected"], "system": r.get("system")}
            for r in (SHAPES[0], SHAPES[3])]  # a null system: none
    pq.write_table(pa.Table.from_pylist(flat), tmp_path / "pairs.parquet")
    dm = _pref(train_file=str(tmp_path / "pairs.parquet"), columns={"prompt": "question", "chosen": "good", "rejected": "bad"})
    expected = [_lists(shapes.train_set[i]) for i in (0, 3)]
    got = [_lists(dm.train_set[i]) for i in range(2)]
    for e, g in zip(expected, got):
        assert {k: v for k, v in e.items() if k != "pair_index"} == {k: v for k, v in g.items() if k != "pair_index"}
    (tmp_path / "pairs.json").write_text(json.dumps(SHAPES))  # a JSON array mixing the shapes
    mixed = _pref(train_file=str(tmp_path / "pairs.json"))
    assert [_lists(mixed.train_set[i]) for i in range(4)] == [_lists(shapes.train_set[i]) for i in range(4)]


def test_a_save_to_disk_folder_with_splits(tmp_path, shapes):
    import datasets

    strings = [SHAPES[0], {**SHAPES[0], "chosen": "20"}]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(strings), "test": datasets.Dataset.from_list(strings[:1])}
                         ).save_to_disk(str(tmp_path / "ds"))
    dm = _pref(train_file=str(tmp_path / "ds"), val_split="test")
    assert (len(dm.train_set), len(dm.val_set)) == (2, 1)
    assert _lists(dm.val_set[0]) == _lists(dm.train_set[0]) == _lists(shapes.train_set[0])


# -- the micro-batch ---------------------------------------------------------------------------------


def _pairs(seed: int, count: int) -> list[dict]:
    """Pairs of random ids (vocabulary of the tiny model) and lengths, a prompt shared by both sides."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        prompt = torch.randint(3, 300, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
        pair = {"pair_index": i, "margin": float(i) / 4}
        for side in ("chosen", "rejected"):
            completion = torch.randint(3, 300, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
            pair[f"{side}_ids"] = np.asarray(prompt + completion, dtype=np.int32)
            pair[f"{side}_labels"] = np.asarray([IGNORE_INDEX] * len(prompt) + completion, dtype=np.int32)
        out.append(pair)
    return out


def _row_by_row(pairs: list[dict], value) -> tuple[list[float], list[int], list[int]]:
    """Per sequence (chosen sides, then rejected): the sum of ``value(previous token, label)`` over its
    targets, their count, and its last token."""
    sums, counts, last = [], [], []
    for side in ("chosen", "rejected"):
        for p in pairs:
            ids, labels = p[f"{side}_ids"].tolist(), p[f"{side}_labels"].tolist()
            scored = [(ids[t - 1], labels[t]) for t in range(1, len(ids)) if labels[t] != IGNORE_INDEX]
            sums.append(sum(value(torch.tensor(a), torch.tensor(b)).item() for a, b in scored))
            counts.append(len(scored))
            last.append(ids[-1])
    return sums, counts, last


@pytest.mark.parametrize("packing", [False, True])
def test_batch_keys_agree_with_the_pairs_row_by_row(packing):
    pairs = _pairs(0, 5)
    batch = PairCollator(0, packing=packing, row_length=40)(pairs)
    value = lambda prev, label: (prev * 3 + label).double()  # noqa: E731  # needs the right token and label
    sums, counts, last = _row_by_row(pairs, value)
    flat = batch["input_ids"].view(-1)
    per_token = value(flat[batch["target_positions"]], batch["target_ids"])
    assert torch.zeros(10, dtype=torch.float64).index_add(0, batch["target_sequence"], per_token).tolist() == sums
    assert batch["sequence_tokens"].tolist() == counts and int(batch["label_tokens"]) == sum(counts)
    assert flat[batch["sequence_ends"]].tolist() == last
    lengths = [len(p[f"{s}_ids"]) for s in ("chosen", "rejected") for p in pairs]
    if packing:  # the end of each sequence: its last position id; rows of at most 40 tokens
        assert batch["position_ids"].view(-1)[batch["sequence_ends"]].tolist() == [n - 1 for n in lengths]
        assert "attention_mask" not in batch and batch["input_ids"].shape[1] <= 40
    else:  # the last real token of its row (chosen rows first)
        assert (batch["sequence_ends"] % batch["input_ids"].shape[1]).tolist() == [n - 1 for n in lengths]
        assert batch["attention_mask"].sum(1).tolist() == lengths
    assert batch["pair_index"].tolist() == list(range(5)) and batch["margin"].dtype == torch.float32
    assert batch["margin"].tolist() == [i / 4 for i in range(5)] and "step_pairs" not in batch


def test_packed_and_padded_pairs_give_the_same_log_probs_and_end_states():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=307, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    model = LlamaForCausalLM(config).eval()
    pairs = _pairs(1, 6)

    def scored(batch):
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
        out = model(**inputs, use_cache=False, output_hidden_states=True)
        logps = torch.log_softmax(out.logits.flatten(0, 1)[batch["target_positions"]], -1)
        token = logps.gather(1, batch["target_ids"][:, None])[:, 0]
        sums = torch.zeros(12).index_add(0, batch["target_sequence"], token)
        return sums, sums / batch["sequence_tokens"], out.hidden_states[-1].flatten(0, 1)[batch["sequence_ends"]]

    with torch.no_grad():
        padded = scored(PairCollator(0)(pairs))
        rows = PairCollator(0, packing=True, row_length=44)(pairs)
        assert rows["input_ids"].shape[0] > 1
        packed = scored(rows)
        flat = flatten_pair_rows(rows)  # the one row flash-attention's varlen path takes
        assert flat["input_ids"].shape[0] == 1
        one_row = scored(flat)
    for a, b, c in zip(padded, packed, one_row):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)


def _fake_trainer(rank: int, replicas: int = 2, accumulate: int = 2, processed: int = 0):
    progress = SimpleNamespace(total=SimpleNamespace(processed=processed))
    return SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": replicas, "rank": rank}),
                           world_size=replicas, global_rank=rank, accumulate_grad_batches=accumulate,
                           fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)))


@pytest.fixture(scope="module")
def shipped():
    """The shipped held-out demo pairs (400), budgeted so that micro-batches hold different numbers
    of pairs."""
    return {packing: _pref(train_file=str(ARITH / "preference_val.jsonl"), max_length=32, batch_size=None,
                           max_tokens_per_batch=256, packing=packing) for packing in (False, True)}


@pytest.mark.parametrize("packing", [False, True])
def test_step_totals_cover_every_micro_batch_of_the_step_on_both_replicas(shipped, packing):
    dm = shipped[packing]
    served = []
    for rank in range(2):
        dm.trainer = _fake_trainer(rank)
        served.append([b for _, b in zip(range(12), dm.train_dataloader())])
    dm.trainer = None
    for step in range(6):
        batches = served[0][2 * step : 2 * step + 2] + served[1][2 * step : 2 * step + 2]
        pairs = sum(len(b["pair_index"]) for b in batches)
        chosen = sum(int(b["sequence_tokens"][: len(b["pair_index"])].sum()) for b in batches)
        assert {(int(b["step_pairs"]), int(b["step_chosen_tokens"])) for b in batches} == {(pairs, chosen)}
    assert all(b["input_ids"].numel() <= 256 for rank in served for b in rank)
    if packing:  # at most 256 // 64 rows of 2 x max_length
        assert all(b["input_ids"].shape[0] <= 4 and int(b["row_tokens"].max()) <= 64 for rank in served for b in rank)
    else:  # the budget, not a fixed count, sets the pairs a micro-batch holds
        assert len({len(b["pair_index"]) for rank in served for b in rank}) > 1


def test_the_sampler_sums_each_of_several_weights_as_it_sums_one():
    lengths = (np.arange(50) % 7 + 1) * 2
    a, b = np.arange(50) % 3 + 1, np.arange(50) % 5
    two = TokenBudgetSampler(lengths, max_tokens=20, num_replicas=2, rank=1, weights=np.stack([a, b], 1), accumulate_grad_batches=3)
    ones = [TokenBudgetSampler(lengths, max_tokens=20, num_replicas=2, rank=1, weights=w, accumulate_grad_batches=3) for w in (a, b)]
    assert [m.step_weight for m in two] == [(x.step_weight, y.step_weight) for x, y in zip(*ones)]
    assert all(isinstance(x.step_weight, float) for x in ones[0])  # one weight: a float, as SFT reads it


def test_a_resumed_loader_serves_the_uninterrupted_batches(shipped):
    dm = shipped[False]
    dm.trainer = _fake_trainer(1, processed=0)
    whole = [(b["pair_index"].tolist(), int(b["step_pairs"])) for b in dm.train_dataloader()]
    dm.trainer = _fake_trainer(1, processed=len(whole) + 3)  # 3 batches into the second epoch
    resumed = [(b["pair_index"].tolist(), int(b["step_pairs"])) for b in dm.train_dataloader()]
    dm.trainer = _fake_trainer(1, processed=len(whole))
    second_epoch = [(b["pair_index"].tolist(), int(b["step_pairs"])) for b in dm.train_dataloader()]
    dm.trainer = None
    assert resumed == second_epoch[3:] and second_epoch != whole  # epochs reshuffle


@pytest.mark.parametrize("packing", [False, True])
def test_reference_loader_reads_every_kept_pair_once_in_order(shipped, packing):
    dm = shipped[packing]
    batches = list(dm.reference_loader())
    assert torch.cat([b["pair_index"] for b in batches]).tolist() == list(range(len(dm.train_set)))
    assert all("step_pairs" not in b and b["input_ids"].numel() <= 256 for b in batches)
    halves = [[b["pair_index"] for b in dm.reference_loader(num_replicas=2, rank=r)] for r in range(2)]
    assert torch.cat([torch.cat(h) for h in halves]).sort().values.tolist() == list(range(len(dm.train_set)))


def test_data_identity_is_the_cache_key(shipped, tmp_path):
    dm = shipped[False]
    assert dm.data_identity() == dm.cache_folder("train").name and dm.data_identity().startswith("preference-train-")
    build = lambda name, **kw: PreferenceDataModule(train_file=str(ARITH / name), tokenizer=str(TINY_MODEL), **kw)  # noqa: E731
    same = build("preference_val.jsonl", max_length=32, batch_size=2)  # batching is not the pairs' identity
    assert same.data_identity() == dm.data_identity()
    assert build("preference_val.jsonl", max_length=33).data_identity() != dm.data_identity()
    assert build("preference_train.jsonl", max_length=32).data_identity() != dm.data_identity()


@pytest.mark.parametrize(
    "options, shape, pairs",
    [({"max_tokens_per_batch": 100}, (6, 16), 3),  # 100 // (2 x 16) pairs
     ({"batch_size": 4}, (8, 16), 4),
     ({"max_tokens_per_batch": 100, "cp": 2}, (12, 16), 6),  # the budget is per rank of a context-parallel group
     ({"max_tokens_per_batch": 100, "packing": True}, (3, 32), 3)],  # rows of one pair each
)
def test_largest_batch(options, shape, pairs):
    options = dict(options)
    cp = options.pop("cp", 1)
    dm = PreferenceDataModule(train_file=str(ARITH / "preference_train.jsonl"), tokenizer=str(TINY_MODEL), max_length=16,
                              **options)
    batch = dm.largest_batch(11, context_parallel_size=cp)
    assert tuple(batch["input_ids"].shape) == shape and tuple(batch["labels"].shape) == shape
    assert int(batch["step_pairs"]) == pairs and int(batch["step_chosen_tokens"]) == pairs * 15
    assert batch["sequence_tokens"].tolist() == [15] * 2 * pairs and int(batch["label_tokens"]) == 2 * pairs * 15
    ends = batch["sequence_ends"].tolist()
    if options.get("packing"):
        assert ends == [32 * i + 15 for i in range(pairs)] + [32 * i + 31 for i in range(pairs)]
    else:
        assert ends == [16 * i + 15 for i in range(2 * pairs)]
    assert batch["pair_index"].tolist() == list(range(pairs)) and batch["margin"].tolist() == [0.0] * pairs


# -- the CLI -----------------------------------------------------------------------------------------


def test_the_cli_builds_and_trains_on_the_module(tmp_path):
    """A config with the module's arguments through LightningCLI (the recipes' RecipeCLI, its
    tokenizer linked to the model): two optimizer steps of two micro-batches, packed, each batch
    carrying its step's totals."""
    import lightning.pytorch as pl

    from lightning_mem.cli import RecipeCLI

    class Tiny(pl.LightningModule):
        def __init__(self, name_or_path: str) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(()))
            self.seen: list = []

        def training_step(self, batch, batch_idx):
            self.seen.append({k: batch[k].clone() for k in ("pair_index", "step_pairs", "step_chosen_tokens", "row_tokens")})
            return (self.weight - 1) ** 2

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    config = tmp_path / "config.yaml"
    config.write_text(
        f"model:\n  name_or_path: {TINY_MODEL}\n"
        f"data:\n  train_file: {ARITH / 'preference_val.jsonl'}\n  max_length: 24\n  max_tokens_per_batch: 96\n"
        f"  packing: true\n  cache_dir: {tmp_path / 'cache'}\n"
        f"trainer:\n  max_steps: 2\n  accumulate_grad_batches: 2\n  accelerator: cpu\n  devices: 1\n  logger: false\n"
        f"  enable_progress_bar: false\n  default_root_dir: {tmp_path / 'run'}\n"
    )
    cli = RecipeCLI(Tiny, PreferenceDataModule, args=["fit", "--config", str(config), "--checkpoint.save_last", "false"])
    dm = cli.datamodule
    assert isinstance(dm, PreferenceDataModule) and dm.tokenizer_name == str(TINY_MODEL) and dm.packing
    seen = cli.model.seen
    assert len(seen) == 4
    for step in (seen[:2], seen[2:]):
        assert {int(b["step_pairs"]) for b in step} == {sum(len(b["pair_index"]) for b in step)}
    assert all(int(b["row_tokens"].max()) <= 48 for b in seen)


# -- at scale ----------------------------------------------------------------------------------------


def _pair_table(rows: int):
    import datasets
    import pyarrow as pa

    ids = pa.array([[5, 6, 7, 8]] * rows, pa.list_(pa.int32()))
    labels = pa.array([[-100, -100, 7, 8]] * rows, pa.list_(pa.int32()))
    number = lambda values: pa.array(values, pa.int32())  # noqa: E731
    lengths = number((np.arange(rows) % 50 + 4).tolist())
    columns = {"chosen_ids": ids, "chosen_labels": labels, "chosen_length": lengths, "chosen_targets": number([2] * rows),
               "rejected_ids": ids, "rejected_labels": labels, "rejected_length": number([4] * rows),
               "rejected_targets": number([2] * rows), "margin": pa.array([0.0] * rows, pa.float32()),
               "status": pa.array([0] * rows, pa.int8())}
    table = pa.Table.from_batches(pa.Table.from_pydict(columns).to_batches(max_chunksize=1000))
    return datasets.Dataset(datasets.table.InMemoryTable(table))


def test_the_pair_set_and_its_sampler_keep_no_python_object_per_pair():
    """200,000 pairs: the dataset's arrays and the sampler's plan and step totals are numpy arrays;
    Python objects allocated and kept while building them number far fewer than the pairs."""
    rows = 200_000
    table = _pair_table(rows)
    before = sys.getallocatedblocks()
    dataset = PreferenceDataset(table)
    sampler = TokenBudgetSampler(dataset.padded_lengths(), max_tokens=1024, num_replicas=2, seed=0,
                                 weights=np.stack([np.ones(len(dataset)), dataset.chosen_targets], 1), accumulate_grad_batches=2)
    kept = sys.getallocatedblocks() - before
    assert len(dataset) == rows and len(sampler) > 0
    assert kept < rows // 100, kept
    assert sampler.batches.flat.dtype == np.int32 and sampler.batch_weights.shape == (len(sampler.batches), 2)


# -- the shipped demo pairs ---------------------------------------------------------------------------


def test_the_script_regenerates_the_shipped_pairs_byte_for_byte(tmp_path):
    spec = importlib.util.spec_from_file_location("make_preference_pairs", REPO / "scripts" / "make_preference_pairs.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    train, val = script.make(tmp_path)
    for made in (train, val):
        assert made.read_bytes() == (ARITH / made.name).read_bytes(), made.name
    rows = {p.name: [json.loads(line) for line in p.read_text().splitlines()] for p in (train, val)}
    prompt = lambda r: r["prompt"] if isinstance(r.get("prompt"), str) else (r.get("prompt") or r["chosen"])[0]["content"]  # noqa: E731
    train_prompts = {prompt(r) for r in rows[train.name]}
    assert not any(prompt(r) in train_prompts for r in rows[val.name])  # held-out prompts
    assert len(rows[train.name]) > 3000 and len(rows[val.name]) >= 300
    shapes = {("prompt" in r, isinstance(r["chosen"], str)) for r in rows[train.name]}
    assert shapes == {(True, True), (True, False), (False, False)}
    assert not any("margin" in r for rs in rows.values() for r in rs)


def test_the_shipped_pairs_load_whole(tmp_path):
    dm = _pref(train_file=str(ARITH / "preference_train.jsonl"), val_file=str(ARITH / "preference_val.jsonl"),
               cache_dir=str(tmp_path))
    for name, dataset in (("train", dm.train_set), ("val", dm.val_set)):
        stats = dm.stats[name]
        assert (stats.truncated, stats.dropped, stats.identical) == (0, 0, 0) and len(dataset) == stats.rows
