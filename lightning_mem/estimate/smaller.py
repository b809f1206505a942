"""When no suggestion fits: the smallest way down the ladder full weights -> LoRA -> QLoRA that does.

A run that trains every weight and fits nowhere even with every technique of :mod:`.suggest` can
still train the same model with adapters. The ladder is tried in order of how much it changes,
each step re-estimated, and stops at the first that fits:

1. LoRA on the run itself: its own config and overrides (strategy, offload, data) plus adapters of
   the shipped configs' shape (r=16, alpha 32, every linear layer of the blocks), where the recipe
   has a ``model.lora`` section and the run sets none;
2. the shipped LoRA configs of the same model (``model.name_or_path``) in the run's recipe folder;
3. the shipped QLoRA configs of the same model (``configs/qlora/`` for SFT; configs of the run's
   recipe folder that set ``model.quantization``).

Shipped configs are found in the ``configs/`` folder that holds the run's config, and in
``./configs`` (the project's checkout; a wheel carries no configs). One that needs more ranks than
the run has is left out. Each step is an entry like a suggestion's: ``what``, ``config``, ``recipe``,
``overrides``, ``world_size``, ``device_peak_bytes``, ``fits``, ``command`` (or ``error``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_mem.estimate.recipe_config import RECIPES, parse_config

#: The adapters of the shipped LoRA and QLoRA configs, as the recipes' CLI overrides.
LORA_OVERRIDES = ["--model.lora.r=16", "--model.lora.lora_alpha=32", "--model.lora.target_modules=all-linear"]
FULL, LORA, QLORA = 0, 1, 2
_LEVEL_NAMES = {LORA: "LoRA", QLORA: "QLoRA"}


def level_of(recipe: str, model: Any) -> int:
    """Where a run stands on the ladder: QLoRA (quantized base), LoRA (adapters) or full weights."""
    get = model.get if hasattr(model, "get") else lambda key, default=None: default
    if recipe.endswith("qlora") or get("quantization"):
        return QLORA
    return LORA if get("lora") else FULL


def _shown(path: Path) -> str:
    """``path`` as a user would type it here: relative to the working folder where it can be."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _ranks(path: Path, data: dict[str, Any]) -> int:
    """The ranks a shipped config runs on: its tier's GPUs, else ``trainer.devices`` x ``num_nodes``."""
    from lightning_mem.estimate.report import tier_of

    tier = tier_of(path)
    if tier is not None:
        return tier.gpus
    trainer = data.get("trainer") or {}
    devices = trainer.get("devices", 1)
    devices = len(devices) if isinstance(devices, list) else devices if isinstance(devices, int) else 1
    return max(devices, 1) * int(trainer.get("num_nodes") or 1)


def _model_of(path: Path, model: dict[str, Any]) -> str | None:
    """The config's ``model.name_or_path`` as its run would read it (a relative folder found as the
    recipes' CLI finds it, so it compares with the parsed run's); None where it names none."""
    from lightning_mem.cli import resolve_input_path, search_dirs

    value = model.get("name_or_path")
    if not isinstance(value, str) or not value:
        return None
    try:
        return resolve_input_path(value, "model.name_or_path", search_dirs([path]), may_be_hub_id=True)
    except Exception:  # noqa: BLE001 - a folder missing here: not this run's model
        return None


def shipped(config: str | Path, recipe: str, name_or_path: str, above: int, ranks: int) -> list[tuple[int, Path, str]]:
    """``(level, path, recipe)`` of the shipped configs of ``name_or_path`` above ladder level
    ``above`` that run on at most ``ranks`` ranks, in ladder order (then by name)."""
    import yaml

    folders = {name: module for name, module in RECIPES.items()
               if module == recipe or (name == "qlora" and recipe.endswith(".sft"))}
    roots = dict.fromkeys(root.resolve() for root in (Path(config).resolve().parent.parent, Path.cwd() / "configs"))
    own = Path(config).resolve()
    found: dict[Path, tuple[int, Path, str]] = {}
    for root in roots:
        for folder, module in folders.items():
            for path in sorted((root / folder).glob("*.yaml")):
                path = path.resolve()
                if path == own or path in found:
                    continue
                data = yaml.safe_load(path.read_text()) or {}
                model = data.get("model") or {}
                level = level_of(module, model)
                if level > above and _ranks(path, data) <= ranks and _model_of(path, model) == name_or_path:
                    found[path] = (level, path, module)
    return sorted(found.values(), key=lambda item: (item[0], item[1].name))


def smaller_ways(
    cfg: Any,
    recipe: str,
    config: str,
    overrides: list[str],
    world_size: int,
    usable: int,
    estimate_config: Callable[[str, list[str], str, int | None], Any],
) -> list[dict[str, Any]]:
    """Down the ladder from the run (``config`` + ``overrides`` under ``recipe``, parsed as ``cfg``,
    on ``world_size`` ranks) until a step fits ``usable`` bytes: the steps tried, in order.
    ``estimate_config(config, overrides, recipe, world_size or None)`` estimates one step."""
    from lightning_mem.estimate.report import command

    model = cfg.model
    here = level_of(recipe, model)
    steps: list[tuple[str, str, str, list[str], int | None]] = []
    if here == FULL and hasattr(model, "get") and "lora" in model.keys():
        steps.append(("LoRA on this run (r=16, alpha 32, every linear layer; the base frozen)", config, recipe,
                      overrides + LORA_OVERRIDES, world_size))
    if here < QLORA:
        # The estimate pointed the parsed config at a config-only copy of the model: parse it afresh.
        _, parsed, _ = parse_config(recipe, ["--config", str(config), *overrides])
        for level, path, module in shipped(config, recipe, parsed.model.name_or_path, here, world_size):
            steps.append((f"the shipped {_LEVEL_NAMES[level]} config {_shown(path)}", _shown(path), module, [], None))
    tried: list[dict[str, Any]] = []
    for what, path, module, args, ranks in steps:
        entry: dict[str, Any] = {"what": what, "config": path, "recipe": module, "overrides": args,
                                 "command": command(module, path, args)}
        try:
            result = estimate_config(path, args, module, ranks)
        except Exception as err:  # noqa: BLE001 - a step that cannot run is said, and the next is tried
            tried.append({**entry, "error": str(err).splitlines()[0]})
            continue
        peak = result.device_peak_bytes
        tried.append({**entry, "world_size": result.world_size, "device_peak_bytes": peak, "fits": peak <= usable})
        if peak <= usable:
            break
    return tried
