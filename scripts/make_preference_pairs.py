"""Make the shipped preference pairs of the CPU demo (DPO, reward model) from the arithmetic data:

    python scripts/make_preference_pairs.py                 # data/arithmetic/{preference_train,preference_val,reward_train}.jsonl
    python scripts/make_preference_pairs.py --out /tmp/pairs

Each pair answers an arithmetic prompt of ``data/arithmetic/{train,val}.jsonl`` (their phrasings,
as in ``prompts.jsonl``): ``chosen`` is the right answer, ``rejected`` a near miss -- off by one or
two, its two digits swapped, or the other operation's result -- drawn with a fixed seed, so the
files are the same bytes on every run (a test regenerates them).

- ``preference_train.jsonl``: one pair per row of ``train.jsonl`` whose prompt is not a held-out one;
- ``preference_val.jsonl``: two pairs (two different near misses) per row of ``val.jsonl``; no
  held-out prompt occurs in the training pairs.
- ``reward_train.jsonl`` (the reward model's training pairs): four pairs per row of
  ``preference_train.jsonl``'s prompts, two near misses and two *wide* misses (any other answer from
  0 to 40). A reward model steers PPO toward whatever it scores highest among the answers the
  policy samples, so it must rank the right answer above every answer, not only above near misses:
  trained on near misses alone, the tiny model's reward ranks some far-off answer first for most
  prompts and PPO learns to give it (docs/reward_model.md). Its own random stream (seed + 1): the
  two preference files stay as they are.

The rows mix the three shapes ``PreferenceDataModule`` reads, about a third each: strings
(``prompt``/``chosen``/``rejected``), TRL's conversational form, and whole conversations sharing
their prompt. Every row keeps ``answer`` (a reward rule's field). No ``margin``: the demo trains
plain Bradley-Terry.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "arithmetic"
SEED = 0
_QUESTION = re.compile(r"(\d+) ([+-]) (\d+)")


def prompt_of(row: dict) -> str:
    return row["prompt"] if "prompt" in row else row["messages"][0]["content"]


def near_misses(prompt: str, answer: int) -> dict[str, list[int]]:
    """Wrong answers close to ``answer``, by kind: off by one or two, its two digits swapped, the
    other operation's result (none below 0)."""
    a, op, b = _QUESTION.search(prompt).groups()
    a, b = int(a), int(b)
    digits = str(answer)
    kinds = {
        "off by one or two": [answer + d for d in (-2, -1, 1, 2)],
        "digits swapped": [int(digits[::-1])] if len(digits) == 2 and digits[0] != digits[1] else [],
        "other operation": [a - b if op == "+" else a + b],
    }
    return {kind: sorted({v for v in values if v >= 0 and v != answer}) for kind, values in kinds.items()}


def draw(misses: dict[str, list[int]], count: int, rng: random.Random) -> list[int]:
    """``count`` different near misses, each of a kind drawn first (so that the four off-by-n values
    do not drown the rarer kinds), then a value of it."""
    drawn: list[int] = []
    for _ in range(count):
        kinds = [kind for kind, values in misses.items() if set(values) - set(drawn)]
        if not kinds:
            break
        drawn.append(rng.choice([v for v in misses[rng.choice(kinds)] if v not in drawn]))
    return drawn


def pair_row(prompt: str, chosen: str, rejected: str, answer: str, shape: int) -> dict:
    """The pair in row shape ``shape``: 0 strings, 1 conversational, 2 whole conversations."""
    if shape == 0:
        return {"prompt": prompt, "chosen": chosen, "rejected": rejected, "answer": answer}
    user = [{"role": "user", "content": prompt}]
    chosen_turn, rejected_turn = [{"role": "assistant", "content": chosen}], [{"role": "assistant", "content": rejected}]
    if shape == 1:
        return {"prompt": user, "chosen": chosen_turn, "rejected": rejected_turn, "answer": answer}
    return {"chosen": user + chosen_turn, "rejected": user + rejected_turn, "answer": answer}


def pairs(rows: list[dict], per_row: int, rng: random.Random) -> list[dict]:
    out = []
    for row in rows:
        prompt, answer = prompt_of(row), int(row["answer"])
        for rejected in draw(near_misses(prompt, answer), per_row, rng):
            out.append(pair_row(prompt, str(answer), str(rejected), row["answer"], rng.randrange(3)))
    return out


#: The answers a wide miss is drawn from (the arithmetic data's answers run from 0 to 40).
WIDE = range(0, 41)


def reward_pairs(rows: list[dict], rng: random.Random) -> list[dict]:
    """Per row, two near misses and two wide misses (not near), each pair in a random shape."""
    out = []
    for row in rows:
        prompt, answer = prompt_of(row), int(row["answer"])
        misses = near_misses(prompt, answer)
        close = {v for values in misses.values() for v in values}
        wide = [v for v in WIDE if v != answer and v not in close]
        for rejected in draw(misses, 2, rng) + rng.sample(wide, 2):
            out.append(pair_row(prompt, str(answer), str(rejected), row["answer"], rng.randrange(3)))
    return out


def make(out: Path, data: Path = DATA, seed: int = SEED) -> tuple[Path, Path]:
    read = lambda name: [json.loads(line) for line in (data / name).read_text().splitlines() if line.strip()]  # noqa: E731
    train, val = read("train.jsonl"), read("val.jsonl")
    held_out = {prompt_of(r) for r in val}
    rng = random.Random(seed)
    files = {"preference_train.jsonl": pairs([r for r in train if prompt_of(r) not in held_out], 1, rng),
             "preference_val.jsonl": pairs(val, 2, rng)}
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in files.items():
        (out / name).write_bytes("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows).encode())
    return out / "preference_train.jsonl", out / "preference_val.jsonl"


def make_reward_pairs(out: Path, data: Path = DATA, seed: int = SEED) -> Path:
    """``reward_train.jsonl`` in ``out``: :func:`reward_pairs` of the training prompts (not held out)."""
    read = lambda name: [json.loads(line) for line in (data / name).read_text().splitlines() if line.strip()]  # noqa: E731
    held_out = {prompt_of(r) for r in read("val.jsonl")}
    rows = reward_pairs([r for r in read("train.jsonl") if prompt_of(r) not in held_out], random.Random(seed + 1))
    out.mkdir(parents=True, exist_ok=True)
    path = out / "reward_train.jsonl"
    path.write_bytes("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows).encode())
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DATA, help="folder to write the files into")
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args(argv)
    for path in (*make(args.out, seed=args.seed), make_reward_pairs(args.out, seed=args.seed)):
        print(f"{path}: {sum(1 for _ in path.open())} pairs")


if __name__ == "__main__":
    main()
