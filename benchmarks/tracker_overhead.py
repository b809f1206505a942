"""Microseconds the estimate's TrackingMode adds per operator: a Llama forward and backward on fake tensors.

``python benchmarks/tracker_overhead.py [--other PATH/TO/tracker.py ...] [--rounds N] [--layers L]`` builds
the tiny Llama's architecture with L blocks on fake tensors and times building it, a forward and a
backward under this checkout's tracker and, with ``--other``, under another copy of
``lightning_mem/estimate/tracker.py`` (another checkout's), alternating round by round in one
process, so both see the same machine load. Prints each round's seconds per 1,000 operators.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
import warnings

import torch


def _load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _one_round(tracker, config, ids) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM

    ledger = tracker.MemoryLedger({config.vocab_size})
    mode = tracker.TrackingMode(ledger, fake=True)
    ops = 0
    inner = mode._run

    def counted(func, args, kwargs):  # noqa: ANN001
        nonlocal ops
        ops += 1
        return inner(func, args, kwargs)

    mode._run = counted
    start = time.perf_counter()
    with mode:  # built inside: its parameters are fake, as in the estimate
        model = AutoModelForCausalLM.from_config(config)
        model(input_ids=ids, labels=ids).loss.backward()
    return time.perf_counter() - start, ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--other", action="append", default=[],
                        help="another checkout's lightning_mem/estimate/tracker.py (repeatable)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    from transformers import AutoConfig

    from lightning_mem import assets
    from lightning_mem.estimate import tracker as this

    config = AutoConfig.from_pretrained(assets.ASSETS / "tiny-llama")
    config.num_hidden_layers = args.layers
    ids = torch.randint(3, config.vocab_size, (2, 64))
    trackers = {"this": this}
    for index, path in enumerate(args.other):
        trackers[path] = _load(path, f"other_tracker_{index}")
    rows: dict[str, list[float]] = {name: [] for name in trackers}
    for _ in range(args.rounds):
        for name, tracker in trackers.items():
            seconds, ops = _one_round(tracker, config, ids)
            rows[name].append(round(1000 * seconds / max(ops, 1), 3))
    medians = {name: sorted(values)[len(values) // 2] for name, values in rows.items()}
    print(json.dumps({"seconds_per_1000_ops": rows, "median": medians, "ops_per_round": ops}))


if __name__ == "__main__":
    main()
