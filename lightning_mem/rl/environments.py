"""Environments for multi-turn rollouts (YAML ``model.environment``): what the policy talks to.

An environment is one episode's state. The rollout (:mod:`lightning_mem.rl.multi_turn`) makes a
fresh instance for every trajectory from the factory the YAML names (``class_path`` and
``init_args``, as ``model.reward`` is named), so that no state is shared between trajectories,
and calls it in this order:

1. ``reset(row) -> messages``: the conversation the policy continues (the prompt row's messages,
   a system prompt, a task description...). The chat template renders it with the generation
   prompt, and with :attr:`Environment.tools` as its ``tools=`` argument.
2. ``step(assistant_message) -> (observations, reward, done)``, once per assistant turn:
   ``assistant_message`` is ``{"role": "assistant", "content": text}``, the turn's sampled tokens
   decoded without special tokens (a tool call's markup, ``<tool_call>...``, is text the model
   wrote and stays in it). ``observations`` are the messages that answer it (``user`` or ``tool``
   messages), ``reward`` a number added to the trajectory's score, ``done`` whether the episode
   ended. The observations of a step that ends the episode are not rendered.

A trajectory's score is the sum of its step rewards; the advantage estimators see it as the single
number they see for a single-turn response (:func:`lightning_mem.rl.algorithms.rewards_with_kl_penalty`
puts it on the trajectory's last sampled token).

:meth:`Environment.metrics` returns counts the rollout sums over the step's trajectories and logs
(``multi_turn/<name>``): a tool environment counts its unparsable calls, its tools' errors and
timeouts there.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from lightning_mem.data.chat import row_to_prompt_messages
from lightning_mem.rl.reward import RewardFunction

Message = dict[str, Any]


class Step(NamedTuple):
    """What :meth:`Environment.step` returns (a plain 3-tuple is accepted too)."""

    observations: list[Message]
    reward: float
    done: bool


class Environment:
    """Base class of multi-turn environments; one instance per trajectory.

    Subclasses implement :meth:`reset` and :meth:`step`. Optional: :attr:`tools` (Python functions
    offered through the chat template's ``tools=``; transformers writes each one's JSON schema from
    its signature and docstring), :meth:`required_keys` (row keys checked on every prompt row before
    any model loads, as a reward rule's are) and :meth:`metrics`.
    """

    #: The functions the chat template offers the model as tools; None renders no tools.
    tools: Sequence[Callable[..., Any]] | None = None
    #: The role of this environment's observations, for the start's check that the chat template
    #: renders an observation as a suffix of the conversation so far (``tool`` when it has tools).
    observation_role: str = "user"
    #: The names :meth:`metrics` reports: every rollout logs each of them (zeros included), so
    #: that every rank sums the same names.
    counters: tuple[str, ...] = ()

    def required_keys(self) -> Sequence[str]:
        """The row keys :meth:`reset` or :meth:`step` read (e.g. ``["answer"]``)."""
        return ()

    def reset(self, row: dict[str, Any]) -> list[Message]:
        """The conversation the policy answers first, from the prompt's data row."""
        raise NotImplementedError

    def step(self, message: Message) -> Step | tuple[list[Message], float, bool]:
        """The environment's answer to one assistant turn: ``(observations, reward, done)``."""
        raise NotImplementedError

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to the count ``name`` (reported by :meth:`metrics`)."""
        self.__dict__.setdefault("_counts", Counter())[name] += n

    def metrics(self) -> dict[str, float]:
        """This trajectory's counts (summed over the step's trajectories, logged as ``multi_turn/<name>``)."""
        return dict(self.__dict__.get("_counts", {}))


#: What ``model.environment`` holds: a factory that makes one environment per trajectory. From
#: YAML, ``class_path`` + ``init_args`` become a callable that builds a new instance on each call.
EnvironmentFactory = Callable[[], Environment]


def as_step(result: Any) -> Step:
    """``step``'s result as a :class:`Step`, or a ``TypeError`` that says what came back instead."""
    if not isinstance(result, tuple) or len(result) != 3:
        raise TypeError(f"step must return (observations, reward, done), got {type(result).__name__}")
    observations, reward, done = result
    if not isinstance(observations, list) or not all(isinstance(m, dict) and "role" in m for m in observations):
        raise TypeError("step's observations must be a list of messages (dicts with a `role` and a `content`)")
    return Step(list(observations), float(reward), bool(done))


def prompt_of(messages: list[Message]) -> str:
    """The last user message's text: what a reward rule reads as the prompt in an environment
    (it has no tokenizer to decode the rendered prompt with; the shipped rules read the row)."""
    users = [m.get("content") for m in messages if m.get("role") == "user"]
    return str(users[-1]) if users else ""


class RewardEnvironment(Environment):
    """One turn, scored by a reward rule: the single-turn rollout as an environment.

    ``reset`` returns the row's prompt messages (as the prompt data renders them), ``step`` scores
    the answer with ``reward`` and ends the episode. A run with this environment samples and
    learns exactly what the same run with ``model.reward`` does (tests/rl/test_multi_turn_recipe.py).
    """

    def __init__(self, reward: RewardFunction) -> None:
        self.reward = reward
        self.row: dict[str, Any] = {}
        self.messages: list[Message] = []

    def required_keys(self) -> Sequence[str]:
        return self.reward.required_keys()

    def reset(self, row: dict[str, Any]) -> list[Message]:
        self.row, self.messages = row, row_to_prompt_messages(row)
        return list(self.messages)

    def step(self, message: Message) -> Step:
        score = float(self.reward([prompt_of(self.messages)], [message["content"]], [self.row])[0])
        return Step([], score, True)
