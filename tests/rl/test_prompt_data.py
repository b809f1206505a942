"""PromptDataModule: prompt rows, left-padded batches, equal batches on every rank."""

import json

import pytest

from lightning_mem.data import DataFormatError, FullBatchSampler, PromptDataModule, row_to_prompt_messages
from lightning_mem.settings import settings_at
from tests.helpers import ARITH, TINY_MODEL


def test_prompt_rows():
    assert row_to_prompt_messages({"prompt": "1 + 1 =", "system": "Be brief."}) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1 + 1 ="},
    ]
    msgs = [{"role": "user", "content": "hi"}]
    assert row_to_prompt_messages({"messages": msgs}) == msgs
    with pytest.raises(DataFormatError, match=r"p.jsonl:3: a prompt's `messages` must end before the assistant"):
        row_to_prompt_messages({"messages": [*msgs, {"role": "assistant", "content": "x"}], "_where": "p.jsonl:3"})
    with pytest.raises(DataFormatError, match=r"p.jsonl:4: a prompt row needs `prompt` \(a string or a list of messages\) or `messages`"):
        row_to_prompt_messages({"question": "?", "_where": "p.jsonl:4"})


def test_batches_are_left_padded_and_carry_their_rows():
    dm = PromptDataModule(str(ARITH / "prompts.jsonl"), tokenizer=str(TINY_MODEL), batch_size=4, max_prompt_length=64)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert ids.shape[0] == 4 and len(batch["rows"]) == 4
    assert mask[:, -1].all()  # every prompt ends in the last column: generation continues from there
    pad = dm.tokenizer.pad_token_id
    assert (ids[mask == 0] == pad).all()
    text = dm.tokenizer.decode(ids[0][mask[0].bool()])
    assert batch["rows"][0]["prompt"] in text and text.endswith("<|assistant|>\n")
    assert "answer" in batch["rows"][0]


def test_too_long_prompts_are_dropped_and_counted(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": "What is 1 + 1?", "answer": "2"}] * 3 + [{"prompt": "1 + 1 " * 50, "answer": "2"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dm = PromptDataModule(str(path), tokenizer=str(TINY_MODEL), batch_size=2, max_prompt_length=20)
    dm.setup("fit")
    assert len(dm.train_set) == 3 and dm.dropped == [f"{path}:4"]


def test_every_rank_gets_full_equal_batches():
    lengths = [3] * 11
    per_rank = [list(FullBatchSampler(lengths, batch_size=2, num_replicas=2, rank=r, seed=0)) for r in (0, 1)]
    # 11 prompts -> 5 full batches of 2 -> 4 (a multiple of 2 ranks): 2 per rank, never a short one.
    assert [len(b) for b in per_rank[0]] == [2, 2] and [len(b) for b in per_rank[1]] == [2, 2]
    seen = [i for rank in per_rank for batch in rank for i in batch]
    assert len(seen) == len(set(seen)) == 8


def test_bad_settings_name_their_key(tmp_path):
    with pytest.raises(FileNotFoundError, match="`data.train_file`"), settings_at("data"):
        PromptDataModule(str(tmp_path / "none.jsonl"), tokenizer=str(TINY_MODEL))
    with pytest.raises(ValueError, match="`data.batch_size` must be positive"), settings_at("data"):  # as the recipes name it
        PromptDataModule(str(ARITH / "prompts.jsonl"), tokenizer=str(TINY_MODEL), batch_size=0)


def test_system_prompt_is_added_to_rows_that_have_none(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": "What is 1 + 1?", "answer": "2"}, {"prompt": "2 + 2 =", "system": "Own.", "answer": "4"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dm = PromptDataModule(str(path), tokenizer=str(TINY_MODEL), batch_size=1, system_prompt="Number only.")
    dm.setup("fit")
    texts = [dm.tokenizer.decode(dm.train_set[i]["prompt_ids"]) for i in range(len(dm.train_set))]
    assert texts[0].startswith("<|system|>\nNumber only.\n<|user|>\nWhat is 1 + 1?")
    assert texts[1].startswith("<|system|>\nOwn.\n")
    # The row carries it too, so a reward model rebuilding the conversation sees the same one.
    assert row_to_prompt_messages(dm.train_set.rows[0])[0] == {"role": "system", "content": "Number only."}


def test_reward_keys_are_checked_against_the_caches_key_sets(tmp_path):
    """A start checks a reward's keys against the kept rows' distinct key sets, recorded when the
    cache is built (reading every row's JSON took minutes at ten million rows), with the error
    :meth:`check_rows` gives on the rows themselves."""
    from recipes.rewards import ExactAnswerReward

    path = tmp_path / "p.jsonl"
    rows = ([{"prompt": "1 + 1 =", "answer": "2"}] * 2 + [{"prompt": "2 + 2 ="}] + [{"prompt": "3 =", "answer": "3", "x": 1}]
            + [{"prompt": "1 + 1 " * 50, "note": "dropped"}] + [{"prompt": "4 ="}])
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")  # and a blank line
    dm = PromptDataModule(str(path), tokenizer=str(TINY_MODEL), batch_size=1, max_prompt_length=20, cache_dir=str(tmp_path / "c"))
    dm.setup("fit")
    assert dm.key_sets == [[["_where", "answer", "prompt"], 2, f"{path}:1"], [["_where", "prompt"], 2, f"{path}:3"],
                           [["_where", "answer", "prompt", "x"], 1, f"{path}:4"]]
    reward = ExactAnswerReward()
    with pytest.raises(ValueError) as from_rows:
        reward.check_rows(dm.train_set.rows, source=str(path))
    with pytest.raises(ValueError) as from_sets:
        reward.check_key_sets(dm.key_sets, source=str(path))
    assert str(from_sets.value) == str(from_rows.value) == (
        f"{path}:3: no `answer`, which the reward ExactAnswerReward needs (it reads ['answer']; 2 of 5 rows lack one)")
    ExactAnswerReward(answer_key="prompt").check_key_sets(dm.key_sets)  # every row has it
