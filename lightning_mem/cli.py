"""The LightningCLI shared by the recipes.

- a ``checkpoint`` section whose folder follows the run's root: ``checkpoint.dirpath`` is derived
  from ``trainer.default_root_dir`` so that moving a run (one override on the command line) moves
  its checkpoints too, and ``--ckpt_path last`` finds them;
- the default logger is a CSVLogger under ``trainer.default_root_dir`` (``<root>/logs/version_N``),
  whatever else is installed (Lightning's own default switches to TensorBoard when it is);
- the resolved config (``config.yaml``) goes to the logger's run folder
  (:func:`lightning_mem.run_dir.run_dir`), and every setting reaches the logger as a hyperparameter;
- relative input paths in a config file (data files, model folders) are found from the config
  file, not from wherever the command runs (:func:`resolve_input_path`);
- ``--ckpt_path`` naming an empty or non-checkpoint file fails before any model is loaded;
- at the command line (:func:`run_command`), a user's mistake -- a setting, a path, a data line --
  prints one line and exits with status 2, as the parser's own errors do; a bug keeps its
  traceback, and ``LIGHTNING_MEM_DEBUG=1`` shows the traceback of either;
- ``fit --auto_fit true`` estimates the run first and applies the cheapest suggestion that fits the
  device (``--device_memory``, else the CUDA device's), before any model is loaded
  (:mod:`lightning_mem.auto_fit`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import types
import typing
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import yaml
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar, TQDMProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import Logger
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_mem.allocator import (
    allocator_advice,
    apply_expandable_segments,
    expandable_segments_decision,
    host_offloads,
)
from lightning_mem.callbacks.progress import StepProgressBar, StepRichProgressBar
from lightning_mem.checkpointing import AtomicCheckpointIO, ResumeCheck, find_last_checkpoint
from lightning_mem.data.rows import DataFormatError
from lightning_mem.quiet import silence_unactionable_warnings
from lightning_mem.run_dir import run_dir
from lightning_mem.settings import SettingError, SettingPathError, settings_at, user_error_in

# Before a recipe imports bitsandbytes (it logs at import): recipes import this module first.
silence_unactionable_warnings()


def _checkpoint_dir(default_root_dir: str | None) -> str:
    return f"{default_root_dir or '.'}/checkpoints"


# ---------------------------------------------------------------------------------------------
# Relative paths in config files
# ---------------------------------------------------------------------------------------------


def project_root(start: Path) -> Path | None:
    """The nearest folder at or above ``start`` that holds ``pyproject.toml`` or ``.git``."""
    for folder in (start, *start.parents):
        if (folder / "pyproject.toml").is_file() or (folder / ".git").exists():
            return folder
    return None


def search_dirs(config_files: list[Path]) -> list[Path]:
    """Where a relative input path is looked for, in order: each config file's folder (the last
    file given first), the project root above it, then the current directory."""
    dirs: list[Path] = []
    for config in reversed(config_files):
        folder = config.resolve().parent
        dirs += [folder] + ([root] if (root := project_root(folder)) else [])
    dirs.append(Path.cwd())
    return list(dict.fromkeys(dirs))  # in order, without repeats


def _looks_like_hub_id(value: str) -> bool:
    return not value.startswith((".", "/", "~")) and value.count("/") == 1


def resolve_input_path(value: str, key: str, dirs: list[Path], *, may_be_hub_id: bool = False) -> str:
    """An absolute path for a relative ``value`` found under one of ``dirs``.

    Absolute paths are returned as they are. A hub id (``org/name``, where ``may_be_hub_id``) that
    exists in none of ``dirs`` is returned as it is; any other value found nowhere is an error
    naming the key and every folder tried.
    """
    path = Path(value).expanduser()
    if path.is_absolute():
        return value
    for folder in dirs:
        if (folder / path).exists():
            return str(folder / path)
    if may_be_hub_id and _looks_like_hub_id(value):
        return value
    tried = ", ".join(str(d) for d in dirs)
    what = "model path" if may_be_hub_id else "data file"
    raise SettingPathError(key, f": {what} {value!r} does not exist; a relative path is looked for under: {tried}")


# ---------------------------------------------------------------------------------------------
# The resolved config and the hyperparameters, in the run's folder and logger
# ---------------------------------------------------------------------------------------------


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"model": {"optimizer": {"init_args": {"lr": 1e-3}}}}`` -> ``{"model.optimizer.init_args.lr": 1e-3}``;
    lists of mappings (callbacks) are numbered, other lists kept whole."""
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    if isinstance(tree, list) and any(isinstance(v, dict) for v in tree):
        out = {}
        for i, v in enumerate(tree):
            out.update(flatten(v, f"{prefix}{i}."))
        return out
    return {prefix[:-1]: tree}


class RunConfigCallback(SaveConfigCallback):
    """Write ``config.yaml`` into the logger's run folder and log every setting as a hyperparameter.

    Lightning's own callback writes to ``trainer.log_dir``, which for MLflow and W&B is a folder
    shared by all runs; and a LightningModule's ``save_hyperparameters`` reaches the logger with
    the module's arguments only. Here the logger gets the whole resolved config, flattened to
    dotted keys (``data.max_length``, ``model.optimizer.init_args.lr``, ``trainer.max_steps``, ...).
    """

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.already_saved:
            return
        folder = run_dir(trainer)  # collective: every rank calls it
        path = folder / self.config_filename
        if not self.overwrite and trainer.strategy.broadcast(trainer.is_global_zero and path.is_file()):
            raise RuntimeError(f"{path} exists: a previous run's config would be overwritten")
        if trainer.is_global_zero:
            folder.mkdir(parents=True, exist_ok=True)
            self.parser.save(self.config, str(path), skip_none=False, overwrite=True, multifile=self.multifile)
            self.save_config(trainer, pl_module, stage)
            self.already_saved = True
        self.already_saved = trainer.strategy.broadcast(self.already_saved)

    def save_config(self, trainer: Any, pl_module: Any, stage: str) -> None:
        hparams = self.hyperparameters()
        for logger in trainer.loggers:
            if isinstance(logger, Logger):
                logger.log_hyperparams(hparams)

    def hyperparameters(self) -> dict[str, Any]:
        """The resolved config as flat ``section.key`` hyperparameters (the config files' paths left out)."""
        tree = yaml.safe_load(self.parser.dump(self.config, skip_none=False, skip_validation=True)) or {}
        tree.pop("config", None)
        return flatten(tree)


# ---------------------------------------------------------------------------------------------
# --ckpt_path
# ---------------------------------------------------------------------------------------------


def check_checkpoint_path(ckpt_path: str | None) -> None:
    """Fail, naming the file, when ``--ckpt_path`` is a missing, empty or non-checkpoint file.

    Keywords (``last``, ``best``, ``hpc``, ``registry...``) are left to Lightning; a folder (a
    sharded FSDP2 or DeepSpeed checkpoint) must not be empty.
    """
    if ckpt_path is None or ckpt_path in ("last", "best", "hpc") or str(ckpt_path).startswith("registry"):
        return
    path = Path(ckpt_path).expanduser()
    if "://" in str(ckpt_path):
        return  # a remote URL: fsspec reads it
    if not path.exists():
        raise SettingPathError("ckpt_path", f": {str(ckpt_path)!r} does not exist (relative to {Path.cwd()})")
    if path.is_dir():
        if not any(path.iterdir()):
            raise SettingError("ckpt_path", f": {str(ckpt_path)!r} is an empty folder, not a checkpoint")
        return
    if path.stat().st_size == 0:
        raise SettingError(
            "ckpt_path", f": {str(ckpt_path)!r} is empty (0 bytes); it is not a checkpoint (a run killed while writing it?)"
        )
    if not zipfile.is_zipfile(path):
        raise SettingError(
            "ckpt_path",
            f": {str(ckpt_path)!r} is not a PyTorch checkpoint (torch.save writes a zip archive; this"
            " file is not one: truncated, or another kind of file)",
        )


# ---------------------------------------------------------------------------------------------
# The CLI
# ---------------------------------------------------------------------------------------------


class RecipeCLI(LightningCLI):
    """LightningCLI with a ``checkpoint`` section (ModelCheckpoint) and the tokenizer linked to the model.

    Only the subcommands a recipe supports are offered (``fit``, and ``validate`` where the module
    has a validation step), and no top-level ``--optimizer``/``--lr_scheduler``: the recipes take
    theirs as ``model.optimizer``/``model.lr_scheduler``.
    """

    #: Recipes whose datamodule loads a tokenizer link it to the model's path.
    link_tokenizer = True

    #: Keys holding input paths: relative values in a config file are looked for from the config
    #: file (see :func:`search_dirs`). Outputs (``trainer.default_root_dir``, ``export_dir``) stay
    #: relative to the current directory, as in any Lightning run.
    input_path_keys = ("data.train_file", "data.val_file")
    #: The same for keys that may also hold a hub id (``org/name``).
    model_path_keys = ("model.name_or_path", "data.tokenizer", "model.reward_model.name_or_path",
                       "model.critic.name_or_path")

    def __init__(self, *args: Any, save_config_callback: Any = RunConfigCallback, **kwargs: Any) -> None:
        # LightningCLI's own --optimizer would build an optimizer over the module's parameters
        # before configure_model has created any (an empty parameter list).
        kwargs.setdefault("auto_configure_optimizers", False)
        silence_unactionable_warnings()
        super().__init__(*args, save_config_callback=save_config_callback, **kwargs)

    def subcommands(self) -> dict[str, set[str]]:  # type: ignore[override]
        # No recipe has a test_step or predict_step: those subcommands could only crash.
        commands = {"fit": {"model", "train_dataloaders", "val_dataloaders", "datamodule"}}
        if getattr(self._model_class, "validation_step", None) is not LightningModule.validation_step:
            commands["validate"] = {"model", "dataloaders", "datamodule"}
        return commands

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--auto_fit", type=bool, default=False,
                            help="fit: estimate the run before any model loads and, if it does not fit the device,"
                                 " apply the cheapest suggestion that does (logged, and in config.yaml as auto_fit_applied)")
        parser.add_argument("--device_memory", type=Optional[str], default=None,
                            help="the memory auto_fit fits one device's share into (24GiB, 80GB, bytes); default: the"
                                 " CUDA device's total memory")
        parser.add_argument("--auto_fit_applied", type=Optional[str], default=None,
                            help="written by auto_fit: what it changed and why (leave it unset)")
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults({"checkpoint.save_last": True, "checkpoint.save_top_k": 0})
        parser.link_arguments("trainer.default_root_dir", "checkpoint.dirpath", compute_fn=_checkpoint_dir)
        if self.link_tokenizer:
            parser.link_arguments("model.name_or_path", "data.tokenizer")

    def before_instantiate_classes(self) -> None:
        super().before_instantiate_classes()
        if self.subcommand == "fit" and self.config["fit"].get("auto_fit"):
            self._auto_fit()
        config = self.config[self.subcommand] if self.subcommand else self.config
        self._resolve_input_paths(config)
        self._default_logger(config)
        check_numbers(config)
        check_setting_groups(self.model_class, config.get("model"), "model")
        _set_device_allocator(config)
        if self.subcommand == "fit":
            self._checkpoint_within_budget(config)
        if self.datamodule_class is not None and _is_plain_section(config.get("data")):
            # Built once here, cheaply (a datamodule reads its data in setup): a rule relating its
            # arguments (train_file or dataset) fails now, named data.<argument>.
            with settings_at("data"):
                self.datamodule_class(**config.data.as_dict())

    def instantiate_classes(self) -> None:
        # jsonargparse re-raises a constructor's error (a callback's, a strategy's, a reward's) inside
        # its own "Does not validate against any of the Union subtypes", which lists every subtype's
        # message but is raised from the first subtype's error only (a strategy's first is `str`).
        # Every class but the module and datamodule (Lightning's own instantiators, registered
        # first) is built through _build, which remembers a user error on its way out; one whose
        # message the final error reports is raised as it is, to print as one line.
        self._constructor_errors: list[BaseException] = []
        self.parser.add_instantiator(self._build, object, subclasses=True)
        try:
            super().instantiate_classes()
        except Exception as err:
            user_error = user_error_in(err, USER_ERRORS) or next(
                (e for e in reversed(self._constructor_errors) if str(e) in str(err)), None)
            if user_error is None:
                raise
            raise user_error from None
        if self.datamodule is not None and hasattr(self.datamodule, "config_key"):
            self.datamodule.config_key = "data"  # errors while reading the data name data.<argument>

    def _build(self, class_type: type, *args: Any, **kwargs: Any) -> Any:
        try:
            return class_type(*args, **kwargs)
        except USER_ERRORS as err:
            self._constructor_errors.append(err)
            raise

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        self._args = args  # auto_fit estimates the run from its own command line
        super().parse_arguments(parser, args)
        # Checked here: LightningCLI reads the checkpoint's hyperparameters right after parsing,
        # and torch.load's errors name neither the file nor the option.
        subcommand = self.config.get("subcommand")
        if subcommand:
            check_checkpoint_path(self.config[subcommand].get("ckpt_path"))

    def _auto_fit(self) -> None:
        """Estimate this run (a subprocess) and, when it does not fit, parse the command line again
        with the cheapest fitting suggestion's overrides added: the run, its logs and its
        config.yaml are then the suggested run's."""
        from lightning_mem import auto_fit

        args = sys.argv[1:] if self._args is None else self._args
        if not isinstance(args, (list, tuple)):
            raise SettingError("auto_fit", "`auto_fit: true` needs the run's command line (a list of arguments)")
        config, overrides = auto_fit.split_command_line(list(args))
        device_bytes, budget_from = auto_fit.device_budget(self.config["fit"].get("device_memory"))
        result = auto_fit.estimate_with_suggestions(config, overrides, device_bytes, _recipe_module(self.model_class))
        chosen = auto_fit.choose(result)
        line = auto_fit.describe(result, chosen, budget_from)
        rank_zero_info(f"auto_fit: {line}")
        extra = [*chosen["overrides"]] if chosen is not None else []
        self.parse_arguments(self.parser, [*args, *extra, f"--auto_fit_applied={line}"])

    def _checkpoint_within_budget(self, config: Any) -> None:
        """An ``ActivationCheckpointing`` callback with a ``budget`` and no ``blocks`` gets the fewest
        blocks whose estimated device peak fits: the run is estimated (on fake tensors, before any
        model loads) with its callback list as configured, that callback set to n blocks."""
        callbacks = config.trainer.get("callbacks") or []
        if not isinstance(callbacks, (list, tuple)):  # one callback given on its own is not a list
            callbacks = [callbacks]
        entries = [c for c in callbacks if isinstance(c, dict) or hasattr(c, "class_path")]
        for index, entry in enumerate(entries):
            if not str(_get(entry, "class_path")).endswith("ActivationCheckpointing"):
                continue
            budget, blocks = _get(entry, "init_args.budget"), _get(entry, "init_args.blocks")
            if budget is None or blocks is not None:
                continue
            key = f"trainer.callbacks[{index}].init_args.budget"
            from lightning_mem import auto_fit
            from lightning_mem.activation_checkpointing import fewest_blocks_within
            from lightning_mem.estimate import estimate
            from lightning_mem.estimate.report import parse_size

            budget_bytes = parse_size(str(budget), key=key)
            args = sys.argv[1:] if self._args is None else self._args
            config_file, overrides = auto_fit.split_command_line(list(args))

            def peak_of(n: int) -> int:
                listed = [_callback_as_dict(c) for c in callbacks]
                listed[index]["init_args"].update(budget=None, blocks=n)
                return estimate(config_file, [*overrides, f"--trainer.callbacks={json.dumps(listed)}"]).device_peak_bytes

            num_blocks = _num_blocks(_get(config, "model.name_or_path"))
            try:
                chosen, peaks = fewest_blocks_within(budget_bytes, peak_of, num_blocks)
            except ValueError as err:
                raise SettingError(key, f" ({budget}): {err}") from None
            entry.init_args.blocks = chosen
            rank_zero_info(
                f"ActivationCheckpointing budget {budget}: {chosen} of {num_blocks} blocks checkpointed (estimated"
                f" peak {peaks[chosen] / 2**30:.2f} GiB; none: {peaks[0] / 2**30:.2f} GiB)")

    def _resolve_input_paths(self, config: Any) -> None:
        files = [Path(p.absolute if hasattr(p, "absolute") else p) for p in (config.get("config") or [])]
        if not files:
            return  # all from the command line: relative to the current directory, as a shell user expects
        dirs = search_dirs(files)
        for key in (*self.input_path_keys, *self.model_path_keys):
            value = _get(config, key)
            if isinstance(value, str) and value:
                config[key] = resolve_input_path(value, key, dirs, may_be_hub_id=key in self.model_path_keys)
            elif isinstance(value, list):  # several models (a reward-model ensemble): each member alike
                config[key] = [resolve_input_path(v, f"{key}[{i}]", dirs, may_be_hub_id=key in self.model_path_keys)
                               if isinstance(v, str) and v else v for i, v in enumerate(value)]

    @staticmethod
    def _default_logger(config: Any) -> None:
        # Lightning's default (logger=None/True) is TensorBoard when tensorboard is importable and CSV
        # otherwise: the run's files would move with what happens to be installed.
        if config.trainer.get("logger") in (None, True):
            root = config.trainer.get("default_root_dir") or "."
            config.trainer.logger = {
                "class_path": "lightning.pytorch.loggers.CSVLogger",
                "init_args": {"save_dir": root, "name": "logs"},
            }

    def before_fit(self) -> None:
        config = self.config_init["fit"]
        if config.get("ckpt_path") == "last":
            dirpath = getattr(self.trainer.checkpoint_callback, "dirpath", None) or _checkpoint_dir(
                self.trainer.default_root_dir
            )
            if find_last_checkpoint(dirpath) is None:
                # Lightning would warn too, in three lines that do not say where it looked.
                rank_zero_warn(f"--ckpt_path last: no last*.ckpt in {Path(dirpath).resolve()}; training starts from scratch")
                config["ckpt_path"] = None
        strategy = self.trainer.strategy
        if type(strategy.checkpoint_io) is TorchCheckpointIO:
            # A crash while writing last.ckpt must leave the previous one, not a truncated file.
            strategy.checkpoint_io = AtomicCheckpointIO()
        if config.get("ckpt_path"):
            keys = getattr(self.model, "optimizer_config_keys", ("model.optimizer",))
            self.trainer.callbacks.append(ResumeCheck(keys))
        _count_steps_in_progress_bar(self.trainer)
        advice = allocator_advice(host_offloads(self.trainer, self.model))
        if advice:
            rank_zero_warn(advice)


def _callback_as_dict(entry: Any) -> dict[str, Any]:
    """A parsed callback entry as plain data, to pass back on an estimate's command line."""
    data = entry.as_dict() if hasattr(entry, "as_dict") else dict(entry)
    data.setdefault("init_args", {})
    return data


def _num_blocks(name_or_path: Any) -> int:
    """The decoder blocks of the configured model, read from its config.json (no weights)."""
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(str(name_or_path)).num_hidden_layers)


def _set_device_allocator(config: Any) -> None:
    """Turn on CUDA's expandable segments before anything touches CUDA, unless the user set
    ``PYTORCH_CUDA_ALLOC_CONF`` or a vLLM engine sleeps between rollouts (its own allocator)."""
    import torch

    vllm_sleep = _get(config, "model.rollout_engine.name") == "vllm" and (
        _get(config, "model.rollout_engine.sleep_level") or 0) > 0
    decision = expandable_segments_decision(vllm_sleep=vllm_sleep, cuda=torch.cuda.is_available())
    apply_expandable_segments(decision)


def _recipe_module(model_class: type) -> str:
    """The importable module of a recipe's LightningModule (``recipes.sft``, also when it runs as
    ``python -m recipes.sft``, where the class's module is ``__main__``)."""
    name = model_class.__module__
    if name == "__main__":
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        name = spec.name if spec is not None else name
    return name


def _count_steps_in_progress_bar(trainer: Any) -> None:
    # Lightning's default bars restart every epoch and have no total for a max_steps run (the rich
    # one shows "Epoch 4/-2"); a bar the user configured is left alone.
    for i, callback in enumerate(trainer.callbacks):
        if type(callback) is TQDMProgressBar:
            trainer.callbacks[i] = StepProgressBar(
                refresh_rate=callback.refresh_rate, process_position=callback.process_position, leave=callback._leave
            )
        elif type(callback) is RichProgressBar:
            trainer.callbacks[i] = StepRichProgressBar(
                refresh_rate=callback.refresh_rate, leave=callback._leave, theme=callback.theme,
                console_kwargs=callback._console_kwargs,
            )


def check_numbers(config: Any) -> None:
    """Fail on settings that would only fail deep inside torch or Lightning, naming the key.

    The trainer's counts (:func:`check_trainer_numbers`) and any negative or non-finite
    ``...init_args.lr`` (an optimizer's or scheduler's).
    """
    flat = config.as_dict() if hasattr(config, "as_dict") else dict(config)
    check_trainer_numbers(flat.get("trainer") or {})

    def walk(node: Any, key: str) -> None:
        if isinstance(node, dict):
            for name, value in node.items():
                walk(value, f"{key}.{name}" if key else str(name))
        elif key.endswith("init_args.lr") and isinstance(node, (int, float)) and not isinstance(node, bool):
            if node < 0 or not math.isfinite(node):
                raise SettingError(key, f" must be a finite learning rate >= 0, got {node!r}")

    walk(flat, "")


#: The trainer's integer counts and the least value each takes (the parser has checked they are
#: ints). Below it, Lightning raises from the Trainer's constructor or its loops (a traceback after
#: the model is built), or ``accumulate_grad_batches`` divides by zero later.
TRAINER_LEAST: dict[str, tuple[int, str]] = {
    "max_steps": (-1, " (-1: no limit)"),
    "max_epochs": (-1, " (-1: no limit)"),
    "min_steps": (0, ""),
    "min_epochs": (0, ""),
    "accumulate_grad_batches": (1, ""),
    "num_nodes": (1, ""),
    "check_val_every_n_epoch": (1, ""),
    "reload_dataloaders_every_n_epochs": (0, ""),
    "log_every_n_steps": (0, ""),
    "num_sanity_val_steps": (-1, " (-1: every validation batch)"),
}
#: Batch limits: a fraction in [0, 1] or a whole number of batches (Lightning's own rule).
TRAINER_BATCH_LIMITS = ("limit_train_batches", "limit_val_batches", "limit_test_batches",
                        "limit_predict_batches", "overfit_batches", "val_check_interval")


def check_trainer_numbers(trainer: dict[str, Any]) -> None:
    """Raise a :class:`SettingError` naming the first ``trainer.<key>`` whose number Lightning would
    refuse (``max_steps: -5``), so that it fails as one line before any model is built."""
    for key, (least, note) in TRAINER_LEAST.items():
        value = trainer.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise SettingError(f"trainer.{key}", f" must be an int >= {least}{note}, got {value!r}")
    for key in TRAINER_BATCH_LIMITS:
        value = trainer.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue  # None, or a time for val_check_interval ("00:00:10:00"), which Lightning parses
        if not (0 <= value <= 1 or (value > 1 and float(value).is_integer())):
            raise SettingError(f"trainer.{key}", f" must be a fraction in [0, 1] or a whole number of batches, got {value!r}")


def _dataclass_in(annotation: Any) -> type | None:
    """The dataclass in ``annotation`` (``LoraSettings``, ``LoraSettings | None``), or None."""
    options = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else (annotation,)
    return next((o for o in options if isinstance(o, type) and dataclasses.is_dataclass(o)), None)


def _build_group(group: type, values: dict[str, Any]) -> Any:
    # Nested groups first, each under its own name (memory_plan.rollout.reference).
    hints = typing.get_type_hints(group)
    for name, value in values.items():
        nested = _dataclass_in(hints.get(name))
        if nested is not None and isinstance(value, dict):
            with settings_at(name):
                values[name] = _build_group(nested, dict(value))
    return group(**values)


def check_setting_groups(component: Any, section: Any, prefix: str) -> None:
    """Build each settings group (a dataclass argument of ``component``'s constructor) from the
    parsed ``section`` once, under its key: the parser checked every field's type and range, naming
    the full key; this runs the group's own rules (those relating fields, a dtype name, a regex)
    with the same naming (``model.quantization.compute_dtype``), before any model loads. Without it
    jsonargparse reports a group's error without its key."""
    if section is None or not hasattr(section, "items"):
        return
    try:
        hints = typing.get_type_hints(component.__init__)
    except Exception:  # an annotation this process cannot resolve: the constructor checks as usual
        return
    for name, annotation in hints.items():
        group, value = _dataclass_in(annotation), _get(section, name)
        if group is not None and hasattr(value, "as_dict"):
            with settings_at(f"{prefix}.{name}"):
                _build_group(group, value.as_dict())


def _is_plain_section(section: Any) -> bool:
    # The init arguments of a fixed class; a class_path section may name any class.
    return hasattr(section, "as_dict") and "class_path" not in section


def _get(config: Any, key: str) -> Any:
    try:
        return config[key]
    except (KeyError, TypeError, AttributeError):
        return None


# ---------------------------------------------------------------------------------------------
# The command line: one line for a user's mistake, a traceback for a bug
# ---------------------------------------------------------------------------------------------

#: Errors a user causes and fixes in their config, command line or data, each of which names the
#: key, file or line: at the command line they print as one line. Anything else is a bug in this
#: code (or in a library under it) and keeps its traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (SettingError, DataFormatError)

#: Set to 1 to see the traceback of a user error too (e.g. to report where a check fired).
DEBUG_ENV = "LIGHTNING_MEM_DEBUG"


def run_command(main: Callable[[], Any]) -> Any:
    """Run a recipe's ``main()`` as the command line does (``python -m recipes.sft ...``).

    A user error (:data:`USER_ERRORS`, also one another error was raised from, as jsonargparse
    wraps a constructor's) prints ``error: <message>`` on stderr and exits with status 2, like the
    parser's own errors (a misspelled key, a value of the wrong type); with
    ``LIGHTNING_MEM_DEBUG=1`` it raises as it is. Called from Python, ``main()`` itself raises:
    only the command line turns errors into an exit status.
    """
    try:
        return main()
    except Exception as err:
        # A constructor's error reaches here wrapped by jsonargparse (a callback's, a strategy's):
        # the user error it was raised from is the report.
        user_error = user_error_in(err, USER_ERRORS)
        if user_error is None or os.environ.get(DEBUG_ENV, "").strip() not in ("", "0"):
            raise
        print(f"error: {user_error}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
