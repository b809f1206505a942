"""Teacher and student must speak the same tokenizer: checked before any weight loads.

Distillation compares the two models' distributions token id by token id, so both must map every
id to the same token. Sizes alone do not show that (two unrelated tokenizers can both have 32,000
tokens), and equal sizes are not needed either: Qwen2.5-7B's output layer has 152,064 rows against
151,936 in the 0.5B and 1.5B models, on the same 151,665-token tokenizer (TRL #3028, torchtune
#2119). The rows past the tokenizer are padding no id ever reaches; both layers are compared on
their first ``width`` rows, the narrower layer's, which holds every id of the shared tokenizer.

Cross-tokenizer distillation (aligning two vocabularies, as TRL's GOLD or NeMo RL's TokenAligner
do) is not built: a teacher with another tokenizer is refused in one line naming both models.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_mem.settings import SettingError


@dataclass(frozen=True)
class SharedVocabulary:
    """What the two models share: ``width`` output rows compared, of ``tokens`` tokenizer ids."""

    tokens: int
    student_rows: int
    teacher_rows: int

    @property
    def width(self) -> int:
        return min(self.student_rows, self.teacher_rows)


def output_rows(name_or_path: str, *, trust_remote_code: bool = False) -> int:
    """The output layer's rows of a model, from its config (``vocab_size``): no weights read."""
    config_file = Path(name_or_path) / "config.json"
    if config_file.is_file():  # a local folder: read as it is, without transformers' defaults
        config = json.loads(config_file.read_text())
    else:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code).to_dict()
    rows = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if not rows:
        raise ValueError(f"{name_or_path}: its config names no vocab_size")
    return int(rows)


def _difference(student: Any, teacher: Any) -> str | None:
    """The first way the two tokenizers map ids differently, in words; None when they agree."""
    ours, theirs = student.get_vocab(), teacher.get_vocab()
    if len(ours) != len(theirs):
        return f"{len(ours)} tokens against {len(theirs)}"
    by_id = {i: t for t, i in theirs.items()}
    for token, index in sorted(ours.items(), key=lambda item: item[1]):
        if by_id.get(index) != token:
            return f"id {index} is {token!r} in the student's and {by_id.get(index)!r} in the teacher's"
    special = {i: str(t) for i, t in student.added_tokens_decoder.items() if getattr(t, "special", False)}
    other = {i: str(t) for i, t in teacher.added_tokens_decoder.items() if getattr(t, "special", False)}
    if special != other:
        index = min(set(special) ^ set(other) or {i for i in special if special[i] != other.get(i)})
        return f"id {index} is a special token in one tokenizer only"
    return None


def shared_vocabulary(student: str, teacher: str, *, trust_remote_code: bool = False,
                      key: str = "teacher.name_or_path") -> SharedVocabulary:
    """Check that ``teacher`` uses ``student``'s tokenizer and that both output layers cover it.

    Reads the two tokenizers and config.json files, never the weights.

    Raises:
        SettingError: naming ``key`` and both models, in one line.
    """
    from lightning_mem.models import load_tokenizer

    ours = load_tokenizer(student, trust_remote_code=trust_remote_code, key=key)
    theirs = load_tokenizer(teacher, trust_remote_code=trust_remote_code, key=key)
    why = _difference(ours, theirs)
    if why is not None:
        raise SettingError(
            key, f": the teacher {teacher!r} and the student {student!r} use different tokenizers ({why});"
            " distillation across tokenizers is not built: pick a teacher of the student's tokenizer family",
        )
    shared = SharedVocabulary(len(ours), output_rows(student, trust_remote_code=trust_remote_code),
                              output_rows(teacher, trust_remote_code=trust_remote_code))
    if shared.tokens > shared.width:
        narrow = student if shared.student_rows <= shared.teacher_rows else teacher
        raise SettingError(
            key, f": the shared tokenizer has {shared.tokens} tokens, but {narrow!r} has an output layer of"
            f" {shared.width} rows: it cannot score every token",
        )
    return shared
