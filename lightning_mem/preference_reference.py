"""The reference policy of preference training (DPO and its family), by memory plan.

A DPO step compares the policy's log-probs of each pair's chosen and rejected completions with a
frozen reference's (the policy before training). Where that reference lives is a memory plan,
``model.reference.mode`` in the DPO recipe (:class:`ReferenceSettings`):

- ``adapters_off`` (LoRA, QLoRA): the policy's own base with its adapters switched off *is* the
  reference; nothing is loaded a second time (:class:`~lightning_mem.rl.reference.AdaptersOff`).
- ``copy``: a frozen copy on the device (:class:`~lightning_mem.rl.reference.FrozenCopy`): a
  model's weights more, no activations kept (its forward runs without gradients).
- ``host``: the same copy parked in host memory between its forwards, brought to the device for
  each one and sent back (:class:`HostParked`, through :mod:`lightning_mem.offload`'s module
  residency, as PPO's memory plan parks its frozen models): the device holds it only while it runs.
- ``precompute``: one pass over the data before the first step, then no reference at all during
  training: each pair's two sums are looked up by its ``pair_index``
  (:mod:`lightning_mem.reference_cache` keeps them on disk for later runs and every rank).
- ``auto``: ``adapters_off`` with LoRA, else ``copy``. ``none``: no reference, for the
  reference-free objectives (SimPO, ORPO), which load none under any mode.

The forward is the caller's (``score(model) -> [2B]`` per-sequence sums): the reference computes
its log-probs exactly as the policy's are computed, same chunking, same batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_mem import offload
from lightning_mem.offload import module_residency
from lightning_mem.rl.reference import AdaptersOff, FrozenCopy
from lightning_mem.settings import SettingError, check_fields

ReferenceMode = Literal["auto", "adapters_off", "copy", "host", "precompute", "none"]


@dataclass
class ReferenceSettings:
    """Where the reference lives (the DPO recipe's ``model.reference``).

    Args:
        mode: ``auto``, ``adapters_off``, ``copy``, ``host``, ``precompute`` or ``none`` (see the
            module docstring). Objectives that need no reference load none whatever the mode.
        name_or_path: the reference's weights (a folder or hub id); None: the policy's starting
            weights (``model.name_or_path``; with LoRA, its base).
        cache_dir: ``precompute``: the folder that keeps the log-probs (``train.safetensors``,
            ``val.safetensors``); relative to ``trainer.default_root_dir``; None:
            ``reference_logps`` there. A folder holding log-probs of other inputs is refused.
        pin_memory: ``host``: pin the parked copy (faster transfers); None: pinned when the device
            is CUDA.
    """

    mode: ReferenceMode = "auto"
    name_or_path: str | None = None
    cache_dir: str | None = None
    pin_memory: bool | None = None

    def __post_init__(self) -> None:
        check_fields(self)


def reference_mode(settings: ReferenceSettings, *, needs_reference: bool, lora: bool, loss: str = "the loss") -> str | None:
    """The mode a run carries out: None when the objective needs no reference; ``auto`` resolved
    (``adapters_off`` with LoRA and no other weights named, else ``copy``).

    Raises:
        SettingError: naming ``mode`` (or ``name_or_path``) for a combination that cannot work:
            ``none`` under an objective that needs a reference (``loss`` says which), ``adapters_off``
            without adapters or with other weights named.
    """
    check_fields(settings)
    mode = settings.mode
    if mode == "adapters_off" and not lora:
        raise SettingError("mode", ": `adapters_off` switches off the policy's LoRA adapters, and this policy has none;"
                                   " use `copy`, `host` or `precompute` (or give the policy `lora`)")
    if mode == "adapters_off" and settings.name_or_path is not None:
        raise SettingError("name_or_path", f" ({settings.name_or_path!r}) names other weights, but `mode: adapters_off` is"
                                           " the policy's own base; use `copy`, `host` or `precompute` for other weights",
                           siblings=("mode",))
    if mode == "none" and needs_reference:
        raise SettingError("mode", f" is 'none', but {loss} compares the policy with a reference; use a reference-free"
                                   " loss (simpo, orpo) or another mode (auto, copy, host, precompute, adapters_off)")
    if not needs_reference:
        return None
    if mode == "auto":
        return "adapters_off" if lora and settings.name_or_path is None else "copy"
    return mode


class HostParked(FrozenCopy):
    """A frozen copy that lives in host memory except during its own forward.

    :meth:`park` sends it to the host (after the strategy has put the module on the device); each
    :meth:`logprobs` brings it to the device, runs the forward, and parks it again, so the policy's
    training phase never holds it. The moves are :mod:`lightning_mem.offload`'s, whose ledger
    (``module_location``) says where it is (on a CPU-only machine, where both are one memory).

    The copy never changes, so its host tensors (pinned on CUDA) are made once and kept: parking it
    again only drops the device tensors, and each forward costs one host-to-device copy, not a
    copy each way and a fresh pinned allocation (slow, at a model's size) per micro-batch.
    """

    mode = "host"

    def __init__(self, pin_memory: bool | None = None) -> None:
        super().__init__()
        self.pin_memory = pin_memory
        self._host: list[Tensor] | None = None

    def _tensors(self) -> list[Tensor]:
        return [*self.module.parameters(), *(b for b in self.module.buffers() if b is not None)]

    def park(self) -> None:
        ledger = module_residency(self.module)
        if ledger.location == "host":
            return
        if self._host is None:
            # Called through the module: the memory estimate counts what these allocate by wrapping them there.
            offload.offload_module(self.module, pin_memory=self.pin_memory)
            self._host = [t.data for t in self._tensors()]
            return
        for tensor, host in zip(self._tensors(), self._host):
            tensor.data = host  # the device copy is dropped; the host one is still exact
        ledger.location = "host"

    def logprobs(self, actor: nn.Module, score: Callable[[nn.Module], Tensor]) -> Tensor:
        offload.reload_module(self.module)  # copies to where each tensor came from; the kept host tensors stay
        try:
            return score(self.module)
        finally:  # also on an exception: the plan's resting place is the host
            self.park()


@contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode inside the block, its own mode after: a reference forward through the
    policy must not see the dropout the policy may train with (``model.disable_dropout: false``)."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


class PolicyBase(AdaptersOff):
    """:class:`~lightning_mem.rl.reference.AdaptersOff` (the LoRA policy's base, adapters disabled),
    in eval mode."""

    def logprobs(self, actor: nn.Module, score: Callable[[nn.Module], Tensor]) -> Tensor:
        with evaluating(actor):
            return super().logprobs(actor, score)


class StartingPolicy:
    """The policy itself, while it still holds its starting weights: what ``precompute`` scores
    with before the first step when the reference is those weights and there are no adapters to
    switch off (a full fine-tune). Nothing is loaded; the forward runs in eval mode."""

    mode = "starting_policy"
    module = None

    def build(self, load_policy: Callable[[], nn.Module]) -> None:
        return None

    def logprobs(self, actor: nn.Module, score: Callable[[nn.Module], Tensor]) -> Tensor:
        with evaluating(actor):
            return score(actor)


Reference = FrozenCopy | AdaptersOff | StartingPolicy


def build_reference(mode: str, *, pin_memory: bool | None = None) -> Reference:
    """The object that runs the reference forward under ``mode``: ``adapters_off``, ``copy``,
    ``host``, or ``starting_policy`` (what ``precompute`` may score with)."""
    kinds: dict[str, Callable[[], Reference]] = {
        "adapters_off": PolicyBase, "copy": FrozenCopy, "host": lambda: HostParked(pin_memory),
        "starting_policy": StartingPolicy,
    }
    if mode not in kinds:
        raise ValueError(f"no reference object for mode {mode!r}")
    return kinds[mode]()


# ---------------------------------------------------------------------------------------------
# precompute: one pass, each replica its share, a table of (chosen, rejected) sums per pair
# ---------------------------------------------------------------------------------------------


def padded_share(batches: Iterable[dict[str, Tensor]], count: int,
                 filler: Callable[[], dict[str, Tensor]]) -> Iterator[tuple[dict[str, Tensor], bool]]:
    """``(batch, keep)`` for this replica's share of a pass, padded to ``count`` forwards: every
    replica runs as many as the one with the most (a sharded model's collectives need every rank at
    each forward), the extra ones on ``filler()``'s batch, whose values are not kept."""
    done, spare = 0, None
    for batch in batches:
        done += 1
        spare = batch
        yield batch, True
    for _ in range(count - done):
        if spare is None:
            spare = filler()
        yield spare, False


def reference_table(batches: Iterable[tuple[dict[str, Tensor], bool]], score: Callable[[dict[str, Tensor]], Tensor],
                    pairs: int, device: torch.device | str) -> Tensor:
    """``[pairs, 2]`` float32: the (chosen, rejected) log-prob sums ``score(batch)`` gives each kept
    batch's pairs, at their ``pair_index`` rows. The rows of pairs no kept batch holds are ``-inf``:
    another replica's share. The replicas' tables then combine by an element-wise max, which takes
    each pair's value whoever scored it, and as it is when two replicas scored it (a sampler that
    serves a batch twice to even out the ranks' step counts)."""
    table = torch.full((pairs, 2), -math.inf, dtype=torch.float32, device=device)
    for batch, keep in batches:
        sums = score(batch).float()  # [2B]: the chosen sides first, then the rejected
        if keep:
            index = batch["pair_index"].to(device)
            half = index.numel()
            table[index] = torch.stack([sums[:half], sums[half:]], dim=1).to(device)
    return table


def looked_up(table: Tensor, pair_index: Tensor) -> tuple[Tensor, Tensor]:
    """The (chosen, rejected) sums of a micro-batch's pairs from a precomputed table, on the device
    (an index, no host read)."""
    rows = table.index_select(0, pair_index.to(table.device))
    return rows[:, 0], rows[:, 1]


def check_table(table: Tensor, pairs: int, *, where: Any) -> None:
    """A table must hold one finite row per kept pair: a wrong shape (a file of other data) or a
    pair no replica scored (``-inf``) fails here, plainly, rather than as a strange loss later."""
    if table.dim() != 2 or table.shape != (pairs, 2):
        raise ValueError(f"{where}: reference log-probs of shape {tuple(table.shape)}, expected ({pairs}, 2) for {pairs} pairs")
    missing = (~torch.isfinite(table)).any(dim=1).nonzero().flatten()
    if missing.numel():
        raise ValueError(f"{where}: {missing.numel()} of {pairs} pairs were not scored (pair {int(missing[0])} first)")
