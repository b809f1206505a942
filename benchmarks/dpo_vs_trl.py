"""DPO step time and peak RSS: the DPO recipe beside TRL's DPOTrainer on the same batches, on CPU.

    # TRL lives in a venv of its own (a comparison only, never a dependency of the package):
    python3 -m venv /work/venv-trl
    /work/venv-trl/bin/pip install torch==2.13.0       # the CPU build (on this machine: from local disk)
    /work/venv-trl/bin/pip install trl==1.16.0
    # then, with the project's venv:
    python benchmarks/dpo_vs_trl.py --trl-python /work/venv-trl/bin/python --rounds 3

Both sides train the Qwen2.5-0.5B-Instruct architecture (``--model``, a config folder) from the
same seeded random weights, written once to ``--work-dir`` (with the tiny tokenizer beside them,
which TRL wants as its ``processing_class``; every token id is given, none is tokenized), on the
same ``--pairs`` preference pairs of random token ids (``--prompt-tokens`` of prompt, then
``--completion-tokens`` of chosen or of rejected completion), one micro-batch of all of them per
step, replayed every step. Same objective (sigmoid, beta 0.1), precision (``bf16-true``: weights,
gradients and AdamW state in bf16; or ``32-true``), optimizer (torch AdamW, fused by default as in
TRL's default ``optim``, weight decay 0, constant learning rate ``--lr``), clipping (norm 1.0), no
activation checkpointing (TRL's default turns it on: ``gradient_checkpointing=False`` here), no
dropout (both sides' default).

- **ours**: ``recipes.dpo.DPOModule`` fitted by a Lightning ``Trainer`` (its ``training_step`` and
  reference, Lightning's backward, clipping and optimizer step), fed by a data module that yields
  the pairs in the preference batch layout, collated by ``lightning_mem.data.PairCollator``.
  Reference ``copy`` (a resident frozen copy) or ``precompute`` (one pass before the first step,
  then no reference; the disk cache is not used, so each run does the pass).
- **trl**: ``trl.DPOTrainer`` with ``DPOConfig``; the reference resident (TRL's default, a second
  model loaded from the same folder) or ``precompute_ref_log_probs=True``. The pairs arrive as
  ``prompt_ids``/``chosen_ids``/``rejected_ids`` columns, so the dataset's tokenizing map is
  skipped (``_prepare_dataset`` returns them as they are); everything from the collator on is
  TRL's own.

Each run is a fresh process of its own interpreter (TRL's venv for TRL), one at a time, the sides
and reference modes interleaved round by round (ours copy, TRL resident, ours precompute, TRL
precompute, ...), so the machine's load falls on all alike. A run times each optimizer step as the
interval between two step starts (Lightning's ``on_train_batch_start``, the HF Trainer's
``on_step_begin``), drops the first ``--warmup`` intervals, and reports their median; its peak RSS
twice, from the kernel's high-water mark: the whole process (loading included) and the training
steps alone (the mark is reset at the first step's start, ``/proc/self/clear_refs``). Each run also
scores the pairs once before its first step (no gradients) and reports the per-sequence summed
completion log-probs, and reports the loss of every step: on step 1 the policy is the reference
(ln 2), and the log-probs of both sides must agree, to be sure the two compute the same thing.
Beside the wall time, the process's CPU time per step (all threads: on a machine shared with other
jobs, the work done, less the load's share of the clock).

``--trace-rss`` samples the resident memory every 10 ms and reports each step's peak per phase
(forward; backward, TRL's clipping included; clipping and optimizer step, ours; the rest) above the
step's starting RSS. ``--mmap-threshold`` fixes glibc's mmap threshold in each run
(``MALLOC_MMAP_THRESHOLD_``): every larger block is then returned to the system when freed, so RSS
follows the live bytes, not what the allocator's heap happens to keep.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SIDES = {"ours": ("copy", "precompute"), "trl": ("resident", "precompute")}


# ---------------------------------------------------------------------------------------------
# What both sides read: the weights folder and the pairs (written by the driver, the project's venv)
# ---------------------------------------------------------------------------------------------


def make_weights(config_folder: str, work_dir: Path, seed: int) -> Path:
    """Seeded random fp32 weights of ``config_folder``'s architecture, with the tiny tokenizer, once."""
    import hashlib

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    text = (Path(config_folder) / "config.json").read_bytes()
    target = work_dir / f"weights-{hashlib.sha256(text + f'seed={seed}'.encode()).hexdigest()[:12]}"
    if (target / "model.safetensors").exists():
        return target
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_folder), dtype=torch.float32)
    tmp = target.with_name(target.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(ROOT / "assets/tiny-llama")).save_pretrained(tmp)
    os.replace(tmp, target)
    return target


def make_pairs(count: int, prompt: int, completion: int, vocab: int, seed: int) -> list[dict[str, list[int]]]:
    """``count`` pairs of random token ids: a prompt, and chosen and rejected completions that differ."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    draw = lambda n: torch.randint(3, vocab, (n,), generator=generator).tolist()  # noqa: E731
    return [{"prompt_ids": draw(prompt), "chosen_ids": draw(completion), "rejected_ids": draw(completion)}
            for _ in range(count)]


# ---------------------------------------------------------------------------------------------
# Inside a worker: the clock and the memory marks (stdlib only: both interpreters run this)
# ---------------------------------------------------------------------------------------------


class Marks:
    """Step starts, the process's peak RSS before the first step, and the training steps' peak."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.cpu_starts: list[float] = []  # the process's CPU time, all threads: the work, less the load's share
        self.load_peak_kb = self.first_step_kb = 0
        self.phases: list[tuple[str, float]] = []
        self.trace: list[tuple[float, int]] = []
        self.imports_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # made after the imports

    def step_start(self) -> None:
        if not self.starts:  # the first step: what came before (loads, a precompute) is its own peak
            self.load_peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            self.first_step_kb = _rss_kb()
            Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark (Linux >= 4.0)
        self.starts.append(time.perf_counter())
        self.cpu_starts.append(time.process_time())

    def phase(self, name: str) -> None:
        """A point inside a step (forward done, backward done, optimizer done), for the RSS trace."""
        self.phases.append((name, time.perf_counter()))

    def sample(self, period: float = 0.01) -> None:
        """Sample the resident memory every ``period`` seconds in a daemon thread, from the first step on."""
        import threading

        def loop() -> None:
            while True:
                if self.starts:
                    self.trace.append((time.perf_counter(), _rss_kb()))
                time.sleep(period)

        threading.Thread(target=loop, daemon=True).start()

    def by_phase(self) -> list[dict[str, float]]:
        """Each step's sampled RSS peak per phase, in GiB above the RSS at that step's start."""
        marks = sorted([("start", t) for t in self.starts] + self.phases, key=lambda m: m[1])
        steps: list[dict[str, float]] = []
        for (name, t0), (_, t1) in zip(marks, marks[1:]):
            if name == "start":
                base = next((kb for t, kb in self.trace if t >= t0), 0)
                steps.append({})
            inside = [kb for t, kb in self.trace if t0 <= t < t1]
            if steps and inside:
                label = {"start": "forward", "forward": "backward", "backward": "optimizer", "optimizer": "rest"}[name]
                steps[-1][label] = round((max(inside) - base) / 2**20, 3)
                steps[-1].setdefault("base", round(base / 2**20, 3))
        return steps

    def result(self, warmup: int) -> dict[str, Any]:
        train_peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # since the reset
        intervals = [b - a for a, b in zip(self.starts, self.starts[1:])]
        cpu = [b - a for a, b in zip(self.cpu_starts, self.cpu_starts[1:])]
        return {"step_s": intervals[warmup:], "warmup_s": intervals[:warmup], "step_cpu_s": cpu[warmup:],
                "train_peak_rss_gib": train_peak_kb / 2**20, "imports_rss_gib": self.imports_kb / 2**20,
                "first_step_rss_gib": self.first_step_kb / 2**20, "rss_by_phase": self.by_phase(),
                "process_peak_rss_gib": max(train_peak_kb, self.load_peak_kb) / 2**20}


def _rss_kb() -> int:
    """Resident memory now (VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _load_average() -> float:
    return os.getloadavg()[0]


# ---------------------------------------------------------------------------------------------
# ours: the DPO recipe's module under a Lightning Trainer
# ---------------------------------------------------------------------------------------------


def run_ours(args: argparse.Namespace, pairs: list[dict[str, list[int]]]) -> dict[str, Any]:
    sys.path.insert(0, args.code)
    import functools
    import tempfile

    import torch
    from lightning.pytorch import Callback, LightningDataModule, Trainer, seed_everything
    from torch.utils.data import DataLoader

    from lightning_mem.data.preference import PairCollator
    from recipes.dpo import DPOModule

    def side(p: dict[str, list[int]], name: str) -> tuple[list[int], list[int]]:
        return p["prompt_ids"] + p[f"{name}_ids"], [-100] * len(p["prompt_ids"]) + p[f"{name}_ids"]

    rows = []
    for index, p in enumerate(pairs):
        (chosen, chosen_labels), (rejected, rejected_labels) = side(p, "chosen"), side(p, "rejected")
        rows.append({"chosen_ids": chosen, "chosen_labels": chosen_labels, "rejected_ids": rejected,
                     "rejected_labels": rejected_labels, "pair_index": index, "margin": 0.0})
    batch = PairCollator(pad_token_id=0)(rows)
    # One micro-batch per optimizer step: the step's totals are this batch's (the sampler's job in a run).
    batch["step_pairs"] = torch.tensor(len(rows))
    batch["step_chosen_tokens"] = torch.tensor(sum(len(p["chosen_ids"]) for p in pairs))

    class Pairs(LightningDataModule):
        """The same micro-batch every step, and the in-order pass ``precompute`` makes first."""

        train_set = rows  # len(): the kept pairs

        def train_dataloader(self) -> Any:
            return DataLoader([dict(batch) for _ in range(args.steps)], batch_size=None, collate_fn=lambda b: b)

        def reference_loader(self, name: str = "train", *, num_replicas: int = 1, rank: int = 0) -> Any:
            return [dict(batch)]

    marks = Marks()
    if args.trace_rss:
        marks.sample()
    losses: list[float] = []
    logps: list[float] = []

    class Clock(Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            with torch.no_grad():  # step 0's policy: what the reference is
                logps.extend(module.sequence_logps(module.model, batch).tolist())

        def on_train_batch_start(self, *args: Any) -> None:
            marks.step_start()

        def on_before_backward(self, *rest: Any) -> None:
            marks.phase("forward")

        def on_after_backward(self, *rest: Any) -> None:
            marks.phase("backward")

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, *rest: Any) -> None:
            marks.phase("optimizer")
            losses.append(float(outputs["loss"]))

    seed_everything(args.seed, verbose=False)
    fused = {"fused": True} if args.fused else {}
    optimizer = functools.partial(torch.optim.AdamW, lr=args.lr, weight_decay=0.0, **fused)
    module = DPOModule(name_or_path=args.weights, optimizer=optimizer, export_dir=None,
                       dpo={"loss_type": "sigmoid", "beta": args.beta}, reference={"mode": args.reference})
    with tempfile.TemporaryDirectory() as root:
        trainer = Trainer(accelerator="cpu", devices=1, precision=args.precision, max_steps=args.steps,
                          gradient_clip_val=1.0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False, num_sanity_val_steps=0, callbacks=[Clock()], default_root_dir=root)
        trainer.fit(module, datamodule=Pairs())
    return {**marks.result(args.warmup), "losses": losses, "logps": logps}


# ---------------------------------------------------------------------------------------------
# trl: DPOTrainer (run by the TRL venv's interpreter)
# ---------------------------------------------------------------------------------------------


def run_trl(args: argparse.Namespace, pairs: list[dict[str, list[int]]]) -> dict[str, Any]:
    import tempfile

    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    class PreTokenized(DPOTrainer):
        """DPOTrainer on pairs given as token ids: its tokenizing map is skipped, nothing else."""

        def _prepare_dataset(self, dataset: Any, *rest: Any, **kwargs: Any) -> Any:
            return dataset

        def compute_loss(self, *rest: Any, **kwargs: Any) -> Any:
            out = super().compute_loss(*rest, **kwargs)
            if self.model.training:
                marks.phase("forward")
            return out

    marks = Marks()
    if args.trace_rss:
        marks.sample()

    class Clock(TrainerCallback):
        def on_step_begin(self, *rest: Any, **kwargs: Any) -> None:
            marks.step_start()

        def on_pre_optimizer_step(self, *rest: Any, **kwargs: Any) -> None:
            marks.phase("backward")

        def on_step_end(self, *rest: Any, **kwargs: Any) -> None:
            marks.phase("optimizer")

    dtype = {"bf16-true": "bfloat16", "32-true": "float32"}[args.precision]
    with tempfile.TemporaryDirectory() as out:
        config = DPOConfig(
            output_dir=out, use_cpu=True, seed=args.seed, per_device_train_batch_size=len(pairs), max_steps=args.steps,
            learning_rate=args.lr, lr_scheduler_type="constant", weight_decay=0.0,
            optim="adamw_torch_fused" if args.fused else "adamw_torch", max_grad_norm=1.0,
            bf16=False, fp16=False, model_init_kwargs={"dtype": dtype},  # the weights' dtype, no autocast
            gradient_checkpointing=False, max_length=None, loss_type=["sigmoid"], beta=args.beta,
            precompute_ref_log_probs=args.reference == "precompute", logging_steps=1, report_to="none",
            save_strategy="no", dataloader_num_workers=0, disable_tqdm=True)
        trainer = PreTokenized(model=args.weights, args=config, train_dataset=Dataset.from_list(pairs),
                               processing_class=AutoTokenizer.from_pretrained(args.weights), callbacks=[Clock()])
        examples = [trainer.train_dataset[i] for i in range(len(pairs))]
        chosen, rejected = trainer.compute_ref_log_probs(trainer.model, trainer.data_collator(examples))
        logps = torch.cat([chosen, rejected]).float().tolist()
        trainer.train()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {**marks.result(args.warmup), "losses": losses, "logps": logps}


# ---------------------------------------------------------------------------------------------
# The driver: make the inputs, run the workers interleaved, compare and summarise
# ---------------------------------------------------------------------------------------------


def run_worker(python: str, args: argparse.Namespace, side: str, reference: str, log: Path) -> dict[str, Any]:
    """One fresh process; its result is the last line it prints."""
    command = [python, str(Path(__file__).resolve()), "worker", "--side", side, "--reference", reference,
               "--weights", str(args.weights), "--pairs-file", str(args.pairs_file), "--code", args.code,
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--precision", args.precision,
               "--lr", str(args.lr), "--beta", str(args.beta), "--seed", str(args.seed)]
    command += ([] if args.fused else ["--no-fused"]) + (["--trace-rss"] if args.trace_rss else [])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "TQDM_DISABLE": "1"}
    if args.mmap_threshold:  # glibc: a fixed threshold, so freed large blocks go back at once on both sides
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    load_before = _load_average()
    started = time.perf_counter()
    with log.open("a") as err:
        err.write(f"\n=== {side} {reference} ===\n")
        err.flush()
        done = subprocess.run(command, cwd=args.code, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{side} ({reference}) failed with exit code {done.returncode}; see {log}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result.update(side=side, reference=reference, wall_s=time.perf_counter() - started,
                  load_average=(load_before + _load_average()) / 2)
    return result


def compare(first: dict[str, Any], second: dict[str, Any]) -> dict[str, float]:
    """How far apart two runs' step-0 log-probs and step-1 losses are."""
    a, b = first["logps"], second["logps"]
    return {"logps_max_abs_diff": max(abs(x - y) for x, y in zip(a, b)),
            "logps_max_rel_diff": max(abs(x - y) / max(abs(x), abs(y), 1e-12) for x, y in zip(a, b)),
            "step1_loss_diff": abs(first["losses"][0] - second["losses"][0])}


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for side, references in SIDES.items():
        for reference in references:
            mine = [r for r in runs if r["side"] == side and r["reference"] == reference]
            if not mine:
                continue
            steps = [s for r in mine for s in r["step_s"]]
            cpu = [s for r in mine for s in r.get("step_cpu_s", [])]
            table[f"{side}:{reference}"] = {
                "runs": len(mine), "steps_timed": len(steps), "median_step_s": statistics.median(steps),
                "median_step_cpu_s": statistics.median(cpu) if cpu else None,
                "run_medians_s": [statistics.median(r["step_s"]) for r in mine],
                "train_peak_rss_gib": max(r["train_peak_rss_gib"] for r in mine),
                "process_peak_rss_gib": max(r["process_peak_rss_gib"] for r in mine),
                "step1_loss": mine[0]["losses"][0], "losses": mine[0]["losses"],
                "load_average": [round(r["load_average"], 1) for r in mine]}
    return table


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", nargs="?", default="run", choices=("run", "worker"))
    parser.add_argument("--trl-python", default="/work/venv-trl/bin/python", help="the TRL venv's interpreter")
    parser.add_argument("--python", default=sys.executable, help="our side's interpreter (the project's venv)")
    parser.add_argument("--model", default=str(ROOT / "assets/hub/Qwen/Qwen2.5-0.5B-Instruct"), help="a config folder")
    parser.add_argument("--work-dir", default=str(ROOT / "runs/dpo_vs_trl"), help="weights, pairs, logs, results")
    parser.add_argument("--code", default=str(ROOT), help="the checkout whose recipe and library run as ours")
    parser.add_argument("--pairs", type=int, default=2, help="pairs per step (one micro-batch)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--completion-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per run (the last one is not timed)")
    parser.add_argument("--warmup", type=int, default=1, help="step intervals dropped at each run's start")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sides", default="ours:copy,trl:resident,ours:precompute,trl:precompute",
                        help="the runs of one round, in order")
    parser.add_argument("--precision", default="bf16-true", choices=("bf16-true", "32-true"))
    parser.add_argument("--no-fused", dest="fused", action="store_false", help="torch's for-loop AdamW on both sides")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of each run (default: torch's)")
    parser.add_argument("--trace-rss", action="store_true", help="sample RSS every 10 ms: each step's peak per phase")
    parser.add_argument("--mmap-threshold", type=int, default=None,
                        help="MALLOC_MMAP_THRESHOLD_ of each run (glibc; default: glibc's dynamic threshold)")
    # worker-only
    parser.add_argument("--side", choices=tuple(SIDES))
    parser.add_argument("--reference")
    parser.add_argument("--weights")
    parser.add_argument("--pairs-file")
    return parser


def worker(args: argparse.Namespace) -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    pairs = json.loads(Path(args.pairs_file).read_text())
    run = run_ours if args.side == "ours" else run_trl
    result = run(args, pairs)
    import torch

    result["threads"] = torch.get_num_threads()
    print(json.dumps(result), flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parser().parse_args(argv)
    if args.mode == "worker":
        worker(args)
        return {}
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    config = json.loads((Path(args.model) / "config.json").read_text())
    args.weights = make_weights(args.model, work, args.seed)
    args.pairs_file = work / "pairs.json"
    args.pairs_file.write_text(json.dumps(make_pairs(args.pairs, args.prompt_tokens, args.completion_tokens,
                                                     config["vocab_size"], args.seed)))
    log = work / "workers.log"
    order = [tuple(item.split(":")) for item in args.sides.split(",")]
    runs: list[dict[str, Any]] = []
    for index in range(args.rounds):
        for side, reference in order:
            python = args.python if side == "ours" else args.trl_python
            runs.append(run_worker(python, args, side, reference, log))
            last = runs[-1]
            print(f"round {index + 1}/{args.rounds} {side}:{reference}: median {statistics.median(last['step_s']):.2f} s"
                  f" per step ({statistics.median(last['step_cpu_s']):.2f} s CPU), train peak RSS {last['train_peak_rss_gib']:.2f} GiB, process {last['process_peak_rss_gib']:.2f}"
                  f" GiB, step-1 loss {last['losses'][0]:.6f}, load {last['load_average']:.1f}", file=sys.stderr, flush=True)
    summary = {"table": summarise(runs), "runs": runs,
               "setup": {"model": args.model, "pairs": args.pairs, "prompt_tokens": args.prompt_tokens,
                         "completion_tokens": args.completion_tokens, "precision": args.precision, "fused": args.fused,
                         "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "lr": args.lr}}
    firsts = {f"{r['side']}:{r['reference']}": r for r in reversed(runs)}
    names = sorted(firsts)
    summary["agreement"] = {f"{a} vs {b}": compare(firsts[a], firsts[b]) for i, a in enumerate(names) for b in names[i + 1:]}
    (work / "result.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({"table": summary["table"], "agreement": summary["agreement"]}, indent=1))
    ln2 = math.log(2)
    for name, row in summary["table"].items():
        if abs(row["step1_loss"] - ln2) > 1e-3:
            print(f"warning: {name}'s step-1 loss {row['step1_loss']:.6f} is not ln 2", file=sys.stderr)
    return summary


if __name__ == "__main__":
    main()
