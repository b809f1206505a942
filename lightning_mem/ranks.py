"""Which ranks read the same batches: the data-parallel replicas, and the model-parallel groups in them.

With tensor or context parallelism, the ranks of one group split a model or a sequence between
them and must all see the *same* batch; only the data-parallel replicas read different ones. A
sampler therefore shards data over ``replicas`` (not the world size), a loss that is a token mean
over the step counts the tokens of the replicas, and a token budget for one rank's micro-batch
holds ``context_parallel_size`` times the tokens, since each rank runs ``1/cp`` of every sequence.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import Tensor

from lightning_mem.settings import SettingNotSupported


def data_parallel(trainer: Any) -> tuple[int, int]:
    """``(replicas, this rank's replica)``: from the strategy's ``distributed_sampler_kwargs``
    (Lightning's own statement of it; the world size and global rank for DDP and DeepSpeed), or
    ``(1, 0)`` without a trainer or on one device."""
    if trainer is None:
        return 1, 0
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    return int(kwargs.get("num_replicas", trainer.world_size)), int(kwargs.get("rank", trainer.global_rank))


def context_parallel_size(trainer: Any) -> int:
    """Ranks each sequence is split across (1 without context parallelism)."""
    if trainer is None:
        return 1
    return int(getattr(trainer.strategy, "context_parallel_size", 1) or 1)


def per_rank_budget(max_tokens: int | None, trainer: Any) -> int | None:
    """A micro-batch token budget stated per rank, as tokens of whole sequences: each rank of a
    context-parallel group holds ``1/cp`` of every sequence."""
    return None if max_tokens is None else max_tokens * context_parallel_size(trainer)


def check_model_splits(trainer: Any, name_or_path: str, *, trust_remote_code: bool = False) -> None:
    """Ask the trainer's strategy, before any weights load, whether the model at ``name_or_path``
    can be split the way the strategy is set to split (``check_model_config``: heads that divide
    by the tensor- and context-parallel sizes, a tensor-parallel plan). The strategy's
    :class:`~lightning_mem.settings.SettingError` names its own argument; a recipe names where that
    sits in its YAML with ``settings_at("trainer.strategy.init_args")``. A strategy that does not
    split models has nothing to check."""
    check = getattr(trainer.strategy, "check_model_config", None) if trainer is not None else None
    if check is None:
        return
    from transformers import AutoConfig

    check(AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code))


def check_packing_splits(trainer: Any, *, packing_key: str) -> None:
    """Packed rows and a strategy that splits models or sequences: refused before any model loads.
    The split of a sequence across ranks reads its positions from the attention mask, and a packed
    row has none (its restarting position ids would be lost)."""
    strategy = trainer.strategy
    splits = {key: size for key, size in (
        ("tensor_parallel_size", int(getattr(strategy, "tensor_parallel_size", 1) or 1)),
        ("context_parallel_size", context_parallel_size(trainer)),
    ) if size > 1}
    if splits:
        named = " and ".join(f"`trainer.strategy.init_args.{key}: {size}`" for key, size in splits.items())
        raise SettingNotSupported(packing_key, f"`{packing_key}: true` with {named}: packed rows are not split by"
                                  " tensor or context parallelism yet; turn packing off, or the split")


def sum_over_replicas(trainer: Any, value: Tensor) -> Tensor:
    """``value`` summed over the data-parallel replicas (once per replica, not once per rank: the
    ranks of a tensor- or context-parallel group hold the same samples, and a count or an unbiased
    variance must see them once)."""
    replicas, _ = data_parallel(trainer)
    if trainer is None or trainer.world_size == 1 or replicas == 1:
        return value
    if replicas == trainer.world_size:
        return trainer.strategy.reduce(value, reduce_op="sum")
    summed = value.clone()
    dist.all_reduce(summed, group=trainer.strategy.device_mesh["data_parallel"].get_group())
    return summed
