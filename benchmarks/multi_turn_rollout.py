"""What the hf engine's multi-turn rollout costs three ways (issue 54 item 5), on CPU at the tiny model:

- ``cached``: one ``generate`` per turn continuing the KV cache (each turn prefills only its new ids),
  the batch shedding the rows whose episode ended (what the recipe runs);
- ``cached_padded``: the same, the ended rows kept in the batch as padding;
- ``prefill``: every turn prefills each running row's whole conversation again (left-padded, a fresh
  ``generate``; what an engine without cache continuation does).

The environment ends row ``i`` after ``1 + i % turns`` turns and answers each turn with an
observation of ``--obs-words`` words, so the batch shrinks turn by turn and the context grows.
Decoding is greedy, so the three ways decode the same trajectories (checked here; sampled, they draw
the same too, tests/rl/test_multi_turn.py, except that a padded batch also draws for its ended
rows). After one warm-up rollout each, the rows report the median wall time of ``--repeats``
rollouts each (interleaved, so a shared machine's load falls on each alike) and the tokens the
model was fed per rollout (rows x columns of every forward: prefills and decode steps).

    OMP_NUM_THREADS=1 python benchmarks/multi_turn_rollout.py --batch 32 --turns 4 --obs-words 16 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's lightning_mem, whichever one the venv installed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--obs-words", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from lightning_mem.models import load_causal_lm
    from lightning_mem.rl.environments import Environment, Step
    from lightning_mem.rl.multi_turn import MultiTurnConfig, multi_turn_rollout
    from lightning_mem.rl.rollout import GenerationConfig, RolloutEngine

    class Turns(Environment):
        def reset(self, row):
            self.row, self.turn = row, 0
            return [{"role": "user", "content": row["prompt"]}]

        def step(self, message):
            self.turn += 1
            reply = [{"role": "user", "content": " ".join(["again"] * args.obs_words)}]
            return Step(reply, 0.0, self.turn >= self.row["turns"])

    model_dir = ROOT / "assets" / "tiny-llama"
    torch.manual_seed(0)
    model, tokenizer = load_causal_lm(str(model_dir)), AutoTokenizer.from_pretrained(model_dir)
    rows = [{"prompt": f"What is {i} + {i % 7}?", "turns": 1 + i % args.turns} for i in range(args.batch)]
    generation = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False)  # padded rows draw no samples
    engine = RolloutEngine(generation, eos_token_ids=[1], pad_token_id=0)
    common = dict(tokenizer=tokenizer, generation=generation, engine=engine, eos_token_ids=[1], pad_token_id=0)
    config = dict(max_turns=args.turns, max_total_tokens=4096)
    ways = {"cached": multi_turn_rollout(Turns, MultiTurnConfig(**config), **common),
            "cached_padded": multi_turn_rollout(Turns, MultiTurnConfig(**config), **common),
            "prefill": multi_turn_rollout(Turns, MultiTurnConfig(**config, cache_across_turns=False), **common)}
    ways["cached_padded"].sampler.shrink = False
    fed = {name: 0 for name in ways}
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    current = ["cached"]
    model.register_forward_pre_hook(lambda m, a, kw: fed.__setitem__(current[0], fed[current[0]] + kw["input_ids"].numel()),
                                    with_kwargs=True)
    inputs = {}
    for name, rollout in ways.items():  # warm-up: the first forwards of a process are slower
        current[0] = name
        rollout.rollout(model, rows)
    fed = {name: 0 for name in ways}
    for _ in range(args.repeats):
        for name, rollout in ways.items():
            current[0] = name
            torch.manual_seed(1)
            start = time.perf_counter()
            exp = rollout.rollout(model, rows)
            seconds[name].append(time.perf_counter() - start)
            inputs[name] = exp.input_ids
    assert all(torch.equal(inputs["cached"], ids) for ids in inputs.values()), "the three ways sampled differently"
    tokens = int(exp.attention_mask.sum())
    for name in ways:
        print(json.dumps({"way": name, "median_s": round(statistics.median(seconds[name]), 3),
                          "seconds": [round(s, 3) for s in seconds[name]], "tokens_fed": fed[name] // args.repeats,
                          "trajectory_tokens": tokens, "batch": args.batch, "turns": args.turns,
                          "obs_words": args.obs_words, "new_tokens": args.new_tokens}))


if __name__ == "__main__":
    main()
