"""Rewrite the ``# estimated peak per rank (GiB): ...`` header of GPU-tier configs from a fresh estimate.

    python scripts/update_estimate_headers.py                      # every configs/*/*.yaml but tiny_*
    python scripts/update_estimate_headers.py configs/sft/llama-3.1-8b_1x24gb.yaml

The CI gate (``tests/estimate/test_config_gate.py``) holds each header within 5 % of the estimate:
after a change that moves an estimate, this writes the new figures (computed, never typed in) and
prints what changed. A config whose estimate no longer fits its tier is reported, and its header
still updated: choosing another memory plan for it is a decision, not a rewrite.
"""

from __future__ import annotations

import logging
import re
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADER = re.compile(r"^# estimated peak per rank \(GiB\):((?:\s+\w+=[0-9.]+)+)", re.MULTILINE)


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(ROOT))
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    from lightning_mem.estimate import estimate, tier_of, usable_bytes
    from lightning_mem.estimate.report import training_ranks

    paths = [Path(a) for a in argv] or sorted(p for p in (ROOT / "configs").glob("*/*.yaml") if not p.name.startswith("tiny_"))
    too_big = []
    for path in paths:
        text = path.read_text()
        tier = tier_of(path)
        # Separate placement: the tier's GPUs less the generating ones train; both roles' phases.
        result = estimate(path, [], world_size=training_ranks(path, tier) if tier else None)
        peaks = " ".join(f"{p.phase}={p.device_peak_bytes / 2**30:.2f}" for p in result.every_phase)
        match = HEADER.search(text)
        if match is None:
            print(f"{path}: no '# estimated peak per rank (GiB): ...' header line; add one by hand once", file=sys.stderr)
            continue
        old = match.group(1).strip()
        path.write_text(text[: match.start(1)] + " " + peaks + text[match.end(1):])
        print(f"{path.relative_to(ROOT) if path.is_absolute() else path}: {old} -> {peaks}", flush=True)
        if tier is not None and result.device_peak_bytes > usable_bytes(tier.memory_bytes):
            too_big.append(str(path))
    for path in too_big:
        print(f"DOES NOT FIT its tier: {path}", file=sys.stderr)
    return 1 if too_big else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
