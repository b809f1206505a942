"""Write a trained model in Hugging Face format, whatever strategy trained it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightning_mem.checkpointing import staged_directory


def gather_full_state_dict(trainer: Any, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The model's full (unsharded) state dict on CPU on rank 0, None on other ranks.

    A strategy that shards parameters provides ``full_state_dict(module)`` (a collective: every
    rank must call it); otherwise the module's own tensors are complete on every rank.
    """
    strategy = trainer.strategy
    if hasattr(strategy, "full_state_dict"):
        state = strategy.full_state_dict(model)
    else:
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return state if trainer.is_global_zero else None


def export_hf(trainer: Any, model: torch.nn.Module, tokenizer: Any, out_dir: str | Path) -> None:
    """Save ``model`` (a ``PreTrainedModel``, or a peft model: adapters only) and the tokenizer to ``out_dir``."""
    state = gather_full_state_dict(trainer, model)
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
        raise FileNotFoundError(f"`--ckpt_path`: {str(ckpt_path)!r} does not exist")
    own = module.state_dict()
    if path.is_dir():
        import warnings

        import torch.distributed.checkpoint as dcp
        from lightning_mem.strategies.fsdp2 import CHECKPOINT_METADATA, FSDP2Strategy

        if not (path / ".metadata").is_file():
            raise ValueError(
                f"`--ckpt_path`: {path} is a folder but not a sharded (torch distributed) checkpoint; for a DeepSpeed"
                " folder, convert it first with lightning.pytorch.utilities.deepspeed.convert_zero_checkpoint_to_fp32_state_dict"
            )
        FSDP2Strategy.check_complete(path)
        reader = dcp.FileSystemReader(str(path))
        saved = {k.removeprefix("state_dict.") for k in reader.read_metadata().state_dict_metadata if k.startswith("state_dict.")}
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
            raise ValueError(f"`--ckpt_path`: {path} is not a Lightning checkpoint (no `state_dict`)")
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
