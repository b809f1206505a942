"""Token in, token out: observations rendered as the difference of two renderings build the whole
conversation's rendering token for token (the tiny model's template, Qwen2.5's ChatML with tools and
Llama 3.1's headers with the ipython role, the last two written here from their documentation); a
template that rewrites earlier turns is refused; the buffers become Experience whose mask is the
sampled tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from lightning_mem.rl.tools import tool_schemas
from lightning_mem.rl.trajectory import (
    ChatRenderer,
    PrefixError,
    Trajectory,
    check_prefix_preserving,
    experience_from_trajectories,
)
from lightning_mem.settings import SettingError
from recipes.tools import calculator
from tests.helpers import TINY_MODEL

TEMPLATES = Path(__file__).parent / "chat_templates"

#: Each format's tokens, added to the tiny tokenizer's vocabulary (its own template needs none):
#: (special tokens, other added tokens, the end-of-turn token, the observation role).
FORMATS = {
    "tiny": ([], [], "<|eos|>", "user"),
    "qwen2.5": (["<|im_start|>", "<|im_end|>"], ["<tool_call>", "</tool_call>"], "<|im_end|>", "tool"),
    "llama3.1": (["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                  "<|python_tag|>"], [], "<|eot_id|>", "tool"),
}
TEMPLATE_FILES = {"qwen2.5": "qwen2.5_tools.jinja", "llama3.1": "llama3.1_tools.jinja"}
#: What the model says in each format's tool-calling turn.
CALLS = {
    "tiny": "12 + 7 = 19",
    "qwen2.5": '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 + 7"}}\n</tool_call>',
    "llama3.1": '{"name": "calculator", "parameters": {"expression": "12 + 7"}}',
}


def tokenizer_for(fmt: str):
    tok = AutoTokenizer.from_pretrained(TINY_MODEL)
    special, plain, end, _ = FORMATS[fmt]
    if special:
        tok.add_special_tokens({"additional_special_tokens": special})
    if plain:
        tok.add_tokens(plain)
    if fmt == "llama3.1":
        tok.bos_token = "<|begin_of_text|>"
    tok.eos_token = end
    return tok


def renderer_for(fmt: str) -> ChatRenderer:
    tok = tokenizer_for(fmt)
    template = (TEMPLATES / TEMPLATE_FILES[fmt]).read_text() if fmt in TEMPLATE_FILES else None
    return ChatRenderer(tok, end_token_ids=[tok.eos_token_id], chat_template=template)


def conversation(fmt: str) -> list[tuple[list[dict], dict | None]]:
    """(observations before the turn, the assistant's message) pairs: a tool call, its result, an
    answer, the user's reply, a last answer."""
    role = FORMATS[fmt][3]
    return [
        ([{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 12 + 7?"}],
         {"role": "assistant", "content": CALLS[fmt]}),
        ([{"role": role, "content": "19"}], {"role": "assistant", "content": "19"}),
        ([{"role": "user", "content": "And 19 - 4?"}], {"role": "assistant", "content": "15"}),
    ]


def assembled(renderer: ChatRenderer, fmt: str, *, ended: bool = True) -> tuple[list[int], list[bool], list[dict]]:
    """The buffer the rollout would build, with each turn "sampled" as its content's ids (and the end
    token when ``ended``), and the conversation's messages."""
    tools = tool_schemas([calculator]) if fmt != "tiny" else None
    end = renderer.tokenizer.eos_token_id
    turns = conversation(fmt)
    messages = list(turns[0][0])
    ids, sampled = renderer.prompt_ids(messages, tools), []
    sampled = [False] * len(ids)
    for k, (_, answer) in enumerate(turns):
        if k:
            obs = renderer.observation_ids(messages, turns[k][0], tools=tools, ended=ended)
            ids, sampled = ids + obs, sampled + [False] * len(obs)
            messages += turns[k][0]
        turn = renderer.encode(answer["content"]) + ([end] if ended else [])
        ids, sampled = ids + turn, sampled + [True] * len(turn)
        messages.append(answer)
    return ids, sampled, messages


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_the_prefix_differences_rebuild_the_whole_rendering_token_for_token(fmt):
    renderer = renderer_for(fmt)
    tools = tool_schemas([calculator]) if fmt != "tiny" else None
    for ended in (True, False):  # a turn that ended with its end token, and one cut at max_new_tokens
        ids, sampled, messages = assembled(renderer, fmt, ended=ended)
        whole = renderer.encode(renderer.render(messages, tools=tools))
        # The template's close after the last answer (Qwen's "\n" after <|im_end|>; all of it for a
        # turn cut before its end token) is the template's text, not sampled.
        close = renderer.close.removeprefix(renderer.tokenizer.eos_token) if ended else renderer.close
        assert ids + renderer.encode(close) == whole
    # The sampled flags cover the answers' ids and nothing else.
    answers = [t for t, s in zip(ids, sampled) if s]
    assert renderer.tokenizer.decode(answers) == "".join(a["content"] for _, a in conversation(fmt))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_an_observation_ends_with_the_next_turns_generation_prompt(fmt):
    renderer = renderer_for(fmt)
    ids, _, messages = assembled(renderer, fmt)
    obs = renderer.observation_text(messages, [{"role": "user", "content": "Thanks."}])
    assert obs.endswith(renderer.render([{"role": "user", "content": "x"}], generation_prompt=True)
                        .removeprefix(renderer.render([{"role": "user", "content": "x"}])))


def test_qwen_observation_starts_with_the_newline_after_the_sampled_end_token():
    renderer = renderer_for("qwen2.5")
    messages = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}]
    text = renderer.observation_text(messages, [{"role": "tool", "content": "4"}])
    assert text == "\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    cut = renderer.observation_text(messages, [{"role": "tool", "content": "4"}], ended=False)
    assert cut == "<|im_end|>" + text  # a turn cut before its end token: the template closes it


def test_llama_tool_results_render_in_the_ipython_role():
    renderer = renderer_for("llama3.1")
    messages = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": CALLS["llama3.1"]}]
    text = renderer.observation_text(messages, [{"role": "tool", "content": "4"}])
    assert text == "<|start_header_id|>ipython<|end_header_id|>\n\n4<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"


DROPS_PAST_REASONING = (  # as Qwen3's template does: a reasoning block before the last user message is dropped
    "{%- set ns = namespace(last=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last = loop.index0 %}"
    "{%- endif %}{%- endfor %}{%- for m in messages %}{%- set c = m.content %}{%- if m.role == 'assistant' and"
    " loop.index0 < ns.last and '</think>' in c %}{%- set c = c.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|' + m.role + '|>\\n' + c + '<|eos|>' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}"
    "{%- endif %}"
)


def test_a_template_that_rewrites_earlier_turns_is_refused_in_one_line():
    tok = tokenizer_for("tiny")
    renderer = ChatRenderer(tok, end_token_ids=[tok.eos_token_id], chat_template=DROPS_PAST_REASONING)
    with pytest.raises(SettingError) as error:
        check_prefix_preserving(renderer, observation_role="user", key="multi_turn.chat_template")
    message = str(error.value)
    assert message.startswith("`multi_turn.chat_template`: the chat template is not prefix-preserving") and "\n" not in message
    with pytest.raises(PrefixError, match="changed the conversation before it"):
        renderer.observation_text([{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>a</think>b"}],
                                  [{"role": "user", "content": "again"}])
    for fmt in FORMATS:  # the three prefix-preserving formats pass
        check_prefix_preserving(renderer_for(fmt), observation_role=FORMATS[fmt][3])


def test_a_template_that_cannot_render_the_observation_role_is_refused():
    tok = tokenizer_for("tiny")
    strict = ("{%- for m in messages %}{%- if m.role not in ['user', 'assistant'] %}{{ raise_exception('no role ' + m.role) }}"
              "{%- endif %}{{ m.content }}{%- endfor %}")
    renderer = ChatRenderer(tok, end_token_ids=[tok.eos_token_id], chat_template=strict)
    with pytest.raises(SettingError, match="cannot render a multi-turn conversation with 'tool' observations"):
        check_prefix_preserving(renderer, observation_role="tool", key="name_or_path")


def test_experience_masks_align_with_the_buffers():
    renderer = renderer_for("tiny")
    ids, sampled, _ = assembled(renderer, "tiny")
    prompt = renderer.prompt_ids(conversation("tiny")[0][0])
    first = Trajectory(None, [], prompt, ids=ids[len(prompt):], sampled=sampled[len(prompt):], reward=1.0, turns=3)
    second = Trajectory(None, [], [5, 6], ids=[7, 1], sampled=[True, True], at_budget=True)
    exp = experience_from_trajectories([first, second], pad_token_id=0, mask_at_budget=True)
    assert exp.input_ids[0, : len(ids)].tolist() == ids and exp.attention_mask[0].sum() == len(ids)
    assert exp.prompt_lengths.tolist() == [len(prompt), 2]
    for i, t in enumerate((first, second)):  # response column j is sequence position prompt + j
        n = len(t.ids)
        assert exp.response_ids[i, :n].tolist() == t.ids == exp.input_ids[i, len(t.prompt_ids):len(t.prompt_ids) + n].tolist()
        assert exp.response_mask[i, :n].tolist() == [int(s) for s in t.sampled] and exp.response_mask[i, n:].sum() == 0
    assert exp.scores.tolist() == [1.0, 0.0] and exp.sample_keep.tolist() == [True, False]
    assert torch.equal(exp.response_lengths, torch.tensor([sum(first.sampled), 2]))
