"""Token-budget micro-batches for RL passes, with the same count on every rank.

Rollout lengths vary a lot from step to step (a response may stop after one token or run to
``max_new_tokens``), so a fixed micro-batch size either wastes memory on short batches or runs
out of it on long ones. Packing to a padded-token budget keeps each forward/backward about the
same size. Two more rules for the training phase:

- **Same count on every rank.** With sharded models each forward and backward is a collective:
  a rank with fewer micro-batches would leave the others waiting forever. Every rank packs its
  own samples, the ranks agree on the largest count, and ranks with fewer split their biggest
  micro-batches until they match (verl balances its dynamic micro-batches the same way).
- **Split-invariant loss.** Each micro-batch's loss is a *sum* over tokens scaled by
  ``replicas / tokens in the whole mini-batch on all replicas``: the accumulated gradient is then
  the mini-batch's token mean, whatever the budget, the split, or the number of ranks (the data-
  parallel all-reduce averages over the replicas, which their count undoes; see :mod:`lightning_mem.ranks`).

With ``model.ppo.packing`` a micro-batch runs as one packed row (:mod:`lightning_mem.data.packing`):
its cost is the sum of its sequences' lengths, not ``longest x count``, so the plan takes a
:class:`PackedBudget` and fills it by best-fit-decreasing. It goes through the same
``StepIO.micro_batches`` call (a budget that says how it counts), so the memory estimate's own
``StepIO`` sees and shortens a packed plan as it does a padded one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lightning_mem.batching import pack_by_token_budget, split_to_count


@dataclass(frozen=True)
class PackedBudget:
    """A micro-batch budget of ``tokens`` real tokens: the summed lengths of a packed row's sequences."""

    tokens: int

    def __post_init__(self) -> None:
        if self.tokens <= 0:
            raise ValueError(f"a packed budget must be positive, got {self.tokens}")


def micro_batches(
    lengths: Sequence[int],
    max_tokens: int | PackedBudget | None,
    *,
    agree_on_count: Callable[[int], int] | None = None,
) -> list[list[int]]:
    """Group sample indices ``0..len(lengths)-1`` into micro-batches of at most ``max_tokens``
    padded tokens (``None``: one micro-batch of everything), or of at most ``max_tokens.tokens``
    summed tokens for a :class:`PackedBudget` (best-fit-decreasing: few, full rows).

    Padded, samples are sorted longest first before packing, so that similar lengths share a batch
    and little goes to padding. ``agree_on_count(local_count) -> count`` returns the count all ranks
    use (the maximum over ranks); ``None`` in a single process.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    if isinstance(max_tokens, PackedBudget):
        # Here, not at the top: the package `lightning_mem.data` loads the datamodules (Lightning, datasets).
        from lightning_mem.data.packing import best_fit_decreasing

        batches = best_fit_decreasing(order, lengths, max_tokens.tokens)
    else:
        batches = [order] if max_tokens is None else pack_by_token_budget(order, lengths, max_tokens)
    if agree_on_count is not None:
        batches = split_to_count(batches, agree_on_count(len(batches)), lengths)
    return batches
