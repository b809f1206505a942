"""Direct preference optimization (DPO) and its family on preference pairs.

    python -m recipes.dpo fit --config configs/dpo/tiny_cpu.yaml
    python -m recipes.dpo fit --config configs/dpo/tiny_cpu.yaml --model.reference.mode precompute

A step, for ``B`` pairs stacked as ``2B`` sequences (the ``B`` chosen sides, then the rejected ones:
:class:`~lightning_mem.data.PreferenceDataModule`): 1. the reference's summed completion log-probs,
without gradients: looked up by ``pair_index`` when precomputed, else one forward of the reference
wherever the memory plan keeps it (``model.reference``, :mod:`lightning_mem.preference_reference`);
2. the policy's, from one forward of chosen and rejected together through the chunked logits path,
summed per sequence; 3. the objective per pair (``model.dpo``, :mod:`lightning_mem.preference_losses`);
4. a mean over the optimizer step's pairs (every micro-batch, every rank), and an NLL term as a
token mean over the step's chosen tokens. The model plumbing (loading, LoRA, precision, checkpoints
of what trains, export, merge) is the SFT recipe's, which this module subclasses. docs/dpo.md.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor

from lightning_mem import logits as logits_path
from lightning_mem.callbacks import memory_phase
from lightning_mem.checkpointing import check_trainable_kept, keep_trainable
from lightning_mem.cli import RecipeCLI, run_command
from lightning_mem.data import PreferenceDataModule
from lightning_mem.data.packing import VARLEN_ATTENTION, flatten_rows
from lightning_mem.dtypes import dtype_name, trainer_dtypes
from lightning_mem.export import export_main
from lightning_mem.logits import ChunkSize, check_supported, next_token_targets, score_tokens
from lightning_mem.lora import LoraSettings, merge_main
from lightning_mem.models import check_model_source, load_causal_lm
from lightning_mem.preference_losses import (
    PreferenceLossOutput,
    PreferenceLossSettings,
    SequenceLogps,
    preference_loss,
    preference_metrics,
)
from lightning_mem.preference_reference import (
    HostParked,
    ReferenceSettings,
    build_reference,
    check_table,
    looked_up,
    padded_share,
    reference_mode,
    reference_table,
)
from lightning_mem.quantization import QuantizationSettings
from lightning_mem.quantized_lora import load_quantized_lora
from lightning_mem.ranks import check_model_splits, data_parallel
from lightning_mem.reference_cache import ReferenceLogpCache, cache_key, code_version, weights_identity
from lightning_mem.rl.memory_plan import release_cached_memory
from lightning_mem.rl.reference import disable_dropout
from lightning_mem.settings import SettingError, settings_at
from lightning_mem.step_io import step_io
from recipes.sft import SFTModule


def _adamw(params: Any) -> torch.optim.Optimizer:
    # TRL DPOConfig's learning rate: DPO moves a model that already answers well.
    return torch.optim.AdamW(params, lr=1e-6)


class DPOModule(SFTModule):
    """A policy trained on preference pairs against a frozen reference.

    Args:
        name_or_path, dtype, attn_implementation, trust_remote_code, optimizer, lr_scheduler,
            logits_chunk_size, export_dir, lora, random_init_dir, init_seed: the SFT recipe's
            (:class:`~recipes.sft.SFTModule`). A config-only folder always gets its seeded random
            weights saved under ``random_init_dir``, so a reference loaded from it is the policy's
            start. The optimizer's default learning rate is TRL's, 1e-6.
        dpo: the objective (:class:`~lightning_mem.preference_losses.PreferenceLossSettings`:
            ``loss_type`` (one or several, weighted by ``loss_weights``), ``beta``,
            ``label_smoothing``, ``gamma``, ``orpo_lambda``, ``discopop_tau``).
        reference: where the reference lives (:class:`~lightning_mem.preference_reference.ReferenceSettings`:
            ``mode`` auto / adapters_off / copy / host / precompute / none, ``name_or_path``,
            ``cache_dir``, ``pin_memory``). Reference-free objectives (simpo, orpo, sft) load none.
        disable_dropout: switch the policy's dropout off, LoRA's included (TRL's default): the
            log-ratio then compares two deterministic forwards.
        quantization: a quantized base under the LoRA adapters (QLoRA's 4-bit NF4, or 8-bit:
            :class:`~lightning_mem.quantization.QuantizationSettings`, as in ``recipes.qlora``): needs
            ``lora``; the reference is then that base with the adapters off. Its unquantized tensors
            take ``dtype``, or the compute dtype when it is unset.
    """

    def __init__(
        self,
        name_or_path: str = "assets/tiny-llama",
        dtype: str | None = None,
        attn_implementation: str | None = None,
        trust_remote_code: bool = False,
        optimizer: OptimizerCallable = _adamw,
        lr_scheduler: LRSchedulerCallable | None = None,
        logits_chunk_size: ChunkSize = 512,
        export_dir: str | None = "export",
        lora: LoraSettings | None = None,
        random_init_dir: str = "random_base",
        init_seed: int = 0,
        dpo: PreferenceLossSettings = PreferenceLossSettings(),
        reference: ReferenceSettings = ReferenceSettings(),
        disable_dropout: bool = True,
        quantization: QuantizationSettings | None = None,
    ) -> None:
        super().__init__(name_or_path=name_or_path, dtype=dtype, attn_implementation=attn_implementation,
                         trust_remote_code=trust_remote_code, optimizer=optimizer, lr_scheduler=lr_scheduler,
                         logits_chunk_size=logits_chunk_size, export_dir=export_dir, lora=lora,
                         random_init_dir=random_init_dir, init_seed=init_seed)
        # Objects, whatever arrives: under LightningCLI (and load_from_checkpoint) these are dicts.
        with settings_at("model.dpo"):
            self.dpo = PreferenceLossSettings(**dpo) if isinstance(dpo, dict) else dpo
        with settings_at("model.reference"):
            self.reference_settings = ReferenceSettings(**reference) if isinstance(reference, dict) else reference
            if self.reference_settings.name_or_path is not None:  # a missing folder fails before any load
                check_model_source(self.reference_settings.name_or_path, key="name_or_path")
            #: What the run carries out: adapters_off, copy, host, precompute, or None (no reference).
            self.reference_mode = reference_mode(self.reference_settings, needs_reference=self.dpo.needs_reference,
                                                 lora=self.lora is not None,
                                                 loss=f"`model.dpo.loss_type: {self.dpo.loss_type}`")
        with settings_at("model.quantization"):
            self.quantization = QuantizationSettings(**quantization) if isinstance(quantization, dict) else quantization
        if self.quantization is not None and self.lora is None:
            raise SettingError("model.quantization", ": a quantized base cannot train, only adapters on it can; set"
                                                     " `model.lora` too, or train the base unquantized")
        if self.reference_mode is None and self.reference_settings.mode not in ("auto", "none"):
            rank_zero_warn(f"`model.reference.mode: {self.reference_settings.mode}` has no effect: `model.dpo.loss_type:"
                           f" {self.dpo.loss_type}` reads no reference, so none is loaded")
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler"], logger=False)
        # Checkpoints hold what trains only (never a reference copy): loading leaves the rest missing.
        self.strict_loading = False
        self.reference_policy: Any = None  # the object that runs the reference forward
        self.reference: torch.nn.Module | None = None  # a loaded copy's module (registered: placed by the strategy)
        self.reference_tables: dict[str, Tensor] = {}  # precompute: [pairs, 2] per split
        self._reference_loads = False  # decided in setup: configure_model loads a reference copy
        self._cache_keys: dict[str, dict[str, Any]] = {}
        self._cached: dict[str, bool] = {}
        self._restored = False  # the policy's weights came from a checkpoint (not its start)
        self._policy_path: str | None = None

    # -- setup: every check before any model loads -----------------------------------------------
    def setup(self, stage: str) -> None:
        super().setup(stage)
        from lightning.pytorch.strategies import ModelParallelStrategy

        if self.reference_mode == "host" and isinstance(self.trainer.strategy, ModelParallelStrategy):
            raise SettingError(
                "model.reference.mode", ": `host` parks a whole copy in host memory, but"
                f" {type(self.trainer.strategy).__name__} shards every model and owns where its shards live; use"
                " `copy` with the strategy's `cpu_offload`, or `precompute`")
        self._reference_loads = self.reference_mode in ("copy", "host")
        if self.reference_mode == "precompute":
            if getattr(self.trainer.datamodule, "data_identity", None):  # else no cache (the estimate has no data)
                with settings_at("model.reference"):
                    self._check_reference_cache()
            # A miss is computed from a loaded copy only when other weights are named: the policy's
            # start (or a LoRA policy's base) scores it itself, loading nothing.
            hit = bool(self._cached) and all(self._cached.values())
            self._reference_loads = not hit and self.reference_settings.name_or_path is not None
        if self._reference_loads:
            self.reference_dtype()  # a dtype the precision contradicts fails now
            if self.reference_settings.name_or_path is not None:  # the SFT setup checked the policy's source
                with settings_at("trainer.strategy.init_args"):
                    check_model_splits(self.trainer, self.reference_settings.name_or_path,
                                       trust_remote_code=self.hparams.trust_remote_code)

    def policy_source(self) -> str:
        """The policy's starting weights: ``name_or_path``, or for a config-only folder its seeded random
        weights saved under ``random_init_dir``, so that a reference loaded from the same source is
        the same model (and a precomputed cache can name the weights)."""
        if self._policy_path is None:
            from lightning_mem.lora import saved_base

            hp = self.hparams
            self._policy_path = saved_base(self._trainer, hp.name_or_path, hp.random_init_dir, seed=hp.init_seed)
        return self._policy_path

    def reference_source(self) -> str:
        return self.reference_settings.name_or_path or self.policy_source()

    def reference_dtype(self) -> torch.dtype | str:
        """A frozen role's dtype: the LoRA base's (``model.dtype``) or the compute dtype."""
        dtypes = trainer_dtypes(self._trainer, key="trainer.precision")
        with settings_at("model"):
            return dtypes.load_dtype(self.hparams.dtype if self.lora is not None else None, role="frozen",
                                     key="dtype", precision_key="trainer.precision")

    def _check_reference_cache(self) -> None:
        """precompute: each split's key, and whether its cache file can be used (all ranks agree); a
        file holding other inputs' values is refused here, naming it."""
        datamodule, hp = self.trainer.datamodule, self.hparams
        folder = Path(self.reference_settings.cache_dir or "reference_logps")
        self.reference_cache = ReferenceLogpCache(folder if folder.is_absolute() else Path(self.trainer.default_root_dir) / folder)
        dtype = self.reference_dtype()
        common = dict(reference=weights_identity(self.reference_source()), precision=self.trainer.precision,
                      dtype=dtype if isinstance(dtype, str) else dtype_name(dtype), attention=hp.attn_implementation,
                      code=code_version(logits_path, DPOModule.sequence_logps))
        for split in self._splits():
            self._cache_keys[split] = cache_key(data=datamodule.data_identity(split), **common)
            hit = self.reference_cache.lookup(split, self._cache_keys[split])
            # Every rank computes the pass together or none does (a shared file system may differ).
            self._cached[split] = bool(self.trainer.strategy.reduce_boolean_decision(hit, all=True))

    def _splits(self) -> list[str]:
        datamodule = self.trainer.datamodule
        return ["train"] + (["val"] if getattr(datamodule, "val_set", None) is not None else [])

    # -- the models -------------------------------------------------------------------------------
    def configure_model(self) -> None:
        if self.model is not None:
            return
        if self.quantization is None:
            super().configure_model()  # the policy, from policy_source(), LoRA applied, in train mode
        else:
            self.model = load_quantized_lora(
                self.policy_source(), self.quantization, self.lora, frozen_dtype=self.model_dtype(),
                trained_dtype=trainer_dtypes(self._trainer).trained, attn_implementation=self.hparams.attn_implementation,
                trust_remote_code=self.hparams.trust_remote_code)
            if self.logits_chunk_size:  # a model the chunked path cannot score fails here, naming our key
                check_supported(self.model, key="model.logits_chunk_size")
        if self.hparams.disable_dropout:
            disable_dropout(self.model)
        mode = self.reference_mode
        if mode is None:
            return
        if mode == "precompute":  # what scores the pass on a miss, if anything must
            mode = "copy" if self._reference_loads else ("adapters_off" if self.lora is not None else "starting_policy")
        self.reference_policy = build_reference(mode, pin_memory=self.reference_settings.pin_memory)
        if self._reference_loads:
            self.reference = self.reference_policy.build(self._load_reference)

    def _load_reference(self) -> torch.nn.Module:
        hp = self.hparams
        return load_causal_lm(self.reference_source(), dtype=self.reference_dtype(), attn_implementation=hp.attn_implementation,
                              trust_remote_code=hp.trust_remote_code, key="model.reference.name_or_path")

    def on_fit_start(self) -> None:
        self.prepare_reference(self._splits())

    def on_validation_start(self) -> None:
        self.prepare_reference(["val"])  # `validate` runs no on_fit_start; in fit this finds it done

    def prepare_reference(self, splits: list[str]) -> None:
        """After the strategy placed the models, before the first step: ``host`` parks the copy in
        host memory; ``precompute`` fills the tables (from the cache or one pass) and frees what
        scored them."""
        if isinstance(self.reference_policy, HostParked):
            self.reference_policy.park()
        missing = [split for split in splits if split not in self.reference_tables]
        if self.reference_mode == "precompute" and missing:
            self.precompute_reference(missing)

    def on_train_epoch_start(self) -> None:
        if self.reference is not None:  # Lightning puts the whole module in train mode at each epoch
            self.reference.eval()

    # -- precompute: one pass over the data, before the first step ---------------------------------
    def precompute_reference(self, splits: list[str]) -> None:
        """Each split's ``[pairs, 2]`` table, read from the cache or computed by :meth:`reference_pass`
        (and saved for the next run); then nothing that scored it stays in memory."""
        for split in splits:
            stand_in = step_io(self.trainer).data_pass(split)  # the memory estimate's batches, or None
            if stand_in is not None:  # values that are not values: nothing to check or save
                pairs = sum(batch["pair_index"].numel() for batch in stand_in)
                self.reference_tables[split] = self.reference_pass([(batch, True) for batch in stand_in], pairs)
                continue
            if self._cached.get(split):
                table = self.reference_cache.load(split, self._cache_keys[split], device=self.device)
            else:
                table = self.reference_pass(self.reference_batches(split), self._pairs_of(split))
                if self.trainer.local_rank == 0 and split in self._cache_keys:  # once per node
                    path = self.reference_cache.save(split, self._cache_keys[split], table)
                    rank_zero_info(f"reference log-probs of {table.shape[0]} {split} pairs saved to {path}")
            check_table(table, self._pairs_of(split), where=f"{split} reference log-probs")
            self.reference_tables[split] = table
        self.trainer.strategy.barrier("reference_logps")
        self._free_reference()

    def reference_batches(self, split: str) -> Any:
        """This rank's share of the pass over ``split``, as ``(batch, keep)``: the data module's
        in-order micro-batches, padded so every replica runs as many forwards."""
        datamodule = self.trainer.datamodule
        if not hasattr(datamodule, "reference_loader"):
            raise TypeError(f"`model.reference.mode: precompute` passes over the data before training through the data"
                            f" module's reference_loader(), and {type(datamodule).__name__} has none"
                            " (lightning_mem.data.PreferenceDataModule has)")
        replicas, replica = data_parallel(self.trainer)
        whole = datamodule.reference_loader(split)
        mine = datamodule.reference_loader(split, num_replicas=replicas, rank=replica) if replicas > 1 else whole
        count = -(-len(whole) // replicas)
        return padded_share(mine, count, lambda: next(iter(whole)))

    def reference_pass(self, batches: Any, pairs: int) -> Tensor:
        """The reference's (chosen, rejected) sums of every pair of ``batches`` (``(batch, keep)``), a
        ``[pairs, 2]`` table gathered from the replicas (an element-wise max: the rows another
        replica scored are ``-inf`` here): the loop the memory estimate can drive."""
        if self.reference_mode == "precompute" and self._restored and self.reference_policy.mode == "starting_policy":
            self._load_late_copy()
        score = lambda batch: self.reference_policy.logprobs(  # noqa: E731
            self.model, lambda model: self.sequence_logps(model, move_data_to_device(batch, self.device)))
        with memory_phase(self.trainer, "precompute"), torch.no_grad(), self.trainer.precision_plugin.forward_context():
            table = reference_table(batches, score, pairs, self.device)
        return self.trainer.strategy.reduce(table, reduce_op="max")

    def _load_late_copy(self) -> None:
        # NOTE: a resumed full fine-tune whose cache is gone: the policy no longer holds its start,
        # so a copy is loaded now, outside the strategy (unsharded, on this rank's device).
        rank_zero_warn("precompute: no reference log-probs cached and the policy resumed from a checkpoint;"
                       f" loading the starting weights ({self.reference_source()}) once to compute them")
        self.reference_policy = build_reference("copy")
        self.reference_policy.build(lambda: self._load_reference().to(self.device))

    def _pairs_of(self, split: str) -> int:
        return len(getattr(self.trainer.datamodule, f"{split}_set"))

    def _free_reference(self) -> None:
        self.reference_policy = None
        self.reference = None
        release_cached_memory()

    # -- the algorithm ----------------------------------------------------------------------------
    def sequence_logps(self, model: torch.nn.Module, batch: dict[str, Tensor]) -> Tensor:
        """``[2B]`` float32: each side's summed completion-token log-probs (chosen sides first), from
        one forward of all ``2B`` sequences through the chunked logits path."""
        inputs, positions = batch, batch["target_positions"]
        if self.hparams.attn_implementation in VARLEN_ATTENTION and "row_tokens" in batch:
            # varlen flash-attention isolates the sequences of one row only; the targets keep their
            # order, so target_sequence still names theirs.
            inputs = flatten_rows(batch)
            positions, _ = next_token_targets(inputs["input_ids"], inputs["labels"])
        scores = score_tokens(model, inputs["input_ids"], inputs.get("attention_mask"), positions, batch["target_ids"],
                              chunk_size=self.logits_chunk_size, position_ids=inputs.get("position_ids"))
        sums = torch.zeros(batch["sequence_tokens"].numel(), dtype=torch.float32, device=scores.logprobs.device)
        return sums.index_add(0, batch["target_sequence"], scores.logprobs.float())

    @staticmethod
    def sides(sums: Tensor, batch: dict[str, Tensor]) -> tuple[SequenceLogps, SequenceLogps]:
        """The chosen and the rejected halves of ``[2B]`` per-sequence sums."""
        half, tokens = batch["pair_index"].numel(), batch["sequence_tokens"]
        return SequenceLogps(sums[:half], tokens[:half]), SequenceLogps(sums[half:], tokens[half:])

    def reference_logps(self, batch: dict[str, Tensor], split: str) -> tuple[SequenceLogps | None, SequenceLogps | None]:
        """1. The reference's sums: looked up by ``pair_index`` (precompute), or one forward without
        gradients (adapters off, a copy, a host-parked copy); None for a reference-free objective."""
        if self.reference_mode is None:
            return None, None
        if self.reference_mode == "precompute":
            chosen, rejected = looked_up(self.reference_tables[split], batch["pair_index"])
            tokens, half = batch["sequence_tokens"], batch["pair_index"].numel()
            return SequenceLogps(chosen, tokens[:half]), SequenceLogps(rejected, tokens[half:])
        # Part of the step's phase (train): its forward keeps nothing, and a host-parked copy's
        # transfer to the device is what the step holds while it runs.
        with torch.no_grad():
            sums = self.reference_policy.logprobs(self.model, lambda model: self.sequence_logps(model, batch))
        return self.sides(sums, batch)

    def pair_losses(self, batch: dict[str, Tensor], split: str) -> tuple[PreferenceLossOutput, SequenceLogps, SequenceLogps]:
        # 1. The reference first: its forward keeps nothing, the policy's keeps activations for backward.
        ref_chosen, ref_rejected = self.reference_logps(batch, split)
        # 2. The policy: chosen and rejected in one forward.
        chosen, rejected = self.sides(self.sequence_logps(self.model, batch), batch)
        # 3. The objective, per pair.
        return preference_loss(self.dpo, chosen, rejected, ref_chosen, ref_rejected), chosen, rejected

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        out, chosen, rejected = self.pair_losses(batch, "train")
        # 4. Means over the optimizer step: pairs for the pairwise terms, chosen tokens for the NLL.
        pairs = out.pair_losses.numel()
        loss = out.pair_losses.sum() * self._step_share(batch.get("step_pairs"), pairs)
        mean = out.pair_losses.detach().mean()
        if out.nll_weight:
            nll, tokens = -chosen.sums.sum(), chosen.tokens.sum()
            loss = loss + out.nll_weight * nll * self._step_share(batch.get("step_chosen_tokens"), tokens)
            mean = mean + out.nll_weight * nll.detach() / tokens.clamp(min=1)
        # Device tensors without prog_bar: no host read per micro-batch (DESIGN.md).
        self.log("train_loss", mean, on_step=True, on_epoch=False)
        for name, value in preference_metrics(out, chosen, rejected).items():
            self.log(name, value, on_step=True, on_epoch=False)
        return loss

    def _step_share(self, step_total: Tensor | None, local: Tensor | int) -> Tensor | float:
        """What turns this micro-batch's sum into its share of the step's mean (as SFT's
        ``_step_scale``): Lightning divides by the accumulation and DDP averages the replicas, so
        multiplying by both and dividing by the step's count (every micro-batch, every replica; the
        sampler counts it ahead, on the host) makes the accumulated gradient that of the step's mean.
        Without a step count (a data module of your own): the micro-batch's mean."""
        if step_total is None:
            return 1.0 / local.clamp(min=1) if isinstance(local, Tensor) else 1.0 / max(local, 1)
        replicas, _ = data_parallel(self.trainer)
        return (self.trainer.accumulate_grad_batches * replicas) / step_total.clamp(min=1)

    # -- validation: the same quantities over the val pairs ---------------------------------------
    def on_validation_epoch_start(self) -> None:
        # Pair-loss sum, pairs, NLL sum, chosen tokens: val_loss is the objective over the whole set.
        self._val_sums = torch.zeros(4, dtype=torch.float32, device=self.device)
        self._val_nll_weight = 0.0

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        out, chosen, rejected = self.pair_losses(batch, "val")
        pairs = out.pair_losses.numel()
        self._val_sums += torch.stack([out.pair_losses.sum().float(), torch.tensor(float(pairs), device=self.device),
                                       -chosen.sums.sum().float(), chosen.tokens.sum().float()])
        for name, value in preference_metrics(out, chosen, rejected).items():
            self.log(f"val_{name}", value, batch_size=pairs, sync_dist=True)
        self._val_nll_weight = out.nll_weight

    def on_validation_epoch_end(self) -> None:
        sums = self.trainer.strategy.reduce(self._val_sums, reduce_op="sum")
        loss = sums[0] / sums[1].clamp(min=1) + self._val_nll_weight * sums[2] / sums[3].clamp(min=1)
        self.log("val_loss", loss, prog_bar=True)

    def adapter_base_record(self) -> dict[str, Any]:
        record = super().adapter_base_record()  # a quantized base says so: merge and reload quantize it again
        return record if self.quantization is None else {**record, "quantization": asdict(self.quantization)}

    # -- checkpoints: what trains, never the reference ---------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        keep_trainable(self, checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        check_trainable_kept(self, checkpoint)
        self._restored = True


class DPOCLI(RecipeCLI):
    """The recipes' CLI; a relative ``model.reference.name_or_path`` in a config file is found from it."""

    model_path_keys = (*RecipeCLI.model_path_keys, "model.reference.name_or_path")


def main(args: list[str] | None = None) -> DPOCLI | Path:
    # A loaded reference copy is frozen in eval mode by design: Lightning's notice about it is noise.
    warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode at the start of training")
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] == ["merge"]:  # not Trainer subcommands: dispatched before LightningCLI sees argv
        return merge_main(argv[1:], prog="python -m recipes.dpo merge")
    if argv[:1] == ["export"]:
        return export_main(DPOCLI, DPOModule, PreferenceDataModule, argv[1:])
    return DPOCLI(DPOModule, PreferenceDataModule, args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    run_command(main)
