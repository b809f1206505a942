"""Run a recipe config's own step code on fake tensors and record each phase's memory.

The steps, in the order the real run takes them:

1. parse the config with the recipe's own LightningCLI parser (nothing is instantiated but the
   LightningModule and the strategy, precision and callbacks of the trainer section);
2. point every model of the config (policy, critic, reward model) at a folder holding only its
   ``config.json`` (a hub id resolves to ``assets/hub/<id>``), so the recipe's ``configure_model``
   builds it with random init -- on fake tensors, so nothing is allocated or read;
3. apply what the trainer would: the precision plugin's init context and conversion, the
   strategy's activation checkpointing, the technique callbacks' hooks;
4. make the optimizers with the module's ``configure_optimizers`` and take one small warm-up step,
   so the optimizer's real state tensors exist (their bytes are whatever the optimizer allocates);
5. run the largest micro-batch the config allows through the recipe's step methods and record,
   per phase, the peak of live tensor bytes and its breakdown (:mod:`.tracker`).

Sharding strategies (FSDP2, DeepSpeed ZeRO) run here as one unsharded process; their per-rank
bytes are derived from the measured weights, gradients and optimizer state (see
:func:`shard_per_rank`). For FSDP2 the derivation is the ledger's per-rank view, applied at every
allocation (a rank peaks where its own bytes do, not where the unsharded process does), with the
gradients followed unit by unit as FSDP2 reduce-scatters them (:class:`_GradientFlight`);
:mod:`.sharded` runs the same step really sharded, one process per rank, to check it.
"""

from __future__ import annotations

import contextlib
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

from lightning_mem.assets import ASSETS, HUB_ASSETS
from lightning_mem.estimate.tracker import HOST, MemoryLedger, TrackingMode

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


def _recipe_parts(module_name: str) -> tuple[Any, type, type, type]:
    """The recipe's CLI class, LightningModule class and LightningDataModule class, found in it."""
    from lightning.pytorch import LightningDataModule, LightningModule
    from lightning.pytorch.cli import LightningCLI

    from lightning_mem.cli import RecipeCLI

    mod = importlib.import_module(module_name)
    classes = [v for v in vars(mod).values() if inspect.isclass(v)]
    modules = [c for c in classes if issubclass(c, LightningModule) and c.__module__ == module_name]
    datas = [c for c in classes if issubclass(c, LightningDataModule)]
    clis = [c for c in classes if issubclass(c, LightningCLI) and c.__module__ == module_name]
    if len(modules) != 1 or not datas:
        raise ValueError(f"{module_name}: expected one LightningModule and a datamodule, found {modules} {datas}")
    return mod, (clis[0] if clis else RecipeCLI), modules[0], datas[0]


def parse_config(recipe_module: str, args: list[str]) -> tuple[Any, Any, type]:
    """Parse ``args`` (``--config ...`` and overrides) with the recipe's own CLI; instantiate nothing."""
    _, cli_class, module_class, data_class = _recipe_parts(recipe_module)

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


def _localize_models(model_cfg: Any, workdir: Path) -> list[int]:
    """Rewrite every model location of ``model_cfg`` in place; return the vocabulary sizes."""
    vocab: list[int] = []

    def swap(holder: Any, attr: str, key: str) -> None:
        value = getattr(holder, attr, None) if holder is not None else None
        if not value:
            return
        folder = config_folder(value, key)
        config = json.loads((folder / "config.json").read_text())
        vocab.append(int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size", 0)))
        setattr(holder, attr, config_only_copy(value, key, workdir))

    swap(model_cfg, "name_or_path", "model.name_or_path")
    swap(getattr(model_cfg, "critic", None), "name_or_path", "model.critic.name_or_path")
    swap(getattr(model_cfg, "reward_model", None), "name_or_path", "model.reward_model.name_or_path")
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
    # DeepSpeed ZeRO: the optimizer steps fp32 master copies of 16-bit weights (see
    # :class:`_MasterWeights`), and gradients pass through reduce buckets of this many elements.
    master_weights: bool = False
    bucket_elements: int = 0
    # Gradients are reduce-scattered unit by unit as backward leaves each unit (FSDP2): until then a
    # unit's gradients are whole on the device, and its reduce-scatter input stays allocated until
    # the next unit reduces (see :class:`_GradientFlight`).
    unit_gradients: bool = False


def sharding_of(strategy: Any) -> Sharding:
    if strategy is None:
        return Sharding()
    name = type(strategy).__name__
    if hasattr(strategy, "_cpu_offload") and hasattr(strategy, "_reshard_after_forward"):  # FSDP2Strategy
        cats = ("weights", "gradients", "optimizer_state")
        return Sharding("FSDP2" + (" + CPU offload" if strategy.cpu_offload else ""), cats,
                        cats if strategy.cpu_offload else (), gathered_units=2, unit_gradients=True)
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


def shard_per_rank(breakdown: dict[str, int], host: int, sharding: Sharding, world_size: int,
                   unit_bytes: tuple[int, int], grad_element_size: int = 4, *, gathered: bool = True,
                   in_flight: tuple[int, int] | None = None,
                   gathered_units: int | None = None) -> tuple[dict[str, int], int]:
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
    """
    measured_grads = breakdown["gradients"]
    out = dict(breakdown)
    unreduced, buffered = in_flight if in_flight is not None and gathered else (0, 0)
    for cat in sharding.shard:
        share = math.ceil((breakdown[cat] - (unreduced if cat == "gradients" else 0)) / world_size)
        if cat in sharding.host:
            out[cat] = 0
            host += share * 4 // grad_element_size if cat == "gradients" and sharding.master_weights else share
        else:
            out[cat] = share
    if "weights" in sharding.shard and sharding.gathered_units and gathered:
        block, root = unit_bytes
        units = sharding.gathered_units if gathered_units is None else gathered_units
        out["weights"] += min(units * block + root, breakdown["weights"])
        if in_flight is not None:
            out["gradients"] += unreduced + buffered
        elif breakdown["gradients"]:
            out["gradients"] += min(block + root, breakdown["gradients"])
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
def _attribution(ledger: MemoryLedger, fake: bool) -> Iterator[None]:
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


class EstimateRun:
    """One estimate: the module, its optimizers and trainer pieces, the ledger, and the phases."""

    def __init__(self, init: Any, cfg: Any, *, world_size: int, fake: bool, vocab: list[int], workdir: Path) -> None:
        from lightning.pytorch import Trainer

        self.module = init.model
        self.data = init.data
        self.cfg = cfg
        trainer_cfg = init.trainer
        self.strategy = trainer_cfg.strategy if not isinstance(trainer_cfg.strategy, str) else None
        self.callbacks = [cb for cb in (trainer_cfg.callbacks or []) if _is_technique(cb)]
        self.precision = precision_plugin(trainer_cfg.precision)
        self.clip = trainer_cfg.gradient_clip_val
        self.world_size = world_size
        self.sharding = sharding_of(self.strategy)
        self.ledger = MemoryLedger(set(vocab))
        self.mode = TrackingMode(self.ledger, fake=fake)
        # A CPU trainer for what the module's methods read from it (world size, device).
        # Its root is the estimate's temporary folder: whatever a recipe writes under
        # ``trainer.default_root_dir`` (a real run's saved random base) goes nowhere else.
        self.trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                               default_root_dir=str(workdir),
                               enable_progress_bar=False, enable_model_summary=False, callbacks=self.callbacks)
        self.phases: list[PhaseEstimate] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self._units = (0, 0)
        self._grad_size = 4
        self._flight: _GradientFlight | None = None
        self._stepping = False

    # -- building ---------------------------------------------------------------------------------
    def build(self) -> None:
        module = self.module
        module.trainer = self.trainer
        # Logging needs a running loop; what a step logs takes no memory worth counting.
        module.log = module.log_dict = lambda *args, **kwargs: None
        with self.precision.module_init_context():
            module.configure_model()
        _convert(self.precision, module)
        self._checkpointing()
        for cb in self.callbacks:
            cb.setup(self.trainer, module, "fit")
        self.retag()
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._gradient_ready)
        # A learning-rate schedule holds no tensors, and its horizon needs a running trainer.
        module.lr_scheduler_factory = None
        out = module.configure_optimizers()
        self.optimizers = _optimizer_list(out)
        if self.sharding.master_weights:
            self.optimizers = [_MasterWeights.wrap(opt, self.ledger) for opt in self.optimizers]
        for opt in self.optimizers:
            opt.register_step_post_hook(lambda o, *_: self._retag_optimizer(o))
        for cb in self.callbacks:
            cb.on_fit_start(self.trainer, module)
        self._units, self._grad_size = self.unit_bytes(), self.grad_element_size()
        if self.sharding.shard:  # a sharded run: the ledger's peaks are one rank's
            if self.sharding.unit_gradients:  # FSDP2 reduce-scatters gradients unit by unit
                self._flight = _GradientFlight.of(module, self.strategy)
            self.ledger.view = self._per_rank

    def _per_rank(self, breakdown: dict[str, int], host: int) -> tuple[dict[str, int], int]:
        flight = self._flight
        return shard_per_rank(breakdown, host, self.sharding, self.world_size, self._units, self._grad_size,
                              gathered=not self._stepping,
                              in_flight=(flight.unreduced, flight.buffered) if flight is not None else None,
                              gathered_units=1 if flight is not None and flight.last_block else None)

    def _gradient_ready(self, param: torch.Tensor) -> None:
        if self._flight is not None:  # before the retag: the view then sees the unit's progress
            self._flight.add(param)
        self.ledger.retag(param.grad, "gradients")

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

    def retag(self) -> None:
        """Parameters and buffers are weights, gradients gradients, optimizer tensors state (unless on the host)."""
        ledger = self.ledger
        for t in [*self.module.parameters(), *self.module.buffers(), *_quantization_state(self.module)]:
            if ledger.category_of(t) != HOST:
                ledger.retag(t, "weights")
            if isinstance(t, nn.Parameter) and t.grad is not None and ledger.category_of(t.grad) != HOST:
                ledger.retag(t.grad, "gradients")
        for opt in self.optimizers:
            self._retag_optimizer(opt)

    def _retag_optimizer(self, opt: torch.optim.Optimizer) -> None:
        for state in opt.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and self.ledger.category_of(value) != HOST:
                    self.ledger.retag(value, "optimizer_state")

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

    # -- measuring --------------------------------------------------------------------------------
    def accounting(self) -> contextlib.AbstractContextManager:
        """What the run adds to the ledger's view for its whole length (a subclass's hooks)."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def phase(self, name: str, shape: str) -> Iterator[None]:
        self.retag()
        self.ledger.reset_peak()
        yield
        ledger = self.ledger
        if ledger.view is not None:  # the peak of one rank's view, taken at every moment
            breakdown, host = dict(ledger.peak_breakdown), ledger.peak_host_bytes
        else:  # the unsharded peak, divided over the ranks
            breakdown, host = shard_per_rank(ledger.peak_breakdown, ledger.peak_host_bytes, self.sharding,
                                             self.world_size, self._units, self._grad_size)
        self.phases.append(PhaseEstimate(name, sum(breakdown.values()), breakdown, host, shape))

    def step_optimizers(self) -> None:
        self._stepping = True  # a sharded model is resharded: nothing gathered, nothing in flight
        try:
            for opt in self.optimizers:
                for cb in self.callbacks:
                    cb.on_before_optimizer_step(self.trainer, self.module, opt)
                if self.clip:
                    params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
                    torch.nn.utils.clip_grad_norm_(params, float(self.clip))
                opt.step()
                opt.zero_grad(set_to_none=True)
        finally:
            self._stepping = False

    def backward(self, loss: torch.Tensor) -> None:
        for cb in self.callbacks:
            cb.on_before_backward(self.trainer, self.module, loss)
        loss.backward()
        if self._flight is not None:  # FSDP2 reduces the root units and frees its buffers at the end
            self._flight.reset()
        for cb in self.callbacks:
            cb.on_after_backward(self.trainer, self.module)


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
    def step(self) -> None:
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

    def reset(self) -> None:
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
    from torch._subclasses.fake_tensor import FakeTensor

    params4bit = bnb.nn.Params4bit
    fake_class = type("Params4bit", (FakeTensor, params4bit), {"__module__": __name__})
    original = params4bit.__new__

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

    params4bit.__new__ = new
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


def _quantization_state(module: nn.Module) -> list[torch.Tensor]:
    """The tensors a quantized weight holds besides its packed bytes (absmax, code books, ...):
    weights, though neither parameters nor buffers."""
    from lightning_mem.quantization import quant_state_tensors, is_quantized_linear

    return [t for m in module.modules() if is_quantized_linear(m) for t in quant_state_tensors(m.weight)]


def _convert(precision: Any, module: nn.Module) -> None:
    """``precision.convert_module`` in place, tensor by tensor: ``Module.to`` would swap the fake
    parameters, which their weak references forbid."""
    target = getattr(precision, "_desired_input_dtype", None)
    if target is None:
        return
    for t in [*module.parameters(), *module.buffers()]:
        if t.is_floating_point() and t.dtype != target:
            t.data = t.data.to(target)


def _is_technique(callback: Any) -> bool:
    """The callbacks that change memory (not the monitor or checkpointing)."""
    from lightning_mem.callbacks import MemoryMonitor

    from lightning.pytorch.callbacks import ModelCheckpoint

    return not isinstance(callback, (MemoryMonitor, ModelCheckpoint)) and type(callback).__name__ != "FitCheck"


def _optimizer_list(out: Any) -> list[torch.optim.Optimizer]:
    if isinstance(out, torch.optim.Optimizer):
        return [out]
    if isinstance(out, dict):
        return [out["optimizer"]]
    if isinstance(out, tuple):
        out = out[0]
    return [o["optimizer"] if isinstance(o, dict) else o for o in out]


# ---------------------------------------------------------------------------------------------
# The recipes' steps
# ---------------------------------------------------------------------------------------------


def _tokens(shape: tuple[int, int], fill: int) -> dict[str, torch.Tensor]:
    ids = torch.full(shape, fill, dtype=torch.long)
    return {"input_ids": ids, "attention_mask": torch.ones(shape, dtype=torch.long), "labels": ids.clone()}


def _fill_token(pad: int | None, eos: list[int]) -> int:
    """The smallest token id that neither ends a sequence nor pads: the worst case, every sequence full."""
    taken = set(eos) | ({pad} if pad is not None else set())
    return next(i for i in range(len(taken) + 1) if i not in taken)


def sft_batch_shape(data: Any) -> tuple[int, int]:
    """The largest micro-batch the data section allows: a full token budget of full-length rows."""
    length = data.max_length
    if getattr(data, "max_tokens_per_batch", None):
        return max(data.max_tokens_per_batch // length, 1), length
    return data.batch_size, length


def run_sft(run: EstimateRun, accumulate: int) -> None:
    """The SFT/QLoRA training step (``module.loss``, backward, optimizer step), largest micro-batch."""
    module = run.module
    config = module.model.config
    fill = _fill_token(getattr(config, "pad_token_id", None), _as_list(getattr(config, "eos_token_id", None)))
    shape = sft_batch_shape(run.data)

    def step(batch_shape: tuple[int, int], micro_batches: int) -> None:
        for index in range(micro_batches):
            batch = _tokens(batch_shape, fill)
            for cb in run.callbacks:
                cb.on_train_batch_start(run.trainer, module, batch, index)
            with run.precision.train_step_context():
                loss_sum, tokens = module.loss(batch)  # the summed cross-entropy and its label tokens
                loss = loss_sum / tokens.clamp(min=1)
            run.backward(loss / micro_batches)
            del loss
            for cb in run.callbacks:
                cb.on_train_batch_end(run.trainer, module, None, batch, index)
        run.step_optimizers()

    step((1, 8), 1)  # warm-up: the optimizer makes its state
    # With accumulation, the second micro-batch runs its forward next to the first one's gradients.
    with run.phase("train", f"micro-batch {shape[0]} x {shape[1]} tokens, {min(accumulate, 2)} of {accumulate} accumulated"):
        step(shape, min(accumulate, 2))


def run_ppo(run: EstimateRun, rows: list[dict[str, Any]], *, full_loops: bool = False) -> None:
    """A PPO iteration through the module's own rollout, score and update methods, at the largest
    shapes: every prompt ``max_prompt_length`` long, every response ``max_new_tokens`` long.

    Two loops repeat the same step many times, and a repetition cannot raise the peak (see
    :func:`_last_decode_step` and :func:`_steady_micro_batches`): generation runs its prefill and
    first decode step and then only its last decode step, and each phase runs at most two
    micro-batches of each shape. ``full_loops=True`` runs every decode step and every micro-batch
    (what the tests compare the fast estimate with).
    """
    from lightning_mem.rl.memory_plan import PhaseMemory
    from lightning_mem.rl.microbatch import micro_batches

    module = run.module
    engine = module.rollout_engine
    run.mode.fill_token = _fill_token(engine.pad_token_id, engine.eos_token_ids)
    opts = run.optimizers
    module.memory = PhaseMemory(
        module.memory_plan, trainer=None, actor_optimizer=opts[0], critic_optimizer=opts[1] if len(opts) > 1 else None,
        critic=module.critic, reference=module.reference, reward_model=module.reward_model, rollout_engine=engine,
    )
    module.memory.place("train")
    ppo = module.ppo
    run.clip = ppo.max_grad_norm
    row = rows[0] if rows else {}
    batching = micro_batches if full_loops else _steady_micro_batches(micro_batches)
    recipe_globals = vars(inspect.getmodule(type(module)))

    def iteration(prompts: int, prompt_len: int, new_tokens: int) -> None:
        fill = run.mode.fill_token
        engine.config = dataclasses.replace(engine.config, max_new_tokens=new_tokens)
        batch = {
            "input_ids": torch.full((prompts, prompt_len), fill, dtype=torch.long),
            "attention_mask": torch.ones((prompts, prompt_len), dtype=torch.long),
            "rows": [row] * prompts,
        }
        group = module.grpo.group_size if not module.use_critic else 1
        seqs = f"{prompts * group} sequences x ({prompt_len} prompt + {new_tokens} new) tokens"
        generation = contextlib.nullcontext() if full_loops else _last_decode_step(run, module.actor)
        with run.phase("rollout", seqs), module.memory.phase("rollout"), generation:
            run.retag()
            exp = module.rollout(batch)
        with run.phase("score", f"{seqs}, no-grad micro-batches of <= {ppo.logprob_budget} tokens"), \
                module.memory.phase("score"), _replaced(recipe_globals, "micro_batches", batching):
            run.retag()
            _score(module, exp)
            module.logprobs_and_values(exp)
        module.advantages(exp)
        _ppo_update(run, exp, batch, batching)

    generation = engine.config
    try:
        _warm_up_optimizers(run)  # the optimizers make their state, as after any earlier step
        iteration(run.data.batch_size, run.data.max_prompt_length, generation.max_new_tokens)
    finally:
        engine.config = generation


def _ppo_update(run: EstimateRun, exp: Any, batch: dict[str, Any], batching: Callable) -> None:
    """The train phase: the first mini-batch's micro-batches through the module's loss, backward
    and one optimizer step (later mini-batches have the same shapes)."""
    module, ppo = run.module, run.module.ppo
    mini_size = math.ceil(len(exp) / ppo.num_mini_batches)
    with run.phase("train", f"mini-batch of {mini_size} sequences, micro-batches of <= "
                            f"{ppo.max_tokens_per_microbatch} tokens"), module.memory.phase("train"):
        run.retag()
        for cb in run.callbacks:
            cb.on_train_batch_start(run.trainer, module, batch, 0)
        mini = exp.select(torch.arange(mini_size))
        scale = 1.0 / max(float(mini.response_mask.sum()), 1.0)
        for idx in batching(mini.sequence_lengths, ppo.max_tokens_per_microbatch,
                            agree_on_count=module.agree_on_count):
            with run.precision.train_step_context():
                loss, _ = module.loss(mini.select(idx))
            run.backward(loss * scale)
            del loss
        run.step_optimizers()
        for cb in run.callbacks:
            cb.on_train_batch_end(run.trainer, module, None, batch, 0)


def _warm_up_optimizers(run: EstimateRun) -> None:
    """One optimizer step on zero gradients: every optimizer makes its real state tensors (AdamW's
    moments, bitsandbytes' 8-bit blocks), as they exist at any step after the first; the gradients
    are freed again by the step's ``zero_grad``."""
    for opt in run.optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
    run.step_optimizers()


@contextlib.contextmanager
def _replaced(namespace: dict[str, Any], name: str, value: Any) -> Iterator[None]:
    """``namespace[name] = value`` inside (a recipe module's global), if it has that name."""
    if name not in namespace:
        yield
        return
    original = namespace[name]
    namespace[name] = value
    try:
        yield
    finally:
        namespace[name] = original


def _steady_micro_batches(micro_batches: Callable) -> Callable:
    """``micro_batches`` keeping at most two micro-batches of each shape.

    A micro-batch's tensors are fixed by its rows' sequence lengths (every prompt of the
    estimator's batch has the same length, so its response lengths follow). Micro-batches of one
    shape leave the same live state behind them: the first a phase's outputs (and, in training,
    the gradients, allocated by its backward), the second exactly what it found. The third and
    later therefore start from the second's state and repeat its peak: skipping them changes no
    figure (``tests/estimate/test_estimate_accuracy.py`` checks it against every micro-batch run).
    """

    def steady(lengths: Any, max_tokens: Any, **kwargs: Any) -> list[list[int]]:
        seen: dict[tuple[int, ...], int] = {}
        kept = []
        for idx in micro_batches(lengths, max_tokens, **kwargs):
            key = tuple(sorted(int(lengths[i]) for i in idx))
            seen[key] = seen.get(key, 0) + 1
            if seen[key] <= 2:
                kept.append(idx)
        return kept

    return steady


@contextlib.contextmanager
def _last_decode_step(run: EstimateRun, model: nn.Module) -> Iterator[None]:
    """Generation's memory peak without its whole loop: ``model.generate`` runs twice, for real.

    Autoregressive decoding peaks either in its prefill (every prompt token at once) or in its last
    decode step (one token per sequence against the longest KV cache: a dynamic cache only grows,
    and each step's other tensors have the same shapes). So ``generate`` runs (1) on the prompts for
    two new tokens -- the prefill and the first decode step -- and then (2) for the last token,
    resuming from a cache that the model's own forward filled with the prompt and the first
    ``max_new_tokens - 2`` response tokens (``fill_token``\ s, which the sampler would have
    produced; making that cache is not measured: the real loop grows it one token at a time, with
    smaller transients than the step measured next). Its output is the full-length sequences, as
    the whole loop's would be. A static (preallocated, full-length) cache makes every decode step
    alike: the second step stands for the last, and the output is padded to full length with
    ``fill_token``.
    """
    generate = model.generate

    def last_step(*args: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                  **kwargs: Any) -> torch.Tensor:
        if args or max_new_tokens <= 3:
            return generate(*args, input_ids=input_ids, attention_mask=attention_mask,
                            max_new_tokens=max_new_tokens, **kwargs)
        fill = run.mode.fill_token
        rows, prompt = input_ids.shape
        first = generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=2, **kwargs)
        if kwargs.get("past_key_values") is not None:  # static: the step's shapes do not grow
            pad = torch.full((rows, prompt + max_new_tokens - first.shape[1]), fill, dtype=first.dtype)
            return torch.cat([first, pad], dim=1)
        del first
        done = max_new_tokens - 1  # response tokens the loop has made before its last step
        ids = torch.cat([input_ids, torch.full((rows, done), fill, dtype=input_ids.dtype)], dim=1)
        mask = torch.cat([attention_mask, torch.ones((rows, done), dtype=attention_mask.dtype)], dim=1)
        with run.ledger.unmeasured(), torch.no_grad():
            cache = _grown_cache(model, ids[:, :-1], mask[:, :-1])
        return generate(input_ids=ids, attention_mask=mask, max_new_tokens=1, past_key_values=cache, **kwargs)

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


def _score(module: Any, exp: Any) -> None:
    # A rule scores strings (no tensors to speak of); a reward model runs for real on fake tensors.
    try:
        module.score(exp)
    except (KeyError, TypeError, ValueError):
        if module.reward_model is not None:
            raise
        exp.scores = torch.zeros(len(exp))


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


def _first_rows(path: str | None, count: int = 1) -> list[dict[str, Any]]:
    if not path or not Path(path).is_file():
        return []
    with open(path) as handle:
        return [json.loads(line) for line, _ in zip(handle, range(count)) if line.strip()]


def estimate(
    config: str | Path,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    recipe: str | None = None,
    world_size: int | None = None,
    fake: bool = True,
    full_loops: bool = False,
    run_class: type[EstimateRun] = EstimateRun,
) -> Estimate:
    """Estimate every phase of ``config`` (plus recipe CLI ``overrides``) per rank.

    ``fake=False`` runs the same steps on real tensors (for tests on small models).
    ``full_loops=True`` runs PPO's every decode step and micro-batch instead of the ones that
    decide the peak (:func:`run_ppo`): the same figures, many times slower. ``run_class`` makes
    the run: :class:`EstimateRun`, or a subclass such as :mod:`.sharded`'s, which really shards
    the model.
    """
    module_name = recipe_for(config, recipe)
    cli, cfg, module_class = parse_config(module_name, ["--config", str(config), *overrides])
    with tempfile.TemporaryDirectory(prefix="lightning_mem_estimate_") as tmp:
        vocab = _localize_models(cfg.model, Path(tmp))
        if cfg.get("data") is not None and "tokenizer" in cfg.data:
            cfg.data.tokenizer = cfg.model.name_or_path
        init = instantiate(cli, cfg)
        size = world_size or _world_size(cfg.trainer)
        run = run_class(init, cfg, world_size=size, fake=fake, vocab=vocab, workdir=Path(tmp))
        with _attribution(run.ledger, fake), _weights_source(fake), run.mode, run.accounting():
            try:
                run.build()
                if hasattr(run.module, "rollout_engine"):
                    run_ppo(run, _first_rows(getattr(run.data, "train_path", None) or cfg.data.get("train_file")),
                            full_loops=full_loops)
                else:
                    run_sft(run, int(cfg.trainer.accumulate_grad_batches or 1))
            finally:
                for cb in run.callbacks:  # e.g. activation offload's saved-tensor hooks are global
                    cb.teardown(run.trainer, run.module, "fit")
    notes = []
    if run.sharding.shard:
        notes.append(f"{run.sharding.name}: per rank, {', '.join(run.sharding.shard)} are 1/{size} of the measured "
                     f"bytes" + (f"; {', '.join(run.sharding.host)} on the host" if run.sharding.host else "")
                     + ("; the largest block (x2, prefetch) and the root unit are gathered on the device"
                        if run.sharding.gathered_units else "")
                     + ("; gradients stay whole on the device until backward leaves their unit"
                        if run.sharding.unit_gradients else ""))
    return Estimate(str(config), module_name, size, run.sharding.name, run.phases, notes, parsed=cfg)
