"""``--suggest``: only what changes the config and lowers its peak; when nothing fits, one line that
says so and the smallest way down the LoRA/QLoRA ladder that does, with its command and estimate.

The logic is shown with parsed configs (no estimate) and stand-in estimates; one real run of the
command, shared by the module, shows it end to end on the tiny configs (about ten tiny estimates).
"""

from __future__ import annotations

import functools
import json

import pytest

from lightning_mem.estimate import Estimate, PhaseEstimate, estimate
from lightning_mem.estimate.__main__ import main
from lightning_mem.estimate.recipe_config import parse_config
from lightning_mem.estimate.report import GiB, device_needed, suggestions_text, usable_bytes
from lightning_mem.estimate.smaller import LORA_OVERRIDES, smaller_ways
from lightning_mem.estimate.suggest import candidates, suggest

CKPT = "--trainer.callbacks+=lightning_mem.callbacks.ActivationCheckpointing"
OFFLOAD = "--trainer.callbacks+=lightning_mem.callbacks.ActivationOffload"
EIGHT_BIT = "--model.optimizer=bitsandbytes.optim.PagedAdamW8bit"
SPLIT = "--data.max_tokens_per_batch=512"
FSDP2_CKPT = "--trainer.strategy.init_args.activation_checkpointing=1"
FSDP2_OFFLOAD = "--trainer.strategy.init_args.cpu_offload=true"


@functools.cache
def _parsed(recipe: str, config: str, *overrides: str):
    return parse_config(recipe, ["--config", config, *overrides])[1]


def _offered(recipe: str, config: str, *overrides: str) -> list[str]:
    return [arg for c in candidates(_parsed(recipe, config, *overrides), recipe) for arg in c.overrides]


def test_a_config_holding_a_technique_is_not_offered_it_again():
    # The 8B config checkpoints every block and offloads to the CPU under FSDP2: neither is offered.
    offered = _offered("recipes.sft", "configs/sft/llama-3.1-8b_1x24gb.yaml")
    assert FSDP2_CKPT not in offered and FSDP2_OFFLOAD not in offered and CKPT not in offered
    assert EIGHT_BIT in offered and OFFLOAD in offered
    # The same config without them is offered both.
    offered = _offered("recipes.sft", "configs/sft/llama-3.1-8b_1x24gb.yaml",
                       "--trainer.strategy.init_args.activation_checkpointing=false",
                       "--trainer.strategy.init_args.cpu_offload=false")
    assert FSDP2_CKPT in offered and FSDP2_OFFLOAD in offered
    # Callbacks and optimizers already there.
    assert CKPT in _offered("recipes.sft", "configs/sft/tiny_cpu.yaml")
    assert CKPT not in _offered("recipes.sft", "configs/sft/tiny_cpu.yaml", CKPT)
    assert EIGHT_BIT not in _offered("recipes.sft", "configs/sft/tiny_cpu_adamw8bit.yaml")
    # QLoRA checkpoints with its own switch, offered only where it is off.
    assert not any("activation_checkpointing" in a for a in _offered("recipes.qlora", "configs/qlora/tiny_cpu.yaml"))
    assert "--model.activation_checkpointing=true" in _offered(
        "recipes.qlora", "configs/qlora/tiny_cpu.yaml", "--model.activation_checkpointing=false")


def test_ppo_is_offered_to_park_only_the_optimizer_state_its_plan_keeps_on_the_device():
    tiny = "--model.name_or_path=assets/tiny-llama"  # not the SFT demo's export: nothing loads
    gae = [c for c in candidates(_parsed("recipes.ppo", "configs/ppo/tiny_cpu.yaml", tiny), "recipes.ppo")
           if c.kind == "state_on_host"]
    assert [c.overrides for c in gae] == [[f"--model.memory_plan.{phase}.{role}_optimizer=host"
                                           for phase in ("rollout", "score") for role in ("actor", "critic")]]
    parked = _parsed("recipes.ppo", "configs/ppo/tiny_cpu_grpo.yaml", tiny,
                     "--model.memory_plan.rollout.actor_optimizer=host")
    grpo = [c for c in candidates(parked, "recipes.ppo") if c.kind == "state_on_host"]  # no critic, rollout's parked
    assert [c.overrides for c in grpo] == [["--model.memory_plan.score.actor_optimizer=host"]]


def _estimate(peak_gib: float) -> Estimate:
    peak = int(peak_gib * GiB)
    phase = PhaseEstimate("train", peak, {"weights": peak // 4, "gradients": 0, "optimizer_state": peak // 4,
                                          "activations": peak // 2}, 0)
    return Estimate("c.yaml", "recipes.sft", 1, "single device", [phase])


def test_a_candidate_that_raises_the_peak_is_dropped_and_never_combined():
    """Stand-in estimates, by which candidates a run applies: 8-bit AdamW raises the peak (as under
    FSDP2 CPU offload); the others lower it, none enough alone, and offload adds nothing to a
    combination that checkpoints (what it would stash is recomputed)."""
    cfg = _parsed("recipes.sft", "configs/sft/tiny_cpu.yaml")
    peaks = {(): 10.0, (SPLIT,): 9.0, (CKPT,): 8.0, (EIGHT_BIT,): 11.0, (OFFLOAD,): 8.5,
             (SPLIT, CKPT): 7.0, (SPLIT, CKPT, OFFLOAD): 7.5}
    runs: list[tuple[str, ...]] = []

    def run_estimate(args: list[str]) -> Estimate:
        applied = tuple(a for a in (SPLIT, CKPT, EIGHT_BIT, OFFLOAD) if a in args)
        runs.append(applied)
        return _estimate(peaks[applied])

    device = int((6.0 * GiB + GiB) / 0.9) + 1  # 6 GiB usable: nothing fits
    advice = suggest(cfg, "recipes.sft", [], device, run_estimate, base=_estimate(10.0), config="c.yaml")
    assert [(s["what"].count("+") + 1, s["device_peak_bytes"] / GiB) for s in advice.suggestions] == \
        [(1, 9.0), (1, 8.0), (2, 7.0), (1, 8.5)]  # offload alone lowers the peak; with the others it does not
    assert not advice.fits and advice.smaller is None  # no estimate_config: the ladder is not looked for
    assert [(s["overrides"][0], s["device_peak_bytes"] / GiB) for s in advice.dropped] == [(EIGHT_BIT, 11.0)]
    assert all(EIGHT_BIT not in run for run in runs if len(run) > 1)  # never combined
    assert not any(EIGHT_BIT in " ".join(s["overrides"]) for s in advice.suggestions)
    text = suggestions_text(advice.suggestions, advice.dropped, smaller=advice.smaller, peak=10 * GiB,
                            device_bytes=device)
    assert "  not suggested, no lower than the config's own 10.00 GiB: 8-bit paged AdamW (optimizer state ~2 bytes" \
           " per parameter) at 11.00 GiB" in text.splitlines()
    assert text.splitlines()[-1] == ("nothing fits 7.8 GiB (6.00 GiB usable): the lowest this run reaches is 7.00 GiB"
                                     " (2 of the above combined), which needs a device of at least 8.9 GiB")
    # Where one fits, it is a suggestion and the ladder is not looked for.
    peaks[(OFFLOAD,)] = 5.0
    advice = suggest(cfg, "recipes.sft", [], device, run_estimate, base=_estimate(10.0), config="c.yaml",
                     estimate_config=lambda *a: pytest.fail("the ladder was looked for"))
    assert advice.fits and [s["overrides"] for s in advice.suggestions if s["fits"]] == [[OFFLOAD]]


def test_the_device_a_peak_needs_is_the_smallest_whose_usable_bytes_hold_it():
    for peak in (1, GiB, int(5.21 * GiB), 70 * GiB):
        need = device_needed(peak)
        assert usable_bytes(int(need * GiB)) >= peak > usable_bytes(int((need - 0.1) * GiB))


def test_the_ladder_goes_down_from_where_the_run_stands():
    """Full weights: LoRA on the run, then the shipped LoRA and QLoRA configs of the same model;
    LoRA: QLoRA only; QLoRA: nothing. It stops at the first that fits."""
    seen: list[tuple[str, tuple[str, ...], str, int | None]] = []

    def estimate_config(config, args, recipe, ranks, peak=1.0):
        seen.append((config, tuple(args), recipe, ranks))
        return _estimate(peak)

    full = _parsed("recipes.sft", "configs/sft/tiny_cpu.yaml")
    ways = smaller_ways(full, "recipes.sft", "configs/sft/tiny_cpu.yaml", ["--data.max_length=32"], 1, 0,
                        estimate_config)
    assert [(w["config"], w["recipe"], w["overrides"]) for w in ways] == [
        ("configs/sft/tiny_cpu.yaml", "recipes.sft", ["--data.max_length=32", *LORA_OVERRIDES]),
        ("configs/sft/tiny_cpu_lora.yaml", "recipes.sft", []),
        ("configs/qlora/tiny_cpu.yaml", "recipes.qlora", []),
    ]
    assert [r for *_, r in seen] == [1, None, None]  # the run's ranks; a shipped config's own
    assert ways[0]["command"] == ("python -m recipes.sft fit --config configs/sft/tiny_cpu.yaml --data.max_length=32 "
                                  + " ".join(LORA_OVERRIDES))
    seen.clear()
    lora = _parsed("recipes.sft", "configs/sft/tiny_cpu_lora.yaml")
    assert [w["config"] for w in smaller_ways(lora, "recipes.sft", "configs/sft/tiny_cpu_lora.yaml", [], 1,
                                              2 * GiB, estimate_config)] == ["configs/qlora/tiny_cpu.yaml"]
    qlora = _parsed("recipes.qlora", "configs/qlora/tiny_cpu.yaml")
    assert smaller_ways(qlora, "recipes.qlora", "configs/qlora/tiny_cpu.yaml", [], 1, 0, estimate_config) == []
    seen.clear()
    first = smaller_ways(full, "recipes.sft", "configs/sft/tiny_cpu.yaml", [], 1, 2 * GiB, estimate_config)
    assert len(first) == len(seen) == 1 and first[0]["fits"]  # LoRA on the run fits: nothing more is estimated


@pytest.fixture(scope="module")
def nothing_fits():
    """The tiny SFT config on a 1.15 GiB device (0.035 GiB usable): the command's JSON."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["--config", "configs/sft/tiny_cpu.yaml", "--device-memory", "1.15GiB", "--suggest", "--json"])
    return code, json.loads(out.getvalue())


def test_nothing_fits_names_the_smallest_way_that_does_with_its_command_and_estimate(nothing_fits):
    code, out = nothing_fits
    assert code == 1 and out["fits"] is False
    assert out["suggestions"] and not any(s["fits"] for s in out["suggestions"])
    assert all(s["device_peak_bytes"] < out["device_peak_bytes"] for s in out["suggestions"])  # each lowers it
    ways = out["smaller"]
    assert [w["config"] for w in ways] == ["configs/sft/tiny_cpu.yaml", "configs/sft/tiny_cpu_lora.yaml",
                                           "configs/qlora/tiny_cpu.yaml"]
    assert [w["fits"] for w in ways] == [False, False, True]
    qlora = ways[-1]
    assert qlora["command"] == "python -m recipes.qlora fit --config configs/qlora/tiny_cpu.yaml"
    assert qlora["device_peak_bytes"] == estimate("configs/qlora/tiny_cpu.yaml").device_peak_bytes
    lines = suggestions_text(out["suggestions"], out["dropped"], smaller=ways, peak=out["device_peak_bytes"],
                             device_bytes=out["device_memory_bytes"]).splitlines()
    assert lines[-2].startswith("nothing fits 1.1 GiB (0.03 GiB usable): the lowest this run reaches is ")
    assert lines[-2].endswith(f"; the smallest way that does: the shipped QLoRA config configs/qlora/tiny_cpu.yaml,"
                              f" estimated at {qlora['device_peak_bytes'] / GiB:.2f} GiB:")
    assert lines[-1] == "  python -m recipes.qlora fit --config configs/qlora/tiny_cpu.yaml"
    assert sum(line.startswith("nothing fits") for line in lines) == 1


def test_auto_fit_and_fit_check_name_the_smallest_way_when_nothing_fits(nothing_fits):
    from lightning_mem import auto_fit
    from lightning_mem.callbacks import FitCheck
    from lightning_mem.settings import SettingError

    _, out = nothing_fits
    with pytest.raises(SettingError, match=r"no suggestion fits \(.*\); the smallest way that does: the shipped QLoRA"
                                           r" config configs/qlora/tiny_cpu.yaml, estimated at 0.0\d GiB: python -m"
                                           r" recipes.qlora fit --config configs/qlora/tiny_cpu.yaml; see"):
        auto_fit.choose(out)
    with pytest.warns(UserWarning, match=r"nothing else fits; the smallest way that does \(0.0 GiB\): the shipped"
                                         r" QLoRA config .*: python -m recipes.qlora fit --config"
                                         r" configs/qlora/tiny_cpu.yaml"):
        FitCheck().report(out)
