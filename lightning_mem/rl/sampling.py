"""What a rollout samples: only the settings our :class:`GenerationConfig` names, never the checkpoint's.

Hugging Face ``generate`` fills every setting a call leaves unset from the model's own
``generation_config`` (loaded from the checkpoint's ``generation_config.json``). The Qwen2.5
Instruct checkpoints carry ``repetition_penalty: 1.1`` (1.05 in the 7B), ``top_k: 20``,
``top_p: 0.8`` and ``temperature: 0.7``; others carry ``no_repeat_ngram_size``, suppressed tokens,
``min_new_tokens``... A rollout that took any of them would sample another distribution than the
plain temperature softmax that PPO's log-prob pass scores, and the importance ratio would be wrong
in every update, silently. So:

- :func:`hf_generation_config` builds the call's settings from ours alone;
- :func:`checkpoint_settings_hidden` hides the model's own settings for the duration of the call
  (transformers 5.x merges them into any config it is handed: ``_prepare_generation_config``
  fills each ``None`` field from ``model.generation_config``), and says once, in one line, which
  of the checkpoint's settings are not used.

The vLLM engine (:mod:`lightning_mem.rl.vllm_engine`) starts with ``generation_config="vllm"``
(vLLM's own defaults, not the folder's) and gives every sampling parameter explicitly; it says
what it leaves out with :func:`say_ignored` too.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

#: Keys of a generation config that are not sampling settings: token ids (the engine passes its own
#: end and padding tokens; stopping is not sampling), bookkeeping, and what ``generate`` returns.
NOT_SAMPLING = frozenset({
    "eos_token_id", "pad_token_id", "bos_token_id", "decoder_start_token_id", "transformers_version",
    "_from_model_config", "use_cache", "cache_implementation", "cache_config", "output_scores",
    "output_logits", "output_attentions", "output_hidden_states", "return_dict_in_generate",
})

_said: set[str] = set()


def hf_generation_config(config: Any, *, eos_token_ids: list[int], pad_token_id: int) -> Any:
    """A fresh ``transformers.GenerationConfig`` holding only what ``config`` (our
    :class:`~lightning_mem.rl.rollout.GenerationConfig`) says: the length cap, greedy or sampling,
    and for sampling the temperature, with no top-k or top-p cut."""
    from transformers import GenerationConfig as HFGenerationConfig

    settings: dict[str, Any] = dict(
        max_new_tokens=config.max_new_tokens, do_sample=config.do_sample,
        eos_token_id=list(eos_token_ids), pad_token_id=pad_token_id, use_cache=True,
    )
    if config.do_sample:
        # All three set, none left to the merge (transformers' own fallback for top_k is 50). Greedy
        # sets none of them: generate warns about sampling settings it would not use.
        settings.update(temperature=config.temperature, top_k=config.top_k, top_p=config.top_p)
    return HFGenerationConfig(**settings)


def _plain_defaults() -> dict[str, Any]:
    from transformers import GenerationConfig as HFGenerationConfig

    # transformers >= 5.x keeps the fallbacks apart (fields default to None); older ones set them.
    getter = getattr(HFGenerationConfig, "_get_default_generation_params", None)
    return dict(getter()) if getter is not None else HFGenerationConfig().to_dict()


def ignored_settings(checkpoint_config: Any, used: Any) -> dict[str, Any]:
    """The checkpoint's settings that differ from what the rollout uses (its own value, else the
    plain default): what hiding them changes."""
    if checkpoint_config is None:
        return {}
    defaults, ours = _plain_defaults(), used.to_dict()
    ignored = {}
    for key, value in checkpoint_config.to_diff_dict().items():
        if key in NOT_SAMPLING or value is None:
            continue
        effective = ours.get(key) if ours.get(key) is not None else defaults.get(key)
        if value != effective:
            ignored[key] = value
    return ignored


def _generating_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    # Every Hugging Face model in the tree (a peft or FSDP wrapper generates through the inner one).
    return [m for m in model.modules() if isinstance(getattr(m, "generation_config", None), _hf_config_type())]


def _hf_config_type() -> type:
    from transformers import GenerationConfig as HFGenerationConfig

    return HFGenerationConfig


def say_ignored(checkpoint_configs: list[Any], used: Any) -> None:
    """Say once per process, in one line, which of the checkpoints' sampling settings the rollout
    leaves out (read from the first sampled rollout: a greedy one ignores every sampling setting)."""
    if not used.do_sample or "ignored" in _said:
        return
    ignored: dict[str, Any] = {}
    for config in checkpoint_configs:
        ignored.update(ignored_settings(config, used))
    _said.add("ignored")
    if ignored:
        listed = ", ".join(f"{key}={value!r}" for key, value in sorted(ignored.items()))
        warnings.warn(f"the checkpoint's sampling settings are not used (the rollout samples only what"
                      f" `generation` says, the distribution PPO scores): {listed}", UserWarning, stacklevel=3)


@contextlib.contextmanager
def checkpoint_settings_hidden(model: torch.nn.Module, used: Any) -> Iterator[None]:
    """Within the block, every Hugging Face model in ``model`` carries a plain generation config,
    so ``generate`` merges nothing of the checkpoint's into ``used``; put back afterwards (an
    export still writes the checkpoint's own generation_config.json)."""
    HFGenerationConfig = _hf_config_type()
    modules = _generating_modules(model)
    kept = [m.generation_config for m in modules]
    say_ignored(kept, used)
    try:
        for m in modules:
            m.generation_config = HFGenerationConfig()
        yield
    finally:
        for m, config in zip(modules, kept):
            m.generation_config = config
