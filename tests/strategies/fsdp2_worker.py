"""Runs one FSDP2Strategy training scenario and writes what each rank measured.

Usage: python tests/strategies/fsdp2_worker.py SPEC.json

Lightning's launcher re-executes this script once per extra rank, so the tests run it in
a subprocess instead of inside pytest. Each rank writes ``<out>/rank<r>.json``; rank 0
also writes the HF export when the spec asks for one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.distributed._composable.contract import _get_registry
from torch.distributed.tensor import DTensor

import fsdp2_scenarios as sc
from lightning_mem.callbacks import TrainingDtypes
from lightning_mem.strategies import FSDP2Strategy

SCENARIOS = {
    "policy_ref_value": sc.PolicyRefValue,
    "lora_meta_reward": sc.LoraWithMetaReward,
    "policy_only": sc.PolicyOnly,
    "bf16_checkpoint": sc.Bf16Checkpoint,
}


class PeakDeviceMemory(Callback):
    """Peak allocated CUDA memory over the training steps only (setup excluded)."""

    def on_train_start(self, trainer, pl_module):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    def on_train_end(self, trainer, pl_module):
        torch.cuda.synchronize()
        self.peak = torch.cuda.max_memory_allocated()


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _nbytes(tensor: torch.Tensor) -> int:
    local = local_tensor(tensor)
    return local.numel() * local.element_size()


def _registry(module: nn.Module) -> list[str]:
    return sorted(_get_registry(module) or {})


def _blocks(model: nn.Module) -> list[nn.Module]:
    inner = model.base_model.model if hasattr(model, "peft_config") else model
    return list(inner.model.layers)


def measure_model(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    params = list(model.parameters())
    state_bytes = step_bytes = entries = 0
    for param in params:
        state = optimizer.state.get(param, {})
        entries += bool(state)
        for key, value in state.items():
            if key == "step":
                step_bytes += _nbytes(value)
            else:
                state_bytes += _nbytes(value)
    trainable = [p for p in params if p.requires_grad]
    states = [v for p in trainable for k, v in optimizer.state.get(p, {}).items() if k != "step"]
    return {
        "trainable_dtypes": sorted({str(local_tensor(p).dtype) for p in trainable}),
        "frozen_dtypes": sorted({str(local_tensor(p).dtype) for p in params if not p.requires_grad}),
        "optim_state_dtypes": sorted({str(local_tensor(v).dtype) for v in states}),
        "local_param_bytes": sum(_nbytes(p) for p in params),
        "full_param_bytes": sum(p.numel() * p.element_size() for p in params),
        "full_trainable_bytes": sum(p.numel() * p.element_size() for p in trainable),
        "num_trainable": len(trainable),
        "all_dtensor": all(isinstance(p, DTensor) for p in params),
        "param_dtypes": sorted({str(p.dtype) for p in params}),
        "param_devices": sorted({str(local_tensor(p).device) for p in params}),
        "buffer_devices": sorted({str(b.device) for b in model.buffers()}),
        "local_optim_state_bytes": state_bytes,
        "optim_step_bytes": step_bytes,
        "optim_entries": entries,
        "root_apis": _registry(model),
    }


def measure(trainer: pl.Trainer, module: pl.LightningModule) -> dict:
    optimizer = trainer.optimizers[0]
    report = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "losses": module.losses,
        "models": {},
        "optim_state_devices": sorted(
            {str(local_tensor(v).device) for s in optimizer.state.values() for k, v in s.items() if k != "step"}
        ),
    }
    for name in ("policy", "ref", "value_head", "reward", "reward_head", "lora_policy"):
        if hasattr(module, name):
            model = getattr(module, name)
            report["models"][name] = measure_model(model, optimizer)
            if name not in ("value_head", "reward_head"):
                report["models"][name]["block_apis"] = [_registry(b) for b in _blocks(model)]
    return report


def meta_reward_checks(module: sc.LoraWithMetaReward, strategy: FSDP2Strategy) -> dict:
    """What the strategy's materialization gave the meta-created reward model (rank 0)."""
    # Collectives: every rank gathers, only rank 0 receives.
    full = strategy.full_state_dict(module.reward)
    head = strategy.full_state_dict(module.reward_head).get("weight")
    if not full:
        return {}
    fresh = sc.tiny_llama(seed=4, pad_token_id=0)
    q_proj = full["model.layers.0.self_attn.q_proj.weight"]
    return {
        "norms_are_one": all(bool((v == 1).all()) for k, v in full.items() if k.endswith("norm.weight")),
        "pad_row_max_abs": full["model.embed_tokens.weight"][0].abs().max().item(),
        "q_proj_std": q_proj.std().item(),
        "all_finite": all(bool(v.isfinite().all()) for v in full.values()),
        "inv_freq_matches": torch.equal(module.reward.model.rotary_emb.inv_freq.cpu(), fresh.model.rotary_emb.inv_freq),
        "keys_match": sorted(full) == sorted(fresh.state_dict()),
        # nn.Linear.reset_parameters draws from U(-1/sqrt(in), 1/sqrt(in)).
        "head_max_abs": head.abs().max().item(),
        "head_std": head.std().item(),
    }


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(spec["out"])
    module = SCENARIOS[spec["scenario"]](**spec.get("scenario_args", {}))
    strategy = FSDP2Strategy(**spec.get("strategy", {}))
    callbacks: list[Callback] = []
    if spec.get("checkpoint_dir"):
        callbacks.append(
            ModelCheckpoint(
                dirpath=spec["checkpoint_dir"],
                filename="{epoch}",
                save_top_k=-1,
                every_n_epochs=1,
                save_on_train_epoch_end=True,
            )
        )
    dtypes = TrainingDtypes() if spec.get("report_dtypes") else None
    if dtypes:
        callbacks.append(dtypes)
    peak = PeakDeviceMemory() if spec.get("measure_peak") else None
    if peak:
        callbacks.append(peak)
    devices = spec.get("devices", 2)
    trainer = pl.Trainer(
        accelerator=spec.get("accelerator", "cpu"),
        devices=devices,
        strategy=strategy,
        precision=spec.get("precision", "32-true"),
        max_epochs=spec.get("epochs", 2),
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=bool(spec.get("checkpoint_dir")),
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, train_dataloaders=sc.train_loader(sc.GLOBAL_BATCH // devices), ckpt_path=spec.get("ckpt_path"))

    report = measure(trainer, module)
    if peak:
        report["peak_allocated"] = peak.peak
    if dtypes:
        report["dtype_report"] = {"line": dtypes.report.line(), "compute": sorted(str(d) for d in dtypes.report.compute)}
    if spec["scenario"] == "bf16_checkpoint":
        report["forward_weight_dtypes"] = {k: sorted(v) for k, v in module.forward_weight_dtypes.items()}
    if spec["scenario"] == "lora_meta_reward":
        report["forward_weight_dtypes"] = sorted(module.forward_weight_dtypes)
        report["reward_scores_finite"] = all(torch.isfinite(torch.tensor(module.reward_scores)).tolist())
        report["meta_reward"] = meta_reward_checks(module, strategy)
    if spec.get("export_dir"):
        # The SFT recipe's export, as it must run under FSDP2: gather on every rank, write on rank 0.
        trainable_only = spec.get("export_trainable_only", False)
        state_dict = strategy.full_state_dict(module.policy, trainable_only=trainable_only)
        if trainer.is_global_zero:
            # Counted first: save_pretrained empties the dict as it writes.
            report["export_keys"] = len(state_dict)
            module.policy.save_pretrained(spec["export_dir"], state_dict=state_dict)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
