"""The recipes' shared CLI: only working subcommands, early checks, safe checkpoints, clear resumes."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

import recipes.ppo as ppo
import recipes.qlora as qlora
import recipes.sft as sft
from lightning_mem.checkpointing import AtomicCheckpointIO, ResumeCheck, staged_directory
from lightning_mem.cli import DEBUG_ENV, run_command
from lightning_mem.data.rows import DataFormatError
from lightning_mem.export import export_hf
from lightning_mem.settings import SettingError
from tests.helpers import REPO, TINY_MODEL, run_recipe

CONFIG = str(REPO / "configs" / "sft" / "tiny_cpu.yaml")


def _sft(root, *extra):
    return sft.main([
        "fit", "--config", CONFIG, f"--trainer.default_root_dir={root}", "--trainer.enable_progress_bar=false",
        "--trainer.logger=false", "--trainer.val_check_interval=null", "--trainer.limit_val_batches=0",
        "--trainer.max_steps=2", "--model.lr_scheduler.init_args.warmup_steps=1", "--model.export_dir=null",
        "--data.max_tokens_per_batch=256", *extra,
    ])  # fmt: skip


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was reported")

    monkeypatch.setattr(sft, "load_causal_lm", refuse)


@pytest.mark.parametrize("main", [sft.main, ppo.main])
@pytest.mark.parametrize("subcommand", ["test", "predict"])
def test_subcommands_that_would_crash_are_not_offered(main, subcommand, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([subcommand, "--help"])
    assert exit_info.value.code != 0
    assert subcommand in capsys.readouterr().err  # "invalid choice: 'test'"


def test_help_lists_no_top_level_optimizer(capsys):
    with pytest.raises(SystemExit):
        sft.main(["fit", "--help"])
    out = capsys.readouterr().out
    assert "--optimizer" not in out and "--lr_scheduler" not in out
    assert "--model.optimizer" in out and "--model.lr_scheduler" in out


def test_ppo_offers_no_validate(capsys):
    # The PPO module has no validation step; SFT has one, so it keeps `validate`.
    with pytest.raises(SystemExit):
        ppo.main(["validate", "--help"])
    assert "validate" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        sft.main(["validate", "--help"])
    assert exit_info.value.code == 0


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("--trainer.accumulate_grad_batches=0", r"`trainer.accumulate_grad_batches` must be an int >= 1, got 0"),
        ("--trainer.max_epochs=-2", r"`trainer.max_epochs` must be an int >= -1 \(-1: no limit\), got -2"),
        ("--trainer.num_sanity_val_steps=-3", r"`trainer.num_sanity_val_steps` must be an int >= -1"),
        ("--trainer.limit_train_batches=1.5", r"`trainer.limit_train_batches` must be a fraction in \[0, 1\] or a whole"),
        ("--trainer.limit_val_batches=-1", r"`trainer.limit_val_batches` must be a fraction in \[0, 1\] or a whole"),
        ("--model.optimizer.init_args.lr=-0.001", r"`model.optimizer.init_args.lr` must be a finite learning rate >= 0"),
    ],
)
def test_bad_numbers_fail_before_any_model_naming_the_key(tmp_path, no_model_load, override, message):
    with pytest.raises(SettingError, match=message):  # a user error: one line at the command line
        _sft(tmp_path, override)


QLORA = str(REPO / "configs" / "qlora" / "tiny_cpu.yaml")
PPO = str(REPO / "configs" / "ppo" / "tiny_cpu.yaml")


@pytest.mark.parametrize(
    ("recipe", "config", "override", "key", "rule"),
    [
        ("sft", CONFIG, "--data.batch_size=0", "data.batch_size", "v>0"),
        ("sft", CONFIG, "--model.lora.lora_dropout=1", "lora_dropout", "v>=0 and v<1"),
        ("qlora", QLORA, "--model.lora.r=0", "model.lora.r", "v>0"),
        ("qlora", QLORA, "--model.quantization.quant_type=int4", "model.quantization.quant_type", "Literal['nf4', 'fp4']"),
        ("ppo", PPO, "--model.ppo.clip_ratio=2", "model.ppo.clip_ratio", "v>0 and v<1"),
        ("ppo", PPO, "--model.kl.horizon=0", "model.kl.horizon", "v>0"),
        ("ppo", PPO, "--model.generation.top_p=0", "model.generation.top_p", "v>0 and v<=1"),
        ("ppo", PPO, "--model.rollout_engine.sleep_level=3", "model.rollout_engine.sleep_level", "Literal[0, 1, 2]"),
        ("ppo", PPO, "--data.max_prompt_length=-3", "data.max_prompt_length", "v>0"),
    ],
)
def test_a_value_outside_its_typed_constraint_fails_while_parsing_naming_the_key(recipe, config, override, key, rule, capsys):
    main = {"sft": sft.main, "qlora": qlora.main, "ppo": ppo.main}[recipe]
    with pytest.raises(SystemExit) as exit_info:  # --print_config: nothing past the parser runs
        main(["fit", "--config", config, override, "--print_config"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f'Parser key "{key}"' in err and rule in err, err


@pytest.mark.parametrize(
    ("recipe", "config", "overrides", "message"),
    [
        ("qlora", QLORA, ["--model.quantization.bits=8", "--model.quantization.quant_storage=bfloat16"],
         r"^`model.quantization.quant_storage` applies to 4-bit weights only"),
        ("ppo", PPO, [f"--model.name_or_path={TINY_MODEL}", "--model.kl.target=1", "--model.kl.coef=0"],
         r"^`model.kl.target` \(adaptive KL\) needs an initial `model.kl.coef` > 0$"),
        ("sft", CONFIG, ["--data.max_tokens_per_batch=8"],
         r"^`data.max_tokens_per_batch` \(8\) is below `data.max_length` \(64\)"),
    ],
)
def test_a_rule_relating_fields_names_the_full_key_before_any_model(recipe, config, overrides, message, tmp_path, monkeypatch):
    for module in (sft, qlora, ppo):
        for name in ("load_causal_lm", "load_quantized_causal_lm"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, _refuse)
    main = {"sft": sft.main, "qlora": qlora.main, "ppo": ppo.main}[recipe]
    with pytest.raises(SettingError, match=message):
        main(["fit", "--config", config, f"--trainer.default_root_dir={tmp_path}", *overrides])


def _refuse(*args, **kwargs):
    raise AssertionError("a model was loaded before the bad input was reported")


def test_ckpt_path_last_without_a_checkpoint_warns_once_naming_the_folder(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli = _sft(tmp_path, "--ckpt_path=last")
    messages = [str(w.message) for w in caught if "last checkpoint" in str(w.message) or "last*.ckpt" in str(w.message)]
    assert messages == [f"--ckpt_path last: no last*.ckpt in {(tmp_path / 'checkpoints').resolve()}; training starts from scratch"]
    assert cli.trainer.global_step == 2
    # Every recipe's single-file checkpoints are written beside the target, then renamed.
    assert isinstance(cli.trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()


def test_resume_with_a_changed_lr_warns_naming_the_key(tmp_path):
    _sft(tmp_path)
    with pytest.warns(UserWarning, match=r"`model.optimizer.init_args.lr` is 0.002 in the config but the resumed checkpoint .* has 0.001"):
        cli = _sft(tmp_path, "--ckpt_path=last", "--trainer.max_steps=3", "--model.optimizer.init_args.lr=0.002")
    assert cli.trainer.global_step == 3


def test_resume_check_is_quiet_when_nothing_changed(tmp_path):
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    check = ResumeCheck(["model.optimizer"])
    trainer = type("T", (), {"ckpt_path": "x.ckpt", "optimizers": [optimizer]})()
    check.on_fit_start(trainer, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check.on_train_start(trainer, None)


# -- atomic writes ------------------------------------------------------------------------------


def test_checkpoint_write_failing_midway_leaves_the_previous_file(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    target = tmp_path / "last.ckpt"
    io.save_checkpoint({"step": 1}, target)
    real_save = torch.save

    def disk_full(obj, f, *args, **kwargs):
        f.write(b"\x80\x02 half a pickle")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        io.save_checkpoint({"step": 2}, target)
    monkeypatch.setattr(torch, "save", real_save)
    assert torch.load(target) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no temporary file left behind


class _FailingModel(torch.nn.Module):
    def save_pretrained(self, out, state_dict, safe_serialization):
        (out / "config.json").write_text("{}")
        raise RuntimeError("disk full while writing weights")


def test_failed_export_leaves_no_half_written_folder(tmp_path):
    trainer = type("T", (), {"strategy": type("S", (), {"barrier": lambda self, name: None})(), "is_global_zero": True})()
    out = tmp_path / "export"
    with pytest.raises(RuntimeError, match="disk full"):
        export_hf(trainer, _FailingModel(), None, out)
    assert not out.exists() and list(tmp_path.iterdir()) == []
    # A previous export survives a failed one.
    out.mkdir()
    (out / "model.safetensors").write_text("old")
    with pytest.raises(RuntimeError):
        export_hf(trainer, _FailingModel(), None, out)
    assert (out / "model.safetensors").read_text() == "old" and not (out / "config.json").exists()


def test_staged_directory_replaces_the_target_on_success(tmp_path):
    out = tmp_path / "export"
    out.mkdir()
    (out / "stale.bin").write_text("old")
    with staged_directory(out) as staging:
        (staging / "model.safetensors").write_text("new")
        assert not (out / "model.safetensors").exists()  # invisible until complete
    assert [p.name for p in out.iterdir()] == ["model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["export"]


def test_export_from_checkpoint_rejects_what_it_cannot_read(tmp_path):
    from lightning_mem.export import load_checkpoint_weights

    module = torch.nn.Linear(2, 2)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint_weights(module, tmp_path / "nope.ckpt")
    (tmp_path / "zero").mkdir()
    with pytest.raises(ValueError, match="not a sharded"):
        load_checkpoint_weights(module, tmp_path / "zero")
    torch.save({"weight": torch.zeros(2, 2)}, tmp_path / "plain.pt")
    with pytest.raises(ValueError, match="not a Lightning checkpoint"):
        load_checkpoint_weights(module, tmp_path / "plain.pt")
    torch.save({"state_dict": {"other.weight": torch.zeros(2, 2)}}, tmp_path / "other.ckpt")
    with pytest.raises(ValueError, match="tensors this model does not have"):
        load_checkpoint_weights(module, tmp_path / "other.ckpt")
    torch.save({"state_dict": {"weight": torch.ones(2, 2), "bias": torch.ones(2)}, "global_step": 7}, tmp_path / "ok.ckpt")
    assert load_checkpoint_weights(module, tmp_path / "ok.ckpt")["global_step"] == 7
    assert torch.equal(module.weight, torch.ones(2, 2))


# -- the command line: one line for a user's mistake, a traceback for a bug -------------------


def _raises(error):
    def main():
        raise error

    return main


@pytest.mark.parametrize("error", [SettingError("model.lr", " must be >= 0, got -1"),
                                   DataFormatError("train.jsonl:3: not valid JSON")])
def test_a_user_error_is_one_line_and_status_2(error, capsys, monkeypatch):
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    with pytest.raises(SystemExit) as exit_info:
        run_command(_raises(error))
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {error}"]


def test_debug_shows_the_user_errors_traceback_and_a_bug_keeps_its_own(monkeypatch):
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(SettingError):
        run_command(_raises(SettingError("model.lr", " must be >= 0")))
    monkeypatch.delenv(DEBUG_ENV)
    with pytest.raises(KeyError):  # not a user error: the traceback is the report
        run_command(_raises(KeyError("internal")))
    assert run_command(lambda: 7) == 7


def test_the_recipe_command_prints_a_bad_setting_as_one_line(tmp_path):
    result = run_recipe("sft", "fit", "--config", CONFIG, f"--trainer.default_root_dir={tmp_path}",
                        f"--model.name_or_path={tmp_path / 'no-such-model'}")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: `model.name_or_path`: model path '{tmp_path / 'no-such-model'}' does not exist"]


def test_a_negative_max_steps_is_one_line_at_the_command_line(tmp_path):
    # Lightning's own check raises from the Trainer's constructor, after the model is built.
    result = run_recipe("sft", "fit", "--config", CONFIG, f"--trainer.default_root_dir={tmp_path}",
                        "--trainer.max_steps", "-5")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: `trainer.max_steps` must be an int >= -1 (-1: no limit), got -5"]


def test_unactionable_library_lines_are_dropped_and_others_kept(caplog):
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    from lightning_mem.quiet import UNACTIONABLE_LOGS

    with caplog.at_level(logging.INFO):  # through Lightning's own helper, as Lightning prints it
        rank_zero_info("💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger]")
        rank_zero_info("GPU available: False, used: False")
    assert [r.getMessage() for r in caplog.records] == ["GPU available: False, used: False"]
    for name, prefix, _why in UNACTIONABLE_LOGS:  # e.g. DeepSpeed's logger, which does not propagate
        logger = logging.getLogger(name)
        record = logger.makeRecord(name, logging.WARNING, __file__, 1, prefix + " ...", (), None)
        assert not logger.filter(record), name
        assert logger.filter(logger.makeRecord(name, logging.WARNING, __file__, 1, "something else", (), None))
