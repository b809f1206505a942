"""Progress bars that count what ends a ``max_steps`` run (optimizer steps, not batches of an epoch)
and read training metrics from the device only at the steps Lightning logs at.

Showing a metric means reading it from the device (``.item()``), and on a GPU each read makes the
host wait for every queued kernel; the GPU then idles while the host prepares the next batch. A
value logged with ``prog_bar=True`` is read by Lightning itself after **every batch** (its logger
connector converts the progress-bar metrics to numbers at each batch end, bar or no bar), so with
gradient accumulation a step synced between its micro-batches. The recipes log their training
values without ``prog_bar``, and these bars show the ones named in ``metrics`` (``train_loss`` by
default) from ``trainer.callback_metrics``, read at the optimizer steps where
``trainer.log_every_n_steps`` has the logger read them anyway, and at the last step; between reads
the bar keeps counting and shows the last values. What validation logs is read when it ends, as
Lightning does.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from typing_extensions import override


#: What the bars show of the values logged without ``prog_bar`` (the recipes' training loss).
SHOWN = ("train_loss",)


class _ReadsAtLogSteps:
    """``get_metrics`` for a progress bar: during training, a read of the device only when the step
    has reached a multiple of ``trainer.log_every_n_steps`` (or ``max_steps``) since the last read;
    ``metrics`` names the values of ``trainer.callback_metrics`` it then shows beside Lightning's."""

    def __init__(self, *args: Any, metrics: tuple[str, ...] = SHOWN, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.metrics = tuple(metrics)
        self._read_step = 0
        self._shown: dict[str, Any] = {}

    def _read_due(self, trainer: Any) -> bool:
        step, every = int(trainer.global_step), max(int(trainer.log_every_n_steps or 1), 1)
        last = trainer.max_steps is not None and trainer.max_steps > 0 and step >= trainer.max_steps
        due = step // every != self._read_step // every or (last and step != self._read_step)
        if due:
            self._read_step = step
        return due

    @override
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._read_step, self._shown = int(trainer.global_step), {}
        super().on_train_start(trainer, pl_module)  # type: ignore[misc]

    def get_metrics(self, trainer: Any, pl_module: Any) -> dict[str, Any]:
        if trainer.training and not self._read_due(trainer):
            return self._shown
        logged = trainer.callback_metrics  # tensors as logged: nothing read back yet
        shown = {name: float(logged[name]) for name in self.metrics if name in logged}
        self._shown = {**shown, **super().get_metrics(trainer, pl_module)}  # type: ignore[misc]
        return self._shown


class StepProgressBar(_ReadsAtLogSteps, TQDMProgressBar):
    """Lightning's tqdm bar, but with ``trainer.max_steps`` set the training bar runs over the whole
    run: ``step 130/600`` (the epoch in the description) instead of restarting at every epoch with
    no total for the run. A PPO step is an optimizer step (``global_step``), as ``max_steps`` counts.
    Without ``max_steps`` it counts Lightning's way. Either way it reads training metrics only at log
    steps (see the module); ``metrics``: the names it shows of those logged without ``prog_bar``.
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


class StepRichProgressBar(_ReadsAtLogSteps, RichProgressBar):
    """Lightning's rich bar (its default when ``rich`` is installed), counting steps like
    :class:`StepProgressBar` when ``trainer.max_steps`` is set: ``Epoch 3, step 130/600`` instead
    of ``Epoch 3/-2`` over one epoch's batches. Without ``max_steps`` it is Lightning's bar, minus
    the negative epoch total of ``max_epochs: -1``. Training metrics as :class:`StepProgressBar`.
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
