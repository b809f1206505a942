"""ZeroStrategy and phase offload.

Four layers, by what the machine has:

* always (no DeepSpeed): validation before DeepSpeed is imported, the install hint, lazy import;
* DeepSpeed installed: the strategy's final config, phase-offload argument checks;
* ``slow`` (DeepSpeed, CPU): DeepSpeed itself trains a tiny model on 2 CPU processes (gloo,
  ``DS_ACCELERATOR=cpu``) with the configs this library produces, with and without a phase
  offload in between; this file is the worker (see ``__main__`` at the bottom);
* ``gpu``: a real Trainer run under ``ZeroStrategy``.

Run the slow one with ``pytest -m slow tests/strategies/test_deepspeed.py`` in an environment
with ``lightning-mem[deepspeed]``; the first run compiles DeepSpeed's CPU Adam and FusedAdam ops
(about 3 minutes each on 2 cores), later runs reuse them.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from torch import nn
from torch.nn import functional as F

from lightning_mem.settings import SettingError, SettingNotSupported
from lightning_mem.strategies.deepspeed import (
    ALL_STATES,
    INSTALL_HINT,
    TRAINING_STATES,
    ZeroStrategy,
    deepspeed_phase_offload,
    to_deepspeed_cpu_adam,
)
from lightning_mem.strategies.zero_config import ZeroTier, deepspeed_config, zero_tier

REPO = Path(__file__).resolve().parents[2]


# --- always: no DeepSpeed needed -------------------------------------------------------------


@pytest.fixture
def no_deepspeed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make `import deepspeed` fail, as on a machine without the extra."""
    for name in [m for m in sys.modules if m == "deepspeed" or m.startswith("deepspeed.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "deepspeed", None)


def test_missing_deepspeed_names_the_extra(no_deepspeed: None) -> None:
    with pytest.raises(SettingNotSupported, match=r"^`trainer.strategy`: ZeroStrategy needs DeepSpeed.*lightning-mem\[deepspeed\]"):
        ZeroStrategy("zero3_offload")
    assert "lightning-mem[deepspeed]" in INSTALL_HINT


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"stage": 2, "offload_params": "cpu"}, SettingError,
         r"^`trainer\.strategy\.init_args\.offload_params: cpu` needs `trainer\.strategy\.init_args\.stage: 3`"),
        ({"preset": "zero3_offload_nvme"}, SettingError, r"^`trainer\.strategy\.init_args\.nvme_path` is required"),
        ({"preset": "zero9"}, SettingError, r"^`trainer\.strategy\.init_args\.preset` 'zero9' is not a ZeRO preset"),
        ({"preset": "zero3_offload_nvme", "nvme_path": "/no/such/dir"}, FileNotFoundError,
         r"^`trainer\.strategy\.init_args\.nvme_path` '/no/such/dir' is not a directory"),
    ],
)
def test_bad_tiers_fail_before_deepspeed_is_needed(no_deepspeed: None, kwargs, error, match) -> None:
    # The tier is checked first: a bad YAML says what is wrong even where DeepSpeed is missing.
    with pytest.raises(error, match=match):
        ZeroStrategy(**kwargs)


def test_library_imports_without_deepspeed(no_deepspeed: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # Import the modules afresh while `import deepspeed` fails: none may need it at import time.
    for name in ("deepspeed", "zero_config", "zero_memory"):
        monkeypatch.delitem(sys.modules, f"lightning_mem.strategies.{name}", raising=False)
        module = importlib.import_module(f"lightning_mem.strategies.{name}")
        assert module.__name__ == f"lightning_mem.strategies.{name}"
    assert sys.modules["deepspeed"] is None


def _zero_strategy_configs() -> list[Path]:
    found = []
    for path in sorted(REPO.glob("configs/*/*.yaml")):
        if "lightning_mem.strategies.deepspeed.ZeroStrategy" in path.read_text():
            found.append(path)
    return found


def test_shipped_zero_configs_name_valid_tiers() -> None:
    # Every YAML using ZeroStrategy: its init_args are constructor arguments and its tier is
    # possible. (The recipes' own config test parses the whole file with the recipe's CLI.)
    configs = _zero_strategy_configs()
    assert configs, "no YAML uses ZeroStrategy"
    accepted = set(inspect.signature(ZeroStrategy.__init__).parameters) - {"self"}
    tier_fields = {"preset", *(f.name for f in dataclasses.fields(ZeroTier))}
    for path in configs:
        strategy = yaml.safe_load(path.read_text())["trainer"]["strategy"]
        init_args = strategy.get("init_args", {})
        assert set(init_args) <= accepted, f"{path}: unknown ZeroStrategy argument(s) {set(init_args) - accepted}"
        zero_tier(**{k: v for k, v in init_args.items() if k in tier_fields})
        lines = path.read_text().splitlines()
        header = lines[: next(i for i, line in enumerate(lines) if not line.startswith("#"))]
        assert any("ESTIMATE" in line for line in header), f"{path}: header must state the estimated peak memory"
        assert any(f"--config configs/{path.parent.name}/{path.name}" in line for line in header), (
            f"{path}: header must give the exact command"
        )


# --- DeepSpeed installed, no engine ----------------------------------------------------------


@pytest.mark.parametrize(
    ("preset", "overrides", "precision", "remote_device"),
    [
        ("zero2", {}, "bf16-true", None),
        ("zero2_offload", {"pin_memory": False}, "16-mixed", None),
        ("zero3_offload", {"reduce_bucket_size": 1000}, "bf16-mixed", "cpu"),
        ("zero3", {}, "32-true", None),
    ],
)
def test_strategy_config_is_the_pure_config_for_the_trainer_precision(preset, overrides, precision, remote_device):
    pytest.importorskip("deepspeed")
    from lightning.pytorch.plugins.precision import DeepSpeedPrecision

    strategy = ZeroStrategy(preset, **overrides)
    assert strategy.tier == zero_tier(preset, **overrides)
    assert strategy.remote_device == remote_device
    strategy.precision_plugin = DeepSpeedPrecision(precision)
    strategy._init_config_if_needed()  # what setup() and model_sharded_context() run first
    # Without a LightningModule Lightning adds no batch keys, so this is the whole config.
    assert strategy.config == deepspeed_config(zero_tier(preset, **overrides), precision)


def test_strategy_cpu_adam_off_and_extra_config_reach_the_config() -> None:
    pytest.importorskip("deepspeed")
    extra = {"zero_optimization": {"stage3_max_reuse_distance": 0}, "bf16": {"enabled": False}}
    strategy = ZeroStrategy("zero3_offload_optimizer", cpu_adam=False, extra_config=extra)
    from lightning.pytorch.plugins.precision import DeepSpeedPrecision

    strategy.precision_plugin = DeepSpeedPrecision("bf16-true")
    strategy._init_config_if_needed()
    assert strategy.config["zero_force_ds_cpu_optimizer"] is False
    assert strategy.config["zero_optimization"]["stage3_max_reuse_distance"] == 0
    assert strategy.config["bf16"] == {"enabled": False}  # an explicit extra_config key wins


def test_phase_offload_needs_a_set_up_engine() -> None:
    pytest.importorskip("deepspeed")
    with pytest.raises(RuntimeError, match=r"phase_offload needs the DeepSpeed engine"):
        ZeroStrategy("zero2").phase_offload()


class _EngineWithoutOffload:
    """An engine as an older DeepSpeed (or a non-ZeRO optimizer) presents it."""

    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)


@pytest.mark.parametrize(
    ("include", "error", "match"),
    [
        (["optim_states", "momentum"], ValueError, r"unknown state name\(s\) \['momentum'\]"),
        ("optim_states", ValueError, r"include='optim_states' must be a non-empty list"),
        ([], ValueError, r"must be a non-empty list"),
        (TRAINING_STATES, RuntimeError, r"offload_states/reload_states .*\(SGD\).* installed DeepSpeed"),
    ],
)
def test_phase_offload_rejects_what_it_cannot_do(include, error, match) -> None:
    pytest.importorskip("deepspeed")
    with pytest.raises(error, match=match):
        with deepspeed_phase_offload(_EngineWithoutOffload(), include):
            pass


def test_cpu_adam_conversion_refuses_what_cpu_adam_cannot_do() -> None:
    pytest.importorskip("deepspeed")
    params = [nn.Parameter(torch.zeros(2))]
    with pytest.raises(SettingNotSupported, match=r"^`cpu_adam: true` with `offload_optimizer`: .*replaces only torch.optim.Adam/AdamW.*SGD.*`cpu_adam: false`"):
        to_deepspeed_cpu_adam(torch.optim.SGD(params, lr=0.1))
    with pytest.raises(SettingNotSupported, match=r"^`cpu_adam: true`: .*amsgrad=True"):
        to_deepspeed_cpu_adam(torch.optim.AdamW(params, amsgrad=True))
    stepped = torch.optim.AdamW(params)
    params[0].grad = torch.ones(2)
    stepped.step()
    with pytest.raises(ValueError, match=r"fresh optimizer"):
        to_deepspeed_cpu_adam(stepped)


# --- slow: DeepSpeed trains on CPU with these configs ----------------------------------------


@pytest.mark.slow
def test_cpu_adam_keeps_groups_hyperparameters_and_scheduler() -> None:
    pytest.importorskip("deepspeed")
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    model = nn.Linear(4, 2)
    torch_opt = torch.optim.AdamW(
        [{"params": [model.weight], "weight_decay": 0.1}, {"params": [model.bias], "weight_decay": 0.0}],
        lr=1e-3,
        betas=(0.8, 0.9),
        eps=1e-6,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(torch_opt, lambda step: 0.5**step)
    cpu_adam = to_deepspeed_cpu_adam(torch_opt)
    assert isinstance(cpu_adam, DeepSpeedCPUAdam) and cpu_adam.adam_w_mode
    assert [g["params"] for g in cpu_adam.param_groups] == [[model.weight], [model.bias]]
    assert [g["weight_decay"] for g in cpu_adam.param_groups] == [0.1, 0.0]
    assert all(g["betas"] == (0.8, 0.9) and g["eps"] == 1e-6 for g in cpu_adam.param_groups)
    assert to_deepspeed_cpu_adam(cpu_adam) is cpu_adam
    assert not to_deepspeed_cpu_adam(torch.optim.Adam(model.parameters())).adam_w_mode

    # The scheduler built on the torch optimizer drives CPU Adam's learning rate...
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    expected = {name: p.detach().clone() for name, p in model.named_parameters()}
    reference = torch.optim.AdamW(
        [{"params": [expected["weight"]], "weight_decay": 0.1}, {"params": [expected["bias"]], "weight_decay": 0.0}],
        lr=1e-3,
        betas=(0.8, 0.9),
        eps=1e-6,
    )
    ref_scheduler = torch.optim.lr_scheduler.LambdaLR(reference, lambda step: 0.5**step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            for p in [*model.parameters(), *expected.values()]:
                p.requires_grad_(True)
                p.grad = None
            F.mse_loss(model(x), y).backward()
            F.mse_loss(F.linear(x, expected["weight"], expected["bias"]), y).backward()
            cpu_adam.step()
            reference.step()
            scheduler.step()
            ref_scheduler.step()
    assert [g["lr"] for g in cpu_adam.param_groups] == [1e-3 * 0.5**3] * 2
    # The cosmetic cost, documented in to_deepspeed_cpu_adam: torch warns once, at the first
    # scheduler step, because the scheduler's own (torch) optimizer never stepped.
    scheduler_warnings = [w for w in caught if "lr_scheduler.step()" in str(w.message)]
    assert len(scheduler_warnings) == 1
    # ...and CPU Adam computes AdamW.
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, expected[name], rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("deepspeed")
    from tests.helpers import HANG_GUARD_S

    out = tmp_path_factory.mktemp("deepspeed_cpu")
    # PYTHONPATH: the worker imports this checkout's lightning_mem, whatever is installed.
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__, str(out)]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return {"ranks": ranks}


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["zero2", "zero3_fused_adam", "zero2_offload"])
def test_phase_offload_round_trip_changes_no_result(cpu_run: dict[str, Any], scenario: str) -> None:
    for rank in cpu_run["ranks"]:
        plain, offloaded = rank[scenario]["plain"], rank[scenario]["offloaded"]
        # Bit-exact: every state came back exactly as it left, so training continues unchanged.
        assert offloaded == plain
        assert plain[-1] < plain[0] - 0.1  # and it trains


@pytest.mark.slow
def test_tiers_train_alike_within_bf16_noise(cpu_run: dict[str, Any]) -> None:
    for rank in cpu_run["ranks"]:
        full_offload = rank["zero3_offload"]["losses"]
        # Same init, same data, same AdamW math; different sharding, placement and kernels.
        # (DeepSpeed's stage 3 swaps in its own linear, so stage 2 and 3 differ in the last bits.)
        assert full_offload[0] == rank["zero3_fused_adam"]["plain"][0]
        for other in (rank["zero2"]["plain"], rank["zero3_fused_adam"]["plain"], rank["zero2_offload"]["plain"]):
            torch.testing.assert_close(torch.tensor(full_offload), torch.tensor(other), rtol=0.02, atol=0.02)
        assert rank["zero3_offload"]["optimizer"] == "DeepSpeedCPUAdam"


@pytest.mark.slow
def test_phase_offload_errors_on_engines_it_cannot_offload(cpu_run: dict[str, Any]) -> None:
    errors = cpu_run["ranks"][0]["errors"]
    assert "phase offload cannot move the states of an engine whose parameters are already offloaded" in errors[
        "zero3_offload"
    ]
    assert "only for its FusedAdam, but the optimizer is AdamW" in errors["zero3_torch_adamw"]


@pytest.mark.slow
def test_hugging_face_model_loads_sharded_under_zero3(cpu_run: dict[str, Any]) -> None:
    for rank in cpu_run["ranks"]:
        load = rank["hf_zero3_load"]
        assert load["partitioned"], "from_pretrained left whole tensors: zero.Init did not partition the model"
        assert load["num_params"] > 0 and load["mismatched"] == []  # the checkpoint's weights, exactly
        # ZeRO-3 runs the loaded model like the plain one (DeepSpeed's own linear: bf16 last bits).
        assert abs(load["loss"] - load["reference_loss"]) < 0.02
        assert load["zero3_enabled_in_fit"] and not load["zero3_enabled_after_teardown"]


# --- gpu: the strategy under a real Trainer --------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["zero2", "zero3_offload"])
def test_trainer_fits_with_zero_tier_and_phase_offload_frees_gpu_memory(preset: str, tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _TinyLM()
            self.losses: list[float] = []
            self.freed: list[int] = []

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            if preset == "zero2" and batch_idx == 2:
                # A PPO-style phase: optimizer state off the GPU while the model only runs forward.
                before = torch.cuda.memory_allocated()
                with self.trainer.strategy.phase_offload():
                    self.freed.append(before - torch.cuda.memory_allocated())
                    with torch.no_grad():
                        self.model(batch)
            loss = self.model(batch)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    # 8 identical micro-batches per epoch: batch_idx 2 (the phase) comes after two optimizer steps.
    data = torch.utils.data.DataLoader(_batch(0, 0).repeat(8, 1), batch_size=BATCH)
    module = Module()
    trainer = pl.Trainer(
        accelerator="cuda",
        devices=1,
        strategy=ZeroStrategy(preset),
        precision="bf16-true",
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, data)
    assert module.losses[-1] < module.losses[0] - 0.1
    assert trainer.strategy.config["bf16"] == {"enabled": True}
    if preset == "zero2":
        # fp32 master weights + Adam moments: 12 bytes per parameter left the GPU.
        num_params = sum(p.numel() for p in _TinyLM().parameters())
        assert len(module.freed) == 1 and module.freed[0] >= 12 * num_params
    else:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        assert isinstance(trainer.strategy.deepspeed_engine.basic_optimizer, DeepSpeedCPUAdam)


# --- the CPU worker (run by torch.distributed.run from `cpu_run`) ----------------------------

VOCAB, DIM, SEQ, BATCH = 64, 32, 16, 4


class _TinyLM(nn.Module):
    """Embedding, two MLP blocks, LM head: enough tensors for ZeRO to partition and gather."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM)) for _ in range(2)
        )
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens[:, :-1])
        for block in self.blocks:
            hidden = hidden + block(hidden)
        logits = self.head(self.norm(hidden)).float()
        return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _batch(rank: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + step % 2)  # two batches, seen repeatedly
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)


def _train(
    config: dict[str, Any],
    make_optimizer: Any,
    *,
    steps: int = 6,
    offload_after: int | None = None,
    include: tuple[str, ...] = TRAINING_STATES,
) -> tuple[list[float], Any]:
    import deepspeed

    torch.manual_seed(0)
    model = _TinyLM()
    optimizer = make_optimizer(model.parameters())
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    rank = torch.distributed.get_rank()
    losses = []
    for step in range(steps):
        batch = _batch(rank, step)
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if step == offload_after:
            with deepspeed_phase_offload(engine, include):
                with torch.no_grad():
                    engine(batch)  # the phase still runs the model forward (PPO rollouts)
    return losses, engine


def _config(preset: str, **overrides: Any) -> dict[str, Any]:
    # Exactly what ZeroStrategy hands DeepSpeed under Trainer(precision="bf16-true"), plus the keys
    # Lightning fills from the Trainer. param_persistence_threshold=0: partition even tiny tensors.
    return {
        **deepspeed_config(zero_tier(preset, **overrides), "bf16-true"),
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 1_000_000,
    }


def _worker(out: Path) -> None:
    import deepspeed
    from deepspeed.ops.adam import FusedAdam

    deepspeed.init_distributed(dist_backend="gloo")
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-2)  # noqa: E731
    cpu_adamw = lambda params: to_deepspeed_cpu_adam(adamw(params))  # noqa: E731
    fused = lambda params: FusedAdam(params, lr=1e-2, adam_w_mode=True, weight_decay=0.01)  # noqa: E731
    results: dict[str, Any] = {"errors": {}}

    for name, config, make_optimizer in [
        ("zero2", _config("zero2"), adamw),
        ("zero3_fused_adam", _config("zero3", param_persistence_threshold=0), fused),
        ("zero2_offload", _config("zero2_offload"), cpu_adamw),
    ]:
        plain, _ = _train(config, make_optimizer)
        offloaded, _ = _train(config, make_optimizer, offload_after=2, include=TRAINING_STATES)
        results[name] = {"plain": plain, "offloaded": offloaded}

    losses, engine = _train(_config("zero3_offload", param_persistence_threshold=0), cpu_adamw)
    results["zero3_offload"] = {"losses": losses, "optimizer": type(engine.basic_optimizer).__name__}
    try:
        with deepspeed_phase_offload(engine, ALL_STATES):
            pass
    except ValueError as err:
        results["errors"]["zero3_offload"] = str(err)

    _, engine = _train(_config("zero3", param_persistence_threshold=0), adamw, steps=1)
    try:
        with deepspeed_phase_offload(engine):
            pass
    except ValueError as err:
        results["errors"]["zero3_torch_adamw"] = str(err)

    results["hf_zero3_load"] = _hf_zero3_load(out)
    (out / f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps(results))


def _hf_zero3_load(out: Path) -> dict[str, Any]:
    """`from_pretrained` inside ZeroStrategy.model_sharded_context, as in a recipe's configure_model."""
    import deepspeed
    from lightning.fabric.plugins.environments import TorchElasticEnvironment
    from lightning.pytorch.accelerators import CPUAccelerator
    from lightning.pytorch.plugins.precision import DeepSpeedPrecision
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.integrations import is_deepspeed_zero3_enabled

    checkpoint = out / "tiny-llama"
    if torch.distributed.get_rank() == 0:
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=DIM,
            intermediate_size=2 * DIM,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
        )
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(checkpoint)
    torch.distributed.barrier()
    expected = load_file(checkpoint / "model.safetensors")
    batch = _batch(torch.distributed.get_rank(), 0)
    with torch.no_grad():
        reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
        reference_loss = reference(input_ids=batch, labels=batch).loss.item()

    # Under a Trainer, Lightning fills the micro-batch size from the dataloader before zero.Init.
    extra = {"train_micro_batch_size_per_gpu": BATCH}
    # (A CPU accelerator only so that `teardown` runs here; the Trainer would refuse it.)
    strategy = ZeroStrategy(
        "zero3",
        param_persistence_threshold=0,
        extra_config=extra,
        accelerator=CPUAccelerator(),
        cluster_environment=TorchElasticEnvironment(),
    )
    strategy.precision_plugin = DeepSpeedPrecision("bf16-true")
    with strategy.model_sharded_context():
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    partitioned = all(hasattr(p, "ds_id") and p.numel() == 0 for p in model.parameters())
    # The strategy's export path: gathered layer by layer, whole on rank 0.
    gathered = strategy.full_state_dict(model)
    mismatched = [name for name, t in gathered.items() if name in expected and not torch.equal(t, expected[name])]
    if strategy.is_global_zero and set(expected) - set(gathered):
        mismatched.append(f"missing: {sorted(set(expected) - set(gathered))}")
    config = {**strategy.config, "gradient_accumulation_steps": 1}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config)
    loss = engine(input_ids=batch, labels=batch).loss
    engine.backward(loss)
    engine.step()
    enabled_in_fit = is_deepspeed_zero3_enabled()
    strategy.teardown()
    return {
        "partitioned": partitioned,
        "mismatched": mismatched,
        "num_params": len(expected),
        "loss": loss.item(),
        "reference_loss": reference_loss,
        "zero3_enabled_in_fit": enabled_in_fit,
        "zero3_enabled_after_teardown": is_deepspeed_zero3_enabled(),
    }


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
