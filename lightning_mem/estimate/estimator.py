"""The estimate, start to end: parse the config, run the recipe's own fit on fake tensors, and
report each phase's memory per rank (:func:`estimate`, :class:`Estimate`).

The steps, in the order the estimate takes them:

1. parse the config with the recipe's own LightningCLI parser (nothing is instantiated but the
   LightningModule, its datamodule and the strategy, precision and callbacks of the trainer section);
2. point every model of the config (policy, critic, reward model) at a folder holding only its
   ``config.json`` (a hub id resolves to ``assets/hub/<id>``), so the recipe's ``configure_model``
   builds it with random init -- on fake tensors, so nothing is allocated or read;
3. run Lightning's own ``Trainer.fit`` of the module (:class:`~lightning_mem.estimate.run.EstimateRun`):
   one CPU process with the config's precision plugin, clipping and accumulation and its technique
   callbacks; its data are the datamodule's ``largest_batch``: a short warm-up step, then the
   largest micro-batch the config allows. The module's own hooks and steps run (``configure_model``, ``configure_optimizers``,
   ``training_step``, backward, optimizer step, ``zero_grad``), so a recipe -- or a user's subclass
   of one -- is estimated as itself;
4. record, per phase the step reports (or for the whole step), the peak of live tensor bytes and
   its breakdown (:mod:`.tracker`, :mod:`.recorder`), then stop the fit.

Sharding strategies (FSDP2, DeepSpeed ZeRO) run here as one unsharded process; their per-rank
bytes are derived from the measured weights, gradients and optimizer state (see
:func:`~lightning_mem.estimate.sharding.shard_per_rank`). For FSDP2 the derivation is the ledger's
per-rank view (:mod:`.rank_view`), applied at every allocation (a rank peaks where its own bytes
do, not where the unsharded process does), with the gradients followed unit by unit as FSDP2
reduce-scatters them and each model's root unit gathered only while that model runs.
:func:`~lightning_mem.estimate.measure_fit` runs the config's real fit on 2 ranks to hold it to
what each rank holds.
"""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_mem.estimate.generator import RECEIVE_PHASE, RoleEstimate, generating_rank
from lightning_mem.estimate.recipe_config import instantiate, localize_models, parse_config, recipe_for, world_size_of
from lightning_mem.estimate.recorder import PhaseEstimate
from lightning_mem.estimate.run import EstimateRun


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
    #: Separate placement: the generating ranks (``phases`` and ``world_size`` are the training ranks').
    generator: RoleEstimate | None = None

    @property
    def every_phase(self) -> list[PhaseEstimate]:
        """The training rank's phases, then a generating rank's (separate placement)."""
        return self.phases + (self.generator.phases if self.generator is not None else [])

    @property
    def device_peak_bytes(self) -> int:
        """The largest peak of any rank (both roles are on devices of the same size)."""
        return max(p.device_peak_bytes for p in self.every_phase)

    @property
    def host_peak_bytes(self) -> int:
        return max(p.host_peak_bytes for p in self.every_phase)

    @property
    def training_peak_bytes(self) -> int:
        return max(p.device_peak_bytes for p in self.phases)


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
        vocab = localize_models(cfg.model, Path(tmp))
        if cfg.get("data") is not None and "tokenizer" in cfg.data:
            cfg.data.tokenizer = cfg.model.name_or_path
        init = instantiate(cli, cfg)
        size = world_size or world_size_of(cfg.trainer)
        separate = _separate_placement(init.model, size)
        run = run_class(init, cfg, world_size=size, fake=fake, vocab=vocab, workdir=Path(tmp), full_loops=full_loops,
                        device_memory=device_memory)
        run.fit()
        generator = None
        if separate is not None:
            generator = generating_rank(run, run.stand_in, ranks=separate.generator_devices,
                                        max_staleness=separate.max_staleness)
    notes = _notes(run, init.trainer.callbacks, size)
    phases = run.phases
    if generator is not None:
        # The training rank's rollout phase only takes the generators' samples.
        phases = [dataclasses.replace(p, phase=RECEIVE_PHASE) if p.phase == "rollout" else p for p in phases]
        notes = [f"separate placement: {size} training rank(s) (no generation: `{RECEIVE_PHASE}` takes the samples)"
                 f" and {generator.ranks} generating rank(s), each estimated on its own device",
                 *notes, *generator.notes]
    return Estimate(str(config), module_name, size, run.sharding.name, phases, notes, parsed=cfg,
                    paged_state_bytes=sum(run.paged_bytes.values()), generator=generator)


def _separate_placement(module: Any, training_ranks: int) -> Any:
    """The module's ``async_rollout`` settings when it samples in generator processes of its own
    (``model.rollout_engine.placement: separate``), checked against the training ranks; else None."""
    from lightning_mem.rl.async_config import check_generator_devices

    engine = getattr(module, "rollout_engine_config", None)
    if engine is None or getattr(engine, "placement", "colocated") != "separate":
        return None
    check_generator_devices(module.async_config, training_ranks)
    return module.async_config
