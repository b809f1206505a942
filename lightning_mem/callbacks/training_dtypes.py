"""One line at the start of a run: the dtypes it really trains, keeps and computes in.

A config says ``precision: bf16-mixed``; whether the trained weights are fp32 depends on how each
model was loaded (a bf16 checkpoint stays bf16 unless something casts it), and what an optimizer
keeps depends on its class (AdamW's moments follow their parameter; 8-bit states are uint8 codes
with fp32 scales). So the line is observed, not derived from the config: the parameters as they
are, the gradients the first optimizer step consumes, the optimizer state once that step has made
it, and the dtypes the trained models' linear layers return in the first training batch.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_mem.compile import hold_eager
from lightning_mem.callbacks.optimizer_state_offload import unwrap_optimizer
from lightning_mem.dtypes import dtype_name
from lightning_mem.offload import local_tensor
from lightning_mem.optim import optimizer_state_bytes_by_dtype


def _millions(count: int) -> str:
    return f"{count / 1e6:.2f}M"


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


def _counts(counts: Counter, note: str = "") -> str:
    return ", ".join(f"{dtype_name(d)} ({_millions(n)}{note})" for d, n in counts.most_common())


def _shares(counts: Counter) -> str:
    """``bfloat16``, or ``bfloat16 + float32 (0.4 %)``: the dtypes by the elements they produced."""
    total = sum(counts.values())
    (main, _), *rest = counts.most_common()
    return " + ".join([dtype_name(main)] + [f"{dtype_name(d)} ({100 * n / total:.2g} %)" for d, n in rest])


@dataclass
class DtypeReport:
    """What :class:`TrainingDtypes` observed (this rank's tensors)."""

    precision: str
    trainable: Counter = field(default_factory=Counter)  # dtype -> parameters
    gradients: set = field(default_factory=set)
    optimizer_state: dict = field(default_factory=dict)  # dtype -> bytes
    compute: Counter = field(default_factory=Counter)  # dtype -> elements the trained models' linear layers returned
    frozen: dict = field(default_factory=dict)  # top-level module -> Counter(dtype -> parameters)

    def line(self) -> str:
        # Largest first: AdamW's moments, or an 8-bit optimizer's uint8 codes before its fp32 scales.
        state = " + ".join(f"{dtype_name(d)} {_size(n)}"
                           for d, n in sorted(self.optimizer_state.items(), key=lambda kv: -kv[1])) or "none"
        text = (f"dtypes under precision {self.precision}: trainable parameters {_counts(self.trainable) or 'none'}, "
                f"gradients {' + '.join(sorted(dtype_name(d) for d in self.gradients)) or 'none'}, "
                f"optimizer state {state}, compute {_shares(self.compute) if self.compute else '?'}")
        if self.frozen:
            trained = set(self.trainable)
            parts = []
            for name, counts in self.frozen.items():
                # A frozen model held narrower than what trains, in what the matmuls run in anyway.
                note = "; the compute dtype, to save memory" if (
                    set(counts) <= set(self.compute) and not set(counts) & trained) else ""
                parts.append(f"{name} {_counts(counts, note)}")
            text += "; frozen: " + "; ".join(parts)
        return text


class TrainingDtypes(Callback):
    """Log once, after the first optimizer step, the dtypes of the trainable parameters, their
    gradients, the optimizer state and the compute, and of every frozen model.

    - trainable parameters: by dtype, as held (an FSDP2 shard's local dtype);
    - gradients: as the first optimizer step receives them (with the optimizer-in-backward
      callback, which frees each one before any hook sees them all: the parameters' dtype, which
      autograd gives every gradient);
    - optimizer state: bytes per dtype once the first step has created it (step counters, 0-dim
      float32 tensors whatever the precision, left out);
    - compute: the dtypes the linear layers of every model that trains return in the first
      training batch (autocast's, FSDP2's ``param_dtype``, a 4-bit layer's ``compute_dtype``), the
      less used ones with their share of the elements (a value head computes in fp32 by design).
      Observed through a global forward hook, so the step runs as it always does: an output layer
      that :mod:`lightning_mem.logits` multiplies in directly (the fused path, in the dtype
      ``F.linear`` would use) is not called, and not counted;
    - frozen: the parameters that take no update, per top-level submodule (``reference``,
      ``reward_model``, a LoRA base inside ``model``).

    :attr:`report` keeps what was observed. The recipes add this callback themselves
    (``configure_callbacks``); add it to a Lightning run of your own the same way.
    """

    def __init__(self) -> None:
        self.report: Optional[DtypeReport] = None
        self._gradients: set[torch.dtype] = set()
        self._compute: Counter = Counter()
        self._hooks: list[Any] = []
        self._watched: set[int] = set()
        self._hold = f"TrainingDtypes@{id(self):x}"

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self.report is not None or self._hooks:
            return
        for _, child in pl_module.named_children():
            if any(p.requires_grad for p in child.parameters()):
                self._watched |= {id(m) for m in child.modules() if isinstance(m, nn.Linear)}
        # NOTE: one global forward hook, not a hook on each layer: a layer's own hooks change how the
        # step runs it (lightning_mem.logits reads a hook-free output layer's weight directly, and
        # calls a hooked one as a module), so the first batch of every run -- a resumed one's too --
        # would take another path than the others and differ from them in the last bits.
        handle = nn.modules.module.register_module_forward_hook(self._record_compute)
        self._hooks.append(handle)
        # Compiled blocks (CompileBlocks) run eager while the hook is on: traced, it would make each
        # block recompile until dynamo gives up compiling them for the whole run.
        hold_eager(self._hold, alive=lambda: handle.id in (handle.hooks_dict_ref() or {}))

    def _record_compute(self, module: nn.Module, args: Any, output: Any) -> None:
        if id(module) not in self._watched or not (isinstance(output, torch.Tensor) and output.is_floating_point()):
            return
        dtype = output.dtype
        # A 4-bit/8-bit layer multiplies in its compute_dtype (autocast's, under autocast) and
        # hands its output back in the input's dtype.
        compute_dtype = getattr(module, "compute_dtype", None)
        if isinstance(compute_dtype, torch.dtype):
            device = output.device.type
            dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else compute_dtype
        self._compute[dtype] += output.numel()

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self.report is None:  # every optimizer of the first step (PPO's actor and critic)
            self._gradients |= {local_tensor(p.grad).dtype for group in unwrap_optimizer(optimizer).param_groups
                                for p in group["params"] if p.grad is not None}

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self.report is not None or trainer.global_step == 0:
            return  # before the first optimizer step (gradient accumulation): no state yet
        self._stop_watching()
        self.report = self.observe(trainer, pl_module)
        rank_zero_info(self.report.line())

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop_watching()  # a run that ends before its first optimizer step leaves no global hook behind

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Lightning calls no teardown after an exception: a run that fails in its first batch would
        # leave the global hook on every module of the process (and compiled blocks eager).
        self._stop_watching()

    def _stop_watching(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._watched.clear()
        hold_eager(self._hold, False)

    def observe(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> DtypeReport:
        report = DtypeReport(str(trainer.precision), compute=Counter(self._compute))
        for name, child in pl_module.named_children():
            frozen: Counter = Counter()
            for param in child.parameters():
                dtype = local_tensor(param).dtype
                if param.requires_grad:
                    report.trainable[dtype] += param.numel()
                else:
                    frozen[dtype] += param.numel()
            if frozen:
                report.frozen[name] = frozen
        report.gradients = self._gradients or set(report.trainable)
        optimizers = [unwrap_optimizer(o) for o in trainer.optimizers]
        for callback in trainer.callbacks:  # the optimizer-in-backward callback steps optimizers of its own
            optimizers += list(getattr(getattr(callback, "stepper", None), "optimizers", {}).values())
        state: Counter = Counter()
        for optimizer in optimizers:
            state.update(optimizer_state_bytes_by_dtype(optimizer, scalars=False))
        report.optimizer_state = dict(state)
        return report
