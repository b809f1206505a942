"""The PPO recipe: bad input fails before any model loads; the memory plan holds during a real step;
an update does not depend on the micro-batch split; PPO, GRPO, LoRA, shared critic and reward
model variants run; and the tiny end-to-end run (SFT warm-up, then PPO) raises the reward."""

from __future__ import annotations

import re

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger

import recipes.ppo as ppo
from lightning_mem.data import PromptDataModule
from lightning_mem.lora import LoraSettings
from lightning_mem.offload import module_location, optimizer_state_location
from lightning_mem.rl.config import CriticConfig, GRPOConfig, KLConfig, PPOConfig, RewardModelConfig
from lightning_mem.rl.memory_plan import PhaseMemoryPlan, PhasePlacement
from lightning_mem.rl.rollout import GenerationConfig
from lightning_mem.settings import SettingError
from recipes.rewards import ArithmeticReward
from tests.helpers import ARITH, REPO, TINY_MODEL, csv_logger_args, read_metric, run_recipe

CONFIG = str(REPO / "configs" / "ppo" / "tiny_cpu.yaml")


def gpu_tier_plan() -> PhaseMemoryPlan:
    away = dict(actor_optimizer="host", critic_optimizer="host")
    return PhaseMemoryPlan(
        rollout=PhasePlacement(**away, critic="host", reference="host", reward_model="host"),
        score=PhasePlacement(**away),
        train=PhasePlacement(reference="host", reward_model="host"),
        empty_cache_between_phases=True,
    )


def fit(tmp_path, module_cls=ppo.PPOModule, *, steps=1, batch_size=8, **overrides):
    """One short in-process fit of the recipe's module on the tiny random model."""
    seed_everything(0)
    kwargs = dict(
        name_or_path=str(TINY_MODEL),
        reward=ArithmeticReward(),
        generation=GenerationConfig(max_new_tokens=4),
        ppo=PPOConfig(ppo_epochs=1, num_mini_batches=2, max_tokens_per_microbatch=256),
        export_dir=None,
    )
    kwargs.update(overrides)
    module = module_cls(**kwargs)
    data = PromptDataModule(str(ARITH / "prompts.jsonl"), tokenizer=str(TINY_MODEL), batch_size=batch_size, max_prompt_length=64)
    trainer = Trainer(
        accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=steps, default_root_dir=tmp_path,
        logger=CSVLogger(tmp_path, name="logs"), log_every_n_steps=1, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module, data)
    return module, trainer


# -- the memory plan during a real step ---------------------------------------------------------


class PlacementProbe(ppo.PPOModule):
    """Records, at each point of the step, where the plan's components are according to the offload
    primitives' ledgers."""

    seen: dict[str, dict[str, str]]

    def _where(self) -> dict[str, str]:
        optimizers = self._optimizers()
        out = {"actor_optimizer": optimizer_state_location(optimizers[0])}
        if len(optimizers) > 1:
            out["critic_optimizer"] = optimizer_state_location(optimizers[1])
        for name in ("critic", "reference", "reward_model"):
            if getattr(self, name) is not None:
                out[name] = module_location(getattr(self, name))
        return out

    def rollout(self, batch):
        type(self).last = self
        self.seen = {"rollout": self._where()}
        return super().rollout(batch)

    def score(self, exp):
        self.seen["score"] = self._where()
        return super().score(exp)

    def _optimizer_step(self):
        self.seen["update"] = self._where()
        super()._optimizer_step()


def test_memory_plan_holds_in_every_phase_of_a_step(tmp_path):
    module, _ = fit(tmp_path, PlacementProbe, memory_plan=gpu_tier_plan(), kl=KLConfig(coef=0.05))
    seen = module.seen
    assert seen["rollout"] == dict(
        actor_optimizer="host", critic_optimizer="host", critic="host", reference="host"
    )
    assert seen["score"] == dict(
        actor_optimizer="host", critic_optimizer="host", critic="device", reference="device"
    )
    assert seen["update"] == dict(
        actor_optimizer="device", critic_optimizer="device", critic="device", reference="host"
    )
    # Lightning saw a normal step: optimizer state exists and the phases were timed.
    assert module._optimizers()[0].state
    for phase in ("rollout", "score", "train"):
        assert read_metric(tmp_path, f"time_{phase}_s")[0] > 0


class FailingUpdate(PlacementProbe):
    def _optimizer_step(self):
        self.seen["update"] = self._where()
        raise RuntimeError("out of memory (simulated) in the train phase")


def test_an_exception_in_the_train_phase_leaves_everything_on_the_device(tmp_path):
    with pytest.raises(RuntimeError, match="simulated"):
        fit(tmp_path, FailingUpdate, memory_plan=gpu_tier_plan(), kl=KLConfig(coef=0.05))
    module = FailingUpdate.last
    assert module.seen["update"]["reference"] == "host"  # the plan had parked the reference
    assert set(module._where().values()) == {"device"}, module._where()
    assert set(module.memory.locations.values()) == {"device"}


# -- an update does not depend on how the mini-batch is split -----------------------------------


def test_update_is_the_same_whatever_the_token_budget(tmp_path, monkeypatch):
    counts = []
    from lightning_mem.rl import microbatch

    real = microbatch.micro_batches

    def counting(lengths, max_tokens, **kwargs):
        batches = real(lengths, max_tokens, **kwargs)
        counts.append((max_tokens, len(batches)))
        return batches

    monkeypatch.setattr(microbatch, "micro_batches", counting)  # what StepIO.micro_batches calls
    sgd = lambda params: torch.optim.SGD(params, lr=1.0)  # noqa: E731  (plain SGD: params move by exactly -grad)
    params = {}
    for budget in (None, 40):
        module, _ = fit(
            tmp_path / str(budget), Snapshot, optimizer=sgd, critic_optimizer=sgd,
            ppo=PPOConfig(ppo_epochs=1, num_mini_batches=1, max_grad_norm=None, max_tokens_per_microbatch=budget,
                          logprob_max_tokens_per_microbatch=4096),
        )
        params[budget] = {f"actor.{k}": v.detach().clone() for k, v in module.actor.named_parameters()}
        params[budget].update({f"critic.{k}": v.detach().clone() for k, v in module.critic.named_parameters()})
    update_splits = [n for budget, n in counts if budget == 40]
    assert update_splits and min(update_splits) >= 4  # the small budget really split the mini-batch
    for name, whole in params[None].items():
        torch.testing.assert_close(params[40][name], whole, atol=2e-6, rtol=1e-4, msg=name)
    # ... and the update was not a no-op: most actor tensors moved.
    moved = [not torch.equal(params[None][f"actor.{k}"], v) for k, v in module.initial.items()]
    assert sum(moved) > len(moved) // 2


class Snapshot(ppo.PPOModule):
    def on_fit_start(self):
        self.initial = {k: v.detach().clone() for k, v in self.actor.named_parameters()}
        super().on_fit_start()


class OldLogprobPass(ppo.PPOModule):
    """Counts the actor's forward passes, and can force the separate old-logprob pass."""

    force_old_pass = False
    actor_passes = 0

    @property
    def on_policy(self) -> bool:
        return False if self.force_old_pass else super().on_policy

    def _policy(self, model, mb, **kwargs):
        self.actor_passes += model is self.actor
        return super()._policy(model, mb, **kwargs)


def test_on_policy_update_skips_the_old_logprob_pass_and_is_unchanged(tmp_path):
    """ppo_epochs 1 x num_mini_batches 1: the update's own (detached) log-probs are the old ones, so
    the score phase runs no actor pass, and the update (plain SGD) and the logged KL are the same."""
    sgd = lambda params: torch.optim.SGD(params, lr=1.0)  # noqa: E731
    runs = {}
    for forced in (False, True):
        cls = type("Forced" if forced else "Skipping", (OldLogprobPass,), {"force_old_pass": forced})
        module, _ = fit(
            tmp_path / str(forced), cls, optimizer=sgd, advantage_estimator="grpo", grpo=GRPOConfig(group_size=4),
            batch_size=4, kl=KLConfig(coef=0.05, estimator="k3", in_reward=False),
            ppo=PPOConfig(ppo_epochs=1, num_mini_batches=1, max_grad_norm=None, max_tokens_per_microbatch=256),
        )
        runs[forced] = module
    skipping, forced = runs[False], runs[True]
    assert skipping.on_policy and skipping.actor_passes < forced.actor_passes
    for (name, p), q in zip(skipping.actor.named_parameters(), forced.actor.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=name)
    kl = {f: read_metric(tmp_path / str(f), "kl")[0] for f in (False, True)}
    assert kl[False] == pytest.approx(kl[True], abs=1e-6)


# -- variants -----------------------------------------------------------------------------------


def test_grpo_builds_no_critic_and_samples_groups(tmp_path):
    module, _ = fit(
        tmp_path, advantage_estimator="grpo", grpo=GRPOConfig(group_size=4), batch_size=4,
        kl=KLConfig(coef=0.01, estimator="k3", in_reward=False),
    )
    assert module.critic is None and module.value_head is None
    assert len(module._optimizers()) == 1
    assert read_metric(tmp_path, "reward_mean") and not read_metric(tmp_path, "value_loss")


def test_lora_actor_uses_its_base_as_the_reference_and_a_shared_critic(tmp_path):
    module, _ = fit(
        tmp_path, lora=LoraSettings(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        critic=CriticConfig(layout="shared"),
    )
    assert module.reference is None and module.reference_mode == "adapters_off"
    assert module.critic is None and module.value_head is not None
    trainable = {n for n, p in module.actor.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    # The step's KL is measured against the adapters-off model: it starts at the policy itself.
    assert abs(read_metric(tmp_path, "kl")[0]) < 1e-4
    # The shared value head trains with the actor's optimizer.
    actor_params = [p for group in module._optimizers()[0].param_groups for p in group["params"]]
    assert any(p is module.value_head.summary.weight for p in actor_params)
    assert read_metric(tmp_path, "value_loss")


@pytest.mark.parametrize("lora", [False, True], ids=["full-actor", "lora-actor"])
def test_checkpoint_holds_only_what_trains(lora):
    """The reference and a LoRA actor's base never change: the checkpoint leaves them out (they
    reload from the policy's source), and loading checks every trainable tensor is there."""
    module = ppo.PPOModule(
        name_or_path=str(TINY_MODEL), reward=ArithmeticReward(), kl=KLConfig(coef=0.05), export_dir=None,
        lora=LoraSettings(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) if lora else None,
        critic=CriticConfig(layout="shared" if lora else "separate"),
    )
    module.configure_model()
    checkpoint = {"state_dict": module.state_dict()}
    module.on_save_checkpoint(checkpoint)
    saved = set(checkpoint["state_dict"])
    assert saved == {n for n, p in module.named_parameters() if p.requires_grad}
    if lora:  # the adapters and the shared value head, no base weight
        assert saved and all("lora_" in k or k.startswith("value_head.") for k in saved)
    else:  # the whole actor and critic, no reference
        assert {k.split(".")[0] for k in saved} == {"actor", "critic"}
        assert len([k for k in saved if k.startswith("actor.")]) == len(list(module.actor.parameters()))
    module.on_load_checkpoint(checkpoint)
    checkpoint["state_dict"].pop(sorted(saved)[0])
    with pytest.raises(KeyError, match="lacks 1 trainable tensors"):
        module.on_load_checkpoint(checkpoint)


def test_lora_dropout_is_off_in_the_actor_so_two_passes_agree():
    """Dropout is switched off *after* the adapters are added: with lora_dropout 0.1 two train-mode
    forwards of the actor give identical logprobs (else the PPO ratio pi/pi_old is noise)."""
    seed_everything(0)
    module = ppo.PPOModule(
        name_or_path=str(TINY_MODEL), reward=ArithmeticReward(), kl=KLConfig(coef=0.0),
        lora=LoraSettings(r=4, lora_alpha=8, lora_dropout=0.1), export_dir=None,
    )
    module.configure_model()
    actor = module.actor.train()
    with torch.no_grad():  # LoRA's B starts at 0, which would hide any dropout on A's input
        for name, p in actor.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    ids = torch.randint(5, 200, (4, 12), generator=torch.Generator().manual_seed(0))

    def logprobs():
        with torch.no_grad():
            return torch.log_softmax(actor(input_ids=ids).logits.float(), dim=-1)

    first, second = logprobs(), logprobs()
    assert torch.equal(first, second)
    # The check can see noise: with the adapters' dropout back on, the two passes differ.
    dropouts = [m for n, m in actor.named_modules() if isinstance(m, torch.nn.Dropout) and "lora_dropout" in n]
    assert dropouts and all(m.p == 0.0 for m in dropouts)
    for m in dropouts:
        m.p = 0.1
    assert not torch.equal(logprobs(), logprobs())


def test_reward_model_is_scored_and_parked_on_the_host(tmp_path):
    module, _ = fit(
        tmp_path, PlacementProbe, reward=None, reward_model=RewardModelConfig(name_or_path=str(TINY_MODEL)),
        memory_plan=gpu_tier_plan(),
    )
    assert module.seen["rollout"]["reward_model"] == "host"
    assert module.seen["score"]["reward_model"] == "device"
    assert module.seen["update"]["reward_model"] == "host"
    assert torch.isfinite(torch.tensor(read_metric(tmp_path, "reward_mean")[0]))


# -- advantages ---------------------------------------------------------------------------------


def _grpo_experience():
    """Two groups of four: group 0 all right (score 1), group 1 one right; the wrong answers are
    the longer ones, as they tend to be (so a batch mean over tokens is not 0)."""
    from types import SimpleNamespace

    lengths = [2, 2, 2, 2, 2, 6, 6, 6]
    mask = torch.tensor([[1] * n + [0] * (6 - n) for n in lengths])
    return SimpleNamespace(
        response_mask=mask, scores=torch.tensor([1.0, 1, 1, 1, 1, 0, 0, 0]),
        group_ids=torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]), old_logprobs=torch.zeros(8, 6), ref_logprobs=None,
        engine_logprobs=None, loss_mask=None, correction_weights=None, sample_stats={}, sample_keep=None,
    )


@pytest.mark.parametrize("scale", [True, False])
def test_grpo_advantages_reach_the_loss_as_they_are(scale):
    """GRPO's group-relative score is the advantage: no batch whitening on top. (Whitened, the
    all-right group got +0.365 per token here, and Dr. GRPO's unscaled score was divided by the
    batch std anyway.)"""
    module = ppo.PPOModule(
        name_or_path=str(TINY_MODEL), reward=ArithmeticReward(), advantage_estimator="grpo",
        grpo=GRPOConfig(group_size=4, scale_rewards=scale), kl=KLConfig(coef=0.0),
    )
    module._sum_over_ranks = lambda value: value  # one process, no trainer attached
    exp = _grpo_experience()
    module.advantages(exp)
    mask = exp.response_mask.bool()
    assert torch.equal(exp.advantages[:4], torch.zeros(4, 6))  # the all-alike group: exactly 0
    # group 1: mean 0.25; centred 0.75 / -0.25; unbiased std 0.5
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25]) / (0.5 + 1e-6 if scale else 1.0)
    for row, value in zip(range(4, 8), expected):
        assert torch.allclose(exp.advantages[row][mask[row]], value.expand(int(mask[row].sum())), atol=1e-6, rtol=0)
    assert torch.equal(exp.advantages[~mask], torch.zeros(int((~mask).sum())))


def test_grpo_with_whitening_asked_for_is_an_error(tmp_path, no_model_load):
    with pytest.raises(ValueError, match=r"`model.ppo.whiten_advantages: true` with `model.advantage_estimator: grpo`:"
                                         r" whitening is a GAE option"):
        _cli(tmp_path, "--model.advantage_estimator=grpo", "--model.ppo.whiten_advantages=true")


# -- bad input: one clear error, before any model is loaded ---------------------------------


@pytest.mark.parametrize(
    ("estimator", "settings", "message"),
    [
        ("grpo", dict(critic=CriticConfig(name_or_path="x")),
         r"^`model.critic.name_or_path` is set, but `model.advantage_estimator: grpo` learns no value function"),
        ("rloo", dict(ppo=PPOConfig(whiten_advantages=True)), r"^`model.ppo.whiten_advantages: true` with `model.adv"),
        ("rloo", dict(generation=GenerationConfig(do_sample=False)),
         r"^`model.generation.do_sample: false` with `model.advantage_estimator: rloo`"),
        ("reinforce_pp", dict(ppo=PPOConfig(filter_groups=True)),
         r"^`model.ppo.filter_groups: true` with `model.advantage_estimator: reinforce_pp`: .* only \('grpo'"),
        ("gae", dict(ppo=PPOConfig(policy_loss="gspo")), r"^`model.ppo.policy_loss: gspo` with `model.advantage_estimator: gae`"),
        ("grpo", dict(ppo=PPOConfig(overlong={"buffer": 8})),
         r"^`model.ppo.overlong.buffer` \(8\) is longer than `model.generation.max_new_tokens` \(4\)"),
    ],
)
def test_objective_combinations_that_cannot_work(estimator, settings, message):
    args = dict(generation=GenerationConfig(max_new_tokens=4), ppo=PPOConfig(), critic=CriticConfig()) | settings
    with pytest.raises(ValueError, match=message):
        ppo.PPOModule._validate_objective(estimator, args["generation"], args["ppo"], args["critic"])


def test_objective_errors_name_the_yaml_keys_from_the_cli(tmp_path, no_model_load):
    """The group's own rules (dual clip on GSPO; a TIS lower bound) and the engine rule, through the CLI."""
    with pytest.raises(ValueError, match=r"^`model.ppo.clip_ratio_c` \(the dual clip\) is a term of `model.ppo.policy_loss:"
                                         r" vanilla`, not of `model.ppo.policy_loss: gspo`"):
        _cli(tmp_path, "--model.advantage_estimator=grpo", "--model.ppo.policy_loss=gspo", "--model.ppo.clip_ratio_c=3")
    with pytest.raises(ValueError, match=r"^`model.ppo.rollout_correction.lower` is a bound of"
                                         r" `model.ppo.rollout_correction.mode: mis`"):
        _cli(tmp_path, "--model.ppo.rollout_correction.mode=tis", "--model.ppo.rollout_correction.lower=0.5")
    with pytest.raises(ValueError, match=r"^`model.ppo.rollout_correction.mode: tis` weighs samples by the rollout engine's"
                                         r" own log-probs, and `model.rollout_engine.name: hf`"):
        _cli(tmp_path, "--model.ppo.rollout_correction.mode=tis")


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was reported")

    monkeypatch.setattr(ppo, "load_causal_lm", refuse)
    monkeypatch.setattr(ppo, "load_value_model", refuse)
    monkeypatch.setattr(ppo, "load_reward_models", refuse)


def _cli(tmp_path, *extra):
    return ppo.main(
        ["fit", "--config", CONFIG, f"--trainer.default_root_dir={tmp_path}", f"--model.name_or_path={TINY_MODEL}", *extra]
    )


def test_reward_class_path_that_does_not_import(tmp_path, no_model_load, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _cli(tmp_path, "--model.reward.class_path=recipes.rewards.NoSuchReward")
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    assert "model.reward" in err and "recipes.rewards.NoSuchReward" in err


def test_memory_plan_that_parks_a_model_it_needs(tmp_path, no_model_load):
    with pytest.raises(ValueError, match=r"`model.memory_plan.score.reference` is 'host', but the score phase"):
        _cli(tmp_path, "--model.memory_plan.score.reference=host")


def test_reward_rule_and_reward_model_together(tmp_path, no_model_load):
    with pytest.raises(SettingError, match=r"^set exactly one of `model.reward` \(a rule's class_path\) and `model.reward_model`.*; this config sets both$"):
        _cli(tmp_path, f"--model.reward_model.name_or_path={TINY_MODEL}")


def test_grpo_group_of_one(tmp_path, no_model_load, capsys):
    # A typed constraint (AtLeastTwo): the parser refuses it, naming the key, before anything is built.
    with pytest.raises(SystemExit):
        _cli(tmp_path, "--model.advantage_estimator=grpo", "--model.grpo.group_size=1")
    assert re.search(r'"model.grpo.group_size":\s+Not of type AtLeastTwo: 1 does not conform to restriction v>=2', capsys.readouterr().err)


def test_lora_target_typo_fails_before_the_policy_loads(tmp_path, no_model_load):
    with pytest.raises(ValueError, match=r"`model.lora.target_modules`: \['qkv'\] matches no linear module of LlamaForCausalLM"):
        _cli(tmp_path, "--model.lora.r=4", "--model.lora.target_modules=[q_proj, qkv]")


def test_lora_takes_peft_names_only(tmp_path, no_model_load, capsys):
    with pytest.raises(SystemExit):
        _cli(tmp_path, "--model.lora.r=4", "--model.lora.alpha=8")
    assert "alpha" in capsys.readouterr().err


def test_missing_policy_checkpoint(tmp_path, no_model_load):
    with pytest.raises(FileNotFoundError, match=r"`model.name_or_path`: model path './no-sft-export' does not exist"):
        _cli(tmp_path, "--model.name_or_path=./no-sft-export")


def test_prompt_row_without_the_rewards_key_fails_before_any_model(tmp_path, no_model_load):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1 + 1 =", "answer": "2"}\n{"prompt": "2 + 2 ="}\n')
    with pytest.raises(ValueError, match=r"prompts.jsonl:2: no `answer`, which the reward ExactAnswerReward needs"):
        _cli(tmp_path, f"--data.train_file={prompts}", "--data.batch_size=1")


# -- end to end: the real CLI, SFT warm-up then PPO ---------------------------------------------


# `sft_export` (tests/conftest.py): the SFT demo's export, made once a session, the policy PPO starts from.


def _ppo(root, sft_export, *extra, config=CONFIG):
    run = run_recipe(
        "ppo", "fit", "--config", config, f"--trainer.default_root_dir={root}", f"--model.name_or_path={sft_export}",
        *csv_logger_args(root), *extra,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return root


SHORT_EPOCHS = 8  # 128 PPO steps, about 75 s: the tiny config's first quarter


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory, sft_export):
    """The tiny config cut to its first quarter (128 of 512 PPO steps)."""
    return _ppo(tmp_path_factory.mktemp("ppo"), sft_export, f"--trainer.max_epochs={SHORT_EPOCHS}")


def _quarters(root) -> list[float]:
    rewards = [v for _, v in sorted(read_metric(root, "reward_mean").items())]
    q = len(rewards) // 4
    return [sum(rewards[i * q : (i + 1) * q]) / q for i in range(4)]


def test_rewards_are_in_unit_range(ppo_run):
    rewards = [v for _, v in sorted(read_metric(ppo_run, "reward_mean").items())]
    assert len(rewards) == 16 * SHORT_EPOCHS
    assert all(0.0 <= r <= 1.0 for r in rewards)


def test_short_run_raises_the_reward(ppo_run):
    """A quarter of the config's budget. Each quarter of this run is 1,024 sampled answers, so the
    difference of two quarter means has a standard error of about 0.02; measured on 2026-11-22, from
    the SFT start of then: +0.07 (0.588 -> 0.658). The bar sits two standard errors below that."""
    first, *_, last = _quarters(ppo_run)
    assert last >= first + 0.03, _quarters(ppo_run)


def test_ppo_export_gives_the_right_answer_more_probability(ppo_run, sft_export):
    """Apart from the training metric, and free of sampling noise: the probability the exported
    actor gives the exact answer (the expected reward of one rollout), averaged over the 512
    prompts, beats the policy it started from. Measured on 2026-11-22: 0.611 -> 0.677 (docs/ppo.md)."""
    from scripts.eval_arithmetic import evaluate

    before = evaluate(str(sft_export), limit=512)
    after = evaluate(str(ppo_run / "export"), limit=512)
    assert after["answer_probability"] >= before["answer_probability"] + 0.03, (before, after)
    assert before["greedy_exact"] >= 0.6, before  # the SFT demo taught the task (measured 0.877 on 2026-11-23)


@pytest.mark.slow  # the target, on the full config: about 5 minutes (`pytest -m slow`)
def test_reward_improves_over_the_full_tiny_config(tmp_path, sft_export):
    first, *_, last = _quarters(_ppo(tmp_path, sft_export))
    assert last >= first + 0.15, (first, last)


def test_every_metric_is_logged(ppo_run):
    for name in (
        "reward_mean", "reward_std", "kl", "kl_coef", "policy_loss", "value_loss", "clipfrac", "entropy", "approx_kl",
        "response_length", "gen_tokens_per_s", "time_rollout_s", "time_score_s", "time_train_s",
    ):
        assert len(read_metric(ppo_run, name)) == 16 * SHORT_EPOCHS, name
    assert (ppo_run / "export" / "model.safetensors").is_file()


# -- the tiny GRPO config ---------------------------------------------------------------------------

GRPO_CONFIG = str(REPO / "configs" / "ppo" / "tiny_cpu_grpo.yaml")
GRPO_SHORT_STEPS = 16  # of the config's 128
# Measured (docs/ppo.md): P(exact answer) 0.611 -> 0.633 after 16 steps, -> 0.671 after 128; the
# training reward's quarters 0.611 -> 0.646 (each quarter 2,048 answers: standard error of the
# difference ~0.015). The quarter bar sits about 1.7 standard errors below the measurement; the
# P(exact answer) bars at about half the measured gains (no sampling noise in that number, but
# another machine's float rounding can draw other rollouts). After 16 steps the gain is not yet
# reliable: a second run after the logits-path merge measured 0.6127 -> 0.6183 (+0.006), so the
# default suite checks that the 16 steps moved the policy without collapsing it, and the gain is
# the slow test's.
GRPO_SHORT_FLOOR = 0.01  # P(exact answer) may not fall by more than this
GRPO_QUARTER_GAIN = 0.01
GRPO_FULL_GAIN = 0.03


@pytest.fixture(scope="module")
def grpo_short_run(tmp_path_factory, sft_export):
    """The GRPO config's first 16 steps (8 prompts x 8 answers each)."""
    root = tmp_path_factory.mktemp("grpo")
    return _ppo(root, sft_export, "--trainer.max_epochs=1", f"--trainer.limit_train_batches={GRPO_SHORT_STEPS}",
                "--trainer.enable_progress_bar=false", config=GRPO_CONFIG)


def test_grpo_tiny_config_short_run(grpo_short_run, sft_export):
    """The default suite's share of the GRPO config: 16 steps of 64 answers scored in groups of 8,
    no critic; the actor moved, and gives the exact answer no less probability than the SFT start
    (the reward's rise is the slow test's; see docs/ppo.md for the measured values)."""
    from safetensors.torch import load_file

    from scripts.eval_arithmetic import evaluate

    rewards = read_metric(grpo_short_run, "reward_mean")
    assert sorted(rewards) == list(range(GRPO_SHORT_STEPS))
    assert all(0.0 <= r <= 1.0 and (r * 64) == round(r * 64) for r in rewards.values()), rewards
    assert not read_metric(grpo_short_run, "value_loss")
    before = evaluate(str(sft_export), limit=512)
    after = evaluate(str(grpo_short_run / "export"), limit=512)
    assert after["answer_probability"] >= before["answer_probability"] - GRPO_SHORT_FLOOR, (before, after)
    start, end = load_file(sft_export / "model.safetensors"), load_file(grpo_short_run / "export" / "model.safetensors")
    assert sum(not torch.equal(start[k], end[k]) for k in start) > len(start) // 2


@pytest.mark.slow  # the full GRPO config, 128 steps: about 16 minutes on 2 loaded cores (`pytest -m slow`)
def test_grpo_tiny_config_raises_the_reward(tmp_path, sft_export):
    from scripts.eval_arithmetic import evaluate

    root = _ppo(tmp_path, sft_export, "--trainer.enable_progress_bar=false", config=GRPO_CONFIG)
    first, *_, last = _quarters(root)
    assert last >= first + GRPO_QUARTER_GAIN, _quarters(root)
    before = evaluate(str(sft_export), limit=512)
    after = evaluate(str(root / "export"), limit=512)
    assert after["answer_probability"] >= before["answer_probability"] + GRPO_FULL_GAIN, (before, after)


# -- resume ---------------------------------------------------------------------------------------


def test_resume_repeats_the_uninterrupted_run_exactly(tmp_path, sft_export):
    """6 PPO steps straight, against 3 steps, a stop, and ``--ckpt_path last``: the same rollouts
    (the sampling stream is in the checkpoint) give the same rewards, losses and KL at every step.
    4 steps make an epoch of the 16 prompts, so the resumed part also crosses an epoch boundary
    (where a new DataLoader iterator draws from the global generator)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join((ARITH / "prompts.jsonl").read_text().splitlines(keepends=True)[:16]))
    same = [
        f"--data.train_file={prompts}", "--data.batch_size=4", "--model.ppo.ppo_epochs=1",
        "--model.ppo.num_mini_batches=1", "--checkpoint.every_n_train_steps=2", "--model.export_dir=null",
        "--trainer.enable_progress_bar=false",
    ]  # global_step counts optimizer steps: 2 (actor, critic) per PPO step here
    whole = _ppo(tmp_path / "whole", sft_export, *same, "--trainer.max_steps=12")
    part = _ppo(tmp_path / "part", sft_export, *same, "--trainer.max_steps=6")
    assert sorted(read_metric(part, "reward_mean")) == [0, 1, 2]
    _ppo(part, sft_export, *same, "--trainer.max_steps=12", "--ckpt_path=last")
    for name in ("reward_mean", "response_length", "policy_loss", "value_loss", "kl", "entropy", "approx_kl"):
        expected, resumed = read_metric(whole, name), read_metric(part, name)
        assert sorted(expected) == list(range(6)), name
        assert resumed == expected, (name, expected, resumed)
    assert len(set(read_metric(whole, "reward_mean").values())) > 1  # the steps did differ


# -- FSDP2 on 2 CPU ranks: the same update as one process on the same global batch ---------------


def test_two_fsdp2_ranks_make_the_single_process_update(tmp_path, sft_export):
    """16 prompts, greedy rollouts (so both runs see the same responses), one PPO step with plain
    SGD: the 2-rank run (8 prompts each, sharded actor/critic/reference, activation checkpointing
    and offload, global whitening and token normalisation) must write the single-process weights."""
    from safetensors.torch import load_file

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join((ARITH / "prompts.jsonl").read_text().splitlines(keepends=True)[:16]))
    same = [
        f"--model.name_or_path={sft_export}", f"--data.train_file={prompts}", "--trainer.max_epochs=1",
        "--model.generation.do_sample=false", "--model.ppo.ppo_epochs=1", "--model.ppo.num_mini_batches=1",
        "--model.ppo.max_grad_norm=null", "--model.optimizer.class_path=torch.optim.SGD",
        "--model.optimizer.init_args.lr=1.0", "--model.critic_optimizer.class_path=torch.optim.SGD",
        "--model.critic_optimizer.init_args.lr=1.0", "--trainer.logger=false",
    ]
    runs = {
        "single": ["--config", CONFIG, "--data.batch_size=16"],
        "fsdp2": ["--config", str(REPO / "configs" / "ppo" / "tiny_cpu_fsdp2.yaml"), "--data.batch_size=8"],
    }
    weights = {}
    for name, args in runs.items():
        root = tmp_path / name
        run = run_recipe("ppo", "fit", *args, *same, f"--trainer.default_root_dir={root}")
        assert run.returncode == 0, run.stderr[-3000:]
        weights[name] = load_file(root / "export" / "model.safetensors")
    start = load_file(sft_export / "model.safetensors")
    assert weights["single"].keys() == weights["fsdp2"].keys()
    for key, value in weights["single"].items():
        torch.testing.assert_close(weights["fsdp2"][key], value, atol=1e-5, rtol=1e-4, msg=key)
    assert sum(not torch.equal(weights["single"][k], start[k]) for k in start) > len(start) // 2
