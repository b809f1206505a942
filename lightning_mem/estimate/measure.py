"""The recipe's own run, measured with the estimate's tracker: what the estimate is held to.

:func:`measure_fit` builds a config exactly as ``python -m recipes.<recipe> fit --config ...`` does
-- the recipe's LightningCLI makes the trainer, the module and the datamodule from the YAML and the
overrides, with every callback the YAML names -- and calls ``trainer.fit`` on real CPU tensors under
the estimate's :class:`~lightning_mem.estimate.tracker.TrackingMode` and
:class:`~lightning_mem.estimate.tracker.MemoryLedger`, with a :class:`FitRecorder` among the
callbacks. Every optimizer step after the first is measured (each phase keeps its largest peak),
and the fit stops after ``steps`` of them.

Two things differ from an unobserved run, and neither moves a byte: sampling draws a token that ends
nothing, so every response runs to ``max_new_tokens`` (the case the estimate describes; a run whose
responses stop early holds less); and the run's root folder is a temporary one. The data are
whatever the config and overrides name: to hold an estimate to a run, give the run rows that fill
``max_length`` (or ``max_prompt_length``), as the estimate's largest micro-batch does.

With ``world_size`` > 1 each rank is a spawned process of one gloo group (the config's
``trainer.devices`` must say the same); a strategy that shards with FSDP2 has its shards counted as
each rank holds them (:class:`~lightning_mem.estimate.sharded.FSDP2Categories`).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from typing_extensions import override

from lightning_mem.estimate.recipe_config import model_vocab_sizes, recipe_for, recipe_parts, sampled_tokens
from lightning_mem.estimate.recorder import MeasuredStep, PhaseEstimate, PhaseRecorder, attribution
from lightning_mem.estimate.sharded import DEFAULT_TIMEOUT_S, SHARED_DIR_ENV, FSDP2Categories, is_fsdp2, run_ranks
from lightning_mem.estimate.tracker import MemoryLedger, TrackingMode
from lightning_mem.settings import SettingError


class FitRecorder(PhaseRecorder):
    """Measures optimizer steps ``1 .. steps - 1`` of a fit, then stops it."""

    def __init__(self, ledger: MemoryLedger, *, steps: int) -> None:
        if steps < 2:
            raise ValueError(f"`steps`: the first step is not measured, so at least 2 are needed, got {steps}")
        super().__init__(ledger)
        self.steps = steps

    @override
    def measured(self, step: int) -> bool:
        return 1 <= step < self.steps

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        accumulate = trainer.accumulate_grad_batches
        if (batch_idx + 1) % accumulate == 0 and batch_idx // accumulate == self.steps - 1:
            raise MeasuredStep


class FSDP2FitRecorder(FSDP2Categories, FitRecorder):
    """A :class:`FitRecorder` of a fit that FSDP2 shards over ranks."""

    def __init__(self, ledger: MemoryLedger, *, steps: int, offload: bool) -> None:
        super().__init__(ledger, steps=steps)
        self.offload = offload


def filling_rows(folder: str | Path, tokenizer: str = "assets/tiny-llama", rows: int = 64) -> dict[str, list[str]]:
    """Overrides that point a config at rows filling every micro-batch, written to ``folder``:
    ``"sft"`` (completions longer than ``max_length`` 64, so a 256-token budget takes 4 full rows)
    and ``"ppo"`` (prompts all of one length, which becomes ``max_prompt_length``; 4 a batch). The
    estimate describes this case; a run on it is what the estimate is held to."""
    from lightning_mem.data.chat import encode_prompt, row_to_prompt_messages
    from lightning_mem.models import load_tokenizer

    folder = Path(folder)
    sft = folder / "sft.jsonl"
    sft.write_text("".join(json.dumps({"prompt": "1+1", "completion": "x" * 120}) + "\n" for _ in range(rows)))
    prompts = [{"prompt": f"Compute {i % 10} + 3, and then a few words more.", "answer": str(i % 10 + 3)}
               for i in range(rows)]
    loaded = load_tokenizer(tokenizer)
    (length,) = {len(encode_prompt(row_to_prompt_messages(r), loaded)) for r in prompts}
    ppo = folder / "prompts.jsonl"
    ppo.write_text("".join(json.dumps(r) + "\n" for r in prompts))
    return {
        "sft": [f"--data.train_file={sft}", "--data.val_file=null", "--data.max_tokens_per_batch=256"],
        "ppo": [f"--data.train_file={ppo}", f"--data.max_prompt_length={length}",
                f"--model.name_or_path={tokenizer}", "--data.batch_size=4"],
    }


def measure_fit(
    config: str | Path,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    recipe: str | None = None,
    steps: int = 3,
    world_size: int = 1,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> list[list[PhaseEstimate]]:
    """Each rank's measured phases of ``config``'s real fit (plus recipe CLI ``overrides``):
    ``result[rank]``. One process runs here; several are spawned (guard a calling script's top
    level with ``if __name__ == "__main__":``)."""
    args = (str(config), list(overrides), recipe, steps)
    if world_size == 1:
        return [_fit_rank(*args, world_size=1)]
    return run_ranks(_fit_rank, args, world_size=world_size, timeout=timeout, name=f"measure_fit({config})")


def _fit_rank(config: str, overrides: list[str], recipe: str | None, steps: int, *,
              world_size: int) -> list[PhaseEstimate]:
    _, cli_class, module_class, data_class = recipe_parts(recipe_for(config, recipe))
    shared = os.environ.get(SHARED_DIR_ENV) if world_size > 1 else None  # one run folder for all ranks
    with contextlib.nullcontext(shared) if shared else tempfile.TemporaryDirectory(prefix="lightning_mem_fit_") as tmp:
        args = ["--config", config, *overrides, f"--trainer.default_root_dir={tmp}",
                "--trainer.enable_progress_bar=false"]
        cli = cli_class(module_class, data_class, args=args, run=False)
        trainer, module = cli.trainer, cli.model
        if trainer.world_size != world_size:
            raise SettingError("trainer.devices", f": the config runs {trainer.world_size} processes, not {world_size}")
        ledger = MemoryLedger(set(model_vocab_sizes(cli.config.model)))
        fill, _ = sampled_tokens(module.hparams.name_or_path)
        mode = TrackingMode(ledger, fake=False, fixed_sampling=True, fill_token=fill)
        strategy = trainer.strategy
        recorder: FitRecorder = (
            FSDP2FitRecorder(ledger, steps=steps, offload=bool(strategy.cpu_offload)) if is_fsdp2(strategy)
            else FitRecorder(ledger, steps=steps)
        )
        trainer.callbacks.append(recorder)
        accounting = recorder.accounting() if isinstance(recorder, FSDP2Categories) else contextlib.nullcontext()
        with attribution(ledger, fake=False), mode, accounting:
            try:
                trainer.fit(module, datamodule=cli.datamodule)
            except MeasuredStep:
                pass
            finally:
                for cb in trainer.callbacks:  # saved-tensor hooks (activation offload) are global
                    cb.teardown(trainer, module, "fit")
        if not recorder.peaks:
            raise RuntimeError(f"{config}: the fit ended before {steps} optimizer steps (max_steps, or too little data?)")
        return recorder.phases
