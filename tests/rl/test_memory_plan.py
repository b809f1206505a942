"""The per-phase memory plan: validation, and where things live in each phase (read from the
offload primitives' own bookkeeping, since host and device are the same memory on CPU)."""

import pytest
import torch
from torch import nn

from lightning_mem.offload import module_location, optimizer_state_location
from lightning_mem.rl.memory_plan import PhaseMemory, PhaseMemoryPlan, PhasePlacement
from lightning_mem.settings import settings_at


def gpu_tier_plan(**kwargs) -> PhaseMemoryPlan:
    """The GPU tiers' default: Adam state off the device outside training; ref and reward on the
    host outside scoring; the critic on the host during the rollout."""
    away = dict(actor_optimizer="host", critic_optimizer="host")
    return PhaseMemoryPlan(
        rollout=PhasePlacement(**away, critic="host", reference="host", reward_model="host"),
        score=PhasePlacement(**away),
        train=PhasePlacement(reference="host", reward_model="host"),
        **kwargs,
    )


def trained_optimizer(module: nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(module.parameters(), lr=0.1)
    module(torch.ones(3, 4, device=module.weight.device)).sum().backward()
    opt.step()
    return opt


@pytest.fixture
def parts():
    torch.manual_seed(0)
    actor, critic = nn.Linear(4, 4), nn.Linear(4, 1)
    return dict(
        actor_optimizer=trained_optimizer(actor),
        critic_optimizer=trained_optimizer(critic),
        critic=critic,
        reference=nn.Linear(4, 4),
        reward_model=nn.Linear(4, 1),
    )


def where(memory: PhaseMemory, parts: dict) -> dict[str, str]:
    """Each component's location according to the primitives' ledgers (not the plan's own record)."""
    out = {}
    for name, obj in parts.items():
        out[name] = optimizer_state_location(obj) if name.endswith("optimizer") else module_location(obj)
        assert out[name] == memory.locations[name], name
    return out


def test_each_phase_places_everything_as_declared(parts):
    memory = PhaseMemory(gpu_tier_plan(), **parts)
    memory.place("train")
    assert where(memory, parts) == dict(
        actor_optimizer="device", critic_optimizer="device", critic="device", reference="host", reward_model="host"
    )
    with memory.phase("rollout"):
        assert where(memory, parts) == dict(
            actor_optimizer="host", critic_optimizer="host", critic="host", reference="host", reward_model="host"
        )
    with memory.phase("score"):
        assert where(memory, parts) == dict(
            actor_optimizer="host", critic_optimizer="host", critic="device", reference="device", reward_model="device"
        )
    with memory.phase("train"):
        assert where(memory, parts)["actor_optimizer"] == "device"
        assert where(memory, parts)["reference"] == "host"
    assert set(memory.seconds) == {"rollout", "score", "train"}


def test_round_trips_leave_every_tensor_bit_identical(parts):
    before_state = {k: v.clone() for k, v in parts["actor_optimizer"].state_dict()["state"][0].items()}
    before_ref = parts["reference"].weight.detach().clone()
    memory = PhaseMemory(gpu_tier_plan(), **parts)
    for phase in ("train", "rollout", "score", "train", "rollout", "score", "train"):
        memory.place(phase)
    after_state = parts["actor_optimizer"].state_dict()["state"][0]
    for key, value in before_state.items():
        assert torch.equal(after_state[key], value), key
    memory.restore()
    assert torch.equal(parts["reference"].weight, before_ref)
    assert all(location == "device" for location in memory.locations.values())


@pytest.mark.parametrize("phase", ["rollout", "score", "train"])
def test_an_exception_mid_phase_brings_everything_back_to_the_device(parts, phase):
    memory = PhaseMemory(gpu_tier_plan(), **parts)
    memory.place("train")
    with pytest.raises(RuntimeError, match="boom"):
        with memory.phase(phase):
            assert "host" in where(memory, parts).values()  # the plan did park something
            raise RuntimeError("boom")
    assert set(where(memory, parts).values()) == {"device"}
    assert memory.current is None


def test_offloads_happen_before_reloads(parts):
    calls = []

    class Recording(PhaseMemory):
        def _to_host(self, name):
            calls.append(("host", name))
            super()._to_host(name)

        def _to_device(self, name):
            calls.append(("device", name))
            super()._to_device(name)

    memory = Recording(gpu_tier_plan(), **parts)
    memory.place("score")  # reference and reward stay, optimizers out
    calls.clear()
    memory.place("train")  # optimizers back in, reference and reward out
    kinds = [kind for kind, _ in calls]
    assert kinds == sorted(kinds, key=lambda k: k != "host"), calls  # every "host" move first
    assert {name for _, name in calls} == {"actor_optimizer", "critic_optimizer", "reference", "reward_model"}


def test_missing_components_are_skipped():
    actor = nn.Linear(4, 4)
    memory = PhaseMemory(gpu_tier_plan(), actor_optimizer=trained_optimizer(actor))  # GRPO with a reward rule
    with memory.phase("rollout"):
        assert optimizer_state_location(memory.components["actor_optimizer"]) == "host"
    assert set(memory.components) == {"actor_optimizer"}


def test_kv_cache_freed_after_rollout_only_when_asked():
    class Engine:
        freed = 0

        def free_kv_cache(self):
            self.freed += 1
            return True

    for free, expected in ((True, 1), (False, 0)):
        engine = Engine()
        memory = PhaseMemory(PhaseMemoryPlan(free_kv_cache=free), rollout_engine=engine)
        with memory.phase("rollout"):
            pass
        with memory.phase("score"):
            pass
        assert engine.freed == expected


@pytest.mark.parametrize(
    "phase, component",
    [("score", "reference"), ("score", "reward_model"), ("score", "critic"), ("train", "actor_optimizer"), ("train", "critic")],
)
def test_a_component_cannot_be_on_the_host_in_a_phase_that_uses_it(phase, component):
    plan = PhaseMemoryPlan(**{phase: PhasePlacement(**{component: "host"})})
    with pytest.raises(ValueError, match=rf"`model.memory_plan.{phase}.{component}` is 'host', but the {phase} phase"), settings_at("model.memory_plan"):
        plan.validate()


def test_unknown_placement_is_named():
    with pytest.raises(ValueError, match=r"`model.memory_plan.rollout.reference` must be 'device' or 'host', got 'gpu'"), settings_at("model.memory_plan.rollout"):
        PhaseMemoryPlan(rollout=PhasePlacement(reference="gpu")).validate()


def _devices(parts: dict) -> dict[str, str]:
    """Each component's location read from its tensors' devices (CUDA only: on CPU they are the same)."""
    out = {}
    for name, obj in parts.items():
        if name.endswith("optimizer"):
            tensors = [t for s in obj.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
        else:
            tensors = list(obj.parameters())
        kinds = {t.device.type for t in tensors}
        assert len(kinds) == 1, (name, kinds)
        out[name] = "device" if kinds == {"cuda"} else "host"
    return out


@pytest.mark.gpu
def test_each_phase_places_everything_on_the_declared_device_on_cuda():
    torch.manual_seed(0)
    actor, critic = nn.Linear(4, 4).cuda(), nn.Linear(4, 1).cuda()
    parts = dict(actor_optimizer=trained_optimizer(actor), critic_optimizer=trained_optimizer(critic), critic=critic,
                 reference=nn.Linear(4, 4).cuda(), reward_model=nn.Linear(4, 1).cuda())
    memory = PhaseMemory(gpu_tier_plan(), **parts)
    memory.place("train")
    assert _devices(parts) == dict(
        actor_optimizer="device", critic_optimizer="device", critic="device", reference="host", reward_model="host"
    )
    with memory.phase("rollout"):
        assert _devices(parts) == dict(
            actor_optimizer="host", critic_optimizer="host", critic="host", reference="host", reward_model="host"
        )
    with memory.phase("score"):
        assert _devices(parts) == dict(
            actor_optimizer="host", critic_optimizer="host", critic="device", reference="device", reward_model="device"
        )
    with memory.phase("train"):
        assert _devices(parts)["actor_optimizer"] == "device" and _devices(parts)["reference"] == "host"
    # The update works on the state that came back.
    actor(torch.ones(3, 4, device="cuda")).sum().backward()
    parts["actor_optimizer"].step()


@pytest.mark.parametrize("trim", [True, False])
def test_host_memory_trimmed_after_state_comes_back_when_asked(parts, monkeypatch, trim):
    from lightning_mem.rl import memory_plan

    calls = []
    monkeypatch.setattr(memory_plan, "release_free_host_memory", lambda: calls.append(1) or True)
    memory = PhaseMemory(gpu_tier_plan(trim_host_memory=trim), **parts)
    memory.place("train")
    calls.clear()
    memory.place("rollout")  # only moves out: nothing freed on the host yet
    assert calls == []
    memory.place("train")  # optimizer state back: its host copies freed
    assert calls == ([1] if trim else [])


def test_host_placements_are_named_as_the_config_names_them():
    assert gpu_tier_plan().host_placements() == [
        "rollout.actor_optimizer", "rollout.critic_optimizer", "rollout.critic", "rollout.reference",
        "rollout.reward_model", "score.actor_optimizer", "score.critic_optimizer", "train.reference",
        "train.reward_model",
    ]
    assert PhaseMemoryPlan().host_placements() == []


def test_a_phase_is_measured_after_what_it_sends_to_the_host_has_left(parts):
    """A phase observer (the MemoryMonitor, the estimate's recorder) starts measuring a phase once
    what the phase parks on the host is gone, and before what it brings back comes in: the phase's
    peak is what it holds, not the previous phase's placement on its way out."""
    import contextlib
    from types import SimpleNamespace

    seen: dict[str, dict[str, str]] = {}

    class Observer:
        @contextlib.contextmanager
        def phase(self, name):
            seen[name] = dict(memory.locations)
            yield

    memory = PhaseMemory(gpu_tier_plan(), trainer=SimpleNamespace(callbacks=[Observer()]), **parts)
    memory.place("train")
    with memory.phase("rollout"):
        pass
    with memory.phase("score"):
        pass
    with memory.phase("train"):
        pass
    # Entering the rollout: the optimizers and critic already on the host.
    assert seen["rollout"] == dict(actor_optimizer="host", critic_optimizer="host", critic="host",
                                   reference="host", reward_model="host")
    # Entering the score phase: the reference and reward model not back yet (they come in inside it).
    assert seen["score"]["reference"] == "host" and seen["score"]["reward_model"] == "host"
    # Entering train: the reference and reward model have left; the optimizers come back inside it.
    assert seen["train"] == dict(actor_optimizer="host", critic_optimizer="host", critic="device",
                                 reference="host", reward_model="host")
    assert memory.locations["actor_optimizer"] == "device"


def test_phase_boundaries_in_a_tiny_grpo_fit_start_no_full_collection(tmp_path, monkeypatch):
    """``empty_cache_between_phases`` releases after each phase without walking the whole heap: a full
    collection (~490,000 objects once the recipes are imported) cost a third of a tiny GRPO step."""
    import gc

    import recipes.ppo as ppo
    from lightning_mem.rl import memory_plan
    from tests.helpers import REPO, TINY_MODEL

    releases, full, in_release = [], [], []
    release = memory_plan.release_cached_memory

    def counted_release():
        # Only the release's own collections count: Python's automatic ones may come at any allocation.
        releases.append(1)
        in_release.append(True)
        try:
            release()
        finally:
            in_release.pop()

    def on_gc(phase, info):
        if phase == "start" and info["generation"] == 2 and in_release:
            full.append(1)

    monkeypatch.setattr(memory_plan, "release_cached_memory", counted_release)
    gc.callbacks.append(on_gc)
    try:
        ppo.main(["fit", "--config", str(REPO / "configs/ppo/tiny_cpu_grpo.yaml"), f"--model.name_or_path={TINY_MODEL}",
                  "--model.memory_plan.empty_cache_between_phases=true", "--trainer.max_steps=4",  # 2 GRPO steps
                  "--trainer.logger=false", "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={tmp_path}"])
    finally:
        gc.callbacks.remove(on_gc)
    assert len(releases) == 6  # three phases a step: the old release would have walked the heap 6 times
    assert full == []
