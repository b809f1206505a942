"""Token-budget batching: micro-batches packed up to a padded-token budget instead of a fixed size.

A fixed batch size wastes memory on short samples and runs out of it on long ones; a budget of
``max_tokens`` padded tokens (``longest sample x batch size``) keeps every micro-batch's activation
memory about the same. The same packer serves the data loaders here and the PPO micro-batches.
"""

from __future__ import annotations

import warnings
from typing import Any
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DistributedSampler


def padded_tokens(lengths: Sequence[int]) -> int:
    """Tokens a right-padded batch of these lengths occupies."""
    return max(lengths, default=0) * len(lengths)


def pack_by_token_budget(
    indices: Sequence[int],
    lengths: Sequence[int],
    max_tokens: int,
    *,
    max_batch_size: int | None = None,
) -> list[list[int]]:
    """Greedily group ``indices`` (in the given order) into batches whose padded size fits ``max_tokens``.

    A sample longer than the budget gets a batch of its own rather than being dropped: truncation is
    the data pipeline's job, and silently losing rows here would change the dataset.
    """
    if max_tokens <= 0:
        raise ValueError(f"`max_tokens` must be positive, got {max_tokens}")
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for idx in indices:
        length = lengths[idx]
        new_longest = max(longest, length)
        full = max_batch_size is not None and len(current) >= max_batch_size
        if current and (new_longest * (len(current) + 1) > max_tokens or full):
            batches.append(current)
            current, new_longest = [], length
        current.append(idx)
        longest = new_longest
    if current:
        batches.append(current)
    return batches


def split_largest(
    batches: list[list[int]], lengths: Sequence[int] | None, *, until: Callable[[int], bool]
) -> list[list[int]]:
    """Split the most expensive batch in two (its padded tokens under ``lengths``, then its size)
    until ``until(count)`` holds or every batch is a single sample; every sample is kept."""
    batches = [list(b) for b in batches]

    def cost(batch: list[int]) -> tuple[int, int]:
        return (padded_tokens([lengths[k] for k in batch]) if lengths is not None else 0, len(batch))

    while not until(len(batches)):
        splittable = [i for i, b in enumerate(batches) if len(b) > 1]
        if not splittable:
            break
        i = max(splittable, key=lambda j: cost(batches[j]))
        half = len(batches[i]) // 2
        batches[i : i + 1] = [batches[i][:half], batches[i][half:]]
    return batches


def split_batches_to_multiple(
    batches: list[list[int]], multiple: int, lengths: Sequence[int] | None = None
) -> list[list[int]]:
    """Split the largest batches in two until the count is a multiple of ``multiple``.

    Every rank must run the same number of steps (collectives would hang otherwise); splitting keeps
    every sample, where dropping the remainder would lose data. When every batch already holds a
    single sample and the count is still no multiple (fewer samples than ranks, or only samples
    near the budget), the result stays short: :func:`pad_batches_to_multiple` finishes the job.
    """
    return split_largest(batches, lengths, until=lambda n: n % multiple == 0)


def split_to_count(batches: list[list[int]], count: int, lengths: Sequence[int]) -> list[list[int]]:
    """Split the most expensive (padded tokens) batches in two until there are ``count`` of them."""
    if count < len(batches):
        raise ValueError(f"cannot reach {count} micro-batches from {len(batches)} by splitting")
    out = split_largest(batches, lengths, until=lambda n: n >= count)
    if len(out) < count:
        raise ValueError(f"{sum(map(len, batches))} samples cannot make {count} micro-batches")
    return out


def pad_batches_to_multiple(batches: list[list[int]], multiple: int, lengths: Sequence[int]) -> list[list[int]]:
    """Append repeats of the cheapest batches until the count is a multiple of ``multiple``.

    The padding rule for what splitting cannot fix: every sample is still served once per epoch,
    and at most ``multiple - 1`` single-sample batches (the shortest samples) are served a second
    time, so that every rank runs the same number of steps.
    """
    missing = -len(batches) % multiple
    if not missing or not batches:
        return [list(b) for b in batches]
    cheapest = sorted(range(len(batches)), key=lambda i: (padded_tokens([lengths[j] for j in batches[i]]), i))
    extra = [list(batches[cheapest[k % len(cheapest)]]) for k in range(missing)]
    return [list(b) for b in batches] + extra


class BatchPlan:
    """An epoch's batches of sample indices as two numpy arrays, not a list of Python lists.

    ``flat`` holds every batch's indices one after another (int32, 4 bytes a sample served; int64
    past 2**31 samples) and ``offsets`` where each batch starts (int64, 8 bytes a batch, plus one).
    At ten million rows a list of lists holds a Python int per row in every rank's private memory
    (about 36 bytes each, 0.36 GB a rank, more while it is built); these arrays hold 4 bytes a row. ``plan[i]`` is batch
    ``i`` as a list of ints, made when it is served; iterating yields every batch in turn.
    """

    def __init__(self, flat: np.ndarray, offsets: np.ndarray) -> None:
        wide = len(flat) and int(np.max(flat)) >= 2**31
        self.flat = np.ascontiguousarray(flat, dtype=np.int64 if wide else np.int32)
        self.offsets = np.ascontiguousarray(offsets, dtype=np.int64)

    @classmethod
    def from_lists(cls, batches: Sequence[Sequence[int]]) -> BatchPlan:
        sizes = np.fromiter((len(b) for b in batches), dtype=np.int64, count=len(batches))
        flat = np.fromiter((i for b in batches for i in b), dtype=np.int64, count=int(sizes.sum()))
        return cls(flat, np.concatenate(([0], np.cumsum(sizes))))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> list[int]:
        return self.flat[self.offsets[i] : self.offsets[i + 1]].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        return (self[i] for i in range(len(self)))

    @property
    def nbytes(self) -> int:
        return self.flat.nbytes + self.offsets.nbytes

    def sizes(self) -> np.ndarray:
        return np.diff(self.offsets)

    def reduce(self, ufunc: np.ufunc, values: np.ndarray) -> np.ndarray:
        """``ufunc`` over each batch of ``values[index]`` (``np.maximum``: each batch's longest)."""
        if not len(self):
            return values[:0]
        return ufunc.reduceat(values[self.flat], self.offsets[:-1])

    def padded_tokens(self, lengths: np.ndarray) -> np.ndarray:
        """Each batch's right-padded size, ``longest x count``."""
        return self.reduce(np.maximum, lengths).astype(np.int64) * self.sizes()


def _split_plan_to_multiple(plan: BatchPlan, multiple: int, lengths: np.ndarray) -> BatchPlan:
    """:func:`split_batches_to_multiple` on a :class:`BatchPlan`, with the same choices: the batch
    of most padded tokens (then most samples, then the first) that holds more than one sample is
    split in two, until the count is a multiple or no batch can be split."""
    offsets = plan.offsets
    while (len(offsets) - 1) % multiple:
        step = BatchPlan(plan.flat, offsets)
        sizes = step.sizes()
        cost = np.where(sizes > 1, step.padded_tokens(lengths), -1)
        if not len(cost) or cost.max() < 0:
            break
        i = int(np.argmax(np.where(cost == cost.max(), sizes, -1)))
        offsets = np.insert(offsets, i + 1, offsets[i] + sizes[i] // 2)
    return BatchPlan(plan.flat, offsets)


def _pad_plan_to_multiple(plan: BatchPlan, multiple: int, lengths: np.ndarray) -> BatchPlan:
    """:func:`pad_batches_to_multiple` on a :class:`BatchPlan`: repeats of the cheapest batches
    (padded tokens, then the first) appended until the count is a multiple."""
    missing = -len(plan) % multiple
    if not missing or not len(plan):
        return plan
    cheapest = np.lexsort((np.arange(len(plan)), plan.padded_tokens(lengths)))
    extra = [plan[int(cheapest[k % len(cheapest)])] for k in range(missing)]
    tail = BatchPlan.from_lists(extra)
    return BatchPlan(np.concatenate((plan.flat, tail.flat)),
                     np.concatenate((plan.offsets, plan.offsets[-1] + tail.offsets[1:])))


class MicroBatch(list):
    """One micro-batch's sample indices, with the summed ``weights`` (e.g. label tokens) of every
    micro-batch of the same optimizer step on *all* ranks: the denominator of a token-mean loss
    over the whole step, known before the first of its backward passes.

    With one weight per sample ``step_weight`` is a float; with several (``weights`` of shape
    ``[samples, k]``: a preference pair's count and its chosen side's tokens) a tuple of k floats."""

    step_weight: float | tuple[float, ...] | None = None


class TokenBudgetSampler(DistributedSampler):
    """A distributed sampler that yields whole batches of indices.

    Batches are either ``batch_size`` samples or packed to ``max_tokens`` padded tokens (samples of
    similar length grouped within windows of ``sort_window``). The packing is fixed once, so every
    epoch has the same number of steps; each epoch reshuffles the batch order (``set_epoch``, which
    Lightning calls). Batches go round-robin to ranks, so ranks get the same step count and similar
    token loads. Every sample is served exactly once per epoch across ranks; only when the batch
    count cannot be made a multiple of the rank count by splitting batches (every batch is then a
    single sample) are the shortest samples served a second time, with a warning
    (``num_padding_batches`` says how many).

    ``position_fn``, when set, returns how many batches this rank has already consumed in the whole
    run; each new iterator then starts from there (epoch = position // len, skipping the rest).
    That is what makes a resumed run see exactly the batches an uninterrupted one would, from a
    checkpoint taken mid-epoch or at an epoch's end, whatever epoch number the trainer resumes with.

    ``weights`` (one number per sample, e.g. its label tokens, or a row of k numbers per sample) and
    ``accumulate_grad_batches`` make every yielded batch a :class:`MicroBatch` carrying its
    optimizer step's total weight (or k totals) over all ranks. Steps are grouped as Lightning
    groups them: ``accumulate_grad_batches`` consecutive batches from the start of each epoch, the
    last group possibly shorter. Every rank computes the
    same total without a collective, since every rank knows the whole (seeded) plan.

    It subclasses ``DistributedSampler`` so that Lightning uses it as is instead of injecting its own.
    Use it as ``DataLoader(dataset, sampler=sampler, batch_size=None)`` with a dataset whose
    ``__getitem__`` takes a list of indices.
    """

    #: Batches served a second time per epoch (see :func:`pad_batches_to_multiple`).
    num_padding_batches: int = 0

    def __init__(
        self,
        lengths: Sequence[int],
        *,
        max_tokens: int | None = None,
        batch_size: int | None = None,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        sort_window: int = 512,
        weights: Sequence[float] | None = None,
        accumulate_grad_batches: int = 1,
    ) -> None:
        if (max_tokens is None) == (batch_size is None):
            raise ValueError("set exactly one of `max_tokens_per_batch` and `batch_size`")
        if batch_size is not None and batch_size <= 0:
            raise ValueError(f"`batch_size` must be positive, got {batch_size}")
        # DistributedSampler only needs a sized dataset; the lengths array is one.
        super().__init__(lengths, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        # Arrays, not lists: a million-row set's lengths come from the tokenized cache's int32
        # column without a Python int per row, and are shared, not copied (padded sizes are
        # computed in int64: a length times a count).
        self.lengths = np.asarray(lengths)
        if self.lengths.dtype.kind not in "iu":
            self.lengths = self.lengths.astype(np.int64)
        self.max_tokens = max_tokens
        self.batch_size = batch_size
        self.sort_window = sort_window
        if weights is not None and len(weights) != len(self.lengths):
            raise ValueError(f"`weights` has {len(weights)} entries for {len(self.lengths)} samples")
        if accumulate_grad_batches < 1:
            raise ValueError(f"`accumulate_grad_batches` must be >= 1, got {accumulate_grad_batches}")
        self.accumulate_grad_batches = accumulate_grad_batches
        self.position_fn: Callable[[], int] | None = None
        self.batches = self._plan()
        # Each batch's summed weight (8 bytes a batch and weight), for the steps' totals; nothing per
        # row is kept.
        self.batch_weights = (None if weights is None
                              else self.batches.reduce(np.add, np.asarray(weights, dtype=np.float64)))

    def _order(self) -> np.ndarray:
        """The (seeded) sample order the plan groups: int64, 8 bytes a sample."""
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed)
            return torch.randperm(len(self.lengths), generator=g).numpy()
        return np.arange(len(self.lengths), dtype=np.int64)

    def _plan(self) -> BatchPlan:
        batches = self._group(self._order())
        if not isinstance(batches, BatchPlan):  # a subclass's grouping as lists
            batches = BatchPlan.from_lists(batches)
        batches = _split_plan_to_multiple(batches, self.num_replicas, self.lengths)
        planned = len(batches)
        batches = _pad_plan_to_multiple(batches, self.num_replicas, self.lengths)
        #: Batches served twice per epoch so that every rank gets the same step count (see
        #: :func:`pad_batches_to_multiple`); 0 unless there are fewer samples than ranks or every
        #: batch is a single sample.
        self.num_padding_batches = len(batches) - planned
        if self.num_padding_batches and self.rank == 0:
            warnings.warn(
                f"TokenBudgetSampler: {planned} batches cannot be split evenly over {self.num_replicas} ranks"
                f" (each holds one sample), so {self.num_padding_batches} of the shortest samples are served"
                " twice per epoch to give every rank the same step count",
                stacklevel=2,
            )
        return batches

    def _group(self, order: np.ndarray) -> BatchPlan | list[list[int]]:
        """The epoch-independent batches of the (seeded) sample ``order``; a subclass may group
        differently (:class:`lightning_mem.data.packing.PackedBatchSampler` packs rows)."""
        if self.batch_size is not None:
            return BatchPlan(order, np.append(np.arange(0, len(order), self.batch_size), len(order)))
        # Windows of ``sort_window`` samples, each longest first; a stable sort keeps the shuffled
        # order among equal lengths. One sort of the whole order, not one per window.
        window = np.arange(len(order), dtype=np.int64) // self.sort_window
        flat = order[np.lexsort((-self.lengths[order].astype(np.int64), window))]
        starts = _budget_starts(self.lengths[flat], self.max_tokens, self.sort_window)
        return BatchPlan(flat, np.append(starts, len(order)))

    def _epoch_order(self, epoch: int) -> np.ndarray:
        """Every rank's batch numbers of ``epoch`` in order; rank ``r`` takes ``[r::num_replicas]``."""
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + 1 + epoch)
            return torch.randperm(len(self.batches), generator=g).numpy()
        return np.arange(len(self.batches), dtype=np.int64)

    def _epoch_batches(self, epoch: int) -> list[list[int]]:
        return [self.batches[int(i)] for i in self._epoch_order(epoch)[self.rank :: self.num_replicas]]

    def _step_weights(self, ordered: np.ndarray) -> np.ndarray:
        """Per local batch position, the total weight of its optimizer step over all ranks."""
        per_rank, world, accumulate = len(self), self.num_replicas, self.accumulate_grad_batches
        # Batch j of the epoch's order is local position j // world of rank j % world.
        step_of = np.arange(per_rank * world) // world // accumulate
        weights = self.batch_weights[ordered[: per_rank * world]]
        if weights.ndim == 1:
            totals = np.bincount(step_of, weights=weights)
        else:  # several weights a sample: each column summed alike
            totals = np.stack([np.bincount(step_of, weights=w) for w in weights.T], axis=1)
        return totals[np.arange(per_rank) // accumulate]

    def __iter__(self) -> Iterator[list[int]]:  # type: ignore[override]
        epoch, skip = self.epoch, 0
        if self.position_fn is not None:
            epoch, skip = divmod(self.position_fn(), len(self))
        ordered = self._epoch_order(epoch)
        mine = ordered[self.rank :: self.num_replicas][: len(self)]
        if self.batch_weights is None:
            return (self.batches[int(b)] for b in mine[skip:])
        step_weights = self._step_weights(ordered)
        as_weight = float if step_weights.ndim == 1 else lambda row: tuple(float(w) for w in row)
        return (_with_weight(self.batches[int(mine[i])], as_weight(step_weights[i])) for i in range(skip, len(mine)))

    def batch_at(self, n: int) -> list[int]:
        """This rank's ``n``-th batch of the run (epochs counted on): what :meth:`__iter__` yields
        as batch ``n % len(self)`` of epoch ``n // len(self)``. A reader ahead of the loader (a
        generator sampling future prompts) asks for it without disturbing the loader."""
        epoch, position = divmod(n, len(self))
        mine = self._epoch_order(epoch)[self.rank :: self.num_replicas][: len(self)]
        return self.batches[int(mine[position])]

    def __len__(self) -> int:
        return len(self.batches) // self.num_replicas

    def padding_efficiency(self) -> float:
        """Real tokens / padded tokens over the plan: 1.0 means no padding at all."""
        real = int(self.lengths[self.batches.flat].sum())
        padded = int(self.batches.padded_tokens(self.lengths).sum())
        return real / max(padded, 1)


def _budget_starts(lengths: np.ndarray, max_tokens: int, window: int) -> np.ndarray:
    """Where each batch starts in windows of ``window`` samples, each sorted longest first, packed
    greedily to ``max_tokens`` padded tokens (:func:`pack_by_token_budget` on sorted lengths, no
    batch across windows): a batch's first sample is its longest, so it takes ``max_tokens // that
    length`` samples (at least one; samples of length 0 share one batch)."""
    starts, at, n = [], 0, len(lengths)
    while at < n:
        starts.append(at)
        end = min(n, (at // window + 1) * window)
        longest = int(lengths[at])
        at = min(end, at + max(1, max_tokens // longest)) if longest else end
    return np.asarray(starts, dtype=np.int64)


def _with_weight(indices: list[int], step_weight: float | tuple[float, ...]) -> MicroBatch:
    batch = MicroBatch(indices)
    batch.step_weight = step_weight
    return batch


def resume_where_stopped(sampler: TokenBudgetSampler, trainer: Any) -> None:
    """Position a training sampler by the batches the trainer has already run.

    Lightning restores its batch counters from a checkpoint but replays a plain DataLoader from
    the start (and, from a checkpoint taken on an epoch's last batch, resumes with the next epoch
    number); positioning by batches run makes a resumed run see exactly the uninterrupted batches.
    """
    if trainer is None:
        return
    progress = trainer.fit_loop.epoch_loop.batch_progress
    sampler.position_fn = lambda: progress.total.processed
