"""Logit distillation beside a cross-entropy loss: what the SFT recipe calls (``model.distillation``).

Per micro-batch, at the positions the cross-entropy scores (the assistant's tokens):

1. the teacher's forward, without gradients (:meth:`LogitDistillation.teacher_hidden`; a recipe
   runs it as its own phase, so the memory monitor and the estimate show it): its final hidden
   states at those positions, ``[n, H_t]``;
2. inside the student's forward, beside the cross-entropy (``score_tokens(..., extra=...)`` with
   :meth:`LogitDistillation.in_forward`, where a strategy has the student's output layer whole):
   each position's divergence of the student from the teacher, both output layers applied a
   vocabulary slice at a time (:mod:`lightning_mem.distillation.divergences`);
3. :meth:`LogitDistillation.mix`: ``(1 - kd_ratio) * CE + kd_ratio * KD`` (torchtune's), both summed
   over the micro-batch's tokens, so that the recipe's step scale makes each a token mean over the
   optimizer step.

No ``T**2`` factor multiplies the divergence at a temperature (TRL GKD's convention; Hinton et al.
scale by it to keep gradient sizes comparable across temperatures).
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, Literal

import torch
from jsonargparse.typing import ClosedUnitInterval, PositiveFloat, PositiveInt
from torch import Tensor, nn

from lightning_mem.distillation.divergences import Divergence, distillation_divergence
from lightning_mem.distillation.teacher import Teacher, TeacherSettings
from lightning_mem.distillation.vocabulary import SharedVocabulary, shared_vocabulary
from lightning_mem.data.packing import check_packing_attention
from lightning_mem.settings import SettingError, SettingNotSupported, check_fields, settings_at


@dataclass
class DistillationSettings:
    """Logit distillation from a teacher (the SFT recipe's ``model.distillation``).

    Args:
        teacher: the teacher model and its place (:class:`~lightning_mem.distillation.teacher.TeacherSettings`).
        loss: the divergence, ``forward_kl`` (torchtune's), ``reverse_kl`` or ``jsd`` (TRL GKD's
            generalized Jensen-Shannon, with ``beta``).
        beta: ``jsd``'s interpolation: 0 is forward KL, 1 reverse KL (TRL's convention).
        temperature: both models' logits are divided by it.
        kd_ratio: the loss is ``(1 - kd_ratio) * cross_entropy + kd_ratio * divergence``.
        top_k: the divergence over the teacher's ``top_k`` most likely tokens of each position
            only, both models' log-probs normalised over the whole vocabulary (the ``k`` of NeMo
            RL's ``topk_logits_k``, not its renormalisation); null: over the whole vocabulary.
    """

    teacher: TeacherSettings
    loss: Literal["forward_kl", "reverse_kl", "jsd"] = "forward_kl"
    beta: ClosedUnitInterval = 0.5
    temperature: PositiveFloat = 1.0
    kd_ratio: ClosedUnitInterval = 0.5
    top_k: PositiveInt | None = None

    def __post_init__(self) -> None:
        if isinstance(self.teacher, dict):  # the CLI's hparams hold plain dicts
            with settings_at("teacher"):
                self.teacher = TeacherSettings(**self.teacher)
        check_fields(self)


class LogitDistillation:
    """The teacher and the loss of logit distillation (see the module docstring).

    The recipe calls :meth:`check` in ``setup`` (before anything loads), :meth:`load_teacher` in
    ``configure_model``, then per micro-batch :meth:`teacher_hidden`, :meth:`in_forward` (the
    student's scoring forward computes the divergence) and :meth:`mix`. Errors name keys relative to the settings (a recipe adds its prefix).
    """

    def __init__(self, settings: DistillationSettings) -> None:
        self.settings = settings
        self.teacher = Teacher(settings.teacher, output_layer_with_student=True, key="teacher")
        self.measure = Divergence(settings.loss, float(settings.beta))
        self.vocabulary: SharedVocabulary | None = None

    def check(self, student: str, *, trainer: Any = None, trust_remote_code: bool = False,
              packing: bool = False, packing_key: str = "data.packing") -> SharedVocabulary:
        """Before any weight loads: the teacher shares the student's tokenizer, ``top_k`` fits in
        it, its own attention isolates packed examples (``packing``), and the strategy does not split
        the student's sequences or layers (each rank holds a whole teacher, which scores whole
        sequences).

        Raises:
            SettingError: naming the key (``teacher.name_or_path``, ``top_k``).
        """
        if trainer is not None and _splits_the_model(trainer):
            raise SettingNotSupported(
                "teacher", " cannot distill into a student split by tensor or context parallelism yet: the teacher"
                " scores whole sequences on every rank; use data parallelism (FSDP2 without those degrees)")
        attention = self.settings.teacher.attn_implementation
        if packing and attention is not None:  # unset: the student's, which the recipe checks
            check_packing_attention(attention, key="teacher.attn_implementation", packing_key=packing_key)
        self.vocabulary = shared_vocabulary(student, self.settings.teacher.name_or_path,
                                            trust_remote_code=trust_remote_code, key="teacher.name_or_path")
        top_k = self.settings.top_k
        if top_k is not None and top_k > self.vocabulary.width:
            raise SettingError("top_k", f" ({top_k}) exceeds the {self.vocabulary.width} tokens compared")
        return self.vocabulary

    def load_teacher(self, trainer: Any, *, compute_dtype: torch.dtype, trust_remote_code: bool = False,
                     attn_implementation: str | None = None, random_init_dir: str = "random_teacher",
                     init_seed: int = 0) -> nn.Module:
        """Load and place the teacher on the trainer's device (its ``placement``). A 4-bit teacher
        from a config-only folder first gets seeded random weights under ``random_init_dir``
        (relative to ``trainer.default_root_dir``), as a 4-bit load needs weights on disk."""
        from lightning_mem.lora import saved_base

        if self.vocabulary is None:
            raise RuntimeError("LogitDistillation.check must run before load_teacher")
        settings = self.settings.teacher
        source = None
        if settings.quantization is not None:
            source = saved_base(trainer, settings.name_or_path, random_init_dir, seed=init_seed)
        return self.teacher.load(student_device=trainer.strategy.root_device, compute_dtype=compute_dtype,
                                 width=self.vocabulary.width, source=source, trust_remote_code=trust_remote_code,
                                 attn_implementation=attn_implementation)

    def teacher_hidden(self, input_ids: Tensor, attention_mask: Tensor | None, positions: Tensor, *,
                       position_ids: Tensor | None = None) -> Tensor:
        """The teacher's forward (brought onto its device and parked again when ``host``): its
        final hidden states at ``positions``, ``[n, H_t]`` on the student's device, no gradient."""
        with self.teacher.on_device():
            return self.teacher.hidden_states(input_ids, attention_mask, positions, position_ids=position_ids)

    def divergence(self, student_hidden: Tensor, student_head: nn.Module, teacher_hidden: Tensor, *,
                   chunk_size: int | str | None = "auto") -> Tensor:
        """``[n]`` fp32: each position's divergence of the student's distribution (its hidden rows
        through ``student_head``) from the teacher's."""
        s = self.settings
        return distillation_divergence(
            student_hidden, student_head, teacher_hidden, self.teacher.output_layer, divergence=self.measure,
            temperature=float(s.temperature), width=self.vocabulary.width, top_k=s.top_k, chunk_size=chunk_size,
        )

    def in_forward(self, teacher_hidden: Tensor, *, chunk_size: int | str | None = "auto"
                   ) -> Callable[[Tensor, nn.Module], Tensor]:
        """:meth:`divergence` against ``teacher_hidden``, as ``score_tokens``' ``extra``: run inside
        the student's forward on its scored rows and its own output layer."""
        return lambda hidden, head: self.divergence(hidden, head, teacher_hidden, chunk_size=chunk_size)

    def mix(self, cross_entropy: Tensor, divergence: Tensor) -> Tensor:
        """``(1 - kd_ratio) * cross_entropy + kd_ratio * divergence`` (both summed over the same tokens)."""
        ratio = float(self.settings.kd_ratio)
        return (1.0 - ratio) * cross_entropy + ratio * divergence


def _splits_the_model(trainer: Any) -> bool:
    strategy = trainer.strategy
    return any(int(getattr(strategy, name, 1) or 1) > 1 for name in ("tensor_parallel_size", "context_parallel_size"))
