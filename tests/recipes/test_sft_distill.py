"""Logit distillation in the SFT recipe through the real CLI: the tiny config from the SFT demo's
export (the teacher phase in the memory timeline, the student alone in checkpoints), every
``model.distillation`` key from YAML with a LoRA student on packed rows, the estimate's teacher
phase, and a teacher of another tokenizer refused before any model loads."""

from __future__ import annotations

import csv
import shutil

import pytest
import torch

import lightning_mem.distillation.teacher as teacher_module
import recipes.sft as sft
from lightning_mem.settings import SettingError
from tests.helpers import REPO, TINY_MODEL, csv_logger_args, read_metric, run_recipe

CONFIG = "configs/sft/tiny_cpu_distill.yaml"
SHORT = ["--trainer.val_check_interval=null", "--trainer.limit_val_batches=0", "--trainer.log_every_n_steps=1",
         "--trainer.enable_progress_bar=false", "--model.lr_scheduler.init_args.warmup_steps=1",
         "--data.max_tokens_per_batch=256"]


def _fit(root, *extra):
    run = run_recipe("sft", "fit", "--config", CONFIG, f"--trainer.default_root_dir={root}", *csv_logger_args(root),
                     *SHORT, *extra)
    assert run.returncode == 0, run.stderr[-3000:]
    return root


def test_the_tiny_config_distills_from_the_sft_export(tmp_path, sft_export):
    """4 steps of configs/sft/tiny_cpu_distill.yaml as shipped (a parked teacher, forward KL):
    both loss terms logged every step, the teacher's forward a phase of the memory timeline, and
    a checkpoint of the student only."""
    root = _fit(tmp_path, f"--model.distillation.teacher.name_or_path={sft_export}", "--trainer.max_steps=4",
                "--checkpoint.every_n_train_steps=4")
    kd, ce, total = (read_metric(root, name) for name in ("train_kd_loss", "train_ce_loss", "train_loss"))
    assert sorted(kd) == sorted(ce) == sorted(total) == [0, 1, 2, 3]
    for step in kd:  # kd_ratio 0.5: the logged loss is the mean of the two terms
        assert kd[step] > 0 and total[step] == pytest.approx(0.5 * (kd[step] + ce[step]), rel=1e-5)
    with next(root.glob("logs/*/memory.csv")).open() as f:
        phases = {row["phase"] for row in csv.DictReader(f)}
    assert "teacher" in phases
    state = torch.load(root / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    student = sft.load_causal_lm(str(REPO / "assets/tiny-llama-student")).state_dict()
    assert set(state) == {f"model.{k}" for k in student}  # the teacher reloads from its folder


def test_every_distillation_key_from_yaml_with_a_lora_student_on_packed_rows(tmp_path):
    """Two steps with each ``model.distillation`` key set from the command line: a 4-bit teacher
    with its own dtype, attention and placement, JSD with beta, temperature, kd_ratio and top-k,
    into LoRA adapters on packed rows."""
    root = _fit(
        tmp_path, f"--model.distillation.teacher.name_or_path={TINY_MODEL}", "--trainer.max_steps=2",
        "--model.distillation.teacher.dtype=float32", "--model.distillation.teacher.placement=device",
        "--model.distillation.teacher.attn_implementation=sdpa",
        "--model.distillation.teacher.quantization={bits: 4, compute_dtype: float32}",
        "--model.distillation.loss=jsd", "--model.distillation.beta=0.3", "--model.distillation.temperature=2.0",
        "--model.distillation.kd_ratio=0.7", "--model.distillation.top_k=16",
        "--model.lora={r: 4, lora_alpha: 8, target_modules: all-linear}", "--model.attn_implementation=sdpa",
        "--data.packing=true", "--checkpoint.every_n_train_steps=2",
    )
    kd, ce, total = (read_metric(root, name) for name in ("train_kd_loss", "train_ce_loss", "train_loss"))
    assert sorted(kd) == [0, 1]
    for step in kd:
        assert kd[step] > 0 and total[step] == pytest.approx(0.3 * ce[step] + 0.7 * kd[step], rel=1e-5)
    assert (root / "random_teacher").is_dir()  # the config-only teacher's seeded weights, for the 4-bit load


def test_a_student_sharded_by_fsdp2_distills(tmp_path):
    """Two FSDP2 ranks (gloo, CPU offload, checkpointing: configs/sft/tiny_cpu_fsdp2.yaml), each with
    its own teacher parked on the host: the divergence runs inside the student's forward, where the
    root unit's output layer is whole (outside it that layer is a DTensor shard)."""
    root = tmp_path
    run = run_recipe("sft", "fit", "--config", "configs/sft/tiny_cpu_fsdp2.yaml", f"--trainer.default_root_dir={root}",
                     *csv_logger_args(root), *SHORT[:-2], "--data.max_tokens_per_batch=256", "--trainer.max_steps=2",
                     "--model.name_or_path=assets/tiny-llama-student",
                     f"--model.distillation={{teacher: {{name_or_path: {TINY_MODEL}, placement: host}}}}")
    assert run.returncode == 0, run.stderr[-3000:]
    kd = read_metric(root, "train_kd_loss")
    assert sorted(kd) == [0, 1] and all(0 < v < 10 for v in kd.values())


def test_the_estimate_shows_the_teachers_phase_and_the_students():
    from lightning_mem.estimate import estimate

    result = estimate(REPO / CONFIG, [f"--model.distillation.teacher.name_or_path={TINY_MODEL}"])
    phases = {p.phase: p for p in result.every_phase}
    assert set(phases) == {"teacher", "train"}
    # The teacher's 4 blocks of 256 weigh more than the student's 2 of 128; parked, it is on the host in train.
    assert phases["teacher"].device_breakdown_bytes["weights"] > phases["train"].device_breakdown_bytes["weights"]
    assert phases["train"].host_peak_bytes > 0


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was reported")

    monkeypatch.setattr(sft, "load_causal_lm", refuse)
    monkeypatch.setattr(teacher_module, "load_causal_lm", refuse)


def test_a_teacher_of_another_tokenizer_is_refused_before_any_model_loads(tmp_path, no_model_load):
    other = tmp_path / "other"
    other.mkdir()
    for name in ("config.json", "tokenizer_config.json", "tokenizer.json"):
        shutil.copyfile(TINY_MODEL / name, other / name)
    text = (other / "tokenizer.json").read_text()
    (other / "tokenizer.json").write_text(text.replace('"<|user|>"', '"<|human|>"'))
    with pytest.raises(SettingError, match=r"^`model.distillation.teacher.name_or_path`: the teacher .* and the student"
                                           r" .* use different tokenizers .*; distillation across tokenizers is not built"):
        sft.main(["fit", "--config", CONFIG, f"--trainer.default_root_dir={tmp_path}",
                  f"--model.distillation.teacher.name_or_path={other}"])
