"""PPO and GRPO for a causal LM, with a per-phase memory plan.

    python -m recipes.ppo fit --config configs/ppo/tiny_cpu.yaml

One training step is one PPO iteration on a batch of prompts:

1. rollout:    the actor samples responses (KV cache on); under ReMax also one greedy answer per prompt;
               with an environment, multi-turn trajectories (:mod:`lightning_mem.rl.multi_turn`);
2. score:      a reward rule or reward model judges each response (an environment scored its own);
3.             old logprobs (actor), reference logprobs, values (critic), all without gradients;
               with a distillation teacher, its logprobs of the sampled tokens (a phase of its own);
4. advantages: per-token rewards with a KL penalty and GAE, whitened; or a critic-free estimator
               (GRPO's group-relative scores as they are, RLOO, REINFORCE++, ReMax, OPO, pass@k);
               plus each token's reverse KL to a teacher (on-policy distillation);
               the filters' loss mask and the rollout correction's weights;
5. update:     ``ppo_epochs`` over shuffled mini-batches of token-budget micro-batches: the policy
               loss (clipped surrogate, GSPO, CISPO, Clip-/KL-Cov or GMPO), clipped value loss,
               entropy bonus, each aggregated per ``ppo.loss_agg_mode`` over the whole mini-batch;
               gradient clipping;
6. metrics.

Where each model and optimizer state lives in each phase is the YAML's ``model.memory_plan``
(:mod:`lightning_mem.rl.memory_plan`); strategy, precision, checkpointing and offload callbacks
are the trainer's. This file is only the algorithm.

Steps: ``trainer.max_steps`` (like ``global_step`` and ``checkpoint.every_n_train_steps``) counts
optimizer steps, not PPO iterations: each iteration makes ``ppo_epochs x num_mini_batches`` updates,
and with a separate critic each update steps two optimizers, so an iteration is
``ppo_epochs x num_mini_batches x 2`` steps (x 1 for GRPO or a shared critic). The loggers' step is
the iteration. A learning-rate schedule without ``total_steps`` spans the run.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn

from lightning_mem.callbacks.shared_casts import SharedCasts
from lightning_mem.callbacks.training_dtypes import TrainingDtypes
from lightning_mem.checkpointing import check_trainable_kept, keep_trainable
from lightning_mem.cli import RecipeCLI, run_command
from lightning_mem.clipping import clip_module_gradients
from lightning_mem.data import PromptDataModule, row_to_prompt_messages
from lightning_mem.data.packing import check_packing_attention
from lightning_mem.export import export_hf, export_main
from lightning_mem.logits import ChunkSize, check_chunk_size, check_supported
from lightning_mem.lora import LoraSettings, apply_lora, check_lora_targets, meta_model
from lightning_mem.models import check_model_source, load_causal_lm, load_tokenizer
from lightning_mem.dtypes import cast_trainable, resolve_dtype, trainer_dtypes
from lightning_mem.optim import param_groups, page_where_supported
from lightning_mem.packed_attention import use_packed_sdpa
from lightning_mem.ranks import check_model_splits, check_packing_splits, data_parallel, per_rank_budget, sum_over_replicas
from lightning_mem.schedules import build_lr_scheduler, check_schedule
from lightning_mem.settings import SettingError, settings_at
from lightning_mem.step_io import step_io
from lightning_mem.rl.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    clipped_value_loss,
    gae_advantages,
    grpo_advantages,
    kl_estimate,
    masked_sum,
    rewards_with_kl_penalty,
    whiten,
)
from lightning_mem.rl.advantages import (
    ADVANTAGE_ESTIMATORS,
    GROUPED,
    WITH_CRITIC,
    GREEDY_BASELINE,
    AdvantageEstimator,
    grpo_passk_advantages,
    opo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    remax_advantages,
    rloo_advantages,
)
from lightning_mem.rl.async_client import default_host
from lightning_mem.rl.async_config import AsyncRolloutConfig, check_generator_devices
from lightning_mem.rl.async_generator import GeneratorSpec
from lightning_mem.rl.async_rollout import AsyncRollouts, GreedyAnswers
from lightning_mem.rl.config import CriticConfig, GRPOConfig, KLConfig, PPOConfig, RewardModelConfig, RolloutCorrectionConfig
from lightning_mem.rl.loss_aggregation import counts, denominator, token_weights, weighted_sum
from lightning_mem.rl.policy_losses import SEQUENCE_LOSSES, policy_loss
from lightning_mem.rl.rollout_correction import correction_weights, mismatch_kl
from lightning_mem.rl.sample_filters import groups_filtered, overlong_penalty, truncated, varied_groups
from lightning_mem.rl.engines import RolloutEngineConfig, logprob_mismatch
from lightning_mem.rl.distillation import NoReward, TeacherConfig, check_signals, on_policy_distillation, teacher_alone
from lightning_mem.rl.critic import SeparateCritic, SharedHead, ValueHead, ValueModel, load_value_model, value_function
from lightning_mem.rl.memory_plan import PhaseMemory, PhaseMemoryPlan
from lightning_mem.rl.microbatch import PackedBudget
from lightning_mem.rl.environments import EnvironmentFactory
from lightning_mem.rl.multi_turn import (MultiTurnConfig, MultiTurnRollout, check_multi_turn, check_template,
                                         environment_keys, trajectory_metrics)
from lightning_mem.rl.reference import AdaptersOff, FrozenCopy, ReferenceMode, disable_dropout, reference_policy
from lightning_mem.rl.reward import (
    RewardFunction,
    RewardModel,
    RewardModelEnsemble,
    check_reward_model_sources,
    load_reward_models,
    reward_spread,
)
from lightning_mem.rl.rng import SamplingRNG
from lightning_mem.rl.rollout import Experience, GenerationConfig, RolloutEngine, greedy_rollout, policy_forward


#: Optional per-sample sums of a step and the metric each becomes (their mean over the samples):
#: truncated responses; model.gold_reward's score of the same samples; a reward-model ensemble's
#: members' std; ReMax's greedy answers' score; DAPO's overlong penalty.
_PER_SAMPLE = {"truncated": "truncated_frac", "gold_score": "gold_reward_mean", "reward_model_std": "reward_model_std",
               "baseline_score": "baseline_reward_mean", "overlong_penalty": "overlong_penalty"}


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-6)


class PPOModule(LightningModule):
    """Actor, critic, reference and reward for PPO (``advantage_estimator: gae``) or GRPO.

    Args:
        name_or_path: the policy to start from (usually an SFT checkpoint); folder or hub id.
        dtype, attn_implementation, trust_remote_code: as in the SFT recipe: ``dtype`` is the
            actor's, and with ``lora`` its frozen base's. Every model follows one rule under
            ``trainer.precision`` (:mod:`lightning_mem.dtypes`), whatever the checkpoints'
            ``torch_dtype``: what trains (the actor or its adapters, the critic, the shared value
            head) in the precision's trained dtype, float32 under ``32-true`` and ``*-mixed``; the
            frozen reference copy, and the reward model unless ``reward_model.dtype`` says
            otherwise, in the compute dtype (bfloat16 under ``bf16-mixed``).
        lora: train LoRA adapters instead of the whole actor
            (:class:`~lightning_mem.lora.LoraSettings`, peft's names: ``r``, ``lora_alpha``,
            ``lora_dropout``, ``target_modules``...; the same section as SFT's and QLoRA's). The
            target names are checked on a meta-device twin before any load; the reference is then
            the same model with its adapters disabled, so no second copy is loaded.
        optimizer, lr_scheduler: the actor's (and the shared value head's); the scheduler is
            stepped every optimizer step and also drives the critic's optimizer.
        critic_optimizer: the separate critic's optimizer.
        advantage_estimator: ``gae`` (PPO with a critic); or critic-free: ``grpo`` (group-relative),
            ``rloo`` (leave-one-out group baseline), ``reinforce_pp`` (REINFORCE++: batch-whitened
            returns), ``reinforce_pp_baseline`` (group mean subtracted, then batch-whitened), ``remax``
            (a greedy answer's score as the baseline), ``opo`` (length-weighted group mean) or
            ``grpo_passk`` (only each group's best answer, by its lead over the second)
            (:mod:`lightning_mem.rl.advantages`). The grouped ones (``grpo``, ``rloo``,
            ``reinforce_pp_baseline``, ``opo``, ``grpo_passk``) sample ``grpo.group_size`` answers per
            prompt; ``remax`` samples one and decodes one greedily.
        reward: a rule, ``class_path`` of a :class:`~lightning_mem.rl.reward.RewardFunction`.
        reward_model: a learned reward instead (:class:`~lightning_mem.rl.config.RewardModelConfig`):
            a sequence classifier with one output, such as ``recipes.reward_model``'s export, or a
            list of them whose scores are aggregated (``aggregate``).
        teacher: on-policy distillation (:class:`~lightning_mem.rl.distillation.TeacherConfig`): a
            frozen teacher scores each sampled token in a phase of its own (``teacher``), and each
            token's advantage gains ``coef * (log p_teacher - log p_old)`` after the estimator's
            (:mod:`lightning_mem.rl.distillation`); with ``top_k``, the loss also gains ``loss_coef``
            times the student's divergence from the teacher's ``top_k`` likeliest tokens at every
            sampled position (:mod:`lightning_mem.distillation.topk`). With the teacher, ``reward`` and
            ``reward_model`` may both be unset (every score is then 0).
        gold_reward: a rule scored on every rollout and logged as ``gold_reward_mean``, never trained
            on: the true reward beside a learned one (a reward model's score can rise while the
            rule's does not: over-optimization).
        reference: ``auto`` (adapters off with LoRA, else a frozen copy), ``copy`` or
            ``adapters_off``. Not built when the KL penalty is off.
        generation, ppo, kl, grpo, critic: the knob groups of :mod:`lightning_mem.rl.config`.
        rollout_engine: what samples the rollouts: Hugging Face ``generate`` (``hf``, the default)
            or vLLM (``vllm``) with its memory knobs
            (:class:`~lightning_mem.rl.engines.RolloutEngineConfig`); and where: ``placement:
            colocated`` (the training processes, between updates) or ``separate`` (generator
            processes of their own, each running that engine, sampling ahead of training).
        async_rollout: how far a separate generator may run ahead (``max_staleness``), what happens
            to a late batch, how often weights are sent, the link's timeout
            (:class:`~lightning_mem.rl.async_config.AsyncRolloutConfig`). Unused when colocated.
        environment: multi-turn rollouts instead of one answer per prompt: ``class_path`` of an
            :class:`~lightning_mem.rl.environments.Environment`, one made per trajectory, which
            scores it (``reward`` and ``reward_model`` stay unset).
        multi_turn: the trajectories' budgets and rendering
            (:class:`~lightning_mem.rl.multi_turn.MultiTurnConfig`).
        memory_plan: where things live per phase (:class:`~lightning_mem.rl.memory_plan.PhaseMemoryPlan`).
        logits_chunk_size: response tokens per chunk through the output layer in the score and
            update passes (:mod:`lightning_mem.logits`): at most one chunk's ``[tokens, vocab]``
            logits are alive, and backward recomputes them. ``auto``: as few chunks as keep each
            within 2**26 logits. None or 0: all of a micro-batch's response tokens at once (the
            unchunked path).
        export_dir: where the trained actor and tokenizer are written (HF format) at the end of
            fit, relative to ``trainer.default_root_dir``; None skips it.
    """

    #: Config keys of the optimizers ``configure_optimizers`` returns, in order (for resume warnings).
    optimizer_config_keys = ("model.optimizer", "model.critic_optimizer")

    def __init__(
        self,
        name_or_path: str,
        dtype: str | None = None,
        attn_implementation: str | None = None,
        trust_remote_code: bool = False,
        lora: LoraSettings | None = None,
        optimizer: OptimizerCallable = _adamw,
        lr_scheduler: LRSchedulerCallable | None = None,
        critic_optimizer: OptimizerCallable = _adamw,
        advantage_estimator: AdvantageEstimator = "gae",
        reward: RewardFunction | None = None,
        reward_model: RewardModelConfig | None = None,
        teacher: TeacherConfig | None = None,
        gold_reward: RewardFunction | None = None,
        reference: ReferenceMode = "auto",
        generation: GenerationConfig = GenerationConfig(),
        ppo: PPOConfig = PPOConfig(),
        kl: KLConfig = KLConfig(),
        grpo: GRPOConfig = GRPOConfig(),
        critic: CriticConfig = CriticConfig(),
        memory_plan: PhaseMemoryPlan = PhaseMemoryPlan(),
        logits_chunk_size: ChunkSize = 512,
        rollout_engine: RolloutEngineConfig = RolloutEngineConfig(),
        async_rollout: AsyncRolloutConfig = AsyncRolloutConfig(),
        environment: EnvironmentFactory | None = None,
        multi_turn: MultiTurnConfig = MultiTurnConfig(),
        export_dir: str | None = "export",
    ) -> None:
        super().__init__()
        if isinstance(lora, dict):  # load_from_checkpoint passes the saved hyperparameters back as dicts
            lora = LoraSettings(**lora)
        # Every check that needs no model runs here, so a bad config fails in a second.
        self._validate(name_or_path, dtype, lora, advantage_estimator, reward, reward_model, reference,
                       generation, ppo, kl, grpo, critic, memory_plan, logits_chunk_size,
                       trust_remote_code=trust_remote_code, attn_implementation=attn_implementation,
                       environment=environment, multi_turn=multi_turn, teacher=teacher)
        # logger=False: the CLI logs the whole resolved config (lightning_mem.cli.RunConfigCallback).
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler", "critic_optimizer", "environment"], logger=False)
        ppo = self._check_rollout_engine(rollout_engine, generation, ppo, async_rollout)
        self.rollout_engine_config, self.async_config = rollout_engine, async_rollout
        self.automatic_optimization = False  # several optimizer steps per rollout
        self.strict_loading = False  # checkpoints hold only what trains (on_save_checkpoint)
        self.optimizer_factory, self.critic_optimizer_factory = optimizer, critic_optimizer
        self.lr_scheduler_factory = lr_scheduler
        self._signals(reward, gold_reward, reward_model, teacher, environment, multi_turn)
        self.lora, self.generation, self.ppo, self.kl, self.grpo = lora, generation, ppo, kl, grpo
        self.critic_config, self.memory_plan = critic, memory_plan
        self.logits_chunk_size = check_chunk_size(logits_chunk_size, key="model.logits_chunk_size")
        self.advantage_estimator = advantage_estimator
        self.use_critic = advantage_estimator in WITH_CRITIC
        self.eos_token_ids: list[int] = []
        # What the KL penalty compares with, and where values come from: one object each, chosen
        # here from the config; the step only calls them (rl/reference.py, rl/critic.py).
        self.reference_policy: FrozenCopy | AdaptersOff | None = reference_policy(
            reference, kl_enabled=kl.enabled, lora=lora is not None)
        self.value_function: SharedHead | SeparateCritic | None = (
            value_function(critic.layout) if self.use_critic else None)
        self.kl_controller = self._kl_controller(kl)
        self._unbuilt()

    def _signals(self, reward: RewardFunction | None, gold_reward: RewardFunction | None,
                 reward_model: RewardModelConfig | None, teacher: TeacherConfig | None, environment: EnvironmentFactory | None,
                 multi_turn: MultiTurnConfig) -> None:
        """What scores the samples (a rule, a reward model, an environment, a teacher alone) and
        the gold rule logged beside them."""
        for name in ("reward", "gold_reward"):
            # From the CLI a rule is its class_path, plain data that load_from_checkpoint builds again;
            # one built in Python is an object, kept out of the checkpoint (it need not pickle).
            if isinstance(self.hparams.get(name), RewardFunction):
                del self.hparams[name]
        self.reward_fn = NoReward() if teacher_alone(reward, reward_model, teacher, environment) else reward
        self.gold_reward_fn = gold_reward
        self.environment, self.multi_turn = environment, multi_turn
        # Kept as given: under the CLI, hparams hold the parsed config's plain dicts, not this dataclass.
        self.reward_model_config = reward_model
        self.distillation = on_policy_distillation(teacher)

    @staticmethod
    def _check_rollout_engine(rollout_engine: RolloutEngineConfig, generation: GenerationConfig, ppo: PPOConfig,
                              async_rollout: AsyncRolloutConfig | None = None) -> PPOConfig:
        """The engine's settings, and a rollout correction only where there is drift to correct (in
        separate placement, on by default: the generator's weights lag the trainer's). Returns
        ``ppo``, or a copy of it with that default correction (never the caller's object changed:
        it may be a shared default)."""
        with settings_at("model"):
            rollout_engine.validate(generation)
        separate = rollout_engine.placement == "separate"
        if separate and async_rollout is not None and async_rollout.rollout_correction and not ppo.rollout_correction.enabled:
            ppo = dataclasses.replace(ppo, rollout_correction=RolloutCorrectionConfig(mode="tis"))
            rank_zero_info(
                "async rollouts: the TIS rollout correction is on (each token weighed by pi_old / pi_generator, capped"
                f" at {ppo.rollout_correction.upper:g}): samples may be up to `model.async_rollout.max_staleness`="
                f"{async_rollout.max_staleness} versions old. `model.ppo.rollout_correction` picks another mode;"
                " `model.async_rollout.rollout_correction: false` leaves it off"
            )
        if ppo.rollout_correction.enabled and rollout_engine.name == "hf" and not separate:
            raise SettingError(
                "model.ppo.rollout_correction.mode",
                f"`model.ppo.rollout_correction.mode: {ppo.rollout_correction.mode}` weighs samples by the rollout"
                " engine's own log-probs, and `model.rollout_engine.name: hf` samples with the actor itself (there is"
                " no drift to correct): use `model.rollout_engine.name: vllm`, or `mode: none`"
            )
        return ppo

    def _unbuilt(self) -> None:
        """What configure_model builds (after the data are checked, where a strategy can wrap it).
        The modules are attributes of this module so that strategies, the memory plan and
        checkpoints see them."""
        self.actor: nn.Module | None = None
        self.value_head: ValueHead | None = None  # the shared layout's module
        self.critic: ValueModel | None = None  # the separate layout's module
        self.reference: nn.Module | None = None  # a frozen copy's module (None with adapters_off)
        self.reward_model: RewardModel | RewardModelEnsemble | None = None
        self.tokenizer: Any = None
        self.rollout_engine: RolloutEngine | None = None  # or a VLLMRolloutEngine (same interface)
        # Separate placement: the generator process and the trainer's schedule around it (on_fit_start).
        self.async_rollouts: AsyncRollouts | None = None
        self.trajectories: MultiTurnRollout | None = None  # with an environment: the multi-turn rollout
        self._async_state: dict[str, int] | None = None  # from a checkpoint, until on_fit_start
        self._async_metrics: dict[str, float] = {}
        self.memory: PhaseMemory | None = None
        # The stream rollouts and shuffles draw from; in the checkpoint, so a resume is exact.
        self.sampling_rng: SamplingRNG | None = None

    @property
    def separate(self) -> bool:
        """Whether a generator process of its own samples the rollouts (``placement: separate``)."""
        return self.rollout_engine_config.placement == "separate"

    @property
    def reference_mode(self) -> str | None:
        """``copy``, ``adapters_off``, or None (no KL penalty, no reference)."""
        return None if self.reference_policy is None else self.reference_policy.mode

    @property
    def reads_actor_hidden(self) -> bool:
        """Whether the actor's forwards must return hidden states (a shared value head reads them)."""
        return self.value_function is not None and self.value_function.reads_actor_hidden

    @staticmethod
    def _kl_controller(kl: KLConfig) -> AdaptiveKLController | FixedKLController:
        if kl.target is not None:
            return AdaptiveKLController(kl.coef, kl.target, kl.horizon)
        return FixedKLController(kl.coef)

    @staticmethod
    def _validate(name_or_path, dtype, lora, advantage_estimator, reward, reward_model, reference,
                  generation, ppo, kl, grpo, critic, memory_plan, logits_chunk_size, *,
                  trust_remote_code=False, attn_implementation=None, environment=None, multi_turn=None,
                  teacher=None) -> None:
        check_model_source(name_or_path, key="model.name_or_path")
        if ppo.packing:  # the actor, reference and critic all load with this attention
            check_packing_attention(attn_implementation, key="model.attn_implementation", packing_key="model.ppo.packing")
        resolve_dtype(dtype, key="model.dtype")
        if advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise SettingError("model.advantage_estimator", f" must be one of {ADVANTAGE_ESTIMATORS}, got {advantage_estimator!r}")
        with settings_at("model"):  # what an environment cannot work with (lightning_mem.rl.multi_turn)
            check_multi_turn(environment, multi_turn, scored_otherwise=reward is not None or reward_model is not None,
                             advantage_estimator=advantage_estimator, generation=generation)
        check_signals(reward, reward_model, teacher, environment, advantage_estimator, filter_groups=ppo.filter_groups)
        if reward is not None and not callable(reward):
            raise TypeError(f"`model.reward` must be a RewardFunction, got {type(reward).__name__}")
        if reward_model is not None:  # its config.json: a classifier with more than one output is refused
            check_reward_model_sources(reward_model.name_or_path, key="model.reward_model.name_or_path")
            resolve_dtype(reward_model.dtype, key="model.reward_model.dtype")
        with settings_at("model"):
            reference_policy(reference, kl_enabled=kl.enabled, lora=lora is not None)
        if lora is not None:
            # On a meta-device twin: a target typo fails here, before the policy is read.
            with settings_at("model.lora"):
                check_lora_targets(meta_model(name_or_path, trust_remote_code=trust_remote_code), lora)
        if advantage_estimator in WITH_CRITIC and critic.name_or_path is not None:
            check_model_source(critic.name_or_path, key="model.critic.name_or_path")
        resolve_dtype(critic.dtype, key="model.critic.dtype")
        check_chunk_size(logits_chunk_size, key="model.logits_chunk_size")
        # The settings groups checked their own fields when built (the parser checks the ranges,
        # naming the key); the plan's rule relates its phases.
        with settings_at("model.memory_plan"):
            memory_plan.validate()
        PPOModule._validate_objective(advantage_estimator, generation, ppo, critic)

    @staticmethod
    def _validate_objective(advantage_estimator, generation, ppo, critic) -> None:
        """The combinations of estimator, loss and filters that cannot work, each named by its keys."""
        estimator = f"`model.advantage_estimator: {advantage_estimator}`"
        if advantage_estimator not in WITH_CRITIC:
            if critic.name_or_path is not None:
                raise SettingError("model.critic.name_or_path",
                                   f" is set, but {estimator} learns no value function (only `gae` does)")
            if ppo.whiten_advantages:
                raise SettingError(
                    "model.ppo.whiten_advantages",
                    f"`model.ppo.whiten_advantages: true` with {estimator}: whitening is a GAE option; the critic-free"
                    " estimators define their own normalisation (GRPO's group std, `model.grpo.scale_rewards`; REINFORCE++'s"
                    " batch whitening)"
                )
        if advantage_estimator in GROUPED and not generation.do_sample:
            raise SettingError("model.generation.do_sample",
                               f"`model.generation.do_sample: false` with {estimator}: a group of greedy answers is all alike")
        if advantage_estimator in GREEDY_BASELINE and not generation.do_sample:
            raise SettingError("model.generation.do_sample", f"`model.generation.do_sample: false` with {estimator}: the"
                               " sampled answer would be the greedy baseline itself, and every advantage 0")
        if ppo.filter_groups and advantage_estimator not in GROUPED:
            raise SettingError(
                "model.ppo.filter_groups",
                f"`model.ppo.filter_groups: true` with {estimator}: it drops groups of answers to one prompt that all"
                f" scored alike, and only {GROUPED} sample groups"
            )
        if ppo.policy_loss in SEQUENCE_LOSSES and advantage_estimator in WITH_CRITIC:
            raise SettingError(
                "model.ppo.policy_loss",
                f"`model.ppo.policy_loss: {ppo.policy_loss}` with {estimator}: it weighs a whole response by one ratio"
                " and needs one advantage per response; GAE's differ token by token (use a critic-free estimator, or"
                " `vanilla`)"
            )
        if ppo.overlong.buffer is not None and ppo.overlong.buffer > generation.max_new_tokens:
            raise SettingError(
                "model.ppo.overlong.buffer",
                f"`model.ppo.overlong.buffer` ({ppo.overlong.buffer}) is longer than"
                f" `model.generation.max_new_tokens` ({generation.max_new_tokens}): the penalty ramps up to that length"
            )

    # -- models ------------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        # Before configure_model: a plan that parks a module on the host cannot work when the
        # strategy shards it (FSDP2 owns the shards' storage; offload them with its cpu_offload).
        from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

        if self.separate:
            self._check_separate_placement()
        if self.rollout_engine_config.name == "vllm" and not self.separate and self.trainer.world_size > 1:
            raise SettingError(
                "model.rollout_engine.name",
                "`model.rollout_engine.name: vllm` runs one engine in the training process: use `trainer.devices: 1`"
                f" (this run has {self.trainer.world_size} processes), or the `hf` engine"
            )
        self._check_packing_splits()
        offloaded = self.memory_plan.offloads_modules()
        if offloaded and isinstance(self.trainer.strategy, ModelParallelStrategy):
            raise SettingError(
                "model.memory_plan",
                f"`model.memory_plan`: {offloaded} put a model on the host, but {type(self.trainer.strategy).__name__}"
                " shards every model and owns where its shards live. Keep them 'device' in the plan and use the"
                " strategy's `cpu_offload` instead."
            )
        self.load_dtypes()  # a dtype the precision contradicts fails before any model loads
        check_schedule(self.lr_scheduler_factory, self.trainer, key="model.lr_scheduler", **self._schedule_steps())
        # Models the strategy cannot split its way (heads vs tensor/context-parallel sizes) fail now.
        hp = self.hparams
        sources = [hp.name_or_path]
        if self.use_critic and self.critic_config.layout == "separate":
            sources.append(self.critic_config.name_or_path or hp.name_or_path)
        if self.reward_model_config is not None:  # not hp.reward_model: under the CLI, hparams hold a plain dict
            sources.extend(self.reward_model_config.paths)
        with settings_at("trainer.strategy.init_args"):
            for source in dict.fromkeys(sources):
                check_model_splits(self.trainer, source, trust_remote_code=hp.trust_remote_code)
        if self.distillation is not None:  # the teacher's tokenizer, attention and the strategy, before any load
            with settings_at("model"):
                self.distillation.check(hp.name_or_path, trainer=self.trainer, trust_remote_code=hp.trust_remote_code,
                                        packing=self.ppo.packing)
        # The data are loaded (the datamodule's setup runs first), the models are not: a row the
        # reward rule cannot score fails now rather than minutes into the first rollout.
        train_set = getattr(self.trainer.datamodule, "train_set", None)
        trained_on = self.reward_fn if self.reward_fn is not None else environment_keys(self.environment)
        for rule in (trained_on, self.gold_reward_fn):
            if rule is None or train_set is None:
                continue
            source = str(getattr(self.trainer.datamodule, "train_path", "data"))
            key_sets = getattr(self.trainer.datamodule, "key_sets", None)
            if key_sets is not None:  # the cache's distinct key sets: no row is read
                rule.check_key_sets(key_sets, source=source)
            else:
                rule.check_rows(train_set.rows, source=source)
        if self.environment is not None:  # multi-turn: the chat template renders observations as suffixes
            with settings_at("model"):
                check_template(self.environment, self.multi_turn, load_tokenizer(
                    hp.name_or_path, trust_remote_code=hp.trust_remote_code, key="model.name_or_path"))

    def _check_separate_placement(self) -> None:
        """Separate placement runs with one device, DDP or FSDP2 (gathered before rank 0 sends), each
        training rank sampling prompts of its own; the generators fit the run's ranks."""
        from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

        strategy = self.trainer.strategy
        if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy, ModelParallelStrategy)):
            raise SettingError(
                "model.rollout_engine.placement",
                "`model.rollout_engine.placement: separate` runs with one device, DDP or FSDP2;"
                f" {type(strategy).__name__} is not built for it yet"
            )
        degrees = {key: int(getattr(strategy, key, 1) or 1) for key in ("tensor_parallel_size", "context_parallel_size")}
        split = {key: degree for key, degree in degrees.items() if degree > 1}
        if split:
            key, degree = next(iter(split.items()))
            raise SettingError(
                "model.rollout_engine.placement",
                f"`model.rollout_engine.placement: separate` with `trainer.strategy.init_args.{key}: {degree}`: the"
                " ranks of a tensor or context group share their prompts, and each would ask a generator for its own"
                " samples of them; use a data-parallel FSDP2 (both sizes 1) or `placement: colocated`"
            )
        check_generator_devices(self.async_config, step_io(self.trainer).training_ranks(self.trainer))

    def _check_packing_splits(self) -> None:
        if self.ppo.packing:
            check_packing_splits(self.trainer, packing_key="model.ppo.packing")

    def configure_callbacks(self) -> list[Any]:
        # TrainingDtypes: one line at the start, the dtypes this run really has. SharedCasts: linear
        # layers reading one fp32 tensor share its autocast copy (no number changes; less kept).
        return [TrainingDtypes(), SharedCasts()]

    def load_dtypes(self) -> dict[str, torch.dtype | str]:
        """The dtype each model loads in under ``trainer.precision``: ``actor`` (with ``lora``, its
        frozen base), ``reference`` (a frozen copy: the compute dtype, or the LoRA base's),
        ``critic`` (trained: ``critic.dtype`` must agree), ``reward_model`` (frozen), and
        ``trained``, the dtype of whatever trains (adapters, the value head)."""
        hp = self.hparams
        dtypes = trainer_dtypes(self._trainer, key="trainer.precision")
        load = lambda value, role, key: dtypes.load_dtype(value, role=role, key=key, precision_key="trainer.precision")  # noqa: E731
        with settings_at("model"):
            return {
                "actor": load(hp.dtype, "frozen" if self.lora is not None else "trained", "dtype"),
                "reference": load(hp.dtype if self.lora is not None else None, "frozen", "dtype"),
                "critic": load(self.critic_config.dtype, "trained", "critic.dtype"),
                "reward_model": load(None if self.reward_model_config is None else self.reward_model_config.dtype,
                                     "frozen", "reward_model.dtype"),
                "trained": dtypes.trained,
                "compute": dtypes.compute,
            }

    def configure_model(self) -> None:
        if self.actor is not None:
            return
        hp = self.hparams
        dtypes = self.load_dtypes()
        load = dict(attn_implementation=hp.attn_implementation, trust_remote_code=hp.trust_remote_code,
                    key="model.name_or_path")
        self.tokenizer = load_tokenizer(hp.name_or_path, trust_remote_code=hp.trust_remote_code, key="model.name_or_path")
        self.actor = load_causal_lm(hp.name_or_path, dtype=dtypes["actor"], **load)
        if self.lora is not None:
            self.actor = apply_lora(self.actor, self.lora)
            cast_trainable(self.actor, dtypes["trained"])  # adapters train in the precision's dtype on any base
        # After the adapters exist: their lora_dropout too would give the ratio pi/pi_old two masks.
        disable_dropout(self.actor)
        if self.logits_chunk_size:  # a policy the chunked path cannot score fails here, naming our key
            check_supported(self.actor, key="model.logits_chunk_size")
        if self.reference_policy is not None:
            self.reference = self.reference_policy.build(
                lambda: load_causal_lm(hp.name_or_path, dtype=dtypes["reference"], **load))
        if self.value_function is not None:
            built = self.value_function.build(self.actor, lambda: self._load_critic(dtypes["critic"]),
                                              dtype=dtypes["trained"])
            setattr(self, self.value_function.attribute, built)
        if self.ppo.packing:  # sdpa scores each packed sequence alone, not the whole row under a block mask
            for model in (self.actor, self.reference, self.critic):
                if model is not None:
                    use_packed_sdpa(model)
        if self.reward_model_config is not None:
            rm = self.reward_model_config
            self.reward_model = load_reward_models(
                rm.name_or_path, dtype=dtypes["reward_model"], trust_remote_code=hp.trust_remote_code,
                max_length=rm.max_length, aggregate=rm.aggregate, uncertainty_coef=rm.uncertainty_coef,
                key="model.reward_model.name_or_path",
            )
        if self.distillation is not None:  # frozen, outside this module's tree, placed as `model.teacher.placement` says
            with settings_at("model"):
                self.distillation.load(self.trainer, compute_dtype=dtypes["compute"],
                                       trust_remote_code=hp.trust_remote_code, attn_implementation=hp.attn_implementation)
        self.eos_token_ids = _eos_ids(self.actor, self.tokenizer)
        # Separate placement: the generators run the configured engine; a training rank samples
        # nothing, so it holds the plain one (no weights of its own, nothing to start or sync).
        engine_config = RolloutEngineConfig(placement="separate") if self.separate else self.rollout_engine_config
        self.rollout_engine = step_io(self._trainer).rollout_engine(  # a module built outside a fit has none
            engine_config, self.generation, model_path=hp.name_or_path,
            eos_token_ids=self.eos_token_ids, pad_token_id=self.tokenizer.pad_token_id,
            # An engine with weights of its own samples in what the actor computes in, not in its
            # fp32 master weights.
            dtype=dtypes["compute"], trust_remote_code=hp.trust_remote_code,
        )
        if self.environment is not None:  # multi-turn: the trajectory loop samples with this engine
            self.trajectories = step_io(self._trainer).multi_turn_rollout(
                self.environment, self.multi_turn, tokenizer=self.tokenizer, generation=self.generation,
                engine=self.rollout_engine, eos_token_ids=self.eos_token_ids, pad_token_id=self.tokenizer.pad_token_id)

    def _load_critic(self, dtype: torch.dtype | str) -> ValueModel:
        hp = self.hparams
        critic = load_value_model(
            self.critic_config.name_or_path or hp.name_or_path,
            dtype=dtype,
            attn_implementation=hp.attn_implementation,
            trust_remote_code=hp.trust_remote_code,
            key="model.critic.name_or_path",
        )
        return disable_dropout(critic)

    def configure_optimizers(self) -> Any:
        vf = self.value_function
        actor_params = param_groups(self.actor, weight_decay=None) + (vf.actor_param_groups() if vf else [])
        optimizers = [self.optimizer_factory(actor_params)]
        if vf is not None and vf.has_own_optimizer:
            optimizers.append(self.critic_optimizer_factory(param_groups(vf.module, weight_decay=None)))
        for optimizer, key in zip(optimizers, self.optimizer_config_keys):
            page_where_supported(optimizer, key)  # before any state: a platform that cannot page runs it unpaged
        if self.lr_scheduler_factory is None:
            return optimizers
        return optimizers, [
            {"scheduler": build_lr_scheduler(self.lr_scheduler_factory, o, self.trainer, **self._schedule_steps()),
             "interval": "step"}
            for o in optimizers
        ]

    def _schedule_steps(self) -> dict[str, int]:
        # Each scheduler steps once per mini-batch update; global_step (what max_steps counts)
        # counts every optimizer's step, so a separate critic doubles it.
        separate = self.value_function is not None and self.value_function.has_own_optimizer
        return {"steps_per_batch": self.ppo.ppo_epochs * self.ppo.num_mini_batches,
                "optimizers": 2 if separate else 1}

    def on_fit_start(self) -> None:
        optimizers = self._optimizers()
        self.memory = PhaseMemory(
            self.memory_plan,
            trainer=self.trainer,
            actor_optimizer=optimizers[0],
            critic_optimizer=optimizers[1] if len(optimizers) > 1 else None,
            critic=self.critic,
            reference=self.reference,
            reward_model=self.reward_model,
            rollout_engine=self.rollout_engine,
            actor=self.actor,
            teacher=None if self.distillation is None else self.distillation.teacher,
        )
        # vLLM starts here, with the actor already on its device (its memory knobs see what is left);
        # the actor's weights reach it at the first rollout's sync.
        self.rollout_engine.start()
        self.memory.place("train")  # the resting placement between steps
        if self.sampling_rng is None:  # not restored from a checkpoint: start from the seeded state
            self.sampling_rng = SamplingRNG()
        if self.separate:
            self._start_generator()

    # -- separate placement -------------------------------------------------------------------
    def generator_spec(self) -> GeneratorSpec:
        """What the generator process is started with: its own copy of the actor, loaded from
        ``name_or_path`` in the compute dtype (it then takes the trainer's weights)."""
        hp, cfg = self.hparams, self.async_config
        devices = None  # on the CPU; on GPUs, the node's devices after the training ranks'
        if self.trainer.strategy.root_device.type == "cuda":
            devices = [f"cuda:{self.trainer.num_devices + g}" for g in range(cfg.generator_devices)]
        return GeneratorSpec(
            host=default_host(), port=0, world_size=self.trainer.world_size + cfg.generator_devices,
            generators=cfg.generator_devices, devices=devices, timeout_s=cfg.timeout_s,
            max_staleness=cfg.max_staleness, name_or_path=hp.name_or_path,
            dtype=str(self._generator_dtype()).removeprefix("torch."), generation=self.generation,
            eos_token_ids=self.eos_token_ids, pad_token_id=self.tokenizer.pad_token_id,
            logits_chunk_size=self.logits_chunk_size, attn_implementation=hp.attn_implementation,
            trust_remote_code=hp.trust_remote_code, rng_state=self.sampling_rng.cpu.clone(), num_threads=cfg.cpu_threads,
            # The behaviour log-probs run in the score phase's micro-batches: same budget, same packing.
            logprob_max_tokens=self.ppo.logprob_budget, packing=self.ppo.packing,
            engine=self.rollout_engine_config,  # its `name` picks the generators' engine
            environment=self.environment, multi_turn=self.multi_turn,  # with an environment, they run the trajectories
        )

    def _generator_dtype(self) -> torch.dtype:
        """The generators' weights: the dtype the actor computes in (FSDP2's ``param_dtype`` under a
        32-true master copy), not its fp32 master weights; vLLM's ``rollout_engine.dtype`` if set."""
        engine = self.rollout_engine_config
        if engine.name == "vllm" and engine.dtype is not None:
            return resolve_dtype(engine.dtype)
        return step_io(self.trainer).compute_dtype(self.trainer, self.load_dtypes()["compute"])

    def _start_generator(self) -> None:
        client = step_io(self.trainer).async_client(
            self.generator_spec(), rank=self.trainer.global_rank, world_size=self.trainer.world_size,
            broadcast=self.trainer.strategy.broadcast, bucket_mb=self.rollout_engine_config.sync_bucket_mb,
            sync_dtype=self._generator_dtype(),
        )
        client.start()
        group = self.grpo.group_size if self.advantage_estimator in GROUPED else 1
        self.async_rollouts = AsyncRollouts(self.async_config, client, self._prompts_of, group_size=group,
                                            greedy_baseline=self.advantage_estimator in GREEDY_BASELINE,
                                            multi_turn=self.environment is not None, say=rank_zero_info)
        if self._async_state is not None:
            self.async_rollouts.load_state_dict(self._async_state)

    def _prompts_of(self, iteration: int) -> dict[str, Any]:
        """Iteration ``iteration``'s prompts on this rank, read ahead of the loader (same sampler)."""
        loader = self.trainer.train_dataloader
        return loader.collate_fn(loader.dataset[loader.sampler.batch_at(iteration)])

    @property
    def iteration(self) -> int:
        """PPO iterations run before this one (one per batch; what a resumed run counts on from)."""
        return self.trainer.fit_loop.epoch_loop.batch_progress.total.processed

    def _close_generator(self, *, kill: bool = False) -> None:
        if self.async_rollouts is not None:
            self.async_rollouts.close(kill=kill)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.sampling_rng.enter()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # Lightning runs the callbacks' hook (ModelCheckpoint's save) before this one: the stream
        # is still live then, and SamplingRNG.state_dict reads it from the generator.
        self.sampling_rng.exit()

    def on_train_epoch_start(self) -> None:
        # Lightning puts the whole module in train mode at each epoch; the frozen models stay in eval.
        for frozen in (self.reference, self.reward_model):
            if frozen is not None:
                frozen.eval()

    # -- one PPO iteration --------------------------------------------------------------------
    # The stages are the recipe's public contract (the memory estimator runs the same ones, and a
    # subclass may override one): `rollout` makes the step's Experience; `score`,
    # `logprobs_and_values` and `advantages` each fill their own fields of it (named in their
    # docstrings) and return nothing; `update` runs the optimizer steps over it through `loss`.
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        try:
            self._iteration_step(batch)
        except Exception:
            self._close_generator(kill=True)  # a generator left running would wait out its timeout
            raise

    def _iteration_step(self, batch: dict[str, Any]) -> None:
        # 1. Rollout: sample responses with the actor (or take the separate generator's samples).
        with self.memory.phase("rollout"):
            exp = self.rollout(batch)
        # 2-3. Score the responses; old and reference logprobs, and values, without gradients.
        with self.memory.phase("score"):
            self.score(exp)
            self.logprobs_and_values(exp)
        # 3b. On-policy distillation: the teacher's logprobs of the sampled tokens, in a phase of its own.
        if self.distillation is not None:
            with self.memory.phase("teacher"):
                self.teacher_logprobs(exp)
        # An engine with weights of its own: how far off-policy it sampled (on-policy, without the
        # old-logprob pass, the update measures it against its own logprobs: see `loss`).
        if exp.engine_logprobs is not None and exp.old_logprobs is not None:
            self.log("engine_logprob_abs_diff", float(logprob_mismatch(exp.engine_logprobs, exp.old_logprobs, exp.response_mask)),
                     on_step=True, on_epoch=False)
        # 4. Advantages: KL-penalised rewards and GAE, or GRPO's group-relative scores.
        self.advantages(exp)
        # 5. Update: ppo_epochs over shuffled mini-batches of token-budget micro-batches.
        with self.memory.phase("train"):
            stats = self.update(exp)
        if self.async_rollouts is not None:  # the generator gets the new weights when a sync is due
            self.async_rollouts.after_update(self.iteration, self.actor)
        # 6. The KL coefficient for the next step, and the step's metrics.
        metrics = self._step_metrics(exp, stats)
        self.kl_controller.update(float(metrics["kl"]), int(metrics.pop("samples")))
        metrics["kl_coef"] = self.kl_controller.value
        self.log_dict({k: float(v) for k, v in metrics.items()}, on_step=True, on_epoch=False)
        self.log("reward", float(metrics["reward_mean"]), prog_bar=True, on_step=True, on_epoch=False)
        if self._async_metrics:  # this rank's: the version it trained on and the time it waited for samples
            self.log_dict(self._async_metrics, on_step=True, on_epoch=False)

    # 1. Rollout ---------------------------------------------------------------------------------
    def rollout(self, batch: dict[str, Any]) -> Experience:
        """A new Experience: the prompts (each ``group_size`` times under GRPO) and the sampled responses."""
        prompt_ids, prompt_mask, rows = batch["input_ids"], batch["attention_mask"], batch["rows"]
        group = self.grpo.group_size if self.advantage_estimator in GROUPED else 1
        if group > 1:  # each prompt `group_size` times, side by side
            prompt_ids = prompt_ids.repeat_interleave(group, dim=0)
            prompt_mask = prompt_mask.repeat_interleave(group, dim=0)
            rows = [row for row in rows for _ in range(group)]
        if self.async_rollouts is not None:
            exp = self._separate_rollout(batch)
        else:
            exp = self._colocated_rollout(batch, prompt_ids, prompt_mask, group, rows)
        exp.group_ids = torch.arange(len(exp), device=self.device) // group
        exp.rows = rows
        exp.prompts = exp.prompts or self.tokenizer.batch_decode(prompt_ids, skip_special_tokens=True)
        exp.responses = exp.responses or self._decode(exp)
        return exp

    def _separate_rollout(self, batch: dict[str, Any]) -> Experience:
        """The generator's samples of this iteration's prompts, each tagged with its weight version
        (under ReMax with the greedy answers it sampled beside them, the same weights'); the
        staleness counts join the step's metrics (summed over ranks)."""
        exp, greedy, metrics = self.async_rollouts.rollout(self.iteration, batch, self.actor)
        if greedy is not None:
            exp.baseline_responses = self._decode(greedy)
        for name in ("input_ids", "attention_mask", "prompt_lengths", "response_ids", "response_mask",
                     "engine_logprobs", "versions", "scores", "sample_keep"):  # (the last two: an environment's)
            if getattr(exp, name) is not None:
                setattr(exp, name, getattr(exp, name).to(self.device))
        counts = {k: v for k, v in metrics.items() if k.startswith("async/staleness_") or k in ("async/dropped", "async/late")}
        exp.sample_stats.update({k: torch.tensor(v, dtype=torch.float64) for k, v in counts.items()})
        self._async_metrics = {k: v for k, v in metrics.items() if k not in counts}
        return exp

    def _colocated_rollout(self, batch: dict[str, Any], prompt_ids: Tensor, prompt_mask: Tensor, group: int,
                           rows: list[dict[str, Any]]) -> Experience:
        synced = self.trainer.world_size > 1
        with step_io(self.trainer).generation(self.actor):
            if self.trajectories is not None:  # multi-turn: a trajectory per row, run against its environment
                return self.trajectories.rollout(self.actor, rows, synced=synced, agree_on_count=self.agree_on_count)
            exp = self.rollout_engine.generate(self.actor, prompt_ids, prompt_mask, synced=synced, group_size=group)
            if self.advantage_estimator in GREEDY_BASELINE:  # ReMax: each prompt's greedy answer, the baseline
                exp.baseline_responses = self._decode(greedy_rollout(self.rollout_engine, self.actor, prompt_ids,
                                                                     prompt_mask, synced=synced))
        return exp

    def _decode(self, exp: Experience | GreedyAnswers) -> list[str]:
        return [self.tokenizer.decode(ids[: int(n)], skip_special_tokens=True)
                for ids, n in zip(exp.response_ids, exp.response_lengths)]

    # 2. Score -----------------------------------------------------------------------------------
    def score(self, exp: Experience) -> None:
        """Fills ``exp.scores``: the reward rule's or the reward model's score of each response (and
        ``exp.baseline_scores``, of the greedy answers, under ReMax)."""
        if exp.scores is None:  # (an environment scored its trajectories as they ran)
            exp.scores = self._scores(exp, exp.responses)
            if (spread := reward_spread(self.reward_model)) is not None:  # an ensemble: how far its members disagree
                exp.sample_stats["reward_model_std"] = spread
        if self.gold_reward_fn is not None:  # logged beside the reward trained on, never trained on
            gold = self.gold_reward_fn(exp.prompts, exp.responses, exp.rows)
            exp.sample_stats["gold_score"] = gold.to(torch.float64).sum()
        if exp.baseline_responses:
            exp.baseline_scores = self._scores(exp, exp.baseline_responses)
            exp.sample_stats["baseline_score"] = exp.baseline_scores.to(torch.float64).sum()
        overlong = self.ppo.overlong
        if overlong.buffer is not None:  # DAPO's soft penalty: the score the update learns from
            penalty = overlong_penalty(exp.response_lengths, max_new_tokens=self.generation.max_new_tokens,
                                       buffer=overlong.buffer, factor=overlong.penalty_factor).to(self.device)
            exp.scores = exp.scores + penalty.to(exp.scores.dtype)
            exp.sample_stats["overlong_penalty"] = penalty.to(torch.float64).sum()

    def _scores(self, exp: Experience, responses: list[str]) -> Tensor:
        if self.reward_fn is not None:
            scores = self.reward_fn(exp.prompts, responses, exp.rows)
        else:
            messages = [row_to_prompt_messages(row) for row in exp.rows]
            scores = self.reward_model(
                messages, responses, max_tokens=self.ppo.logprob_budget, agree_on_count=self.agree_on_count
            )
        return scores.to(self.device)

    # 3. Logprobs and values ---------------------------------------------------------------------
    @property
    def on_policy(self) -> bool:
        """One optimizer step per rollout: the update's policy *is* the rollout's, so its own
        logprobs (detached) serve as the old ones and the separate old-logprob pass is skipped,
        unless something before the update needs them (a KL penalty in the reward, a shared
        value head that reads the actor's hidden states, a distillation teacher's advantage)."""
        # The rollout correction weighs by pi_old / pi_engine before the update, so it needs pi_old first.
        uses_old = (self.reads_actor_hidden or (self.reference_policy is not None and self.kl.in_reward)
                    or self.ppo.rollout_correction.enabled or self.distillation is not None)
        return self.ppo.ppo_epochs == 1 and self.ppo.num_mini_batches == 1 and not uses_old

    def _policy(self, model: nn.Module, mb: Experience, **kwargs: Any) -> Any:
        return policy_forward(
            model, mb, temperature=self.generation.temperature, chunk_size=self.logits_chunk_size,
            packed=self.ppo.packing, **kwargs
        )

    def _budget(self, max_tokens: int | None) -> int | PackedBudget | None:
        """A micro-batch budget as the plan takes it: per rank, and counted in real tokens when the
        micro-batches run packed (a row holds no padding, so the same budget fits more sequences)."""
        budget = per_rank_budget(max_tokens, self.trainer)  # a context-parallel rank runs 1/cp of each sequence
        return PackedBudget(budget) if self.ppo.packing and budget is not None else budget

    @torch.no_grad()
    def logprobs_and_values(self, exp: Experience) -> None:
        """Fills ``exp.old_logprobs`` (None on-policy), ``exp.ref_logprobs`` (None without a
        reference) and ``exp.old_values`` (None without a critic), micro-batch by micro-batch."""
        shape = exp.response_ids.shape
        reference, values = self.reference_policy, self.value_function
        # float32 under any precision: bf16-true makes bf16 torch's default dtype inside the step.
        zeros = lambda: torch.zeros(shape, dtype=torch.float32, device=self.device)  # noqa: E731
        exp.old_logprobs = None if self.on_policy else zeros()
        exp.ref_logprobs = zeros() if reference is not None else None
        exp.old_values = zeros() if values is not None else None
        plan = step_io(self.trainer).micro_batches
        for idx in plan(exp.sequence_lengths, self._budget(self.ppo.logprob_budget), agree_on_count=self.agree_on_count):
            mb = exp.select(idx)
            cols = mb.response_ids.shape[1]
            hidden = None
            if exp.old_logprobs is not None:
                out = self._policy(self.actor, mb, with_hidden=self.reads_actor_hidden)
                exp.old_logprobs[idx, :cols], hidden = out.logprobs, out.hidden
            if reference is not None:
                exp.ref_logprobs[idx, :cols] = reference.logprobs(self.actor, lambda model: self._policy(model, mb).logprobs)
            if values is not None:
                exp.old_values[idx, :cols] = values.values(mb, hidden, packed=self.ppo.packing)

    @torch.no_grad()
    def teacher_logprobs(self, exp: Experience) -> None:
        """Fills ``exp.teacher_logprobs``: the distillation teacher's logprob of each sampled token, in
        the score phase's micro-batches (no collective: each rank holds a whole teacher)."""
        plan = step_io(self.trainer).micro_batches
        self.distillation.score(exp, lambda lengths: plan(lengths, self._budget(self.ppo.logprob_budget)),
                                temperature=self.generation.temperature, chunk_size=self.logits_chunk_size,
                                packed=self.ppo.packing)

    # 4. Advantages ------------------------------------------------------------------------------
    def advantages(self, exp: Experience) -> None:
        """Fills ``exp.advantages``, ``exp.returns`` (with a critic) and ``exp.kl`` (each sample's KL
        to the reference, zeros without one or when the update measures it on-policy)."""
        mask = exp.response_mask.float()
        # On-policy, the old logprobs come with the update (the KL is then measured there).
        kl = (
            kl_estimate(exp.old_logprobs, exp.ref_logprobs, self.kl.estimator, mask=mask)
            if exp.ref_logprobs is not None and exp.old_logprobs is not None else torch.zeros_like(mask)
        )
        estimator = self.advantage_estimator
        penalty = self.kl_controller.value if self.kl.in_reward else 0.0
        if estimator == "gae":
            rewards = rewards_with_kl_penalty(exp.scores, kl, mask, penalty)
            advantages, exp.returns = gae_advantages(
                rewards, exp.old_values, mask, gamma=self.ppo.gamma, lam=self.ppo.lam
            )
            if self.ppo.whiten_advantages is not False:
                advantages = whiten(advantages, mask, reduce=self._sum_over_ranks)
        elif estimator == "grpo":
            # The group-relative score is the advantage, as it is: no batch whitening on top (a
            # group that scored all alike keeps exactly 0; Dr. GRPO stays unscaled).
            advantages = grpo_advantages(exp.scores, exp.group_ids, mask, scale=self.grpo.scale_rewards)
        elif estimator == "rloo":
            advantages = rloo_advantages(exp.scores, exp.group_ids, mask)
        elif estimator == "reinforce_pp":  # the KL penalty (in the reward) is part of REINFORCE++'s return
            rewards = rewards_with_kl_penalty(exp.scores, kl, mask, penalty)
            advantages = reinforce_pp_advantages(rewards, mask, gamma=self.ppo.gamma, reduce=self._sum_over_ranks)
        elif estimator == "remax":  # the return (KL penalty included) minus the greedy answer's score
            rewards = rewards_with_kl_penalty(exp.scores, kl, mask, penalty)
            advantages = remax_advantages(rewards, exp.baseline_scores, mask)
        elif estimator == "opo":
            advantages = opo_advantages(exp.scores, exp.group_ids, mask)
        elif estimator == "grpo_passk":
            advantages = grpo_passk_advantages(exp.scores, exp.group_ids, mask, scale=self.grpo.scale_rewards)
        else:
            advantages = reinforce_pp_baseline_advantages(exp.scores, exp.group_ids, mask, reduce=self._sum_over_ranks)
        if self.distillation is not None:  # each token's own reverse KL to the teacher, after the estimator's normalisation
            advantages = self.distillation.advantages(exp, advantages)
        exp.advantages = advantages
        exp.kl = kl.sum(dim=1)
        self.sample_mask(exp)
        self.rollout_correction(exp)

    def sample_mask(self, exp: Experience) -> None:
        """Fills ``exp.loss_mask``: the response tokens that train, without the samples the filters
        drop (DAPO's zero-variance groups and truncated responses), and their counts for the metrics."""
        keep = torch.ones(exp.response_mask.shape[0], dtype=torch.bool, device=exp.response_mask.device)
        if exp.sample_keep is not None:  # the rollout's own verdict: a trajectory that failed, or at its budget
            keep &= exp.sample_keep
        if self.ppo.filter_groups:
            varied = varied_groups(exp.scores, exp.group_ids)
            keep &= varied
            dropped, groups = groups_filtered(varied, exp.group_ids)
            exp.sample_stats.update(groups_filtered=dropped, groups=groups)
        if self.ppo.overlong.filter or self.ppo.overlong.buffer is not None:
            cut = truncated(exp.response_ids, exp.response_mask, self.eos_token_ids, self.generation.max_new_tokens)
            exp.sample_stats["truncated"] = cut.to(torch.float64).sum()
            if self.ppo.overlong.filter:
                keep &= ~cut
        versions = getattr(exp, "versions", None)  # separate placement: the version each sample was drawn under
        if versions is not None and self.async_config.late_policy == "drop":  # older than the bound
            keep &= (self.iteration - versions) <= self.async_config.max_staleness
        exp.loss_mask = exp.response_mask * keep.unsqueeze(1).to(exp.response_mask.dtype)

    def rollout_correction(self, exp: Experience) -> None:
        """Fills ``exp.correction_weights`` (TIS) or drops tokens from ``exp.loss_mask`` (MIS), from
        the engine's and the trainer's log-probs of the sampled tokens; and the mismatch metrics."""
        rc = self.ppo.rollout_correction
        if exp.engine_logprobs is None or exp.old_logprobs is None:
            return
        mask = exp.response_mask
        cols = min(exp.engine_logprobs.shape[1], mask.shape[1])
        engine = torch.zeros_like(exp.old_logprobs)
        engine[:, :cols] = exp.engine_logprobs[:, :cols]
        exp.sample_stats["mismatch_kl"] = mismatch_kl(exp.old_logprobs, engine, mask).to(torch.float64).sum()
        if not rc.enabled:
            return
        loss_mask = exp.loss_mask if exp.loss_mask is not None else mask
        c = correction_weights(exp.old_logprobs, engine, loss_mask, mode=rc.mode, level=rc.level, upper=rc.upper,
                               lower=rc.lower)
        exp.sample_stats["correction_affected"] = c.affected.to(torch.float64).sum()
        if rc.mode == "mis":  # dropped tokens leave the loss and its normaliser, as if never sampled
            exp.loss_mask = loss_mask * (~c.affected).to(loss_mask.dtype)
        else:
            exp.correction_weights = c.weights

    # 5. Update ----------------------------------------------------------------------------------
    def update(self, exp: Experience) -> dict[str, Tensor]:
        totals: dict[str, Tensor] = {}
        io = step_io(self.trainer)
        for _ in io.repeats(range(self.ppo.ppo_epochs)):
            order = torch.randperm(len(exp), device=self.device)
            for mini_idx in io.repeats(torch.tensor_split(order, self.ppo.num_mini_batches)):
                mini = exp.select(mini_idx)
                # The loss is averaged over the whole mini-batch on all replicas (its tokens or its
                # sequences, per `loss_agg_mode`), whatever the split into micro-batches and ranks;
                # the gradient average over the data-parallel replicas is undone by their count.
                tokens, sequences = self._sum_over_ranks(counts(self._loss_mask(mini)))
                total = denominator(self.ppo.agg_mode, tokens, sequences, horizon=self.generation.max_new_tokens)
                scale = (data_parallel(self.trainer)[0] / total).float()
                for idx in io.micro_batches(
                    mini.sequence_lengths, self._budget(self.ppo.max_tokens_per_microbatch),
                    agree_on_count=self.agree_on_count,
                ):
                    loss, terms = self.loss(mini.select(idx))
                    self.manual_backward(loss * scale)
                    for name, value in terms.items():
                        totals[name] = totals.get(name, 0.0) + value
                self._optimizer_step()
        return totals

    @staticmethod
    def _loss_mask(exp: Experience) -> Tensor:
        return exp.response_mask if exp.loss_mask is None else exp.loss_mask

    def loss(self, mb: Experience) -> tuple[Tensor, dict[str, Tensor]]:
        """The micro-batch's share of the loss: each term's per-token values times their
        aggregation weights, summed (the update divides by the mini-batch's tokens or sequences,
        :mod:`lightning_mem.rl.loss_aggregation`); and the terms for the metrics."""
        mask = mb.response_mask.float()
        loss_mask = self._loss_mask(mb).float()
        weights = token_weights(loss_mask, self.ppo.agg_mode)
        # With no entropy bonus, the entropy is a metric: no gradient through a vocabulary-wide softmax.
        bonus = self.ppo.entropy_coef > 0
        dense = None if self.distillation is None else self.distillation.in_forward(
            mb, temperature=self.generation.temperature, chunk_size=self.logits_chunk_size)
        out = self._policy(self.actor, mb, with_entropy=True, entropy_grad=bonus, with_hidden=self.reads_actor_hidden,
                           extra=dense)
        old_logprobs = out.logprobs.detach() if mb.old_logprobs is None else mb.old_logprobs
        pg = policy_loss(self.ppo.policy_loss, out.logprobs, old_logprobs, mb.advantages, loss_mask,
                         clip_low=self.ppo.clip_low, clip_high=self.ppo.clip_high, clip_c=self.ppo.clip_ratio_c,
                         **self.ppo.loss_options)
        # The rollout correction reweighs the policy term only (the engine's drift is the actor's).
        pg_weights = weights if mb.correction_weights is None else weights * mb.correction_weights
        loss = weighted_sum(pg.loss, pg_weights)
        if bonus:
            loss = loss - self.ppo.entropy_coef * weighted_sum(out.entropy, weights)
        with torch.no_grad():
            count = lambda flags: masked_sum(flags.to(loss.dtype), loss_mask)  # noqa: E731
            terms = {"tokens": loss_mask.sum(), "policy_loss": masked_sum(pg.loss.detach(), loss_mask),
                     "clipped": count(pg.clipped), "clipped_low": count(pg.clipped_low),
                     "clipped_high": count(pg.clipped_high), "dual_clipped": count(pg.dual_clipped),
                     "approx_kl": masked_sum(torch.expm1(pg.log_ratio) - pg.log_ratio, loss_mask),
                     "entropy": masked_sum(out.entropy.detach(), loss_mask)}
            if mb.engine_logprobs is not None and mb.old_logprobs is None:  # pi_old is this pass's
                terms["engine_abs_diff"] = masked_sum((mb.engine_logprobs - out.logprobs.detach()).abs(), mask)
                terms["engine_tokens"] = mask.sum()
        if mb.ref_logprobs is not None and (not self.kl.in_reward or mb.old_logprobs is None):
            kl = kl_estimate(out.logprobs, mb.ref_logprobs, self.kl.estimator, mask=mask)
            terms["kl_sum"] = masked_sum(kl, mask).detach()  # per sample, every response token (the metric)
            if not self.kl.in_reward:
                loss = loss + self.kl_controller.value * weighted_sum(kl, weights)
        if out.extra is not None:  # the teacher's top-k at every token (model.teacher.top_k), a token mean as above
            loss = loss + self.distillation.loss_coef * weighted_sum(out.extra, weights)
            terms["teacher_divergence"] = masked_sum(out.extra.detach(), loss_mask)
        if self.value_function is not None:
            values = self.value_function.values(mb, out.hidden, packed=self.ppo.packing)
            vl = clipped_value_loss(values, mb.old_values, mb.returns, loss_mask, clip_range=self.ppo.value_clip)
            loss = loss + self.ppo.vf_coef * weighted_sum(vl.loss, weights)
            terms.update(value_loss=vl.loss_sum.detach(), value_clipped=vl.clipped_tokens)
        return loss, terms

    def _optimizer_step(self) -> None:
        schedulers = self.lr_schedulers()
        schedulers = [] if schedulers is None else schedulers if isinstance(schedulers, list) else [schedulers]
        for optimizer in self.optimizers() if isinstance(self.optimizers(), list) else [self.optimizers()]:
            if self.ppo.max_grad_norm is not None:  # any AdamW, fused too, under bf16 (lightning_mem.clipping)
                clip_module_gradients(self, optimizer, self.ppo.max_grad_norm, "norm")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        for scheduler in schedulers:
            scheduler.step()

    # 6. Metrics ---------------------------------------------------------------------------------
    def _step_metrics(self, exp: Experience, totals: dict[str, Tensor]) -> dict[str, Tensor]:
        """The step's metrics over all ranks, from one all-reduce of their sums (float64)."""
        scores = exp.scores.to(torch.float64)
        sums = {"score": scores.sum(), "score_sq": (scores * scores).sum(), "samples": len(scores),
                "response_tokens": exp.response_mask.sum(), "kl_rollout": exp.kl.sum(), **exp.sample_stats, **totals}
        stacked = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=self.device) for v in sums.values()])
        t = dict(zip(sums, self._sum_over_ranks(stacked)))
        samples = t["samples"]
        reward_mean = t["score"] / samples
        reward_var = (t["score_sq"] - samples * reward_mean * reward_mean) / (samples - 1).clamp(min=1)
        # On-policy the KL was measured in the (single) update pass, each token once.
        kl_sum = t["kl_sum"] if exp.old_logprobs is None and "kl_sum" in t else t["kl_rollout"]
        # Token means over every update of this step (each token counted once per epoch).
        # (`tokens` are those that trained: every sample may have been filtered.)
        per_token = lambda name: t[name] / t["tokens"].clamp(min=1)  # noqa: E731
        metrics = {
            "samples": samples,
            "reward_mean": reward_mean,
            "reward_std": reward_var.clamp(min=0).sqrt(),
            "kl": kl_sum / samples,
            "policy_loss": per_token("policy_loss"),
            "clipfrac": per_token("clipped"),
            "clipfrac_low": per_token("clipped_low"),
            "clipfrac_high": per_token("clipped_high"),
            "approx_kl": per_token("approx_kl"),
            "response_length": t["response_tokens"] / samples,
            "gen_tokens_per_s": t["response_tokens"] / max(self.memory.seconds["rollout"], 1e-9),
            **{f"time_{phase}_s": seconds for phase, seconds in self.memory.seconds.items()},
            "entropy": per_token("entropy"),
        }
        if "value_loss" in t:
            metrics["value_loss"] = per_token("value_loss")
            metrics["value_clipfrac"] = per_token("value_clipped")
        if self.ppo.clip_ratio_c is not None:
            metrics["clipfrac_dual"] = per_token("dual_clipped")
        if "groups" in t:
            metrics["groups_filtered_frac"] = t["groups_filtered"] / t["groups"]
        metrics.update({name: t[key] / samples for key, name in _PER_SAMPLE.items() if key in t})
        if "teacher_divergence" in t:  # the student's divergence from the teacher's top-k, per token
            metrics["teacher_divergence"] = per_token("teacher_divergence")
        if "teacher_kl" in t:  # the sampled tokens' mean log p_old - log p_teacher (a reverse-KL estimate)
            metrics["teacher_kl"] = t["teacher_kl"] / t["response_tokens"].clamp(min=1)
        # The engine's drift over all response tokens, and the share the correction cut or dropped.
        if "mismatch_kl" in t:
            metrics["mismatch_kl"] = t["mismatch_kl"] / t["response_tokens"]
        if "engine_abs_diff" in t:  # on-policy: measured in the update, every response token once
            metrics["engine_logprob_abs_diff"] = t["engine_abs_diff"] / t["engine_tokens"].clamp(min=1)
        if "correction_affected" in t:
            metrics["correction_affected_frac"] = t["correction_affected"] / t["response_tokens"]
        # Separate placement: the samples trained at each staleness (the histogram), and those dropped.
        metrics.update({name: value for name, value in t.items() if name.startswith("async/")})
        metrics.update(trajectory_metrics(t))  # multi-turn: turns, observation tokens, faults
        return metrics

    # -- ranks --------------------------------------------------------------------------------
    def _sum_over_ranks(self, value: Tensor) -> Tensor:
        # Over the data-parallel replicas: a tensor- or context-parallel group's ranks share samples.
        return sum_over_replicas(self.trainer, value)

    def agree_on_count(self, count: int) -> int:
        if self.trainer.world_size == 1:
            return count
        return int(self.all_gather(torch.tensor(count, device=self.device)).max())

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        optimizers = self.optimizers(use_pl_optimizer=False)
        return optimizers if isinstance(optimizers, list) else [optimizers]

    # -- checkpoints and export ---------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # What trains only: the reference and reward models and a LoRA actor's base never change
        # and reload from their sources (for a 7B policy, 14 GB each in bf16).
        keep_trainable(self, checkpoint)
        checkpoint["kl_controller"] = self.kl_controller.state_dict()
        if self.sampling_rng is not None:
            checkpoint["sampling_rng"] = self.sampling_rng.state_dict()
        if self.async_rollouts is not None:  # the weight version counter (the queue is rebuilt on resume)
            checkpoint["async_rollout"] = self.async_rollouts.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        check_trainable_kept(self, checkpoint)
        if "kl_controller" in checkpoint:
            self.kl_controller.load_state_dict(checkpoint["kl_controller"])
        if "sampling_rng" in checkpoint:
            self.sampling_rng = SamplingRNG()
            self.sampling_rng.load_state_dict(checkpoint["sampling_rng"])
        self._async_state = checkpoint.get("async_rollout")

    def on_fit_end(self) -> None:
        if self.memory is not None:
            self.memory.restore()
        if self.rollout_engine is not None:
            self.rollout_engine.close()
        self._close_generator()
        if self.hparams.export_dir is None:
            return
        self.export(Path(self.trainer.default_root_dir) / self.hparams.export_dir)

    def export(self, out: Path) -> None:
        """Write the actor and tokenizer to ``out`` in HF format (also ``python -m recipes.ppo export``)."""
        export_hf(self.trainer, self.actor, self.tokenizer, out)
        rank_zero_info(f"exported the actor and tokenizer to {out}")


def _eos_ids(model: nn.Module, tokenizer: Any) -> list[int]:
    """Every token that ends a response: the tokenizer's eos and the model's generation config's
    (chat models often stop on an end-of-turn token as well)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(config_eos, int):
        ids.add(config_eos)
    elif config_eos:
        ids.update(config_eos)
    if not ids:
        raise SettingError("model.name_or_path", ": neither the tokenizer nor the generation config names an eos token")
    return sorted(ids)


def main(args: list[str] | None = None) -> RecipeCLI:
    # Two Lightning warnings that every PPO run would print and that are by design here: the frozen
    # reference (and reward model) are in eval mode; and with manual optimization a checkpoint
    # holds the weights after the step's updates, which is the state a resume continues from.
    warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode at the start of training")
    warnings.filterwarnings("ignore", message=r"Using ModelCheckpoint with manual optimization")
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] == ["export"]:  # from a checkpoint; not a Trainer subcommand
        return export_main(RecipeCLI, PPOModule, PromptDataModule, argv[1:])
    return RecipeCLI(PPOModule, PromptDataModule, args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    run_command(main)
