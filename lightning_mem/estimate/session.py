"""Run a recipe config's own fit on fake tensors and record each phase's memory.

The steps, in the order the estimate takes them:

1. parse the config with the recipe's own LightningCLI parser (nothing is instantiated but the
   LightningModule, its datamodule and the strategy, precision and callbacks of the trainer section);
2. point every model of the config (policy, critic, reward model) at a folder holding only its
   ``config.json`` (a hub id resolves to ``assets/hub/<id>``), so the recipe's ``configure_model``
   builds it with random init -- on fake tensors, so nothing is allocated or read;
3. run Lightning's own ``Trainer.fit`` of the module (:class:`EstimateRun`): one CPU process with the
   config's precision plugin, clipping and accumulation and its technique callbacks; its data are
   the datamodule's ``largest_batch``: a short warm-up step, then the largest micro-batch the config
   allows. The module's own hooks and steps run (``configure_model``, ``configure_optimizers``,
   ``training_step``, backward, optimizer step, ``zero_grad``), so a recipe -- or a user's subclass
   of one -- is estimated as itself;
4. record, per phase the step reports (or for the whole step), the peak of live tensor bytes and
   its breakdown (:mod:`.tracker`), then stop the fit.

Sharding strategies (FSDP2, DeepSpeed ZeRO) run here as one unsharded process; their per-rank
bytes are derived from the measured weights, gradients and optimizer state (see
:func:`shard_per_rank`). For FSDP2 the derivation is the ledger's per-rank view, applied at every
allocation (a rank peaks where its own bytes do, not where the unsharded process does), with the
gradients followed unit by unit as FSDP2 reduce-scatters them (:class:`_GradientFlight`) and each
model's root unit gathered only while that model runs. :func:`~lightning_mem.estimate.measure_fit`
runs the config's real fit on 2 ranks to hold it to what each rank holds.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import inspect
import json
import math
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning.pytorch import Callback
from typing_extensions import override

from lightning_mem.assets import ASSETS, HUB_ASSETS
from lightning_mem.estimate.cuda import CudaDeviceModel
from lightning_mem.estimate.tracker import HOST, MemoryLedger, TrackingMode
from lightning_mem.offload import local_tensor
from lightning_mem.step_io import StepIO

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
_RECIPES = {"sft": "recipes.sft", "qlora": "recipes.qlora", "ppo": "recipes.ppo"}


@dataclass
class PhaseEstimate:
    """One phase on one rank: the device peak, its breakdown and the host bytes."""

    phase: str
    device_peak_bytes: int
    device_breakdown_bytes: dict[str, int]
    host_peak_bytes: int
    shape: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class Estimate:
    config: str
    recipe: str
    world_size: int
    strategy: str
    phases: list[PhaseEstimate] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    parsed: Any = field(default=None, repr=False)  # the parsed config (for suggestions)
    #: bytes of paged optimizer state in CUDA managed memory (counted on the host, not in the phases'
    #: device peaks, but for the largest parameter's pages in the train phase)
    paged_state_bytes: int = 0

    @property
    def device_peak_bytes(self) -> int:
        return max(p.device_peak_bytes for p in self.phases)

    @property
    def host_peak_bytes(self) -> int:
        return max(p.host_peak_bytes for p in self.phases)


# ---------------------------------------------------------------------------------------------
# 1. Parse
# ---------------------------------------------------------------------------------------------


def recipe_for(config: str | Path, recipe: str | None = None) -> str:
    """The recipe module of a config: ``recipe`` if given, else from ``configs/<recipe>/``."""
    if recipe is not None:
        return _RECIPES.get(recipe, recipe)
    parent = Path(config).resolve().parent.name
    if parent not in _RECIPES:
        raise ValueError(
            f"--config {config}: cannot tell its recipe from the folder {parent!r}; pass --recipe "
            f"({', '.join(_RECIPES)} or a module path)"
        )
    return _RECIPES[parent]


def recipe_parts(module_name: str) -> tuple[Any, type, type, type]:
    """The recipe's CLI class, LightningModule class and LightningDataModule class, found in it."""
    from lightning.pytorch import LightningDataModule, LightningModule
    from lightning.pytorch.cli import LightningCLI

    mod = importlib.import_module(module_name)
    classes = [v for v in vars(mod).values() if inspect.isclass(v)]
    modules = [c for c in classes if issubclass(c, LightningModule) and c.__module__ == module_name]
    datas = [c for c in classes if issubclass(c, LightningDataModule)]
    if len(modules) != 1 or not datas:
        raise ValueError(f"{module_name}: expected one LightningModule and a datamodule, found {modules} {datas}")
    return mod, _cli_class(modules[0]), modules[0], datas[0]


def _cli_class(module_class: type) -> type:
    """The CLI a recipe runs under: the one defined in or imported by the module of the recipe
    class, else of its nearest parent recipe (a user's subclass in a file of its own runs under its
    parent's). Looked up, not imported: ``lightning_mem.cli`` itself calls the estimator."""
    from lightning.pytorch.cli import LightningCLI

    for cls in module_class.__mro__:
        found = [v for v in vars(importlib.import_module(cls.__module__)).values()
                 if inspect.isclass(v) and issubclass(v, LightningCLI)]
        # The most derived one (a module that imports RecipeCLI also sees LightningCLI, its base).
        found = [c for c in found if not any(o is not c and issubclass(o, c) for o in found)]
        if found:
            return found[0]
    return LightningCLI


def parse_config(recipe_module: str, args: list[str]) -> tuple[Any, Any, type]:
    """Parse ``args`` (``--config ...`` and overrides) with the recipe's own CLI; instantiate nothing."""
    _, cli_class, module_class, data_class = recipe_parts(recipe_module)

    class _ParseOnly(cli_class):  # type: ignore[misc, valid-type]
        def instantiate_classes(self) -> None:
            pass

    cli = _ParseOnly(module_class, data_class, args=args, run=False, save_config_callback=None)
    return cli, cli.config, module_class


# ---------------------------------------------------------------------------------------------
# 2. Models from config.json only
# ---------------------------------------------------------------------------------------------


def config_folder(name_or_path: str, key: str) -> Path:
    """The folder whose config.json describes ``name_or_path`` (a local folder, or a shipped hub id)."""
    from lightning_mem.models import check_model_source

    if check_model_source(name_or_path, key=key) == "local":
        return Path(name_or_path).expanduser()
    shipped = HUB_ASSETS / name_or_path
    if (shipped / "config.json").is_file():
        return shipped
    raise FileNotFoundError(
        f"`{key}`: no config.json is shipped for the hub id {name_or_path!r} (looked in {shipped}); "
        "pass a local folder that holds its config.json"
    )


def config_only_copy(name_or_path: str, key: str, workdir: Path) -> str:
    """A folder with the model's config.json (and a tokenizer) but no weights."""
    source = config_folder(name_or_path, key)
    target = workdir / key.replace(".", "_")
    target.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        if (source / name).is_file():
            shutil.copy(source / name, target / name)
    # The estimate needs a tokenizer only for its special token ids and to decode responses.
    tokenizer_source = source if (source / "tokenizer.json").is_file() else ASSETS / "tiny-llama"
    for name in _TOKENIZER_FILES:
        if (tokenizer_source / name).is_file():
            shutil.copy(tokenizer_source / name, target / name)
    return str(target)


#: Where a recipe config names its models (the policy; PPO's critic and reward model).
MODEL_KEYS = (("", "model.name_or_path"), ("critic", "model.critic.name_or_path"),
              ("reward_model", "model.reward_model.name_or_path"))


def _model_locations(model_cfg: Any) -> Iterator[tuple[Any, str]]:
    """``(section holding name_or_path, its key)`` for every model the config names."""
    for attr, key in MODEL_KEYS:
        holder = getattr(model_cfg, attr, None) if attr else model_cfg
        if holder is not None and getattr(holder, "name_or_path", None):
            yield holder, key


def model_vocab_sizes(model_cfg: Any) -> list[int]:
    """The vocabulary size of every model the config names (a ``[..., vocab]`` tensor is logits)."""
    sizes = []
    for holder, key in _model_locations(model_cfg):
        config = json.loads((config_folder(holder.name_or_path, key) / "config.json").read_text())
        sizes.append(int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size", 0)))
    return sizes


def _localize_models(model_cfg: Any, workdir: Path) -> list[int]:
    """Point every model location of ``model_cfg`` at a config-only copy; return the vocabulary sizes."""
    vocab = model_vocab_sizes(model_cfg)
    for holder, key in _model_locations(model_cfg):
        holder.name_or_path = config_only_copy(holder.name_or_path, key, workdir)
    return vocab


def instantiate(cli: Any, cfg: Any) -> Any:
    """The parsed config's objects (module, datamodule, the trainer section's strategy and
    callbacks), made by the recipe CLI's own parser; the Trainer itself is not made."""
    return cli.parser.instantiate_classes(cfg)


def _build_object(value: Any) -> Any:
    """``class_path``/``init_args`` (a Namespace or dict) to an object; anything else as it is."""
    from jsonargparse import Namespace

    if isinstance(value, Namespace):
        value = value.as_dict()
    if isinstance(value, dict) and "class_path" in value:
        module_name, _, name = value["class_path"].rpartition(".")
        cls = getattr(importlib.import_module(module_name), name)
        args = {k: _build_object(v) for k, v in (value.get("init_args") or {}).items()}
        return cls(**args)
    return value


# ---------------------------------------------------------------------------------------------
# 3. Precision and strategy
# ---------------------------------------------------------------------------------------------


def precision_plugin(precision: Any) -> Any:
    from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision

    value = str(precision)
    if value in ("32", "32-true", "64-true"):
        return Precision()
    if value in ("bf16-true", "16-true", "bf16", "16"):
        return HalfPrecision("bf16-true" if value.startswith("bf16") else "16-true")
    if value in ("bf16-mixed", "16-mixed"):
        # Autocast on the device the estimate runs on (CPU); the dtypes are those of the GPU run.
        return MixedPrecision("bf16-mixed", device="cpu")
    raise ValueError(f"`trainer.precision`: the estimator does not know {precision!r}")


@dataclass
class Sharding:
    """How a strategy divides weights, gradients and optimizer state over ranks, and offloads them."""

    name: str = "single device"
    shard: tuple[str, ...] = ()  # categories divided by the world size
    host: tuple[str, ...] = ()  # categories kept in host memory
    gathered_units: int = 0  # largest units held unsharded at once on the device (FSDP2/ZeRO-3)
    # In a forward, if more (0: as many): FSDP2 keeps a unit's flat all-gather output until the next
    # unit's is copied out (to overlap them), so beside the computing unit's parameters two flat
    # unit-sized buffers can be alive (measured on 2 gloo ranks: tests/estimate/test_estimate_accuracy.py).
    forward_gathered_units: int = 0
    # DeepSpeed ZeRO: the optimizer steps fp32 master copies of 16-bit weights (see
    # :class:`_MasterWeights`), and gradients pass through reduce buckets of this many elements.
    master_weights: bool = False
    bucket_elements: int = 0
    # Gradients are reduce-scattered unit by unit as backward leaves each unit (FSDP2): until then a
    # unit's gradients are whole on the device, and its reduce-scatter input stays allocated until
    # the next unit reduces (see :class:`_GradientFlight`).
    unit_gradients: bool = False
    # FSDP2's mixed precision: units are gathered, and compute, in ``param_dtype``; gradients are
    # reduce-scattered in ``reduce_dtype`` (None: ``param_dtype``) onto shards of the parameters' own dtype.
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    # FSDP2's reshard_after_forward: True frees a unit after its forward; False keeps a trained
    # model's units gathered from their forward until their backward; an int k keeps a 1/k copy.
    reshard_after_forward: bool | int = True
    # FSDP2Strategy's tensor and context parallelism (lightning_mem/strategies/tensor_parallel.py,
    # lightning_mem/context_parallel.py). Weights, gradients and optimizer state stay 1/world_size
    # per rank: the plan splits every layer, embeddings and output layer included, over the
    # tensor-parallel ranks, and FSDP2 shards those pieces over the data x context ranks (the
    # replicated norms are ignored). What FSDP2 gathers, and the gradients it has yet to reduce, are
    # a unit's tensor-parallel piece: 1/tensor_parallel. Outside generation each rank runs
    # 1/context_parallel of every sequence: activations and logits divide by it (Ulysses trades the
    # attention kernel's sequence for heads: the same bytes); with ``sequence_parallel`` the
    # activations divide by the tensor-parallel size too (heads and MLP columns inside the regions,
    # sequence shards between them); without it they are counted whole (an upper bound: the local
    # heads and columns would be smaller). The logits are whole over the vocabulary (the output
    # layer gathers them). Generation runs whole sequences on every rank of a context group, through
    # the split model: its KV cache holds 1/tensor_parallel of the key/value heads.
    tensor_parallel: int = 1
    context_parallel: int = 1
    sequence_parallel: bool = False


def sharding_of(strategy: Any) -> Sharding:
    if strategy is None:
        return Sharding()
    name = type(strategy).__name__
    if hasattr(strategy, "_cpu_offload") and hasattr(strategy, "_reshard_after_forward"):  # FSDP2Strategy
        cats = ("weights", "gradients", "optimizer_state")
        reshard = strategy._reshard_after_forward
        precision = f", compute in {str(strategy._param_dtype).removeprefix('torch.')}" if strategy._param_dtype else ""
        tp, cp = getattr(strategy, "tensor_parallel_size", 1), getattr(strategy, "context_parallel_size", 1)
        sp = getattr(strategy, "sequence_parallel", False)
        split = (f" + TP {tp}" + (" (sequence parallel)" if sp else "") if tp > 1 else "") + (f" + CP {cp}" if cp > 1 else "")
        return Sharding("FSDP2" + split + (" + CPU offload" if strategy.cpu_offload else "") + precision, cats,
                        cats if strategy.cpu_offload else (), gathered_units=2, forward_gathered_units=3,
                        unit_gradients=True, param_dtype=strategy._param_dtype, reduce_dtype=strategy._reduce_dtype,
                        reshard_after_forward=reshard, tensor_parallel=tp, context_parallel=cp, sequence_parallel=sp)
    tier = getattr(strategy, "tier", None)
    if tier is not None:  # ZeroStrategy
        shard = ("gradients", "optimizer_state") + (("weights",) if tier.stage == 3 else ())
        # With the optimizer offloaded, each rank's reduced gradient partition goes to the host too,
        # where CPU Adam steps it; only the reduce buckets stay on the device.
        host = (("gradients", "optimizer_state") if tier.offloads_optimizer else ()) + (
            ("weights",) if tier.offloads_params else ())
        # Stage 2 with overlap_comm alternates two reduce buckets; stage 3 keeps one.
        buckets = 2 if tier.stage == 2 and tier.overlap_comm else 1
        return Sharding(f"DeepSpeed ZeRO-{tier.stage}" + (" + offload" if host else ""), shard, host,
                        gathered_units=2 if tier.stage == 3 else 0, master_weights=True,
                        bucket_elements=buckets * tier.reduce_bucket_size)
    return Sharding(name)


#: bitsandbytes' state buffers that a paged optimizer makes in CUDA managed memory, and the size from
#: which it does (``Optimizer8bit.get_state_buffer``: smaller tensors get ordinary device buffers).
PAGED_STATE_KEYS = ("state1", "state2")
PAGED_MIN_NUMEL = 100_000


def pages_on_a_gpu(optimizer: Any) -> bool:
    """Whether ``optimizer`` keeps paged state on the GPU tier the estimate is for.

    The estimate runs on a CPU, where :func:`lightning_mem.optim.page_where_supported` runs a paged
    optimizer unpaged (``is_paged`` cleared); the class still says what the config asked for. A GPU
    tier is taken to page (Linux on a data-centre GPU has concurrent managed access); where it does
    not, the run goes unpaged and holds the state on the device, which the estimate then understates
    by the paged bytes its notes give.
    """
    if getattr(optimizer, "is_paged", False):
        return True
    cls = type(optimizer)
    return cls.__module__.startswith("bitsandbytes") and cls.__name__.startswith("Paged")


def is_paged_buffer(param: torch.Tensor, key: str) -> bool:
    return key in PAGED_STATE_KEYS and param.numel() >= PAGED_MIN_NUMEL


def shard_per_rank(breakdown: dict[str, int], host: int, sharding: Sharding, world_size: int,
                   unit_bytes: tuple[int, int], grad_element_size: int = 4, *, gathered: bool = True,
                   in_flight: tuple[int, int] | None = None,
                   gathered_units: int | None = None, scales: dict[str, float] | None = None,
                   resident: int = 0, generating: bool = False) -> tuple[dict[str, int], int]:
    """Per-rank device breakdown and host bytes of one unsharded measurement under ``sharding``.

    A sharded category holds 1/world_size of its measured bytes per rank (on the host when
    offloaded). A strategy that shards parameters gathers units (a decoder block, the root) to
    compute: ``gathered_units`` of the largest block plus the root unit stay on the device, with
    their gradients before the reduce-scatter (``unit_bytes`` = (largest block, root) parameter bytes).
    ``gathered=False``: the optimizer step, where no unit is gathered and no gradient is in flight.
    ``in_flight`` (with ``sharding.unit_gradients``): the measured gradients not reduced yet (whole
    on the device, not sharded) and the reduce-scatter buffer held beside them; ``gathered_units``
    overrides the sharding's count of gathered blocks (1 in a model's last block of backward).
    DeepSpeed's reduce buckets (``bucket_elements`` of ``grad_element_size`` bytes, no more than the
    gradients) stay on the device; a gradient partition it offloads is fp32 on the host.
    ``scales``: per category, the sharded bytes per measured byte (the run computed in FSDP2's
    ``param_dtype`` while the shards keep their own dtype: fp32 shards of a bf16 computation are 2).
    ``resident``: bytes of units a ``reshard_after_forward`` other than True keeps after their forward.
    Tensor and context parallelism divide as :class:`Sharding` says; ``generating``: the rollout's
    generation, which runs whole sequences on every rank of a context group.
    """
    measured_grads = breakdown["gradients"]
    out = dict(breakdown)
    unreduced, buffered = in_flight if in_flight is not None and gathered else (0, 0)
    scales = scales or {}
    for cat in sharding.shard:
        measured = breakdown[cat] - (unreduced if cat == "gradients" else 0)
        share = math.ceil(measured * scales.get(cat, 1.0) / world_size)
        if cat in sharding.host:
            out[cat] = 0
            host += share * 4 // grad_element_size if cat == "gradients" and sharding.master_weights else share
        else:
            out[cat] = share
    if "weights" in sharding.shard and sharding.gathered_units and gathered:
        block, root = unit_bytes
        units = sharding.gathered_units if gathered_units is None else gathered_units
        tp = sharding.tensor_parallel  # a gathered unit is its tensor-parallel piece
        out["weights"] += math.ceil((min(units * block + root, breakdown["weights"]) + resident) / tp)
        if in_flight is not None:
            out["gradients"] += math.ceil((unreduced + buffered * scales.get("reduce_scatter", 1.0)) / tp)
        elif breakdown["gradients"]:
            out["gradients"] += math.ceil(min(block + root, breakdown["gradients"]) / tp)
    if sharding.tensor_parallel * sharding.context_parallel > 1:
        if generating:
            out["kv_cache"] = math.ceil(out["kv_cache"] / sharding.tensor_parallel)
        else:
            tokens = sharding.context_parallel
            out["logits"] = math.ceil(out["logits"] / tokens)
            out["activations"] = math.ceil(
                out["activations"] / (tokens * (sharding.tensor_parallel if sharding.sequence_parallel else 1)))
    if sharding.bucket_elements and measured_grads:
        out["gradients"] += min(sharding.bucket_elements * grad_element_size, measured_grads)
    return out, host


# ---------------------------------------------------------------------------------------------
# 4-5. The run: build, warm up the optimizers, measure each phase
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def patched(obj: Any, name: str, wrapper: Callable[[Callable], Callable]) -> Iterator[None]:
    original = getattr(obj, name)
    setattr(obj, name, wrapper(original))
    try:
        yield
    finally:
        setattr(obj, name, original)


def in_section(ledger: MemoryLedger, category: str) -> Callable[[Callable], Callable]:
    """Wrap a function so that what it allocates is counted as ``category``."""

    def wrap(fn: Callable) -> Callable:
        def inner(*args: Any, **kwargs: Any) -> Any:
            with ledger.section(category):
                return fn(*args, **kwargs)

        return inner

    return wrap


@contextlib.contextmanager
def attribution(ledger: MemoryLedger, fake: bool) -> Iterator[None]:
    """Sections of library code whose allocations have a known category: the KV cache layers of
    transformers, the host copies of :mod:`lightning_mem.offload` and of activation offload."""
    from transformers import cache_utils

    from lightning_mem import offload
    from lightning_mem import activation_offload

    with contextlib.ExitStack() as stack:
        for cls in (cache_utils.DynamicLayer, cache_utils.StaticLayer):
            for method in ("lazy_initialization", "update"):
                stack.enter_context(patched(cls, method, in_section(ledger, "kv_cache")))
        for fn in ("optimizer_state_to_host", "offload_module"):
            stack.enter_context(patched(offload, fn, in_section(ledger, HOST)))
        # What comes back is what it was (the phase's retag comes before the plan moves it in).
        stack.enter_context(patched(offload, "optimizer_state_to_device", in_section(ledger, "optimizer_state")))
        stack.enter_context(patched(offload, "reload_module", in_section(ledger, "weights")))
        stack.enter_context(patched(activation_offload.ActivationOffloader, "_stash", in_section(ledger, HOST)))
        stack.enter_context(patched(torch.utils, "swap_tensors", _swap_or_set_data))
        if fake:
            stack.enter_context(patched(activation_offload.ActivationOffloader, "_should_stash", _fake_only(ledger)))
        yield


def _swap_or_set_data(swap: Callable) -> Callable:
    # ``Module.to``/``_apply`` always swaps fake parameters, which fails when anything holds a weak
    # reference to them (fake tensor caches do); giving the parameter the new data is the same here.
    def inner(t1: torch.Tensor, t2: torch.Tensor) -> None:
        try:
            swap(t1, t2)
        except RuntimeError:
            t1.data = t2.data

    return inner


def _fake_only(ledger: MemoryLedger) -> Callable[[Callable], Callable]:
    """ActivationOffloader's choice of what to stash, for fake tensors.

    Its own check keeps FakeTensor (by exact type) and parameters (by data pointer, which is 0 for
    every fake storage) in place. For a fake tensor the same rules are applied here, with the
    ledger's category standing in for the pointer test. The saved integer tensors (token ids,
    positions) are real CPU tensors whose storage cannot be re-viewed as a fake byte buffer: they
    stay in place (a few KB per layer).
    """

    def wrap(should_stash: Callable) -> Callable:
        def inner(self: Any, tensor: torch.Tensor) -> bool:
            from torch._subclasses.fake_tensor import FakeTensor

            if not isinstance(tensor, FakeTensor):
                return False
            if tensor.layout is not torch.strided or tensor.device.type != self.device.type:
                return False
            if tensor.is_leaf and tensor.requires_grad:
                return False
            base = tensor._base
            if base is not None and base.is_leaf and base.requires_grad:
                return False
            if ledger.category_of(tensor) == "weights":
                return False
            nbytes = tensor.untyped_storage().nbytes()
            return nbytes > 0 and nbytes >= self.min_bytes

        return inner

    return wrap


class MeasuredStep(Exception):
    """Raised by the estimate's callback once its measured step is recorded: the fit stops there,
    as a run stopped by a crash would (no end-of-fit export, no checkpoint)."""


class PhaseRecorder(Callback):
    """Follows a Lightning fit under a :class:`~lightning_mem.estimate.tracker.MemoryLedger`: tells the
    ledger what each tensor is, and records the peak of each phase of the measured steps.

    Parameters are weights, ``p.grad`` gradients, optimizer state tensors optimizer state (each
    unless its storage is on the host). The phases are those a step reports (``rollout``, ``score``,
    ``train``: :func:`lightning_mem.callbacks.memory_phase` reaches this callback as it reaches the
    ``MemoryMonitor``); a step that reports none is one phase, ``train``, from its first micro-batch
    to its optimizer step. Over several measured steps a phase keeps its largest peak.
    :meth:`measured` says which optimizer steps count (the estimate: the one after its warm-up; a
    real run: every one after the first).
    """

    def __init__(self, ledger: MemoryLedger, *, sharding: Sharding | None = None, world_size: int = 1) -> None:
        self.ledger = ledger
        self.sharding = sharding or Sharding()
        self.world_size = world_size
        self.peaks: dict[str, PhaseEstimate] = {}
        self.module: Any = None
        self.optimizers: list[Any] = []
        self._units = (0, 0)
        self._grad_size = 4
        self._stepping = False
        self._measuring = False
        self._named = False  # the current step reported a phase
        self._depth = 0  # open phases: nested ones (an engine's sleep inside the rollout) are part of theirs
        self._shape = ""
        self._phase: str | None = None  # the phase a step reported, while it runs
        #: Paged optimizer state (bitsandbytes' managed buffers) per parameter, and the largest one:
        #: the pages the update of one parameter needs on the device (see :func:`pages_on_a_gpu`).
        self.paged_bytes: dict[int, int] = {}
        self.paged_working_set = 0

    @property
    def phases(self) -> list[PhaseEstimate]:
        return list(self.peaks.values())

    def measured(self, step: int) -> bool:
        """Whether optimizer step ``step`` (0-based, counted by this fit's batches) is measured."""
        return step >= 1

    # -- Lightning hooks --------------------------------------------------------------------------
    @override
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.module = pl_module
        self.optimizers = list(trainer.strategy.optimizers)
        self._callbacks = list(trainer.callbacks)
        for opt in self.optimizers:
            opt.register_step_post_hook(lambda o, *_: self._stepped(o))
        for p in pl_module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._gradient_ready)
        self._units, self._grad_size = self.unit_bytes(), self.grad_element_size()
        self.retag()

    @override
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.retag()
        accumulate = trainer.accumulate_grad_batches
        if batch_idx % accumulate == 0 and self.measured(batch_idx // accumulate):  # a measured step begins
            self._measuring, self._named = True, False
            self._shape = self.describe(batch)
            self.ledger.reset_peak()

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        accumulate = trainer.accumulate_grad_batches
        if not self._measuring or (batch_idx + 1) % accumulate:
            return
        if not self._named:  # a step that names no phases is one: train
            self._record("train", self.step_description(accumulate))
        self._measuring = False

    def step_description(self, accumulate: int) -> str:
        return f"micro-batch {self._shape}, {accumulate} accumulated"

    @override
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._stepping = True  # a sharded model is resharded: nothing gathered, nothing in flight
        # What the step allocates (its temporaries) is the optimizer's, and sharded like its state.
        self.ledger.begin_section("optimizer_state")

    # -- phases (a PhaseObserver, like the MemoryMonitor) -----------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._depth += 1
        top = self._depth == 1 and self._measuring
        if top:
            self._named, self._phase = True, name
            self.retag()
            self.ledger.reset_peak()
        try:
            yield
        finally:
            self._depth -= 1
            if top:
                self._phase = None
        if top:
            self._record(name, f"batch of {self._shape}")

    def _record(self, name: str, shape: str) -> None:
        ledger = self.ledger
        if ledger.view is not None:  # the peak of one rank's view, taken at every moment
            breakdown, host = dict(ledger.peak_breakdown), ledger.peak_host_bytes
        else:  # the unsharded peak, divided over the ranks
            breakdown, host = shard_per_rank(ledger.peak_breakdown, ledger.peak_host_bytes, self.sharding,
                                             self.world_size, self._units, self._grad_size,
                                             generating=name == "rollout")
        if name == "train" and self.paged_working_set:
            # The parameter being updated has its paged state on the device (bitsandbytes prefetches
            # it before the update); one parameter's, whole or this rank's shard of it.
            share = self.world_size if "optimizer_state" in self.sharding.shard else 1
            breakdown = {**breakdown, "optimizer_state": breakdown["optimizer_state"] + math.ceil(self.paged_working_set / share)}
        new = PhaseEstimate(name, sum(breakdown.values()), breakdown, host, shape)
        old = self.peaks.get(name)
        if old is None or new.device_peak_bytes > old.device_peak_bytes:
            self.peaks[name] = new
        if old is not None and old.host_peak_bytes > self.peaks[name].host_peak_bytes:
            self.peaks[name].host_peak_bytes = old.host_peak_bytes

    @staticmethod
    def describe(batch: Any) -> str:
        if not isinstance(batch, dict):
            return "?"
        rows = _rows_of(batch)
        tokens = max((v.shape[1] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() >= 2), default=0)
        return f"{rows} x {tokens} tokens"

    # -- the ledger's categories ------------------------------------------------------------------
    def _gradient_ready(self, param: torch.Tensor) -> None:
        self.ledger.retag(param.grad, "gradients")

    def _stepped(self, opt: Any) -> None:
        self.ledger.end_section("optimizer_state")
        self._retag_optimizer(opt)

    def _forward(self, *_: Any) -> None:
        self._stepping = False  # a forward gathers again

    def retag(self) -> None:
        """Parameters and buffers are weights, gradients gradients, optimizer tensors state (unless on the host)."""
        if self.module is None:
            return
        ledger = self.ledger
        for t in [*self.module.parameters(), *self.module.buffers(), *_quantization_state(self.module)]:
            if ledger.category_of(t) != HOST:
                ledger.retag(t, "weights")
            if isinstance(t, nn.Parameter) and t.grad is not None and ledger.category_of(t.grad) != HOST:
                ledger.retag(t.grad, "gradients")
        for opt in [*self.optimizers, *self._in_backward_optimizers()]:
            self._retag_optimizer(opt)

    def _in_backward_optimizers(self) -> list:
        # OptimizerInBackward steps one optimizer per parameter (built in its on_fit_start, stepped in
        # backward, not by Lightning): their state is optimizer state too.
        from lightning_mem.callbacks.optimizer_in_backward import OptimizerInBackward

        return [opt for cb in getattr(self, "_callbacks", ()) if isinstance(cb, OptimizerInBackward) and cb.stepper
                for opt in cb.stepper.optimizers.values()]

    def _retag_optimizer(self, opt: Any) -> None:
        paged = pages_on_a_gpu(opt)
        for param, state in opt.state.items():
            managed = 0
            for key, value in state.items():
                if not isinstance(value, torch.Tensor) or self.ledger.category_of(value) == HOST:
                    continue
                if paged and is_paged_buffer(param, key):
                    # CUDA managed memory: outside the caching allocator's count, and the driver moves
                    # its pages to the host when the card runs short. Counted on the host (its worst
                    # case); what must be resident is one parameter's pages at its update, below.
                    self.ledger.retag(value, HOST)
                    managed += local_tensor(value).untyped_storage().nbytes()
                else:
                    self.ledger.retag(value, "optimizer_state")
            if paged:
                # The largest count seen: a later pass (each phase's end retags) finds the managed
                # buffers already on the host and would count 0 for them.
                self.paged_bytes[id(param)] = max(self.paged_bytes.get(id(param), 0), managed)
                self.paged_working_set = max(self.paged_working_set, managed)

    def unit_bytes(self) -> tuple[int, int]:
        """(largest decoder block, everything outside the blocks) parameter bytes, over all models."""
        from lightning_mem import module_tree

        block, root = 0, 0
        for _, model in module_tree.find_hf_models(self.module):
            blocks = module_tree.find_blocks(model, module_tree.default_block_classes(model))
            in_blocks = {id(p) for b in blocks for p in b.parameters()}
            sizes = [sum(p.numel() * p.element_size() for p in b.parameters()) for b in blocks]
            block = max([block, *sizes])
            root += sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in in_blocks)
        return block, root

    def grad_element_size(self) -> int:
        trainable = [p for p in self.module.parameters() if p.requires_grad]
        return trainable[0].element_size() if trainable else 4


class EstimateRun(PhaseRecorder, StepIO):
    """One estimate: Lightning's own ``Trainer.fit`` of the config's module, on fake tensors.

    The run is a :class:`PhaseRecorder` of that fit, and its :class:`~lightning_mem.step_io.StepIO`:

    - the fit runs the module's own hooks and steps -- ``configure_model``,
      ``configure_optimizers``, ``training_step``, Lightning's backward, clipping, optimizer step and
      ``zero_grad`` (automatic optimization), or the recipe's own update loop (manual) -- with the
      config's precision plugin and technique callbacks, so a recipe subclass is estimated as itself;
    - its data are the datamodule's ``largest_batch``: first a warm-up step of short rows (the
      optimizers make their state, and whatever a step leaves alive for the next one stays alive;
      its sampled responses end at once), then the largest micro-batch the config allows (two of
      them when gradients accumulate: the second forward runs next to the first one's gradients);
    - it measures the second step and then stops the fit (:class:`MeasuredStep`);
    - as the step's ``StepIO`` it skips repetitions that cannot raise a peak (generation's middle
      decode steps, the third and later micro-batches of one shape, PPO's mini-batches and epochs
      after the first) unless ``full_loops``.

    A sharding strategy runs as one unsharded process whose per-rank view
    (:func:`shard_per_rank`) the ledger applies at every moment.
    """

    def __init__(self, init: Any, cfg: Any, *, world_size: int, fake: bool, vocab: list[int], workdir: Path,
                 full_loops: bool = False, device_memory: int | None = None) -> None:
        trainer_cfg = init.trainer
        strategy = trainer_cfg.strategy if not isinstance(trainer_cfg.strategy, str) else None
        super().__init__(MemoryLedger(set(vocab)), sharding=sharding_of(strategy), world_size=world_size)
        self.module = init.model
        self.data = init.data
        self.cfg = cfg
        self.strategy = strategy
        self.callbacks = [cb for cb in (trainer_cfg.callbacks or []) if _is_technique(cb)]
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
        self._flight: _GradientFlight | None = None
        self._root_bytes: dict[int, int] = {}  # id(model) -> its root unit's parameter bytes
        self._in_forward: set[int] = set()
        self._entering = False
        self._scales: dict[str, float] = {}  # sharded bytes per measured byte (FSDP2 mixed precision)
        self._shard_dtype = torch.float32
        self._resident: dict[int, int] = {}  # units kept gathered after their forward -> bytes
        self._fill, self._eos = 0, None
        self.device_memory = device_memory  # one device's total bytes, when the estimate knows the card
        accelerator = str(trainer_cfg.accelerator or "auto").lower()
        self.on_cuda = accelerator not in ("cpu", "mps")  # what the config runs on, not this machine
        #: What a CUDA device allocates beyond the CPU run's tensors (:mod:`.cuda`); None on a CPU config.
        self.device_model: CudaDeviceModel | None = CudaDeviceModel() if self.on_cuda else None
        if self.device_model is not None:
            self.ledger.round_bytes = self.device_model.round_bytes
        self._blas_workspaces: torch.Tensor | None = None

    def measured(self, step: int) -> bool:
        return step == 1

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
        """A warm-up step of short rows (8 tokens), then the measured step of the datamodule's
        largest micro-batch."""
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
        warm_up = _head(batch, rows=_rows_of(batch), tokens=8)  # every row: no loop of the step runs empty
        return [warm_up] * self.accumulated + [batch] * self.accumulated

    def fit(self) -> None:
        from lightning.pytorch import Trainer
        from torch.utils.data import DataLoader

        fill, self._eos = sampled_tokens(self.cfg.model.name_or_path)
        self._fill = fill
        # The warm-up step samples an end of sequence at once (its responses are one token).
        self.mode.fill_token = fill if self._eos is None else self._eos
        device = (self.device_model.applied(lambda: self._phase is not None) if self.device_model is not None
                  else contextlib.nullcontext())
        with attribution(self.ledger, self.fake), _weights_source(self.fake), device, self.mode, self.accounting():
            self.trainer = Trainer(**self.trainer_arguments())
            if self.sharding.context_parallel > 1:
                # The recipes state micro-batch budgets per rank of a context group and read its size
                # from the strategy (lightning_mem.ranks.per_rank_budget): this one-process fit's
                # strategy says what the run's would.
                self.trainer.strategy.context_parallel_size = self.sharding.context_parallel
            loader = DataLoader(self.batches(fill), batch_size=None, collate_fn=_as_is)
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
            trainer.strategy.optimizers = [_MasterWeights.wrap(o, self.ledger) for o in trainer.strategy.optimizers]
        if self.sharding.param_dtype is not None:
            self._compute_in(self.sharding.param_dtype, pl_module)
        super().on_fit_start(trainer, pl_module)
        if self.device_model is not None:
            trains = any(p.requires_grad for p in pl_module.parameters())
            self.device_model = dataclasses.replace(self.device_model, blas_threads=2 if trains else 1)
            # cuBLAS/cuBLASLt workspaces: made at the first matmul of each thread, never freed.
            with self.ledger.section("other"):
                self._blas_workspaces = torch.empty(self.device_model.workspace_bytes, dtype=torch.uint8)
        if self.sharding.shard:  # a sharded run: the ledger's peaks are one rank's
            from lightning_mem import module_tree

            for _, model in module_tree.find_hf_models(pl_module):
                model.register_forward_pre_hook(self._forward)
            if self.sharding.unit_gradients:  # FSDP2 reduce-scatters gradients unit by unit
                self._flight = _GradientFlight.of(pl_module, self.strategy)
                self._follow_units(pl_module)
            self.ledger.view = self._per_rank
        self._split_like_the_run(pl_module)

    def _split_like_the_run(self, pl_module: nn.Module) -> None:
        """What a model split by tensor or context parallelism computes beyond its share of this
        one-process run: the recipe pads each sequence to a multiple of ``cp`` (times ``tp`` under
        sequence parallelism) before splitting it -- a 41-token GRPO sequence is 2 x 21 tokens, not
        2 x 20.5 -- so this run pads as the run does (a layout of one slice: the padding alone);
        and Ulysses' exchanges allocate copies the division misses (:mod:`.ulysses`)."""
        from lightning_mem import module_tree
        from lightning_mem.context_parallel import SequenceLayout, attach_layout
        from lightning_mem.estimate.ulysses import use_ulysses_footprint

        sharding = self.sharding
        multiple = sharding.context_parallel * (sharding.tensor_parallel if sharding.sequence_parallel else 1)
        for _, model in module_tree.find_hf_models(pl_module):
            if multiple > 1:
                attach_layout(model, SequenceLayout(multiple=multiple))
            if sharding.context_parallel > 1:
                use_ulysses_footprint(model, active=lambda: self._phase != "rollout")

    def _compute_in(self, dtype: torch.dtype, module: nn.Module) -> None:
        """FSDP2's mixed precision: units are gathered, and compute, in ``dtype`` while the shards and
        the optimizer keep the parameters' dtype. The run computes in ``dtype`` (its activations,
        gathered units and unreduced gradients are then the real ones); the per-rank view scales the
        sharded categories back to the shards' dtype (:func:`shard_per_rank`'s ``scales``)."""
        params = [p for p in module.parameters() if p.is_floating_point()]
        before = sum(p.numel() * p.element_size() for p in params)
        trained = [p for p in params if p.requires_grad]
        shard_size = trained[0].element_size() if trained else 4
        self._shard_dtype = trained[0].dtype if trained else torch.float32
        for t in [*params, *module.buffers()]:
            if t.is_floating_point() and t.dtype != dtype:
                t.data = t.data.to(dtype)
        after = sum(p.numel() * p.element_size() for p in params)
        size = torch.empty((), dtype=dtype).element_size()
        reduce_size = torch.empty((), dtype=self.sharding.reduce_dtype or dtype).element_size()
        self._scales = {"weights": before / max(after, 1), "gradients": shard_size / size,
                        "reduce_scatter": reduce_size / size}

    def _optimizer_state_scale(self) -> float:
        # The state of a parameter computed in param_dtype would be in the shard's dtype (AdamW's
        # moments follow their parameter; 8-bit states do not).
        dtype = self.sharding.param_dtype
        measured = scaled = 0
        for opt in self.optimizers:
            for state in opt.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        nbytes = value.numel() * value.element_size()
                        measured += nbytes
                        scaled += nbytes * (self._shard_dtype.itemsize / value.element_size()
                                            if value.dtype == dtype else 1)
        return scaled / measured if measured else 1.0

    @override
    def _stepped(self, opt: Any) -> None:
        super()._stepped(opt)
        if self.sharding.param_dtype is not None:
            self._scales["optimizer_state"] = self._optimizer_state_scale()

    def _follow_units(self, module: nn.Module) -> None:
        """FSDP2 gathers a model's root unit for its forward and its backward only; and when a forward
        enters a unit, the previous unit's flat all-gather output is still alive beside the new one
        while the new unit's parameters are copied out (:attr:`Sharding.forward_gathered_units`)."""
        from lightning_mem import module_tree

        for _, model in module_tree.find_hf_models(module):
            key = id(model)
            blocks = module_tree.find_blocks(model, module_tree.default_block_classes(model))
            in_blocks = {id(p) for b in blocks for p in b.parameters()}
            self._root_bytes[key] = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in in_blocks)
            model.register_forward_pre_hook(lambda *_, k=key: self._in_forward.add(k))
            model.register_forward_hook(lambda *_, k=key: self._in_forward.discard(k))
            trained = any(p.requires_grad for p in model.parameters())
            keeps = self.sharding.reshard_after_forward is not True and trained  # frozen models reshard
            for block in self.strategy.blocks_to_shard(model):
                block.register_forward_pre_hook(self._entering_unit)
                if keeps and self.sharding.reshard_after_forward is False:  # gathered from now until its backward
                    block.register_forward_pre_hook(lambda *_, b=block, k=key: self._keep(k, b))
                elif keeps:  # an int: resharded to a smaller group after its forward
                    block.register_forward_hook(lambda *_, b=block, k=key: self._keep(k, b))
            if keeps:
                model.register_forward_hook(lambda *_, k=key: self._keep(k, None))
        if self._flight is not None:
            self._flight.on_left = self._release

    def _keep(self, model: int, block: nn.Module | None) -> None:
        """A unit that ``reshard_after_forward`` keeps after its forward (None: the model's root)."""
        if not torch.is_grad_enabled():
            return
        k = self.sharding.reshard_after_forward
        nbytes = self._root_bytes[model] if block is None else sum(
            p.numel() * p.element_size() for p in block.parameters())
        self._resident[id(block) if block is not None else model] = nbytes if k is False else math.ceil(nbytes / k)

    def _release(self, unit: int | None) -> None:
        """Backward left ``unit`` (None: all of them, at its end): FSDP2 reshards it."""
        if unit is None:
            self._resident.clear()
        else:
            self._resident.pop(unit, None)

    def _entering_unit(self, *_: Any) -> None:
        self._entering = True
        try:
            self.ledger.observe()
        finally:
            self._entering = False

    @override
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.accumulated:  # the measured step samples full-length responses
            self.mode.fill_token = self._fill
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if batch_idx == 2 * self.accumulated - 1:
            raise MeasuredStep

    @override
    def step_description(self, accumulate: int) -> str:
        return f"micro-batch {self._shape}, {self.accumulated} of {self.accumulate} accumulated"

    @override
    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        if self._flight is not None:  # FSDP2 reduces the root units and frees its buffers at the end
            self._flight.reset()

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
            stack.enter_context(_last_decode_step(self, model))
        return stack

    @override
    def rollout_engine(self, config: Any, generation: Any, **kwargs: Any) -> Any:
        if config.name != "vllm":
            return super().rollout_engine(config, generation, **kwargs)
        from lightning_mem.estimate.engine import ReservedEngine

        return ReservedEngine(generation, config, run=self, on_cuda=self.on_cuda, device_memory=self.device_memory,
                              **kwargs)

    # -- the per-rank view ------------------------------------------------------------------------
    def _per_rank(self, breakdown: dict[str, int], host: int) -> tuple[dict[str, int], int]:
        flight = self._flight
        units, count, resident = self._units, self._gathered_units(), 0
        if flight is not None:  # the roots gathered now: models in a forward, or in a backward
            block, _ = units
            active = self._in_forward | set(flight.roots)
            units = (block, sum(self._root_bytes.get(k, 0) for k in active))
            kept_blocks = sum(v for k, v in self._resident.items() if k not in self._root_bytes)
            kept_roots = sum(v for k, v in self._resident.items() if k in self._root_bytes and k not in active)
            if kept_blocks and self.sharding.reshard_after_forward is False:
                # Every unit it computes with is among those kept; a forward holds the latest flat
                # all-gather output beside them, a backward nothing more.
                count = 0 if flight.in_backward else 1
            resident = kept_blocks + kept_roots
        return shard_per_rank(breakdown, host, self.sharding, self.world_size, units, self._grad_size,
                              scales=self._scales, resident=resident,
                              gathered=not self._stepping,
                              in_flight=(flight.unreduced, flight.buffered) if flight is not None else None,
                              gathered_units=count, generating=self._phase == "rollout")

    def _gathered_units(self) -> int | None:
        flight = self._flight
        if flight is None:
            return None
        if flight.last_block:  # backward in a model's first block: nothing left to prefetch
            return 1
        if self._entering and not flight.in_backward and self.sharding.forward_gathered_units:
            return self.sharding.forward_gathered_units
        return None

    @override
    def _gradient_ready(self, param: torch.Tensor) -> None:
        if self._flight is not None:  # before the retag: the view then sees the unit's progress
            self._flight.add(param)
        super()._gradient_ready(param)

    def _checkpointing(self) -> None:
        # FSDP2Strategy's own activation checkpointing, applied to the blocks it would shard.
        strategy = self.strategy
        if strategy is None or not getattr(strategy, "_checkpoint_every", 0):
            return
        from lightning_mem import activation_checkpointing, module_tree

        for _, model in module_tree.find_hf_models(self.module):
            blocks = strategy.blocks_to_shard(model)
            for index in activation_checkpointing.checkpointed_indices(len(blocks), strategy._checkpoint_every):
                strategy.apply_activation_checkpointing(blocks[index])

    def accounting(self) -> contextlib.AbstractContextManager:
        """What the run adds to the ledger's view for its whole length (a subclass's hooks)."""
        return contextlib.nullcontext()


class _MasterWeights:
    """DeepSpeed ZeRO's mixed-precision optimizer, as far as memory goes.

    Beside 16-bit weights DeepSpeed keeps an fp32 master copy of every trainable parameter; at
    the step it gives the masters fp32 copies of the gradients, steps the client optimizer (or
    CPU Adam, which allocates the same two fp32 moments) on them, and copies the masters back into
    the 16-bit weights. Here the client optimizer's own class steps fp32 copies made the same way,
    so the state bytes are whatever that optimizer allocates; the strategy's sharding then divides
    them per rank (:func:`shard_per_rank`). fp32 weights need no master copy: the optimizer is
    returned as it is.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, pairs: list[tuple[torch.Tensor, torch.Tensor]],
                 ledger: MemoryLedger) -> None:
        self.optimizer = optimizer
        self.pairs = pairs
        self.ledger = ledger

    @classmethod
    def wrap(cls, optimizer: torch.optim.Optimizer, ledger: MemoryLedger) -> Any:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if all(p.dtype == torch.float32 for p in params):
            return optimizer
        pairs, groups = [], []
        with ledger.section("optimizer_state"), torch.no_grad():
            for group in optimizer.param_groups:
                masters = [p.detach().float().requires_grad_(p.requires_grad) for p in group["params"]]
                pairs += zip(group["params"], masters)
                groups.append({**group, "params": masters})
        return cls(type(optimizer)(groups), pairs, ledger)  # every group names all its hyperparameters

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def register_step_post_hook(self, hook: Callable) -> Any:
        return self.optimizer.register_step_post_hook(hook)

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> None:
        if closure is not None:  # Lightning's automatic optimization: the forward and backward
            with torch.enable_grad():
                closure()
        # Everything the step allocates, its temporaries included, belongs to the rank's partition.
        with self.ledger.section("optimizer_state"):
            for param, master in self.pairs:
                if param.grad is not None:
                    master.grad = param.grad.float()
                    param.grad = None  # DeepSpeed frees the 16-bit gradient partition at the step
            self.optimizer.step()
        for param, master in self.pairs:
            param.copy_(master)
            master.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param, _ in self.pairs:
            param.grad = None


@dataclass
class _RootFlight:
    """One FSDP2 root's (one model's) gradients not reduce-scattered yet, and its buffer."""

    root: int = 0  # gradients of the root unit (outside the blocks) so far: reduced at the end of backward
    current: int | None = None  # the block whose gradients arrive now
    current_bytes: int = 0
    buffered: int = 0  # the last reduced block's reduce-scatter input


@dataclass
class _GradientFlight:
    """FSDP2's gradients on their way to the reduce-scatter, followed through one backward.

    FSDP2 reduce-scatters a unit's gradients when backward leaves the unit: until then they are
    whole (unsharded) on the device. Its reduce-scatter input, a unit-sized buffer, stays
    allocated until the next unit of the same root reduces (FSDP2 keeps one in flight per root,
    so the collective may overlap the next unit's compute); the root units (embeddings, final
    norm, head: everything outside the blocks) reduce at the end of backward. Each model is its
    own root (PPO's actor and critic backpropagate in one backward, each with its own buffer).
    Fed by each parameter's gradient as the unsharded run accumulates it, and by the gradient of
    each block's input, which is when backward leaves the block (FSDP2 hooks the same moment) --
    before the previous block's recomputation, whose activations must not meet this block's
    gradients twice over.
    """

    unit_of: dict[int, tuple[int, int | None]] = field(default_factory=dict)  # id(param) -> (root, id(block) | None)
    unit_bytes: dict[int, int] = field(default_factory=dict)  # id(block) -> its trainable parameters' bytes
    index: dict[int, tuple[int, int]] = field(default_factory=dict)  # id(block) -> (root, place in forward order)
    roots: dict[int, _RootFlight] = field(default_factory=dict)
    last_block: bool = False  # backward is in a model's first block: nothing left to prefetch
    on_left: Callable[[int | None], None] | None = None  # told when backward leaves a unit (None: all)

    @classmethod
    def of(cls, module: nn.Module, strategy: Any) -> "_GradientFlight":
        from lightning_mem import module_tree

        flight = cls()
        for _, model in module_tree.find_hf_models(module):
            key = id(model)
            flight.unit_of.update({id(p): (key, None) for p in model.parameters()})
            for index, block in enumerate(strategy.blocks_to_shard(model)):
                flight.index[id(block)] = (key, index)
                # The reduce-scatter input holds the gradients of what trains (LoRA: the adapters).
                flight.unit_bytes[id(block)] = sum(p.numel() * p.element_size() for p in block.parameters()
                                                   if p.requires_grad)
                flight.unit_of.update({id(p): (key, id(block)) for p in block.parameters()})
                block.register_forward_pre_hook(flight._entered, with_kwargs=True)
        return flight

    def _entered(self, block: nn.Module, args: tuple, kwargs: dict) -> None:
        inputs = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.requires_grad]
        if inputs and torch.is_grad_enabled():
            inputs[0].register_hook(lambda grad, unit=id(block): self._left(unit))

    def _left(self, unit: int) -> None:
        if self.on_left is not None:
            self.on_left(unit)
        key, index = self.index[unit]
        state = self.roots.setdefault(key, _RootFlight())
        if unit == state.current:  # its gradients are reduced now; the reduce-scatter input stays
            state.buffered = self.unit_bytes[unit]
            state.current, state.current_bytes = None, 0
        # Backward enters the block before this one, which was prefetched; with no block before
        # that, FSDP2 has nothing more to prefetch: one block stays gathered, not two.
        self.last_block = index == 1

    @property
    def unreduced(self) -> int:
        return sum(state.root + state.current_bytes for state in self.roots.values())

    @property
    def buffered(self) -> int:
        return sum(state.buffered for state in self.roots.values())

    def add(self, param: torch.Tensor) -> None:
        nbytes = param.grad.numel() * param.grad.element_size()
        key, unit = self.unit_of.get(id(param), (0, None))  # 0: a unit of its own (a value head)
        state = self.roots.setdefault(key, _RootFlight())
        if unit is None:
            state.root += nbytes
            return
        if self.index[unit][1] > 0:
            self.last_block = False
        if unit != state.current:
            if state.current is not None:  # backward left that block: it reduced
                state.buffered = self.unit_bytes[state.current]
            state.current, state.current_bytes = unit, 0
        state.current_bytes += nbytes

    @property
    def in_backward(self) -> bool:
        return bool(self.roots)

    def reset(self) -> None:
        if self.on_left is not None:
            self.on_left(None)
        self.roots.clear()
        self.last_block = False


@contextlib.contextmanager
def _weights_source(fake: bool) -> Iterator[None]:
    """Where a config-only base's weights come from: on fake tensors, from its config alone.

    A LoRA or QLoRA recipe gives a config-only base seeded random weights on disk and reads them
    back (quantizing as it reads); fake tensors can be neither written nor read, so inside
    :func:`~lightning_mem.models.config_only_models` the same ``configure_model`` builds the base
    from its config (and quantizes it with bitsandbytes' own ops). A real-tensor run (the accuracy
    tests) takes the recipe's disk path, inside the estimate's temporary folder.
    """
    from lightning_mem.models import config_only_models

    if not fake:
        yield
        return
    with config_only_models(), _fake_params4bit():
        yield


@contextlib.contextmanager
def _fake_params4bit() -> Iterator[None]:
    """Let bitsandbytes' ``Params4bit`` wrap a fake tensor.

    ``Params4bit(data)`` re-types ``data`` in place (``Tensor._make_subclass``), which a FakeTensor
    (itself a subclass) refuses. For fake data it becomes an instance of a class that is both:
    FakeTensor for dispatch (shapes, dtypes, the fake device), Params4bit for everything else, its
    attributes set as ``Params4bit.__new__`` sets them. Quantization, the forward's dequantization
    and the matmul then run bitsandbytes' own code and fake kernels, so the packed weight and its
    quantization state have the shapes and dtypes a real load gives.
    """
    try:
        import bitsandbytes as bnb
    except ImportError:
        yield
        return
    params4bit = bnb.nn.Params4bit
    original = params4bit.__new__
    params4bit.__new__ = _fake_params4bit_new(params4bit, original)
    # bitsandbytes caches the code of its nested (double) quantization in a module-level dict on
    # first use; made inside the estimate it would be a fake tensor's leftovers, and every later
    # real quantization in the process would quantize the absmax with it (different bytes).
    qmaps = bnb.functional.name2qmap
    cached = dict(qmaps)
    try:
        yield
    finally:
        params4bit.__new__ = original
        qmaps.clear()
        qmaps.update(cached)


def _fake_params4bit_new(params4bit: type, original: Callable[..., Any]) -> Callable[..., Any]:
    """A ``Params4bit.__new__`` that makes fake data an instance of a class both FakeTensor and
    Params4bit (see :func:`_fake_params4bit`); real data goes to ``original``."""
    from torch._subclasses.fake_tensor import FakeTensor

    attributes = ("blocksize", "compress_statistics", "quant_type", "quant_state", "quant_storage",
                  "bnb_quantized", "module")

    def detach(self: Any) -> Any:
        # Still a Params4bit: moving a module (``Module.to``) rebuilds its parameters with
        # ``Parameter(param_applied)``, which asks ``detach()`` for the same class.
        out = FakeTensor.detach(self)
        out.__class__ = type(self)
        for name in attributes:
            setattr(out, name, getattr(self, name, None))
        return out

    fake_class = type("Params4bit", (FakeTensor, params4bit), {"__module__": __name__, "detach": detach})

    def new(cls: type, data: torch.Tensor | None = None, requires_grad: bool = False, quant_state: Any = None,
            blocksize: int | None = None, compress_statistics: bool = True, quant_type: str = "fp4",
            quant_storage: torch.dtype = torch.uint8, module: Any = None, bnb_quantized: bool = False,
            **kwargs: Any) -> Any:
        if not isinstance(data, FakeTensor):
            return original(cls, data, requires_grad, quant_state, blocksize, compress_statistics, quant_type,
                            quant_storage, module, bnb_quantized, **kwargs)
        self = data.detach()  # a new fake tensor on the same (fake) storage
        self.__class__ = fake_class
        self.requires_grad = requires_grad
        self.blocksize = 64 if blocksize is None else blocksize
        self.compress_statistics = compress_statistics
        self.quant_type = quant_type
        self.quant_state = quant_state
        self.quant_storage = quant_storage
        self.bnb_quantized = bnb_quantized
        self.module = module
        return self

    return new


def _quantization_state(module: nn.Module) -> list[torch.Tensor]:
    """The tensors a quantized weight holds besides its packed bytes (absmax, code books, ...):
    weights, though neither parameters nor buffers."""
    from lightning_mem.quantization import quant_state_tensors, is_quantized_linear

    return [t for m in module.modules() if is_quantized_linear(m) for t in quant_state_tensors(m.weight)]


def _is_technique(callback: Any) -> bool:
    """The callbacks that change memory (not the monitor or checkpointing)."""
    from lightning_mem.callbacks import MemoryMonitor

    from lightning.pytorch.callbacks import ModelCheckpoint

    # A callback that cannot run in this CPU fit (runs_in_estimate = False: Liger's CUDA kernels) is
    # left out; its estimate_note says how that changes the figures.
    return (not isinstance(callback, (MemoryMonitor, ModelCheckpoint)) and type(callback).__name__ != "FitCheck"
            and getattr(callback, "runs_in_estimate", True))


# ---------------------------------------------------------------------------------------------
# The estimate's data and shortcuts
# ---------------------------------------------------------------------------------------------


def sampled_tokens(name_or_path: str) -> tuple[int, int | None]:
    """``(fill, eos)`` for the model in the folder ``name_or_path``.

    ``fill``: the smallest token id that neither ends a sequence nor pads. The estimate's token ids
    are this one, and so is every token its measured step samples, so every response runs to its
    length limit (the worst case). ``eos``: a token that ends a sequence (None if none is named),
    which the warm-up step samples, so that its responses end at once.
    """
    from lightning_mem.models import load_tokenizer

    folder = Path(name_or_path)
    eos: list[int] = []
    taken: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        if (folder / name).is_file():
            config = json.loads((folder / name).read_text())
            eos += _as_list(config.get("eos_token_id"))
            taken.update(_as_list(config.get("pad_token_id")))
    tokenizer = load_tokenizer(str(folder), key="model.name_or_path")
    if tokenizer.eos_token_id is not None:
        eos.insert(0, tokenizer.eos_token_id)
    taken.update(eos)
    if tokenizer.pad_token_id is not None:
        taken.add(tokenizer.pad_token_id)
    fill = next(i for i in range(len(taken) + 1) if i not in taken)
    return fill, (eos[0] if eos else None)


def _rows_of(batch: dict[str, Any]) -> int:
    return next((v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() >= 1), 0)


def _head(batch: dict[str, Any], *, rows: int, tokens: int) -> dict[str, Any]:
    """The first ``rows`` rows of ``batch`` and their last ``tokens`` columns (a left-padded prompt
    keeps its end): a warm-up step's small micro-batch of the same layout."""

    def cut(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            value = value[:rows] if value.dim() == 1 else value[:rows, -tokens:]
            return value.clone()
        return value[:rows] if isinstance(value, list) else value

    return {key: cut(value) for key, value in batch.items()}


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


def _new_tokens(kwargs: dict[str, Any], n: int | None = None) -> Any:
    """``generate``'s length cap in ``kwargs`` (a keyword or its ``generation_config``'s); with ``n``,
    a copy of ``kwargs`` whose cap is ``n``."""
    config = kwargs.get("generation_config")
    if n is None:
        return kwargs["max_new_tokens"] if "max_new_tokens" in kwargs else config.max_new_tokens
    if "max_new_tokens" in kwargs or config is None:
        return {**kwargs, "max_new_tokens": n}
    capped = copy.deepcopy(config)
    capped.max_new_tokens = n
    return {**kwargs, "generation_config": capped}


@contextlib.contextmanager
def _last_decode_step(run: EstimateRun, model: nn.Module) -> Iterator[None]:
    """Generation's memory peak without its whole loop: ``model.generate`` runs twice, for real.

    Autoregressive decoding peaks either in its prefill (every prompt token at once) or in its last
    decode step (one token per sequence against the longest KV cache: a dynamic cache only grows,
    and each step's other tensors have the same shapes). So ``generate`` runs (1) on the prompts for
    two new tokens -- the prefill and the first decode step -- and then (2) for the last token,
    resuming from a cache that the model's own forward filled with the prompt and the first
    ``max_new_tokens - 2`` response tokens (each a ``fill_token``, which the sampler would have
    produced; making that cache is not measured: the real loop grows it one token at a time, with
    smaller transients than the step measured next). Its output is the full-length sequences, as
    the whole loop's would be. A static (preallocated, full-length) cache makes every decode step
    alike: the second step stands for the last, and the output is padded to full length with
    ``fill_token``.
    """
    generate = model.generate

    def last_step(*args: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        # The rollout hands its length cap in a GenerationConfig (rl/sampling.py), not as a keyword.
        max_new_tokens = _new_tokens(kwargs)
        if args or max_new_tokens <= 3:
            return generate(*args, input_ids=input_ids, attention_mask=attention_mask, **_new_tokens(kwargs, max_new_tokens))
        fill = run.mode.fill_token
        rows, prompt = input_ids.shape
        first = generate(input_ids=input_ids, attention_mask=attention_mask, **_new_tokens(kwargs, 2))
        if kwargs.get("past_key_values") is not None:  # static: the step's shapes do not grow
            pad = torch.full((rows, prompt + max_new_tokens - first.shape[1]), fill, dtype=first.dtype)
            return torch.cat([first, pad], dim=1)
        del first
        done = max_new_tokens - 1  # response tokens the loop has made before its last step
        ids = torch.cat([input_ids, torch.full((rows, done), fill, dtype=input_ids.dtype)], dim=1)
        mask = torch.cat([attention_mask, torch.ones((rows, done), dtype=attention_mask.dtype)], dim=1)
        with run.ledger.unmeasured(), torch.no_grad():
            cache = _grown_cache(model, ids[:, :-1], mask[:, :-1])
        return generate(input_ids=ids, attention_mask=mask, past_key_values=cache, **_new_tokens(kwargs, 1))

    model.generate = last_step
    try:
        yield
    finally:
        del model.generate  # the class's method again


def _grown_cache(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> Any:
    """The dynamic KV cache ``generate`` would hold after ``ids``, filled by the model's own forward."""
    from transformers import DynamicCache

    config = model.config
    cache = DynamicCache(config=config)
    was_training = model.training
    model.eval()
    try:
        model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True, logits_to_keep=1)
    finally:
        model.train(was_training)
    return cache


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _world_size(trainer_cfg: Any) -> int:
    devices = trainer_cfg.devices
    if isinstance(devices, (list, tuple)):
        devices = len(devices)
    try:
        devices = int(devices)
    except (TypeError, ValueError):
        devices = 1  # "auto": one per process here
    return max(devices, 1) * int(trainer_cfg.num_nodes or 1)


def _notes(run: EstimateRun, callbacks: list[Any] | None, size: int) -> list[str]:
    """What the report says beside its figures: the device model, the sharding, the techniques the
    fake-tensor fit runs differently from the real one, paged state, tensor/context parallelism."""
    notes = []
    if run.device_model is not None:
        model = run.device_model
        notes.append(f"CUDA device model (lightning_mem.estimate.cuda): micro-batches padded (masked attention),"
                     f" {model.workspace_bytes / 2**20:.0f} MiB of cuBLAS/cuBLASLt workspaces ({model.blas_threads}"
                     f" thread(s)), blocks rounded to {model.round_bytes} B")
    if run.sharding.shard:
        notes.append(f"{run.sharding.name}: per rank, {', '.join(run.sharding.shard)} are 1/{size} of the measured "
                     f"bytes" + (f"; {', '.join(run.sharding.host)} on the host" if run.sharding.host else "")
                     + ("; the largest block (x2, prefetch) and the root unit are gathered on the device"
                        if run.sharding.gathered_units else "")
                     + ("; gradients stay whole on the device until backward leaves their unit"
                        if run.sharding.unit_gradients else ""))
    # Techniques the fake-tensor fit runs differently from the real one (compiled blocks run eager).
    notes += [cb.estimate_note for cb in callbacks or [] if getattr(cb, "estimate_note", None)]
    if run.paged_bytes:
        notes.append(f"paged optimizer state: {sum(run.paged_bytes.values()) / 2**30:.2f} GiB in CUDA managed memory, "
                     "counted on the host (the driver moves its pages there when the card runs short; "
                     "max_memory_allocated does not count it); the train phase counts the largest parameter's "
                     f"{run.paged_working_set / 2**30:.2f} GiB on the device, its pages at its update")
    tp, cp = run.sharding.tensor_parallel, run.sharding.context_parallel
    if tp * cp > 1:
        split = "activations" + (f" 1/{cp * tp}" if run.sharding.sequence_parallel else f" 1/{cp}")
        notes.append(f"{run.sharding.name}: gathered units and unreduced gradients are 1/{tp} (a tensor-parallel"
                     f" piece); outside generation {split} and logits 1/{cp} of the one-process run's"
                     + ("" if run.sharding.sequence_parallel or tp == 1 else
                        "; activations are not divided by the tensor-parallel size (an upper bound)")
                     + (f"; the KV cache 1/{tp}" if tp > 1 else ""))
    return notes


def estimate(
    config: str | Path,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    recipe: str | None = None,
    world_size: int | None = None,
    fake: bool = True,
    full_loops: bool = False,
    run_class: type[EstimateRun] = EstimateRun,
    device_memory: int | None = None,
) -> Estimate:
    """Estimate every phase of ``config`` (plus recipe CLI ``overrides``) per rank.

    ``fake=False`` runs the same fit on real tensors (for tests on small models).
    ``full_loops=True`` runs every decode step, micro-batch, mini-batch, epoch and accumulated
    micro-batch instead of the ones that decide the peak (:class:`EstimateRun`): the same figures,
    many times slower. ``run_class`` makes the run: :class:`EstimateRun`, or a subclass such as
    :mod:`.sharded`'s, which really shards the model. ``device_memory`` is one device's total bytes
    (default: the config's tier, if it names one): a vLLM rollout engine takes a fraction of it.
    """
    from lightning_mem.estimate.report import tier_of
    from lightning_mem.rl.engine_config import engines_stood_in

    module_name = recipe_for(config, recipe)
    cli, cfg, module_class = parse_config(module_name, ["--config", str(config), *overrides])
    if device_memory is None and (tier := tier_of(config)) is not None:
        device_memory = tier.memory_bytes
    with tempfile.TemporaryDirectory(prefix="lightning_mem_estimate_") as tmp, engines_stood_in():
        vocab = _localize_models(cfg.model, Path(tmp))
        if cfg.get("data") is not None and "tokenizer" in cfg.data:
            cfg.data.tokenizer = cfg.model.name_or_path
        init = instantiate(cli, cfg)
        size = world_size or _world_size(cfg.trainer)
        run = run_class(init, cfg, world_size=size, fake=fake, vocab=vocab, workdir=Path(tmp), full_loops=full_loops,
                        device_memory=device_memory)
        run.fit()
    notes = _notes(run, init.trainer.callbacks, size)
    return Estimate(str(config), module_name, size, run.sharding.name, run.phases, notes, parsed=cfg,
                    paged_state_bytes=sum(run.paged_bytes.values()))
