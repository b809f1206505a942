"""The estimate's run: Lightning's own ``Trainer.fit`` of the config's module on fake tensors, a
warm-up step then the measured one, and the shortcuts (a StepIO) that skip what cannot raise a peak.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from typing_extensions import override

from lightning_mem.estimate.cuda import CudaDeviceModel
from lightning_mem.estimate.decode_peak import last_decode_step
from lightning_mem.estimate.fake import weights_source
from lightning_mem.estimate.rank_view import RankView
from lightning_mem.estimate.recipe_config import is_technique, precision_plugin, sampled_tokens
from lightning_mem.estimate.recorder import MeasuredStep, rows_of, attribution
from lightning_mem.estimate.sharding import MasterWeights, sharding_of
from lightning_mem.estimate.tracker import MemoryLedger, TrackingMode
from lightning_mem.step_io import StepIO


class EstimateRun(RankView, StepIO):
    """One estimate: Lightning's own ``Trainer.fit`` of the config's module, on fake tensors.

    The run is a :class:`~lightning_mem.estimate.recorder.PhaseRecorder` of that fit, and its :class:`~lightning_mem.step_io.StepIO`:

    - the fit runs the module's own hooks and steps -- ``configure_model``,
      ``configure_optimizers``, ``training_step``, Lightning's backward, clipping, optimizer step and
      ``zero_grad`` (automatic optimization), or the recipe's own update loop (manual) -- with the
      config's precision plugin and technique callbacks, so a recipe subclass is estimated as itself;
    - its data are the datamodule's ``largest_batch``: first a warm-up step of one micro-batch of
      short rows (the optimizers make their state, and whatever a step leaves alive for the next
      one stays alive; its sampled responses end at once), then the largest micro-batch the config
      allows (two of them when gradients accumulate: the second forward runs next to the first
      one's gradients). Each step is an epoch of its own (:class:`_StepPerEpoch`): Lightning steps
      the optimizers at an epoch's last micro-batch, so the warm-up needs only one however many
      the config accumulates;
    - it measures the second step (the second epoch) and then stops the fit (:class:`MeasuredStep`);
    - as the step's ``StepIO`` it skips repetitions that cannot raise a peak (generation's middle
      decode steps, the third and later micro-batches of one shape, PPO's mini-batches and epochs
      after the first) unless ``full_loops``.

    A sharding strategy runs as one unsharded process whose per-rank view
    (:class:`~lightning_mem.estimate.rank_view.RankView`) the ledger applies at every moment.
    """


    def __init__(self, init: Any, cfg: Any, *, world_size: int, fake: bool, vocab: list[int], workdir: Path,
                 full_loops: bool = False, device_memory: int | None = None) -> None:
        trainer_cfg = init.trainer
        strategy = trainer_cfg.strategy if not isinstance(trainer_cfg.strategy, str) else None
        super().__init__(MemoryLedger(set(vocab)), sharding=sharding_of(strategy), world_size=world_size,
                         strategy=strategy)
        self.module = init.model
        self.data = init.data
        self.cfg = cfg
        self.callbacks = [cb for cb in (trainer_cfg.callbacks or []) if is_technique(cb)]
        self.precision = precision_plugin(trainer_cfg.precision)
        self.fake = fake
        self.full_loops = full_loops
        self.workdir = workdir
        self.mode = TrackingMode(self.ledger, fake=fake, fixed_sampling=True)
        self.accumulate = int(trainer_cfg.accumulate_grad_batches or 1)
        # Micro-batches of one optimizer step that run: the second runs next to the first one's
        # gradients, a third would repeat the second.
        self.accumulated = self.accumulate if full_loops else min(self.accumulate, 2)
        self.trainer: Any = None
        self._fill, self._eos = 0, None
        self.device_memory = device_memory  # one device's total bytes, when the estimate knows the card
        accelerator = str(trainer_cfg.accelerator or "auto").lower()
        self.on_cuda = accelerator not in ("cpu", "mps")  # what the config runs on, not this machine
        #: What a CUDA device allocates beyond the CPU run's tensors (:mod:`.cuda`); None on a CPU config.
        self.device_model: CudaDeviceModel | None = CudaDeviceModel() if self.on_cuda else None
        if self.device_model is not None:
            self.ledger.round_bytes = self.device_model.round_bytes
        self._blas_workspaces: torch.Tensor | None = None
        self.stand_in: Any = None  # separate placement: the generators' stand-in (:mod:`.generator`)
        self._logging: tuple[Any, Any] | None = None  # Lightning's logging state after the warm-up step

    def measured(self, step: int) -> bool:
        return step == 1

    @override
    def step_of(self, trainer: Any, batch_idx: int) -> int:
        return trainer.current_epoch  # one optimizer step an epoch (:meth:`batches`)

    # -- the fit ----------------------------------------------------------------------------------
    def trainer_arguments(self) -> dict[str, Any]:
        """The estimate's Trainer: one CPU process with the config's precision, clipping and
        accumulation, the technique callbacks and this run; no logger, checkpoints or validation.
        Its root is the estimate's temporary folder: whatever a recipe writes under
        ``trainer.default_root_dir`` (a LoRA run's saved random base) goes nowhere else."""
        trainer_cfg = self.cfg.trainer
        max_steps = trainer_cfg.max_steps if trainer_cfg.max_steps not in (None, -1) else 2**31 - 1
        return dict(
            accelerator="cpu", devices=1, plugins=[self.precision], callbacks=[*self.callbacks, self],
            max_steps=max_steps, accumulate_grad_batches=self.accumulated,
            gradient_clip_val=trainer_cfg.gradient_clip_val, gradient_clip_algorithm=trainer_cfg.gradient_clip_algorithm,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
            default_root_dir=str(self.workdir),
        )  # fmt: skip

    def batches(self, fill: int) -> list[dict[str, Any]]:
        """A warm-up step of one micro-batch of short rows (8 tokens), then the measured step of
        the datamodule's largest micro-batch (``accumulated`` of them)."""
        largest = getattr(self.data, "largest_batch", None)
        if largest is None:
            raise TypeError(
                f"{type(self.data).__name__} has no largest_batch(fill_token): the estimate needs the datamodule"
                " to say what its largest micro-batch looks like (see lightning_mem.data.SFTDataModule)"
            )
        cp = self.sharding.context_parallel  # a token budget is per rank: cp times the tokens of whole rows
        batch = largest(fill, context_parallel_size=cp) if cp > 1 else largest(fill)
        if self.device_model is not None and self.device_model.padded_batches:
            batch = _one_row_padded(batch)
        if any(key in batch for key in FLAT_POSITIONS):  # cut columns would leave them pointing past the rows
            small = _shortened(self.data, tokens=8)
            warm_up = small.largest_batch(fill, context_parallel_size=cp) if cp > 1 else small.largest_batch(fill)
        else:
            warm_up = _head(batch, rows=rows_of(batch), tokens=8)  # every row: no loop of the step runs empty
        return [warm_up] + [batch] * self.accumulated

    def fit(self) -> None:
        from lightning.pytorch import Trainer
        from torch.utils.data import DataLoader

        fill, self._eos = sampled_tokens(self.cfg.model.name_or_path)
        self._fill = fill
        # The warm-up step samples an end of sequence at once (its responses are one token).
        self.mode.fill_token = fill if self._eos is None else self._eos
        device = (self.device_model.applied(lambda: self._phase is not None) if self.device_model is not None
                  else contextlib.nullcontext())
        with attribution(self.ledger, self.fake), weights_source(self.fake), device, self.mode, self.accounting():
            self.trainer = Trainer(**self.trainer_arguments())
            # The warm-up step ends an epoch (_StepPerEpoch), and at an epoch's end Lightning renews
            # what the module logged (fresh metric states). A run's steps mostly fall mid-epoch, and
            # the estimate has no logger: its warm-up epoch ends without the renewal (and the
            # measured step's logging carries on from the warm-up's: on_train_epoch_start), so the
            # measured step starts with the logged state a mid-epoch step finds.
            self.trainer._logger_connector.update_train_epoch_metrics = lambda: None
            if self.sharding.context_parallel > 1:
                # The recipes state micro-batch budgets per rank of a context group and read its size
                # from the strategy (lightning_mem.ranks.per_rank_budget): this one-process fit's
                # strategy says what the run's would.
                self.trainer.strategy.context_parallel_size = self.sharding.context_parallel
            batches = self.batches(fill)
            loader = DataLoader(batches, batch_size=None, sampler=_StepPerEpoch(len(batches)), collate_fn=_as_is)
            try:
                self.trainer.fit(self.module, train_dataloaders=loader)
            except MeasuredStep:
                pass
            finally:
                for cb in self.callbacks:  # e.g. activation offload's saved-tensor hooks are global
                    cb.teardown(self.trainer, self.module, "fit")
        if not self.peaks:
            raise RuntimeError("the estimate's fit ended before its measured step (did max_steps stop it?)")

    # -- Lightning hooks --------------------------------------------------------------------------
    @override
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._checkpointing()
        if self.sharding.master_weights:
            trainer.strategy.optimizers = [MasterWeights.wrap(o, self.ledger) for o in trainer.strategy.optimizers]
        if self.sharding.param_dtype is not None:
            self._compute_in(self.sharding.param_dtype, pl_module)
        super().on_fit_start(trainer, pl_module)
        if self.device_model is not None:
            trains = any(p.requires_grad for p in pl_module.parameters())
            self.device_model = dataclasses.replace(self.device_model, blas_threads=2 if trains else 1)
            # cuBLAS/cuBLASLt workspaces: made at the first matmul of each thread, never freed.
            with self.ledger.section("other"):
                self._blas_workspaces = torch.empty(self.device_model.workspace_bytes, dtype=torch.uint8)
        self.follow_ranks(pl_module)  # a sharded run: the ledger's peaks are one rank's
        self._split_like_the_run(pl_module)

    @override
    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        if trainer.current_epoch == 1 and self._logging is not None:
            # As if the warm-up's epoch went on: the next batch is not an epoch's first to Lightning's
            # logging, which would otherwise renew the tensors the module logs (Lightning's
            # LightningModule.log, "if we started a new epoch").
            connector = trainer._logger_connector
            connector._first_loop_iter, connector._current_fx = self._logging

    @override
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.step_of(trainer, batch_idx) == 1 and batch_idx == 0:
            self.mode.fill_token = self._fill  # the measured step samples full-length responses
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self.step_of(trainer, batch_idx) == 0:
            connector = trainer._logger_connector
            self._logging = (connector._first_loop_iter, connector._current_fx)
        elif self.step_of(trainer, batch_idx) == 1 and batch_idx == self.accumulated - 1:
            raise MeasuredStep

    @override
    def step_description(self, accumulate: int) -> str:
        return f"micro-batch {self._shape}, {self.accumulated} of {self.accumulate} accumulated"

    # -- the shortcuts (a StepIO) -----------------------------------------------------------------
    @override
    def micro_batches(self, lengths: Any, max_tokens: int | None, *, agree_on_count: Any = None) -> list[list[int]]:
        plan = super().micro_batches(lengths, max_tokens, agree_on_count=agree_on_count)
        return plan if self.full_loops else _two_of_each_shape(plan, lengths)

    @override
    def repeats(self, items: Any) -> Any:
        # Each iteration starts where an optimizer step left the model, and so does the first one
        # of the measured step (the warm-up step ended with one): it stands for all of them.
        return items if self.full_loops else list(items)[:1]

    @override
    def generation(self, model: nn.Module) -> contextlib.AbstractContextManager:
        from lightning_mem.rl.decode import estimated_decode

        stack = contextlib.ExitStack()
        # The static decode loop (kv_cache: static) runs its first decode step only, eager.
        stack.enter_context(estimated_decode(self.mode.fill_token))
        if not (self.full_loops or not self._measuring):  # the warm-up's responses end at once anyway
            stack.enter_context(last_decode_step(self, model))
        return stack

    @override
    def rollout_engine(self, config: Any, generation: Any, **kwargs: Any) -> Any:
        if config.name != "vllm":
            return super().rollout_engine(config, generation, **kwargs)
        from lightning_mem.estimate.engine import ReservedEngine

        return ReservedEngine(generation, config, run=self, on_cuda=self.on_cuda, device_memory=self.device_memory,
                              **kwargs)

    @override
    def multi_turn_rollout(self, environment: Any, config: Any, **kwargs: Any) -> Any:
        from lightning_mem.estimate.trajectories import LongestTrajectories

        # Every trajectory to its token budget; the warm-up step's prompts are its short rows.
        return LongestTrajectories(config, kwargs["engine"], fill_token=lambda: self.mode.fill_token,
                                   prompt_tokens=lambda: getattr(self.data, "max_prompt_length", 8) if self._measuring else 8,
                                   counters=environment().counters)

    @override
    def async_client(self, spec: Any, **kwargs: Any) -> Any:
        from lightning_mem.estimate.generator import GeneratorStandIn

        self.stand_in = GeneratorStandIn(spec, run=self, **kwargs)
        return self.stand_in

    @override
    def data_pass(self, split: str) -> list[dict[str, Any]]:
        # A pass over the data before training (DPO's precompute) has the training micro-batches'
        # budget: the largest one stands for all of them (a pass without gradients leaves nothing
        # behind from one batch to the next). The recorder measures it as the phase it reports.
        batch = self.batches(self._fill)[-1]
        self._shape = self.describe(batch)
        return [batch]

    @override
    def compute_dtype(self, trainer: Any, precision_dtype: Any) -> Any:
        return self.sharding.param_dtype or precision_dtype

    @override
    def training_ranks(self, trainer: Any) -> int:
        return self.world_size

    def accounting(self) -> contextlib.AbstractContextManager:
        """What the run adds to the ledger's view for its whole length (a subclass's hooks)."""
        return contextlib.nullcontext()


def _head(batch: dict[str, Any], *, rows: int, tokens: int) -> dict[str, Any]:
    """The first ``rows`` rows of ``batch`` and their last ``tokens`` columns (a left-padded prompt
    keeps its end): a warm-up step's small micro-batch of the same layout."""

    def cut(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            value = value[:rows] if value.dim() == 1 else value[:rows, -tokens:]
            return value.clone()
        return value[:rows] if isinstance(value, list) else value

    return {key: cut(value) for key, value in batch.items()}


#: Batch keys holding flat positions into ``input_ids.view(-1)`` (a preference batch's targets and
#: sequence ends): a batch with them cannot be cut to its last columns by :func:`_head`.
FLAT_POSITIONS = ("target_positions", "sequence_ends")


def _shortened(data: Any, *, tokens: int) -> Any:
    """A copy of the datamodule ``data`` whose sequences are ``tokens`` long and whose token budget
    shrinks with them (so its largest batch holds as many sequences): its ``largest_batch`` is a
    warm-up batch of the same layout, positions and all."""
    small = copy.copy(data)
    small.max_length = min(tokens, data.max_length)
    if getattr(data, "max_tokens_per_batch", None):
        small.max_tokens_per_batch = max(data.max_tokens_per_batch * small.max_length // data.max_length, small.max_length)
    return small


def _one_row_padded(batch: dict[str, Any]) -> dict[str, Any]:
    """A prompt batch whose first row is one token shorter (left padding): real prompts differ in
    length, and ``generate`` drops an all-ones mask (then attends unmasked). The shape stays the
    largest. Batches with ``labels`` (SFT rows) are left as they are: the padded-mask model
    (:func:`~lightning_mem.estimate.cuda.padded_attention_masks`) covers their forward."""
    mask = batch.get("attention_mask")
    if "labels" in batch or not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[1] < 2:
        return batch
    mask = mask.clone()
    mask[0, 0] = 0
    return {**batch, "attention_mask": mask}


def _as_is(batch: Any) -> Any:
    return batch


class _StepPerEpoch(torch.utils.data.Sampler):
    """The estimate's batches in order, one optimizer step an epoch: the first batch (the warm-up
    step) in epoch 0, the rest (the measured step's micro-batches) in epoch 1. Lightning sets the
    epoch before each epoch's iterator is made, and steps the optimizers at an epoch's last batch
    whatever it accumulates. It has no length: Lightning then finds an epoch's last batch by
    fetching one ahead (with a length it would count to it, and epochs differ here). Also the
    look-ahead of separate placement (:meth:`~lightning_mem.batching.TokenBudgetSampler.batch_at`):
    a batch past the last is the last."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        return iter(range(1) if self.epoch == 0 else range(1, self.n))

    def batch_at(self, position: int) -> int:
        return min(position, self.n - 1)


def _two_of_each_shape(plan: list[list[int]], lengths: Any) -> list[list[int]]:
    """The micro-batches of ``plan``, at most two of each shape.

    A micro-batch's tensors are fixed by its rows' sequence lengths (every prompt of the estimate's
    batch has the same length, so its response lengths follow). Micro-batches of one shape leave
    the same live state behind them: the first a phase's outputs (and, in training, the gradients,
    allocated by its backward), the second exactly what it found. The third and later therefore
    start from the second's state and repeat its peak: skipping them changes no figure
    (``tests/estimate/test_estimate_accuracy.py`` checks it against every micro-batch run).
    """
    seen: dict[tuple[int, ...], int] = {}
    kept = []
    for idx in plan:
        key = tuple(sorted(int(lengths[i]) for i in idx))
        seen[key] = seen.get(key, 0) + 1
        if seen[key] <= 2:
            kept.append(idx)
    return kept
