"""ZeRO tiers: named presets and the DeepSpeed config dict each one produces.

A tier is the memory plan of a DeepSpeed run: the ZeRO stage, where optimizer state and
parameters live (GPU, CPU or NVMe), and the communication bucket sizes. ``zero_tier`` resolves a
preset name plus overrides into a validated :class:`ZeroTier`; ``deepspeed_config`` turns a tier
and the Trainer's precision into DeepSpeed's JSON config. Both are pure functions of their
arguments and import nothing from DeepSpeed, so the exact dicts are tested where DeepSpeed is not
installed. :class:`lightning_mem.strategies.deepspeed.ZeroStrategy` is their only runtime user.

DeepSpeed config reference: https://www.deepspeed.ai/docs/config-json/
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args

from jsonargparse.typing import NonNegativeInt, PositiveInt

from lightning_mem.settings import SettingError, field_problems

OffloadDevice = Literal["none", "cpu", "nvme"]
# What a user may write in YAML: `offload_optimizer: cpu`, or `true` as a short form of `cpu`.
OffloadArg = Union[bool, Literal["none", "cpu", "nvme"]]
ZeroStage = Literal[2, 3]

_OFFLOAD_DEVICES: tuple[str, ...] = get_args(OffloadDevice)

# DeepSpeed's own stage-2/3 defaults, written out so a config dict states every choice it makes.
DEFAULT_BUCKET_SIZE = 500_000_000
DEFAULT_PREFETCH_BUCKET_SIZE = 50_000_000
DEFAULT_PARAM_PERSISTENCE_THRESHOLD = 100_000
DEFAULT_MAX_LIVE_PARAMETERS = 1_000_000_000
DEFAULT_SUB_GROUP_SIZE = 1_000_000_000

# NVMe (ZeRO-Infinity) buffer pools. Optimizer: at least one buffer per Adam tensor
# (fp32 param, grad, exp_avg, exp_avg_sq). Params: DeepSpeed's defaults.
NVME_OPTIMIZER_BUFFER_COUNT = 4
NVME_PARAM_BUFFER_COUNT = 5
NVME_PARAM_BUFFER_SIZE = 100_000_000
NVME_PARAM_MAX_IN_CPU = 1_000_000_000

# Dynamic loss scaling for fp16, DeepSpeed's defaults (bf16 needs none).
FP16_LOSS_SCALING = {
    "loss_scale": 0,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "min_loss_scale": 1,
}

_BF16_PRECISIONS = ("bf16-mixed", "bf16-true")
_FP16_PRECISIONS = ("16-mixed", "16-true")
_FP32_PRECISIONS = ("32-true",)


@dataclass(frozen=True)
class ZeroTier:
    """A validated ZeRO memory plan. Build one with :func:`zero_tier`.

    Args:
        stage: 2 shards gradients and optimizer state across GPUs (every GPU keeps the full 16-bit
            parameters); 3 also shards the parameters and gathers each layer just in time.
        offload_optimizer: ``"cpu"`` or ``"nvme"`` keeps fp32 master weights, gradients and Adam
            state off the GPU, and DeepSpeed steps the optimizer there (CPU Adam).
        offload_params: ``"cpu"`` or ``"nvme"`` keeps the 16-bit parameter shards off the GPU
            (stage 3 only).
        nvme_path: directory on a fast local NVMe drive; required for ``"nvme"`` offload.
        pin_memory: page-lock the host buffers of offloaded state; faster copies, but the pinned
            memory cannot be swapped and counts against host RAM.
        reduce_bucket_size: elements reduced per gradient all-reduce/reduce-scatter bucket.
        allgather_bucket_size: elements per parameter all-gather after the step (stage 2).
        prefetch_bucket_size: elements of upcoming layers gathered ahead of use (stage 3).
        param_persistence_threshold: parameters smaller than this stay whole on every GPU
            (stage 3); avoids gathering many tiny tensors (norms, biases).
        max_live_parameters: cap on gathered parameter elements alive at once (stage 3).
        sub_group_size: elements per optimizer step sub-group (stage 3); smaller lowers the peak
            of offloaded optimizer steps.
        overlap_comm: overlap gradient reduction with backward; faster, but keeps several
            reduce buckets alive on the GPU at once (lower the bucket sizes if that hurts).
        contiguous_gradients: copy gradients into one buffer as they are produced, so the reduce
            and the step do not fragment memory.
    """

    stage: ZeroStage = 2
    offload_optimizer: OffloadDevice = "none"
    offload_params: OffloadDevice = "none"
    nvme_path: str | None = None
    pin_memory: bool = True
    reduce_bucket_size: PositiveInt = DEFAULT_BUCKET_SIZE
    allgather_bucket_size: PositiveInt = DEFAULT_BUCKET_SIZE
    prefetch_bucket_size: PositiveInt = DEFAULT_PREFETCH_BUCKET_SIZE
    param_persistence_threshold: NonNegativeInt = DEFAULT_PARAM_PERSISTENCE_THRESHOLD
    max_live_parameters: PositiveInt = DEFAULT_MAX_LIVE_PARAMETERS
    sub_group_size: PositiveInt = DEFAULT_SUB_GROUP_SIZE
    overlap_comm: bool = True
    contiguous_gradients: bool = True

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def offloads_optimizer(self) -> bool:
        return self.offload_optimizer != "none"

    @property
    def offloads_params(self) -> bool:
        return self.offload_params != "none"


# The tiers a YAML can name with `preset:`; any field can still be overridden next to it.
ZERO_PRESETS: dict[str, dict[str, Any]] = {
    # Multi-GPU, model + activations fit once optimizer state and grads are sharded.
    "zero2": {"stage": 2},
    # Multi-GPU, also moves fp32 master weights and Adam state to host RAM (ZeRO-Offload).
    "zero2_offload": {"stage": 2, "offload_optimizer": "cpu"},
    # Parameters sharded too: for models whose 16-bit weights alone crowd one GPU.
    "zero3": {"stage": 3},
    "zero3_offload_optimizer": {"stage": 3, "offload_optimizer": "cpu"},
    # Everything but the working layer on the host: a model that fits only with offload.
    "zero3_offload": {"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"},
    # ZeRO-Infinity: host RAM is not enough either; needs nvme_path.
    "zero3_offload_nvme": {"stage": 3, "offload_optimizer": "nvme", "offload_params": "nvme"},
}


def zero_tier(preset: str | None = None, **overrides: Any) -> ZeroTier:
    """Resolve ``preset`` (a key of :data:`ZERO_PRESETS`, or None for the defaults) plus the
    overrides that are not None into a validated :class:`ZeroTier`.

    ``offload_optimizer``/``offload_params`` accept ``True``/``False`` as ``"cpu"``/``"none"``.
    """
    if preset is not None and preset not in ZERO_PRESETS:
        raise SettingError("preset", f" {preset!r} is not a ZeRO preset; choose one of {sorted(ZERO_PRESETS)}")
    fields = {f.name for f in dataclasses.fields(ZeroTier)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise TypeError(f"unknown ZeRO tier argument(s) {unknown}; known: {sorted(fields)}")
    values = dict(ZERO_PRESETS[preset]) if preset is not None else {}
    values.update({key: value for key, value in overrides.items() if value is not None})
    for key in ("offload_optimizer", "offload_params"):
        if key in values:
            values[key] = _offload_device(key, values[key])
    return ZeroTier(**values)


def deepspeed_config(
    tier: ZeroTier,
    precision: str | None = None,
    *,
    cpu_adam: bool = True,
    extra_config: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The DeepSpeed config dict for ``tier`` under the Trainer's ``precision``.

    Args:
        tier: the memory plan.
        precision: the Trainer's precision string; ``None`` leaves the precision section out (the
            strategy adds it once the Trainer has connected its precision plugin).
        cpu_adam: with an offloaded optimizer, insist on DeepSpeed's CPU Adam (DeepSpeed's default,
            and the strategy converts torch Adam/AdamW to it). ``False`` lets DeepSpeed step any
            client optimizer on the host instead, several times slower than CPU Adam.
        extra_config: raw DeepSpeed keys merged last (nested dicts merged key by key), for the
            settings a tier does not name.

    Batch size, gradient accumulation and clipping are left out: Lightning fills them from the
    Trainer (``accumulate_grad_batches``, ``gradient_clip_val``) and refuses them here.
    """
    config: dict[str, Any] = {
        # Lightning hands DeepSpeed the optimizer from `configure_optimizers` (torch AdamW, or a
        # bitsandbytes one); DeepSpeed otherwise refuses every optimizer but its own under ZeRO.
        "zero_allow_untested_optimizer": True,
        "zero_optimization": _zero_section(tier),
    }
    if tier.offloads_optimizer and not cpu_adam:
        config["zero_force_ds_cpu_optimizer"] = False
    if precision is not None:
        config.update(precision_config(precision))
    if extra_config:
        _deep_merge(config, extra_config)
    return config


def precision_config(precision: str) -> dict[str, Any]:
    """DeepSpeed's precision section for a Lightning precision string ("bf16-true", ...)."""
    if precision in _BF16_PRECISIONS:
        return {"bf16": {"enabled": True}}
    if precision in _FP16_PRECISIONS:
        return {"fp16": {"enabled": True, **FP16_LOSS_SCALING}}
    if precision in _FP32_PRECISIONS:
        return {}
    supported = _BF16_PRECISIONS + _FP16_PRECISIONS + _FP32_PRECISIONS
    raise SettingError("precision", f" {precision!r} is not supported with DeepSpeed; use one of {list(supported)}")


def _zero_section(tier: ZeroTier) -> dict[str, Any]:
    zero: dict[str, Any] = {
        "stage": tier.stage,
        "overlap_comm": tier.overlap_comm,
        "contiguous_gradients": tier.contiguous_gradients,
        "reduce_bucket_size": tier.reduce_bucket_size,
    }
    if tier.stage == 2:
        zero.update({
            "reduce_scatter": True,
            "allgather_partitions": True,
            "allgather_bucket_size": tier.allgather_bucket_size,
        })
    else:
        zero.update({
            "stage3_prefetch_bucket_size": tier.prefetch_bucket_size,
            "stage3_param_persistence_threshold": tier.param_persistence_threshold,
            "stage3_max_live_parameters": tier.max_live_parameters,
            "sub_group_size": tier.sub_group_size,
        })
    if tier.offloads_optimizer:
        zero["offload_optimizer"] = _offload_section(tier, tier.offload_optimizer, params=False)
    if tier.offloads_params:
        zero["offload_param"] = _offload_section(tier, tier.offload_params, params=True)
    return zero


def _offload_section(tier: ZeroTier, device: str, *, params: bool) -> dict[str, Any]:
    section: dict[str, Any] = {"device": device, "pin_memory": tier.pin_memory}
    if device != "nvme":
        return section
    section["nvme_path"] = tier.nvme_path
    if params:
        section.update({
            "buffer_count": NVME_PARAM_BUFFER_COUNT,
            "buffer_size": NVME_PARAM_BUFFER_SIZE,
            "max_in_cpu": NVME_PARAM_MAX_IN_CPU,
        })
    else:
        section["buffer_count"] = NVME_OPTIMIZER_BUFFER_COUNT
    return section


def _offload_device(name: str, value: Any) -> str:
    if value is True:
        return "cpu"
    if value is False:
        return "none"
    if value not in _OFFLOAD_DEVICES:
        raise SettingError(name, f" {value!r} is not an offload device; use one of {list(_OFFLOAD_DEVICES)} (or true/false)")
    return value


def _validate(tier: ZeroTier) -> None:
    # Each field's type and range is its annotation (the CLI checks them while parsing the
    # strategy's arguments); named here as the arguments zero_tier and the strategy take.
    for name, value, problem in field_problems(tier):
        raise SettingError(name, f" {problem}, got {value!r}")
    if tier.offloads_params and tier.stage != 3:
        raise SettingError(
            "offload_params",
            f"`offload_params: {tier.offload_params}` needs `stage: 3`: at stage {tier.stage} every GPU keeps the full"
            " 16-bit parameters, so there is nothing sharded to offload. Set `stage: 3`, or `offload_params: none`",
            siblings=("stage",))
    uses_nvme = "nvme" in (tier.offload_optimizer, tier.offload_params)
    if uses_nvme and not tier.nvme_path:
        raise SettingError("nvme_path", " is required when `offload_optimizer` or `offload_params` is 'nvme'",
                           siblings=("offload_optimizer", "offload_params"))
    if tier.nvme_path and not uses_nvme:
        raise SettingError(
            "nvme_path", f" {tier.nvme_path!r} is set but nothing is offloaded to NVMe; set `offload_optimizer` and/or"
            " `offload_params` to 'nvme', or drop it", siblings=("offload_optimizer", "offload_params"))


def _deep_merge(base: dict[str, Any], extra: Mapping[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _deep_merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
