"""PPO update time: the recipe's own ``PPOModule.update`` (policy loss, aggregation, backward) on one
fixed GRPO batch, for comparing two checkouts.

    python benchmarks/ppo_update_time.py --json                         # this checkout
    python benchmarks/ppo_update_time.py --json --code <old checkout>   # the same batch, older code
    python benchmarks/ppo_update_time.py --ab <old checkout> --rounds 4 # both, rounds alternated
    python benchmarks/ppo_update_time.py --packing-ab --long-tail --rounds 4  # padded vs packed, alternated

The batch: 64 answers (8 prompts x 8) of the tiny Llama, 24 prompt tokens and 1-6 response tokens,
with off-policy old log-probs so the clip acts; ``grpo`` advantages, 2 mini-batches, default
settings (``token-mean``, vanilla clipped surrogate). The trainer is a stand-in (no Lightning loop,
no optimizer: the gradient is dropped), so the figure is the update's forward, loss and backward.
With ``--ab`` each round runs both checkouts in fresh processes one after the other, so load from
other jobs falls on both alike; the figure is the ratio of the medians.

``--packing`` runs the update with ``model.ppo.packing: true`` (each micro-batch one padding-free
row, the actor switched to ``packed_sdpa`` as the recipe switches it; ``--block-mask`` keeps plain
``sdpa`` and its block-diagonal mask instead). ``--long-tail`` swaps the batch for a long-tailed length mix: prompts of 16-48 tokens,
responses log-normal (median 24 tokens, clamped to 1-192), micro-batches of ``--max-tokens``
tokens, where padding to the longest sequence costs most. ``--packing-ab`` alternates padded and
packed runs in fresh processes and reports each one's real tokens per second (prompt + response
tokens of the two mini-batches over the update's time), its micro-batch count, and the peak bytes
of the tensors the update allocates (one extra tracked update, :mod:`lightning_mem.estimate.tracker`).
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
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _lengths(long_tail: bool, n: int = 64) -> tuple[int, Any, Any]:
    """The response width and ``n`` prompt and response lengths: short responses, or a long tail."""
    import torch

    if long_tail:
        response = 192
        prompts = torch.randint(16, 49, (n,))
        lengths = torch.distributions.LogNormal(torch.tensor(24.0).log(), 1.0).sample((n,)).round().long().clamp(1, response)
    else:
        response = 6
        prompts = torch.full((n,), 24)
        lengths = torch.randint(1, response + 1, (n,))
    return response, prompts, lengths


def _experience(module: Any, response: int, prompts: Any, lengths: Any) -> Any:
    """Random sequences of those lengths in groups of 8, with old log-probs near the actor's and
    their advantages: what one PPO update takes."""
    import torch

    from lightning_mem.rl.rollout import Experience, policy_forward

    n = len(prompts)
    width = int((prompts + lengths).max())
    attention = (torch.arange(width) < (prompts + lengths).unsqueeze(1)).long()
    ids = torch.randint(3, 300, (n, width)) * attention
    columns = (prompts.unsqueeze(1) + torch.arange(response)).clamp(max=width - 1)
    response_mask = (torch.arange(response) < lengths.unsqueeze(1)).long()
    response_ids = ids.gather(1, columns) * response_mask
    base = Experience(input_ids=ids, attention_mask=attention, prompt_lengths=prompts,
                      response_ids=response_ids, response_mask=response_mask, group_ids=torch.arange(n) // 8,
                      scores=torch.randint(0, 2, (n,)).float())
    with torch.no_grad():
        base.old_logprobs = (policy_forward(module.actor, base, chunk_size=None).logprobs
                             + 0.3 * torch.randn(n, response)) * response_mask
    module.advantages(base)
    return base


def measure(steps: int, *, packing: bool = False, long_tail: bool = False, max_tokens: int | None = None,
            block_mask: bool = False) -> dict:
    import torch

    import recipes.ppo as ppo
    from lightning_mem.models import load_causal_lm
    from lightning_mem.rl.config import GRPOConfig, KLConfig, PPOConfig
    from lightning_mem.rl.rollout import GenerationConfig
    from lightning_mem.estimate.tracker import MemoryLedger, TrackingMode
    from lightning_mem.step_io import StepIO
    from recipes.rewards import ArithmeticReward

    class Probe(ppo.PPOModule):
        stand_in = SimpleNamespace(world_size=1, global_rank=0, strategy=SimpleNamespace(), callbacks=[])

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
    response, prompts, lengths = _lengths(long_tail)
    ppo_settings = dict(num_mini_batches=2, max_grad_norm=None, max_tokens_per_microbatch=max_tokens)
    if packing:  # only named when on, so that an older checkout (no such key) still runs the padded case
        ppo_settings["packing"] = True
    module = Probe(name_or_path=str(ROOT / "assets/tiny-llama"), reward=ArithmeticReward(), advantage_estimator="grpo",
                   grpo=GRPOConfig(group_size=8), kl=KLConfig(coef=0.0), generation=GenerationConfig(max_new_tokens=response),
                   ppo=PPOConfig(**ppo_settings), export_dir=None)
    module.actor = load_causal_lm(str(ROOT / "assets/tiny-llama"))
    if packing and not block_mask:  # what PPOModule.configure_model does with packing on
        from lightning_mem.packed_attention import use_packed_sdpa

        use_packed_sdpa(module.actor)
    base = _experience(module, response, prompts, lengths)
    plans = []
    plain = module.stand_in.callbacks

    class Counting(StepIO):
        def micro_batches(self, lengths, max_tokens, *, agree_on_count=None):
            plans.append(super().micro_batches(lengths, max_tokens, agree_on_count=agree_on_count))
            return plans[-1]

    module.stand_in.callbacks = [Counting()]
    times = []
    for i in range(steps + 2):
        start = time.perf_counter()
        module.update(base)
        if i >= 2:  # the first two are a warm-up
            times.append(time.perf_counter() - start)
    module.stand_in.callbacks = plain
    ledger = MemoryLedger({module.actor.config.vocab_size})
    with TrackingMode(ledger):  # after the timing: tracking slows every operator down
        module.update(base)
    seconds = statistics.median(times)
    tokens = int(base.attention_mask.sum())  # every sequence once: the two mini-batches split the batch
    return {"update_s": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "micro_batches": len(plans[-1]) + len(plans[-2]), "update_peak_bytes": ledger.peak_bytes}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--code", default=str(ROOT), help="the checkout whose recipe and library run")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--ab", help="another checkout: alternate rounds of it and this one")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--packing", action="store_true", help="model.ppo.packing: true")
    parser.add_argument("--long-tail", action="store_true", help="the long-tailed length mix")
    parser.add_argument("--max-tokens", type=int, default=None, help="model.ppo.max_tokens_per_microbatch")
    parser.add_argument("--packing-ab", action="store_true", help="alternate padded and packed rounds")
    parser.add_argument("--block-mask", action="store_true",
                        help="packed rows under plain sdpa and its block-diagonal mask (not packed_sdpa)")
    args = parser.parse_args(argv)
    shape = ((["--long-tail"] if args.long_tail else []) + ([f"--max-tokens={args.max_tokens}"] if args.max_tokens else [])
             + (["--block-mask"] if args.block_mask else []))
    if args.packing_ab:
        runs: dict[str, list[dict]] = {"padded": [], "packed": []}
        for round_ in range(args.rounds):
            for label in ("padded", "packed"):
                command = [sys.executable, __file__, "--json", "--steps", str(args.steps), "--threads", str(args.threads),
                           *shape, *(["--packing"] if label == "packed" else [])]
                out = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT)
                runs[label].append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(f"round {round_ + 1}/{args.rounds} {label}: {runs[label][-1]['tokens_per_s']:.0f} tokens/s",
                      file=sys.stderr, flush=True)
        summary = {label: {"tokens_per_s": [r["tokens_per_s"] for r in rs],
                           "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                           "micro_batches": rs[0]["micro_batches"], "update_peak_bytes": rs[0]["update_peak_bytes"],
                           "tokens": rs[0]["tokens"]} for label, rs in runs.items()}
        summary["packed_over_padded"] = (summary["packed"]["median_tokens_per_s"]
                                         / summary["padded"]["median_tokens_per_s"])
        print(json.dumps(summary))
        return
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
    result = measure(args.steps, packing=args.packing, long_tail=args.long_tail, max_tokens=args.max_tokens,
                     block_mask=args.block_mask)
    print(json.dumps(result) if args.json else
          f"update: {result['update_s'] * 1e3:.1f} ms, {result['tokens_per_s']:.0f} tokens/s, "
          f"{result['micro_batches']} micro-batches, update peak {result['update_peak_bytes'] / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
