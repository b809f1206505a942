"""The recipes' shared CLI: only working subcommands, early checks, safe checkpoints, clear resumes."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

import recipes.ppo as ppo
import recipes.qlora as qlora
import recipes.sft as sft
from lightning_mem import quantized_lora
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
    for module in (sft, qlora, ppo, quantized_lora):  # the QLoRA recipe loads through quantized_lora
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


# -- a callback's, a strategy's, a recipe's check: one line naming the key, also from inside Lightning --

FSDP2 = str(REPO / "configs" / "sft" / "tiny_cpu_fsdp2.yaml")
OIB = "lightning_mem.callbacks.OptimizerInBackward"
CALLBACK_AC = "lightning_mem.callbacks.ActivationCheckpointing"


def _one_error_line(result) -> str:
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    return errors[0]


@pytest.mark.parametrize(("recipe", "args", "line"), [
    # A callback's check in its `setup` hook, raised inside Lightning's fit (the command).
    ("sft", ["--config", CONFIG, f"--trainer.callbacks+={OIB}", "--model.optimizer=bitsandbytes.optim.PagedAdamW8bit"],
     "error: `trainer.callbacks[OptimizerInBackward]` cannot run with `trainer.gradient_clip_val: 1.0`: gradients are"
     " freed one by one"),
    # A strategy's constructor, which jsonargparse wraps in its own "Does not validate" error.
    ("sft", ["--config", FSDP2, "--trainer.strategy.init_args.tensor_parallel_size=2"],
     "error: `trainer.strategy.init_args.cpu_offload: true` cannot be combined with"
     " `trainer.strategy.init_args.tensor_parallel_size: 2`"),
    # A class the model's constructor takes (the reward), wrapped the same way.
    ("ppo", ["--config", PPO, f"--model.name_or_path={TINY_MODEL}", "--model.reward=recipes.rewards.ArithmeticReward",
             "--model.reward.init_args.partial=1.0"],
     "error: `model.reward.init_args.partial` must be in [0, 1), got 1.0"),
], ids=["callback-hook", "strategy-constructor", "ppo-reward"])
def test_a_check_inside_lightning_or_a_constructor_is_one_line_at_the_command_line(tmp_path, recipe, args, line):
    result = run_recipe(recipe, "fit", *args, f"--trainer.default_root_dir={tmp_path}")
    assert _one_error_line(result).startswith(line)


def _command_line(main, args, capsys) -> str:
    """``main(args)`` as the command line runs it: the one ``error:`` line it prints, status 2."""
    with pytest.raises(SystemExit) as exit_info:
        run_command(lambda: main(args))
    assert exit_info.value.code == 2
    return capsys.readouterr().err.splitlines()[-1]


@pytest.mark.parametrize(("recipe", "config", "overrides", "line"), [
    ("sft", CONFIG, [f"--trainer.callbacks+={CALLBACK_AC}", "--trainer.callbacks.every=0"],
     "error: `trainer.callbacks[ActivationCheckpointing].init_args.every` must be >= 1, got 0"),
    ("sft", CONFIG, ["--trainer.strategy=lightning_mem.strategies.ZeroStrategy",
                     "--trainer.strategy.init_args.preset=zero9"],
     "error: `trainer.strategy.init_args.preset` 'zero9' is not a ZeRO preset"),
    # FSDP2's own check in setup_environment, inside fit: a shard group larger than the ranks.
    ("sft", FSDP2, ["--trainer.devices=1", "--trainer.strategy.init_args.reshard_after_forward=2"],
     "error: `trainer.strategy.init_args.reshard_after_forward: 2` must divide the data-parallel size (1)"),
    ("sft", CONFIG, ["--model.logits_chunk_size=-1"],
     "error: `model.logits_chunk_size` must be 'auto', a positive int (rows per chunk), or 0 or null (one chunk),"
     " got -1"),
    ("qlora", QLORA, ["--model.logits_chunk_size=-1"], "error: `model.logits_chunk_size` must be 'auto'"),
    ("ppo", PPO, [f"--model.name_or_path={TINY_MODEL}", "--model.logits_chunk_size=-1"],
     "error: `model.logits_chunk_size` must be 'auto'"),
    ("ppo", PPO, [f"--model.name_or_path={TINY_MODEL}", "--model.advantage_estimator=grpo",
                  "--model.generation.do_sample=false"],
     "error: `model.generation.do_sample: false` with `model.advantage_estimator: grpo`: a group of greedy answers"),
    ("qlora", QLORA, ["--model.device_map=auto"], "error: `model.device_map` is set, so the base must stay where"),
    ("sft", CONFIG, ["--auto_fit=true", "--device_memory=1GiB"],
     "error: `device_memory`: 1GiB leaves nothing for the run: the estimate reserves 1.10 GiB"),
], ids=["callback-constructor", "zero-constructor", "fsdp2-setup-environment", "sft-chunk", "qlora-chunk", "ppo-chunk",
        "ppo-objective", "qlora-device-map", "auto-fit-reserve"])
def test_a_refused_setting_prints_one_line_naming_its_key(recipe, config, overrides, line, tmp_path, capsys,
                                                           monkeypatch):
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    for module in (sft, qlora, ppo, quantized_lora):  # the QLoRA recipe loads through quantized_lora
        for name in ("load_causal_lm", "load_quantized_causal_lm"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, _refuse)
    main = {"sft": sft.main, "qlora": qlora.main, "ppo": ppo.main}[recipe]
    args = ["fit", f"--config={config}", f"--trainer.default_root_dir={tmp_path}", *overrides]
    assert _command_line(main, args, capsys).startswith(line)


@pytest.mark.parametrize("recipe", ["qlora", "ppo"])
def test_logits_chunk_size_auto_is_accepted_by_every_recipe(recipe, capsys):
    main, config = {"qlora": (qlora.main, QLORA), "ppo": (ppo.main, PPO)}[recipe]
    with pytest.raises(SystemExit) as exit_info:  # parsed and validated; nothing past the parser runs
        main(["fit", "--config", config, "--model.logits_chunk_size=auto", "--print_config"])
    assert exit_info.value.code == 0
    assert "  logits_chunk_size: auto" in capsys.readouterr().out.splitlines()


def test_logits_chunk_size_auto_trains_as_explicit_chunks(tmp_path):
    # `auto` at the tiny vocabulary is one chunk per micro-batch; 7 rows are many: the same update.
    from lightning_mem.models import load_causal_lm, load_tokenizer

    start = tmp_path / "start"  # one set of random weights that both runs load
    load_causal_lm(str(TINY_MODEL)).save_pretrained(start)
    load_tokenizer(str(TINY_MODEL)).save_pretrained(start)
    initial = {n: p.detach().clone() for n, p in load_causal_lm(str(start)).named_parameters()}
    sgd = [f"--model.name_or_path={start}", "--model.optimizer=torch.optim.SGD", "--model.optimizer.init_args.lr=1.0",
           "--model.lr_scheduler=null", "--trainer.gradient_clip_val=null", "--trainer.max_steps=1"]
    auto = _sft(tmp_path / "auto", *sgd, "--model.logits_chunk_size=auto").model
    chunked = _sft(tmp_path / "chunked", *sgd, "--model.logits_chunk_size=7").model
    assert auto.logits_chunk_size == "auto" and chunked.logits_chunk_size == 7
    after = dict(chunked.model.named_parameters())
    moved = 0
    for name, param in auto.model.named_parameters():
        update = after[name].detach() - initial[name]
        if update.norm() == 0:
            continue
        moved += 1
        # Relative to the update (SGD at lr 1); fp32 sums in another order: test_sft's bound.
        error = float((param.detach() - after[name].detach()).norm() / update.norm())
        assert error <= 2e-5, (name, error)
    assert moved > len(initial) // 2


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
