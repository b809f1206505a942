"""Run every single-GPU tier config for a few steps on a CUDA card capped to the tier's memory, and
write the rows for docs/benchmarks.md: fits or not, peak allocated and reserved per phase beside
the estimate, batch time and tokens/s.

    python -m benchmarks.gpu.tiers --out runs/gpu                  # every configs/*/*_1x<N>gb*.yaml
    python -m benchmarks.gpu.tiers --only sft/qwen2.5 --steps 1    # a subset, one optimizer step
    python -m benchmarks.gpu.tiers --list                          # what would run, and each cap

``benchmarks/gpu/run.sh`` calls this after installing the carried wheels and running the ``gpu``
tests. Each config runs in a process of its own (``--one``, with a time limit) so that an
out-of-memory error, a crash or a hang costs that config only, and the card starts empty:

* configs whose caps fit the card together run at once (``--jobs``, default 3: an 80 GB card holds
  three 24 GB tiers, each process's CUDA context counted beside its cap); one with a paged optimizer
  (managed memory, which no cap bounds) or a tier as large as the card runs alone. Each result is
  printed as it comes, and one summary line ends the run, also when it is interrupted;
* the card is capped with ``torch.cuda.set_per_process_memory_fraction`` to the tier's memory
  (a 24 GB tier on an 80 GB card gets 24 GiB of it); a card no larger than the tier is left
  uncapped, and the row says so. The cap bounds the caching allocator only: the CUDA context
  (about 0.5 GiB) comes on top, as on a real card of that size;
* models are built at random from the architecture's ``config.json`` in ``assets/hub`` (there are
  no weights on a machine without network); the tokenizer is the tiny model's, whose ids all fall
  in any vocabulary. Memory does not depend on the weights' values;
* the data is generated to fill the config's largest micro-batch (SFT rows longer than
  ``data.max_length``, truncated to it; prompts as close to ``data.max_prompt_length`` as the
  tokenizer allows), which is the shape the estimator assumes;
* no checkpoint, no export, no validation, no ``FitCheck`` (it would estimate again, for the
  whole card): a few training steps and the ``MemoryMonitor``'s per-step and per-phase peaks.

The estimate beside each measurement is the config header's (``# estimated peak per rank``),
which the config gate (tests/estimate/test_config_gate.py) holds within 5 % of a fresh estimate.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import json
import os
import random
import re
import shutil
import statistics
import string
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from lightning_mem.estimate import recipe_config
from lightning_mem.estimate.recipe_config import RECIPES  # the recipe module of each configs/ folder

ROOT = Path(__file__).resolve().parents[2]
PAIR_RECIPES = ("dpo", "reward_model")  # their data are preference pairs
#: Every model folder a config names, under `model` (the estimator's list: each is built at random here).
MODEL_KEYS = tuple(key.removeprefix("model.") for _, key in recipe_config.MODEL_KEYS)
GiB = 1 << 30
HEADER = re.compile(r"^# estimated peak per rank \(GiB\):((?:\s+\w+=[0-9.]+)+)", re.MULTILINE)
DEFAULT_TIMEOUT_S = 540  # one config per 10-minute device command, with room for the start-up


# ---------------------------------------------------------------------------------------------
# What runs, and how large a card it sees
# ---------------------------------------------------------------------------------------------


def single_gpu_configs(configs_dir: Path = ROOT / "configs", only: list[str] | tuple[str, ...] = ()) -> list[Path]:
    """Every config whose tier is one GPU (``# tier: 1xNGB``, or ``_1xNgb`` in its name), sorted;
    with ``only``, those whose ``<recipe>/<file>`` contains one of the patterns."""
    from lightning_mem.estimate.report import tier_of

    found = []
    for path in sorted(configs_dir.glob("*/*.yaml")):
        tier = tier_of(path)
        if tier is None or tier.gpus != 1:
            continue
        if only and not any(pattern in f"{path.parent.name}/{path.name}" for pattern in only):
            continue
        found.append(path)
    return found


def cap_fraction(tier_bytes: int, total_bytes: int) -> tuple[float, str]:
    """The share of the card ``set_per_process_memory_fraction`` gets so that the run sees the
    tier's card, and the words the row says it in."""
    if tier_bytes <= 0 or total_bytes <= 0:
        raise ValueError(f"memory sizes must be positive, got tier {tier_bytes} and card {total_bytes} bytes")
    if tier_bytes >= total_bytes:
        return 1.0, (f"uncapped: the card's {total_bytes / GiB:.1f} GiB are no more than the tier's"
                     f" {tier_bytes / GiB:.0f} GiB")
    return tier_bytes / total_bytes, f"capped to {tier_bytes / GiB:.0f} of {total_bytes / GiB:.1f} GiB"


def header_estimate(path: Path) -> dict[str, float]:
    """The per-phase peaks (GiB) the config's header states; empty for a config without one."""
    match = HEADER.search(path.read_text())
    if match is None:
        return {}
    return {name: float(value) for name, value in (item.split("=") for item in match.group(1).split())}


def needs_missing_package(config: dict[str, Any]) -> str | None:
    """The package a config needs that this environment lacks (DeepSpeed has no wheel to carry)."""
    strategy = (config.get("trainer") or {}).get("strategy")
    path = strategy.get("class_path", "") if isinstance(strategy, dict) else str(strategy or "")
    if "ZeroStrategy" in path and importlib.util.find_spec("deepspeed") is None:
        return "deepspeed"
    return None


# ---------------------------------------------------------------------------------------------
# Models and data a machine without network can build
# ---------------------------------------------------------------------------------------------


def config_only_model(name_or_path: str, workdir: Path) -> str:
    """A folder the recipe builds the model from at random. A hub id becomes its shipped
    ``assets/hub/<id>/config.json`` beside the tiny model's tokenizer; anything else (a local
    folder) is returned as it is."""
    from lightning_mem.assets import HUB_ASSETS, TINY_MODEL

    source = HUB_ASSETS / name_or_path
    if not (source / "config.json").is_file():
        if (ROOT / name_or_path).expanduser().is_dir():
            return name_or_path  # a local folder (a tiny config's): the recipe reads it as in any run
        raise FileNotFoundError(f"no config.json is shipped for the hub id {name_or_path!r} (looked in {source})")
    target = workdir / "models" / name_or_path.replace("/", "--")
    target.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        if (source / name).is_file():
            shutil.copy(source / name, target / name)
    for file in TINY_MODEL.iterdir():
        if file.name != "config.json":
            shutil.copy(file, target / file.name)
    return str(target)


def _words(rng: random.Random, count: int) -> str:
    return " ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 8))) for _ in range(count))


def sft_rows(count: int, max_length: int, tokenizer: Any, *, seed: int = 0) -> list[dict[str, str]]:
    """``count`` prompt/completion rows, each longer than ``max_length`` tokens, so that every
    one is truncated to exactly ``max_length`` with its loss on the completion."""
    from lightning_mem.data.chat import row_to_messages
    from lightning_mem.data.sft import tokenize_example

    rng = random.Random(seed)
    words = max(1, max_length // 4)
    while True:  # long enough for this tokenizer (checked on one row, with a margin for the rest)
        row = {"prompt": "Repeat after me.", "completion": _words(rng, words)}
        example, truncated = tokenize_example(row_to_messages(row), tokenizer, max_length)
        if truncated and example is not None:
            break
        words *= 2
    return [{"prompt": "Repeat after me.", "completion": _words(rng, words * 3 // 2)} for _ in range(count)]


def prompt_rows(count: int, max_prompt_length: int, tokenizer: Any, *, system_prompt: str | None = None,
                seed: int = 0) -> list[dict[str, str]]:
    """``count`` prompts of as many tokens as fit ``max_prompt_length`` (the system prompt and the
    chat template included): the rollout's prefill at the size the config allows."""
    from lightning_mem.data.chat import encode_prompt, row_to_prompt_messages

    rng = random.Random(seed)

    def length(text: str) -> int:
        row = {"prompt": text, **({"system": system_prompt} if system_prompt else {})}
        return len(encode_prompt(row_to_prompt_messages(row), tokenizer))

    rows = []
    words = max_prompt_length
    for _ in range(count):
        pool = _words(rng, max_prompt_length).split()
        low, high = 1, min(words * 2, len(pool))  # the most words that fit, by bisection
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if length(" ".join(pool[:mid])) <= max_prompt_length else (low, mid - 1)
        words = low
        rows.append({"prompt": " ".join(pool[:low]), "answer": "0"})
    return rows


def _write_jsonl(rows: list[dict[str, Any]], path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def overrides_for(path: Path, workdir: Path, steps: int) -> list[str]:
    """The recipe CLI overrides that turn a tier config into a few measured steps on this machine
    (models at random, generated data, no checkpoint/export/validation, the probe added)."""
    from lightning_mem.models import load_tokenizer

    config = yaml.safe_load(path.read_text())
    recipe, name = path.parent.name, f"{path.parent.name}--{path.stem}"
    model, data, trainer = config.get("model") or {}, config.get("data") or {}, config.get("trainer") or {}
    args = [
        f"--trainer.default_root_dir={workdir / 'runs' / name}",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.limit_val_batches=0",
        "--checkpoint.save_last=false",
        "--checkpoint.every_n_train_steps=0",
        "--model.export_dir=null",
    ]
    tokenizer_folder = None
    for key in MODEL_KEYS:
        value = model
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if isinstance(value, str) and value:
            folder = config_only_model(value, workdir)
            args.append(f"--model.{key}={folder}")
            tokenizer_folder = tokenizer_folder or folder
        elif isinstance(value, list) and value:  # a reward-model ensemble: each member alike
            folders = [config_only_model(member, workdir) for member in value]
            args.append(f"--model.{key}={json.dumps(folders)}")
            tokenizer_folder = tokenizer_folder or folders[0]
    if tokenizer_folder is not None and not Path(tokenizer_folder).is_absolute():
        tokenizer_folder = str(ROOT / tokenizer_folder)  # the tiny configs' relative folders
    tokenizer = load_tokenizer(tokenizer_folder or str(ROOT / "assets" / "tiny-llama"))
    files = workdir / "data" / name
    if recipe == "ppo":
        batch = int(data.get("batch_size") or 1)
        rows = prompt_rows(batch * (steps + 1), int(data.get("max_prompt_length") or 512), tokenizer,
                           system_prompt=data.get("system_prompt"))
        batches = steps
    else:
        max_length = int(data.get("max_length") or 1024)
        per_batch = max(1, int(data.get("max_tokens_per_batch") or 0) // max_length) or int(data.get("batch_size") or 1)
        accumulate = int(trainer.get("accumulate_grad_batches") or 1)
        rows = sft_rows(2 * steps * accumulate * per_batch + 8, max_length, tokenizer)
        if recipe in PAIR_RECIPES:  # two rows make a pair whose sides are each truncated to max_length
            rows = [{"prompt": a["prompt"], "chosen": a["completion"], "rejected": b["completion"]}
                    for a, b in zip(rows[::2], rows[1::2])]
        batches = steps * accumulate
        args.append("--data.val_file=null")
    args.append(f"--data.train_file={_write_jsonl(rows, files / ('prompts.jsonl' if recipe == 'ppo' else 'train.jsonl'))}")
    # One epoch cut to the batches wanted; max_steps stays the config's, so its LR schedule (its
    # warm-up and decay span max_steps) is the one the config runs.
    args += ["--trainer.max_epochs=1", f"--trainer.limit_train_batches={batches}"]
    callbacks = [c for c in trainer.get("callbacks") or [] if "FitCheck" not in str(c.get("class_path", c) if isinstance(c, dict) else c)]
    if not any("MemoryMonitor" in str(c) for c in callbacks):
        callbacks.append({"class_path": "lightning_mem.callbacks.MemoryMonitor"})
    callbacks.append({"class_path": "benchmarks.gpu.probe.TierProbe"})
    args.append(f"--trainer.callbacks={json.dumps(callbacks)}")
    return args


# ---------------------------------------------------------------------------------------------
# One config, in this process
# ---------------------------------------------------------------------------------------------


def phase_peaks(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per MemoryMonitor phase (``step`` for the step samples): how many samples, and the peak
    allocated and reserved bytes over them (None where the device has no such counter: CPU)."""
    peaks: dict[str, dict[str, Any]] = {}
    for row in rows:
        name = row["phase"] if row["event"] == "phase" else "step"
        entry = peaks.setdefault(name, {"samples": 0, "allocated": None, "reserved": None})
        entry["samples"] += 1
        for key, metric in (("allocated", "device_peak_allocated_bytes"), ("reserved", "device_peak_reserved_bytes")):
            if metric in row:
                entry[key] = max(entry[key] or 0, int(row[metric]))
    return peaks


def batch_speed(batches: list[dict[str, Any]]) -> dict[str, Any]:
    """Median seconds per training batch and tokens per second, the first batch left out when there
    are more (it pays for warm-up: kernels, the optimizer state's first allocation)."""
    if not batches:
        return {"batches": 0, "median_s": None, "tokens_per_s": None, "tokens_kind": None}
    timed = batches[1:] if len(batches) > 1 else batches
    seconds = sum(b["seconds"] for b in timed)
    rollout = [b["rollout_tokens_per_s"] for b in timed if "rollout_tokens_per_s" in b]
    phases = sorted({name for b in timed for name in b.get("phase_s", {})})
    return {
        "phase_s": {name: statistics.median(b["phase_s"].get(name, 0.0) for b in timed) for name in phases},
        "batches": len(batches),
        "median_s": statistics.median(b["seconds"] for b in timed),
        "tokens_per_s": sum(b["tokens"] for b in timed) / seconds if seconds > 0 else None,
        "tokens_kind": timed[-1]["tokens_kind"],
        "rollout_tokens_per_s": statistics.median(rollout) if rollout else None,
    }


def run_one(path: Path, workdir: Path, steps: int) -> dict[str, Any]:
    """Run ``path`` for ``steps`` steps in this process, capped to its tier on CUDA; the result
    (outcome, per-phase peaks, batch times) as a JSON-able dict. An out-of-memory error is an
    outcome, not a failure of this function."""
    import torch

    from benchmarks.gpu.probe import TierProbe
    from lightning_mem.estimate.report import tier_of

    path = Path(path).resolve()
    tier = tier_of(path)
    result: dict[str, Any] = {
        "config": _shown(path),
        "tier": f"{tier.gpus}x{tier.memory_gb}GB" if tier else None,
        "steps": steps,
        "estimate_gib": header_estimate(path),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "cap": None,
    }
    if torch.cuda.is_available() and tier is not None:
        fraction, result["cap"] = cap_fraction(tier.memory_bytes, torch.cuda.get_device_properties(0).total_memory)
        torch.cuda.set_per_process_memory_fraction(fraction, 0)
    start = time.perf_counter()
    try:
        args = ["fit", "--config", str(path), *overrides_for(path, workdir, steps)]
        importlib.import_module(RECIPES[path.parent.name]).main(args)
        result["outcome"] = "fits"
    except torch.OutOfMemoryError as err:
        result["outcome"], result["error"] = "out of memory", str(err).splitlines()[0]
    except Exception as err:  # noqa: BLE001 - any failure is this config's row, said as it is
        result["outcome"], result["error"] = "error", f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    result["wall_s"] = time.perf_counter() - start
    probe = TierProbe.instances[-1] if TierProbe.instances else None
    result["phases"] = phase_peaks(probe.memory_rows) if probe else {}
    result["speed"] = batch_speed(probe.batches) if probe else batch_speed([])
    return result


# ---------------------------------------------------------------------------------------------
# Rows for docs/benchmarks.md
# ---------------------------------------------------------------------------------------------


def _gib(value: Any) -> str:
    return "n/a" if value is None else f"{value / GiB:.2f}"


def measured_phase(result: dict[str, Any], phase: str) -> dict[str, Any] | None:
    """The measured peaks of an estimated ``phase``: the MemoryMonitor phase of that name, else
    the step samples (a recipe that names no phases runs its whole step as its one phase)."""
    phases = result.get("phases") or {}
    return phases.get(phase) or (phases.get("step") if len(result.get("estimate_gib") or {}) <= 1 else None)


def table_rows(result: dict[str, Any]) -> list[str]:
    """One markdown row per estimated phase (and per measured phase the estimate has not: the
    vLLM engine's transitions), config and outcome on each."""
    estimate = result.get("estimate_gib") or {}
    measured = result.get("phases") or {}
    names = list(estimate) or [n for n in measured if n != "step"] or ["step"]
    names += [n for n in measured if n not in names and n != "step" and n not in estimate]
    speed = result.get("speed") or {}
    outcome = result.get("outcome", "?")
    if result.get("error"):
        outcome += f" ({result['error'][:120]})"
    cap = result.get("cap") or "no cap"
    if result.get("beside"):  # its batch times shared the card's compute
        cap += f", beside {result['beside']} other run(s)"
    batch_s = "n/a" if speed.get("median_s") is None else f"{speed['median_s']:.2f}"
    tokens = "n/a" if speed.get("tokens_per_s") is None else f"{speed['tokens_per_s']:,.0f} {speed['tokens_kind']}"
    if speed.get("rollout_tokens_per_s") is not None:
        tokens += f" (rollout {speed['rollout_tokens_per_s']:,.0f})"
    rows = []
    for name in names:
        peak = measured_phase(result, name) if name in estimate else measured.get(name)
        allocated, reserved = (peak or {}).get("allocated"), (peak or {}).get("reserved")
        est = estimate.get(name)
        ratio = "n/a" if est is None or allocated is None else f"{allocated / GiB / est:.2f}"
        rows.append(
            f"| `{result['config']}` | {result.get('tier') or 'none'}, {cap} | {outcome} | {name} | "
            f"{'n/a' if est is None else f'{est:.2f}'} | {_gib(allocated)} | {_gib(reserved)} | {ratio} | "
            f"{batch_s} | {tokens} |"
        )
    return rows


TABLE_HEAD = (
    "| config | tier, cap | outcome | phase | estimate GiB | peak allocated GiB | peak reserved GiB "
    "| allocated / estimate | batch s (median) | tokens/s |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
)


def markdown(results: list[dict[str, Any]], *, date: str, device: str, command: str, versions: str) -> str:
    """The section for docs/benchmarks.md: when, on what, with which command, then the table."""
    lines = [
        f"GPU tier runs, {date}, {device} ({versions}); command: `{command}`. Each config ran a few steps"
        " in a process of its own with the card capped to its tier (`set_per_process_memory_fraction`;"
        " the CUDA context is outside the cap), models at random from `assets/hub` configs, generated data"
        " filling the largest micro-batch. Estimate: the config header's (tracked tensor bytes). Peaks:"
        " `MemoryMonitor` (max over the run's steps). Batch time: median of the training batches after"
        " the first; tokens/s: `input` = non-padding tokens fed, `generated` = PPO response tokens per"
        " second of the whole step (in brackets: of its rollout alone). Configs whose caps fit the card"
        " together ran at once (`--jobs`); such a row says `beside N other run(s)`, and its times shared"
        " the card's compute (rerun with `--jobs 1` for clean timings).",
        "",
        TABLE_HEAD,
    ]
    for result in results:
        lines += table_rows(result)
    lines += phase_time_rows(results)
    return "\n".join(lines) + "\n"


def phase_time_rows(results: list[dict[str, Any]]) -> list[str]:
    """A PPO step's time by phase (median over the batches after the first): seconds and share of
    the step, and the rollout's generated tokens/s. Empty when no config logged phase times."""
    rows = []
    for result in results:
        speed = result.get("speed") or {}
        phases, step = speed.get("phase_s") or {}, speed.get("median_s")
        if not phases or not step:
            continue
        parts = ", ".join(f"{name} {seconds:.2f} s ({seconds / step:.0%})" for name, seconds in phases.items())
        rate = speed.get("rollout_tokens_per_s")
        rows.append(f"| {result['config']} | {step:.2f} | {parts} | {'n/a' if rate is None else f'{rate:,.0f}'} |")
    if not rows:
        return []
    return ["", "Each PPO step by phase (median seconds, share of the step's median):", "",
            "| config | step s | phases | rollout generated tokens/s |", "|---|---|---|---|", *rows]


# ---------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------


def _shown(path: Path) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


class _Child:
    """One config's process (``--one``): started, polled, and read back (or said how it ended)."""

    def __init__(self, path: Path, workdir: Path, steps: int, timeout_s: float, *, beside: int = 0) -> None:
        self.path, self.timeout_s, self.beside = path, timeout_s, beside
        name = f"{path.parent.name}--{path.stem}"
        self.result_file = workdir / "results" / f"{name}.json"
        self.result_file.parent.mkdir(parents=True, exist_ok=True)
        self.result_file.unlink(missing_ok=True)
        self.log = workdir / "logs" / f"{name}.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "benchmarks.gpu.tiers", "--one", str(path), "--workdir", str(workdir),
               "--steps", str(steps), "--result", str(self.result_file)]
        self._out = open(self.log, "w")  # noqa: SIM115 - closed in result()
        self.start = time.perf_counter()
        self.process = subprocess.Popen(cmd, cwd=ROOT, stdout=self._out, stderr=subprocess.STDOUT)

    def done(self) -> bool:
        if self.process.poll() is not None:
            return True
        if time.perf_counter() - self.start > self.timeout_s:
            self.process.kill()
            self.process.wait()
            self.timed_out = True
            return True
        return False

    timed_out = False

    def result(self) -> dict[str, Any]:
        self._out.close()
        path = self.path
        if self.timed_out:
            result = {"config": _shown(path), "outcome": f"timed out after {self.timeout_s:.0f} s",
                      "estimate_gib": header_estimate(path)}
        elif self.result_file.is_file():
            result = json.loads(self.result_file.read_text())
        else:  # the process ended before writing its result: a crash from C, or a kill
            tail = self.log.read_text(errors="replace").strip().splitlines()[-1:] if self.log.is_file() else []
            code = self.process.returncode
            how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            result = {"config": _shown(path), "outcome": "crashed", "error": f"{how}: {' '.join(tail)}",
                      "estimate_gib": header_estimate(path)}
        result["beside"] = self.beside
        return result


def _child(path: Path, workdir: Path, steps: int, timeout_s: float) -> dict[str, Any]:
    child = _Child(path, workdir, steps, timeout_s)
    while not child.done():
        time.sleep(1)
    return child.result()


# ---------------------------------------------------------------------------------------------
# Several configs on one card at once
# ---------------------------------------------------------------------------------------------

#: Per process, outside the cap: the CUDA context and loaded kernels (about 0.5 GiB seen on an
#: H100 with torch 2.11), counted at 1 GiB so that the caps and contexts together stay inside the card.
CONTEXT_BYTES = 1 << 30


def runs_alone(path: Path, tier_bytes: int | None, total_bytes: int | None) -> str | None:
    """Why a config must have the card to itself (None: it may share it).

    A paged optimizer's state is managed memory, which ``set_per_process_memory_fraction`` does not
    cap: asking for more than the card has free can hang the GPU, not only the process (GPU.md). A
    config whose tier is the whole card (or unknown) has nothing to share it with.
    """
    if "Paged" in path.read_text():
        return "paged optimizer state (managed memory is outside the cap)"
    if tier_bytes is None or total_bytes is None or tier_bytes >= total_bytes:
        return "its tier is the whole card"
    return None


def fits_beside(running: list[int], tier_bytes: int, total_bytes: int) -> bool:
    """Whether a process capped to ``tier_bytes`` fits next to processes capped to ``running``."""
    # every capped process's context, and the driver's own (it asked the card for its size)
    return sum(running) + tier_bytes + CONTEXT_BYTES * (len(running) + 2) <= total_bytes


def _versions() -> str:
    import torch

    import lightning_mem

    return f"torch {torch.__version__}, lightning-mem {lightning_mem.__version__}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu.tiers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "runs" / "gpu"),
                        help="where gpu_tiers.md/.json and each run's memory.csv/png go (default: $OUT, else runs/gpu)")
    parser.add_argument("--only", action="append", default=[], help="run configs whose <recipe>/<file> contains this (repeatable)")
    parser.add_argument("--config", action="append", type=Path, default=[],
                        help="run this config instead (repeatable; in a configs/<recipe>/ folder, any tier)")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps (SFT, QLoRA) or PPO steps per config")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per config before it is stopped")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/lightning_mem_gpu"), help="models, data and runs")
    parser.add_argument("--jobs", type=int, default=3,
                        help="configs run at once where their caps fit the card together (1: one at a time, for"
                             " clean timings; default 3: an 80 GB card holds three 24 GB tiers)")
    parser.add_argument("--list", action="store_true", help="print the configs and the cap each would get; run nothing")
    parser.add_argument("--one", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.one is not None:  # the child: one config, its result as JSON
        result = run_one(args.one, args.workdir, args.steps)
        args.result.write_text(json.dumps(result, indent=1))
        return 0
    return _drive(args)


def _drive(args: argparse.Namespace) -> int:
    import torch

    from lightning_mem.estimate.report import tier_of

    configs = [p.resolve() for p in args.config] or single_gpu_configs(only=args.only)
    unknown = [str(p) for p in configs if p.parent.name not in RECIPES or not p.is_file()]
    if unknown:
        print(f"--config: {unknown} is not a file in a configs/<{'|'.join(RECIPES)}>/ folder", file=sys.stderr)
        return 2
    if not configs:
        print(f"no single-GPU tier config matches {args.only}", file=sys.stderr)
        return 2
    total = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    device = torch.cuda.get_device_name(0) if total else "no CUDA device"
    if args.list:
        for path in configs:
            tier = tier_of(path)
            cap = cap_fraction(tier.memory_bytes, total)[1] if total and tier else "no cap (no CUDA device or no tier)"
            print(f"{_shown(path)}: {cap}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    command = "benchmarks/gpu/run.sh " + " ".join(sys.argv[1:])
    date = datetime.date.today().isoformat()
    results: list[dict[str, Any]] = []
    queue = list(enumerate(configs, 1))
    running: dict[int, tuple[_Child, int, bool]] = {}  # index -> (child, capped bytes, alone)
    finished = 0

    def record(index: int, path: Path, result: dict[str, Any], seconds: float) -> None:
        nonlocal finished
        finished += 1
        results.append(result)
        _keep_run_files(path, args.workdir, args.out)
        (args.out / "gpu_tiers.json").write_text(json.dumps(results, indent=1))
        (args.out / "gpu_tiers.md").write_text(
            markdown(results, date=date, device=device, command=command, versions=_versions()))
        shared = f", beside {result['beside']} other run(s)" if result.get("beside") else ""
        print(f"[{finished}/{len(configs)}] {path.parent.name}/{path.name}: {result.get('outcome')}"
              f" in {seconds:.0f} s{shared}", flush=True)

    try:
        while queue or running:
            for index, child_info in list(running.items()):
                child = child_info[0]
                if child.done():
                    del running[index]
                    record(index, child.path, child.result(), time.perf_counter() - child.start)
            started = _start_what_fits(queue, running, args, total)
            if not started and (queue or running):
                time.sleep(1)
        print((args.out / "gpu_tiers.md").read_text())
    finally:  # an interrupted driver still says what it saw; the summary is the last line
        for child, _, _ in running.values():
            child.process.kill()
        print(summary(results, len(configs)), flush=True)
    return 0


def _start_what_fits(queue: list[tuple[int, Path]], running: dict[int, tuple[_Child, int, bool]],
                     args: argparse.Namespace, total: int | None) -> bool:
    """Start every queued config that fits beside the running ones (in order; one that must run
    alone waits for an empty card, and nothing starts beside it). Skipped configs are recorded at once."""
    from lightning_mem.estimate.report import tier_of

    started = False
    for item in list(queue):
        index, path = item
        if any(alone for _, _, alone in running.values()):
            break
        missing = needs_missing_package(yaml.safe_load(path.read_text()))
        if missing:
            queue.remove(item)
            child = _Skipped(path, f"skipped: needs {missing}")
            running[index] = (child, 0, False)
            started = True
            continue
        tier = tier_of(path)
        tier_bytes = tier.memory_bytes if tier is not None else None
        alone = runs_alone(path, tier_bytes, total) is not None or args.jobs == 1
        if running and (alone or len(running) >= args.jobs
                        or not fits_beside([b for _, b, _ in running.values()], tier_bytes, total)):
            if alone:
                break  # it waits for the card to empty; the order is kept
            continue
        queue.remove(item)
        child = _Child(path, args.workdir, args.steps, args.timeout, beside=len(running))
        running[index] = (child, tier_bytes or 0, alone)
        started = True
    return started


class _Skipped:
    """A config that does not run here, recorded as a child that is done at once."""

    def __init__(self, path: Path, outcome: str) -> None:
        self.path, self.outcome, self.start = path, outcome, time.perf_counter()

    def done(self) -> bool:
        return True

    def result(self) -> dict[str, Any]:
        return {"config": _shown(self.path), "outcome": self.outcome, "estimate_gib": header_estimate(self.path)}

    class process:  # noqa: N801 - the part of Popen the driver's cleanup uses
        @staticmethod
        def kill() -> None:
            return None


def summary(results: list[dict[str, Any]], planned: int) -> str:
    """One line: how many configs ran and what came of them."""
    outcomes: dict[str, int] = {}
    for result in results:
        key = str(result.get("outcome", "?")).split(" after ")[0].split(":")[0]
        outcomes[key] = outcomes.get(key, 0) + 1
    ran = f"{len(results)} of {planned} configs" if len(results) < planned else f"{planned} configs"
    return f"tier configs: {ran}: " + (", ".join(f"{n} {k}" for k, n in outcomes.items()) or "none ran")


def _keep_run_files(path: Path, workdir: Path, out: Path) -> None:
    # The memory timeline and samples come back with the rows (the runs themselves stay in workdir).
    name = f"{path.parent.name}--{path.stem}"
    target = out / "runs" / name
    for file in (workdir / "runs" / name).glob("**/memory*.*"):
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy(file, target / file.name)
    log = workdir / "logs" / f"{name}.log"
    if log.is_file():
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy(log, target / "run.log")


if __name__ == "__main__":
    sys.exit(main())
