"""Records every shipped GPU-tier config's estimate JSON into a folder, or checks it is byte-identical to a recorded one.

``python scripts/check_estimates_identical.py record OUT``  writes OUT/<recipe>__<config>.json (stdout of
``python -m lightning_mem.estimate --config C --json``), its exit status and its wall time;
``python scripts/check_estimates_identical.py compare BASE [--out NEW]`` records the current code into NEW
(a temporary folder by default) and says, per config, whether stdout and exit status equal BASE's.
``--only PATTERN`` (repeatable, substring of the config path) limits either to some configs. A refactor of
the estimator is safe to merge when ``compare`` reports every config identical.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def shipped_configs(only: list[str] | None) -> list[Path]:
    """Every GPU-tier config (the tiny_cpu* ones have no tier, so no estimate to hold them to)."""
    configs = sorted(p for p in (ROOT / "configs").glob("*/*.yaml") if not p.name.startswith("tiny_cpu"))
    if only:
        configs = [p for p in configs if any(o in str(p.relative_to(ROOT)) for o in only)]
    return configs


def record_one(config: Path, out: Path) -> dict:
    """One estimate in a fresh process, as a user runs it (so import time is in the wall time)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_mem.estimate", "--config", str(config.relative_to(ROOT)), "--json"],
        cwd=ROOT, env=env, capture_output=True, text=True,
    )
    seconds = time.perf_counter() - start
    name = f"{config.parent.name}__{config.stem}"
    (out / f"{name}.json").write_text(proc.stdout)
    (out / f"{name}.stderr").write_text(proc.stderr)
    return {"name": name, "rc": proc.returncode, "seconds": round(seconds, 1)}


def record(out: Path, only: list[str] | None) -> dict[str, dict]:
    out.mkdir(parents=True, exist_ok=True)
    meta_path = out / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    for config in shipped_configs(only):
        row = record_one(config, out)
        meta[row["name"]] = {"rc": row["rc"], "seconds": row["seconds"]}
        # NOTE: written after every config so an interrupted recording keeps what it has.
        meta_path.write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
        print(f"{row['name']}: rc {row['rc']}, {row['seconds']} s", flush=True)
    return meta


def compare(base: Path, out: Path, only: list[str] | None) -> int:
    """0 when every recorded config's stdout and exit status equal the base's; 1 otherwise."""
    base_meta = json.loads((base / "meta.json").read_text())
    new_meta = record(out, only)
    differ = 0
    for config in shipped_configs(only):
        name = f"{config.parent.name}__{config.stem}"
        if name not in base_meta:
            print(f"{name}: not in {base}", flush=True)
            differ += 1
            continue
        same = (base / f"{name}.json").read_bytes() == (out / f"{name}.json").read_bytes()
        same = same and base_meta[name]["rc"] == new_meta[name]["rc"]
        before, after = base_meta[name]["seconds"], new_meta[name]["seconds"]
        print(f"{name}: {'identical' if same else 'DIFFERS'} ({before} s -> {after} s)", flush=True)
        differ += not same
    print(f"{differ} config(s) differ" if differ else "every config identical")
    return 1 if differ else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["record", "compare"])
    parser.add_argument("folder", type=Path, help="record: where to write; compare: the recorded base")
    parser.add_argument("--out", type=Path, default=None, help="compare: where to record the current code")
    parser.add_argument("--only", action="append", default=None, help="substring of the config path")
    args = parser.parse_args(argv)
    if args.mode == "record":
        record(args.folder, args.only)
        return 0
    out = args.out or Path(tempfile.mkdtemp(prefix="estimates-"))
    return compare(args.folder, out, args.only)


if __name__ == "__main__":
    sys.exit(main())
