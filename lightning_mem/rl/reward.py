"""What a response is worth: a rule (a :class:`RewardFunction`) or a learned reward model.

A rule sees the decoded prompt and response and the prompt's data row (``answer``, test cases,
...). A reward model (:class:`RewardModel`) is a Hugging Face sequence-classification model with
one output, reading the conversation rendered with *its own* tokenizer, so the policy and the
reward model need not share a vocabulary.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_mem.data.rows import DataFormatError
from lightning_mem.models import check_model_source
from lightning_mem.padding import pad_sequences
from lightning_mem.rl.microbatch import micro_batches
from lightning_mem.settings import SettingError


class RewardFunction:
    """Base class of rule-based rewards, selected in YAML by ``class_path``.

    Subclasses implement :meth:`score`; the recipe calls it once per rollout batch, on every
    rank, with that rank's samples. A rule that reads keys of the data rows names them in
    :meth:`required_keys`, so that a missing key fails when the data load, before any model does.
    """

    def required_keys(self) -> Sequence[str]:
        """The row keys :meth:`score` reads (e.g. ``["answer"]``); checked on every row up front."""
        return ()

    @property
    def described(self) -> str:
        """How errors about rows name this rule."""
        return f"the reward {type(self).__name__}"

    def check_rows(self, rows: Sequence[dict[str, Any]], source: str = "the prompt data") -> None:
        """Raise naming the first row (file and line) that lacks a :meth:`required_keys` key."""
        keys = list(self.required_keys())
        for row in rows:
            missing = [k for k in keys if k not in row]
            if missing:
                where = row.get("_where", f"a row of {source}")
                raise DataFormatError(
                    f"{where}: no `{missing[0]}`, which {self.described} needs"
                    f" (it reads {keys}; {sum(any(k not in r for k in keys) for r in rows)} of {len(rows)} rows lack one)"
                )

    def check_key_sets(self, key_sets: Sequence[Sequence[Any]], source: str = "the prompt data") -> None:
        """:meth:`check_rows` on a prompt set's distinct key sets (``[keys, rows, first row's where]``,
        :func:`lightning_mem.data.prompts.key_sets`): the same error, without reading every row."""
        keys = list(self.required_keys())
        lacking = [(where, [k for k in keys if k not in have], n) for have, n, where in key_sets if any(k not in have for k in keys)]
        if lacking:
            where, missing, _ = lacking[0]  # the sets come in the order of their first rows
            where = where or f"a row of {source}"
            total = sum(n for _, n, _ in key_sets)
            raise DataFormatError(
                f"{where}: no `{missing[0]}`, which {self.described} needs"
                f" (it reads {keys}; {sum(n for _, _, n in lacking)} of {total} rows lack one)"
            )

    def score(self, prompts: list[str], responses: list[str], rows: list[dict[str, Any]]) -> Sequence[float]:
        """One score per response. ``responses`` are decoded without special tokens; ``rows`` are
        the prompts' data rows (every key of the JSONL line)."""
        raise NotImplementedError

    def __call__(self, prompts: list[str], responses: list[str], rows: list[dict[str, Any]]) -> Tensor:
        scores = torch.as_tensor(list(self.score(prompts, responses, rows)), dtype=torch.float32)
        if scores.shape != (len(responses),):
            raise ValueError(f"{type(self).__name__}.score returned {tuple(scores.shape)} scores for {len(responses)} responses")
        return scores


class RewardModel(nn.Module):
    """A sequence classifier with one logit as the reward, with the tokenizer it was trained with.

    ``model`` is a ``PreTrainedModel`` attribute, so a sharding strategy treats it like the other
    frozen models.
    """

    def __init__(self, model: nn.Module, tokenizer: Any, max_length: int = 2048) -> None:
        super().__init__()
        self.model = model.requires_grad_(False).eval()
        self.tokenizer = tokenizer
        self.max_length = max_length
        # The classifier reads the last non-pad token of each row; it must know the pad id.
        if getattr(self.model.config, "pad_token_id", None) is None:
            self.model.config.pad_token_id = tokenizer.pad_token_id

    def _encode(self, prompt_messages: list[dict[str, str]], response: str) -> list[int]:
        from lightning_mem.data.chat import encode_rendered, render_with_spans

        text, _ = render_with_spans([*prompt_messages, {"role": "assistant", "content": response}], self.tokenizer)
        return encode_rendered(text, self.tokenizer)["input_ids"][-self.max_length :]

    @torch.no_grad()
    def forward(
        self,
        prompt_messages: list[list[dict[str, str]]],
        responses: list[str],
        *,
        max_tokens: int | None = None,
        agree_on_count: Callable[[int], int] | None = None,
    ) -> Tensor:
        """Scores of each (conversation, response), micro-batched by ``max_tokens`` padded tokens
        (``agree_on_count``: see :func:`lightning_mem.rl.microbatch.micro_batches`)."""
        encoded = [self._encode(m, r) for m, r in zip(prompt_messages, responses)]
        device = next(self.model.parameters()).device
        scores = torch.zeros(len(encoded), dtype=torch.float32, device=device)
        pad = self.tokenizer.pad_token_id
        for idx in micro_batches([len(e) for e in encoded], max_tokens, agree_on_count=agree_on_count):
            ids, mask = pad_sequences([encoded[i] for i in idx], pad, device=device)
            logits = self.model(input_ids=ids, attention_mask=mask).logits
            scores[torch.tensor(idx, device=device)] = logits[:, 0].float()
        return scores


def reward_model_outputs(name_or_path: str) -> tuple[str, int] | None:
    """``(architecture, outputs)`` of a local sequence-classifier folder, read from its config.json
    (no weights, no model); None for a hub id, a causal LM (its head is new: one output) or a
    config that states no outputs."""
    config_file = Path(name_or_path).expanduser() / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    architectures = config.get("architectures") or []
    if architectures and all(name.endswith("ForCausalLM") for name in architectures):
        return None
    id2label = config.get("id2label")
    outputs = len(id2label) if isinstance(id2label, dict) else config.get("num_labels")
    if outputs is None:
        return None
    return (architectures[0] if architectures else config.get("model_type", "model")), int(outputs)


def check_reward_model_source(name_or_path: str, *, key: str = "name_or_path") -> None:
    """A reward model's folder (or hub id) exists and, where its config.json says, has one output:
    refused in one line naming ``key``, before any model loads. A classifier with more outputs
    (a two-class preference head, say) has no single score to reward with."""
    check_model_source(name_or_path, key=key)
    found = reward_model_outputs(name_or_path)
    if found is not None and found[1] != 1:
        architecture, outputs = found
        raise SettingError(
            key, f": {name_or_path} is a {architecture} with {outputs} outputs (its config.json); a reward model"
            " scores with one (`num_labels: 1`)")


def aggregate_scores(member_scores: Tensor, aggregate: str = "mean", uncertainty_coef: float | None = None) -> Tensor:
    """One score per response from ``[members, N]`` scores: their ``mean``, their ``min`` (the
    worst case), or ``mean_minus_std`` (mean minus ``uncertainty_coef``, default 1, times the
    members' population std), as in Coste et al. 2023."""
    if aggregate == "mean":
        return member_scores.mean(0)
    if aggregate == "min":
        return member_scores.min(0).values
    if aggregate == "mean_minus_std":
        coef = 1.0 if uncertainty_coef is None else uncertainty_coef
        return member_scores.mean(0) - coef * member_scores.std(0, correction=0)
    raise ValueError(f"unknown reward aggregate {aggregate!r}")


class RewardModelEnsemble(nn.Module):
    """Several :class:`RewardModel` (each with its own tokenizer) scored as one: the members'
    scores aggregated by :func:`aggregate_scores`. One module, so a memory plan parks and returns
    the whole ensemble as it does a single reward model.

    After each call ``last_std`` holds the members' population std of each response (``[N]``
    fp32), the spread the recipe logs as ``reward_model_std``.
    """

    def __init__(self, members: Sequence[RewardModel], aggregate: str = "mean",
                 uncertainty_coef: float | None = None) -> None:
        super().__init__()
        self.members = nn.ModuleList(members)
        self.aggregate, self.uncertainty_coef = aggregate, uncertainty_coef
        self.last_std: Tensor | None = None

    @torch.no_grad()
    def forward(
        self,
        prompt_messages: list[list[dict[str, str]]],
        responses: list[str],
        *,
        max_tokens: int | None = None,
        agree_on_count: Callable[[int], int] | None = None,
    ) -> Tensor:
        """The aggregate score of each (conversation, response), ``[N]`` fp32; each member scores
        in turn with :meth:`RewardModel.forward`'s micro-batches."""
        scores = torch.stack([member(prompt_messages, responses, max_tokens=max_tokens, agree_on_count=agree_on_count)
                              for member in self.members])
        self.last_std = scores.std(0, correction=0)
        return aggregate_scores(scores, self.aggregate, self.uncertainty_coef)


def reward_spread(reward_model: nn.Module | None) -> Tensor | None:
    """The sum over the last scored responses of an ensemble's member std (float64, a step
    metric's numerator: ``reward_model_std`` is its mean over samples); None unless the reward
    model is an ensemble of several members."""
    if not isinstance(reward_model, RewardModelEnsemble) or len(reward_model.members) < 2 or reward_model.last_std is None:
        return None
    return reward_model.last_std.to(torch.float64).sum()


def load_reward_model(
    name_or_path: str,
    *,
    dtype: str | torch.dtype | None = None,
    trust_remote_code: bool = False,
    max_length: int = 2048,
    key: str = "name_or_path",
) -> RewardModel:
    """Load ``AutoModelForSequenceClassification`` (one label) and its tokenizer as a :class:`RewardModel`.

    ``key`` names ``name_or_path`` in errors (the PPO recipe passes ``model.reward_model.name_or_path``).

    A folder with only a config (the tiny test model) initialises the head and backbone at random.
    """
    from transformers import AutoModelForSequenceClassification

    from lightning_mem.models import load_pretrained, load_tokenizer

    check_reward_model_source(name_or_path, key=key)
    tokenizer = load_tokenizer(name_or_path, trust_remote_code=trust_remote_code, key=key)
    model = load_pretrained(AutoModelForSequenceClassification, name_or_path, dtype=dtype,
                            trust_remote_code=trust_remote_code, key=key, config_kwargs={"num_labels": 1})
    return RewardModel(model, tokenizer, max_length=max_length)


def member_keys(name_or_path: str | Sequence[str], key: str = "name_or_path") -> list[tuple[str, str]]:
    """``(path, key naming it)`` of each reward model: ``key`` for a single path, ``key[i]`` for a
    list's members."""
    if isinstance(name_or_path, str):
        return [(name_or_path, key)]
    return [(path, f"{key}[{i}]") for i, path in enumerate(name_or_path)]


def check_reward_model_sources(name_or_path: str | Sequence[str], *, key: str = "name_or_path") -> None:
    """:func:`check_reward_model_source` on each member, named ``key[i]`` in a list."""
    for path, member_key in member_keys(name_or_path, key):
        check_reward_model_source(path, key=member_key)


def load_reward_models(
    name_or_path: str | Sequence[str],
    *,
    aggregate: str = "mean",
    uncertainty_coef: float | None = None,
    key: str = "name_or_path",
    **kwargs: Any,
) -> RewardModel | RewardModelEnsemble:
    """A plain :class:`RewardModel` for one path (the module tree of a single reward model, so its
    checkpoints load as before); a :class:`RewardModelEnsemble` for a list (even of one).
    ``kwargs`` go to :func:`load_reward_model` for every member."""
    if isinstance(name_or_path, str):
        return load_reward_model(name_or_path, key=key, **kwargs)
    members = [load_reward_model(path, key=member_key, **kwargs) for path, member_key in member_keys(name_or_path, key)]
    return RewardModelEnsemble(members, aggregate=aggregate, uncertainty_coef=uncertainty_coef)
