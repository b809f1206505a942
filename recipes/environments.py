"""Multi-turn environments for the PPO recipe, chosen in YAML by ``model.environment.class_path``.

Write your own by subclassing :class:`lightning_mem.rl.environments.Environment` (``reset`` and
``step``) and pointing ``class_path`` at it; ``init_args`` become its constructor arguments, and a
new instance is made for every trajectory. :class:`lightning_mem.rl.tools.ToolEnvironment` offers
Python functions as tools (``recipes.tools.calculator`` is one).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from jsonargparse.typing import PositiveInt

from lightning_mem.data.chat import row_to_prompt_messages
from lightning_mem.rl.environments import Environment, Message, Step
from lightning_mem.settings import SettingError, check_arguments, settings_at

_INTEGER = re.compile(r"^\s*(-?\d+)\s*$")


class ArithmeticRetry(Environment):
    """The shipped arithmetic prompts, with another try after a wrong answer.

    The first turn answers the prompt. A right answer (the bare integer of the row's ``answer``)
    ends the episode with reward 1; a wrong one gets ``feedback`` as the user's next message and
    another try, up to ``tries`` answers in all; the last wrong one ends it with reward 0. A right
    answer at try ``k`` (from 1) is worth ``retry_discount ** (k - 1)``: less than at once, more
    than never, so the policy learns both to answer right and to answer differently when told it
    was wrong. Counts ``retries`` (wrong answers that got another try) and ``solved_on_retry``.
    """

    counters = ("retries", "solved_on_retry")

    def __init__(self, tries: PositiveInt = 2, retry_discount: float = 0.5, feedback: str = "Wrong. Try again.",
                 answer_key: str = "answer") -> None:
        with settings_at("model.environment.init_args"):
            check_arguments(ArithmeticRetry.__init__, {"tries": tries})
            if not 0 <= retry_discount <= 1:
                raise SettingError("retry_discount", f" must be in [0, 1], got {retry_discount}")
        self.tries, self.retry_discount, self.feedback, self.answer_key = tries, retry_discount, feedback, answer_key
        self.answer = ""
        self.tried = 0

    def required_keys(self) -> Sequence[str]:
        return [self.answer_key]

    def reset(self, row: dict[str, Any]) -> list[Message]:
        self.answer, self.tried = str(row[self.answer_key]).strip(), 0
        return row_to_prompt_messages(row)

    def step(self, message: Message) -> Step:
        self.tried += 1
        match = _INTEGER.match(str(message["content"]))
        if match is not None and match.group(1) == self.answer:
            if self.tried > 1:
                self.count("solved_on_retry")
            return Step([], self.retry_discount ** (self.tried - 1), True)
        if self.tried >= self.tries:
            return Step([], 0.0, True)
        self.count("retries")
        return Step([{"role": "user", "content": self.feedback}], 0.0, False)
