"""Recompute time against held activation bytes: no checkpointing, selective, every block, budget.

One training step (forward + backward) of a Qwen2.5-0.5B-shaped model (its hidden, MLP and head
sizes; ``--layers`` blocks; a ``--vocab`` cut so the head does not dominate on CPU), random init,
fp32, on CPU, for each mode, interleaved (A, B, C, D, A, B...) so a shared machine's load falls on
each alike. Held bytes: every storage the forward created that is still alive when it returns
(what backward will read: autograd's saved tensors and selective checkpointing's cache), counted
with a dispatch mode; the step time's difference to no checkpointing is the recompute.

The budget row checkpoints the fewest first blocks whose held bytes fit halfway between none and
every block (:func:`lightning_mem.activation_checkpointing.fewest_blocks_within`, here fed with
these measured bytes; the recipes feed it the estimator's peaks).

    OMP_NUM_THREADS=2 nice -n 5 python benchmarks/activation_checkpointing.py --layers 4 --seq 512 --repeats 3
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def build(layers: int, vocab: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(ROOT / "assets/hub/Qwen/Qwen2.5-0.5B-Instruct")
    config.num_hidden_layers, config.vocab_size, config.use_cache = layers, vocab, False
    config.tie_word_embeddings = False
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")


def _live_bytes(created) -> int:
    # A live storage seen twice (an op returning its input, a view) counts once.
    live = {ref.cdata: n for ref, n in created if not ref.expired()}
    return sum(live.values())


def held_and_seconds(model, ids) -> tuple[int, float]:
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    # Every storage made, not keyed by address: a freed one's address is reused by later ones.
    created: list[tuple[StorageWeakRef, int]] = []

    class Created(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    s = t.untyped_storage()
                    created.append((StorageWeakRef(s), s.nbytes()))
            return out

    model.zero_grad(set_to_none=True)
    gc.collect()
    start = time.perf_counter()
    with Created():
        loss = model(input_ids=ids, labels=ids).loss
    held = _live_bytes(created)
    loss.backward()
    return held, time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    from lightning_mem.activation_checkpointing import checkpoint_blocks, fewest_blocks_within

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))

    def held_with(**kwargs) -> int:
        model = build(args.layers, args.vocab)
        checkpoint_blocks(model, **kwargs)
        return held_and_seconds(model, ids)[0]

    none_bytes, full_bytes = held_with(count=0), held_with(every=1)
    budget = (none_bytes + full_bytes) // 2
    budget_blocks, _ = fewest_blocks_within(budget, lambda n: held_with(count=n), args.layers)
    modes = {"none": dict(count=0), "selective": dict(every=1, policy="selective"), "every block": dict(every=1),
             f"budget ({budget_blocks} of {args.layers})": dict(count=budget_blocks)}
    models = {}
    for name, kwargs in modes.items():
        models[name] = build(args.layers, args.vocab)
        checkpoint_blocks(models[name], **kwargs)
    for model in models.values():
        held_and_seconds(model, ids)  # warm-up
    held: dict[str, int] = {}
    seconds: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(args.repeats):
        for name, model in models.items():
            held[name], s = held_and_seconds(model, ids)
            seconds[name].append(s)
    base = statistics.median(seconds["none"])
    print(f"Qwen2.5-0.5B shapes, {args.layers} blocks, vocab {args.vocab}, batch {args.batch} x {args.seq}, fp32, CPU;"
          f" budget {budget / 2**20:.0f} MiB (halfway none..every block)")
    for name in models:
        med = statistics.median(seconds[name])
        print(f"| {name} | {held[name] / 2**20:.0f} MiB | {med:.2f} s | {100 * (med / base - 1):+.0f} % |")
    print(json.dumps({"held": held, "seconds": seconds}))


if __name__ == "__main__":
    main()
