"""Write a trained model in Hugging Face format, whatever strategy trained it."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from lightning_mem.checkpointing import (
    CHECKPOINT_METADATA,
    check_complete,
    saved_module_keys,
    staged_directory,
    trainable_names,
)
from lightning_mem.settings import SettingError, SettingPathError


@runtime_checkable
class GathersStateDict(Protocol):
    """A strategy whose modules' weights are spread over ranks (FSDP2 shards, ZeRO-3 partitions)
    gathers them itself; every other strategy's modules are whole on every rank."""

    def full_state_dict(self, module: torch.nn.Module, *, trainable_only: bool = False) -> dict[str, Tensor]:
        """``module``'s whole state dict on the host on rank 0, ``{}`` elsewhere; every rank calls it."""
        ...


def full_state_dict(module: torch.nn.Module, *, trainable_only: bool = False) -> dict[str, Tensor]:
    """The whole, unsharded state dict of ``module`` (plain or FSDP2-sharded), on rank 0 on the host.

    A collective when a process group exists: every rank must call it. Rank 0 gets plain CPU
    tensors under the module's own keys (so ``module.save_pretrained(path, state_dict=sd)``
    writes a normal HF checkpoint); the other ranks get ``{}``. One tensor is gathered at a time,
    so rank 0 needs host memory for the result, not device memory for the model.

    ``trainable_only``: the trainable parameters only (for LoRA the adapters and
    ``modules_to_save``); the frozen base is never gathered or copied.
    """
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return local_state_dict(module, trainable_only=trainable_only)  # no process group: nothing is sharded
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # cpu_offload=True: each tensor is gathered on the device, then moved to the host, and
    # only rank 0 keeps it.
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    state = get_model_state_dict(module, options=options)
    if trainable_only:  # the gathered dict keeps buffers too
        trainable = trainable_names(module)
        state = {name: t for name, t in state.items() if name in trainable}
    return state


def local_state_dict(module: torch.nn.Module, *, trainable_only: bool = False) -> dict[str, Tensor]:
    """``module``'s own tensors copied to the host, when they are whole on this rank (not sharded);
    ``trainable_only``: its trainable parameters only, the rest is not copied."""
    trainable = trainable_names(module) if trainable_only else None
    return {name: t.detach().cpu() for name, t in module.state_dict().items() if trainable is None or name in trainable}


def gather_state_dict(trainer: Any, model: torch.nn.Module, *, trainable_only: bool = False) -> dict[str, Tensor] | None:
    """``model``'s whole state dict on the host on rank 0 (None on other ranks), whatever strategy
    trained it: a :class:`GathersStateDict` strategy gathers its shards (a collective), any other
    strategy's module is whole already. ``trainable_only`` as in :func:`full_state_dict`."""
    strategy = trainer.strategy
    gather = strategy.full_state_dict if isinstance(strategy, GathersStateDict) else full_state_dict
    state = gather(model, trainable_only=trainable_only)
    return state if trainer.is_global_zero else None


def export_hf(trainer: Any, model: torch.nn.Module, tokenizer: Any, out_dir: str | Path) -> None:
    """Save ``model`` (a ``PreTrainedModel``, or a peft model: adapters only) and the tokenizer to ``out_dir``."""
    state = gather_state_dict(trainer, model)
    if state is not None:
        # Written beside out_dir and renamed into place: a failed export leaves the previous one
        # (or nothing), never a folder with a config and no weights.
        with staged_directory(out_dir) as out:
            model.save_pretrained(out, state_dict=state, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(out)
    trainer.strategy.barrier("export_hf")


# -- export from a training checkpoint ------------------------------------------------------------


def load_checkpoint_weights(module: torch.nn.Module, ckpt_path: str | Path) -> dict[str, Any]:
    """Load a Lightning training checkpoint's weights into ``module``, in one process on the host.

    Works for a single file (``last.ckpt`` of a single-process or DeepSpeed-consolidated run) and
    for a sharded folder (``FSDP2Strategy``/``ModelParallelStrategy``: one ``.distcp`` shard per
    rank): torch's distributed checkpoint reader reassembles the shards into whole tensors without
    any process group. Keys the checkpoint leaves out on purpose (a recipe's frozen models) are
    kept as the module loaded them; a key of the checkpoint the module lacks is an error (the
    config does not match the run). Returns the checkpoint's other entries (``global_step``...).
    """
    path = Path(ckpt_path)
    if not path.exists():
        raise SettingPathError("--ckpt_path", f": {str(ckpt_path)!r} does not exist")
    own = module.state_dict()
    if path.is_dir():
        import warnings

        import torch.distributed.checkpoint as dcp

        if not (path / ".metadata").is_file():
            raise SettingError(
                "--ckpt_path",
                f": {path} is a folder but not a sharded (torch distributed) checkpoint; for a DeepSpeed"
                " folder, convert it first with lightning.pytorch.utilities.deepspeed.convert_zero_checkpoint_to_fp32_state_dict"
            )
        check_complete(path)
        reader = dcp.FileSystemReader(str(path))
        saved = saved_module_keys(path)
        _check_keys(saved, own, module, path)
        state = {k: v for k, v in own.items() if k in saved}
        with warnings.catch_warnings():
            # One process on purpose: the reader reassembles every rank's shard.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"state_dict": state}, storage_reader=reader)
        meta = torch.load(path / CHECKPOINT_METADATA, map_location="cpu", weights_only=False)
    else:
        meta = torch.load(path, map_location="cpu", weights_only=False)
        if not isinstance(meta, dict) or "state_dict" not in meta:
            raise SettingError("--ckpt_path", f": {path} is not a Lightning checkpoint (no `state_dict`)")
        state = meta.pop("state_dict")
        _check_keys(set(state), own, module, path)
    module.load_state_dict(state, strict=False)
    hook = getattr(module, "on_load_checkpoint", None)
    if callable(hook):
        hook({**meta, "state_dict": state})
    return meta


def _check_keys(saved: set[str], own: dict[str, Any], module: torch.nn.Module, path: Path) -> None:
    unknown = sorted(saved - set(own))
    if unknown:
        raise ValueError(
            f"{path} holds {len(unknown)} tensors this model does not have (e.g. {unknown[:3]}): export with the"
            " config the run was trained with"
        )
    missing = sorted(set(own) - saved)
    if missing and getattr(module, "strict_loading", True):
        raise ValueError(f"{path} lacks {len(missing)} of the model's tensors (e.g. {missing[:3]})")


def export_main(cli_class: Any, model_class: Any, datamodule_class: Any, argv: list[str]) -> Path:
    """``python -m recipes.<recipe> export --config RUN.yaml --ckpt_path CKPT [--out DIR] [overrides]``.

    Builds the recipe's module from the run's config in one CPU process, loads the checkpoint's
    weights (single file or FSDP2 shards) and writes what the recipe writes at the end of fit
    (an HF model, or an adapter) to ``--out`` (default: the run's ``export_dir``).
    """
    ckpt_path, rest = _pop_option(argv, "--ckpt_path")
    out, rest = _pop_option(rest, "--out")
    if ckpt_path is None:
        raise SystemExit("export: --ckpt_path is required (a last.ckpt file or a sharded checkpoint folder)")
    # One process on the host, whatever the run used: the shards are reassembled on load.
    overrides = ["--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.num_nodes=1", "--trainer.strategy=auto",
                 "--trainer.logger=false"]
    cli = cli_class(model_class, datamodule_class, args=[*rest, *overrides], run=False, save_config_callback=None)
    module, trainer = cli.model, cli.trainer
    module.trainer = trainer  # the recipe's export reads the run folder and the strategy from it
    module.configure_model()
    meta = load_checkpoint_weights(module, ckpt_path)
    target = Path(out) if out else Path(trainer.default_root_dir) / (module.hparams.get("export_dir") or "export")
    module.export(target)
    print(f"exported {ckpt_path} (step {meta.get('global_step', '?')}) to {target}")
    return target


def _pop_option(argv: list[str], name: str) -> tuple[str | None, list[str]]:
    rest, value, i = [], None, 0
    while i < len(argv):
        if argv[i] == name and i + 1 < len(argv):
            value, i = argv[i + 1], i + 2
            continue
        if argv[i].startswith(name + "="):
            value = argv[i].split("=", 1)[1]
        else:
            rest.append(argv[i])
        i += 1
    return value, rest
