"""Token in, token out: a trajectory is one append-only buffer of token ids, and what it becomes.

A multi-turn conversation is never re-tokenized. The buffer holds, in order: the prompt (the
chat template's rendering of the environment's first messages, with the generation prompt), then
each assistant turn's ids *as sampled*, then each observation's ids, and so on. Re-tokenizing the
decoded conversation would not give the sampled ids back (a tokenizer has many spellings of one
text), and PPO would then score other tokens than the ones the policy chose.

An observation's ids are the difference of two renderings by the chat template: the conversation
with the observation (and the generation prompt of the next assistant turn) minus the conversation
so far, checked to be a true suffix. The template's text after an assistant's content (Qwen2.5's
``<|im_end|>\\n``, Llama 3.1's ``<|eot_id|>``) less the end token the model sampled (``\\n``) opens
the observation's ids: context the template writes and the model did not. A template that rewrites
earlier turns when a later one comes (Qwen3's drops past ``<think>`` blocks) is refused at the
start (:func:`check_prefix_preserving`), and a rendering that is not a suffix during the run ends
that trajectory (counted as ``template_mismatch``).

:func:`experience_from_trajectories` lays the buffers out as PPO's :class:`Experience`: the prompt,
then everything after it as the "response", whose mask (``response_mask``) is 1 on the sampled
tokens and 0 on the observation tokens: context, not actions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_mem.data.chat import encode_rendered
from lightning_mem.rl.environments import Environment, Message
from lightning_mem.rl.rollout import Experience
from lightning_mem.settings import SettingError

#: Stands for an assistant's content while the template's text around it is found.
_CONTENT = "\u2063content\u2063"
#: The sample conversation the start's check renders; the first answer carries a reasoning block,
#: which a template that drops past reasoning (Qwen3's) rewrites when the next turn comes.
_SAMPLE_ANSWERS = ("<think>\nadd them\n</think>\n\nfour", "4")


class PrefixError(ValueError):
    """A rendering that does not extend the conversation so far as a suffix."""


class ChatRenderer:
    """The chat template's renderings of a growing conversation, as token ids.

    ``chat_template``: a Jinja template used instead of the tokenizer's own (YAML
    ``model.multi_turn.chat_template``). ``end_token_ids``: the tokens that end an assistant turn
    (the rollout's end-of-sequence ids).
    """

    def __init__(self, tokenizer: Any, *, end_token_ids: list[int], chat_template: str | None = None) -> None:
        self.tokenizer, self.chat_template = tokenizer, chat_template
        self.end_texts = [tokenizer.decode([i]) for i in end_token_ids]
        self.close = self.assistant_close()

    def render(self, messages: list[Message], *, tools: list[dict[str, Any]] | None = None,
               generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools or None, chat_template=self.chat_template,
                                                  tokenize=False, add_generation_prompt=generation_prompt)

    def encode(self, text: str) -> list[int]:
        return list(encode_rendered(text, self.tokenizer)["input_ids"])

    def prompt_ids(self, messages: list[Message], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The ids the policy continues first: ``messages`` with the generation prompt."""
        return self.encode(self.render(messages, tools=tools, generation_prompt=True))

    def assistant_close(self) -> str:
        """The template's text after an assistant message's content (its end token, a newline...)."""
        messages = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": _CONTENT}]
        text = self.render(messages)
        if _CONTENT not in text:
            raise PrefixError("the template does not write an assistant message's content as given")
        return text[text.index(_CONTENT) + len(_CONTENT):]

    def observation_text(self, conversation: list[Message], observations: list[Message], *,
                         tools: list[dict[str, Any]] | None = None, ended: bool = True) -> str:
        """The text after the last assistant turn's sampled tokens up to the next turn's generation
        prompt: the rest of the template's close (less the end token the model sampled, when
        ``ended``), the observations, the generation prompt. Raises :class:`PrefixError` where the
        template rewrote what the conversation so far rendered as."""
        before = self.render(conversation, tools=tools)
        after = self.render(conversation + observations, tools=tools, generation_prompt=True)
        if not after.startswith(before):
            at = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
            raise PrefixError(f"rendering an observation changed the conversation before it (first at character {at}:"
                              f" {before[at:at + 30]!r} became {after[at:at + 30]!r})")
        if not before.endswith(self.close):
            raise PrefixError(f"the last assistant message does not end with the template's close {self.close!r}")
        close = self.close
        if ended:  # the model's own end token stands for the template's
            close = next((close[len(t):] for t in self.end_texts if t and close.startswith(t)), close)
        return close + after[len(before):]

    def observation_ids(self, conversation: list[Message], observations: list[Message], *,
                        tools: list[dict[str, Any]] | None = None, ended: bool = True) -> list[int]:
        return self.encode(self.observation_text(conversation, observations, tools=tools, ended=ended))


def check_prefix_preserving(renderer_or_error: Any, *, observation_role: str = "user",
                            tools: list[dict[str, Any]] | None = None, key: str = "chat_template") -> None:
    """Refuse a chat template that does not render each observation as a suffix of the conversation
    so far, checked on a sample conversation of two answers and an observation after each (of
    ``observation_role``): a :class:`SettingError` naming ``key``, in one line."""
    try:
        renderer = renderer_or_error() if callable(renderer_or_error) else renderer_or_error
        conversation: list[Message] = [{"role": "user", "content": "What is 2 + 2?"}]
        for answer in _SAMPLE_ANSWERS:
            conversation.append({"role": "assistant", "content": answer})
            observation = [{"role": observation_role, "content": "That is not it. Try again."}]
            renderer.observation_text(conversation, observation, tools=tools)
            conversation += observation
    except PrefixError as error:
        raise SettingError(key, f": the chat template is not prefix-preserving, which multi-turn rollouts need ({error})"
                                "; give one that is in `model.multi_turn.chat_template`") from None
    except Exception as error:  # a template that cannot render the sample (a role it refuses, a missing variable)
        raise SettingError(key, f": the chat template cannot render a multi-turn conversation with"
                                f" {observation_role!r} observations ({type(error).__name__}: {error})") from None


@dataclass
class Trajectory:
    """One episode: its environment, the conversation as messages (for the template), and the
    append-only buffer of ids after the prompt with a flag per id (True: sampled by the policy)."""

    env: Environment | None
    messages: list[Message]
    prompt_ids: list[int]
    tools: list[dict[str, Any]] | None = None
    ids: list[int] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    done: bool = False
    at_budget: bool = False  # ended by max_turns or max_total_tokens, not by the environment
    failed: bool = False  # the environment raised or hung: the trajectory does not train
    pending: list[int] = field(default_factory=list)  # ids the sampler has not seen yet
    last_answer: str = ""
    counts: dict[str, float] = field(default_factory=dict)
    # The engine's log-prob of each id of the buffer (0 on observations), where the engine reports
    # them (vLLM); None once a turn came without them.
    engine_logprobs: list[float] | None = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.ids)

    def add_sampled(self, ids: list[int], logprobs: list[float] | None = None) -> None:
        self.ids += ids
        self.sampled += [True] * len(ids)
        self.engine_logprobs = None if logprobs is None or self.engine_logprobs is None else (
            self.engine_logprobs + list(logprobs[: len(ids)]))

    def add_observation(self, ids: list[int]) -> None:
        self.ids += ids
        self.sampled += [False] * len(ids)
        self.pending = list(ids)
        if self.engine_logprobs is not None:
            self.engine_logprobs += [0.0] * len(ids)

    def add_count(self, name: str, n: float = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n


def experience_from_trajectories(trajectories: list[Trajectory], *, pad_token_id: int, mask_at_budget: bool,
                                 device: torch.device | str | None = None) -> Experience:
    """The trajectories as :class:`Experience`: right-padded prompt + buffer, the buffer as the
    response with ``response_mask`` 1 on sampled ids only, ``scores`` the summed rewards, and
    ``sample_keep`` False for those that must not train (failed, or at their budget under
    ``mask_at_budget``)."""
    from lightning_mem.padding import pad_sequences

    input_ids, attention_mask = pad_sequences([t.prompt_ids + t.ids for t in trajectories], pad_token_id,
                                              device=device)
    width = max([len(t.ids) for t in trajectories] + [1])
    response_ids, _ = pad_sequences([t.ids for t in trajectories], pad_token_id, length=width, device=device)
    response_mask, _ = pad_sequences([[int(s) for s in t.sampled] for t in trajectories], 0, length=width, device=device)
    keep = [not (t.failed or (mask_at_budget and t.at_budget)) for t in trajectories]
    exp = Experience(
        input_ids=input_ids, attention_mask=attention_mask,
        prompt_lengths=torch.tensor([len(t.prompt_ids) for t in trajectories], device=device),
        response_ids=response_ids, response_mask=response_mask,
        group_ids=torch.arange(len(trajectories), device=device),
        responses=[t.last_answer for t in trajectories],
        scores=torch.tensor([t.reward for t in trajectories], dtype=torch.float32, device=device),
        sample_keep=torch.tensor(keep, dtype=torch.bool, device=device),
    )
    if all(t.engine_logprobs is not None for t in trajectories) and any(t.ids for t in trajectories):
        logprobs, _ = pad_sequences([t.engine_logprobs for t in trajectories], 0, length=width, dtype=torch.float32,
                                    device=device)
        exp.engine_logprobs = logprobs * response_mask  # as a single-turn engine's: 0 off the sampled ids
    return exp
