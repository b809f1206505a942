"""Every shipped GPU-tier config trains on CPU as its tiny twin: 2 optimizer steps of SFT/QLoRA/DPO,
2 iterations (rollouts and their updates) of PPO, 2 optimizer steps of a reward model, through the real CLI.

A twin is the config as shipped, with only these overrides, derived from the YAML by
:func:`twin_of` (so a new config gets its twin without a new line here):

* the model: every ``name_or_path`` in ``model`` (actor, critic, reward model) becomes a copy of
  ``assets/tiny-llama`` whose config.json says ``torch_dtype: bfloat16``, as a real checkpoint's does;
* the device: ``trainer.accelerator: cpu``, ``trainer.devices`` cut to at most 2 ranks (4 where the
  config mixes data parallelism with a tensor or context degree, so both dimensions stay), on gloo;
  separate placement (``model.rollout_engine.placement: separate``) keeps its training ranks so cut
  and one generator process (``model.async_rollout.generator_devices: 1``, one CPU thread);
  a tensor or context degree is kept where the ranks and the tiny model's heads (8 query, 4 KV)
  allow it, else the largest degree that divides all three;
* the lengths: ``data.max_length`` / ``max_prompt_length`` / ``generation.max_new_tokens`` cut to
  what the tiny model holds, each token budget scaled by the same factor (never below one sequence;
  DPO's and a reward model's: one pair, two sides); a multi-turn config's trajectory budget
  (``model.multi_turn.max_total_tokens``) is its length;
  PPO's prompt batch cut to a few sequences per mini-batch;
* the run: 2 steps (PPO: 2 prompt batches), no validation, one checkpoint at the end, under tmp.

Strategy, optimizer, callbacks, memory plan, precision, accumulation, clipping and every recipe key
stay as shipped. What a CPU cannot exercise is said per twin in :attr:`Twin.cpu_gaps`, one line
each (``python tests/recipes/test_config_twins.py`` prints the table); a twin that cannot run at
all is skipped with its reason, one that fails on a known open fault is ``xfail(strict=True)``
naming the fault, so the fix flips it. A config the rules do not know fails
``test_every_config_has_a_twin_rule``.

The tiny configs (``tiny_*.yaml``) are the twins' own shape already: tests/recipes run each one
(``test_every_tiny_config_is_run_by_a_test``). The twins are their own ``make test`` step
(marker ``config_twin``, two workers), after the main suite.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `python tests/recipes/test_config_twins.py`

from tests.helpers import (  # noqa: E402
    REPO, TINY_MODEL, bf16_checkpoint_folder, csv_logger_args, read_metric, run_recipe,
)

CONFIGS = sorted((REPO / "configs").glob("*/*.yaml"))
GPU_CONFIGS = [p for p in CONFIGS if not p.name.startswith("tiny_")]
RECIPES = {"sft", "qlora", "ppo", "reward_model", "dpo"}
#: Recipes whose data are preference pairs: a micro-batch holds both sides, so its budget is two rows a pair.
PAIR_RECIPES = {"reward_model", "dpo"}

#: The tiny model's shape, which bounds the parallel degrees and lengths a twin can keep.
_TINY_CONFIG = json.loads((TINY_MODEL / "config.json").read_text())
TINY = {"heads": _TINY_CONFIG["num_attention_heads"], "kv_heads": _TINY_CONFIG["num_key_value_heads"],
        "positions": _TINY_CONFIG["max_position_embeddings"]}
MAX_RANKS = 2  # two CPU cores in CI
MAX_RANKS_MIXED = 4  # data parallel x a model-parallel degree: both dimensions kept
SFT_LENGTH = 64  # tokens per row: the arithmetic rows are ~16 tokens
PROMPT_LENGTH = 96  # the longest shipped system prompt and a question fit
NEW_TOKENS = 8
TRAJECTORY_LENGTH = 160  # a multi-turn twin's token budget: a tiny prompt, a few turns and replies

FSDP2 = "lightning_mem.strategies.FSDP2Strategy"
ZERO = "lightning_mem.strategies.deepspeed.ZeroStrategy"

#: Known open faults: (reason, whether a config has the combination, what its run prints). A twin
#: whose config has the combination is xfail(strict=True) on exactly that failure: any other
#: failure fails, and the fix flips it to XPASS (strict: a failure), so the mark goes with the fix.
KNOWN_FAULTS: list[tuple[str, Any, str]] = []  # none open: FSDP2 + bitsandbytes 8-bit, fused AdamW + bf16
# clipping and TP + SP + activation checkpointing were fixed (issues 36, 37)


class KnownFault(Exception):
    """A twin failed with the output of a known open fault (see KNOWN_FAULTS)."""


class NoTwinRule(ValueError):
    """The config has a key or value the twin rules do not know how to bring to CPU."""


@dataclasses.dataclass
class Twin:
    config: Path
    recipe: str
    ranks: int
    overrides: list[str]
    cpu_gaps: list[str]  # parts of the config a CPU run cannot exercise, one line each
    env: dict[str, str]
    skip: str | None = None
    xfail: str | None = None
    fault_output: str | None = None  # what the known fault prints (a regex)

    @property
    def id(self) -> str:
        return f"{self.config.parent.name}/{self.config.name}"


def _get(config: dict, dotted: str, default: Any = None) -> Any:
    node: Any = config
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return default
        node = node[key]
    return node


def _strategy(config: dict) -> tuple[str | None, dict]:
    strategy = _get(config, "trainer.strategy")
    if strategy is None or isinstance(strategy, str):
        return strategy, {}
    return strategy["class_path"], dict(strategy.get("init_args") or {})


def _fused_adamw_clipped_in_bf16(config: dict) -> bool:
    # torch picks foreach, never fused, when the YAML says neither: only `fused: true` brings this
    # fault to a twin.
    args = _get(config, "model.optimizer.init_args", {}) or {}
    return (args.get("fused") is True and str(_get(config, "trainer.precision", "")).startswith("bf16")
            and bool(_get(config, "trainer.gradient_clip_val")))


def _degree(degree: int, ranks: int) -> int:
    """The largest degree <= ``degree`` that divides the ranks and the tiny model's heads."""
    for d in range(min(degree, ranks), 0, -1):
        if ranks % d == 0 and TINY["heads"] % d == 0 and TINY["kv_heads"] % d == 0:
            return d
    return 1


def _scaled(budget: int | None, factor: float, floor: int) -> int | None:
    return None if budget is None else max(floor, math.ceil(budget * factor))


def _model_paths(node: Any, prefix: str) -> list[str]:
    """Dotted keys of every ``name_or_path`` under ``node``."""
    if not isinstance(node, dict):
        return []
    found = []
    for key, value in node.items():
        if key == "name_or_path" and value is not None:
            found.append(f"{prefix}.{key}")
        else:
            found += _model_paths(value, f"{prefix}.{key}")
    return found


def twin_of(path: Path, model: Path) -> Twin:
    """The tiny twin of the config at ``path``, with ``model`` as every model it names."""
    config = yaml.safe_load(path.read_text())
    recipe = path.parent.name
    if recipe not in RECIPES:
        raise NoTwinRule(f"{path}: no recipe named {recipe!r}")
    out = ["--trainer.accelerator=cpu", *(f"--{key}={model}" for key in _model_paths(config.get("model"), "model"))]
    gaps: list[str] = []
    env = {"OMP_NUM_THREADS": "1"}  # ranks x workers share two cores
    skip = None

    # Device, ranks and strategy.
    devices = _get(config, "trainer.devices", 1)
    if not isinstance(devices, int) or devices < 1:
        raise NoTwinRule(f"{path}: trainer.devices={devices!r}: a twin needs a count")
    if _get(config, "trainer.num_nodes", 1) != 1:
        gaps.append(f"trainer.num_nodes={_get(config, 'trainer.num_nodes')}: one host")
    name, args = _strategy(config)
    ranks = 1
    if name is None:
        if devices != 1:
            raise NoTwinRule(f"{path}: {devices} devices without a strategy")
    elif name == FSDP2:
        tp, cp = args.get("tensor_parallel_size", 1), args.get("context_parallel_size", 1)
        mixed = devices > tp * cp > 1
        ranks = min(devices, MAX_RANKS_MIXED if mixed else MAX_RANKS)
        model_ranks = ranks // 2 if mixed else ranks  # keep a data-parallel pair beside the degree
        for key, degree in (("tensor_parallel_size", tp), ("context_parallel_size", cp)):
            if degree > 1:
                kept = _degree(degree, model_ranks)
                out.append(f"--trainer.strategy.init_args.{key}={kept}")
                if kept != degree:
                    gaps.append(f"{key}: {degree} -> {kept} ({ranks} CPU ranks, tiny model's"
                                f" {TINY['heads']}/{TINY['kv_heads']} heads)")
        out.append("--trainer.strategy.init_args.process_group_backend=gloo")
        if args.get("pin_memory"):
            gaps.append("pin_memory: page-locked host buffers need CUDA")
        if args.get("cpu_offload"):
            gaps.append("cpu_offload: host and device are the same memory on CPU; pinned buffers need CUDA")
    elif name == ZERO:
        ranks = min(devices, MAX_RANKS)
        env["DS_ACCELERATOR"] = "cpu"
        if args.get("pin_memory"):
            gaps.append("pin_memory: page-locked host buffers need CUDA")
        skip = ("DeepSpeed ZeRO: Lightning's DeepSpeedStrategy.setup_environment refuses a non-CUDA accelerator;"
                " ZeRO on CPU runs only outside the Trainer (tests/strategies/test_deepspeed.py, slow)")
        out.append("--trainer.strategy.init_args.process_group_backend=gloo")
    else:
        raise NoTwinRule(f"{path}: no twin rule for strategy {name!r}")
    out.append(f"--trainer.devices={ranks}")
    if devices != ranks:
        gaps.append(f"trainer.devices: {devices} -> {ranks}")

    # Memory parts that need CUDA.
    optimizer = _get(config, "model.optimizer.class_path", "") or ""
    if "Paged" in optimizer:
        gaps.append(f"{optimizer.rsplit('.', 1)[-1]}: paging (CUDA managed memory) is off on CPU, the 8-bit step runs")
    callbacks = [c.get("class_path", "") if isinstance(c, dict) else str(c)
                 for c in _get(config, "trainer.callbacks", []) or []]
    if any(c.endswith("FitCheck") for c in callbacks):
        gaps.append("FitCheck: estimates for the card on CUDA only, a no-op on CPU")
    if any(c.endswith("MemoryMonitor") for c in callbacks):
        gaps.append("MemoryMonitor: device columns (allocated/reserved/NVML) need CUDA; host RSS is logged")
    if _get(config, "model.memory_plan"):
        gaps.append("memory_plan: host and device are the same memory on CPU: the moves run, nothing is freed")
    engine = _get(config, "model.rollout_engine.name", "hf")
    if engine == "vllm":
        out.append("--model.rollout_engine.name=hf")
        gaps.append("rollout_engine vllm -> hf: vLLM is not in the main env (.venv-vllm tests it);"
                    " sleep mode needs CUDA")
        if _get(config, "model.ppo.rollout_correction.mode", "none") != "none":
            # The hf engine samples with the actor itself: no drift to correct, and the recipe refuses it.
            out.append("--model.ppo.rollout_correction.mode=none")
            gaps.append("ppo.rollout_correction: corrects the vLLM engine's drift, none with the hf engine")
    elif engine != "hf":
        raise NoTwinRule(f"{path}: no twin rule for model.rollout_engine.name={engine!r}")
    if _get(config, "model.rollout_engine.placement", "colocated") == "separate":
        # The training ranks (cut as above) and one generator process, each on a thread of the 2 cores.
        generators = _get(config, "model.async_rollout.generator_devices", 1)
        out += ["--model.async_rollout.generator_devices=1", "--model.async_rollout.cpu_threads=1"]
        if generators != 1:
            gaps.append(f"async_rollout.generator_devices: {generators} -> 1 ({ranks} training rank(s) and 1 generator"
                        " process on 2 CPU cores; tests/recipes/test_ppo_async.py runs 2 generators)")
        gaps.append("separate placement: generators on GPUs of their own need CUDA; the rollout link is gloo either way")

    # Lengths, budgets and the run's length.
    run = ["--trainer.max_epochs=1", "--trainer.val_check_interval=null", "--trainer.limit_val_batches=0",
           "--trainer.log_every_n_steps=1", "--trainer.enable_progress_bar=false"]
    if recipe in ("sft", "qlora", *PAIR_RECIPES):
        length = _get(config, "data.max_length")
        if length is None:
            raise NoTwinRule(f"{path}: data.max_length is not set")
        factor = SFT_LENGTH / length
        floor = SFT_LENGTH * (2 if recipe in PAIR_RECIPES else 1)  # one pair is two sides
        out += [f"--data.max_length={SFT_LENGTH}",
                f"--data.max_tokens_per_batch={_scaled(_get(config, 'data.max_tokens_per_batch'), factor, floor)}"]
        run += ["--trainer.max_steps=2", "--checkpoint.every_n_train_steps=2"]
    else:
        prompt, new = _get(config, "data.max_prompt_length"), _get(config, "model.generation.max_new_tokens")
        if prompt is None or new is None:
            raise NoTwinRule(f"{path}: data.max_prompt_length and model.generation.max_new_tokens must be set")
        twin_prompt, twin_new = min(prompt, PROMPT_LENGTH), min(new, NEW_TOKENS)
        length, twin_len = prompt + new, twin_prompt + twin_new
        out += [f"--data.max_prompt_length={twin_prompt}", f"--model.generation.max_new_tokens={twin_new}"]
        trajectory = _get(config, "model.multi_turn.max_total_tokens")
        if trajectory is not None:  # multi-turn: a trajectory's token budget is its sequences' length
            length, twin_len = trajectory, min(trajectory, TRAJECTORY_LENGTH)
            out.append(f"--model.multi_turn.max_total_tokens={twin_len}")
        factor = twin_len / length
        for key in ("max_tokens_per_microbatch", "logprob_max_tokens_per_microbatch"):
            budget = _scaled(_get(config, f"model.ppo.{key}"), factor, twin_len)
            if budget is not None:
                out.append(f"--model.ppo.{key}={budget}")
        if _get(config, "model.reward_model.max_length") is not None:
            out.append(f"--model.reward_model.max_length={twin_prompt + twin_new}")
        # A few sequences per mini-batch: GRPO's groups count, each prompt is group_size sequences.
        minis = _get(config, "model.ppo.num_mini_batches", 1)
        group = _get(config, "model.grpo.group_size", 1) if _get(config, "model.advantage_estimator") != "gae" else 1
        batch = _get(config, "data.batch_size")
        if batch is None:
            raise NoTwinRule(f"{path}: data.batch_size is not set")
        out.append(f"--data.batch_size={min(batch, max(2, math.ceil(2 * minis / group)))}")
        # Two prompt batches: the second rollout comes after an update, so the memory plan's
        # train -> rollout moves run too. The checkpoint lands at the end.
        run += ["--trainer.max_steps=-1", "--trainer.limit_train_batches=2", "--checkpoint.every_n_train_steps=1000000"]
    if twin_length(out) > TINY["positions"]:
        raise NoTwinRule(f"{path}: the twin's sequences exceed the tiny model's {TINY['positions']} positions")

    fault = next(((reason, output) for reason, applies, output in KNOWN_FAULTS if applies(config)), (None, None))
    return Twin(path, recipe, ranks, [*out, *run], gaps, env, skip=skip, xfail=fault[0], fault_output=fault[1])


def twin_length(overrides: list[str]) -> int:
    values = dict(o[2:].split("=", 1) for o in overrides)
    if "data.max_length" in values:
        return int(values["data.max_length"])
    if "model.multi_turn.max_total_tokens" in values:
        return int(values["model.multi_turn.max_total_tokens"])
    return int(values["data.max_prompt_length"]) + int(values["model.generation.max_new_tokens"])


# --- the rules ----------------------------------------------------------------------------------


def test_every_config_has_a_twin_rule():
    problems = []
    for path in GPU_CONFIGS:
        try:
            twin_of(path, TINY_MODEL)
        except NoTwinRule as error:
            problems.append(str(error))
    assert problems == []


def test_every_tiny_config_is_run_by_a_test():
    sources = "\n".join(p.read_text() for p in (REPO / "tests").rglob("*.py"))
    unrun = [f"{p.parent.name}/{p.name}" for p in CONFIGS if p.name.startswith("tiny_")
             and f"configs/{p.parent.name}/{p.name}" not in sources
             and not re.search(rf"\b{p.parent.name}/{re.escape(p.stem)}\b|\"{re.escape(p.stem)}\"", sources)]
    assert unrun == []


def test_twin_keeps_degrees_the_tiny_heads_allow_and_scales_lengths():
    path = REPO / "configs/sft/llama-3.1-70b_lora_8x80gb_tp8.yaml"
    twin = twin_of(path, TINY_MODEL)
    assert twin.ranks == 2
    assert "--trainer.strategy.init_args.tensor_parallel_size=2" in twin.overrides
    assert "--data.max_length=64" in twin.overrides and "--data.max_tokens_per_batch=64" in twin.overrides
    cp = twin_of(REPO / "configs/ppo/qwen2.5-7b-instruct_grpo_8x80gb_cp4.yaml", TINY_MODEL)
    # 8 ranks = 2 replicas x 4 context ranks: the twin keeps both dimensions, 2 x 2.
    assert cp.ranks == 4 and "--trainer.strategy.init_args.context_parallel_size=2" in cp.overrides
    assert f"--model.name_or_path={TINY_MODEL}" in cp.overrides
    assert _degree(8, 4) == 4 and _degree(3, 4) == 2 and _degree(4, 2) == 2


def test_known_fault_marks_only_configs_with_its_combination(tmp_path, monkeypatch):
    fault = ("fused AdamW clipped under bf16 (an example fault)", _fused_adamw_clipped_in_bf16,
             r"does not allow for gradient clipping")
    monkeypatch.setattr(sys.modules[__name__], "KNOWN_FAULTS", [fault])
    config = {"trainer": {"devices": 1, "precision": "bf16-mixed", "gradient_clip_val": 1.0},
              "model": {"name_or_path": "Qwen/Qwen2.5-1.5B",
                        "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"fused": True}}},
              "data": {"max_length": 4096, "max_tokens_per_batch": 8192}}
    path = tmp_path / "sft" / "x_1x80gb.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(config))
    twin = twin_of(path, TINY_MODEL)
    assert "fused AdamW" in twin.xfail and twin.fault_output == r"does not allow for gradient clipping"
    assert "--data.max_tokens_per_batch=128" in twin.overrides  # two rows of the config, two of the twin
    config["model"]["optimizer"]["init_args"]["fused"] = False
    path.write_text(yaml.safe_dump(config))
    assert twin_of(path, TINY_MODEL).xfail is None


def test_vllm_rollouts_become_hf_with_their_gap_said(tmp_path):
    config = yaml.safe_load((REPO / "configs/ppo/qwen2.5-0.5b-instruct_1x24gb.yaml").read_text())
    config["model"]["rollout_engine"] = {"name": "vllm", "sleep_level": 1}
    config["model"]["ppo"]["rollout_correction"] = {"mode": "tis"}
    path = tmp_path / "ppo" / "x_1x24gb.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(config))
    twin = twin_of(path, TINY_MODEL)
    assert {"--model.rollout_engine.name=hf", "--model.ppo.rollout_correction.mode=none"} <= set(twin.overrides)
    assert any(gap.startswith("rollout_engine vllm -> hf") for gap in twin.cpu_gaps)


def test_twin_refuses_a_config_it_has_no_rule_for(tmp_path):
    path = tmp_path / "sft" / "x_8x80gb.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump({"trainer": {"devices": 8, "strategy": {"class_path": "my.Strategy"}},
                                    "data": {"max_length": 128}}))
    with pytest.raises(NoTwinRule, match="no twin rule for strategy 'my.Strategy'"):
        twin_of(path, TINY_MODEL)


# --- the runs -----------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def bf16_tiny(tmp_path_factory) -> Path:
    return bf16_checkpoint_folder(tmp_path_factory.mktemp("twin_model") / "tiny-llama-bf16")


def _param(path: Path) -> Any:
    twin = twin_of(path, TINY_MODEL)
    marks = [pytest.mark.config_twin]
    if twin.skip:
        marks.append(pytest.mark.skip(reason=twin.skip))
    elif twin.xfail:
        marks.append(pytest.mark.xfail(strict=True, raises=KnownFault, reason=twin.xfail))
    return pytest.param(path, id=twin.id, marks=marks)


@pytest.mark.parametrize("path", [_param(p) for p in GPU_CONFIGS])
def test_twin_trains_two_steps_on_cpu(path: Path, bf16_tiny: Path, tmp_path: Path, record_property):
    twin = twin_of(path, bf16_tiny)
    record_property("cpu_gaps", "; ".join(twin.cpu_gaps))
    args = ["fit", "--config", str(path), *twin.overrides, f"--trainer.default_root_dir={tmp_path}",
            *csv_logger_args(tmp_path)]
    result = run_recipe(twin.recipe, *args, env=twin.env)
    output = result.stdout + result.stderr
    if result.returncode != 0 and twin.fault_output and re.search(twin.fault_output, output):
        raise KnownFault(f"{twin.id}: {twin.xfail}")
    assert result.returncode == 0, f"{twin.id}:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    checkpoints = list((tmp_path / "checkpoints").glob("*"))
    assert checkpoints, f"{twin.id}: no checkpoint under {tmp_path}"
    assert (tmp_path / "export").is_dir(), f"{twin.id}: no export"
    # It trained: SFT/QLoRA/DPO logs a loss at both optimizer steps, PPO a reward per rollout; all finite.
    if twin.recipe == "ppo":
        rewards, losses = read_metric(tmp_path, "reward_mean"), read_metric(tmp_path, "policy_loss")
        assert len(rewards) == 2 and losses, (twin.id, rewards, losses)
        values = [*rewards.values(), *losses.values()]
    else:
        values = list(read_metric(tmp_path, "train_loss").values())
        assert len(values) == 2, (twin.id, values)
    assert all(math.isfinite(v) for v in values), (twin.id, values)


def main() -> None:
    """Print every twin: ranks, overrides and what a CPU cannot exercise."""
    for path in GPU_CONFIGS:
        twin = twin_of(path, TINY_MODEL)
        status = f"SKIP: {twin.skip}" if twin.skip else f"XFAIL: {twin.xfail}" if twin.xfail else "runs"
        print(f"{twin.id} ({twin.recipe}, {twin.ranks} rank(s)): {status}")
        print("   ", " ".join(twin.overrides))
        for gap in twin.cpu_gaps:
            print("    cpu gap:", gap)


if __name__ == "__main__":
    main()
