"""On-policy distillation in the PPO recipe (``model.teacher``): the student samples, a frozen
teacher scores every sampled token, and each token's advantage is its own reverse KL to the teacher.

Thinking Machines' "On-Policy Distillation" (Oct 2025) and tinker-cookbook's recipe: with ``x_t``
the t-th sampled response token, ``pi_old`` the student that sampled it and ``q`` the teacher,

    A_t = A_t^reward + coef * (log q(x_t | x_<t) - log pi_old(x_t | x_<t))

on the response tokens (0 elsewhere). ``log pi_old - log q`` at a token the student sampled is a
one-sample estimate of the per-token reverse KL(pi_old || q); the policy gradient with this
advantage lowers it. Per step:

- **teacher phase** (:meth:`OnPolicyDistillation.score`, run by the recipe as a phase of its own
  named ``teacher``, so the memory plan, the ``MemoryMonitor`` and the estimate show it): the
  teacher's log-prob of each response token, ``[N, R]`` fp32, through
  :meth:`lightning_mem.distillation.Teacher.logprobs` (the chunked path: ``[tokens]`` floats, never
  ``[tokens, vocab]``; a padded output layer cut to the shared tokenizer's width), at
  ``generation.temperature``, the temperature the student sampled and is scored at;
- **advantages** (:meth:`OnPolicyDistillation.advantages`): the term above is *added* to the
  advantage the recipe's estimator made from the reward, after that estimator's own normalisation
  (GRPO's group mean and std, GAE's whitening): the reward's part is normalised as it always is,
  the teacher's reaches the loss as it is, per token. The critic's returns (GAE) are the reward's
  only.

Choices, each as tinker-cookbook makes it:

- **discount 0**: a token's advantage is its own log-ratio, not a sum over the tokens after it;
- **the student's log-probs are the behaviour policy's** (``exp.old_logprobs``: the trainer's pass
  over the samples before the update, which the recipe then always runs), fixed for the
  iteration's updates, not the updating policy's. Colocated with the ``hf`` engine they are the
  policy that sampled; with vLLM the same weights as scored by the trainer (the engine's own
  numbers drift from them: ``mismatch_kl``); in separate placement, the trainer's weights at this
  iteration, up to ``async_rollout.max_staleness`` versions newer than the generator's that
  sampled (the rollout correction weighs that gap, as for a reward);
- **no reward needed**: with the teacher alone the reward's part is 0 (every score is 0).

**The dense signal** (``top_k``, :mod:`lightning_mem.distillation.topk`): the teacher phase also
keeps the teacher's ``top_k`` likeliest tokens at every sampled position (``[N, R, k]`` log-probs
and ids), and the update adds ``loss_coef`` times the student's ``divergence`` from them (over those
tokens and the rest of the vocabulary as one outcome), computed inside the student's forward
(:meth:`OnPolicyDistillation.in_forward`) and aggregated as the policy loss. ``coef: 0`` then
turns the one-sample advantage off.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from jsonargparse.typing import ClosedUnitInterval, NonNegativeFloat, PositiveFloat, PositiveInt
from torch import Tensor, nn

from lightning_mem.distillation.divergences import Divergence
from lightning_mem.distillation.teacher import Teacher, TeacherSettings
from lightning_mem.distillation.vocabulary import SharedVocabulary, shared_vocabulary
from lightning_mem.rl.reward import RewardFunction
from lightning_mem.settings import SettingError, SettingNotSupported, check_fields, settings_at


@dataclass
class TeacherConfig(TeacherSettings):
    """The PPO recipe's ``model.teacher``: the teacher (:class:`~lightning_mem.distillation.TeacherSettings`:
    ``name_or_path``, ``dtype``, ``quantization``, ``placement``, ``attn_implementation``) and the
    weight of its advantage.

    Args:
        coef: each token's advantage gains ``coef * (log q - log pi_old)``; beside a reward, the
            reward's advantage keeps weight 1. 0 turns this one-sample signal off (with ``top_k``).
        top_k: the dense signal (:mod:`lightning_mem.distillation.topk`): the teacher's phase keeps
            its ``top_k`` likeliest tokens at every sampled position, and the update adds
            ``loss_coef`` times the student's ``divergence`` from them (over those tokens and the
            rest as one outcome), a token mean like the policy loss; null: no dense signal.
        divergence: the dense signal's ``forward_kl`` (KL(q || p)), ``reverse_kl`` (KL(p || q)) or
            ``jsd`` (TRL GKD's generalized Jensen-Shannon, with ``beta``).
        beta: ``jsd``'s interpolation: 0 is forward KL, 1 reverse KL (TRL's convention).
        loss_coef: the dense signal's weight in the loss (the policy loss keeps weight 1).
    """

    coef: NonNegativeFloat = 1.0
    top_k: PositiveInt | None = None
    divergence: Literal["forward_kl", "reverse_kl", "jsd"] = "reverse_kl"
    beta: ClosedUnitInterval = 0.5
    loss_coef: PositiveFloat = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fields(self)
        if self.coef == 0 and self.top_k is None:
            raise SettingError("coef", " must be positive without `top_k` (then the one-sample advantage is the"
                                       " teacher's only signal), got 0", siblings=("top_k",))


def reverse_kl_advantages(student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor, *, coef: float) -> Tensor:
    """``coef * (teacher - student)`` on the tokens of ``mask``, 0 elsewhere (``[N, R]``): each token's
    own negative reverse-KL estimate, discount 0."""
    return coef * (teacher_logprobs - student_logprobs) * mask.to(student_logprobs.dtype)


def _splits_sequences(trainer: Any) -> dict[str, int]:
    strategy = trainer.strategy
    degrees = {key: int(getattr(strategy, key, 1) or 1) for key in ("tensor_parallel_size", "context_parallel_size")}
    return {key: degree for key, degree in degrees.items() if degree > 1}


class NoReward(RewardFunction):
    """Every response scores 0: the reward of a run whose only signal is the teacher."""

    def score(self, prompts: list[str], responses: list[str], rows: list[dict[str, Any]]) -> list[float]:
        return [0.0] * len(responses)


class OnPolicyDistillation:
    """The teacher of on-policy distillation and its advantage (see the module docstring).

    The recipe calls :meth:`check` in ``setup`` (before any weight loads), :meth:`load` in
    ``configure_model``, then per iteration :meth:`score` in its ``teacher`` phase and
    :meth:`advantages` after the estimator's. Errors name keys relative to ``model`` (``teacher.coef``).
    """

    def __init__(self, config: TeacherConfig) -> None:
        self.config = config
        self.packing = False
        # The whole teacher parks under `placement: host`: only its own forward reads its output layer.
        self.teacher = Teacher(config, output_layer_with_student=False, key="teacher")
        self.vocabulary: SharedVocabulary | None = None
        self.measure = Divergence(config.divergence, float(config.beta))

    def check(self, student: str, *, trainer: Any = None, trust_remote_code: bool = False,
              packing: bool = False) -> SharedVocabulary:
        """Before any weight loads: the teacher shares the student's tokenizer, its own attention
        isolates packed sequences (``packing``), and no rank holds a part of a sequence.

        Raises:
            SettingError: naming ``teacher.name_or_path`` (another tokenizer: one line naming both
                models), ``teacher.attn_implementation`` or ``teacher``.
        """
        from lightning_mem.data.packing import check_packing_attention

        split = _splits_sequences(trainer) if trainer is not None else {}
        if split:
            key, degree = next(iter(split.items()))
            raise SettingNotSupported(
                "teacher", f" with `trainer.strategy.init_args.{key}: {degree}`: the teacher scores whole sequences on"
                " every rank; use data parallelism (FSDP2 without those degrees)")
        self.packing = packing
        if packing and self.config.attn_implementation is not None:  # unset: the student's, checked by the recipe
            check_packing_attention(self.config.attn_implementation, key="teacher.attn_implementation",
                                    packing_key="ppo.packing")
        self.vocabulary = shared_vocabulary(student, self.config.name_or_path, trust_remote_code=trust_remote_code,
                                            key="teacher.name_or_path")
        top_k = self.config.top_k
        if top_k is not None and top_k > self.vocabulary.width:
            raise SettingError("teacher.top_k", f" ({top_k}) exceeds the {self.vocabulary.width} tokens compared")
        return self.vocabulary

    def load(self, trainer: Any, *, compute_dtype: torch.dtype, trust_remote_code: bool = False,
             attn_implementation: str | None = None, init_seed: int = 0,
             random_init_dir: str = "random_teacher") -> torch.nn.Module:
        """Load the teacher frozen and place it (``placement``) beside the trainer's device. A 4-bit
        teacher from a config-only folder first gets seeded random weights under ``random_init_dir``
        (relative to ``trainer.default_root_dir``): a 4-bit load reads weights from disk. Under
        packing (:meth:`check`'s ``packing``) its attention scores each packed sequence alone."""
        from lightning_mem.lora import saved_base
        from lightning_mem.packed_attention import use_packed_sdpa

        if self.vocabulary is None:
            raise RuntimeError("OnPolicyDistillation.check must run before load")
        source = None
        if self.config.quantization is not None:
            source = saved_base(trainer, self.config.name_or_path, random_init_dir, seed=init_seed)
        model = self.teacher.load(student_device=trainer.strategy.root_device, compute_dtype=compute_dtype,
                                  width=self.vocabulary.width, source=source, trust_remote_code=trust_remote_code,
                                  attn_implementation=attn_implementation)
        if self.packing:
            use_packed_sdpa(model)
        return model

    @torch.no_grad()
    def score(self, exp: Any, micro_batches: Callable[[Sequence[int]], list[list[int]]], *, temperature: float,
              chunk_size: int | str | None, packed: bool = False) -> None:
        """Fill ``exp.teacher_logprobs`` (``[N, R]`` fp32, 0 past each response): the teacher's
        log-prob of every sampled response token, micro-batch by micro-batch (``micro_batches``
        maps the samples' lengths to their index lists); with ``top_k``, also
        ``exp.teacher_topk_logprobs`` (``[N, R, k]`` fp32) and ``exp.teacher_topk_ids`` (int32): its
        ``k`` likeliest tokens at each of those positions. A teacher parked on the host must be on
        its device for the call (the memory plan's ``teacher`` phase brings it in,
        :class:`~lightning_mem.rl.memory_plan.PhaseMemory`; or ``teacher.on_device()``)."""
        from lightning_mem.rl.rollout import response_tokens

        k, device = self.config.top_k, exp.response_ids.device
        out = torch.zeros(exp.response_ids.shape, dtype=torch.float32, device=device)
        top = ids = None
        if k is not None:
            top = torch.zeros((*exp.response_ids.shape, k), dtype=torch.float32, device=device)
            ids = torch.zeros((*exp.response_ids.shape, k), dtype=torch.int32, device=device)
        for idx in micro_batches(exp.sequence_lengths):
            mb = exp.select(idx)
            tokens = response_tokens(mb, packed=packed)
            args = (tokens.input_ids, tokens.attention_mask, tokens.positions, tokens.targets)
            kwargs = dict(chunk_size=chunk_size, temperature=temperature, position_ids=tokens.position_ids)
            cols = mb.response_ids.shape[1]
            if k is None:
                out[idx, :cols] = tokens.aligned(self.teacher.logprobs(*args, **kwargs).to(device))
                continue
            target, values, index = self.teacher.top_k(*args, k=k, **kwargs)
            out[idx, :cols], top[idx, :cols], ids[idx, :cols] = (tokens.aligned(t.to(device)) for t in (target, values, index))
        exp.teacher_logprobs, exp.teacher_topk_logprobs, exp.teacher_topk_ids = out, top, ids

    def in_forward(self, mb: Any, *, temperature: float, chunk_size: int | str | None
                   ) -> Callable[[Any], Callable[[Tensor, nn.Module], Tensor]] | None:
        """With ``top_k``: ``policy_forward``'s ``extra`` for the micro-batch ``mb`` (scored by the
        teacher): each response token's divergence of the student from the teacher's stored top-k
        (:func:`~lightning_mem.distillation.topk.top_k_divergence`), the student's log-probs at
        those ids through its output layer a slice at a time, inside its forward. None without."""
        from lightning_mem.distillation.topk import student_logprobs_at, top_k_divergence

        if self.config.top_k is None:
            return None
        width = self.vocabulary.width

        def per_token(tokens: Any) -> Callable[[Tensor, nn.Module], Tensor]:
            index = mb.teacher_topk_ids[tokens.rows, tokens.cols].long()
            teacher = mb.teacher_topk_logprobs[tokens.rows, tokens.cols]
            return lambda hidden, head: top_k_divergence(
                student_logprobs_at(hidden, head, index, width=width, temperature=temperature, chunk_size=chunk_size),
                teacher, self.measure, tail=self.config.top_k < width)

        return per_token

    @property
    def loss_coef(self) -> float:
        """The dense signal's weight in the loss (``top_k``'s divergence)."""
        return float(self.config.loss_coef)

    def advantages(self, exp: Any, reward_advantages: Tensor) -> Tensor:
        """``reward_advantages`` (the estimator's, normalised as it normalises them) plus each
        response token's ``coef * (log q - log pi_old)``; the summed reverse-KL estimate over the
        response tokens goes to ``exp.sample_stats["teacher_kl"]`` (the step's ``teacher_kl``
        metric: its mean per token)."""
        if exp.old_logprobs is None or getattr(exp, "teacher_logprobs", None) is None:
            raise RuntimeError("on-policy distillation needs the old log-probs and the teacher's (score them first)")
        mask = exp.response_mask
        log_ratio = (exp.old_logprobs - exp.teacher_logprobs) * mask.to(exp.old_logprobs.dtype)
        exp.sample_stats["teacher_kl"] = log_ratio.to(torch.float64).sum()
        distilled = reverse_kl_advantages(exp.old_logprobs, exp.teacher_logprobs, mask, coef=float(self.config.coef))
        return reward_advantages + distilled.to(reward_advantages.dtype)


def on_policy_distillation(teacher: TeacherConfig | dict | None) -> OnPolicyDistillation | None:
    """The PPO recipe's ``model.teacher`` (a dict under the CLI's saved hyperparameters), built; None unset."""
    if teacher is None:
        return None
    if isinstance(teacher, dict):
        with settings_at("model.teacher"):
            teacher = TeacherConfig(**teacher)
    return OnPolicyDistillation(teacher)


def teacher_alone(reward: Any, reward_model: Any, teacher: Any, environment: Any = None) -> bool:
    """Whether the teacher is a run's only signal: no rule, no learned reward, no environment."""
    return teacher is not None and reward is None and reward_model is None and environment is None


def check_signals(reward: Any, reward_model: Any, teacher: Any, environment: Any, advantage_estimator: str, *,
                  filter_groups: bool) -> None:
    """Exactly one of ``model.reward`` and ``model.reward_model``, or ``model.environment``, or neither
    beside ``model.teacher`` with an objective that learns from the teacher alone
    (:func:`check_reward_free_objective`).

    Raises:
        SettingError: naming ``model.reward``, ``model.advantage_estimator`` or ``model.ppo.filter_groups``.
    """
    both = reward is not None and reward_model is not None
    if both or (reward is None and reward_model is None and environment is None and teacher is None):
        raise SettingError(
            "model.reward", "set exactly one of `model.reward` (a rule's class_path) and `model.reward_model` (a"
            " learned reward's folder), or `model.environment`, or neither beside `model.teacher`; this config sets"
            f" {'both' if both else 'neither'}", siblings=("model.reward_model",))
    if teacher_alone(reward, reward_model, teacher, environment):
        with settings_at("model"):
            check_reward_free_objective(advantage_estimator, filter_groups=filter_groups)


def check_reward_free_objective(advantage_estimator: str, *, filter_groups: bool) -> None:
    """With the teacher as the only signal (no ``reward``, no ``reward_model``) every score is 0: the
    estimators that learn from the reward alone cannot work. Keys as the PPO module's arguments
    (a recipe adds ``model``).

    Raises:
        SettingError: naming ``advantage_estimator`` or ``ppo.filter_groups``.
    """
    from lightning_mem.rl.advantages import GREEDY_BASELINE, WITH_CRITIC

    why = "with `teacher` alone (no `reward` or `reward_model`) every score is 0"
    named = ("teacher", "reward", "reward_model")
    if advantage_estimator in WITH_CRITIC + GREEDY_BASELINE:
        raise SettingError(
            "advantage_estimator",
            f"`advantage_estimator: {advantage_estimator}` learns from the reward, and {why}: use a critic-free"
            " estimator (`grpo`, whose advantage from equal scores is exactly 0), or set a reward", siblings=named)
    if filter_groups:
        raise SettingError("ppo.filter_groups", f"`ppo.filter_groups: true` drops every group that scored alike,"
                           f" and {why}", siblings=named)
