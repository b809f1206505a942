"""torchtune's single-device memory ladder on a GPU (issue #34, item 4): each rung of
``configs/sft/llama-3.2-3b_1x80gb_ladder.yaml`` as a config of its own, run for a few steps by
``benchmarks/gpu/tiers.py`` (capped to the 1x80GB tier), its peak beside torchtune's published figure.

    python -m benchmarks.gpu.ladder --out runs/gpu                            # every rung, one at a time
    python -m benchmarks.gpu.ladder --only adamw8bit --only activation-offload --steps 3
    python -m benchmarks.gpu.ladder --write-only /tmp/rungs                   # the rung configs; nothing runs

The rungs and their overrides are the ones ``benchmarks/published_figures.py`` estimates (the
``torchtune-llama3.2-3b-ladder-*`` setups; the top config's header lists the same): each rung's
config is the top config with its overrides applied, written as YAML under ``--workdir``, so that the
tier driver runs it as it runs any shipped config (random weights from ``assets/hub``, generated rows
of 4,096 tokens, ``MemoryMonitor`` peaks). Writes ``gpu_ladder.md`` and ``gpu_ladder.json`` under
``--out`` beside the driver's own ``gpu_tiers.*``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from benchmarks.gpu.step_time import fmt

ROOT = Path(__file__).resolve().parents[2]
TOP = ROOT / "configs" / "sft" / "llama-3.2-3b_1x80gb_ladder.yaml"
PREFIX = "torchtune-llama3.2-3b-ladder-"
GiB = 1 << 30


def rungs() -> list[Any]:
    """The ladder's setups from ``benchmarks/published_figures.py``, bottom rung first."""
    from benchmarks.published_figures import SETUPS

    found = [s for s in SETUPS if s.name.startswith(PREFIX)]
    if not found or any(Path(s.config).resolve() != TOP for s in found):
        raise RuntimeError(f"published_figures.py has no ladder setups over {TOP.relative_to(ROOT)}")
    return found


def apply_overrides(config: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``config`` with ``--a.b.c=value`` overrides applied as the recipe's CLI applies them: the value
    is YAML (``null``, numbers, JSON lists); a class path given for a ``{class_path, init_args}``
    entry replaces the class and keeps its ``init_args``."""
    result = copy.deepcopy(config)
    for override in overrides:
        if not override.startswith("--") or "=" not in override:
            raise ValueError(f"override {override!r}: expected --key.path=value")
        key, text = override[2:].split("=", 1)
        value = yaml.safe_load(text)
        *parents, last = key.split(".")
        node = result
        for part in parents:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        current = node.get(last)
        if isinstance(current, dict) and "class_path" in current and isinstance(value, str):
            current["class_path"] = value
        else:
            node[last] = value
    return result


def rung_name(setup: Any) -> str:
    return setup.name[len(PREFIX):]


def write_rung(setup: Any, dest: Path) -> Path:
    """The rung's config under ``dest/sft/`` (the tier driver knows the recipe by its folder's name).
    Its header keeps the top config's tier line and says where it came from; it states no estimate
    (the top config's is for the top rung alone)."""
    config = apply_overrides(yaml.safe_load(TOP.read_text()), setup.overrides)
    name = rung_name(setup)
    config["trainer"]["default_root_dir"] = f"runs/sft/llama-3.2-3b_1x80gb_ladder-{name}"
    header = [line for line in TOP.read_text().splitlines() if line.startswith("# tier:")]
    header.append(f"# rung {name!r} of torchtune's ladder (published {setup.published}): "
                  f"{TOP.relative_to(ROOT)} with {' '.join(setup.overrides) or 'no overrides'}")
    path = dest / "sft" / f"llama-3.2-3b_1x80gb_ladder-{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(header) + "\n" + yaml.safe_dump(config, sort_keys=False))
    return path


def selected(only: list[str]) -> list[Any]:
    found = rungs()
    names = [rung_name(s) for s in found]
    unknown = [o for o in only if o not in names]
    if unknown:
        raise ValueError(f"--only: unknown rungs {unknown}; known: {names}")
    return [s for s in found if not only or rung_name(s) in only]


def ladder_rows(setups: list[Any], results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per rung: torchtune's figure beside the measured peak allocated and reserved of the
    training steps, their ratio, and tokens/s."""
    by_config = {Path(r["config"]).stem: r for r in results}
    rows = []
    for setup in setups:
        result = by_config.get(f"llama-3.2-3b_1x80gb_ladder-{rung_name(setup)}", {})
        step = (result.get("phases") or {}).get("step") or {}
        allocated, reserved = step.get("allocated"), step.get("reserved")
        speed = result.get("speed") or {}
        rows.append(dict(rung=rung_name(setup), published=setup.published, published_gib=setup.published_bytes / GiB,
                         outcome=result.get("outcome", "not run"), error=result.get("error"),
                         allocated_gib=None if allocated is None else allocated / GiB,
                         reserved_gib=None if reserved is None else reserved / GiB,
                         ratio=None if allocated is None else allocated / setup.published_bytes,
                         tokens_per_s=speed.get("tokens_per_s"), batch_s=speed.get("median_s")))
    return rows


def markdown(rows: list[dict[str, Any]], *, date: str, device: str, command: str) -> str:
    lines = [f"torchtune's ladder (Llama 3.2 3B, 2 x 4,096 tokens), {date}, {device}, `{command}`; peaks over the"
             " training steps (`MemoryMonitor`), tokens/s of the batches after the first.", "",
             "| rung | torchtune (A100) | peak allocated GiB | peak reserved GiB | allocated / torchtune"
             " | batch s (median) | tokens/s | outcome |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        outcome = row["outcome"] + (f" ({row['error'][:100]})" if row.get("error") else "")
        lines.append(f"| {row['rung']} | {row['published']} | {fmt(row['allocated_gib'], '.2f')}"
                     f" | {fmt(row['reserved_gib'], '.2f')} | {fmt(row['ratio'], '.2f')}"
                     f" | {fmt(row['batch_s'], '.2f')} | {fmt(row['tokens_per_s'], ',.0f')} | {outcome} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu.ladder", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "runs" / "gpu"))
    parser.add_argument("--only", action="append", default=[], help="a rung's name (repeatable); default: every rung")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per rung")
    parser.add_argument("--timeout", type=float, default=240, help="seconds per rung before it is stopped")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/lightning_mem_gpu"))
    parser.add_argument("--write-only", type=Path, metavar="DIR", help="write the rung configs under DIR; run nothing")
    args = parser.parse_args(argv)
    try:
        setups = selected(args.only)
    except ValueError as err:
        parser.error(str(err))
    if args.write_only is not None:
        for setup in setups:
            print(write_rung(setup, args.write_only))
        return 0
    import torch

    from benchmarks.gpu import tiers

    paths = [write_rung(setup, args.workdir / "ladder_configs") for setup in setups]
    # One at a time: each rung's tier is the whole card, and its tokens/s should not share it.
    tiers_args = ["--out", str(args.out), "--steps", str(args.steps), "--timeout", str(args.timeout),
                  "--workdir", str(args.workdir), "--jobs", "1"]
    for path in paths:
        tiers_args += ["--config", str(path)]
    tiers.main(tiers_args)
    results_file = args.out / "gpu_tiers.json"
    results = json.loads(results_file.read_text()) if results_file.is_file() else []
    rows = ladder_rows(setups, results)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    command = "python -m benchmarks.gpu.ladder " + " ".join(argv if argv is not None else sys.argv[1:])
    text = markdown(rows, date=datetime.date.today().isoformat(), device=device, command=command)
    (args.out / "gpu_ladder.json").write_text(json.dumps(rows, indent=1))
    (args.out / "gpu_ladder.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
