"""When a config does not fit: overrides from the project's own techniques, each re-estimated.

Candidates are tried cheapest first (cost = what they slow down or change, not bytes): smaller
micro-batches (same updates, more steps of accumulation), activation checkpointing (one extra
forward), 8-bit optimizer state, optimizer state on the host between phases, activation offload
(transfers), FSDP2 CPU offload (the optimizer steps on the CPU). Each candidate is a list of the
recipe CLI's own overrides; it is kept when the re-estimated peak fits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_mem.estimate.report import usable_bytes


def _has_callback(cfg: Any, name: str) -> bool:
    for cb in cfg.trainer.get("callbacks") or []:
        path = cb.get("class_path", "") if hasattr(cb, "get") else str(cb)
        if path.endswith(name):
            return True
    return False


def _strategy_path(cfg: Any) -> str:
    strategy = cfg.trainer.get("strategy")
    return strategy.get("class_path", "") if hasattr(strategy, "get") else str(strategy)


def candidates(cfg: Any, recipe: str) -> list[tuple[str, list[str]]]:
    """(what it does, overrides), cheapest first, for the parsed config ``cfg``."""
    out: list[tuple[str, list[str]]] = []
    model, data = cfg.model, cfg.get("data")
    fsdp2 = _strategy_path(cfg).endswith("FSDP2Strategy")
    if recipe.endswith("ppo"):
        ppo = model.ppo
        budget = ppo.get("max_tokens_per_microbatch")
        if budget:
            for factor in (2, 4):
                out.append((f"train micro-batches of {budget // factor} tokens (same updates)",
                            [f"--model.ppo.max_tokens_per_microbatch={budget // factor}"]))
        logprob = ppo.get("logprob_max_tokens_per_microbatch")
        if logprob:
            out.append((f"no-grad micro-batches of {logprob // 4} tokens",
                        [f"--model.ppo.logprob_max_tokens_per_microbatch={logprob // 4}"]))
        out.append(("actor and critic optimizer state on the host during rollout and score",
                    ["--model.memory_plan.rollout.actor_optimizer=host", "--model.memory_plan.score.actor_optimizer=host",
                     "--model.memory_plan.rollout.critic_optimizer=host", "--model.memory_plan.score.critic_optimizer=host"]))
    elif data is not None and data.get("max_tokens_per_batch"):
        budget, length = data.max_tokens_per_batch, data.max_length
        accumulate = int(cfg.trainer.get("accumulate_grad_batches") or 1)
        if budget // 2 >= length:
            out.append((f"micro-batches of {budget // 2} tokens, accumulation x2 (same updates)",
                        [f"--data.max_tokens_per_batch={budget // 2}", f"--trainer.accumulate_grad_batches={accumulate * 2}"]))
    if fsdp2:
        out.append(("FSDP2 activation checkpointing of every block", ["--trainer.strategy.init_args.activation_checkpointing=1"]))
    elif not _has_callback(cfg, "ActivationCheckpointing") and not recipe.endswith("qlora"):
        out.append(("activation checkpointing of every block",
                    ["--trainer.callbacks+=lightning_mem.callbacks.ActivationCheckpointing"]))
    optimizer = model.get("optimizer")
    opt_path = optimizer.get("class_path", "") if hasattr(optimizer, "get") else ""
    if "8bit" not in opt_path.lower():
        lr = optimizer.get("init_args", {}).get("lr") if hasattr(optimizer, "get") else None
        args = ["--model.optimizer=bitsandbytes.optim.PagedAdamW8bit"] + ([f"--model.optimizer.init_args.lr={lr}"] if lr else [])
        out.append(("8-bit paged AdamW (optimizer state ~2 bytes per parameter)", args))
    if not _has_callback(cfg, "ActivationOffload"):
        out.append(("activation offload to host memory", ["--trainer.callbacks+=lightning_mem.callbacks.ActivationOffload"]))
    if fsdp2:
        out.append(("FSDP2 CPU offload of parameters, gradients and optimizer state",
                    ["--trainer.strategy.init_args.cpu_offload=true"]))
    return out


def suggest(
    cfg: Any,
    recipe: str,
    overrides: list[str],
    device_bytes: int,
    run_estimate: Callable[[list[str]], Any],
    *,
    limit: int = 3,
) -> list[dict[str, Any]]:
    """Try each candidate alone, then cumulatively; return up to ``limit`` that fit, cheapest first."""
    usable = usable_bytes(device_bytes)
    found: list[dict[str, Any]] = []
    tried: list[dict[str, Any]] = []
    cumulative: list[str] = []  # the candidates that did not fit alone, combined
    for what, extra in candidates(cfg, recipe):
        attempts = [(what, extra)]
        if cumulative:
            attempts.append((f"{what}, with the earlier candidates that did not fit alone", cumulative + extra))
        fitted = False
        for label, args in attempts:
            try:
                result = run_estimate(overrides + args)
            except Exception as err:  # noqa: BLE001 - a candidate that cannot apply is skipped, and said
                tried.append({"what": label, "overrides": args, "error": str(err).splitlines()[0]})
                continue
            peak = result.device_peak_bytes
            entry = {"what": label, "overrides": args, "device_peak_bytes": peak, "fits": peak <= usable}
            tried.append(entry)
            if entry["fits"]:
                found.append(entry)
                fitted = True
                break
        if not fitted:
            cumulative += extra
        if len(found) >= limit:
            break
    return found or tried
