"""Distillation: a frozen teacher's distribution as the training signal for a student.

- :mod:`.teacher`: the teacher role (loading, placement in the memory plan, its hidden states and
  per-token log-probs);
- :mod:`.vocabulary`: teacher and student must share a tokenizer (checked before anything loads);
- :mod:`.divergences`: forward KL, reverse KL and generalized JSD a vocabulary slice at a time;
- :mod:`.logit`: logit distillation beside a cross-entropy (the SFT recipe's ``model.distillation``).
"""

from lightning_mem.distillation.divergences import Divergence, distillation_divergence, reference_rows
from lightning_mem.distillation.logit import DistillationSettings, LogitDistillation
from lightning_mem.distillation.teacher import Teacher, TeacherSettings, held_models
from lightning_mem.distillation.vocabulary import SharedVocabulary, shared_vocabulary

__all__ = [
    "Divergence",
    "DistillationSettings",
    "LogitDistillation",
    "SharedVocabulary",
    "Teacher",
    "TeacherSettings",
    "distillation_divergence",
    "held_models",
    "reference_rows",
    "shared_vocabulary",
]
