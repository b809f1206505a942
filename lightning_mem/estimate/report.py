"""Verdicts, suggestions and the two output formats (a table, JSON) of an :class:`Estimate`."""

from __future__ import annotations

import json
import math
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_mem.estimate.tracker import CATEGORIES
from lightning_mem.settings import SettingError

GiB = 1 << 30
# What the tracked tensor bytes leave out on a real card: the caching allocator's fragmentation
# and rounding, and the CUDA context with its kernels (cuBLAS workspaces, NCCL buffers).
MARGIN_FRACTION = 0.10
MARGIN_BYTES = 1 * GiB
MARGIN_TEXT = "10% of the device for allocator fragmentation + 1 GiB for the CUDA context"

_SIZE = re.compile(r"^\s*([0-9.]+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 1 << 10, "m": 1e6, "mb": 1e6, "mib": 1 << 20,
          "g": 1e9, "gb": 1e9, "gib": 1 << 30, "t": 1e12, "tb": 1e12, "tib": 1 << 40}
_TIER = re.compile(r"^#\s*tier:\s*(\d+)\s*x\s*(\d+)\s*GB\b", re.IGNORECASE | re.MULTILINE)
_TIER_NAME = re.compile(r"_(\d+)x(\d+)gb", re.IGNORECASE)


def parse_size(text: str, *, key: str = "--device-memory") -> int:
    """``24GiB``, ``80GB``, ``24 GiB``, ``25769803776`` -> bytes. A bare ``GB`` is decimal, ``GiB`` binary.

    Raises:
        SettingError: naming ``key``, when ``text`` is no size.
    """
    match = _SIZE.match(str(text))
    unit = (match.group(2) or "").lower() if match else None
    if match is None or unit not in _UNITS:
        raise SettingError(key, f": cannot read {text!r} as a size; write e.g. 24GiB, 80GB or a byte count")
    return int(float(match.group(1)) * _UNITS[unit])


@dataclass
class Tier:
    """The hardware a config is written for: ``gpus`` cards of ``memory_bytes`` each."""

    gpus: int
    memory_gb: int

    @property
    def memory_bytes(self) -> int:
        # Cards are sold in decimal-looking GB that are binary: a "24 GB" card has 24 GiB.
        return self.memory_gb * GiB


def tier_of(config: str | Path) -> Tier | None:
    """A config's tier: its ``# tier: 1x24GB`` header line, else ``_1x24gb`` in its file name."""
    path = Path(config)
    match = _TIER.search(path.read_text()) if path.is_file() else None
    match = match or _TIER_NAME.search(path.name)
    return Tier(int(match.group(1)), int(match.group(2))) if match else None


def training_ranks(config: str | Path, tier: Tier) -> int:
    """The training ranks of a config on its tier: all of the tier's GPUs, less the generating ones
    where it samples in generator processes of its own (``model.rollout_engine.placement:
    separate``, ``model.async_rollout.generator_devices``, default 1)."""
    import yaml

    model = (yaml.safe_load(Path(config).read_text()) or {}).get("model") or {}
    if (model.get("rollout_engine") or {}).get("placement") != "separate":
        return tier.gpus
    return tier.gpus - int((model.get("async_rollout") or {}).get("generator_devices", 1))


def usable_bytes(device_bytes: int) -> int:
    """Device memory the tracked tensors may use: the device less the margin."""
    return int(device_bytes * (1 - MARGIN_FRACTION)) - MARGIN_BYTES


def check_device_size(device_bytes: int, *, key: str, text: str | None = None) -> None:
    """Refuse a device too small for the margin alone (:data:`MARGIN_TEXT`): nothing would be left
    for the run, and every estimate would be said not to fit a negative budget.

    Raises:
        SettingError: naming ``key``, with the margin in bytes and the least device it leaves room on.
    """
    if usable_bytes(device_bytes) > 0:
        return
    least = math.ceil((MARGIN_BYTES / (1 - MARGIN_FRACTION)) / GiB * 100 + 1e-9) / 100  # the first 0.01 GiB above
    reserve = device_bytes - usable_bytes(device_bytes)
    raise SettingError(
        key, f": {text or f'{device_bytes / GiB:.2f} GiB'} leaves nothing for the run: the estimate reserves"
        f" {reserve / GiB:.2f} GiB of a device that size ({MARGIN_TEXT}); give at least {least:.2f} GiB")


def verdict(peak: int, device_bytes: int | None) -> str:
    if device_bytes is None:
        return "no device size given"
    return "fits" if peak <= usable_bytes(device_bytes) else "does NOT fit"


def device_needed(peak: int) -> float:
    """The smallest device, in GiB (rounded up to 0.1), whose usable bytes hold ``peak``."""
    tenths = math.ceil((peak + MARGIN_BYTES) / (1 - MARGIN_FRACTION) / GiB * 10)
    while usable_bytes(int(tenths / 10 * GiB)) < peak:  # the float above may round a byte short
        tenths += 1
    return tenths / 10


def to_dict(estimate: Any, device_bytes: int | None, advice: Any = None) -> dict[str, Any]:
    """The estimate as JSON-ready data; with ``advice`` (:class:`~lightning_mem.estimate.suggest.Advice`),
    its ``suggestions``, ``dropped`` and ``smaller``."""
    out: dict[str, Any] = {
        "config": estimate.config,
        "recipe": estimate.recipe,
        "world_size": estimate.world_size,
        "strategy": estimate.strategy,
        "per_rank": True,
        "device_memory_bytes": device_bytes,
        "margin": {"fraction": MARGIN_FRACTION, "bytes": MARGIN_BYTES, "what": MARGIN_TEXT},
        "usable_device_bytes": usable_bytes(device_bytes) if device_bytes else None,
        "device_peak_bytes": estimate.device_peak_bytes,
        "host_peak_bytes": estimate.host_peak_bytes,
        "fits": None if device_bytes is None else estimate.device_peak_bytes <= usable_bytes(device_bytes),
        "phases": [p.to_dict() for p in estimate.phases],
    }
    generator = getattr(estimate, "generator", None)
    if generator is not None:  # separate placement: each kind of rank, against its own device
        out["roles"] = {
            "training": _role(estimate.world_size, estimate.phases, device_bytes),
            "generating": _role(generator.ranks, generator.phases, device_bytes),
        }
    if advice is not None:
        out.update(advice.to_dict())
    return out


def _role(ranks: int, phases: list[Any], device_bytes: int | None) -> dict[str, Any]:
    peak = max(p.device_peak_bytes for p in phases)
    return {"ranks": ranks, "device_memory_bytes": device_bytes, "device_peak_bytes": peak,
            "host_peak_bytes": max(p.host_peak_bytes for p in phases),
            "fits": None if device_bytes is None else peak <= usable_bytes(device_bytes),
            "phases": [p.to_dict() for p in phases]}


def _gib(n: int) -> str:
    return f"{n / GiB:7.2f}"


def table(estimate: Any, device_bytes: int | None) -> str:
    generator = getattr(estimate, "generator", None)
    if generator is None:
        lines = [
            f"{estimate.config}  ({estimate.recipe}; {estimate.strategy}; world size {estimate.world_size}; "
            "GiB per rank, tracked tensor bytes)",
            *_phase_rows(estimate.phases),
        ]
    else:  # separate placement: a training rank's phases, then a generating rank's, each with its verdict
        lines = [f"{estimate.config}  ({estimate.recipe}; separate placement; GiB per rank, tracked tensor bytes)",
                 f"training ranks: {estimate.world_size} ({estimate.strategy})", *_phase_rows(estimate.phases),
                 _role_verdict("training rank", estimate.phases, device_bytes),
                 f"generating ranks: {generator.ranks} (a copy of the actor each)", *_phase_rows(generator.phases),
                 _role_verdict("generating rank", generator.phases, device_bytes)]
    peak = estimate.device_peak_bytes
    if device_bytes is not None:
        lines.append(
            f"device {device_bytes / GiB:.1f} GiB, usable {usable_bytes(device_bytes) / GiB:.2f} GiB "
            f"(margin: {MARGIN_TEXT}); peak {peak / GiB:.2f} GiB: {verdict(peak, device_bytes)}"
        )
    else:
        lines.append(f"peak {peak / GiB:.2f} GiB per rank (pass --device-memory for a verdict)")
    for note in estimate.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def _phase_rows(phases: list[Any]) -> list[str]:
    cols = ("phase", *CATEGORIES, "device peak", "host")
    rows = [cols]
    for p in phases:
        b = p.device_breakdown_bytes
        rows.append((p.phase, *(_gib(b[c]) for c in CATEGORIES), _gib(p.device_peak_bytes), _gib(p.host_peak_bytes)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = []
    for i, r in enumerate(rows):
        lines.append("  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths))))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    for p in phases:
        if p.shape:
            lines.append(f"  {p.phase}: {p.shape}")
    return lines


def _role_verdict(role: str, phases: list[Any], device_bytes: int | None) -> str:
    peak = max(p.device_peak_bytes for p in phases)
    return f"  {role}: peak {peak / GiB:.2f} GiB: {verdict(peak, device_bytes)}"


def dumps(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2)


def suggestions_text(suggestions: list[dict[str, Any]], dropped: list[dict[str, Any]] = (), *,
                     smaller: list[dict[str, Any]] | None = None, peak: int | None = None,
                     device_bytes: int | None = None) -> str:
    """The suggestions as ready-to-run commands, each with its estimated peak and cost; the
    candidates dropped for not lowering the run's ``peak``; and, when nothing fits, one line that
    says so, with the smallest way that does (``smaller``) and its command."""
    lines = ["", "suggestions (re-estimated, cheapest first; costs per rank and optimizer step):"]
    for s in suggestions:
        if "device_peak_bytes" not in s:
            lines.append(f"  cannot apply: {s['what']}: {s.get('error')}")
            continue
        verdict_text = "fits" if s.get("fits") else "still too big"
        lines.append(f"  {verdict_text} at {s['device_peak_bytes'] / GiB:.2f} GiB: {s['what']}")
        if "cost" in s:
            lines.append(f"    cost: {s['cost']['text']}")
        lines.append(f"    {s.get('command') or ' '.join(s['overrides'])}")
    if dropped:
        own = f" {peak / GiB:.2f} GiB" if peak is not None else ""
        lines.append(f"  not suggested, no lower than the config's own{own}: "
                     + "; ".join(f"{s['what']} at {s['device_peak_bytes'] / GiB:.2f} GiB" for s in dropped))
    if not any(s.get("fits") for s in suggestions) and peak is not None and device_bytes is not None:
        lines += nothing_fits_lines(suggestions, smaller, peak, device_bytes)
    return "\n".join(lines)


def nothing_fits_lines(suggestions: list[dict[str, Any]], smaller: list[dict[str, Any]] | None, peak: int,
                       device_bytes: int) -> list[str]:
    """``nothing fits ...`` in one line: the lowest peak the run reaches, and the smallest way down
    the LoRA/QLoRA ladder that fits (or, if none does, the lowest of all and the device it needs);
    then the command of the way it names."""
    lowered = [s for s in suggestions if "device_peak_bytes" in s]
    lowest = min(lowered, key=lambda s: s["device_peak_bytes"], default=None)
    reach = lowest["device_peak_bytes"] if lowest else peak
    how = "as configured"
    if lowest is not None:
        parts = lowest["what"].count(" + ") + 1
        how = f"{parts} of the above combined" if parts > 1 else lowest["what"]
    head = (f"nothing fits {device_bytes / GiB:.1f} GiB ({usable_bytes(device_bytes) / GiB:.2f} GiB usable): the"
            f" lowest this run reaches is {reach / GiB:.2f} GiB ({how})")
    ways = [s for s in smaller or [] if "device_peak_bytes" in s]
    failed = "".join(f"; cannot estimate {s['what']}: {s['error']}" for s in smaller or [] if "error" in s)
    fitting = [s for s in ways if s["fits"]]
    if fitting:
        way = fitting[0]
        return [f"{head}; the smallest way that does: {way['what']}, estimated at "
                f"{way['device_peak_bytes'] / GiB:.2f} GiB:", f"  {way['command']}"]
    low = min(ways, key=lambda s: s["device_peak_bytes"], default=None)
    if low is None or low["device_peak_bytes"] >= reach:
        tried = "; ".join(f"{s['what']} at {s['device_peak_bytes'] / GiB:.2f} GiB" for s in ways)
        rest = (f"; the smaller ways need more: {tried}" if ways
                else "; no LoRA or QLoRA way of this model to try" if smaller is not None and not failed else "")
        return [f"{head}, which needs a device of at least {device_needed(reach):.1f} GiB{rest}{failed}"]
    tried = "; ".join(f"{s['what']} at {s['device_peak_bytes'] / GiB:.2f} GiB" for s in ways)
    return [f"{head}; nor does any smaller way ({tried}){failed}; the lowest, {low['what']}, needs a device of"
            f" at least {device_needed(low['device_peak_bytes']):.1f} GiB:", f"  {low['command']}"]


def command(recipe: str, config: str, overrides: list[str]) -> str:
    """The ready-to-run line: ``python -m <recipe> fit --config <config> <overrides>``."""
    return shlex.join(["python", "-m", recipe, "fit", "--config", str(config), *overrides])
