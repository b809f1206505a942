"""DeepSpeed ZeRO tiers as a Lightning strategy, and phase offload for RLHF.

``ZeroStrategy`` is Lightning's ``DeepSpeedStrategy`` driven by a :class:`~.zero_config.ZeroTier`
(a preset name plus overrides, all reachable from YAML), instead of DeepSpeed's thirty-odd
constructor arguments. It adds what a tier implies:

* the DeepSpeed config is exactly ``deepspeed_config(tier, trainer precision)`` plus the batch,
  accumulation and clipping keys Lightning fills from the Trainer;
* with the optimizer offloaded, torch ``Adam``/``AdamW`` from ``configure_optimizers`` becomes
  DeepSpeed's CPU Adam (same hyperparameters, same param groups), so one YAML optimizer serves
  every tier;
* with parameters offloaded, ``deepspeed.zero.Init`` builds the model's shards on that device
  (``remote_device``), so a model larger than the GPU is never whole on it.

``deepspeed_phase_offload`` (also ``ZeroStrategy.phase_offload``) moves an engine's training
states to host memory for one phase, e.g. PPO rollouts, with DeepSpeed's own
``offload_states``/``reload_states``.

DeepSpeed is optional (``pip install 'lightning-mem[deepspeed]'``): this module imports it only
when a strategy is built or a phase is offloaded.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch.optim import Optimizer
from typing_extensions import override

from jsonargparse.typing import NonNegativeInt, PositiveInt

from lightning_mem.export import local_state_dict
from lightning_mem.settings import STRATEGY_ARGS, SettingNotSupported, SettingPathError, settings_at
from lightning_mem.strategies.zero_config import OffloadArg, ZeroStage, ZeroTier, deepspeed_config, precision_config, zero_tier

if TYPE_CHECKING:
    import deepspeed

INSTALL_HINT = "pip install 'lightning-mem[deepspeed]'"

# DeepSpeed's names for an engine's states (OffloadStateTypeEnum values).
# Everything a training step needs but a forward pass does not: the model can still generate.
TRAINING_STATES: tuple[str, ...] = ("optim_states", "hp_params", "lp_grads", "contiguous_grad_buffer")
# Also the 16-bit parameters: for an engine that sits idle through the phase.
ALL_STATES: tuple[str, ...] = TRAINING_STATES + ("lp_params",)
# ZeRO-3 moves these two only for DeepSpeed's FusedAdam (an assertion inside DeepSpeed).
_FUSED_ADAM_ONLY_AT_STAGE_3 = ("optim_states", "hp_params")


class ZeroStrategy(DeepSpeedStrategy):
    """DeepSpeed ZeRO-2/3 with optimizer and parameter offload, configured by a tier.

    Args:
        preset: a key of ``ZERO_PRESETS`` (``zero2``, ``zero2_offload``, ``zero3``,
            ``zero3_offload_optimizer``, ``zero3_offload``, ``zero3_offload_nvme``) or None.
        stage ... contiguous_gradients: override the preset; see :class:`ZeroTier`. None keeps
            the preset's value.
        cpu_adam: with the optimizer offloaded, turn torch ``Adam``/``AdamW`` into DeepSpeed's CPU
            Adam. ``False`` steps the client optimizer on the host as it is (slow).
        extra_config: raw DeepSpeed config keys merged over the generated config.
        accelerator, parallel_devices, cluster_environment, precision_plugin,
        process_group_backend, timeout, logging_level, load_full_weights,
        exclude_frozen_parameters: as in Lightning's ``DeepSpeedStrategy``.
    """

    def __init__(
        self,
        preset: str | None = None,
        *,
        stage: ZeroStage | None = None,
        offload_optimizer: OffloadArg | None = None,
        offload_params: OffloadArg | None = None,
        nvme_path: str | None = None,
        pin_memory: bool | None = None,
        reduce_bucket_size: PositiveInt | None = None,
        allgather_bucket_size: PositiveInt | None = None,
        prefetch_bucket_size: PositiveInt | None = None,
        param_persistence_threshold: NonNegativeInt | None = None,
        max_live_parameters: PositiveInt | None = None,
        sub_group_size: PositiveInt | None = None,
        overlap_comm: bool | None = None,
        contiguous_gradients: bool | None = None,
        cpu_adam: bool = True,
        extra_config: dict[str, Any] | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        logging_level: int = logging.WARN,
        load_full_weights: bool = False,
        exclude_frozen_parameters: bool = False,
    ) -> None:
        self._hf_zero3_config: Any = None
        # Validate the whole plan before DeepSpeed is even imported: a bad YAML fails in a second.
        # Every ZeroTier field is an argument of the same name here (None keeps the preset's value).
        arguments = locals()
        with settings_at(STRATEGY_ARGS):  # named where the Trainer takes them
            self.tier: ZeroTier = zero_tier(preset, **{f.name: arguments[f.name] for f in dataclasses.fields(ZeroTier)})
            _check_nvme_path(self.tier)
        self.cpu_adam = cpu_adam
        config = deepspeed_config(self.tier, cpu_adam=cpu_adam, extra_config=extra_config)
        _require_deepspeed()
        super().__init__(
            accelerator=accelerator,
            config=config,
            # zero.Init then builds each parameter's shard directly where the tier keeps it.
            remote_device=self.tier.offload_params if self.tier.offloads_params else None,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            logging_level=logging_level,
            load_full_weights=load_full_weights,
            exclude_frozen_parameters=exclude_frozen_parameters,
        )

    @override
    def _format_config(self) -> None:
        # The precision is known only once the Trainer has connected its precision plugin, and
        # both `setup` and `model_sharded_context` (zero.Init, which needs the dtype) format the
        # config through here. Adding our precision section first makes Lightning's own precision
        # formatting a no-op, so the final config is `deepspeed_config(tier, precision)` plus
        # Lightning's batch-size/accumulation/clipping keys. `setdefault`: extra_config wins.
        assert isinstance(self.config, dict)
        with settings_at("trainer"):  # the Trainer's own `precision`
            section = precision_config(self.precision_plugin.precision)
        for key, value in section.items():
            self.config.setdefault(key, value)
        super()._format_config()

    @contextmanager
    @override
    def model_sharded_context(self) -> Iterator[None]:
        # Lightning enters deepspeed.zero.Init here (stage 3), around `configure_model`. A Hugging
        # Face model loaded there must also know it is under ZeRO-3, or `from_pretrained` copies
        # checkpoint tensors into the empty placeholders zero.Init leaves behind.
        with super().model_sharded_context():
            if self.zero_stage_3:
                self._register_zero3_with_transformers()
            yield

    def _register_zero3_with_transformers(self) -> None:
        """Tell `transformers` that ZeRO-3 is on, for the lifetime of this strategy.

        transformers keeps only a weak reference to the config object, so the strategy holds it:
        loading (`from_pretrained` partitions while it loads), `resize_token_embeddings` and
        `generate` (all ranks keep stepping until every rank is done, since each forward gathers
        parameters from all of them) read it, not just model creation.
        """
        if self._hf_zero3_config is not None:
            return
        try:
            from transformers.integrations import HfDeepSpeedConfig
        except ImportError:  # transformers is a dependency, but a plain torch model needs nothing
            return
        try:
            self._hf_zero3_config = HfDeepSpeedConfig(self.config)
        except ImportError as err:  # transformers' ZeRO-3 support goes through `accelerate`
            raise ImportError(
                f"ZeRO-3 with Hugging Face models needs `accelerate` (transformers loads ZeRO-3 shards through"
                f" it): pip install accelerate. ({err})"
            ) from err

    @override
    def teardown(self) -> None:
        super().teardown()
        # transformers holds only a weak reference: dropping ours switches its ZeRO-3 mode off.
        self._hf_zero3_config = None

    @override
    def _init_optimizers(self) -> tuple[Optimizer, LRSchedulerConfig | None]:
        optimizer, scheduler = super()._init_optimizers()
        if self.tier.offloads_optimizer and self.cpu_adam:
            with settings_at(STRATEGY_ARGS):
                optimizer = to_deepspeed_cpu_adam(optimizer)
        return optimizer, scheduler

    def full_state_dict(self, module: torch.nn.Module, *, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        """The module's full state dict on CPU on rank 0 (``{}`` elsewhere); every rank must call it
        (:class:`lightning_mem.export.GathersStateDict`).

        Under ZeRO-3 each rank holds a slice of every parameter, so the export gathers them one
        submodule at a time: the device never holds more than one layer's full weights, which
        matters on the offload tiers where the whole model would not fit. ``trainable_only``: the
        trainable parameters only (a LoRA adapter); the frozen ones are not gathered.
        """
        if not self.zero_stage_3:
            return local_state_dict(module, trainable_only=trainable_only) if self.is_global_zero else {}
        import deepspeed

        state: dict[str, torch.Tensor] = {}
        for prefix, sub in module.named_modules():
            params = [(n, p) for n, p in sub.named_parameters(recurse=False) if p.requires_grad or not trainable_only]
            with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
                if self.is_global_zero:
                    for name, param in params:
                        state[f"{prefix}.{name}" if prefix else name] = param.detach().cpu().clone()
        if self.is_global_zero and not trainable_only:
            for name, buffer in module.named_buffers():
                state.setdefault(name, buffer.detach().cpu().clone())
            # Keep the module's own key order (and drop non-persistent buffers) as state_dict() would.
            state = {k: state[k] for k in module.state_dict(keep_vars=True) if k in state}
        return state

    def phase_offload(
        self,
        include: Sequence[str] = TRAINING_STATES,
        *,
        pin_memory: bool = True,
        non_blocking: bool = False,
    ) -> AbstractContextManager[None]:
        """Context manager: the engine's ``include`` states live in host memory inside the block.

        Use it around a phase that does not train this engine, e.g. PPO rollouts::

            with self.trainer.strategy.phase_offload():
                rollouts = generate(self.actor, prompts)

        See :func:`deepspeed_phase_offload`.
        """
        import deepspeed

        if not isinstance(self.model, deepspeed.DeepSpeedEngine):
            raise RuntimeError(
                "phase_offload needs the DeepSpeed engine, which exists once the Trainer has set up the strategy"
                " (inside fit/validate/predict), not before"
            )
        return deepspeed_phase_offload(self.model, include, pin_memory=pin_memory, non_blocking=non_blocking)


@contextmanager
def deepspeed_phase_offload(
    engine: deepspeed.DeepSpeedEngine,
    include: Sequence[str] = TRAINING_STATES,
    *,
    pin_memory: bool = True,
    non_blocking: bool = False,
) -> Iterator[None]:
    """Move ``engine``'s ``include`` states to host memory for the block, and back after it.

    Args:
        engine: a DeepSpeed engine with a ZeRO optimizer.
        include: DeepSpeed state names: ``optim_states`` (Adam moments), ``hp_params`` (fp32 master
            weights), ``lp_grads`` (16-bit gradient partitions), ``contiguous_grad_buffer``,
            ``lp_params`` (16-bit weights; leave them for a model that runs forward in the phase).
            Defaults to :data:`TRAINING_STATES`; :data:`ALL_STATES` adds ``lp_params``.
        pin_memory: page-locked host buffers, for faster copies both ways. DeepSpeed keeps them
            until the reload, so they cost host RAM the size of the offloaded states.
        non_blocking: asynchronous copies; the caller must synchronize before relying on them.

    The states come back in ``finally``: an exception inside the phase does not leave the engine
    unable to train. States DeepSpeed keeps on the host anyway (an offloaded optimizer) are
    skipped by DeepSpeed itself.
    """
    states = _offload_state_types(include)
    _check_phase_offload_supported(engine, include)
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    engine.offload_states(include=states, device=OffloadDeviceEnum.cpu, pin_memory=pin_memory, non_blocking=non_blocking)
    try:
        yield
    finally:
        engine.reload_states(non_blocking=non_blocking)


def to_deepspeed_cpu_adam(optimizer: Optimizer) -> Optimizer:
    """DeepSpeed's CPU Adam with ``optimizer``'s param groups and hyperparameters.

    ``optimizer`` must be a fresh (never stepped) torch ``Adam`` or ``AdamW``; a ``DeepSpeedCPUAdam``
    is returned as is. The new optimizer shares the param-group dicts of the old one, so an LR
    scheduler built on the old optimizer in ``configure_optimizers`` still sets the learning rate
    that CPU Adam reads. (torch warns once that the scheduler stepped before its optimizer: the
    old optimizer never steps.)
    """
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    if isinstance(optimizer, DeepSpeedCPUAdam):
        return optimizer
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        raise SettingNotSupported(
            "cpu_adam", f"`cpu_adam: true` with `offload_optimizer`: the optimizer steps on the host as DeepSpeed's CPU"
            f" Adam, which replaces only torch.optim.Adam/AdamW; configure_optimizers returned {type(optimizer).__qualname__}. Use"
            " torch.optim.AdamW (or deepspeed.ops.adam.DeepSpeedCPUAdam) as the optimizer, or set `cpu_adam: false`"
            " to step it on the host as it is (several times slower)", siblings=("offload_optimizer",))
    if optimizer.state:  # the strategy converts the optimizer before its first step
        raise ValueError("to_deepspeed_cpu_adam needs a fresh optimizer: Adam state cannot be carried over")
    for flag in ("amsgrad", "maximize"):
        if any(group.get(flag) for group in optimizer.param_groups):
            raise SettingNotSupported("cpu_adam", f"`cpu_adam: true`: DeepSpeed's CPU Adam does not support the"
                                      f" optimizer's {flag}=True; set it to false in the optimizer, or set `cpu_adam: false`")
    defaults = optimizer.defaults
    # torch's AdamW is Adam with decoupled weight decay; Adam(decoupled_weight_decay=True) is too.
    adamw_mode = isinstance(optimizer, torch.optim.AdamW) or bool(defaults.get("decoupled_weight_decay", False))
    return DeepSpeedCPUAdam(
        optimizer.param_groups,
        lr=float(defaults["lr"]),
        betas=tuple(defaults["betas"]),
        eps=defaults["eps"],
        weight_decay=defaults["weight_decay"],
        adamw_mode=adamw_mode,
    )


def _offload_state_types(include: Sequence[str]) -> list[Any]:
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

    known = [state.value for state in OffloadStateTypeEnum]
    if isinstance(include, str) or not include:
        raise ValueError(f"include={include!r} must be a non-empty list of state names from {known}")
    unknown = [name for name in include if name not in known]
    if unknown:
        raise ValueError(f"include has unknown state name(s) {unknown}; DeepSpeed's are {known}")
    return [OffloadStateTypeEnum(name) for name in include]


def _check_phase_offload_supported(engine: Any, include: Sequence[str]) -> None:
    import deepspeed

    optimizer = getattr(engine, "optimizer", None)
    if not callable(getattr(engine, "offload_states", None)) or not callable(getattr(optimizer, "offload_states", None)):
        raise RuntimeError(
            f"phase offload needs DeepSpeed's offload_states/reload_states for this engine's optimizer"
            f" ({type(optimizer).__qualname__}), which the installed DeepSpeed {deepspeed.__version__} does not"
            " have; upgrade DeepSpeed, and use a ZeRO stage (offload_states is a ZeRO optimizer method)"
        )
    offload_param = engine.zero_offload_param()
    if offload_param is not None and str(getattr(offload_param.device, "value", offload_param.device)) != "none":
        raise ValueError(
            "phase offload cannot move the states of an engine whose parameters are already offloaded"
            " (offload_params); its parameters and optimizer state live on the host already"
        )
    cpu_optimizer = engine.zero_use_cpu_optimizer()  # DeepSpeed skips optimizer states there
    fused_only = [name for name in include if name in _FUSED_ADAM_ONLY_AT_STAGE_3]
    if engine.zero_optimization_stage() == 3 and not cpu_optimizer and fused_only:
        from deepspeed.ops.adam import FusedAdam

        basic = getattr(optimizer, "optimizer", None)
        if not isinstance(basic, FusedAdam):
            raise ValueError(
                f"at ZeRO stage 3, DeepSpeed offloads {fused_only} only for its FusedAdam, but the optimizer is"
                f" {type(basic).__qualname__}: use deepspeed.ops.adam.FusedAdam as the optimizer, or leave"
                f" {fused_only} out of include"
            )


def _require_deepspeed() -> None:
    try:
        import deepspeed  # noqa: F401
    except ImportError as err:
        raise SettingNotSupported("trainer.strategy", f": ZeroStrategy needs DeepSpeed, an optional extra: {INSTALL_HINT}"
                                  ) from err


def _check_nvme_path(tier: ZeroTier) -> None:
    # DeepSpeed creates its swap files under nvme_path only once the engine is built, minutes in.
    if tier.nvme_path is not None and not os.path.isdir(tier.nvme_path):
        raise SettingPathError("nvme_path", f" {tier.nvme_path!r} is not a directory")
