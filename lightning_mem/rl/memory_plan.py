"""A PPO step's memory plan: where each model and optimizer state lives in each phase.

A PPO step has three phases that need different things on the accelerator, and a fourth with a
distillation teacher:

- **rollout**: the actor generates; its KV cache grows with batch x length. Nothing else is used.
- **score**: the reward (rule or model), the reference's and the actor's logprobs, the critic's
  values; all without gradients.
- **teacher** (on-policy distillation only, :mod:`lightning_mem.rl.distillation`): the teacher's
  log-probs of the sampled tokens, without gradients. Unset in the plan, it keeps the score
  phase's placement (nothing moves between the two but the teacher). The teacher itself is not a
  plan component: its ``placement`` says where it lives, and under ``host`` :class:`PhaseMemory`
  brings it onto the device for this phase only.
- **train**: epochs of updates of the actor (and critic): parameters, gradients, optimizer state,
  activations.

The actor's Adam state (8 bytes per trained parameter in fp32, twice the bf16 weights) is dead
weight outside the train phase, and the reference and reward models are dead weight outside the
score phase. NeMo-Aligner moves the Adam state to the host around generation; verl and NeMo RL
also park the frozen models on the host between their uses. :class:`PhaseMemoryPlan` declares
such a plan in YAML; :class:`PhaseMemory` carries it out with the primitives of
:mod:`lightning_mem.offload` and reports each phase to the ``MemoryMonitor``. A paged optimizer's
state (bitsandbytes' managed memory) goes to the host by a page prefetch where the GPU can page,
and stays with the driver where it cannot (:mod:`lightning_mem.paging`).

The plan also owns the rollout engine's residency when the engine holds weights of its own
(vLLM, ``model.rollout_engine``): awake in the rollout, asleep at its ``sleep_level`` in the score
and train phases, and woken for the next rollout in the order optimizer-state offload -> engine
weights -> weight sync (the actor's update) -> KV cache, so the largest allocation comes last,
after everything the rollout does not need has left. Each transition is timed
(``seconds["engine_sync"]``...) and shown to the ``MemoryMonitor`` as a phase of its own.

Example (YAML; in the PPO recipe, ``model.memory_plan``)::

    rollout: {actor_optimizer: host, critic_optimizer: host, critic: host, reference: host, reward_model: host}
    score:   {actor_optimizer: host, critic_optimizer: host, reference: device, reward_model: device}
    train:   {reference: host, reward_model: host}
    free_kv_cache: true
    empty_cache_between_phases: true
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from lightning_mem.allocator import release_free_host_memory
from lightning_mem.settings import SettingError, check_fields

Placement = Literal["device", "host"]
PHASES = ("rollout", "score", "teacher", "train")

#: What each phase computes with: those must be on the device during it.
USED_IN_PHASE: dict[str, tuple[str, ...]] = {
    "rollout": (),
    "score": ("critic", "reference", "reward_model"),
    "teacher": (),
    "train": ("actor_optimizer", "critic_optimizer", "critic"),
}
_OPTIMIZERS = ("actor_optimizer", "critic_optimizer")
_MODULES = ("critic", "reference", "reward_model")


@dataclass
class PhasePlacement:
    """Where each component lives during one phase: ``"device"`` or ``"host"``.

    The actor's own parameters are not listed: every phase computes with them.
    """

    actor_optimizer: Placement = "device"
    critic_optimizer: Placement = "device"
    critic: Placement = "device"
    reference: Placement = "device"
    reward_model: Placement = "device"

    def __post_init__(self) -> None:
        check_fields(self)  # each field is a Literal, which the CLI checks while parsing


@dataclass
class PhaseMemoryPlan:
    """The per-phase placement of the actor's and critic's optimizer state and of the critic,
    reference and reward models, plus two allocator knobs.

    Args:
        rollout, score, train: a :class:`PhasePlacement` per phase. Components a phase computes
            with must be on the device in it (checked by :meth:`validate`).
        teacher: the placement during a distillation teacher's phase; None: the score phase's.
        free_kv_cache: drop the rollout's preallocated (static) KV cache when the rollout ends, so
            its memory serves the next phases; ``False`` keeps it for the next rollout (no
            re-allocation, no fragmentation, but held through training).
        empty_cache_between_phases: return the caching allocator's free blocks to the device after
            each phase (``torch.cuda.empty_cache``): what one phase freed then fits the next
            phase's differently shaped tensors. Costs some re-allocation time; a no-op on CPU.
        pin_memory: pin the host copies (faster, asynchronous transfers); None pins when the
            device is CUDA.
        trim_host_memory: after a phase boundary that brought state back from the host, hand the
            freed host pages back to the system (glibc's ``malloc_trim``; a no-op under jemalloc or
            tcmalloc): without it glibc keeps them, and resident host memory creeps up over a long
            run (measured: docs/benchmarks.md, the long-run row).
    """

    rollout: PhasePlacement = field(default_factory=PhasePlacement)
    score: PhasePlacement = field(default_factory=PhasePlacement)
    train: PhasePlacement = field(default_factory=PhasePlacement)
    teacher: PhasePlacement | None = None
    free_kv_cache: bool = True
    empty_cache_between_phases: bool = False
    pin_memory: bool | None = None
    trim_host_memory: bool = True

    def placement(self, phase: str) -> PhasePlacement:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; the phases are {PHASES}")
        if phase == "teacher" and self.teacher is None:
            return self.score
        return getattr(self, phase)

    def _declared(self) -> tuple[str, ...]:
        """The phases the plan declares (an unset teacher phase is the score phase's, not its own)."""
        return tuple(p for p in PHASES if p != "teacher" or self.teacher is not None)

    def validate(self) -> None:
        """Reject a plan that would compute with a component parked on the host (errors name
        ``<phase>.<component>``; a recipe names where the plan sits, ``settings_at("model.memory_plan")``)."""
        for phase in self._declared():
            placement = self.placement(phase)
            for component in USED_IN_PHASE[phase]:
                if getattr(placement, component) != "device":
                    raise SettingError(
                        f"{phase}.{component}",
                        f" is 'host', but the {phase} phase computes with the"
                        f" {component.replace('_', ' ')}: it must be 'device' there",
                    )

    def host_placements(self) -> list[str]:
        """``"<phase>.<component>"`` for every component (optimizer state or module) sent to the host."""
        return [f"{phase}.{f.name}" for phase in self._declared() for f in dataclasses.fields(PhasePlacement)
                if getattr(self.placement(phase), f.name) == "host"]

    def offloads_modules(self) -> list[str]:
        """``"<phase>.<component>"`` for every module (critic, reference, reward model) sent to the host."""
        return [
            f"{phase}.{name}" for phase in self._declared() for name in _MODULES
            if getattr(self.placement(phase), name) == "host"
        ]


def release_cached_memory() -> None:
    """Give the allocator's unused cached blocks back to the device, after collecting the garbage
    cycles made since the last collection (a tensor only a cycle keeps alive frees its block too).

    Only the young generations are collected: what the phase just made. A full collection walks the
    whole heap, about 490,000 objects once the recipes are imported, for 0.2-0.6 s a phase on CPU
    (a third of a tiny GRPO step, three times a step); measured on the tiny GRPO fit, the full
    collections after each phase found no tensor, only 30-40 small objects in cycles. Cycles that
    survived into the oldest generation are left to Python's own full collections.
    """
    gc.collect(1)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class PhaseMemory:
    """Carries out a :class:`PhaseMemoryPlan` for one PPO module.

    Components that are ``None`` (no critic under GRPO, a rule instead of a reward model, no
    reference when the KL penalty is off) are skipped. ``phase(name)`` moves components to the
    phase's placement (offloads first, so that the peak never holds both the outgoing and the
    incoming), measures the phase (``seconds[name]``, and the ``MemoryMonitor`` if the trainer
    has one), and applies the KV-cache and allocator knobs when it ends.

    The resting placement between steps is the train phase's: checkpoints are written then, with
    every optimizer state where Lightning expects it.
    """

    def __init__(
        self,
        plan: PhaseMemoryPlan,
        *,
        trainer: Any = None,
        actor_optimizer: torch.optim.Optimizer | None = None,
        critic_optimizer: torch.optim.Optimizer | None = None,
        critic: nn.Module | None = None,
        reference: nn.Module | None = None,
        reward_model: nn.Module | None = None,
        rollout_engine: Any = None,
        actor: nn.Module | None = None,
        teacher: Any = None,
    ) -> None:
        plan.validate()
        if getattr(rollout_engine, "needs_weight_sync", False) and actor is None:
            raise ValueError(
                f"PhaseMemory: the {rollout_engine.name} rollout engine holds weights of its own, so the plan needs"
                " the actor to sync them from after each update"
            )
        self.plan = plan
        self.trainer = trainer
        self.rollout_engine = rollout_engine
        self.actor = actor
        # A distillation teacher (lightning_mem.distillation.Teacher): its `on_device()` brings it in
        # for the teacher phase when it is parked on the host, and parks it again after.
        self.teacher = teacher
        self._engine_stale = True  # the engine's weights differ from the actor's (at start: it has none yet)
        #: The rollout engine's state in each phase (``"awake"``, ``"asleep(level 1)"``...), as last seen.
        self.engine_states: dict[str, str] = {}
        given = {
            "actor_optimizer": actor_optimizer,
            "critic_optimizer": critic_optimizer,
            "critic": critic,
            "reference": reference,
            "reward_model": reward_model,
        }
        self.components = {name: obj for name, obj in given.items() if obj is not None}
        self.locations: dict[str, Placement] = {name: "device" for name in self.components}
        self._optimizer_offloads: dict[str, contextlib.ExitStack] = {}
        self.seconds: dict[str, float] = {}
        self.current: str | None = None

    # -- moving things ----------------------------------------------------------------------
    def _to_host(self, name: str) -> None:
        obj = self.components[name]
        if name in _OPTIMIZERS:
            from lightning_mem.offload import offload_optimizer_state

            # The context manager is the primitive's bookkeeping (its ledger says "host" inside);
            # it stays open across phases until the plan wants the state back.
            stack = contextlib.ExitStack()
            stack.enter_context(offload_optimizer_state(obj, pin_memory=self.plan.pin_memory))
            self._optimizer_offloads[name] = stack
        else:
            from lightning_mem.offload import offload_module

            offload_module(obj, pin_memory=self.plan.pin_memory)
        self.locations[name] = "host"

    def _to_device(self, name: str) -> None:
        if name in _OPTIMIZERS:
            self._optimizer_offloads.pop(name).close()
        else:
            from lightning_mem.offload import reload_module

            reload_module(self.components[name])
        self.locations[name] = "device"

    def place(self, phase: str) -> None:
        """Move every component to where ``phase`` wants it: first out to the host, then in."""
        self.send_out(phase)
        self.bring_in(phase)

    def _wanted(self, phase: str) -> dict[str, Placement]:
        placement = self.plan.placement(phase)
        return {name: getattr(placement, name) for name in self.components}

    def send_out(self, phase: str) -> None:
        """Move to the host what ``phase`` wants there (the first half of :meth:`place`)."""
        for name, where in self._wanted(phase).items():
            if where == "host" and self.locations[name] == "device":
                self._to_host(name)

    def bring_in(self, phase: str) -> None:
        """Move to the device what ``phase`` wants there (the second half of :meth:`place`)."""
        wanted = self._wanted(phase)
        returned = [name for name, where in wanted.items() if where == "device" and self.locations[name] == "host"]
        for name in returned:
            self._to_device(name)
        if returned and self.plan.trim_host_memory:
            # The host copies just freed: glibc would keep their pages for later requests.
            release_free_host_memory()

    def restore(self) -> None:
        """Everything back on the device (end of fit, or an exception mid-step)."""
        for name in self.components:
            if self.locations[name] == "host":
                self._to_device(name)

    # -- the rollout engine ------------------------------------------------------------------
    def _engine_step(self, step: str, fn: Any, *args: Any) -> Any:
        """One engine transition, timed (``seconds["engine_<step>"]``) and shown to the MemoryMonitor
        as a phase of its own (nested in the phase it happens in)."""
        start = time.perf_counter()
        with _monitor_phase(self.trainer, f"engine_{step}"):
            out = fn(*args)
        self.seconds[f"engine_{step}"] = time.perf_counter() - start
        return out

    def _wake_engine(self) -> None:
        """Before a rollout, in the order that keeps the peak lowest (the optimizer state has already
        gone to the host in ``place``): the engine's weights, then the actor's weights into them,
        then the KV cache, which is the largest and only needed to generate."""
        engine = self.rollout_engine
        if not getattr(engine, "needs_weight_sync", False):
            return
        self._engine_step("wake_weights", engine.wake, ["weights"])
        if self._engine_stale or engine.weights_lost_in_sleep:
            self._engine_step("sync", engine.sync_weights, self.actor)
            self._engine_stale = False
        self._engine_step("wake_kv_cache", engine.wake, ["kv_cache"])

    def _sleep_engine(self) -> None:
        """After a rollout: an engine with weights of its own sleeps at its level (KV cache freed, and
        weights to the host or freed); the Hugging Face engine frees its static KV cache if the plan
        says so."""
        engine = self.rollout_engine
        if getattr(engine, "needs_weight_sync", False):
            self._engine_step("sleep", engine.sleep)
        elif self.plan.free_kv_cache:
            engine.free_kv_cache()

    # -- phases -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        engine = self.rollout_engine
        start = time.perf_counter()
        try:
            # What the phase sends to the host leaves before the phase is measured: its peak is what
            # it holds, not the previous phase's placement on its way out (a rollout whose working
            # set is smaller than the resting optimizer state would otherwise peak at its first
            # instant, with that state). What it brings onto the device is part of the phase.
            self.send_out(name)
            with _monitor_phase(self.trainer, name):
                self.bring_in(name)
                self.current = name
                if name == "rollout" and engine is not None:
                    self._wake_engine()
                if engine is not None and hasattr(engine, "state"):
                    self.engine_states[name] = engine.state
                with self.teacher.on_device() if name == "teacher" and self.teacher is not None else contextlib.nullcontext():
                    yield
        except BaseException:
            # An exception mid-step (an OOM, a bad reward, Ctrl-C): nothing stays parked on the
            # host, so whatever handles it (a checkpoint on exception, an OOM retry, a debugger)
            # sees every optimizer state and model where Lightning expects them.
            self.restore()
            raise
        finally:
            self.seconds[name] = time.perf_counter() - start
            self.current = None
        if name == "rollout" and engine is not None:
            self._sleep_engine()
        if name == "train":
            self._engine_stale = True  # the update changed the actor
        if self.plan.empty_cache_between_phases:
            release_cached_memory()


def _monitor_phase(trainer: Any, name: str) -> contextlib.AbstractContextManager:
    from lightning_mem.callbacks import memory_phase

    return memory_phase(trainer, name)
