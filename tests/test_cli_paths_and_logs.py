"""RecipeCLI: configs work from any directory, the default logger, the run folder's files and
hyperparameters, and --ckpt_path files that are not checkpoints."""

from __future__ import annotations

import os
import shutil

import pytest
import yaml
from lightning.pytorch.loggers import CSVLogger

import recipes.ppo as ppo
import recipes.sft as sft
from lightning_mem.cli import RecipeCLI, flatten, search_dirs
from tests.helpers import ARITH, REPO, TINY_MODEL

SFT_CONFIG = REPO / "configs" / "sft" / "tiny_cpu.yaml"
PPO_CONFIG = REPO / "configs" / "ppo" / "tiny_cpu.yaml"


def _parse(recipe, *args):
    """Instantiate the recipe's model, data and trainer without running (nothing is loaded)."""
    module = {"sft": (sft.SFTModule, sft.SFTDataModule), "ppo": (ppo.PPOModule, ppo.PromptDataModule)}[recipe]
    return RecipeCLI(*module, args=list(args), run=False)


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """Run from a directory that holds none of the repository's files."""
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


# -- relative paths in configs ----------------------------------------------------------------------


def test_shipped_sft_config_works_from_another_directory(tmp_path, elsewhere):
    cli = _parse("sft", "--config", str(SFT_CONFIG), f"--trainer.default_root_dir={tmp_path / 'run'}")
    assert cli.datamodule.train_path == ARITH / "train.jsonl"
    assert cli.datamodule.val_path == ARITH / "val.jsonl"
    assert cli.model.hparams.name_or_path == str(TINY_MODEL)
    assert cli.datamodule.tokenizer_name == str(TINY_MODEL)


def test_shipped_ppo_config_works_from_another_directory_with_a_relative_config_path(tmp_path, elsewhere):
    relative = os.path.relpath(PPO_CONFIG, elsewhere)
    assert relative.startswith("..")
    cli = _parse("ppo", "--config", relative, "--model.name_or_path=assets/tiny-llama",
                 f"--trainer.default_root_dir={tmp_path / 'run'}")
    assert cli.datamodule.train_path == ARITH / "prompts.jsonl"
    assert cli.model.hparams.name_or_path == str(TINY_MODEL)


def test_user_config_finds_data_next_to_it_first(tmp_path, elsewhere):
    project = tmp_path / "project"
    (project / "cfg").mkdir(parents=True)
    (project / "cfg" / "rows.jsonl").write_text((ARITH / "val.jsonl").read_text())
    config = project / "cfg" / "mine.yaml"
    config.write_text(yaml.safe_dump({"model": {"name_or_path": str(TINY_MODEL)},
                                      "data": {"train_file": "rows.jsonl", "max_length": 64}}))
    cli = _parse("sft", "--config", str(config), f"--trainer.default_root_dir={tmp_path / 'run'}")
    assert cli.datamodule.train_path == project / "cfg" / "rows.jsonl"


def test_each_listed_reward_model_is_found_next_to_the_config(tmp_path, elsewhere):
    cfg = tmp_path / "project" / "cfg"
    for name in ("rm_a", "rm_b"):
        shutil.copytree(TINY_MODEL, cfg / name)
    config = cfg / "ppo.yaml"
    config.write_text(yaml.safe_dump({"model": {"reward": None, "reward_model": {"name_or_path": ["rm_a", "rm_b"]}}}))
    cli = _parse("ppo", "--config", str(PPO_CONFIG), "--config", str(config), "--model.name_or_path=assets/tiny-llama",
                 f"--trainer.default_root_dir={tmp_path / 'run'}")
    assert cli.model.reward_model_config.name_or_path == [str(cfg / "rm_a"), str(cfg / "rm_b")]


def test_missing_relative_path_names_the_key_and_every_folder_tried(tmp_path, elsewhere):
    config = tmp_path / "cfg" / "mine.yaml"
    config.parent.mkdir()
    (tmp_path / "cfg" / "pyproject.toml").write_text("")
    config.write_text(yaml.safe_dump({"model": {"name_or_path": str(TINY_MODEL)}, "data": {"train_file": "nope.jsonl"}}))
    with pytest.raises(FileNotFoundError) as err:
        _parse("sft", "--config", str(config))
    message = str(err.value)
    assert message.startswith("`data.train_file`: data file 'nope.jsonl' does not exist; a relative path is looked for under:")
    assert str(config.parent) in message and str(elsewhere) in message


def test_a_hub_id_for_the_model_is_left_alone():
    dirs = search_dirs([SFT_CONFIG])
    assert dirs[:2] == [SFT_CONFIG.parent, REPO]
    from lightning_mem.cli import resolve_input_path

    assert resolve_input_path("Qwen/Qwen2.5-0.5B", "model.name_or_path", dirs, may_be_hub_id=True) == "Qwen/Qwen2.5-0.5B"
    with pytest.raises(FileNotFoundError, match="`model.name_or_path`: model path './my-model' does not exist"):
        resolve_input_path("./my-model", "model.name_or_path", dirs, may_be_hub_id=True)


# -- the default logger ------------------------------------------------------------------------------


def test_default_logger_is_csv_under_the_root_even_with_tensorboard_installed(tmp_path, monkeypatch):
    from lightning.pytorch.trainer.connectors import logger_connector

    # Lightning's own default would switch to TensorBoardLogger with tensorboard importable.
    monkeypatch.setattr(logger_connector.logger_connector, "_TENSORBOARD_AVAILABLE", True, raising=False)
    cli = _parse("sft", "--config", str(SFT_CONFIG), f"--trainer.default_root_dir={tmp_path}")
    assert type(cli.trainer.logger) is CSVLogger
    assert cli.trainer.logger.log_dir == str(tmp_path / "logs" / "version_0")


def test_logger_false_stays_off(tmp_path):
    cli = _parse("sft", "--config", str(SFT_CONFIG), f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=false")
    assert cli.trainer.logger is None


# -- what reaches the logger -------------------------------------------------------------------------


def test_flatten_numbers_lists_of_mappings():
    tree = {"model": {"optimizer": {"init_args": {"lr": 1e-3, "betas": [0.9, 0.98]}}},
            "trainer": {"callbacks": [{"class_path": "A"}]}}
    assert flatten(tree) == {"model.optimizer.init_args.lr": 1e-3, "model.optimizer.init_args.betas": [0.9, 0.98],
                             "trainer.callbacks.0.class_path": "A"}


def _fit_two_steps(tmp_path, *extra):
    return sft.main([
        "fit", "--config", str(SFT_CONFIG), f"--trainer.default_root_dir={tmp_path}", "--trainer.max_steps=2",
        "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1", f"--data.train_file={ARITH / 'val.jsonl'}",
        "--model.export_dir=null", "--trainer.enable_progress_bar=false",
        "--model.lr_scheduler.init_args.warmup_steps=1", *extra,  # a warm-up longer than the run would warn
    ])


def test_run_folder_holds_config_memory_files_and_all_hyperparameters_csv(tmp_path):
    cli = _fit_two_steps(tmp_path)
    run = tmp_path / "logs" / "version_0"
    assert cli.trainer.logger.log_dir == str(run)
    for name in ("config.yaml", "memory.csv", "memory.png", "metrics.csv", "hparams.yaml"):
        assert (run / name).is_file(), name
    assert not (tmp_path / "config.yaml").exists()
    hparams = yaml.safe_load((run / "hparams.yaml").read_text())
    assert hparams["data.max_length"] == 64 and hparams["data.train_file"] == str(ARITH / "val.jsonl")
    assert hparams["model.optimizer.init_args.lr"] == 0.001 and hparams["model.optimizer.class_path"] == "torch.optim.AdamW"
    assert hparams["model.lr_scheduler.init_args.warmup_steps"] == 1
    assert hparams["trainer.max_steps"] == 2 and hparams["checkpoint.every_n_train_steps"] == 200
    # Once each, under its section: the module's own arguments are not logged a second time bare.
    assert hparams["model.name_or_path"] == str(TINY_MODEL) and "name_or_path" not in hparams
    assert yaml.safe_load((run / "config.yaml").read_text())["trainer"]["max_steps"] == 2


def test_run_folder_holds_config_and_memory_files_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")  # in the dev extra; CI installs it
    cli = _fit_two_steps(tmp_path, "--trainer.logger=lightning.pytorch.loggers.TensorBoardLogger",
                         f"--trainer.logger.save_dir={tmp_path}", "--trainer.logger.name=tb")
    run = tmp_path / "tb" / "version_0"
    assert cli.trainer.logger.log_dir == str(run)
    for name in ("config.yaml", "memory.csv", "memory.png", "hparams.yaml"):
        assert (run / name).is_file(), name
    assert list(run.glob("events.out.tfevents.*"))
    hparams = yaml.safe_load((run / "hparams.yaml").read_text())
    assert hparams["data.max_length"] == 64 and hparams["model.optimizer.init_args.lr"] == 0.001


# -- --ckpt_path that is not a checkpoint ------------------------------------------------------------


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad input was reported")

    monkeypatch.setattr(sft, "load_causal_lm", refuse)


@pytest.mark.parametrize(
    ("content", "message"),
    [(b"", r"is empty \(0 bytes\)"), (b"\x93NUMPY random bytes" * 50, r"is not a PyTorch checkpoint")],
    ids=["zero-bytes", "random"],
)
def test_bad_checkpoint_file_is_named_before_the_model_loads(tmp_path, no_model_load, content, message):
    ckpt = tmp_path / "bad.ckpt"
    ckpt.write_bytes(content)
    with pytest.raises(ValueError, match=rf"`ckpt_path`: '.*bad\.ckpt' {message}"):
        _fit_two_steps(tmp_path, f"--ckpt_path={ckpt}")


def test_missing_checkpoint_file_is_named(tmp_path, no_model_load):
    with pytest.raises(FileNotFoundError, match=r"`ckpt_path`: '.*none\.ckpt' does not exist"):
        _fit_two_steps(tmp_path, f"--ckpt_path={tmp_path / 'none.ckpt'}")
