"""The critic: a Hugging Face backbone with a scalar value head, or a head on the actor's backbone.

Two layouts, one head:

- **separate** (:class:`ValueModel`): its own backbone (``AutoModel``, no LM head), usually
  started from the policy or reward checkpoint, trained by its own optimizer. Costs a second
  model's parameters, gradients and optimizer state; the memory plan can park it on the host
  during the rollout.
- **shared**: a :class:`ValueHead` reads the actor's final hidden states; one forward gives
  logits and values, and one optimizer trains both. Cheapest, but the value loss pulls on the
  policy's features (weight it with ``vf_coef``).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor, nn

from lightning_mem.rl.rollout import Experience, gather_response


class ValueHead(nn.Module):
    """hidden [.., H] -> value [..]. Zero-initialised: the critic starts by predicting 0 for every
    state, so the first advantages are the (whitened) rewards rather than noise from a random head."""

    def __init__(self, hidden_size: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.summary = nn.Linear(hidden_size, 1, dtype=dtype)
        nn.init.zeros_(self.summary.weight)
        nn.init.zeros_(self.summary.bias)

    def forward(self, hidden: Tensor) -> Tensor:
        # The head runs in its own dtype (fp32 by default) whatever the backbone computes in.
        # NOTE: a fresh tensor, not the view `squeeze` gives: FSDP2 hooks the unit's output for
        # backward, and an in-place op on a returned view would silently drop that hook (FSDP2
        # warns on every forward). The copy is one value per token.
        return self.summary(hidden.to(self.summary.weight.dtype)).squeeze(-1).clone()


class ValueModel(nn.Module):
    """A separate critic: ``backbone`` (a ``transformers`` base model) + :class:`ValueHead`.

    The backbone is a ``PreTrainedModel`` attribute, so a sharding strategy finds and shards it
    per block like any other HF model; the head is a small module of its own.
    """

    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = ValueHead(backbone.config.hidden_size)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return self.value_head(hidden)


def load_value_model(
    name_or_path: str,
    *,
    dtype: str | torch.dtype | None = None,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    key: str = "model.critic.name_or_path",
) -> ValueModel:
    """A :class:`ValueModel` whose backbone loads from a causal-LM (or any) checkpoint.

    ``AutoModel`` reads the base model's weights out of a ``*ForCausalLM`` checkpoint and skips
    the LM head (vocabulary x hidden parameters the critic would never use). A folder with only a
    config initialises the backbone at random, as ``load_causal_lm`` does.
    """
    from transformers import AutoConfig, AutoModel

    from lightning_mem.models import check_model_source, has_weights
    from lightning_mem.dtypes import resolve_dtype

    source = check_model_source(name_or_path, key=key)
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    torch_dtype = resolve_dtype(dtype, key=key.rsplit(".", 1)[0] + ".dtype")
    if torch_dtype is not None:
        kwargs["dtype"] = torch_dtype
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if source == "local" and not has_weights(name_or_path):
        backbone = AutoModel.from_config(AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code), **kwargs)
    else:
        # A causal-LM checkpoint has an LM head the backbone does not: transformers would print a
        # load report calling it unexpected on every run. Quiet that, and warn only about what
        # matters, backbone weights the checkpoint lacks (those start at random).
        from transformers.utils import logging as hf_logging

        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            backbone, info = AutoModel.from_pretrained(name_or_path, output_loading_info=True, **kwargs)
        finally:
            hf_logging.set_verbosity(verbosity)
        missing = sorted(info.get("missing_keys") or [])
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            warnings.warn(f"`{key}` ({name_or_path}): the checkpoint has no weights for {shown}; they start at random")
    return ValueModel(backbone)


def critic_values(critic: ValueModel, batch: Experience) -> Tensor:
    """``[n, R]`` values of the states before each response token (same positions as the logits)."""
    values = critic(batch.input_ids, batch.attention_mask)
    return gather_response(values, batch.prompt_lengths, batch.response_ids.shape[1])
