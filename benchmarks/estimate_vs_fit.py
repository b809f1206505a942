"""The memory estimate beside the recipe's real fit, for every shipped CPU config: a markdown table.

    python benchmarks/estimate_vs_fit.py                 # every case
    python benchmarks/estimate_vs_fit.py -k fsdp2        # cases whose name contains "fsdp2"

Each case is estimated on fake tensors (``lightning_mem.estimate.estimate``) and run for real, through
the recipe's own CLI and ``Trainer.fit``, under the same tracker (``lightning_mem.estimate.measure_fit``),
on rows that fill every micro-batch (``filling_rows``). The figures are tracked tensor bytes on CPU:
per phase (per rank for the 2-process FSDP2 configs), the device peak of each and their ratio, and
the host bytes. ``tests/estimate/test_estimate_accuracy.py`` holds the same cases to 5 %.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CALLBACK = "--trainer.callbacks+=lightning_mem.callbacks."
FSDP2 = "--trainer.strategy.init_args."
#: name -> (config, data kind, overrides, ranks)
CASES = {
    "sft": ("configs/sft/tiny_cpu.yaml", "sft", [], 1),
    "sft + activation checkpointing": ("configs/sft/tiny_cpu.yaml", "sft", [CALLBACK + "ActivationCheckpointing"], 1),
    "sft + activation offload": ("configs/sft/tiny_cpu.yaml", "sft", [CALLBACK + "ActivationOffload"], 1),
    "sft + optimizer-state offload": ("configs/sft/tiny_cpu.yaml", "sft", [CALLBACK + "OptimizerStateOffload"], 1),
    "sft + optimizer in backward": ("configs/sft/tiny_cpu.yaml", "sft",
                                    [CALLBACK + "OptimizerInBackward", "--trainer.gradient_clip_val=null"], 1),
    "sft 8-bit AdamW": ("configs/sft/tiny_cpu_adamw8bit.yaml", "sft", [], 1),
    "sft LoRA": ("configs/sft/tiny_cpu_lora.yaml", "sft", [], 1),
    "QLoRA": ("configs/qlora/tiny_cpu.yaml", "sft", [], 1),
    "sft fsdp2 (cpu offload)": ("configs/sft/tiny_cpu_fsdp2.yaml", "sft", [], 2),
    "sft fsdp2 (on device)": ("configs/sft/tiny_cpu_fsdp2.yaml", "sft", [FSDP2 + "cpu_offload=false"], 2),
    "sft fsdp2 (bf16 compute)": ("configs/sft/tiny_cpu_fsdp2.yaml", "sft",
                                 [FSDP2 + "param_dtype=bfloat16", FSDP2 + "reduce_dtype=float32"], 2),
    "sft fsdp2 (reshard_after_forward false)": ("configs/sft/tiny_cpu_fsdp2.yaml", "sft",
                                                [FSDP2 + "cpu_offload=false", FSDP2 + "reshard_after_forward=false"], 2),
    "ppo (gae, separate critic)": ("configs/ppo/tiny_cpu.yaml", "ppo", [], 1),
    "grpo + LoRA": ("configs/ppo/tiny_cpu_grpo.yaml", "ppo",
                    ['--model.lora={"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}',
                     "--data.batch_size=2"], 1),
    "grpo packed": ("configs/ppo/tiny_cpu_grpo_packed.yaml", "ppo", ["--data.batch_size=2"], 1),
    "ppo fsdp2": ("configs/ppo/tiny_cpu_fsdp2.yaml", "ppo", [], 2),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-k", default="", help="only the cases whose name contains this")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    from lightning_mem.estimate import estimate, measure_fit
    from lightning_mem.estimate.measure import filling_rows

    print("| case | phase | estimate MB | real fit MB (per rank) | estimate / real | host MB estimate / real |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        data = filling_rows(tmp)
        for name, (config, kind, overrides, ranks) in CASES.items():
            if args.k not in name:
                continue
            full = [*data[kind], *overrides]
            est = estimate(ROOT / config, full, world_size=ranks)
            real = measure_fit(ROOT / config, full, world_size=ranks, steps=2)
            for index, e in enumerate(est.phases):
                runs = [phases[index] for phases in real]
                worst = max(r.device_peak_bytes for r in runs)
                print(f"| {name} | {e.phase} | {e.device_peak_bytes / 1e6:.3f} | "
                      f"{' / '.join(f'{r.device_peak_bytes / 1e6:.3f}' for r in runs)} | "
                      f"{e.device_peak_bytes / worst:.4f} | {e.host_peak_bytes / 1e6:.2f} / "
                      f"{max(r.host_peak_bytes for r in runs) / 1e6:.2f} |", flush=True)


if __name__ == "__main__":
    main()
