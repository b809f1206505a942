"""Generation's memory peak without its whole decode loop: ``generate`` run for its prefill and first
decode step, then for its last step from a cache grown by the model's own forward
(:func:`last_decode_step`). The estimate's run (:mod:`.run`) and a generating rank's estimate
(:mod:`.generator`) both measure generation this way.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


def _new_tokens(kwargs: dict[str, Any], n: int | None = None) -> Any:
    """``generate``'s length cap in ``kwargs`` (a keyword or its ``generation_config``'s); with ``n``,
    a copy of ``kwargs`` whose cap is ``n``."""
    config = kwargs.get("generation_config")
    if n is None:
        return kwargs["max_new_tokens"] if "max_new_tokens" in kwargs else config.max_new_tokens
    if "max_new_tokens" in kwargs or config is None:
        return {**kwargs, "max_new_tokens": n}
    capped = copy.deepcopy(config)
    capped.max_new_tokens = n
    return {**kwargs, "generation_config": capped}


@contextlib.contextmanager
def last_decode_step(run: Any, model: nn.Module) -> Iterator[None]:
    """Generation's memory peak without its whole loop: ``model.generate`` runs twice, for real.

    Autoregressive decoding peaks either in its prefill (every prompt token at once) or in its last
    decode step (one token per sequence against the longest KV cache: a dynamic cache only grows,
    and each step's other tensors have the same shapes). So ``generate`` runs (1) on the prompts for
    two new tokens -- the prefill and the first decode step -- and then (2) for the last token,
    resuming from a cache that the model's own forward filled with the prompt and the first
    ``max_new_tokens - 2`` response tokens (each a ``fill_token``, which the sampler would have
    produced; making that cache is not measured: the real loop grows it one token at a time, with
    smaller transients than the step measured next). Its output is the full-length sequences, as
    the whole loop's would be. A static (preallocated, full-length) cache makes every decode step
    alike: the second step stands for the last, and the output is padded to full length with
    ``fill_token``.
    """
    generate = model.generate

    def last_step(*args: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        # The rollout hands its length cap in a GenerationConfig (rl/sampling.py), not as a keyword.
        max_new_tokens = _new_tokens(kwargs)
        if args or max_new_tokens <= 3:
            return generate(*args, input_ids=input_ids, attention_mask=attention_mask, **_new_tokens(kwargs, max_new_tokens))
        fill = run.mode.fill_token
        rows, prompt = input_ids.shape
        first = generate(input_ids=input_ids, attention_mask=attention_mask, **_new_tokens(kwargs, 2))
        if kwargs.get("past_key_values") is not None:  # static: the step's shapes do not grow
            pad = torch.full((rows, prompt + max_new_tokens - first.shape[1]), fill, dtype=first.dtype)
            return torch.cat([first, pad], dim=1)
        del first
        done = max_new_tokens - 1  # response tokens the loop has made before its last step
        ids = torch.cat([input_ids, torch.full((rows, done), fill, dtype=input_ids.dtype)], dim=1)
        mask = torch.cat([attention_mask, torch.ones((rows, done), dtype=attention_mask.dtype)], dim=1)
        with run.ledger.unmeasured(), torch.no_grad():
            cache = _grown_cache(model, ids[:, :-1], mask[:, :-1])
        return generate(input_ids=ids, attention_mask=mask, past_key_values=cache, **_new_tokens(kwargs, 1))

    model.generate = last_step
    try:
        yield
    finally:
        del model.generate  # the class's method again


def _grown_cache(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> Any:
    """The dynamic KV cache ``generate`` would hold after ``ids``, filled by the model's own forward."""
    from transformers import DynamicCache

    config = model.config
    cache = DynamicCache(config=config)
    was_training = model.training
    model.eval()
    try:
        model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True, logits_to_keep=1)
    finally:
        model.train(was_training)
    return cache
