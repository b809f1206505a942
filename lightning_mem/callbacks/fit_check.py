"""Will this run fit the card it is on? Ask the memory estimator before the weights load.

``FitCheck`` runs in ``setup`` (before ``configure_model``, so before any weight is read), on CUDA
only: it runs ``python -m lightning_mem.estimate`` in a subprocess (fake tensors, no device memory,
no state shared with the run) for this run's config and command-line overrides, the actual card's
memory and this run's world size, and warns -- with the estimator's suggestions -- when a phase's
peak exceeds the card less the estimator's margin. ``fail=True`` stops the run instead.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_mem.settings import SettingError, callback_args


def config_from_argv(argv: list[str]) -> tuple[Optional[str], list[str]]:
    """The ``--config`` of a recipe command line and its other overrides (after the subcommand)."""
    args = list(argv)
    if args and not args[0].startswith("-"):
        args = args[1:]  # fit / validate
    config, rest, i = None, [], 0
    while i < len(args):
        arg = args[i]
        if arg == "--config" and i + 1 < len(args):
            config, i = args[i + 1], i + 2
            continue
        if arg.startswith("--config="):
            config = arg.split("=", 1)[1]
        elif arg not in ("--ckpt_path",) and not arg.startswith("--ckpt_path="):
            rest.append(arg)
        elif arg == "--ckpt_path":
            i += 1
        i += 1
    return config, rest


class FitCheck(Callback):
    """Estimate this run's per-phase peak for the actual card at the start of fit (CUDA only).

    Args:
        config: the recipe config; None takes ``--config`` from the command line.
        overrides: recipe CLI overrides; None takes the rest of the command line.
        suggest: ask the estimator for overrides that would fit, and print them.
        fail: raise instead of warning when the estimate does not fit.
        timeout_s: give up on the estimate (a warning) after this many seconds.
    """

    def __init__(self, config: Optional[str] = None, overrides: Optional[list[str]] = None, suggest: bool = True,
                 fail: bool = False, timeout_s: float = 900.0) -> None:
        self.config = config
        self.overrides = overrides
        self.suggest = suggest
        self.fail = fail
        self.timeout_s = timeout_s
        self.result: Optional[dict[str, Any]] = None

    def command(self, device_bytes: int, world_size: int) -> list[str]:
        config, rest = config_from_argv(sys.argv[1:])
        config = self.config or config
        if config is None:
            raise SettingError("config", ": none given, and no --config on the command line: the estimate runs a config",
                               prefix=f"{callback_args(self)}.")
        overrides = self.overrides if self.overrides is not None else rest
        cmd = [sys.executable, "-m", "lightning_mem.estimate", "--config", config, *overrides,
               "--device-memory", str(device_bytes), "--world-size", str(world_size), "--json"]
        return cmd + (["--suggest"] if self.suggest else [])

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        device = trainer.strategy.root_device
        if stage != "fit" or device.type != "cuda" or not trainer.is_global_zero:
            return
        import torch

        total = torch.cuda.get_device_properties(device).total_memory
        cmd = self.command(total, trainer.world_size)
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout_s)
            self.result = json.loads(done.stdout)
        except (subprocess.TimeoutExpired, json.JSONDecodeError) as err:
            rank_zero_warn(f"FitCheck: the memory estimate did not finish ({type(err).__name__}); running unchecked")
            return
        self.report(self.result)

    def report(self, result: dict[str, Any]) -> None:
        gib = 1 << 30
        peaks = ", ".join(f"{p['phase']} {p['device_peak_bytes'] / gib:.1f} GiB" for p in result["phases"])
        usable = result["usable_device_bytes"] / gib
        if result["fits"]:
            rank_zero_info(f"FitCheck: estimated peaks per rank {peaks}; fits the {usable:.1f} GiB usable on this card")
            return
        lines = [f"FitCheck: estimated peaks per rank {peaks}: more than the {usable:.1f} GiB usable on this card "
                 f"({result['margin']['what']}). The run will likely run out of memory."]
        for s in result.get("suggestions") or []:
            if s.get("fits"):
                lines.append(f"  fits ({s['device_peak_bytes'] / gib:.1f} GiB): {s['what']}: {' '.join(s['overrides'])}")
        for s in result.get("smaller") or []:  # only when no suggestion fits: a way with adapters
            if s.get("fits"):
                lines.append(f"  nothing else fits; the smallest way that does ({s['device_peak_bytes'] / gib:.1f}"
                             f" GiB): {s['what']}: {s['command']}")
        if self.fail:
            # The suggestions first, then the refusal as one line.
            if len(lines) > 1:
                rank_zero_warn("\n".join(lines[1:]))
            raise SettingError("fail", f": true, and {lines[0].removeprefix('FitCheck: ')}",
                               prefix=f"{callback_args(self)}.")
        rank_zero_warn("\n".join(lines))
