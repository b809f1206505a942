"""The scripts: eval_arithmetic's answer probability is the teacher-forced product of the answer's
token probabilities, its two-try numbers count the multi-turn environment's verdicts, and rows
without an answer are refused by line; plot_metrics draws a PNG and names a missing column."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from lightning_mem.models import load_causal_lm, load_tokenizer
from scripts.eval_arithmetic import evaluate
from tests.helpers import HANG_GUARD_S, REPO, TINY_MODEL


@pytest.fixture(scope="module")
def tiny_saved(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny")
    load_causal_lm(str(TINY_MODEL)).save_pretrained(path)
    load_tokenizer(str(TINY_MODEL)).save_pretrained(path)
    return path


def test_answer_probability_is_the_product_of_token_probabilities(tiny_saved, tmp_path):
    rows = [{"prompt": "What is 3 + 4?", "answer": "7"}, {"prompt": "Compute 12 - 2.", "answer": "10"}]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = evaluate(str(tiny_saved), prompts, limit=2)

    model, tok = load_causal_lm(str(tiny_saved)).eval(), load_tokenizer(str(tiny_saved))
    expected = 0.0
    for row in rows:
        text = tok.apply_chat_template([{"role": "user", "content": row["prompt"]}], tokenize=False, add_generation_prompt=True)
        ids = tok(text + row["answer"] + tok.eos_token, add_special_tokens=False)["input_ids"]
        n_prompt = len(tok(text, add_special_tokens=False)["input_ids"])
        with torch.no_grad():
            probs = model(torch.tensor([ids])).logits[0].softmax(-1)
        p = 1.0
        for t in range(n_prompt, len(ids)):  # every answer token and the end token, one at a time
            p *= float(probs[t - 1, ids[t]])
        expected += p / len(rows)
    assert result["answer_probability"] == pytest.approx(expected, rel=1e-4)
    assert result["prompts"] == 2
    assert 0.0 <= result["greedy_exact"] <= 1.0 and 0.0 <= result["sampled_exact"] <= 1.0


def test_the_second_try_numbers_count_the_environments_verdicts(tiny_saved, tmp_path, monkeypatch):
    """An environment that ignores the answers and says "right at the first try" for answer "first",
    "right at the second" for "second", "wrong twice" otherwise: the three numbers are its counts."""
    import recipes.environments as environments
    from lightning_mem.rl.environments import Step

    class Verdicts(environments.ArithmeticRetry):
        def step(self, message):
            self.tried += 1
            if self.answer == {1: "first", 2: "second"}.get(self.tried):
                return Step([], self.retry_discount ** (self.tried - 1), True)
            return Step([{"role": "user", "content": self.feedback}], 0.0, False) if self.tried < 2 else Step([], 0.0, True)

    monkeypatch.setattr(environments, "ArithmeticRetry", Verdicts)
    answers = ["first", "first", "second", "never", "never", "never"]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": a}) + "\n" for i, a in enumerate(answers)))
    result = evaluate(str(tiny_saved), prompts, limit=6, second_try=True, batch_size=4)  # two batches
    assert result["first_try_exact"] == 2 / 6 and result["second_try_exact"] == 1 / 4
    assert result["two_try_score"] == pytest.approx((2 + 0.5) / 6)


def test_rows_without_an_answer_are_refused(tiny_saved, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is 1 + 1?", "answer": "2"}) + "\n" + json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(KeyError, match=r"p.jsonl: rows without an `answer` key \(line 2 is the first\)"):
        evaluate(str(tiny_saved), prompts)


def test_the_eval_of_a_plain_model_prints_no_bitsandbytes_line_and_imports_no_bitsandbytes(tiny_saved):
    # bitsandbytes logs "Failed to load CPU gemm_4bit_forward from kernels-community ..." when
    # imported without the optional `kernels` package: a line a user cannot act on. Sampling used
    # to import peft (and so bitsandbytes) to look for LoRA layers in any model.
    code = ("import runpy, sys\n"
            f"sys.argv = ['eval_arithmetic.py', {str(tiny_saved)!r}, '--limit', '2']\n"
            "runpy.run_path('scripts/eval_arithmetic.py', run_name='__main__')\n"
            "print('imported bitsandbytes:', 'bitsandbytes' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=HANG_GUARD_S, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == "imported bitsandbytes: False"
    assert json.loads(done.stdout.splitlines()[-2])["prompts"] == 2
    assert "gemm_4bit" not in done.stderr and "kernels-community" not in done.stderr, done.stderr


def test_plot_metrics_draws_each_column_and_names_a_missing_one(tmp_path):
    from scripts.plot_metrics import moving_average, plot

    metrics = tmp_path / "metrics.csv"
    metrics.write_text("step,reward_mean,kl\n0,0.5,\n1,0.7,0.1\n2,0.9,0.2\n")
    out = plot(metrics, ["reward_mean", "kl"], tmp_path / "out" / "curve.png", window=2)
    assert out.is_file() and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert moving_average([0.5, 0.7, 0.9], 2) == pytest.approx([0.5, 0.6, 0.8])
    with pytest.raises(KeyError, match=r"metrics.csv: no column `reward` \(columns: step, reward_mean, kl\)"):
        plot(metrics, ["reward_mean", "reward"], tmp_path / "x.png")


def test_the_readmes_demo_figure_is_the_recorded_runs():
    """The README's demo sentence states the range that `scripts/demo_figure.py` measured (more
    than one seed, whole per cents rounded outwards), and that record is of the demo's current
    config, data and model (rerun the script when they change)."""
    import math
    import re

    from scripts.demo_figure import README_CLAIM, RECORD, fingerprint
    from tests.helpers import REPO

    record = json.loads(RECORD.read_text())
    assert len(record["greedy_exact"]) >= 2
    assert record["inputs"] == fingerprint(), "the demo's inputs changed: rerun scripts/demo_figure.py"
    claim = re.search(README_CLAIM, (REPO / "README.md").read_text())
    assert claim, "README: no 'answers between X % and Y % of the shipped prompts exactly'"
    low, high = map(int, claim.groups())
    rates = record["greedy_exact"].values()
    assert (low, high) == (math.floor(100 * min(rates)), math.ceil(100 * max(rates)))


def test_reward_model_figure_reads_every_logged_metric_and_splits_quarters(tmp_path):
    """scripts/reward_model_figure.py's record: each metric by step from the CSV logger's files (a
    blank cell is a metric not logged at that step), and the means of four quarters in step order."""
    from scripts.reward_model_figure import metrics, quarters

    log = tmp_path / "lightning_logs" / "version_0" / "metrics.csv"
    log.parent.mkdir(parents=True)
    log.write_text("epoch,step,gold_reward_mean,val_accuracy\n0,0,0.5,\n0,1,1.0,\n0,1,,0.75\n")
    assert metrics(tmp_path) == {"gold_reward_mean": {0: 0.5, 1: 1.0}, "val_accuracy": {1: 0.75}}
    assert quarters({3: 4.0, 0: 1.0, 2: 3.0, 1: 2.0, 4: 9.0}) == [1.0, 2.0, 3.0, 4.0]  # the 5th is left over
    with pytest.raises(SystemExit, match="too few logged steps"):
        quarters({0: 1.0})


def test_policy_pairs_rank_the_right_answer_above_each_wrong_sample_most_frequent_first():
    """scripts/make_policy_pairs.py: one pair per distinct wrong sampled answer (empty ones and right
    ones give none), the most frequent first, at most ``per_prompt``; the training prompts leave out
    every held-out one."""
    import random

    from scripts.make_policy_pairs import policy_pairs, training_prompts
    from scripts.make_preference_pairs import DATA, prompt_of

    rows = [{"prompt": "What is 3 + 4?", "answer": "7"}, {"prompt": "Compute 9 - 5.", "answer": "4"}]
    answers = [["7", "8", "6", "8", "", "7", "71", "6"], ["4", "4"]]
    pairs = policy_pairs(rows, answers, 2, random.Random(0))
    sides = []
    for pair in pairs:
        chosen, rejected = pair["chosen"], pair["rejected"]
        last = lambda side: side if isinstance(side, str) else side[-1]["content"]  # noqa: E731
        sides.append((last(chosen), last(rejected), pair["answer"]))
    assert sides == [("7", "6", "7"), ("7", "8", "7")]  # 6 and 8 twice each (a tie: by text), 71 once: cut
    prompts = training_prompts()
    held_out = {prompt_of(json.loads(line)) for line in (DATA / "val.jsonl").read_text().splitlines()}
    assert prompts and not {r["prompt"] for r in prompts} & held_out
    assert len({r["prompt"] for r in prompts}) == len(prompts)


def test_the_distillation_figure_is_the_recorded_runs():
    """docs/distillation.md states what `scripts/distill_figure.py` recorded: distillation above SFT
    alone in each of at least three seeds, on the current config, data and models."""
    from scripts.distill_figure import RECORD, fingerprint
    from tests.helpers import REPO

    record = json.loads(RECORD.read_text())
    assert record["inputs"] == fingerprint(), "the runs' inputs changed: rerun scripts/distill_figure.py"
    rates = record["greedy_exact"]
    assert len(rates) >= 3 and record["distill_wins_every_seed"]
    assert all(r["distill"] > r["sft"] for r in rates.values())
    doc = (REPO / "docs" / "distillation.md").read_text()
    for seed, r in rates.items():
        assert f"| {seed} | {r['sft']:.3f} | {r['distill']:.3f} |" in doc, seed


def test_the_on_policy_distillation_figure_is_the_recorded_runs():
    """docs/distillation.md states what `scripts/distill_onpolicy_figure.py` recorded (each seed's
    warm-up, SFT alone and distilled rates, and whether distillation won every seed), for at least
    three seeds, on the current config, data and models."""
    from scripts.distill_onpolicy_figure import INPUTS, RECORD
    from scripts.distill_figure import fingerprint

    record = json.loads(RECORD.read_text())
    assert record["inputs"] == fingerprint(INPUTS), "the runs' inputs changed: rerun scripts/distill_onpolicy_figure.py"
    rates = record["greedy_exact"]
    assert len(rates) >= 3
    assert record["distill_wins_every_seed"] == all(r["distill"] > r["sft"] for r in rates.values())
    doc = (REPO / "docs" / "distillation.md").read_text()
    for seed, r in rates.items():
        assert f"| {seed} | {r['warmup']:.3f} | {r['sft']:.3f} | {r['distill']:.3f} |" in doc, seed
    assert record["command"] in doc
