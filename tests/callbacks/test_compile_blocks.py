"""The CompileBlocks callback: the SFT recipe's tiny config with its blocks compiled by Inductor
logs the eager run's losses (checkpointing on too), the estimate sees the callback and says how,
and a setting that cannot work stops the run before any model loads."""

from __future__ import annotations

import json

import pytest

from lightning_mem.callbacks import CompileBlocks
from lightning_mem.settings import SettingError
from tests.helpers import REPO, read_metric, run_recipe, short_fit_args

CONFIG = str(REPO / "configs" / "sft" / "tiny_cpu.yaml")
# dynamic: one graph for the token-budget batches' varying lengths (the default compiles a static graph
# first, then a dynamic one: a second compile, which on the loaded 2-core box is minutes).
COMPILE = {"class_path": "lightning_mem.callbacks.CompileBlocks", "init_args": {"dynamic": True}}
CHECKPOINT = {"class_path": "lightning_mem.callbacks.ActivationCheckpointing", "init_args": {"every": 2}}


# Two recipe runs, one compiling 4 blocks with Inductor: minutes on 2 cores, so `slow`; the equality of
# compiled and eager training (Inductor on CPU, losses and every gradient) runs by default in
# tests/test_compile.py.
@pytest.mark.slow
def test_the_recipe_with_compiled_blocks_logs_the_eager_losses(tmp_path):
    losses, logs = {}, {}
    for name, callbacks in (("eager", []), ("compiled", [COMPILE, CHECKPOINT])):
        root = tmp_path / name
        extra = [f"--trainer.callbacks+={json.dumps(callbacks)}"] if callbacks else []
        done = run_recipe("sft", *short_fit_args(CONFIG, root, 4, "--model.export_dir=null", *extra))
        assert done.returncode == 0, done.stderr[-3000:]
        losses[name], logs[name] = read_metric(root, "train_loss"), done.stdout + done.stderr
    assert sorted(losses["compiled"]) == sorted(losses["eager"]) == [0, 1, 2, 3]
    for step, loss in losses["eager"].items():
        assert losses["compiled"][step] == pytest.approx(loss, rel=1e-4), step
    assert "CompileBlocks: 4 blocks of `model` compiled (inductor)" in logs["compiled"]


def test_the_estimate_runs_compiled_blocks_eager_and_says_so(tmp_path):
    from lightning_mem.estimate import estimate
    from lightning_mem.estimate.measure import filling_rows

    rows = filling_rows(tmp_path)["sft"]
    plain = estimate(CONFIG, [*rows, "--trainer.callbacks=[]"])
    compiled = estimate(CONFIG, [*rows, f"--trainer.callbacks={json.dumps([COMPILE])}"])
    assert compiled.device_peak_bytes == plain.device_peak_bytes
    assert any(note.startswith("CompileBlocks: blocks estimated eager") for note in compiled.notes), compiled.notes
    assert not any("CompileBlocks" in note for note in plain.notes)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(mode="reduce-overhead"), r"^`trainer.callbacks\[CompileBlocks\].init_args.mode` must be one of .*CUDA-graph"),
    (dict(backend="inductr"),
     r"^`trainer.callbacks\[CompileBlocks\].init_args.backend` 'inductr' is not a torch.compile backend"),
])
def test_a_setting_that_cannot_work_is_refused_at_parse_time(kwargs, message):
    with pytest.raises(SettingError, match=message):
        CompileBlocks(**kwargs)


@pytest.mark.slow
def test_under_fsdp2_with_the_strategys_checkpointing_compiled_blocks_log_the_eager_losses(tmp_path):
    """Two gloo ranks, CPU offload, every block checkpointed by the strategy before sharding, then
    compiled by the callback after it (aot_eager: the composition, not Inductor's code, is tested).
    About 4 minutes a run on the loaded 2-core box."""
    config = str(REPO / "configs" / "sft" / "tiny_cpu_fsdp2.yaml")
    compile_eager = {"class_path": "lightning_mem.callbacks.CompileBlocks",
                     "init_args": {"backend": "aot_eager", "dynamic": True}}
    losses = {}
    for name, callbacks in (("eager", []), ("compiled", [compile_eager])):
        root = tmp_path / name
        extra = [f"--trainer.callbacks+={json.dumps(callbacks)}"] if callbacks else []
        done = run_recipe("sft", *short_fit_args(config, root, 2, "--model.export_dir=null", *extra))
        assert done.returncode == 0, done.stderr[-3000:]
        losses[name] = read_metric(root, "train_loss")
    assert sorted(losses["compiled"]) == sorted(losses["eager"]) == [0, 1]
    for step, loss in losses["eager"].items():
        assert losses["compiled"][step] == pytest.approx(loss, rel=1e-5), step


def test_blocks_compile_once_for_the_whole_run_while_the_first_batch_is_observed(tmp_path):
    """TrainingDtypes (which every recipe adds) watches the first batch through a global module hook.
    Traced into the compiled blocks, its counter became a guard: each of a model's blocks recompiled
    in that batch until dynamo's limit of 8 sent the block's forward to eager for the rest of the run
    (on the H100 the compiled step was no faster than eager). Dynamo's ``eager`` backend: the guards
    and recompiles are dynamo's own, whatever backend follows."""
    import torch
    from lightning.pytorch import Trainer
    from torch._dynamo.utils import counters
    from torch.utils.data import DataLoader

    from benchmarks.step_time import synthetic_batches
    from lightning_mem.callbacks import TrainingDtypes
    from recipes.sft import SFTModule

    folder = tmp_path / "model"
    folder.mkdir()
    for file in (REPO / "assets" / "tiny-llama").iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = 12  # more blocks than dynamo's recompile limit
    (folder / "config.json").write_text(json.dumps(config))
    torch._dynamo.reset()
    counters.clear()
    module = SFTModule(str(folder), export_dir=None)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[CompileBlocks(backend="eager")])
    data = synthetic_batches(3, 2, 32, config["vocab_size"])
    trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=None, collate_fn=lambda b: b))
    assert counters["stats"]["unique_graphs"] == 1 and counters["frames"]["ok"] == 1, (
        dict(counters["stats"]), dict(counters["frames"]))
    # The recipe's observer still saw the first batch (eager blocks under its hook).
    observer = next(c for c in trainer.callbacks if isinstance(c, TrainingDtypes))
    assert observer.report is not None and sum(observer.report.compute.values()) > 0
    torch._dynamo.reset()
