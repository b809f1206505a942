"""The DPO recipe through its real CLI on the tiny model, fp32: the first step's loss is ln 2; every
reference memory plan gives the same losses; the host-parked copy is on the device only in its
forward; precomputed log-probs are reused and refused on other inputs; packed equals padded; a
resume continues the losses; bad settings fail in one line before any model loads; and from the SFT
demo's export, a short run learns the preference."""

from __future__ import annotations

import json
import math

import pytest
import torch

import recipes.dpo as dpo
from lightning_mem.data import PreferenceDataModule
from lightning_mem.offload import module_location
from lightning_mem.quantization import materialize_random_weights
from lightning_mem.settings import SettingError
from tests.helpers import ARITH, REPO, TINY_MODEL, csv_logger_args, read_metric, run_recipe

CONFIG = str(REPO / "configs" / "dpo" / "tiny_cpu.yaml")
STEPS = 4


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """48 train and 16 val pairs of the shipped set (6 and 2 micro-batches of 8 pairs), and the tiny
    model with seeded random weights on disk (the policy, and a reference loaded from the same folder)."""
    root = tmp_path_factory.mktemp("pairs")
    lines = (ARITH / "preference_train.jsonl").read_text().splitlines()
    (root / "train.jsonl").write_text("\n".join(lines[:48]) + "\n")
    (root / "val.jsonl").write_text("\n".join(lines[48:64]) + "\n")
    (root / "other.jsonl").write_text("\n".join(lines[64:112]) + "\n")
    materialize_random_weights(str(TINY_MODEL), root / "weights", seed=0)
    return root


def _weights(pairs):
    return str(next((pairs / "weights").iterdir()))


def _args(root, pairs, *extra, steps=STEPS):
    return [
        "fit", "--config", CONFIG, f"--trainer.default_root_dir={root}", f"--model.name_or_path={_weights(pairs)}",
        f"--data.train_file={pairs / 'train.jsonl'}", f"--data.val_file={pairs / 'val.jsonl'}",
        "--data.max_tokens_per_batch=null", "--data.batch_size=8", f"--trainer.max_steps={steps}",
        f"--trainer.val_check_interval={steps}", f"--checkpoint.every_n_train_steps={steps}", "--trainer.callbacks=[]",
        "--trainer.log_every_n_steps=1", "--trainer.enable_progress_bar=false", "--model.logits_chunk_size=16",
        "--model.dpo.loss_type=sigmoid",  # DPO's loss alone (the config adds the chosen NLL): ln 2 at step 0
        # A learning rate that moves the policy away from its reference within a few steps.
        "--model.optimizer.init_args.lr=0.001", "--model.lr_scheduler.init_args.warmup_steps=1",
        *csv_logger_args(root), *extra,
    ]  # fmt: skip


def _fit(root, pairs, *extra, steps=STEPS, cli_class=None):
    args = _args(root, pairs, *extra, steps=steps)
    if cli_class is None:
        cli = dpo.main(args)
    else:
        cli = dpo.DPOCLI(cli_class, PreferenceDataModule, args=args, save_config_kwargs={"overwrite": True})
    losses = read_metric(root, "train_loss")
    return cli, [losses[step] for step in sorted(losses)]


# -- the reference memory plans give the same losses -----------------------------------------------


class HostProbe(dpo.DPOModule):
    """Records where the reference copy is, by the residency ledger, at each point of a step."""

    seen: list[tuple[str, str]] = []

    def on_train_start(self):
        type(self).seen = []  # from the first training step (the sanity check validated before)

    def training_step(self, batch, batch_idx):
        self.seen.append(("step", module_location(self.reference)))
        return super().training_step(batch, batch_idx)

    def sequence_logps(self, model, batch):
        self.seen.append(("reference forward" if model is self.reference else "policy forward",
                          module_location(self.reference)))
        return super().sequence_logps(model, batch)


@pytest.fixture(scope="module")
def full_modes(tmp_path_factory, pairs):
    """A full fine-tune under each mode that holds a reference: the same run, four steps each."""
    runs = {}
    for mode in ("copy", "host", "precompute"):
        root = tmp_path_factory.mktemp(mode)
        cli_class = HostProbe if mode == "host" else None
        extra = ["--model.reference.pin_memory=false"] if mode == "host" else []
        cli, losses = _fit(root, pairs, f"--model.reference.mode={mode}", *extra, cli_class=cli_class)
        runs[mode] = (root, cli, losses)
    return runs


def test_the_first_step_loss_is_ln2_when_the_policy_is_its_reference(full_modes):
    root, _, losses = full_modes["copy"]
    assert losses[0] == pytest.approx(math.log(2), abs=1e-6)
    assert read_metric(root, "rewards/chosen")[0] == pytest.approx(0.0, abs=1e-6)
    assert read_metric(root, "rewards/margins")[0] == pytest.approx(0.0, abs=1e-6)
    assert losses[-1] != pytest.approx(losses[0], abs=1e-4)  # the policy moved: the reference matters


def test_copy_host_and_precompute_give_equal_losses(full_modes):
    _, _, copy = full_modes["copy"]
    assert len(copy) == STEPS
    for mode in ("host", "precompute"):
        assert full_modes[mode][2] == pytest.approx(copy, abs=1e-6), mode


def test_validation_logs_the_loss_and_trl_metrics(full_modes):
    root, _, _ = full_modes["copy"]
    for name in ("val_loss", "val_rewards/chosen", "val_rewards/rejected", "val_rewards/accuracies",
                 "val_rewards/margins", "val_logps/chosen", "val_logps/rejected"):
        assert read_metric(root, name), name
    assert read_metric(root, "val_loss") == pytest.approx(read_metric(full_modes["precompute"][0], "val_loss"), abs=1e-6)


def test_the_host_reference_is_on_the_device_only_in_its_forward(full_modes):
    seen = HostProbe.seen
    assert seen[:3] == [("step", "host"), ("reference forward", "device"), ("policy forward", "host")]
    assert {where for what, where in seen if what != "reference forward"} == {"host"}
    assert len([s for s in seen if s[0] == "step"]) == STEPS


def test_precompute_frees_what_scored_it_and_checkpoints_hold_the_policy_only(full_modes):
    root, cli, _ = full_modes["precompute"]
    assert cli.model.reference is None and cli.model.reference_policy is None
    assert set(cli.model.reference_tables) == {"train", "val"}
    assert cli.model.reference_tables["train"].shape == (len(cli.datamodule.train_set), 2)
    assert (root / "reference_logps" / "train.safetensors").is_file()
    saved = torch.load(full_modes["copy"][0] / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    assert saved and not any(key.startswith("reference.") for key in saved)


def test_two_ranks_share_the_pass_and_write_what_one_process_computes(tmp_path, pairs, full_modes):
    from safetensors.torch import load_file

    run = run_recipe("dpo", *_args(tmp_path, pairs, "--model.reference.mode=precompute", "--trainer.devices=2",
                                   "--trainer.strategy=ddp", steps=1))
    assert run.returncode == 0, run.stderr[-3000:]
    for split in ("train", "val"):
        two = load_file(tmp_path / "reference_logps" / f"{split}.safetensors")["logps"]
        one = load_file(full_modes["precompute"][0] / "reference_logps" / f"{split}.safetensors")["logps"]
        # Each rank pads its own micro-batches, so the matmuls' shapes (and float sums) differ: 2e-6
        # apart on sums near -17 was seen; a wrong or missing pair is off by whole units.
        torch.testing.assert_close(two, one, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def lora_modes(tmp_path_factory, pairs):
    runs = {}
    for mode in ("adapters_off", "copy", "precompute"):
        root = tmp_path_factory.mktemp(f"lora_{mode}")
        runs[mode] = _fit(root, pairs, "--model.lora.r=4", "--model.lora.lora_alpha=8", f"--model.reference.mode={mode}")
    return runs


def test_adapters_off_equals_a_copy_of_the_same_base(lora_modes):
    cli, losses = lora_modes["adapters_off"]
    assert cli.model.reference is None  # no second copy
    assert losses[0] == pytest.approx(math.log(2), abs=1e-6)
    assert lora_modes["copy"][1] == pytest.approx(losses, abs=1e-6)
    assert lora_modes["precompute"][1] == pytest.approx(losses, abs=1e-6)  # scored with the adapters off


# -- the precomputed log-probs on disk ----------------------------------------------------------------


def test_the_cache_is_reused_by_the_next_run_which_loads_no_reference(tmp_path, pairs, monkeypatch):
    loads = []
    real_load = dpo.load_causal_lm
    monkeypatch.setattr(dpo, "load_causal_lm", lambda *a, **k: loads.append(a[0]) or real_load(*a, **k))
    cache = tmp_path / "cache"
    common = ["--model.reference.mode=precompute", f"--model.reference.name_or_path={_weights(pairs)}",
              f"--model.reference.cache_dir={cache}"]
    _, first = _fit(tmp_path / "first", pairs, *common)
    assert loads == [_weights(pairs)]  # a miss: the named reference is loaded once, then freed
    assert sorted(p.name for p in cache.iterdir()) == ["train.safetensors", "val.safetensors"]

    def no_pass(*args, **kwargs):
        raise AssertionError("the reference pass ran although its log-probs were cached")

    monkeypatch.setattr(dpo.DPOModule, "reference_pass", no_pass)
    cli, second = _fit(tmp_path / "second", pairs, *common)
    assert loads == [_weights(pairs)]  # nothing loaded the second time
    assert cli.model.reference is None and second == pytest.approx(first, abs=1e-6)


def test_a_cache_of_other_data_is_refused_in_one_line(tmp_path, pairs):
    cache = tmp_path / "cache"
    _fit(tmp_path / "first", pairs, "--model.reference.mode=precompute", f"--model.reference.cache_dir={cache}", steps=1)
    run = run_recipe("dpo", *_args(tmp_path / "second", pairs, "--model.reference.mode=precompute",
                                   f"--model.reference.cache_dir={cache}", f"--data.train_file={pairs / 'other.jsonl'}",
                                   steps=1))
    assert run.returncode == 2, run.stderr[-3000:]
    lines = run.stderr.strip().splitlines()
    assert "Traceback" not in run.stderr
    assert lines[-1].startswith(f"error: `model.reference.cache_dir`: {cache / 'train.safetensors'} holds reference"
                                " log-probs of other inputs (data ("), lines[-1]


def test_validate_from_a_checkpoint_scores_the_reference_from_the_starting_weights(tmp_path, pairs, full_modes):
    # The checkpoint's policy has trained: precompute cannot score with it, and loads the start once.
    # (LightningCLI builds the module from the checkpoint's settings: reference.mode precompute.)
    root = full_modes["precompute"][0]
    args = _args(tmp_path, pairs, f"--ckpt_path={root / 'checkpoints' / 'last.ckpt'}")
    with pytest.warns(UserWarning, match=r"precompute: no reference log-probs cached and the policy resumed"):
        dpo.main(["validate", *args[1:]])
    [(_, expected)] = read_metric(root, "val_loss").items()
    [(_, got)] = read_metric(tmp_path, "val_loss").items()
    assert got == pytest.approx(expected, abs=1e-6)
    assert (tmp_path / "reference_logps" / "val.safetensors").is_file()


# -- packed equals padded -------------------------------------------------------------------------------


def test_packed_pairs_give_the_padded_losses_and_gradients(tmp_path, pairs):
    from lightning_mem.data.preference import PairCollator
    from lightning_mem.lora import LoraSettings

    data = PreferenceDataModule(train_file=str(pairs / "train.jsonl"), tokenizer=str(TINY_MODEL), max_length=64,
                                batch_size=8, cache_dir=str(tmp_path / "data"))
    data.setup("fit")
    chosen = data.train_set.pairs(list(range(12)))
    padded = PairCollator(data.tokenizer.pad_token_id)(chosen)
    packed = PairCollator(data.tokenizer.pad_token_id, packing=True, row_length=data.row_length)(chosen)
    assert "attention_mask" not in packed and packed["input_ids"].shape[0] < padded["input_ids"].shape[0]
    # The reference is the LoRA policy's base; adapters with random B make the policy differ from it.
    module = dpo.DPOModule(name_or_path=_weights(pairs), lora=LoraSettings(r=4, lora_alpha=8), logits_chunk_size=16)
    module.configure_model()
    for name, param in module.model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.05)
    trained = [p for p in module.model.parameters() if p.requires_grad]
    results = []
    for batch in (padded, packed):
        out, _, _ = module.pair_losses(batch, "train")
        results.append((out.pair_losses.detach(), torch.autograd.grad(out.pair_losses.sum(), trained)))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert (loss_a - math.log(2)).abs().max() > 1e-3  # the policy is not its reference
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_a_packed_run_trains_through_the_cli(tmp_path, pairs):
    _, losses = _fit(tmp_path, pairs, "--data.packing=true", "--data.max_tokens_per_batch=256", "--data.batch_size=null",
                     steps=2)
    assert losses[0] == pytest.approx(math.log(2), abs=1e-6)


# -- resume ----------------------------------------------------------------------------------------------


def test_a_resumed_run_continues_with_the_same_losses(tmp_path, pairs, monkeypatch):
    # Stopping at step 3 stands in for a crash; the schedule is pinned to the 6-step run's.
    common = ["--model.reference.mode=precompute", "--model.lr_scheduler.init_args.total_steps=6",
              "--checkpoint.every_n_train_steps=3", "--trainer.val_check_interval=3"]
    _, whole = _fit(tmp_path / "whole", pairs, *common, steps=6)
    _fit(tmp_path / "part", pairs, *common, steps=3)

    def no_pass(*args, **kwargs):
        raise AssertionError("the resumed run computed the reference log-probs the first half cached")

    monkeypatch.setattr(dpo.DPOModule, "reference_pass", no_pass)
    cli, _ = _fit(tmp_path / "part", pairs, *common, "--ckpt_path=last", steps=6)
    resumed = read_metric(tmp_path / "part", "train_loss")
    assert sorted(resumed) == list(range(6))
    assert [resumed[s] for s in range(3, 6)] == pytest.approx(whole[3:], abs=1e-5)
    assert cli.model._restored


# -- the objectives' options, and reference-free ones ------------------------------------------------------


def test_every_objective_option_runs_through_the_cli(tmp_path, pairs):
    cli, losses = _fit(
        tmp_path, pairs, "--model.dpo.loss_type=[sigmoid, sft, simpo, orpo, discopop]",
        "--model.dpo.loss_weights=[1.0, 0.5, 1.0, 1.0, 1.0]", "--model.dpo.beta=0.2", "--model.dpo.label_smoothing=0.1",
        "--model.dpo.gamma=0.3", "--model.dpo.orpo_lambda=0.2", "--model.dpo.discopop_tau=0.1",
        "--model.disable_dropout=false", "--model.logits_chunk_size=auto", steps=2)
    settings = cli.model.dpo
    assert (settings.loss_types, settings.beta, settings.gamma, settings.orpo_lambda) == (
        ("sigmoid", "sft", "simpo", "orpo", "discopop"), 0.2, 0.3, 0.2)
    assert all(math.isfinite(v) for v in losses) and losses[0] > math.log(2)  # the NLL terms add to ln 2


def test_a_reference_free_objective_loads_no_reference(tmp_path, pairs, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a reference was loaded for a reference-free objective")

    monkeypatch.setattr(dpo, "load_causal_lm", refuse)
    cli, losses = _fit(tmp_path, pairs, "--model.dpo.loss_type=simpo", "--model.reference.mode=none", steps=2)
    assert cli.model.reference_mode is None and cli.model.reference_policy is None
    assert all(math.isfinite(v) for v in losses)


# -- bad settings: one line, before any model loads ---------------------------------------------------------


@pytest.fixture
def no_model_load(monkeypatch):
    import recipes.sft as sft

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was reported")

    monkeypatch.setattr(sft, "load_causal_lm", refuse)
    monkeypatch.setattr(dpo, "load_causal_lm", refuse)


def test_none_under_a_loss_that_needs_a_reference(tmp_path, pairs, no_model_load):
    with pytest.raises(SettingError, match=r"^`model.reference.mode` is 'none', but `model.dpo.loss_type: sigmoid`"
                                           r" compares the policy with a reference"):
        dpo.main(_args(tmp_path, pairs, "--model.reference.mode=none"))


def test_adapters_off_without_lora(tmp_path, pairs, no_model_load):
    with pytest.raises(SettingError, match=r"^`model.reference.mode`: `adapters_off` switches off the policy's LoRA"
                                           r" adapters, and this policy has none"):
        dpo.main(_args(tmp_path, pairs, "--model.reference.mode=adapters_off"))


def test_a_reference_folder_that_does_not_exist(tmp_path, pairs, no_model_load):
    with pytest.raises(FileNotFoundError, match=r"^`model.reference.name_or_path`: model path './no-such-reference'"
                                                r" does not exist"):
        dpo.main(_args(tmp_path, pairs, "--model.reference.name_or_path=./no-such-reference"))


def test_adapters_off_with_other_weights_named(tmp_path, pairs, no_model_load):
    with pytest.raises(SettingError, match=r"^`model.reference.name_or_path` \('.*weights.*'\) names other weights, but"
                                           r" `model.reference.mode: adapters_off` is the policy's own base"):
        dpo.main(_args(tmp_path, pairs, "--model.lora.r=4", "--model.reference.mode=adapters_off",
                       f"--model.reference.name_or_path={_weights(pairs)}"))


def test_a_quantized_base_without_adapters(tmp_path, pairs, no_model_load):
    with pytest.raises(SettingError, match=r"^`model.quantization`: a quantized base cannot train, only adapters on it can;"
                                           r" set `model.lora` too"):
        dpo.main(_args(tmp_path, pairs, "--model.quantization={bits: 4}"))


# -- from the SFT demo's export: a short run learns the preference -------------------------------------------


def test_a_short_run_from_the_sft_export_learns_the_preference(tmp_path, sft_export):
    """The shipped config's first 40 steps (of 200): the val pairs' margins and accuracy rise."""
    root = tmp_path / "dpo"
    run = run_recipe(
        "dpo", "fit", "--config", CONFIG, f"--trainer.default_root_dir={root}", f"--model.name_or_path={sft_export}",
        "--trainer.max_steps=40", "--trainer.val_check_interval=10", "--trainer.callbacks=[]",
        "--trainer.log_every_n_steps=1", "--trainer.enable_progress_bar=false", "--model.export_dir=null",
        *csv_logger_args(root),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert read_metric(root, "rewards/margins")[0] == pytest.approx(0.0, abs=1e-6)  # the policy is its reference
    accuracy, margins = read_metric(root, "val_rewards/accuracies"), read_metric(root, "val_rewards/margins")
    first, *_, last = sorted(margins)
    assert (first, last) == (9, 39)
    assert margins[last] > 2 * margins[first] > 0
    assert accuracy[last] > accuracy[first]


def test_the_recorded_end_to_end_figure_is_current_and_meets_the_goal():
    """docs/dpo.md's figure is `scripts/dpo_figure.py`'s record, made from today's config and data:
    DPO raised the SFT export's greedy exact-answer rate by at least 5 points in every seed."""
    from scripts.dpo_figure import RECORD, fingerprint

    record = json.loads(RECORD.read_text())
    assert record["inputs"] == fingerprint(), "the DPO demo's inputs changed: rerun scripts/dpo_figure.py"
    assert len(record["gain_points"]) >= 3 and record["min_gain_points"] >= 5.0, record
    docs = (REPO / "docs" / "dpo.md").read_text()
    for seed, gain in record["gain_points"].items():
        assert f"| {seed} |" in docs and f"{gain:+.1f}" in docs, (seed, gain)
