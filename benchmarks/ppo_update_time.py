"""PPO update time: the recipe's own ``PPOModule.update`` (policy loss, aggregation, backward) on one
fixed GRPO batch, for comparing two checkouts.

    python benchmarks/ppo_update_time.py --json                         # this checkout
    python benchmarks/ppo_update_time.py --json --code <old checkout>   # the same batch, older code
    python benchmarks/ppo_update_time.py --ab <old checkout> --rounds 4 # both, rounds alternated

The batch: 64 answers (8 prompts x 8) of the tiny Llama, 24 prompt tokens and 1-6 response tokens,
with off-policy old log-probs so the clip acts; ``grpo`` advantages, 2 mini-batches, default
settings (``token-mean``, vanilla clipped surrogate). The trainer is a stand-in (no Lightning loop,
no optimizer: the gradient is dropped), so the figure is the update's forward, loss and backward.
With ``--ab`` each round runs both checkouts in fresh processes one after the other, so load from
other jobs falls on both alike; the figure is the ratio of the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]


def measure(steps: int) -> float:
    import torch

    import recipes.ppo as ppo
    from lightning_mem.models import load_causal_lm
    from lightning_mem.rl.config import GRPOConfig, KLConfig, PPOConfig
    from lightning_mem.rl.rollout import Experience, GenerationConfig, policy_forward
    from recipes.rewards import ArithmeticReward

    class Probe(ppo.PPOModule):
        stand_in = SimpleNamespace(world_size=1, callbacks=[])

        @property
        def trainer(self):
            return self.stand_in

        def _sum_over_ranks(self, value):
            return value

        def manual_backward(self, loss, *args, **kwargs):
            loss.backward()

        def _optimizer_step(self):
            self.actor.zero_grad(set_to_none=True)

    torch.manual_seed(0)
    n, prompt, response = 64, 24, 6
    module = Probe(name_or_path=str(ROOT / "assets/tiny-llama"), reward=ArithmeticReward(), advantage_estimator="grpo",
                   grpo=GRPOConfig(group_size=8), kl=KLConfig(coef=0.0), generation=GenerationConfig(max_new_tokens=response),
                   ppo=PPOConfig(num_mini_batches=2, max_grad_norm=None), export_dir=None)
    module.actor = load_causal_lm(str(ROOT / "assets/tiny-llama"))
    lengths = torch.randint(1, response + 1, (n,))
    attention = (torch.arange(prompt + response) < prompt + lengths.unsqueeze(1)).long()
    ids = torch.randint(3, 300, (n, prompt + response)) * attention
    response_mask = attention[:, prompt:]
    base = Experience(input_ids=ids, attention_mask=attention, prompt_lengths=torch.full((n,), prompt),
                      response_ids=ids[:, prompt:], response_mask=response_mask, group_ids=torch.arange(n) // 8,
                      scores=torch.randint(0, 2, (n,)).float())
    with torch.no_grad():
        base.old_logprobs = (policy_forward(module.actor, base, chunk_size=None).logprobs
                             + 0.3 * torch.randn(n, response)) * response_mask
    module.advantages(base)
    times = []
    for i in range(steps + 2):
        start = time.perf_counter()
        module.update(base)
        if i >= 2:  # the first two are a warm-up
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--code", default=str(ROOT), help="the checkout whose recipe and library run")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--ab", help="another checkout: alternate rounds of it and this one")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args(argv)
    if args.ab:
        results: dict[str, list[float]] = {"old": [], "new": []}
        for _ in range(args.rounds):
            for label, code in (("old", args.ab), ("new", str(ROOT))):
                out = subprocess.run([sys.executable, __file__, "--json", "--code", code, "--steps", str(args.steps),
                                      "--threads", str(args.threads)], capture_output=True, text=True, check=True,
                                     cwd=code)
                results[label].append(json.loads(out.stdout.strip().splitlines()[-1])["update_s"])
        old, new = statistics.median(results["old"]), statistics.median(results["new"])
        print(json.dumps({"old_s": results["old"], "new_s": results["new"], "median_old_s": old, "median_new_s": new,
                          "new_over_old": new / old}))
        return
    sys.path.insert(0, args.code)
    import torch

    torch.set_num_threads(args.threads)
    seconds = measure(args.steps)
    print(json.dumps({"update_s": seconds}) if args.json else f"update: {seconds * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
