"""Parsing a config into the recipe's objects: its recipe, its models as config-only folders, its
precision plugin and technique callbacks, its world size and the tokens the estimate samples.

Nothing here runs a step: :func:`parse_config` reads a config with the recipe's own LightningCLI
parser (instantiating nothing), :func:`localize_models` points every model at a folder holding only
its ``config.json`` (a hub id resolves to ``assets/hub/<id>``), and :func:`instantiate` makes the
module, its datamodule and the trainer section's strategy, precision and callbacks.
"""

from __future__ import annotations

import importlib
import inspect
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lightning_mem.assets import ASSETS, HUB_ASSETS
from lightning_mem.settings import SettingError, SettingNotSupported, SettingPathError

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
#: The recipe module of each ``configs/<recipe>/`` folder.
RECIPES = {"sft": "recipes.sft", "qlora": "recipes.qlora", "ppo": "recipes.ppo", "reward_model": "recipes.reward_model",
           "dpo": "recipes.dpo"}


def recipe_for(config: str | Path, recipe: str | None = None) -> str:
    """The recipe module of a config: ``recipe`` if given, else from ``configs/<recipe>/``."""
    if recipe is not None:
        return RECIPES.get(recipe, recipe)
    parent = Path(config).resolve().parent.name
    if parent not in RECIPES:
        raise SettingError(
            "--recipe", f" is needed: cannot tell the recipe of --config {config} from its folder {parent!r}; pass"
            f" --recipe ({', '.join(RECIPES)} or a module path)")
    return RECIPES[parent]


def recipe_parts(module_name: str) -> tuple[Any, type, type, type]:
    """The recipe's CLI class, LightningModule class and LightningDataModule class, found in it."""
    from lightning.pytorch import LightningDataModule, LightningModule
    from lightning.pytorch.cli import LightningCLI

    try:
        mod = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is None or not module_name.startswith(err.name):
            raise  # the module exists and one of its imports is missing: its traceback is the report
        raise SettingError("--recipe", f" {module_name!r}: no such module") from None
    classes = [v for v in vars(mod).values() if inspect.isclass(v)]
    modules = [c for c in classes if issubclass(c, LightningModule) and c.__module__ == module_name]
    datas = [c for c in classes if issubclass(c, LightningDataModule)]
    if len(modules) != 1 or not datas:
        raise SettingError("--recipe", f" {module_name!r}: expected one LightningModule defined there and a datamodule,"
                                       f" found {[m.__name__ for m in modules]} and {[d.__name__ for d in datas]}")
    return mod, _cli_class(modules[0]), modules[0], datas[0]


def _cli_class(module_class: type) -> type:
    """The CLI a recipe runs under: the one defined in or imported by the module of the recipe
    class, else of its nearest parent recipe (a user's subclass in a file of its own runs under its
    parent's). Looked up, not imported: ``lightning_mem.cli`` itself calls the estimator."""
    from lightning.pytorch.cli import LightningCLI

    for cls in module_class.__mro__:
        found = [v for v in vars(importlib.import_module(cls.__module__)).values()
                 if inspect.isclass(v) and issubclass(v, LightningCLI)]
        # The most derived one (a module that imports RecipeCLI also sees LightningCLI, its base).
        found = [c for c in found if not any(o is not c and issubclass(o, c) for o in found)]
        if found:
            return found[0]
    return LightningCLI


def parse_config(recipe_module: str, args: list[str]) -> tuple[Any, Any, type]:
    """Parse ``args`` (``--config ...`` and overrides) with the recipe's own CLI; instantiate nothing."""
    _, cli_class, module_class, data_class = recipe_parts(recipe_module)

    class _ParseOnly(cli_class):  # type: ignore[misc, valid-type]
        def instantiate_classes(self) -> None:
            pass

    # The parser's usage and its tip ("run: ... --help") name this command, not its __main__.py.
    cli = _ParseOnly(module_class, data_class, args=args, run=False, save_config_callback=None,
                     parser_kwargs={"prog": "python -m lightning_mem.estimate"})
    return cli, cli.config, module_class


# ---------------------------------------------------------------------------------------------
# 2. Models from config.json only
# ---------------------------------------------------------------------------------------------


def config_folder(name_or_path: str, key: str) -> Path:
    """The folder whose config.json describes ``name_or_path`` (a local folder, or a shipped hub id)."""
    from lightning_mem.models import check_model_source

    if check_model_source(name_or_path, key=key) == "local":
        return Path(name_or_path).expanduser()
    shipped = HUB_ASSETS / name_or_path
    if (shipped / "config.json").is_file():
        return shipped
    raise SettingPathError(
        key, f": no config.json is shipped for the hub id {name_or_path!r} (looked in {shipped}); "
        "pass a local folder that holds its config.json")


def config_only_copy(name_or_path: str, key: str, workdir: Path) -> str:
    """A folder with the model's config.json (and a tokenizer) but no weights."""
    source = config_folder(name_or_path, key)
    target = workdir / key.replace(".", "_")
    target.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        if (source / name).is_file():
            shutil.copy(source / name, target / name)
    # The estimate needs a tokenizer only for its special token ids and to decode responses.
    tokenizer_source = source if (source / "tokenizer.json").is_file() else ASSETS / "tiny-llama"
    for name in _TOKENIZER_FILES:
        if (tokenizer_source / name).is_file():
            shutil.copy(tokenizer_source / name, target / name)
    return str(target)


#: Where a recipe config names its models (the policy; PPO's critic and reward model; a
#: distillation teacher, SFT's and PPO's; DPO's reference when it names other weights than the
#: policy's), by their section's dotted path under ``model``.
MODEL_KEYS = (("", "model.name_or_path"), ("critic", "model.critic.name_or_path"),
              ("reward_model", "model.reward_model.name_or_path"),
              ("distillation.teacher", "model.distillation.teacher.name_or_path"),
              ("teacher", "model.teacher.name_or_path"), ("reference", "model.reference.name_or_path"))


def _model_locations(model_cfg: Any) -> Iterator[tuple[Any, str, int | None, str]]:
    """``(section holding name_or_path, its key, index, path)`` for every model the config names;
    index is None for a single path and each member's position in a list (a reward-model
    ensemble), whose key is then ``key[i]``."""
    for attr, key in MODEL_KEYS:
        holder = model_cfg
        for part in attr.split(".") if attr else ():
            holder = getattr(holder, part, None)
        value = getattr(holder, "name_or_path", None) if holder is not None else None
        if isinstance(value, (list, tuple)):
            for i, path in enumerate(value):
                yield holder, f"{key}[{i}]", i, path
        elif value:
            yield holder, key, None, value


def model_vocab_sizes(model_cfg: Any) -> list[int]:
    """The vocabulary size of every model the config names (a ``[..., vocab]`` tensor is logits)."""
    sizes = []
    for _, key, _, path in _model_locations(model_cfg):
        config = json.loads((config_folder(path, key) / "config.json").read_text())
        sizes.append(int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size", 0)))
    return sizes


def localize_models(model_cfg: Any, workdir: Path) -> list[int]:
    """Point every model location of ``model_cfg`` at a config-only copy; return the vocabulary sizes."""
    vocab = model_vocab_sizes(model_cfg)
    for holder, key, index, path in list(_model_locations(model_cfg)):
        copy = config_only_copy(path, key, workdir)
        if index is None:
            holder.name_or_path = copy
        else:
            holder.name_or_path = [*holder.name_or_path[:index], copy, *holder.name_or_path[index + 1:]]
    return vocab


def instantiate(cli: Any, cfg: Any) -> Any:
    """The parsed config's objects (module, datamodule, the trainer section's strategy and
    callbacks), made by the recipe CLI's own parser; the Trainer itself is not made."""
    return cli.parser.instantiate_classes(cfg)


def _build_object(value: Any) -> Any:
    """``class_path``/``init_args`` (a Namespace or dict) to an object; anything else as it is."""
    from jsonargparse import Namespace

    if isinstance(value, Namespace):
        value = value.as_dict()
    if isinstance(value, dict) and "class_path" in value:
        module_name, _, name = value["class_path"].rpartition(".")
        cls = getattr(importlib.import_module(module_name), name)
        args = {k: _build_object(v) for k, v in (value.get("init_args") or {}).items()}
        return cls(**args)
    return value


def precision_plugin(precision: Any) -> Any:
    from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision

    value = str(precision)
    if value in ("32", "32-true", "64-true"):
        return Precision()
    if value in ("bf16-true", "16-true", "bf16", "16"):
        return HalfPrecision("bf16-true" if value.startswith("bf16") else "16-true")
    if value in ("bf16-mixed", "16-mixed"):
        # Autocast on the device the estimate runs on (CPU); the dtypes are those of the GPU run.
        return MixedPrecision("bf16-mixed", device="cpu")
    raise SettingNotSupported("trainer.precision", f": the estimator does not know {precision!r}")


def is_technique(callback: Any) -> bool:
    """The callbacks that change memory (not the monitor or checkpointing)."""
    from lightning_mem.callbacks import MemoryMonitor

    from lightning.pytorch.callbacks import ModelCheckpoint

    # A callback that cannot run in this CPU fit (runs_in_estimate = False: Liger's CUDA kernels) is
    # left out; its estimate_note says how that changes the figures.
    return (not isinstance(callback, (MemoryMonitor, ModelCheckpoint)) and type(callback).__name__ != "FitCheck"
            and getattr(callback, "runs_in_estimate", True))


def world_size_of(trainer_cfg: Any) -> int:
    devices = trainer_cfg.devices
    if isinstance(devices, (list, tuple)):
        devices = len(devices)
    try:
        devices = int(devices)
    except (TypeError, ValueError):
        devices = 1  # "auto": one per process here
    return max(devices, 1) * int(trainer_cfg.num_nodes or 1)


def sampled_tokens(name_or_path: str) -> tuple[int, int | None]:
    """``(fill, eos)`` for the model in the folder ``name_or_path``.

    ``fill``: the smallest token id that neither ends a sequence nor pads. The estimate's token ids
    are this one, and so is every token its measured step samples, so every response runs to its
    length limit (the worst case). ``eos``: a token that ends a sequence (None if none is named),
    which the warm-up step samples, so that its responses end at once.
    """
    from lightning_mem.models import load_tokenizer

    folder = Path(name_or_path)
    eos: list[int] = []
    taken: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        if (folder / name).is_file():
            config = json.loads((folder / name).read_text())
            eos += _as_list(config.get("eos_token_id"))
            taken.update(_as_list(config.get("pad_token_id")))
    tokenizer = load_tokenizer(str(folder), key="model.name_or_path")
    if tokenizer.eos_token_id is not None:
        eos.insert(0, tokenizer.eos_token_id)
    taken.update(eos)
    if tokenizer.pad_token_id is not None:
        taken.add(tokenizer.pad_token_id)
    fill = next(i for i in range(len(taken) + 1) if i not in taken)
    return fill, (eos[0] if eos else None)


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)
