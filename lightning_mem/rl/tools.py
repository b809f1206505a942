"""Python functions as tools: their schemas, parsing the model's calls, running them under a timeout,
and :class:`ToolEnvironment`, the environment that offers them.

The chat template receives each function's JSON schema through its ``tools=`` argument
(transformers' ``get_json_schema`` writes it from the signature and the Google-style docstring:
every argument needs a type hint and a line under ``Args:``). The model's calls are parsed in one
of two formats, the two its template families teach:

- ``hermes`` (Qwen2.5, and the ChatML templates that copy it): one or more
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks anywhere in the message.
- ``llama3`` (Llama 3.1/3.2/3.3 with custom tools): the whole message is one JSON object
  ``{"name": ..., "parameters": {...}}`` (``arguments`` is accepted too), optionally after
  ``<|python_tag|>``.

A message with no call in it is the episode's final answer. One that tries (an opening
``<tool_call>``; for ``llama3`` a message starting with ``{``) but does not parse is fed back as an
error observation and counted (``tool_call_unparsed``); so are calls of unknown tools
(``tool_unknown``), tools that raise (``tool_errors``) and tools that run past ``timeout_s``
(``tool_timeouts``): the episode goes on, and the policy learns from what it reads.
"""

from __future__ import annotations

import importlib
import json
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from lightning_mem.rl.environments import Environment, Message, Step, prompt_of
from lightning_mem.rl.reward import RewardFunction
from lightning_mem.settings import SettingError

CallFormat = Literal["hermes", "llama3"]
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]


class ToolCallError(ValueError):
    """A message that tries to call a tool but does not parse; the text says why."""


def _call_from_json(text: str, argument_keys: tuple[str, ...]) -> ToolCall:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ToolCallError(f"not JSON ({error.msg} at character {error.pos})") from None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise ToolCallError('a call is a JSON object with a string "name"')
    arguments = next((value[key] for key in argument_keys if key in value), {})
    if not isinstance(arguments, dict):
        raise ToolCallError(f'"{argument_keys[0]}" must be a JSON object')
    return ToolCall(value["name"], arguments)


def parse_tool_calls(text: str, call_format: CallFormat = "hermes") -> list[ToolCall] | None:
    """The calls in an assistant message; None when it makes none (a final answer). Raises
    :class:`ToolCallError` for a message that tries and fails."""
    if call_format == "hermes":
        if "<tool_call>" not in text:
            return None
        blocks = _HERMES.findall(text)
        if len(blocks) != text.count("<tool_call>"):
            raise ToolCallError("a <tool_call> without its </tool_call>")
        return [_call_from_json(block.strip(), ("arguments", "parameters")) for block in blocks]
    if call_format == "llama3":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return None
        return [_call_from_json(body, ("parameters", "arguments"))]
    raise ValueError(f"unknown tool call format {call_format!r}; choose 'hermes' or 'llama3'")


class Timeout(Exception):
    """A call that did not return within its time."""


def call_with_timeout(fn: Callable[..., Any], timeout_s: float | None, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, or :class:`Timeout` after ``timeout_s`` seconds (None: no limit).

    The call runs in a daemon thread: Python cannot stop a thread, so a call that never returns is
    left behind (it ends with the process) and the rollout goes on. A tool that may hang for good
    and holds resources should run its work in a subprocess of its own."""
    if timeout_s is None:
        return fn(*args, **kwargs)
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = fn(*args, **kwargs)
        except BaseException as error:  # noqa: BLE001 -- handed to the caller's thread
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True, name=f"call-{getattr(fn, '__name__', 'fn')}")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise Timeout(f"{getattr(fn, '__name__', 'call')} did not return within {timeout_s:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def import_function(path: str, *, key: str) -> Callable[..., Any]:
    """The function at the dotted ``path`` (``package.module.function``), or a :class:`SettingError`
    naming ``key``."""
    module, _, name = path.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module), name) if module else None
    except (ImportError, AttributeError) as error:
        raise SettingError(key, f": cannot import {path!r} ({error})") from None
    if not callable(fn):
        raise SettingError(key, f": {path!r} is not a function (give package.module.function)")
    return fn


def tool_schemas(tools: Sequence[Callable[..., Any]], *, key: str = "tools") -> list[dict[str, Any]]:
    """Each function's JSON schema as the chat template receives it (transformers' ``get_json_schema``),
    or a :class:`SettingError` naming ``key`` and the function whose docstring cannot give one."""
    from transformers.utils import get_json_schema

    schemas = []
    for fn in tools:
        try:
            schemas.append(get_json_schema(fn))
        except Exception as error:  # transformers raises its own types for a docstring it cannot read
            raise SettingError(key, f": {getattr(fn, '__name__', fn)!r} cannot be a tool: {error}") from None
    return schemas


class ToolEnvironment(Environment):
    """Python functions as tools, and a reward rule for the final answer.

    Each assistant message is parsed for calls (``call_format``); the calls run in order, each
    under ``timeout_s``, and their results (``str`` of the return value) come back as ``tool``
    messages; a message without calls is the final answer, scored by ``reward`` (0 without one),
    which ends the episode. Faults are observations, counted (module docstring).

    Args:
        tools: the functions, as dotted import paths from YAML (``recipes.tools.calculator``) or
            the functions themselves from Python.
        reward: the rule that scores the final answer (it reads the row, e.g. its ``answer``).
        call_format: ``hermes`` (Qwen2.5's ``<tool_call>`` blocks) or ``llama3`` (a JSON object).
        timeout_s: a tool call's time limit, in seconds.
        max_calls_per_turn: calls beyond this many in one message are not run (an error says so).
    """

    observation_role = "tool"
    counters = ("tool_calls", "tool_call_unparsed", "tool_unknown", "tool_errors", "tool_timeouts")

    def __init__(self, tools: Sequence[str | Callable[..., Any]], reward: RewardFunction | None = None,
                 call_format: CallFormat = "hermes", timeout_s: float = 10.0, max_calls_per_turn: int = 4) -> None:
        key = "model.environment.init_args.tools"
        self.tools = [import_function(t, key=key) if isinstance(t, str) else t for t in tools]
        self.by_name = {fn.__name__: fn for fn in self.tools}
        if call_format not in ("hermes", "llama3"):  # here, not at the first call
            raise SettingError("model.environment.init_args.call_format", f" must be 'hermes' or 'llama3', got {call_format!r}")
        self.reward, self.call_format = reward, call_format
        self.timeout_s, self.max_calls_per_turn = timeout_s, max_calls_per_turn
        self.row: dict[str, Any] = {}
        self.messages: list[Message] = []

    def required_keys(self) -> Sequence[str]:
        return () if self.reward is None else self.reward.required_keys()

    def reset(self, row: dict[str, Any]) -> list[Message]:
        from lightning_mem.data.chat import row_to_prompt_messages

        self.row, self.messages = row, row_to_prompt_messages(row)
        return list(self.messages)

    def step(self, message: Message) -> Step:
        text = str(message.get("content", ""))
        try:
            calls = parse_tool_calls(text, self.call_format)
        except ToolCallError as error:
            self.count("tool_call_unparsed")
            return Step([self._tool_message(f"error: the tool call does not parse: {error}")], 0.0, False)
        if calls is None:  # the final answer
            score = 0.0 if self.reward is None else float(self.reward([prompt_of(self.messages)], [text], [self.row])[0])
            return Step([], score, True)
        self.count("tool_calls", len(calls))
        return Step([self._tool_message(self._run(call), call.name) for call in calls[: self.max_calls_per_turn]]
                    + [self._tool_message(f"error: at most {self.max_calls_per_turn} calls a turn")
                       for _ in calls[self.max_calls_per_turn :]], 0.0, False)

    def _run(self, call: ToolCall) -> str:
        fn = self.by_name.get(call.name)
        if fn is None:
            self.count("tool_unknown")
            return f"error: no tool named {call.name!r} (tools: {', '.join(self.by_name)})"
        try:
            return str(call_with_timeout(fn, self.timeout_s, **call.arguments))
        except Timeout as error:
            self.count("tool_timeouts")
            return f"error: {error}"
        except Exception as error:  # the tool's own fault, or arguments it does not take
            self.count("tool_errors")
            return f"error: {type(error).__name__}: {error}"

    @staticmethod
    def _tool_message(content: str, name: str | None = None) -> Message:
        return {"role": "tool", "content": content, **({"name": name} if name else {})}
