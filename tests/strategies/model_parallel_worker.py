"""Runs the split (tensor / context parallel) runs of a spec and writes what each rank measured.

Usage: python tests/strategies/model_parallel_worker.py SPEC.json

Lightning's launcher re-executes this script once per extra rank at the first fit; the later
fits reuse the processes and their process group. Each rank writes ``<out>/rank<r>.json``:
``{run name: report}`` (:func:`model_parallel_scenarios.fit`); global rank 0 also writes each
run's first-step gradients.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import model_parallel_scenarios as sc
from lightning_mem.strategies import FSDP2Strategy


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(spec["out"])
    torch.set_num_threads(1)
    reports = {}
    for run in spec["runs"]:
        strategy = FSDP2Strategy(process_group_backend="gloo", **run["strategy"])
        reports[run["name"]] = sc.fit(run, out, devices=spec["devices"], strategy=strategy)
    (out / f"rank{reports[spec['runs'][0]['name']]['rank']}.json").write_text(json.dumps(reports))


if __name__ == "__main__":
    main()
