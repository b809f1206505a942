"""``python -m lightning_mem.estimate --config CONFIG [recipe overrides] [--device-memory 24GiB]
[--world-size N] [--suggest [--suggestions N]] [--json]``: will this config fit? See docs/will_it_fit.md."""

from __future__ import annotations

import argparse
import contextlib
import importlib.abc
import importlib.machinery
import logging
import sys
import warnings
from collections.abc import Iterator

from lightning_mem.estimate import report
from lightning_mem.estimate.estimator import estimate
from lightning_mem.estimate.recipe_config import recipe_for
from lightning_mem.estimate.suggest import suggest


@contextlib.contextmanager
def _quiet_lightning() -> Iterator[None]:
    """Lightning's info lines (GPU available...) are the estimate's stand-in trainer's, not the
    user's: silenced while it runs, restored after (main may be called in a process that logs on)."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_mem.estimate",
        description="Per-phase, per-rank memory of a recipe config, from the recipe's own step on fake tensors.",
        epilog="Any other argument is passed to the recipe's CLI as an override, e.g. --data.max_length 4096;"
               " the recipe's keys are listed by `python -m recipes.<recipe> fit --help`.",
    )
    parser.add_argument("--config", required=True, help="a recipe config (configs/<recipe>/*.yaml)")
    parser.add_argument("--recipe", default=None, help="sft, qlora, ppo or a module path; default: from the config's folder")
    parser.add_argument("--device-memory", default=None,
                        help="memory of one device (24GiB, 80GB); default: the config's tier (# tier: 1x24GB or _1x24gb)")
    parser.add_argument("--world-size", type=int, default=None, help="ranks; default: trainer.devices x trainer.num_nodes")
    parser.add_argument("--suggest", action="store_true", help="if it does not fit, re-estimate overrides that would")
    parser.add_argument("--suggestions", type=int, default=3, metavar="N",
                        help="with --suggest: stop after N suggestions that fit (default 3)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args, overrides = parser.parse_known_args(argv)
    device_bytes = None
    if args.device_memory is not None:
        device_bytes = report.parse_size(args.device_memory, key="--device-memory")
        report.check_device_size(device_bytes, key="--device-memory", text=args.device_memory)
    else:
        tier = report.tier_of(args.config)
        device_bytes = tier.memory_bytes if tier else None
    if args.suggestions < 1:
        parser.error(f"--suggestions must be >= 1, got {args.suggestions}")
    if args.suggest and device_bytes is None:
        parser.error("--suggest needs a device size to fit into: pass --device-memory (e.g. 24GiB), or a config"
                     " with a tier (# tier: 1x24GB)")
    recipe = recipe_for(args.config, args.recipe)
    with _quiet_lightning(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = estimate(args.config, overrides, recipe=recipe, world_size=args.world_size, device_memory=device_bytes)
        advice = None
        if args.suggest and result.device_peak_bytes > report.usable_bytes(device_bytes):
            advice = suggest(
                result.parsed, recipe, overrides, device_bytes,
                lambda extra: estimate(args.config, extra, recipe=recipe, world_size=args.world_size,
                                       device_memory=device_bytes),
                base=result, config=args.config, limit=args.suggestions,
                estimate_config=lambda config, extra, module, ranks: estimate(
                    config, extra, recipe=module, world_size=ranks, device_memory=device_bytes),
            )
    if args.json:
        print(report.dumps(report.to_dict(result, device_bytes, advice)))
    else:
        print(report.table(result, device_bytes))
        if advice is not None:
            print(report.suggestions_text(advice.suggestions, advice.dropped, smaller=advice.smaller,
                                          peak=result.device_peak_bytes, device_bytes=device_bytes))
    fits = device_bytes is None or result.device_peak_bytes <= report.usable_bytes(device_bytes)
    return 0 if fits else 1


def _exit(code: int) -> None:
    """Leave as ``sys.exit(code)`` would, without tearing the interpreter down.

    After an estimate the process holds half a million objects (the model's fake parameters, the
    autograd graph's remains, the ledger's weak references); freeing them one by one at shutdown took
    about 2 s of a 15 s estimate. The exit handlers still run and the output is flushed; then the
    process ends, and the operating system takes its memory back at once.
    """
    import atexit
    import os

    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class _BitsandbytesUncompiled(importlib.abc.MetaPathFinder):
    """Imports bitsandbytes, when something first does, with ``torch.compile`` declining.

    At import, bitsandbytes wraps a few of its CPU kernels in ``torch.compile`` and keeps the plain
    function where that raises. Declaring them compiled imports torch's inductor: about 1.5 s of an
    estimate that never runs them (an estimate's quantized operators have fake tensors, which take
    their fake kernels). Only this command's process imports bitsandbytes so: ``estimate()`` in a
    process that goes on to train leaves the import as it is.
    """

    def find_spec(self, name, path=None, target=None):  # noqa: ANN001, ANN201
        if name != "bitsandbytes":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Uncompiled(spec.loader)
        return spec


class _Uncompiled(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec):  # noqa: ANN001, ANN201
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:  # noqa: ANN001
        import torch

        def declined(*args: object, **kwargs: object) -> None:
            raise RuntimeError("an estimate runs nothing compiled")

        compile_, torch.compile = torch.compile, declined
        try:
            self.loader.exec_module(module)
        finally:
            torch.compile = compile_


if __name__ == "__main__":
    sys.meta_path.insert(0, _BitsandbytesUncompiled())
    from lightning_mem.cli import run_command  # a bad setting or data line: one line and status 2

    _exit(run_command(main))
