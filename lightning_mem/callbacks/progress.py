"""A progress bar that counts what ends a ``max_steps`` run: optimizer steps, not batches of an epoch."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from typing_extensions import override


class StepProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar, but with ``trainer.max_steps`` set the training bar runs over the whole
    run: ``step 130/600`` (the epoch in the description) instead of restarting at every epoch with
    no total for the run. A PPO step is an optimizer step (``global_step``), as ``max_steps`` counts.
    Without ``max_steps`` it is Lightning's bar.
    """

    @staticmethod
    def _by_steps(trainer: Any) -> bool:
        return trainer.max_steps is not None and trainer.max_steps > 0

    @override
    def on_train_epoch_start(self, trainer: Any, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        if self._by_steps(trainer):
            bar = self.train_progress_bar
            bar.total = trainer.max_steps
            bar.initial = 0
            _show_step(bar, trainer.global_step)
            bar.set_description(f"Epoch {trainer.current_epoch}, step")

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self._by_steps(trainer):
            return super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        bar = self.train_progress_bar
        if bar is not None and self._should_update(trainer.global_step, bar.total):
            _show_step(bar, trainer.global_step)
            bar.set_postfix(self.get_metrics(trainer, pl_module))


class StepRichProgressBar(RichProgressBar):
    """Lightning's rich bar (its default when ``rich`` is installed), counting steps like
    :class:`StepProgressBar` when ``trainer.max_steps`` is set: ``Epoch 3, step 130/600`` instead
    of ``Epoch 3/-2`` over one epoch's batches. Without ``max_steps`` it is Lightning's bar, minus
    the negative epoch total of ``max_epochs: -1``.
    """

    def _by_steps(self) -> bool:
        trainer = self._trainer
        return trainer is not None and trainer.max_steps is not None and trainer.max_steps > 0

    @property
    def total_train_batches(self) -> int | float:
        return self.trainer.max_steps if self._by_steps() else super().total_train_batches

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        if self._by_steps():
            return f"Epoch {current_epoch}, step"
        max_epochs = self.trainer.max_epochs
        return f"Epoch {current_epoch}" + (f"/{max_epochs - 1}" if max_epochs is not None and max_epochs > 0 else "")

    @override
    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        if self._by_steps():
            self._update(self.train_progress_bar_id, trainer.global_step)

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self._by_steps():
            return super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if not self.is_disabled and self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()
        self._update(self.train_progress_bar_id, trainer.global_step)
        self._update_metrics(trainer, pl_module)


def _show_step(bar: Any, step: int) -> None:
    """Set a tqdm bar's count to ``step`` and redraw it (a disabled bar stays silent)."""
    if not bar.disable:
        bar.n = step
        bar.refresh()
