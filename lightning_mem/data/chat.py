"""Chat rows to text: the row shapes accepted, and their rendering with the tokenizer's chat template.

Row shapes (mixed freely in one file):

- ``{"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}, ...]}``:
  the loss covers every assistant turn.
- ``{"prompt": ..., "completion": ...}`` (optionally ``"system"``), each a string or, as in TRL's
  conversational format, a list of messages: the loss covers the completion's assistant turns.
- for RL, prompt rows: ``{"prompt": ...}`` or ``{"messages": [...]}`` ending before the answer.

Other keys (e.g. ``answer`` for a reward rule) are carried along untouched.
"""

from __future__ import annotations

from typing import Any

from lightning_mem.data.rows import DataFormatError

def check_messages(messages: Any, where: str, field: str = "messages") -> None:
    """A non-empty list of ``{"role": str, "content": str}``, or an error naming the row."""
    if not isinstance(messages, list) or not messages:
        raise DataFormatError(f"{where}: `{field}` must be a non-empty list")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataFormatError(f"{where}: each message in `{field}` needs string `role` and `content`, got {m!r}")


def as_messages(value: Any, role: str, where: str, field: str) -> list[dict[str, str]]:
    # A string prompt is one user turn, a string completion one assistant turn; a list is TRL's
    # conversational form.
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    check_messages(value, where, field)
    return value


def with_system(row: dict[str, Any], messages: list[dict[str, str]]) -> list[dict[str, str]]:
    if row.get("system") and messages[0]["role"] != "system":
        return [{"role": "system", "content": row["system"]}]
    return []


def row_to_conversation(row: dict[str, Any]) -> tuple[list[dict[str, str]], int]:
    """``(messages, first)``: the conversation, and the index of its first message the loss may
    cover (assistant turns from there on are learned). Raises naming the row's file and line."""
    where = row.get("_where", "row")
    if "messages" in row:
        messages = row["messages"]
        check_messages(messages, where)
        if not any(m["role"] == "assistant" for m in messages):
            raise DataFormatError(f"{where}: `messages` has no assistant turn to learn from")
        return messages, 0
    if isinstance(row.get("prompt"), (str, list)) and isinstance(row.get("completion"), (str, list)):
        prompt = as_messages(row["prompt"], "user", where, "prompt")
        completion = as_messages(row["completion"], "assistant", where, "completion")
        if not any(m["role"] == "assistant" for m in completion):
            raise DataFormatError(f"{where}: `completion` has no assistant turn to learn from")
        prompt = with_system(row, prompt) + prompt
        return prompt + completion, len(prompt)
    keys = sorted(k for k in row if k != "_where")
    raise DataFormatError(
        f"{where}: row needs `messages` or `prompt` and `completion` (strings or lists of messages); it has keys {keys}"
    )


def row_to_messages(row: dict[str, Any]) -> list[dict[str, str]]:
    """Normalise a row to chat messages, or raise naming the row's file and line."""
    return row_to_conversation(row)[0]


def row_to_prompt_messages(row: dict[str, Any]) -> list[dict[str, str]]:
    """The conversation a policy continues: ``{"prompt": str}`` (optionally ``"system"``),
    ``{"prompt": [messages]}`` (TRL's conversational form), or ``{"messages": [...]}``, the last two
    ending in a turn that is not the assistant's."""
    where = row.get("_where", "row")
    if isinstance(row.get("prompt"), (str, list)):
        messages, field = as_messages(row["prompt"], "user", where, "prompt"), "prompt"
        messages = with_system(row, messages) + messages
    elif "messages" in row:
        messages, field = row["messages"], "messages"
        check_messages(messages, where)
    else:
        keys = sorted(k for k in row if k != "_where")
        raise DataFormatError(
            f"{where}: a prompt row needs `prompt` (a string or a list of messages) or `messages`; it has keys {keys}"
        )
    if messages[-1]["role"] == "assistant":
        raise DataFormatError(f"{where}: a prompt's `{field}` must end before the assistant's answer")
    return messages


def render_with_spans(
    messages: list[dict[str, str]], tokenizer: Any, first: int = 0
) -> tuple[str, list[tuple[int, int]]]:
    """Render a conversation to text and return the character spans of the assistant turns
    from ``messages[first]`` on (earlier turns, e.g. a conversational prompt's history, are context).

    With a chat template, the span of assistant turn i runs from the end of the rendering of
    ``messages[:i]`` with a generation prompt to the end of the rendering of ``messages[:i+1]``,
    which includes the template's end-of-turn token (so the model learns to stop).
    Without a template: ``role: content`` lines, and the eos token after each assistant turn.
    """
    if getattr(tokenizer, "chat_template", None):

        def render(msgs: list[dict[str, str]], gen: bool) -> str:
            return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

        text = render(messages, False)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant" or i < first:
                continue
            start, end = len(render(messages[:i], True)), len(render(messages[: i + 1], False))
            if not text.startswith(render(messages[: i + 1], False)):
                raise DataFormatError("the tokenizer's chat template does not render conversations prefix by prefix")
            spans.append((start, end))
        return text, spans
    text, spans = "", []
    eos = tokenizer.eos_token or ""
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            text += "assistant: "
            start = len(text)
            text += m["content"] + eos
            if i >= first:
                spans.append((start, len(text)))
            text += "\n"
        else:
            text += f"{m['role']}: {m['content']}\n"
    return text, spans


def render_prompt(messages: list[dict[str, str]], tokenizer: Any) -> str:
    """The text a model continues to answer ``messages`` (the generation prompt, for rollouts and eval)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


def encode_rendered(text: str, tokenizer: Any, **kwargs: Any) -> Any:
    """Tokenize text from :func:`render_with_spans` or :func:`render_prompt`: a chat template writes
    its own special tokens (bos included), plain ``role: content`` text gets the tokenizer's."""
    return tokenizer(text, add_special_tokens=not getattr(tokenizer, "chat_template", None), **kwargs)


def encode_prompt(messages: list[dict[str, str]], tokenizer: Any) -> list[int]:
    """The token ids a model continues to answer ``messages`` (rollouts, evaluation)."""
    return encode_rendered(render_prompt(messages, tokenizer), tokenizer)["input_ids"]
