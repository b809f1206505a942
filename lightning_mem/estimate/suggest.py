"""When a config does not fit: overrides from the project's own techniques, each re-estimated, with
what it costs and the command that runs it.

Candidates are tried cheapest first (cost = what they slow down or change, not bytes): smaller
micro-batches (same updates, more steps of accumulation), activation checkpointing (one extra
forward), 8-bit optimizer state, optimizer state on the host between phases, activation offload
(transfers), FSDP2 CPU offload (the optimizer steps on the CPU). Each candidate is a list of the
recipe CLI's own overrides, offered only where it changes the config (a config that checkpoints
every block is not offered checkpointing). A candidate is a suggestion only when its re-estimated
peak is below the config's own: one that is not is dropped, said once, and never combined (8-bit
paged AdamW under FSDP2 CPU offload puts state back on the device). Those that lower the peak but
do not fit alone are combined, each kept in the combination only while it lowers the combined peak.
When nothing fits, :mod:`.smaller` names the smallest way that does (LoRA, then QLoRA).

A suggestion's cost is read off the estimates themselves where it can be: the bytes activation
offload moves are what the re-estimate holds on the host beyond the plain run (there and back,
every micro-batch), the optimizer state a PPO memory plan parks on the host is the plain run's
``optimizer_state`` (there and back, every step); FSDP2 CPU offload's traffic is about the
plain run's per-rank weights twice (forward, backward) and its gradients once, per micro-batch.
Recomputation is counted in forwards: checkpointing every block runs each block's forward once
more per micro-batch (about a third more compute: a backward costs about two forwards).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_mem.estimate.report import GiB, command, usable_bytes


@dataclass
class Candidate:
    """One technique as recipe CLI overrides; ``kind`` says how it costs (see :func:`cost_of`)."""

    what: str
    overrides: list[str]
    kind: str  # split | recompute | optimizer_8bit | state_on_host | activation_offload | cpu_offload


@dataclass
class Cost:
    """What a suggestion costs per rank: extra forwards of every block per micro-batch, the bytes
    between host and device per optimizer step (PPO: per PPO step), and what else changes."""

    extra_forwards: float = 0.0
    transfer_bytes_per_step: int = 0
    changes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        parts = []
        if self.extra_forwards:
            parts.append(f"+{self.extra_forwards:g} forward of every block per micro-batch (about "
                         f"{self.extra_forwards / 3:.0%} more compute)")
        else:
            parts.append("no extra compute")
        if self.transfer_bytes_per_step:
            parts.append(f"{self.transfer_bytes_per_step / GiB:.2f} GiB host<->device per step")
        else:
            parts.append("no host<->device transfers")
        return "; ".join(parts + self.changes)


def _has_callback(cfg: Any, name: str) -> bool:
    for cb in cfg.trainer.get("callbacks") or []:
        path = cb.get("class_path", "") if hasattr(cb, "get") else str(cb)
        if path.endswith(name):
            return True
    return False


def _strategy_path(cfg: Any) -> str:
    strategy = cfg.trainer.get("strategy")
    return strategy.get("class_path", "") if hasattr(strategy, "get") else str(strategy)


def _strategy_arg(cfg: Any, name: str) -> Any:
    """The strategy's ``init_args.<name>`` as the config sets it (None where it does not)."""
    strategy = cfg.trainer.get("strategy")
    init_args = strategy.get("init_args") if hasattr(strategy, "get") else None
    return init_args.get(name) if hasattr(init_args, "get") else None


def _plan_place(model: Any, phase: str, what: str) -> Any:
    """Where PPO's ``memory_plan`` puts ``what`` in ``phase`` (None where the config does not say)."""
    plan = model.get("memory_plan")
    section = plan.get(phase) if hasattr(plan, "get") else None
    return section.get(what) if hasattr(section, "get") else None


def candidates(cfg: Any, recipe: str) -> list[Candidate]:
    """The techniques this config does not use yet, cheapest first, for the parsed config ``cfg``."""
    out: list[Candidate] = []
    model, data = cfg.model, cfg.get("data")
    fsdp2 = _strategy_path(cfg).endswith("FSDP2Strategy")
    if recipe.endswith("ppo"):
        ppo = model.ppo
        budget = ppo.get("max_tokens_per_microbatch")
        if budget:
            for factor in (2, 4):
                out.append(Candidate(f"train micro-batches of {budget // factor} tokens (same updates)",
                                     [f"--model.ppo.max_tokens_per_microbatch={budget // factor}"], "split"))
        logprob = ppo.get("logprob_max_tokens_per_microbatch")
        if logprob:
            out.append(Candidate(f"no-grad micro-batches of {logprob // 4} tokens",
                                 [f"--model.ppo.logprob_max_tokens_per_microbatch={logprob // 4}"], "split"))
        from lightning_mem.rl.advantages import WITH_CRITIC

        roles = ("actor", "critic") if model.get("advantage_estimator") in WITH_CRITIC else ("actor",)
        parked = [f"--model.memory_plan.{phase}.{role}_optimizer=host" for phase in ("rollout", "score")
                  for role in roles if _plan_place(model, phase, f"{role}_optimizer") != "host"]
        if parked:
            out.append(Candidate(f"{' and '.join(roles)} optimizer state on the host during rollout and score",
                                 parked, "state_on_host"))
    elif data is not None and data.get("max_tokens_per_batch"):
        budget, length = data.max_tokens_per_batch, data.max_length
        accumulate = int(cfg.trainer.get("accumulate_grad_batches") or 1)
        if budget // 2 >= length:
            out.append(Candidate(f"micro-batches of {budget // 2} tokens, accumulation x2 (same updates)",
                                 [f"--data.max_tokens_per_batch={budget // 2}",
                                  f"--trainer.accumulate_grad_batches={accumulate * 2}"], "split"))
    if fsdp2:
        if _strategy_arg(cfg, "activation_checkpointing") not in (True, 1):
            out.append(Candidate("FSDP2 activation checkpointing of every block",
                                 ["--trainer.strategy.init_args.activation_checkpointing=1"], "recompute"))
    elif recipe.endswith("qlora"):  # the recipe checkpoints the quantized blocks itself
        if model.get("activation_checkpointing") is False:
            out.append(Candidate("activation checkpointing of every block",
                                 ["--model.activation_checkpointing=true"], "recompute"))
    elif not _has_callback(cfg, "ActivationCheckpointing"):
        out.append(Candidate("activation checkpointing of every block",
                             ["--trainer.callbacks+=lightning_mem.callbacks.ActivationCheckpointing"], "recompute"))
    optimizer = model.get("optimizer")
    opt_path = optimizer.get("class_path", "") if hasattr(optimizer, "get") else ""
    if "8bit" not in opt_path.lower():
        lr = optimizer.get("init_args", {}).get("lr") if hasattr(optimizer, "get") else None
        args = ["--model.optimizer=bitsandbytes.optim.PagedAdamW8bit"] + ([f"--model.optimizer.init_args.lr={lr}"] if lr else [])
        out.append(Candidate("8-bit paged AdamW (optimizer state ~2 bytes per parameter)", args, "optimizer_8bit"))
    if not _has_callback(cfg, "ActivationOffload"):
        out.append(Candidate("activation offload to host memory",
                             ["--trainer.callbacks+=lightning_mem.callbacks.ActivationOffload"], "activation_offload"))
    if fsdp2 and _strategy_arg(cfg, "cpu_offload") is not True:
        out.append(Candidate("FSDP2 CPU offload of parameters, gradients and optimizer state",
                             ["--trainer.strategy.init_args.cpu_offload=true"], "cpu_offload"))
    return out


def _train(estimate: Any) -> Any:
    phases = {p.phase: p for p in estimate.phases}
    return phases.get("train") or max(estimate.phases, key=lambda p: p.device_peak_bytes)


def _accumulation(cfg: Any, overrides: list[str]) -> int:
    """Micro-batches per optimizer step with ``overrides`` applied (the last one given wins)."""
    value = int(cfg.trainer.get("accumulate_grad_batches") or 1)
    for arg in overrides:
        match = re.fullmatch(r"--trainer\.accumulate_grad_batches=(\d+)", arg)
        if match:
            value = int(match.group(1))
    return value


def cost_of(kinds: list[str], base: Any, after: Any, micro_batches: int) -> Cost:
    """The cost of applying the candidates of ``kinds`` together, from the plain run's estimate
    ``base`` and the estimate ``after`` applying them (per rank; ``micro_batches`` per step)."""
    cost = Cost()
    plain, changed = _train(base), _train(after)
    for kind in dict.fromkeys(kinds):  # each kind once, in order
        if kind == "split":
            cost.changes.append("smaller micro-batches, more of them (same tokens and updates per step)")
        elif kind == "recompute":
            cost.extra_forwards += 1.0
        elif kind == "optimizer_8bit":
            cost.changes.append("8-bit block-wise quantized optimizer state (updates differ slightly from 32-bit AdamW)")
        elif kind == "state_on_host":
            # Parked before the rollout and brought back for the update, every PPO step.
            cost.transfer_bytes_per_step += 2 * plain.device_breakdown_bytes.get("optimizer_state", 0)
        elif kind == "activation_offload":
            # What the offloaded run holds on the host beyond the plain one is one micro-batch's
            # stash: to the host in forward, back in backward.
            stash = max(0, changed.host_peak_bytes - plain.host_peak_bytes)
            cost.transfer_bytes_per_step += 2 * stash * micro_batches
        elif kind == "cpu_offload":
            weights = plain.device_breakdown_bytes.get("weights", 0)
            gradients = plain.device_breakdown_bytes.get("gradients", 0)
            cost.transfer_bytes_per_step += (2 * weights + gradients) * micro_batches
            cost.changes.append("the optimizer step runs on the CPU")
    return cost


@dataclass
class Advice:
    """What ``--suggest`` found. ``suggestions``: those that fit, cheapest first; when none does,
    every attempt that lowered the peak and every one that could not apply. ``dropped``: candidates
    re-estimated no lower than the config's own peak (neither suggested nor combined). ``smaller``:
    when nothing fits, the steps down the LoRA/QLoRA ladder tried (:mod:`.smaller`), the last the
    one that fits if any does; None when it was not looked for."""

    suggestions: list[dict[str, Any]]
    dropped: list[dict[str, Any]] = field(default_factory=list)
    smaller: list[dict[str, Any]] | None = None

    @property
    def fits(self) -> bool:
        return any(s.get("fits") for s in self.suggestions)

    def to_dict(self) -> dict[str, Any]:
        return {"suggestions": self.suggestions, "dropped": self.dropped, "smaller": self.smaller}


@dataclass
class _Trials:
    """One suggest() call's re-estimates: each candidate combination's entry, and the ones that
    could not apply (in ``tried``, with their error)."""

    cfg: Any
    recipe: str
    overrides: list[str]
    run_estimate: Callable[[list[str]], Any]
    base: Any
    usable: int
    config: str | None
    tried: list[dict[str, Any]] = field(default_factory=list)

    def attempt(self, parts: list[Candidate]) -> dict[str, Any] | None:
        args = [arg for part in parts for arg in part.overrides]
        label = " + ".join(part.what for part in parts)
        try:
            result = self.run_estimate(self.overrides + args)
        except Exception as err:  # noqa: BLE001 - a candidate that cannot apply is skipped, and said
            self.tried.append({"what": label, "overrides": args, "error": str(err).splitlines()[0]})
            return None
        peak = result.device_peak_bytes
        entry: dict[str, Any] = {"what": label, "overrides": args, "device_peak_bytes": peak, "fits": peak <= self.usable}
        cost = cost_of([p.kind for p in parts], self.base, result, _accumulation(self.cfg, self.overrides + args))
        entry["cost"] = {**asdict(cost), "text": cost.describe()}
        if self.config is not None:
            entry["command"] = command(self.recipe, self.config, self.overrides + args)
        return entry


def suggest(
    cfg: Any,
    recipe: str,
    overrides: list[str],
    device_bytes: int,
    run_estimate: Callable[[list[str]], Any],
    *,
    base: Any,
    config: str | None = None,
    limit: int = 3,
    estimate_config: Callable[[str, list[str], str, int | None], Any] | None = None,
) -> Advice:
    """Try each candidate alone and, while it lowers the peak, combined with those before it that
    did not fit alone; stop after ``limit`` that fit. ``base`` is the plain run's estimate: a
    candidate must re-estimate below its peak to be suggested at all. Each suggestion has
    ``what``, ``overrides`` (the candidate's own), ``device_peak_bytes``, ``fits`` and ``cost``
    (:class:`Cost` as a dict, with ``text``); given ``config``, ``command`` (the full line,
    ``overrides`` included). When none fits and ``config`` and ``estimate_config`` are given,
    :func:`~lightning_mem.estimate.smaller.smaller_ways` looks for the smallest way that does."""
    trials = _Trials(cfg, recipe, overrides, run_estimate, base, usable_bytes(device_bytes), config)
    attempt, tried, own_peak = trials.attempt, trials.tried, base.device_peak_bytes
    found: list[dict[str, Any]] = []
    dropped: list[dict[str, Any]] = []

    combined: list[Candidate] = []  # those that lowered the peak without fitting, while together they lower it more
    combined_peak = own_peak
    for candidate in candidates(cfg, recipe):
        alone = attempt([candidate])
        if alone is None:
            continue
        if alone["device_peak_bytes"] >= own_peak:
            dropped.append(alone)
            continue
        tried.append(alone)
        if alone["fits"]:
            found.append(alone)
        else:
            together = attempt(combined + [candidate]) if combined else None
            best_apart = min(combined_peak, alone["device_peak_bytes"])
            if together is not None and together["device_peak_bytes"] < best_apart:
                tried.append(together)
                if together["fits"]:
                    found.append(together)
                else:
                    combined, combined_peak = combined + [candidate], together["device_peak_bytes"]
            elif alone["device_peak_bytes"] < combined_peak:  # better than the combination so far: start from it
                combined, combined_peak = [candidate], alone["device_peak_bytes"]
        if len(found) >= limit:
            break
    advice = Advice(found or tried, dropped)
    if not found and config is not None and estimate_config is not None:
        from lightning_mem.estimate.smaller import smaller_ways

        advice.smaller = smaller_ways(cfg, recipe, config, overrides, base.world_size, trials.usable, estimate_config)
    return advice
