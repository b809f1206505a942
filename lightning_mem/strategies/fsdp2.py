"""FSDP2 for every Hugging Face model in a LightningModule, with CPU offload.

``FSDP2Strategy`` is Lightning's ``ModelParallelStrategy`` with the parallelization
written for the user: the LightningModule needs no ``configure_model`` and no
``fully_shard``. In ``setup`` the strategy

1. finds the HF models the module holds (``models_to_shard``),
2. per model, applies activation checkpointing to its blocks
   (``apply_activation_checkpointing``) and shards each block, then the model's root
   (``shard_module``, with ``mixed_precision_policy`` and ``offload_policy``),
3. shards any other module holding parameters (a value head) as a unit of its own,
4. materializes what was created on the meta device: params on the host when offloading,
   on the device otherwise (``materialize``, ``initialize_weights``),
5. moves what FSDP does not own (buffers) to the device and builds the optimizers,
6. lets each optimizer step sharded parameters (``prepare_optimizer``: bitsandbytes'
   optimizers step each rank's local shard).

Each step is a small method a subclass may override; see docs/fsdp2.md.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_mem.checkpointing import (
    CHECKPOINT_METADATA,
    AtomicCheckpointIO,
    check_complete,
    load_sharded_checkpoint,
    publish_version,
    remove_versioned,
    version_dir,
)
from lightning_mem.context_parallel import SequenceLayout, attach_layout
from lightning_mem.dtypes import resolve_dtype
from lightning_mem.settings import STRATEGY_ARGS, SettingError, SettingNotSupported, settings_at
from lightning_mem.offload import optimizer_state_onto
from lightning_mem.optim import step_local_shards
from lightning_mem import activation_checkpointing, module_tree
from lightning_mem.activation_checkpointing import POLICIES
from lightning_mem.strategies import shard_plan, tensor_parallel
from lightning_mem.export import full_state_dict

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

#: Default process-group timeout (seconds): short enough that a hung rank does not hold every node
#: for Lightning's 30 minutes, long enough for rank 0 to write an 8B bf16 export (16 GB: under 3
#: minutes at 100 MB/s) while the others wait at a barrier.
DEFAULT_TIMEOUT_S = 600.0


def _zero_embedding_padding_rows(module: nn.Module) -> None:
    """Zero each sharded embedding's ``padding_idx`` row in whichever rank holds it.

    HF's init zeroes that row with ``init.zeros_(weight[padding_idx])``; indexing a
    dim-0-sharded DTensor returns a gathered copy, so on a sharded model the write is lost.
    """
    for sub in module.modules():
        weight = getattr(sub, "weight", None)
        if not isinstance(sub, nn.Embedding) or sub.padding_idx is None or not isinstance(weight, DTensor):
            continue
        if len(weight.placements) != 1 or not weight.placements[0].is_shard(0):
            continue
        mesh = weight.device_mesh
        # Shard(0) splits rows like `torch.chunk`: ceil(rows / ranks) rows per rank.
        rows_per_rank = -(-weight.shape[0] // mesh.size())
        row = sub.padding_idx - mesh.get_local_rank() * rows_per_rank
        local = weight.to_local()
        if 0 <= row < local.shape[0]:
            with torch.no_grad():
                local[row].zero_()


def _is_meta(tensor: Tensor) -> bool:
    return tensor.device.type == "meta"


class FSDP2Strategy(ModelParallelStrategy):
    """FSDP2 (``fully_shard``) per decoder block for every HF model in the LightningModule.

    Arguments:
        cpu_offload: keep sharded parameters and gradients on the host and run the optimizer
            step there (FSDP2 ``CPUOffloadPolicy``). Host memory is pinned only when the
            strategy runs on an accelerator.
        reshard_after_forward: ``True`` frees gathered parameters after each unit's forward
            (all-gather again in backward); ``False`` keeps them until backward; an int ``k``
            keeps a ``k``-way shard (a divisor of the data-parallel size, not 1 nor all of it).
        param_dtype: dtype parameters are all-gathered and computed in (``"bfloat16"``, ...);
            ``None`` keeps their own. The sharded master copy keeps its dtype.
        reduce_dtype: dtype gradients are reduce-scattered in; ``None`` follows ``param_dtype``.
        activation_checkpointing: ``True`` recomputes every block's activations in backward
            (non-reentrant); an int ``k`` checkpoints every ``k``-th block (blocks 0, k, 2k, ...).
        activation_checkpointing_policy: ``"full"`` recomputes the whole block; ``"selective"``
            keeps matmul and attention outputs and recomputes the rest
            (:mod:`lightning_mem.activation_checkpointing`).
        shard_modules: class names of the blocks to shard (e.g. ``["LlamaDecoderLayer"]``);
            ``None`` takes each HF model's ``_no_split_modules``.
        data_parallel_size: ranks that each train on their own batches; ``"auto"`` is world size
            divided by ``tensor_parallel_size x context_parallel_size``. Parameters are sharded
            across the data and context ranks.
        tensor_parallel_size: ranks each layer's weights are split across, by the architecture's
            own tensor-parallel plan in ``transformers``
            (:mod:`lightning_mem.strategies.tensor_parallel`); 1 (the default) means FSDP alone.
            Needs the attention and key/value heads to divide by it (times ``context_parallel_size``).
        sequence_parallel: with ``tensor_parallel_size > 1``, also split the norms and the
            residual stream between the tensor-parallel regions along the sequence: their saved
            activations shrink ``tensor_parallel_size`` times, at no extra communication.
        context_parallel_size: ranks each sequence is split across (Ulysses attention,
            :mod:`lightning_mem.context_parallel`): every activation shrinks that many times. The
            ranks of a group read the same batches; models score through
            :func:`lightning_mem.logits.score_tokens`, which splits and gathers.
        save_distributed_checkpoint: ``True`` saves one shard per rank (a folder);
            ``False`` gathers full weights and optimizer state into one file on rank 0.
        process_group_backend: as for ``ModelParallelStrategy`` (gloo on CPU, nccl on GPU).
        timeout: how long a collective waits for the other ranks before the run fails, in
            seconds (or a ``timedelta``). A rank that hangs (a stuck data read, SIGSTOP, a dead
            node) then stops every rank after this long instead of Lightning's 30 minutes. It
            must exceed the longest time one rank works while the others wait at a collective:
            rank 0 writing an export or a full (non-sharded) checkpoint of a large model; raise
            it for 70B-scale exports to slow disks.

    Checkpoints: a sharded checkpoint ``<name>.ckpt`` is a symlink to the folder of its latest
    complete save, ``<name>.ckpt.step<N>.<id>``; each save writes a new folder and then swaps the
    link atomically, keeping the previous folder (resume from it by passing its path). A folder
    whose save did not finish lacks its completion marker and is refused on load. The format is
    :mod:`lightning_mem.checkpointing`'s (the export reads it too).
    """

    strategy_name = "fsdp2"

    #: The overridable steps' former (underscore) names; a subclass still overriding one would be
    #: silently ignored, so defining it is an error that names the new method.
    _RENAMED_STEPS = {
        f"_{name}": name
        for name in ("models_to_shard", "blocks_to_shard", "apply_activation_checkpointing", "offload_policy",
                     "mixed_precision_policy", "shard_module", "materialize", "initialize_weights")
    }

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        old = sorted(name for name in cls._RENAMED_STEPS if name in vars(cls))
        if old:
            raise TypeError(
                f"{cls.__name__} overrides {old}: FSDP2Strategy's steps are public now; rename them to"
                f" {[cls._RENAMED_STEPS[name] for name in old]}"
            )

    def __init__(
        self,
        cpu_offload: bool = False,
        reshard_after_forward: Union[bool, int] = True,
        param_dtype: Union[str, torch.dtype, None] = None,
        reduce_dtype: Union[str, torch.dtype, None] = None,
        activation_checkpointing: Union[bool, int] = False,
        activation_checkpointing_policy: Literal["full", "selective"] = "full",
        shard_modules: Optional[Sequence[str]] = None,
        data_parallel_size: Union[Literal["auto"], int] = "auto",
        tensor_parallel_size: int = 1,
        sequence_parallel: bool = False,
        context_parallel_size: int = 1,
        save_distributed_checkpoint: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Union[float, timedelta, None] = DEFAULT_TIMEOUT_S,
    ) -> None:
        with settings_at(STRATEGY_ARGS):  # a bad argument fails here, named where the Trainer takes it
            self._check_sizes(data_parallel_size, tensor_parallel_size)
            self._check_model_parallel(tensor_parallel_size, sequence_parallel, context_parallel_size)
            self._check_plan(cpu_offload, reshard_after_forward, activation_checkpointing, tensor_parallel_size)
            shard_modules = self._shard_module_names(shard_modules)
            timeout = self._timeout_of(timeout)
            if activation_checkpointing_policy not in POLICIES:
                raise SettingError("activation_checkpointing_policy", f" must be one of {POLICIES},"
                                   f" got {activation_checkpointing_policy!r}")
            param_dtype = resolve_dtype(param_dtype, key="param_dtype")
            reduce_dtype = resolve_dtype(reduce_dtype, key="reduce_dtype")
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout if timeout is not None else default_pg_timeout,
        )
        # Full (non-sharded) checkpoints are one file written by rank 0: write it beside the
        # target and rename it, so a crash never leaves a truncated `last.ckpt`.
        self.checkpoint_io = AtomicCheckpointIO()
        self._cpu_offload = cpu_offload
        self._reshard_after_forward = reshard_after_forward
        self._param_dtype = param_dtype
        self._reduce_dtype = reduce_dtype
        # `True` means every block; an int counts blocks; bool is an int, so normalize.
        self._checkpoint_every = int(activation_checkpointing)
        self._checkpoint_policy = activation_checkpointing_policy
        self._shard_modules = shard_modules
        self._sequence_parallel = sequence_parallel
        self._context_parallel_size = context_parallel_size

    @staticmethod
    def _check_plan(cpu_offload: Any, reshard_after_forward: Any, activation_checkpointing: Any,
                    tensor_parallel_size: int) -> None:
        if not isinstance(cpu_offload, bool):
            raise SettingError("cpu_offload", f" must be true or false, got {cpu_offload!r}")
        if cpu_offload and tensor_parallel_size != 1:
            raise SettingError(
                "cpu_offload",
                f"`cpu_offload: true` cannot be combined with `tensor_parallel_size: {tensor_parallel_size}`:"
                " FSDP2's CPU offload needs plain data-parallel shards, while tensor-parallel"
                " parameters must stay on the device. Use `tensor_parallel_size: 1` or `cpu_offload: false`",
                siblings=("tensor_parallel_size",))
        if not isinstance(reshard_after_forward, int) or (
            not isinstance(reshard_after_forward, bool) and reshard_after_forward < 2
        ):
            raise SettingError("reshard_after_forward", " must be a bool or an int >= 2 (a shard size), got"
                               f" {reshard_after_forward!r}")
        if not isinstance(activation_checkpointing, int) or activation_checkpointing < 0:
            raise SettingError("activation_checkpointing", " must be a bool or an int k >= 0 (checkpoint every k-th"
                               f" block), got {activation_checkpointing!r}")

    @staticmethod
    def _shard_module_names(shard_modules: Any) -> Optional[list[str]]:
        if shard_modules is None:
            return None
        if isinstance(shard_modules, str):
            shard_modules = [shard_modules]
        if not shard_modules or not all(isinstance(name, str) and name for name in shard_modules):
            raise SettingError("shard_modules", f" must be a non-empty list of class names, got {shard_modules!r}")
        return list(shard_modules)

    @staticmethod
    def _timeout_of(timeout: Union[float, timedelta, None]) -> Optional[timedelta]:
        if timeout is None or isinstance(timeout, timedelta):
            return timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise SettingError("timeout", f" must be a positive number of seconds, got {timeout!r}")
        return timedelta(seconds=timeout)

    @property
    def param_dtype(self) -> torch.dtype | None:
        """The dtype units are gathered and computed in (None: the parameters' own)."""
        return self._param_dtype

    @staticmethod
    def _check_sizes(data_parallel_size: Any, tensor_parallel_size: Any) -> None:
        if data_parallel_size != "auto" and (
            isinstance(data_parallel_size, bool) or not isinstance(data_parallel_size, int) or data_parallel_size < 1
        ):
            raise SettingError("data_parallel_size", f" must be 'auto' or an int >= 1, got {data_parallel_size!r}")
        if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
            raise SettingError(
                "tensor_parallel_size", f" must be an int >= 1, got {tensor_parallel_size!r} (Lightning's 'auto'"
                " makes it the devices per node, which leaves nothing for FSDP to shard on one node)")

    @staticmethod
    def _check_model_parallel(tensor_parallel_size: int, sequence_parallel: Any, context_parallel_size: Any) -> None:
        if not isinstance(sequence_parallel, bool):
            raise SettingError("sequence_parallel", f" must be true or false, got {sequence_parallel!r}")
        if sequence_parallel and tensor_parallel_size == 1:
            raise SettingError("sequence_parallel", ": true needs `tensor_parallel_size` > 1: it splits the sequence"
                               " between the tensor-parallel regions", siblings=("tensor_parallel_size",))
        if isinstance(context_parallel_size, bool) or not isinstance(context_parallel_size, int) or context_parallel_size < 1:
            raise SettingError("context_parallel_size", f" must be an int >= 1, got {context_parallel_size!r}")

    @property
    def cpu_offload(self) -> bool:
        return self._cpu_offload

    @property
    def tensor_parallel_size(self) -> int:
        return self._tensor_parallel_size

    @property
    def context_parallel_size(self) -> int:
        return self._context_parallel_size

    @property
    def sequence_parallel(self) -> bool:
        return self._sequence_parallel

    # ------------------------------------------------------------------ registry

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:  # Lightning's _StrategyRegistry
        """Register the short names ``fsdp2`` and ``fsdp2_cpu_offload`` (``Trainer(strategy="fsdp2")``)."""
        entries = {
            "fsdp2": ("FSDP2 per decoder block for every HF model in the module", {}),
            "fsdp2_cpu_offload": (
                "FSDP2 with parameters, gradients and optimizer step on the host",
                {"cpu_offload": True},
            ),
        }
        for name, (description, init_params) in entries.items():
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, **init_params)

    # ------------------------------------------------------------------ environment

    @override
    def setup_environment(self) -> None:
        with settings_at(STRATEGY_ARGS):
            self._resolve_data_parallel_size()
        dp, tp, cp = self._data_parallel_size, self._tensor_parallel_size, self._context_parallel_size
        if cp == 1:
            super().setup_environment()
            return
        # Lightning's mesh has two dimensions (data, tensor): built for the data x context ranks,
        # then replaced by the three-dimensional mesh with the context dimension in between.
        self._data_parallel_size = dp * cp
        super().setup_environment()
        self._data_parallel_size = dp
        self._device_mesh = self.model_parallel_mesh(dp, cp, tp)
        self.lightning_module._device_mesh = self._device_mesh

    def _resolve_data_parallel_size(self) -> None:
        # Resolve the mesh before the parent builds it: Lightning's "auto" would make the
        # tensor-parallel size the devices per node, which leaves FSDP nothing to shard.
        world_size = self.num_nodes * self.num_processes
        tp, cp = self._tensor_parallel_size, self._context_parallel_size
        if self._data_parallel_size == "auto":
            if world_size % (tp * cp):
                raise SettingError(
                    "tensor_parallel_size" if tp > 1 else "context_parallel_size",
                    f": `tensor_parallel_size`={tp} x `context_parallel_size`={cp} does not divide the world size"
                    f" ({world_size})", siblings=("tensor_parallel_size", "context_parallel_size"))
            self._data_parallel_size = world_size // (tp * cp)
        dp = self._data_parallel_size
        k = self._reshard_after_forward
        if not isinstance(k, bool) and (k >= dp * cp or (dp * cp) % k):
            raise SettingError("reshard_after_forward", f"`reshard_after_forward: {k}` must divide the data-parallel size"
                               f" ({dp * cp}) and be smaller than it; use true or false otherwise")

    def model_parallel_mesh(self, dp: int, cp: int, tp: int) -> "DeviceMesh":
        """The ``(data_parallel, context_parallel, tensor_parallel)`` mesh: a rank's tensor-parallel
        peers are its nearest (the same node, where the fastest links are), then its context peers."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.root_device.type, (dp, cp, tp),
                                mesh_dim_names=("data_parallel", "context_parallel", "tensor_parallel"))

    @property
    def data_parallel_mesh(self) -> "DeviceMesh":
        """The 1-D mesh parameters are sharded across: the data-parallel ranks, times the
        context-parallel ranks (which train on slices of the same sequences, so their gradients
        are averaged too)."""
        if self._context_parallel_size == 1:
            return self.device_mesh["data_parallel"]
        if getattr(self, "_shard_mesh", None) is None:
            self._shard_mesh = self.device_mesh["data_parallel", "context_parallel"]._flatten("data_context_parallel")
        return self._shard_mesh

    @property
    def tensor_parallel_mesh(self) -> "DeviceMesh":
        return self.device_mesh["tensor_parallel"]

    @property
    def context_parallel_mesh(self) -> Optional["DeviceMesh"]:
        return self.device_mesh["context_parallel"] if self._context_parallel_size > 1 else None

    # ------------------------------------------------------------------ setup

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        # Replaces ModelParallelStrategy.setup, which demands a user `configure_model`, then
        # materializes everything on the device and moves the whole model there; with CPU
        # offload the sharded parameters must be materialized on, and stay on, the host.
        assert self.model is not None
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self._reject_fsdp1(self.model)

        with settings_at(STRATEGY_ARGS):  # a model that cannot be split as set: named where the Trainer takes it
            self.parallelize(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()

        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            for optimizer in self.optimizers:
                self.prepare_optimizer(optimizer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING and not self._cpu_offload:
            # With offload the optimizer state must stay beside the (host) shards.
            for optimizer in self.optimizers:
                optimizer_state_onto(optimizer, self.root_device)

    def parallelize(self, module: nn.Module) -> None:
        """Shard, checkpoint and materialize ``module`` in place (idempotent).

        Models the user already sharded in ``configure_model`` are left as they are.
        """
        from torch.distributed.fsdp import FSDPModule

        models = self.models_to_shard(module)
        self._check_shard_modules([model for _, model in models])
        for name, model in models:
            if not isinstance(model, FSDPModule):
                self._parallelize_model(name, model)
        for name, leftover in shard_plan.unsharded_modules(module):
            if self._tensor_parallel_size > 1:  # on the split models' mesh too (see ReplicatedParallel)
                tensor_parallel.replicate_unsplit(leftover, self.tensor_parallel_mesh)
            self.shard_module(leftover, reshard_after_forward=self._reshard_for(leftover))
        # Every unit root, including any the user sharded in `configure_model`.
        for name, unit in module_tree.outermost(module, lambda sub: isinstance(sub, FSDPModule)):
            self.materialize(name, unit)
        self._check_no_meta(module)

    def _parallelize_model(self, name: str, model: nn.Module) -> None:
        """Checkpoint and shard each block of one model, then its root (torchtitan's order)."""
        from torch.distributed.fsdp import FSDPModule

        class_name = type(model).__name__
        reshard = self._reshard_for(model)
        blocks = self.blocks_to_shard(model)
        checkpointed = set(activation_checkpointing.checkpointed_indices(len(blocks), self._checkpoint_every))
        self.split_model(model)  # tensor and context parallelism before checkpointing and sharding
        for index, block in enumerate(blocks):
            if isinstance(block, FSDPModule):  # sharded by the user's configure_model
                continue
            if index in checkpointed:
                self.apply_activation_checkpointing(block)
            self.shard_module(block, reshard_after_forward=reshard)
        self.shard_module(model, reshard_after_forward=reshard)
        rank_zero_info(
            f"FSDP2Strategy: sharded `{name}` ({class_name}) as {len(blocks)} blocks + root,"
            f" {len(checkpointed)} blocks checkpointed, reshard_after_forward={reshard}"
            + (f", tensor_parallel_size={self._tensor_parallel_size}" if self._tensor_parallel_size > 1 else "")
            + (" with sequence parallelism" if self._sequence_parallel else "")
            + (f", context_parallel_size={self._context_parallel_size}" if self._context_parallel_size > 1 else "")
            + "."
        )

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Step 6: make ``optimizer`` (built by ``configure_optimizers``) step sharded parameters.

        torch's optimizers step ``DTensor`` s themselves and are left as they are; bitsandbytes'
        (8-bit, 32-bit, paged) step each rank's local shard and keep their state for it
        (:func:`lightning_mem.optim.step_local_shards`). Override to adapt optimizers of your own.
        """
        step_local_shards(optimizer)

    def _reshard_for(self, model: nn.Module) -> Union[bool, int]:
        # A model with nothing to train (a PPO reference or reward model) never runs a
        # backward, and FSDP2 reshards units kept gathered by `reshard_after_forward=False`
        # only in backward: the whole model would stay unsharded after its first forward.
        if not any(p.requires_grad for p in model.parameters()):
            return True
        return self._reshard_after_forward

    def _reject_fsdp1(self, module: nn.Module) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        if any(isinstance(sub, FullyShardedDataParallel) for sub in module.modules()):
            raise TypeError(
                f"{type(self).__name__} shards with FSDP2 (`fully_shard`); found modules wrapped in FSDP1's"
                " `FullyShardedDataParallel`. Remove that wrapping from `configure_model`."
            )

    # ------------------------------------------------------------------ overridable steps

    def models_to_shard(self, module: nn.Module) -> list[tuple[str, nn.Module]]:
        """Step 1: the models to shard block by block, with their attribute paths.

        Default: every outermost ``transformers.PreTrainedModel`` (peft models are walked
        through to the HF model inside). Override to add models of your own classes.
        """
        return module_tree.find_hf_models(module)

    def blocks_to_shard(self, model: nn.Module) -> list[nn.Module]:
        """Step 2: the blocks of ``model`` that become FSDP units, in forward order.

        Default: modules whose class is named in ``shard_modules``, else in the model's
        ``_no_split_modules`` (e.g. ``LlamaDecoderLayer``).
        """
        if self._shard_modules is not None:
            names = self._shard_modules
        else:
            names = module_tree.default_block_classes(model)
            if not names:
                raise SettingError(
                    "shard_modules", f": `{type(model).__name__}` declares no `_no_split_modules`, so FSDP2Strategy"
                    " cannot tell its blocks; name the block classes here (e.g. ['MyDecoderLayer'])")
        blocks = module_tree.find_blocks(model, names)
        if not blocks:
            rank_zero_warn(
                f"FSDP2Strategy: `{type(model).__name__}` has no module of class {names}; it is sharded as one"
                " unit, so its whole weight is gathered at once."
            )
        return blocks

    def check_model_config(self, config: Any) -> None:
        """Raise a :class:`~lightning_mem.settings.SettingError` naming this strategy's argument when a
        model of ``config`` (a ``transformers`` config) cannot be split the way it is set to split:
        heads not divisible by ``tensor_parallel_size x context_parallel_size``, no tensor-parallel
        plan, attention that context parallelism would change (sliding windows). Needs no model: a
        recipe calls it before loading one."""
        tensor_parallel.check_model_parallel(
            config, tensor_parallel_size=self._tensor_parallel_size, context_parallel_size=self._context_parallel_size,
            sequence_parallel=self._sequence_parallel)
        if self._context_parallel_size > 1:
            text = config.get_text_config() if hasattr(config, "get_text_config") else config
            layer_types = getattr(text, "layer_types", None) or []
            windowed = any(kind != "full_attention" for kind in layer_types) or (
                not layer_types and getattr(text, "sliding_window", None) is not None
                and getattr(text, "use_sliding_window", True))
            if windowed:
                raise SettingNotSupported(
                    "context_parallel_size", f"={self._context_parallel_size}: {type(config).__name__} has"
                    " sliding-window or non-attention layers, which context parallelism would turn into full causal"
                    " attention; use `context_parallel_size: 1`")

    def split_model(self, model: nn.Module) -> None:
        """Step 2b: split ``model`` (an HF model) over the tensor-parallel ranks by its own plan
        (with ``sequence_parallel``, along the sequence between the tensor-parallel regions), and
        record how its sequences split (:class:`~lightning_mem.context_parallel.SequenceLayout`);
        with ``context_parallel_size > 1`` its attention becomes Ulysses attention. A no-op for
        FSDP alone."""
        tp, cp = self._tensor_parallel_size, self._context_parallel_size
        if tp * cp == 1:
            return
        self.check_model_config(model.config)
        if tp > 1:
            tensor_parallel.apply_tensor_parallel(model, self.tensor_parallel_mesh, sequence_parallel=self._sequence_parallel)
        cp_mesh = self.context_parallel_mesh
        attach_layout(model, SequenceLayout(
            group=cp_mesh.get_group() if cp_mesh is not None else None, size=cp,
            rank=cp_mesh.get_local_rank() if cp_mesh is not None else 0,
            multiple=tp if self._sequence_parallel else 1,
        ))

    def apply_activation_checkpointing(self, block: nn.Module) -> None:
        """Step 3: make ``block`` recompute its activations in backward
        (:func:`lightning_mem.activation_checkpointing.checkpoint_block`)."""
        activation_checkpointing.checkpoint_block(block, self._checkpoint_policy)

    def offload_policy(self) -> "OffloadPolicy":
        """Step 4a: where sharded parameters, gradients and the optimizer step live."""
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        if not self._cpu_offload:
            return OffloadPolicy()
        # NOTE: pinned memory needs an accelerator: pinning raises on a CPU-only build, and
        # on a CPU mesh there is no host-to-device copy for it to speed up.
        return CPUOffloadPolicy(pin_memory=self.root_device.type != "cpu")

    def mixed_precision_policy(self) -> "MixedPrecisionPolicy":
        """Step 4b: the dtypes parameters are gathered in and gradients reduced in."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self._param_dtype, reduce_dtype=self._reduce_dtype)

    def shard_module(self, module: nn.Module, *, reshard_after_forward: Union[bool, int, None] = None) -> None:
        """Step 4: make ``module`` one FSDP unit over the data-parallel mesh.

        ``reshard_after_forward=None`` takes the strategy's setting; frozen models get
        ``True`` (see ``_reshard_for``).
        """
        from torch.distributed.fsdp import fully_shard

        if reshard_after_forward is None:
            reshard_after_forward = self._reshard_after_forward
        self._check_unit_dtypes(module)
        fully_shard(
            module,
            mesh=self.data_parallel_mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=self.mixed_precision_policy(),
            offload_policy=self.offload_policy(),
        )

    @staticmethod
    def _check_unit_dtypes(module: nn.Module) -> None:
        """FSDP2 reduce-scatters a unit's gradients as one flat buffer, so the trainable parameters
        the unit will own must share one dtype (frozen ones may differ: a bf16 LoRA base beside
        fp32 adapters is fine, all-gathered as bytes). FSDP2's own check is a bare AssertionError
        at the first backward; this one names the parameters, before anything is sharded."""
        from torch.distributed.fsdp import FSDPModule

        owned: dict[torch.dtype, list[str]] = {}
        stack = [("", module)]
        while stack:
            prefix, sub = stack.pop()
            for name, param in sub.named_parameters(recurse=False):
                if param.requires_grad:
                    owned.setdefault(param.dtype, []).append(prefix + name)
            # A child sharded already is a unit of its own: its parameters are not this unit's.
            stack += [(f"{prefix}{n}.", c) for n, c in sub.named_children() if not isinstance(c, FSDPModule)]
        if len(owned) > 1:
            examples = ", ".join(f"{names[0]} ({str(dtype).removeprefix('torch.')})" for dtype, names in owned.items())
            raise ValueError(
                f"FSDP2Strategy: `{type(module).__name__}` would be one FSDP2 unit whose trainable parameters differ in"
                f" dtype ({examples}); FSDP2 needs one dtype for them. Load everything that trains in one dtype"
                " (the recipes follow `trainer.precision`; see lightning_mem.dtypes.cast_trainable)."
            )

    def materialize(self, name: str, unit: nn.Module) -> None:
        """Step 5: give meta-device tensors of a sharded ``unit`` real memory and values.

        Models loaded with real weights (``from_pretrained``) have no meta tensors and are
        left untouched: ``fully_shard`` already kept their values. A unit created on the
        meta device gets its (sharded) storage on the host when offloading, else on the
        device; buffers follow the device in ``model_to_device``.
        """
        tensors = list(unit.parameters()) + list(unit.buffers())
        meta = [t for t in tensors if _is_meta(t)]
        if not meta:
            return
        if len(meta) != len(tensors):
            raise ValueError(
                f"`{name}` ({type(unit).__name__}) has both meta-device and materialized tensors; FSDP2Strategy"
                " would have to overwrite the real ones. Create the whole model on one device."
            )
        unit.to_empty(device=torch.device("cpu") if self._cpu_offload else self.root_device)
        self.initialize_weights(unit)

    def initialize_weights(self, unit: nn.Module) -> None:
        """Step 5b: initial values for a freshly materialized unit.

        HF models inside the unit use their own init (which also recomputes rotary
        buffers); other modules their ``reset_parameters``. Override to load weights here.
        """
        adapters = [name for name, sub in unit.named_modules() if hasattr(sub, "reset_lora_parameters")]
        if adapters:
            # HF's init would treat LoRA's A/B as plain Linears (B no longer zero), and
            # peft's own init schemes (pissa, olora, ...) need the real base weights.
            raise ValueError(
                f"FSDP2Strategy cannot initialize peft adapters created on the meta device ({adapters[0]}, ...):"
                " create the base model with real weights, then add the adapters."
            )
        hf_models = [model for _, model in module_tree.find_hf_models(unit)]
        for model in hf_models:
            model.initialize_weights()
            _zero_embedding_padding_rows(model)
        inside_hf = {id(sub) for model in hf_models for sub in model.modules()}
        for sub in unit.modules():
            reset = getattr(sub, "reset_parameters", None)
            if id(sub) not in inside_hf and callable(reset):
                reset()

    def _check_no_meta(self, module: nn.Module) -> None:
        left = [name for name, t in list(module.named_parameters()) + list(module.named_buffers()) if _is_meta(t)]
        if left:
            raise ValueError(
                f"FSDP2Strategy could not materialize meta-device tensors {left[:5]}: they belong to no model"
                " or submodule it shards. Create them on a real device."
            )

    def _check_shard_modules(self, models: list[nn.Module]) -> None:
        if self._shard_modules is None:
            return
        present = module_tree.class_names_in(models)
        missing = [name for name in self._shard_modules if name not in present]
        if missing:
            hints = sorted({n for model in models for n in module_tree.default_block_classes(model)})
            raise SettingError(
                "shard_modules", f" names {missing}, which no model here contains"
                f" ({', '.join(type(m).__name__ for m in models) or 'no HF model found'});"
                f" block classes these models declare: {hints}")

    # ------------------------------------------------------------------ placement

    @override
    def model_to_device(self) -> None:
        if not self._cpu_offload:
            super().model_to_device()
            return
        # FSDP-managed parameters are DTensor shards that CPU offload keeps on the host;
        # everything else (buffers such as rotary frequencies) belongs on the device.
        assert self.model is not None
        device = self.root_device
        self.model._apply(lambda t: t if isinstance(t, DTensor) else t.to(device))

    # ------------------------------------------------------------------ checkpoints

    def full_state_dict(self, module: nn.Module, *, trainable_only: bool = False) -> dict[str, Tensor]:
        """The full state dict of ``module`` on rank 0 (``{}`` elsewhere); call on every rank.

        See :func:`lightning_mem.export.full_state_dict` (:class:`lightning_mem.export.GathersStateDict`).
        """
        return full_state_dict(module, trainable_only=trainable_only)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Sharded: write a new version folder, mark it complete, then swap ``filepath``'s link to it.

        Full (``save_distributed_checkpoint=False``): rank 0 writes one file through
        :class:`~lightning_mem.checkpointing.AtomicCheckpointIO` (temporary file, then rename).
        """
        if not self._save_distributed_checkpoint:
            path = Path(self.broadcast(str(filepath)))
            if path.is_symlink():  # a sharded checkpoint from an earlier run of the same folder
                if self.global_rank == 0:
                    remove_versioned(path)
                self.barrier("fsdp2_remove_sharded")
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError(f"`{type(self).__name__}.save_checkpoint` takes no `storage_options` for sharded checkpoints")
        from torch.distributed.checkpoint import save as save_distributed

        # Every rank must write into the same new folder: rank 0 names it.
        link = Path(self.broadcast(str(filepath)))
        step = int(checkpoint.get("global_step", 0))
        folder = version_dir(link, step, self.broadcast(uuid.uuid4().hex[:8]))
        if self.global_rank == 0:
            folder.mkdir(parents=True)
        self.barrier("fsdp2_checkpoint_folder")
        state = {"state_dict": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": o for i, o in enumerate(checkpoint.pop("optimizer_states", []))})
        save_distributed(state, checkpoint_id=folder)
        if self.global_rank == 0:
            torch.save(checkpoint, folder / CHECKPOINT_METADATA)
        self.barrier("fsdp2_checkpoint_written")  # every rank's shard is on disk
        if self.global_rank == 0:
            publish_version(link, folder, step)
        self.barrier("fsdp2_checkpoint_switched")

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        if not path.is_dir():
            return super().load_checkpoint(path, weights_only=weights_only)
        check_complete(path)
        # Not Lightning's sharded loader: it asks for every tensor the module has, and a recipe's
        # checkpoint holds only what trains (checkpointing.keep_trainable).
        load_sharded_checkpoint(self.model, self.optimizers, path, strict=self.lightning_module.strict_loading)
        return torch.load(path / CHECKPOINT_METADATA, map_location="cpu", weights_only=weights_only)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        # The base class would `rm -r` through the symlink and leave the version folders.
        if self.global_rank == 0:
            remove_versioned(filepath)
