"""Tensor and sequence parallelism for a Hugging Face model, from the architecture's own plan.

*Which* layers split and how is not written here: every ``transformers`` architecture that supports
tensor parallelism names it in its plan (``model.tp_plan``: the config's ``base_model_tp_plan`` under
the model's prefix, plus the class's own entries such as ``lm_head``), e.g. for Llama::

    model.embed_tokens              embedding_rowwise      (vocabulary split, partial lookups summed)
    model.layers.*.self_attn.q_proj colwise                (heads split: attention runs on local heads)
    model.layers.*.self_attn.o_proj rowwise                (partial outputs summed)
    model.layers.*.mlp.{gate,up}    colwise;  down rowwise
    lm_head                         colwise_gather_output  (vocabulary split, logits gathered)

This module translates those names into PyTorch's ``parallelize_module`` styles
(``ColwiseParallel``/``RowwiseParallel``: hooks that turn parameters into ``DTensor`` shards), the way
torchtitan composes tensor parallelism with FSDP2: the plan first, on the tensor-parallel mesh, then
``fully_shard`` over the data(-and-context) mesh (the strategy's job).

**Sequence parallelism** (``sequence_parallel=True``, Megatron-LM's "Reducing Activation
Recomputation", Korthikanti et al. 2022) also splits what the plan leaves replicated: between the
tensor-parallel regions (the norms, the residual stream, dropout) each rank holds ``1/tp`` of the
sequence. The decoder stack's input is split along the sequence as the first block starts; each
attention and MLP region gathers the sequence as it starts (one all-gather) and its row-wise output
layer reduce-scatters back to sequence shards; the norms run on their shard
(``SequenceParallel``, weights replicated, gradients summed over the group by ``DTensor``); the final
norm's output is gathered for the output layer. The embedding's output stays whole: Hugging Face
builds the causal mask and position ids from its length.

**LoRA** (peft) layers split with their base: under a column-wise base, ``lora_B`` splits by
columns too (``lora_A`` sees the whole input and stays replicated); under a row-wise base,
``lora_A`` splits by rows and its output is summed (``lora_B`` stays replicated, or, with sequence
parallelism, runs on the sequence shard as a replicated ``DTensor``).

A plan style this module does not translate (fused ``packed_colwise``, mixture-of-experts styles,
...) is refused by name rather than applied half-way.
"""

from __future__ import annotations

import re
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lightning_mem.activation_checkpointing import recomputing
from lightning_mem.module_tree import default_block_classes, find_blocks
from lightning_mem.settings import SettingError, SettingNotSupported

#: Hugging Face plan styles this module applies (the rest are refused by name).
SUPPORTED_STYLES = ("colwise", "rowwise", "colwise_gather_output", "colwise_rep", "embedding_rowwise", "replicate")


# ---------------------------------------------------------------------------------------------
# Checks that need only the config (no model loaded)
# ---------------------------------------------------------------------------------------------


def attention_heads(config: Any) -> tuple[int, int]:
    """``(query heads, key/value heads)`` of a ``transformers`` config (its text config for a
    multimodal one)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    if heads is None:
        raise ValueError(f"{type(config).__name__} names no `num_attention_heads`: cannot split its attention heads")
    return int(heads), int(getattr(text, "num_key_value_heads", None) or heads)


def check_model_parallel(config: Any, *, tensor_parallel_size: int = 1, context_parallel_size: int = 1,
                         sequence_parallel: bool = False) -> None:
    """Raise a :class:`~lightning_mem.settings.SettingError` naming the sizes when a model of
    ``config`` cannot run split this way: its query or key/value heads do not divide by
    ``tensor_parallel_size x context_parallel_size`` (each rank computes attention for whole heads:
    tensor parallelism splits heads, and Ulysses context parallelism splits them again around the
    attention kernel), or it has no tensor-parallel plan."""
    tp, cp = tensor_parallel_size, context_parallel_size
    if sequence_parallel and tp == 1:
        raise SettingError(
            "sequence_parallel", ": true needs `tensor_parallel_size` > 1 (it splits the sequence between the"
            " tensor-parallel regions)", siblings=("tensor_parallel_size",))
    if tp * cp == 1:
        return
    try:
        heads, kv_heads = attention_heads(config)
    except ValueError as err:  # a config without heads: nothing to split them by
        raise SettingNotSupported("tensor_parallel_size" if tp > 1 else "context_parallel_size", f": {err}") from None
    for name, count in (("attention heads", heads), ("key/value heads", kv_heads)):
        if count % (tp * cp):
            sizes = [f"`{k}`={v}" for k, v in (("tensor_parallel_size", tp), ("context_parallel_size", cp)) if v > 1]
            split = " x ".join(sizes) + (f" = {tp * cp}" if len(sizes) > 1 else "")
            raise SettingError(
                "tensor_parallel_size" if tp > 1 else "context_parallel_size",
                f"{type(config).__name__} has {count} {name}, which {split} does not divide: each rank must compute"
                " attention for whole heads",
                siblings=("tensor_parallel_size", "context_parallel_size"),
            )
    if tp > 1:
        plan = _config_plan(config)
        if not plan:
            raise SettingNotSupported(
                "tensor_parallel_size", f"={tp}: {type(config).__name__} has no tensor-parallel plan"
                " (`base_model_tp_plan`) in transformers; use `tensor_parallel_size: 1` (FSDP alone)")
        unknown = sorted({style for style in plan.values() if style not in SUPPORTED_STYLES})
        if unknown:
            raise SettingNotSupported(
                "tensor_parallel_size", f"={tp}: {type(config).__name__}'s tensor-parallel plan uses {unknown}, which"
                f" lightning-mem does not apply (it applies {list(SUPPORTED_STYLES)}); use `tensor_parallel_size: 1`")


def _config_plan(config: Any) -> dict[str, str]:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return dict(getattr(text, "base_model_tp_plan", None) or {})


# ---------------------------------------------------------------------------------------------
# The plan of a loaded model
# ---------------------------------------------------------------------------------------------


def _pattern(glob: str) -> re.Pattern[str]:
    # HF plans write a layer number as `*`.
    return re.compile(re.escape(glob).replace(r"\*", r"\d+"))


def plan_entries(model: nn.Module) -> dict[str, str]:
    """``{module name: Hugging Face style}`` for every module of ``model`` (a ``PreTrainedModel``)
    that its tensor-parallel plan names, layer numbers filled in."""
    plan = dict(getattr(model, "tp_plan", None) or {})
    if not plan:
        raise SettingNotSupported(
            "tensor_parallel_size", f": {type(model).__name__} has no tensor-parallel plan (`tp_plan`) in transformers;"
            " use `tensor_parallel_size: 1`")
    patterns = [(_pattern(glob), style) for glob, style in plan.items()]
    entries: dict[str, str] = {}
    for name, _ in model.named_modules():
        for pattern, style in patterns:
            if name and pattern.fullmatch(name):
                entries[name] = style
                break
    if not entries:
        raise SettingNotSupported(
            "tensor_parallel_size", f": {type(model).__name__}'s tensor-parallel plan {sorted(plan)} matches none of its"
            " modules; use `tensor_parallel_size: 1`")
    unknown = sorted({style for style in entries.values() if style not in SUPPORTED_STYLES})
    if unknown:
        raise SettingNotSupported(
            "tensor_parallel_size", f": {type(model).__name__}'s tensor-parallel plan uses {unknown}, which lightning-mem"
            f" does not apply (it applies {list(SUPPORTED_STYLES)}); use `tensor_parallel_size: 1`")
    return entries


def _is_lora_layer(module: nn.Module) -> bool:
    return hasattr(module, "base_layer") and isinstance(getattr(module, "lora_A", None), nn.ModuleDict)


Styles = list[tuple[str, ParallelStyle]]


def _layer_styles(style: str, *, sequence_parallel: bool) -> list[ParallelStyle]:
    """The torch styles of a plain layer under one HF style name (in the order they hook)."""
    if style == "colwise":
        return [ColwiseParallel()]
    if style == "rowwise":
        if sequence_parallel:  # left partial; the boundary sums it into sequence slices
            return [RowwiseParallel(output_layouts=Partial(), use_local_output=False), SequenceBoundary("reduce")]
        return [RowwiseParallel()]
    if style in ("colwise_gather_output", "colwise_rep"):
        return [ColwiseParallel(output_layouts=Replicate())]
    if style == "embedding_rowwise":
        return [RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())]
    if style == "replicate":
        return []
    raise AssertionError(style)  # plan_entries refused it


def lora_styles(module: nn.Module, style: str, *, sequence_parallel: bool) -> Styles:
    """``[(relative name, style)]`` for a peft LoRA layer's parts under the HF ``style`` of its base:
    the base like a plain layer; under a column-wise base ``lora_B`` splits by columns too (``lora_A``
    reads the whole input, replicated); under a row-wise base ``lora_A`` splits by rows and is summed
    like the base (``lora_B`` reads the sum: replicated, or on this rank's sequence slice as a
    replicated ``DTensor`` whose gradient is summed over the group)."""
    if getattr(module, "lora_magnitude_vector", None):
        raise SettingNotSupported("tensor_parallel_size", ": DoRA adapters (`use_dora`) cannot be split across ranks")
    if getattr(module, "lora_embedding_A", None):
        raise SettingNotSupported("tensor_parallel_size", ": LoRA on an embedding cannot be split across ranks")
    if style == "replicate":
        return []
    styles: Styles = [("base_layer", s) for s in _layer_styles(style, sequence_parallel=sequence_parallel)]
    for adapter in module.lora_A:
        if style == "rowwise":
            styles += [(f"lora_A.{adapter}", s) for s in _layer_styles(style, sequence_parallel=sequence_parallel)]
            if sequence_parallel:
                styles.append((f"lora_B.{adapter}", SequenceParallel(use_local_output=True)))
        else:  # column-wise, gathered or not: lora_B's columns follow the base's
            styles += [(f"lora_B.{adapter}", s) for s in _layer_styles(style, sequence_parallel=False)]
    return styles


# ---------------------------------------------------------------------------------------------
# Sequence-parallel boundaries
# ---------------------------------------------------------------------------------------------


def _hidden_states(args: tuple, kwargs: dict) -> Tensor:
    return args[0] if args else kwargs["hidden_states"]


def _with_hidden_states(args: tuple, kwargs: dict, value: Tensor) -> tuple[tuple, dict]:
    # A block or region is called with its hidden states first, positionally or by name
    # (Llama's decoder layer calls `self_attn(hidden_states=...)` but `mlp(hidden_states)`).
    if args:
        return (value, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": value}


def _local(x: Tensor) -> Tensor:
    return x.to_local() if isinstance(x, DTensor) else x


class SequenceBoundary(ParallelStyle):
    """Where the sequence-parallel region starts or ends, as a hook on a module's hidden states.

    ``kind``:

    - ``"enter"`` (the first block's input): the whole sequence -> this rank's slice (a local
      slice; its backward all-gathers);
    - ``"gather"`` (an attention or MLP region's input, the final norm's output): slices -> the
      whole sequence (all-gather; its backward keeps this rank's slice);
    - ``"reduce"`` (a row-wise layer's partial output): summed and left in slices (reduce-scatter),
      where the tensor-parallel plan alone would sum it whole (all-reduce).

    The split holds only while autograd records: what sequence parallelism saves is activations
    kept for backward, and a forward without gradients (``generate``, one token at a time; a
    scoring pass) keeps none. Such a forward runs as plain tensor parallelism (``"enter"`` and
    ``"gather"`` pass the sequence through, ``"reduce"`` all-reduces), and a recomputation in
    backward (activation checkpointing) records, so it splits exactly as the forward did.

    Activation checkpointing: the ``"enter"`` hook runs before the checkpoint's own pre-hook (it is
    prepended), so a checkpointed first block saves its input's slice; in the block's recompute,
    which calls the block again with that saved slice, ``"enter"`` passes it through. The
    ``"gather"`` and ``"reduce"`` hooks sit inside the block and run again in the recompute (one
    more all-gather and reduce-scatter per region), as the forward did.
    """

    def __init__(self, kind: str) -> None:
        super().__init__()
        if kind not in ("enter", "gather", "reduce"):
            raise ValueError(f"unknown sequence boundary {kind!r}")
        self.kind = kind

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.kind == "reduce" or getattr(self, "on_output", False):
            module.register_forward_hook(partial(self._on_output, device_mesh))
        else:
            # Prepended: an "enter" slices before activation checkpointing's own pre-hook (whichever
            # was applied first), so a checkpointed first block keeps its input's slice, not the whole.
            module.register_forward_pre_hook(partial(self._on_input, device_mesh), with_kwargs=True,
                                             prepend=self.kind == "enter")
        return module

    def relayout(self, x: Tensor, mesh: DeviceMesh) -> Tensor:
        split = torch.is_grad_enabled()
        if self.kind == "reduce":
            return _local(x.redistribute(placements=[Shard(1) if split else Replicate()]))
        if not split:
            return _local(x)
        if self.kind == "enter":
            if x.shape[1] % mesh.size():
                raise ValueError(
                    f"sequence parallelism splits the sequence over {mesh.size()} ranks, but this batch has"
                    f" {x.shape[1]} positions: pad it to a multiple (lightning_mem.logits.score_tokens does)"
                )
            dt = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            return dt.redistribute(placements=[Shard(1)]).to_local()
        dt = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
        return dt.redistribute(placements=[Replicate()]).to_local()

    def _on_input(self, mesh: DeviceMesh, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self.kind == "enter" and recomputing(module):
            # Activation checkpointing recomputes the first block from the input it saved, which
            # this hook sliced already in the forward: slicing it again would halve it twice.
            return None
        return _with_hidden_states(args, kwargs, self.relayout(_hidden_states(args, kwargs), mesh))

    def _on_output(self, mesh: DeviceMesh, module: nn.Module, args: tuple, output: Any) -> Any:
        if isinstance(output, tuple):
            return (self.relayout(output[0], mesh), *output[1:])
        return self.relayout(output, mesh)


def _gather_output() -> SequenceBoundary:
    style = SequenceBoundary("gather")
    style.on_output = True
    return style


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


def _own_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


def sequence_parallel_plan(model: nn.Module, entries: dict[str, str]) -> Styles:
    """The styles that make the regions between ``entries`` (the tensor-parallel layers) run on
    sequence slices: see the module docstring."""
    modules = dict(model.named_modules())
    block_ids = {id(b) for b in find_blocks(model, default_block_classes(model))}
    blocks = [name for name, m in modules.items() if id(m) in block_ids]
    if not blocks:
        raise SettingNotSupported(
            "sequence_parallel", f": {type(model).__name__} declares no decoder blocks (`_no_split_modules`)")

    def inside(name: str, parents: list[str]) -> bool:
        return any(name == p or name.startswith(f"{p}.") for p in parents)

    # Regions: the modules whose column-wise layers start a tensor-parallel region inside a block.
    regions = sorted({
        name.rpartition(".")[0] for name, style in entries.items() if style == "colwise" and inside(name, blocks)
    })
    styles: Styles = [(blocks[0], SequenceBoundary("enter"))]
    styles += [(region, SequenceBoundary("gather")) for region in regions]
    order = list(modules)
    last_block = order.index(blocks[-1])
    for name, module in modules.items():
        if not name or not _own_params(module) or inside(name, list(entries)):
            continue
        if inside(name, regions):
            raise SettingNotSupported(
                "sequence_parallel", f": `{name}` ({type(module).__name__}) holds parameters inside a tensor-parallel"
                " region that the model's plan does not split")
        if inside(name, blocks):
            if not _is_norm(module):
                raise SettingNotSupported(
                    "sequence_parallel", f": `{name}` ({type(module).__name__}) runs between the tensor-parallel"
                    " regions but is no norm: it cannot run on a sequence slice")
            styles.append((name, SequenceParallel()))
        elif _is_norm(module) and order.index(name) > last_block:
            # The final norm: on sequence slices, then the whole sequence for the output layer.
            styles += [(name, SequenceParallel()), (name, _gather_output())]
    return styles


# ---------------------------------------------------------------------------------------------
# What the plan leaves whole
# ---------------------------------------------------------------------------------------------


def _replicate_own(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for param_name, param in list(module.named_parameters(recurse=False)):
        if not isinstance(param, DTensor):
            replicated = (  # a meta tensor has nothing to broadcast: its values come at materialization
                DTensor.from_local(param.detach(), mesh, [Replicate()], run_check=False) if param.is_meta
                else distribute_tensor(param.detach(), mesh, [Replicate()])
            )
            module.register_parameter(param_name, nn.Parameter(replicated, requires_grad=param.requires_grad))


def _replicated_inputs(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    return tuple(
        DTensor.from_local(x, mesh, [Replicate()], run_check=False) if isinstance(x, Tensor) and not isinstance(x, DTensor)
        else x
        for x in inputs
    )


def _local_outputs(module: nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
    if isinstance(outputs, tuple):
        return tuple(_local(x) if isinstance(x, Tensor) else x for x in outputs)
    return _local(outputs) if isinstance(outputs, Tensor) else outputs


class ReplicatedParallel(ParallelStyle):
    """A module the plan does not split (a norm outside sequence parallelism, LoRA's replicated
    half, a value head), with its parameters made ``Replicate`` DTensors on the tensor-parallel
    mesh and its inputs and outputs kept plain.

    Its values and gradients are the same on every rank of the group either way; what it changes
    is that every parameter of a split model then lives on the same two-dimensional mesh once FSDP
    shards it: gradient clipping takes one norm over all of them, and a ``foreach`` optimizer
    steps them together (both refuse DTensors of different meshes). The replicas are broadcast
    from the group's first rank as they are made.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, _replicate_own, _replicated_inputs, _local_outputs)


def replicate_unsplit(model: nn.Module, mesh: DeviceMesh) -> list[str]:
    """Apply :class:`ReplicatedParallel` to every module of ``model`` holding parameters that are
    not DTensors yet (call it after the plan); returns their names."""
    names = [name for name, module in model.named_modules()
             if any(not isinstance(p, DTensor) for p in module.parameters(recurse=False))]
    modules = dict(model.named_modules())
    for name in names:
        parallelize_module(modules[name], mesh, ReplicatedParallel())
    return names


# ---------------------------------------------------------------------------------------------
# Applying it
# ---------------------------------------------------------------------------------------------


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh, *, sequence_parallel: bool = False) -> dict[str, str]:
    """Split ``model`` (a ``transformers`` ``PreTrainedModel``, possibly holding peft LoRA layers)
    over the 1-D tensor-parallel ``mesh`` by its own plan, in place; returns the plan entries
    applied (``{module name: HF style}``).

    Call it before ``fully_shard``: FSDP2 then shards the ``DTensor`` parameters over the data
    mesh as a second dimension.
    """

    check_model_parallel(model.config, tensor_parallel_size=mesh.size(), sequence_parallel=sequence_parallel)
    entries = plan_entries(model)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    modules = dict(model.named_modules())
    styles: Styles = []
    for name, style in entries.items():
        module = modules[name]
        base = module.base_layer if _is_lora_layer(module) else module
        if "4bit" in type(base).__name__:  # bitsandbytes' Linear4bit: one packed buffer, block scales
            raise SettingNotSupported(
                "tensor_parallel_size", f": `{name}` is a 4-bit layer ({type(base).__name__}), which cannot be split"
                " across ranks; use `tensor_parallel_size: 1`")
        if _is_lora_layer(module):
            styles += [(f"{name}.{part}", s) for part, s in lora_styles(module, style, sequence_parallel=sequence_parallel)]
        else:
            styles += [(name, s) for s in _layer_styles(style, sequence_parallel=sequence_parallel)]
    if sequence_parallel:
        styles += sequence_parallel_plan(model, entries)
    # One parallelize_module call per style: a module with two (a row-wise layer and the boundary
    # after it) gets both hooks, in this order.
    for name, style in styles:
        parallelize_module(modules[name], mesh, style)
    replicate_unsplit(model, mesh)
    # The styles wrap each parameter in a new nn.Parameter, and torch's SequenceParallel leaves it
    # trainable whatever it was: a LoRA run's frozen norms would train.
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    return entries
