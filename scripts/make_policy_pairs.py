"""Preference pairs from the policy's own samples, labelled by the rule: the reward model's data as
an RLHF pipeline collects it (people compare the SFT model's answers; here the exact-answer rule
stands in for them).

    python -m recipes.sft fit --config configs/sft/tiny_cpu.yaml     # runs/sft/tiny_cpu/export
    python scripts/make_policy_pairs.py --out runs/reward_model_data/policy8x1.jsonl
    python scripts/make_policy_pairs.py --samples 16 --per-prompt 6 --repeat 2 --out runs/reward_model_data/policy16x2.jsonl

For each prompt of ``data/arithmetic/train.jsonl`` that is not held out (the prompts of
``reward_train.jsonl``), the policy samples ``--samples`` answers at temperature 1 with the PPO
recipe's rollout engine and chat rendering. Every distinct wrong answer it gave (up to
``--per-prompt``, the most frequent first) becomes a pair with the right answer as ``chosen``: the
near misses this policy makes, the ones a reward model must rank below the right answer or PPO
moves the policy's wrong answers towards them (docs/reward_model.md). A prompt the policy always
answered right adds no pair of its own; nor does an empty answer (the data refuses an empty
completion). The output holds ``reward_train.jsonl``'s pairs (near and wide misses) and the
policy's pairs ``--repeat`` times, shuffled (``--seed``).

Sampling is seeded (``--seed``); the pairs depend on the export sampled from, so they are made, not
shipped: ``scripts/reward_model_figure.py`` makes them from the SFT demo's export.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere, no install needed

from lightning_mem.quiet import silence_unactionable_warnings  # noqa: E402

silence_unactionable_warnings()

from lightning_mem.data import collate_left_padded, encode_prompt, row_to_prompt_messages  # noqa: E402
from lightning_mem.models import load_causal_lm, load_tokenizer  # noqa: E402
from lightning_mem.rl.rollout import GenerationConfig, RolloutEngine  # noqa: E402
from scripts.make_preference_pairs import DATA, pair_row, prompt_of  # noqa: E402


def training_prompts(data: Path = DATA) -> list[dict]:
    """One row per distinct prompt of ``train.jsonl`` that ``val.jsonl`` does not hold, in file order."""
    read = lambda name: [json.loads(line) for line in (data / name).read_text().splitlines() if line.strip()]  # noqa: E731
    held_out = {prompt_of(r) for r in read("val.jsonl")}
    seen, rows = set(), []
    for row in read("train.jsonl"):
        prompt = prompt_of(row)
        if prompt not in held_out and prompt not in seen:
            seen.add(prompt)
            rows.append({"prompt": prompt, "answer": row["answer"]})
    return rows


@torch.no_grad()
def sample_answers(policy: str, rows: list[dict], *, samples: int, seed: int, batch_size: int = 64,
                   max_new_tokens: int = 6) -> list[list[str]]:
    """``samples`` answers of ``policy`` to each row, at temperature 1, as the PPO recipe samples."""
    tokenizer = load_tokenizer(policy)
    model = load_causal_lm(policy, dtype="float32").eval()
    engine = RolloutEngine(GenerationConfig(max_new_tokens=max_new_tokens, temperature=1.0, do_sample=True),
                           eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)
    items = [{"prompt_ids": encode_prompt(row_to_prompt_messages(row), tokenizer), "row": row}
             for row in rows for _ in range(samples)]
    torch.manual_seed(seed)
    answers: list[str] = []
    for start in range(0, len(items), batch_size):
        batch = collate_left_padded(items[start : start + batch_size], tokenizer.pad_token_id)
        exp = engine.generate(model, batch["input_ids"], batch["attention_mask"])
        answers += [tokenizer.decode(ids[: int(n)], skip_special_tokens=True).strip()
                    for ids, n in zip(exp.response_ids, exp.response_lengths)]
    return [answers[i : i + samples] for i in range(0, len(answers), samples)]


def policy_pairs(rows: list[dict], answers: list[list[str]], per_prompt: int, rng: random.Random) -> list[dict]:
    """The right answer against each distinct wrong sampled one (most frequent first, at most
    ``per_prompt``), each pair in a random row shape."""
    out = []
    for row, sampled in zip(rows, answers):
        wrong = Counter(a for a in sampled if a and a != row["answer"])  # an empty answer: no completion to rank
        for rejected, _ in sorted(wrong.items(), key=lambda kv: (-kv[1], kv[0]))[:per_prompt]:
            out.append(pair_row(row["prompt"], row["answer"], rejected, row["answer"], rng.randrange(3)))
    return out


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default=str(ROOT / "runs" / "sft" / "tiny_cpu" / "export"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--samples", type=int, default=8, help="answers sampled per prompt")
    parser.add_argument("--per-prompt", type=int, default=4, help="most pairs a prompt gives")
    parser.add_argument("--repeat", type=int, default=1, help="times the policy's pairs appear beside reward_train.jsonl's")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rows = training_prompts()
    answers = sample_answers(args.policy, rows, samples=args.samples, seed=args.seed)
    pairs = [json.dumps(p, sort_keys=True) for p in policy_pairs(rows, answers, args.per_prompt, random.Random(args.seed))]
    right = sum(a == row["answer"] for row, sampled in zip(rows, answers) for a in sampled)
    print(f"{len(rows)} prompts x {args.samples} samples: {right / (len(rows) * args.samples):.3f} right; "
          f"{len(pairs)} pairs from the policy's wrong answers")
    lines = (DATA / "reward_train.jsonl").read_text().splitlines() + pairs * args.repeat
    random.Random(args.seed).shuffle(lines)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(line + "\n" for line in lines))
    print(f"{args.out}: {len(lines)} pairs")
    return args.out


if __name__ == "__main__":
    main()
