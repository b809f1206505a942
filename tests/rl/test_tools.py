"""Tools: the schemas the chat template gets, the two call formats parsed, and every fault a call can
make (unparsable, unknown tool, a tool that raises, one that hangs) fed back as an error and counted."""

from __future__ import annotations

import time

import pytest

from lightning_mem.rl.tools import (
    Timeout,
    ToolCallError,
    ToolEnvironment,
    call_with_timeout,
    parse_tool_calls,
    tool_schemas,
)
from lightning_mem.settings import SettingError
from recipes.rewards import ArithmeticReward
from recipes.tools import calculator


def sleepy(seconds: float) -> str:
    """
    Sleep, then say so.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "slept"


def test_a_functions_schema_comes_from_its_signature_and_docstring():
    (schema,) = tool_schemas([calculator])
    assert schema["function"]["name"] == "calculator"
    assert schema["function"]["parameters"]["properties"]["expression"]["type"] == "string"
    assert schema["function"]["parameters"]["required"] == ["expression"]

    def undocumented(x: int) -> int:
        return x

    with pytest.raises(SettingError, match=r"^`tools`: 'undocumented' cannot be a tool"):
        tool_schemas([undocumented])


def test_hermes_calls_are_parsed_one_or_several():
    text = ('I will compute. <tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {"expression": "4 * 5"}}</tool_call>')
    calls = parse_tool_calls(text, "hermes")
    assert [(c.name, c.arguments) for c in calls] == [("calculator", {"expression": "2 + 3"}),
                                                     ("calculator", {"expression": "4 * 5"})]
    assert parse_tool_calls("The answer is 5.", "hermes") is None


def test_llama3_calls_are_one_json_object_after_an_optional_python_tag():
    for text in ('{"name": "calculator", "parameters": {"expression": "2 + 3"}}',
                 '<|python_tag|>{"name": "calculator", "arguments": {"expression": "2 + 3"}}'):
        (call,) = parse_tool_calls(text, "llama3")
        assert (call.name, call.arguments) == ("calculator", {"expression": "2 + 3"})
    assert parse_tool_calls("5", "llama3") is None


@pytest.mark.parametrize(("text", "fmt", "why"), [
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "2"}}', "hermes", "without its </tool_call>"),
    ("<tool_call>{name: calculator}</tool_call>", "hermes", "not JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', "hermes", 'string "name"'),
    ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "hermes", "must be a JSON object"),
    ('{"name": "calculator", "parameters": {"expression": "2"}', "llama3", "not JSON"),
])
def test_a_call_that_does_not_parse_says_why(text, fmt, why):
    with pytest.raises(ToolCallError, match=why):
        parse_tool_calls(text, fmt)


def test_a_call_past_its_timeout_raises_and_the_caller_goes_on():
    with pytest.raises(Timeout, match="did not return within 0.2 s"):
        call_with_timeout(sleepy, 0.2, 30)
    assert call_with_timeout(sleepy, 5.0, 0) == "slept"
    with pytest.raises(ZeroDivisionError):
        call_with_timeout(lambda: 1 / 0, 5.0)


def test_the_tool_environment_answers_calls_and_scores_the_final_answer():
    env = ToolEnvironment(tools=["recipes.tools.calculator", sleepy], reward=ArithmeticReward(), timeout_s=0.2)
    assert env.reset({"prompt": "What is 12 + 7?", "answer": "19"}) == [{"role": "user", "content": "What is 12 + 7?"}]
    call = lambda body: {"role": "assistant", "content": f"<tool_call>{body}</tool_call>"}  # noqa: E731
    steps = [
        env.step(call('{"name": "calculator", "arguments": {"expression": "12 + 7"}}')),
        env.step(call("{calculator}")),
        env.step(call('{"name": "abacus", "arguments": {}}')),
        env.step(call('{"name": "calculator", "arguments": {"expression": "12 / 0"}}')),
        env.step(call('{"name": "calculator", "arguments": {"formula": "1"}}')),
        env.step(call('{"name": "sleepy", "arguments": {"seconds": 30}}')),
    ]
    texts = [s.observations[0]["content"] for s in steps]
    assert texts[0] == "19" and steps[0].observations[0] == {"role": "tool", "content": "19", "name": "calculator"}
    assert texts[1].startswith("error: the tool call does not parse: not JSON")
    assert texts[2] == "error: no tool named 'abacus' (tools: calculator, sleepy)"
    assert texts[3] == "error: ValueError: only integers, +, - and * are allowed"
    assert texts[4].startswith("error: TypeError: ")
    assert texts[5] == "error: sleepy did not return within 0.2 s"
    assert all(not s.done and s.reward == 0 for s in steps)
    final = env.step({"role": "assistant", "content": "19"})
    assert final.done and final.reward == 1.0 and final.observations == []
    assert env.metrics() == {"tool_calls": 5, "tool_call_unparsed": 1, "tool_unknown": 1, "tool_errors": 2,
                             "tool_timeouts": 1}
    assert set(env.metrics()) == set(ToolEnvironment.counters)


def test_calls_beyond_the_turns_limit_are_refused_not_run():
    env = ToolEnvironment(tools=[calculator], max_calls_per_turn=1)
    env.reset({"prompt": "q"})
    two = '<tool_call>{"name": "calculator", "arguments": {"expression": "1 + 1"}}</tool_call>' * 2
    step = env.step({"role": "assistant", "content": two})
    assert [m["content"] for m in step.observations] == ["2", "error: at most 1 calls a turn"]


def test_a_tool_path_that_does_not_import_or_an_unknown_format_names_the_key():
    with pytest.raises(SettingError, match=r"^`model.environment.init_args.tools`: cannot import 'recipes.tools.abacus'"):
        ToolEnvironment(tools=["recipes.tools.abacus"])
    with pytest.raises(SettingError, match=r"^`model.environment.init_args.call_format` must be 'hermes' or 'llama3'"):
        ToolEnvironment(tools=[calculator], call_format="json")
