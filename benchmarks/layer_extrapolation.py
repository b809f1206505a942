"""Would an estimate of a few layers, extrapolated per layer, give the full estimate? Measured per config.

    OMP_NUM_THREADS=1 python benchmarks/layer_extrapolation.py --full RECORDS [--only PATTERN] [--out FILE]

For each shipped GPU-tier config, runs ``python -m lightning_mem.estimate --json`` with every model's
``num_hidden_layers`` set to 2, 3, 4 and 8 (a fresh process each; the model folder's copy that the
estimate builds from is edited, nothing else), and extrapolates each figure of the JSON linearly
from the 2-, 3- and 4-layer estimates to the model's own layer count. ``--full`` is a folder of the
full estimates, as ``scripts/check_estimates_identical.py record`` writes it. Per config it prints
the seconds of each short estimate, how many figures the straight line gets exactly, which are not
on one line already at 2-4 layers, and which it gets wrong at 8 layers and at the full count, with
the ratio of the extrapolated figure to the full estimate's.

This is the question behind issue 45's 15 s target for the 70B QLoRA config: an estimate of 80
identical layers run one by one costs about 0.2 s a layer. The answer measured on 2026-11-28 (docs/
will_it_fit.md, "Why the estimate runs every layer"): a peak is the largest of several moments, each
growing at its own rate per layer, so the line through a few layers can run under the full estimate
without any sign of it at those few layers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from check_estimates_identical import shipped_configs  # noqa: E402

SAMPLES = (2, 3, 4, 8)
#: Figures of the report that do not depend on the model.
_FIXED = ("margin", "usable_device_bytes", "device_memory_bytes", "world_size")

#: Run in the child process: the estimate, with each model's config copy cut to ``layers`` layers.
_CHILD = """
import json, sys
from pathlib import Path
from lightning_mem.estimate import recipe_config
import lightning_mem.estimate.__main__ as cli
layers = int(sys.argv[1])
copy = recipe_config.config_only_copy
def fewer_layers(name_or_path, key, workdir):
    folder = copy(name_or_path, key, workdir)
    path = Path(folder) / "config.json"
    config = json.loads(path.read_text())
    config["num_hidden_layers"] = layers
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:layers]
    path.write_text(json.dumps(config))
    return folder
recipe_config.config_only_copy = fewer_layers
sys.meta_path.insert(0, cli._BitsandbytesUncompiled())
sys.exit(cli.main(sys.argv[2:]))
"""


def flatten(value: object, path: str = "") -> dict[str, int]:
    """Every number of an estimate's JSON, by a path naming phases and ranks rather than list positions."""
    out: dict[str, int] = {}
    if isinstance(value, dict):
        for key, item in value.items():
            if key not in _FIXED:
                out.update(flatten(item, f"{path}.{key}"))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            name = i
            if isinstance(item, dict):
                name = f"{item.get('rank', '')}:{item.get('phase', i)}"
            out.update(flatten(item, f"{path}[{name}]"))
    elif isinstance(value, int) and not isinstance(value, bool):
        out[path] = value
    return out


def layer_count(config: Path) -> int:
    """The policy's layer count, from the model folder the config names (assets/hub/ here)."""
    import yaml

    name = yaml.safe_load(config.read_text())["model"]["name_or_path"]
    return json.loads((ROOT / "assets" / "hub" / name / "config.json").read_text())["num_hidden_layers"]


def short_estimate(config: Path, layers: int) -> tuple[dict, float]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(layers), "--config", str(config.relative_to(ROOT)),
                           "--json"], cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if not proc.stdout.strip():
        raise RuntimeError(f"{config.name} at {layers} layers: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout), seconds


def compare(config: Path, full: dict) -> dict:
    n = layer_count(config)
    runs = {layers: short_estimate(config, layers) for layers in SAMPLES}
    figures = {layers: flatten(result) for layers, (result, _) in runs.items()}
    row = {"config": str(config.relative_to(ROOT)), "layers": n,
           "seconds": {layers: round(s, 1) for layers, (_, s) in runs.items()},
           "exact": 0, "not_on_a_line": [], "wrong_at_8": [], "wrong_at_full": []}
    for key, value in flatten(full).items():
        a, b, c = (figures[layers].get(key) for layers in (2, 3, 4))
        if a is None or b is None or c is None or b - a != c - b:
            row["not_on_a_line"].append(key)
            continue
        at_8, at_n = a + 6 * (b - a), a + (n - 2) * (b - a)
        if figures[8].get(key) != at_8:
            row["wrong_at_8"].append(key)
        if at_n == value:
            row["exact"] += 1
        else:
            row["wrong_at_full"].append([key, at_n, value, round(at_n / value, 4) if value else None])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", type=Path, required=True, help="records of the full estimates (check_estimates_identical.py record)")
    parser.add_argument("--only", action="append", default=None, help="substring of the config path (repeatable)")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON")
    args = parser.parse_args()
    rows = []
    for config in shipped_configs(args.only):
        record = args.full / f"{config.parent.name}__{config.stem}.json"
        row = compare(config, json.loads(record.read_text()))
        rows.append(row)
        print(f"{row['config']}: {row['layers']} layers; short estimates {row['seconds']} s; exact"
              f" {row['exact']}, not on a line at 2-4 layers {len(row['not_on_a_line'])}, wrong at 8 layers"
              f" {len(row['wrong_at_8'])}, wrong at {row['layers']} {len(row['wrong_at_full'])}", flush=True)
        for key, extrapolated, value, ratio in row["wrong_at_full"]:
            print(f"    {key}: extrapolated {extrapolated}, full {value} ({ratio})", flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
