"""On-policy distillation in the PPO recipe (``model.teacher``): the teacher's place in each phase of
a real step; its phase and metric; separate placement scoring the generator's samples on the
training ranks as colocated does; the tiny config through the CLI, where a short run lowers the
student's reverse KL to the SFT demo's export; every teacher key from the command line beside a
reward; the dense top-k signal's keys from the command line; the estimate's teacher phase and the
bytes of the stored top-k; and bad settings refused in one line before any model loads."""

from __future__ import annotations

import pytest
import torch

import lightning_mem.distillation.teacher as teacher_module
import recipes.ppo as ppo
from lightning_mem.offload import module_location
from lightning_mem.rl.config import GRPOConfig, KLConfig, PPOConfig
from lightning_mem.rl.distillation import TeacherConfig
from lightning_mem.rl.engine_config import RolloutEngineConfig
from lightning_mem.rl.memory_plan import PhaseMemoryPlan, PhasePlacement
from lightning_mem.settings import SettingError
from tests.distillation.test_teacher import _other_tokenizer, _save_model
from tests.helpers import REPO, TINY_MODEL, csv_logger_args, read_metric, run_recipe
from tests.recipes.test_ppo import PlacementProbe, fit

CONFIG = "configs/ppo/tiny_cpu_distill.yaml"
STUDENT = REPO / "assets" / "tiny-llama-student"


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return _save_model(tmp_path_factory.mktemp("teacher"), seed=1)


def _distill_fit(root, teacher_dir, module_cls=ppo.PPOModule, *, placement="host", **overrides):
    kwargs = dict(reward=None, teacher=TeacherConfig(str(teacher_dir), placement=placement, coef=1.0),
                  advantage_estimator="grpo", grpo=GRPOConfig(group_size=2), kl=KLConfig(coef=0.0),
                  ppo=PPOConfig(ppo_epochs=1, num_mini_batches=1, max_tokens_per_microbatch=256), batch_size=4)
    return fit(root, module_cls, **(kwargs | overrides))


class TeacherProbe(PlacementProbe):
    """Where the teacher is, by the residency ledger, at each point of the step (the plan's other
    components as PlacementProbe records them)."""

    def _where(self):
        return {**super()._where(), "teacher": module_location(self.distillation.teacher.model)}

    def teacher_logprobs(self, exp):
        self.seen["teacher"] = self._where()
        super().teacher_logprobs(exp)
        self.scored = exp


@pytest.mark.parametrize("placement", ["host", "device"])
def test_the_teacher_is_on_the_device_in_its_own_phase_only_when_parked(tmp_path, teacher_dir, placement):
    """``placement: host``: on the host through rollout, score and update, on the device for its
    phase; ``device``: resident. The plan's teacher phase parks the actor's optimizer state; unset,
    the score phase's placement holds (here both park it). The phase is timed and the reverse-KL
    estimate logged."""
    plan = PhaseMemoryPlan(rollout=PhasePlacement(actor_optimizer="host"), score=PhasePlacement(actor_optimizer="host"),
                           teacher=PhasePlacement(actor_optimizer="host"))
    module, _ = _distill_fit(tmp_path, teacher_dir, TeacherProbe, placement=placement, memory_plan=plan)
    away = "host" if placement == "host" else "device"
    assert {phase: seen["teacher"] for phase, seen in module.seen.items()} == {
        "rollout": away, "score": away, "teacher": "device", "update": away}
    assert module.seen["teacher"]["actor_optimizer"] == "host" and module.seen["update"]["actor_optimizer"] == "device"
    assert read_metric(tmp_path, "time_teacher_s")[0] > 0
    exp = module.scored  # the teacher's log-prob of each sampled token; its mean log-ratio is the metric
    mask = exp.response_mask.bool()
    assert bool((exp.teacher_logprobs[mask] < 0).all()) and bool((exp.teacher_logprobs[~mask] == 0).all())
    kl = float(((exp.old_logprobs - exp.teacher_logprobs) * mask).sum() / mask.sum())
    assert read_metric(tmp_path, "teacher_kl")[0] == pytest.approx(kl, rel=1e-5)
    assert read_metric(tmp_path, "reward_mean")[0] == 0.0  # no reward: the teacher is the only signal


def test_separate_placement_scores_the_generators_samples_as_colocated_does(tmp_path, teacher_dir):
    """At ``max_staleness: 0`` separate placement is the colocated run step for step: the teacher
    scores the samples on the training rank after they arrive, against pi_old of the weights they
    were sampled under (staleness 0 every step), so the losses and the teacher's KL agree."""
    from tests.recipes.test_ppo_async import async_config

    steps = 2
    _distill_fit(tmp_path / "colocated", teacher_dir, steps=steps)
    _distill_fit(tmp_path / "separate", teacher_dir, steps=steps, rollout_engine=RolloutEngineConfig(placement="separate"),
                 async_rollout=async_config(0))
    for name in ("policy_loss", "teacher_kl"):
        colocated, separate = read_metric(tmp_path / "colocated", name), read_metric(tmp_path / "separate", name)
        assert sorted(separate) == sorted(colocated) == list(range(steps))
        for step in range(steps):
            assert separate[step] == pytest.approx(colocated[step], abs=1e-6), (name, step, separate, colocated)
    assert read_metric(tmp_path / "separate", "async/staleness_0") == {s: 8.0 for s in range(steps)}


# -- the real CLI --------------------------------------------------------------------------------


def _cli_fit(root, *extra):
    run = run_recipe("ppo", "fit", "--config", CONFIG, f"--trainer.default_root_dir={root}", *csv_logger_args(root),
                     "--trainer.enable_progress_bar=false", *extra)
    assert run.returncode == 0, run.stderr[-3000:]
    return root


def test_the_tiny_config_lowers_the_students_reverse_kl_to_the_sft_export(tmp_path, sft_export):
    """configs/ppo/tiny_cpu_distill.yaml (a parked teacher, no reward, the dense top-16 signal) from
    the untrained student for a short run, at a learning rate ten times the shipped one so that 16
    steps move it: the divergence from the teacher's top-16 and the sampled tokens' reverse-KL
    estimate to the SFT demo's export both fall (measured: the last 4 steps' means at 0.49 and 0.63
    of the first 4's; at the shipped rate 0.82 and 0.87). The mechanics only: docs/distillation.md
    has the 3-seed comparison with SFT."""
    steps = 16
    root = _cli_fit(tmp_path, f"--model.name_or_path={STUDENT}", f"--model.teacher.name_or_path={sft_export}",
                    f"--trainer.max_steps={steps}", "--data.batch_size=8", "--model.grpo.group_size=4",
                    "--model.optimizer.init_args.lr=0.01", f"--checkpoint.every_n_train_steps={steps}")
    for name, bound in (("teacher_divergence", 0.7), ("teacher_kl", 0.9)):
        values = read_metric(root, name)
        assert sorted(values) == list(range(steps)) and all(v > 0 for v in values.values())
        first, last = sum(values[s] for s in range(4)) / 4, sum(values[s] for s in range(steps - 4, steps)) / 4
        assert last < bound * first, (name, values)
    state = torch.load(root / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    assert not any("teacher" in key for key in state)  # the teacher reloads from its folder
    assert (root / "export" / "config.json").is_file()


def test_every_teacher_key_from_the_command_line_beside_a_reward(tmp_path):
    """Two iterations with each ``model.teacher`` key set: a 4-bit teacher with its own dtype,
    attention, placement and coefficient, mixed with the exact-answer reward; a teacher phase of
    the plan's own."""
    root = _cli_fit(
        tmp_path, f"--model.name_or_path={STUDENT}", f"--model.teacher.name_or_path={TINY_MODEL}",
        "--model.teacher.dtype=float32", "--model.teacher.quantization={bits: 4, compute_dtype: float32}",
        "--model.teacher.placement=device", "--model.teacher.attn_implementation=sdpa", "--model.teacher.coef=0.5",
        "--model.reward.class_path=recipes.rewards.ExactAnswerReward", "--model.memory_plan.teacher.actor_optimizer=host",
        "--trainer.max_steps=2", "--data.batch_size=4", "--checkpoint.every_n_train_steps=2",
    )
    assert sorted(read_metric(root, "teacher_kl")) == [0, 1] and sorted(read_metric(root, "reward_mean")) == [0, 1]
    assert (root / "random_teacher").is_dir()  # the config-only teacher's seeded weights, for the 4-bit load


def test_the_dense_top_k_signal_from_the_command_line(tmp_path):
    """Two iterations with every key of the dense signal set (the teacher's top-8 at every sampled
    position, TRL's JSD at beta 0.3, its weight, the one-sample advantage off), in two micro-batches
    a step: the divergence is logged per token and the one-sample term adds nothing."""
    root = _cli_fit(
        tmp_path, f"--model.name_or_path={STUDENT}", f"--model.teacher.name_or_path={TINY_MODEL}",
        "--model.teacher.top_k=8", "--model.teacher.divergence=jsd", "--model.teacher.beta=0.3",
        "--model.teacher.loss_coef=2.0", "--model.teacher.coef=0", "--model.ppo.max_tokens_per_microbatch=160",
        "--trainer.max_steps=2", "--data.batch_size=4", "--checkpoint.every_n_train_steps=2",
    )
    divergence = read_metric(root, "teacher_divergence")
    assert sorted(divergence) == [0, 1] and all(v > 0 for v in divergence.values())
    assert sorted(read_metric(root, "teacher_kl")) == [0, 1]  # still measured, on the sampled tokens
    assert set(read_metric(root, "policy_loss").values()) == {0.0}  # no reward, coef 0: every advantage is 0


def test_the_estimate_counts_the_stored_top_k():
    """The estimator runs the teacher's phase and the update on fake tensors, so the ``[N, R, k]``
    log-probs (fp32) and ids (int32) the teacher keeps are on its books: beyond what every phase
    gains from the setting's bookkeeping (the rollout's difference), the update phase holds
    exactly 8 bytes per entry, 128 samples x 6 response tokens x 16, as long as they live; the
    teacher's phase holds them beside its forward."""
    from lightning_mem.estimate import estimate

    args = [f"--model.name_or_path={STUDENT}", f"--model.teacher.name_or_path={TINY_MODEL}"]
    runs = [estimate(REPO / CONFIG, args + extra) for extra in
            (["--model.teacher.top_k=null", "--model.teacher.coef=1.0"],
             ["--model.teacher.top_k=16", "--model.teacher.coef=0"])]
    one, dense = ({p.phase: p for p in run.every_phase} for run in runs)
    other = {name: dense[name].device_breakdown_bytes["other"] - one[name].device_breakdown_bytes["other"]
             for name in one}
    assert other["train"] - other["rollout"] == 128 * 6 * 16 * (4 + 4), other
    assert dense["teacher"].device_peak_bytes > one["teacher"].device_peak_bytes


def test_the_estimate_shows_the_teachers_phase():
    from lightning_mem.estimate import estimate

    result = estimate(REPO / CONFIG, [f"--model.name_or_path={STUDENT}", f"--model.teacher.name_or_path={TINY_MODEL}"])
    phases = {p.phase: p for p in result.every_phase}
    assert set(phases) == {"rollout", "score", "teacher", "train"}
    # The teacher's 4 blocks of 256 outweigh the student's 2 of 128; parked, they are on the device in its phase only.
    weights = {name: p.device_breakdown_bytes["weights"] for name, p in phases.items()}
    assert weights["teacher"] > 2 * max(weights["rollout"], weights["score"], weights["train"]), weights


# -- bad settings: one line, before any model loads -------------------------------------------------


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was reported")

    for module in (ppo, teacher_module):
        monkeypatch.setattr(module, "load_causal_lm", refuse)


def _main(tmp_path, *extra):
    return ppo.main(["fit", "--config", CONFIG, f"--trainer.default_root_dir={tmp_path}",
                     f"--model.name_or_path={TINY_MODEL}", f"--model.teacher.name_or_path={TINY_MODEL}", *extra])


def test_a_teacher_of_another_tokenizer_is_refused_before_any_model_loads(tmp_path, no_model_load):
    other = _other_tokenizer(tmp_path / "other")
    with pytest.raises(SettingError, match=r"^`model.teacher.name_or_path`: the teacher .* and the student .* use"
                                           r" different tokenizers .*; distillation across tokenizers is not built"):
        _main(tmp_path, f"--model.teacher.name_or_path={other}")


def test_a_top_k_wider_than_the_vocabulary_is_refused_before_any_model_loads(tmp_path, no_model_load):
    with pytest.raises(SettingError, match=r"^`model.teacher.top_k` \(400\) exceeds the 307 tokens compared$"):
        _main(tmp_path, "--model.teacher.top_k=400")


def test_the_reward_rules_name_their_keys_from_the_cli(tmp_path, no_model_load):
    with pytest.raises(SettingError, match=r"^set exactly one of `model.reward` .*, or neither beside `model.teacher`; this config sets neither$"):
        _main(tmp_path, "--model.teacher=null")
    with pytest.raises(SettingError, match=r"^`model.advantage_estimator: gae` learns from the reward"):
        _main(tmp_path, "--model.advantage_estimator=gae")
