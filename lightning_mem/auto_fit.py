"""``fit --auto_fit true``: estimate the run before any model loads and, when it does not fit the
device, apply the cheapest of the estimator's suggestions that does (:class:`~lightning_mem.cli.RecipeCLI`).

The estimate runs as ``python -m lightning_mem.estimate --suggest --json`` in a subprocess, on the
run's own command line (its ``--config`` files and overrides): the fake-tensor fit shares no state
with the real one that follows. The device is ``--device_memory`` when given, else the CUDA
device this process will train on; without either there is nothing to fit into, and that is an
error naming ``device_memory``. The choice is logged and written into the run's ``config.yaml``
(the applied overrides are part of the config it saves, and ``auto_fit_applied`` says what they
were and why).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from lightning_mem.settings import SettingError

#: The CLI's own auto-fit keys: never passed on to the estimate (it would estimate again).
AUTO_FIT_KEYS = ("--auto_fit", "--device_memory", "--auto_fit_applied")
GiB = 1 << 30


def split_command_line(args: list[str]) -> tuple[str, list[str]]:
    """The first ``--config`` of a ``fit`` command line and everything else the estimate needs
    (later ``--config`` files, overrides), without the subcommand, ``--ckpt_path`` or the auto-fit keys."""
    rest = list(args)
    if rest and not rest[0].startswith("-"):
        rest = rest[1:]  # the subcommand
    config: str | None = None
    kept: list[str] = []
    i = 0
    while i < len(rest):
        arg = rest[i]
        name, has_value, value = arg.partition("=")
        takes_next = not has_value and i + 1 < len(rest) and not rest[i + 1].startswith("--")
        if not has_value and takes_next:
            value = rest[i + 1]
        step = 2 if takes_next else 1
        if name == "--config" and config is None:
            config = value
        elif name in ("--ckpt_path", *AUTO_FIT_KEYS):
            pass
        else:
            kept += rest[i:i + step]
        i += step
    if config is None:
        raise SettingError("auto_fit", "`auto_fit: true` needs the run's --config on the command line: the estimate runs it")
    return config, kept


def device_budget(device_memory: str | None) -> tuple[int, str]:
    """The bytes to fit into, and where they come from: ``device_memory`` (``24GiB``, ``80GB``,
    bytes) if set, else this process's CUDA device."""
    from lightning_mem.estimate.report import check_device_size, parse_size

    if device_memory is not None:
        device_bytes = parse_size(device_memory, key="device_memory")
        check_device_size(device_bytes, key="device_memory", text=device_memory)
        return device_bytes, f"device_memory={device_memory}"
    import torch

    if not torch.cuda.is_available():
        raise SettingError(
            "device_memory",
            "`auto_fit: true` fits the run into a device's memory, and there is no CUDA device here: give the"
            " budget with `device_memory` (e.g. --device_memory 24GiB), or drop `auto_fit`",
        )
    index = int(os.environ.get("LOCAL_RANK", 0))
    props = torch.cuda.get_device_properties(index)
    check_device_size(props.total_memory, key="device_memory", text=f"{props.name}'s {props.total_memory / GiB:.2f} GiB")
    return props.total_memory, f"{props.name} (cuda:{index})"


def estimate_with_suggestions(config: str, overrides: list[str], device_bytes: int, recipe: str,
                              timeout_s: float = 3600.0) -> dict[str, Any]:
    """``python -m lightning_mem.estimate ... --suggest --json`` for this run, as a dict."""
    cmd = [sys.executable, "-m", "lightning_mem.estimate", "--config", config, *overrides, "--recipe", recipe,
           "--device-memory", str(device_bytes), "--suggest", "--suggestions", "1", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    try:
        return json.loads(done.stdout)
    except json.JSONDecodeError:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"auto_fit: the estimate failed (exit {done.returncode}): {' '.join(tail)}") from None


def choose(result: dict[str, Any]) -> dict[str, Any] | None:
    """The suggestion to apply: None when the run fits as it is, else the first (cheapest) that
    fits. No suggestion fitting is an error: the run would run out of memory; it names the
    smallest way that fits (LoRA, QLoRA), if the estimate found one."""
    if result["fits"]:
        return None
    fitting = [s for s in result.get("suggestions") or [] if s.get("fits")]
    if fitting:
        return fitting[0]
    usable = result["usable_device_bytes"] / GiB
    tried = "; ".join(f"{s['what']}: {s['device_peak_bytes'] / GiB:.2f} GiB" if "device_peak_bytes" in s
                      else f"{s['what']}: {s.get('error')}" for s in result.get("suggestions") or [])
    # Adapters change what trains: named, never applied.
    way = next((s for s in result.get("smaller") or [] if s.get("fits")), None)
    smaller = (f"; the smallest way that does: {way['what']}, estimated at {way['device_peak_bytes'] / GiB:.2f} GiB:"
               f" {way['command']}" if way else "")
    raise SettingError(
        "auto_fit",
        f"`auto_fit: true`: the run's estimated peak {result['device_peak_bytes'] / GiB:.2f} GiB exceeds the"
        f" {usable:.2f} GiB usable of {result['device_memory_bytes'] / GiB:.2f} GiB (the rest is the estimate's"
        f" reserve: {result['margin']['what']}), and no suggestion fits ({tried or 'none lowers the peak'}){smaller};"
        " see `python -m lightning_mem.estimate --config ... --suggest`",
    )


def describe(result: dict[str, Any], chosen: dict[str, Any] | None, budget_from: str) -> str:
    """One line for the log and for ``auto_fit_applied`` in config.yaml."""
    usable = result["usable_device_bytes"] / GiB
    peak = result["device_peak_bytes"] / GiB
    if chosen is None:
        return f"fits as configured: estimated peak {peak:.2f} GiB of {usable:.2f} GiB usable on {budget_from}"
    cost = f"; cost: {chosen['cost']['text']}" if "cost" in chosen else ""
    return (f"applied '{chosen['what']}' ({' '.join(chosen['overrides'])}): estimated peak"
            f" {peak:.2f} -> {chosen['device_peak_bytes'] / GiB:.2f} GiB of {usable:.2f} GiB usable on"
            f" {budget_from}{cost}")
