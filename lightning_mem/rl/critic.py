"""The critic: a Hugging Face backbone with a scalar value head, or a head on the actor's backbone.

Two layouts, one head:

- **separate** (:class:`ValueModel`): its own backbone (``AutoModel``, no LM head), usually
  started from the policy or reward checkpoint, trained by its own optimizer. Costs a second
  model's parameters, gradients and optimizer state; the memory plan can park it on the host
  during the rollout.
- **shared**: a :class:`ValueHead` reads the actor's final hidden states; one forward gives
  logits and values, and one optimizer trains both. Cheapest, but the value loss pulls on the
  policy's features (weight it with ``vf_coef``).

A recipe holds one value-function object (:func:`value_function`), :class:`SharedHead` or
:class:`SeparateCritic`, and asks it for values; the layout's differences (which module it
builds, whether it reads the actor's hidden states, which optimizer steps it) live here.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor, nn

from lightning_mem.context_parallel import layout_of, sequence_forward
from lightning_mem.data.packing import pack_right_padded
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
        # The head runs in its own dtype (fp32 under 32-true and *-mixed) whatever the backbone
        # computes in, autocast included: values are regressed onto returns, and a bf16 value
        # keeps 8 bits of mantissa. One [tokens, hidden] x [hidden, 1] product: nothing to save.
        # The values come out in float32 under any precision, as the rollout's buffers hold them.
        # NOTE: a fresh tensor, not the view `squeeze` gives: FSDP2 hooks the unit's output for
        # backward, and an in-place op on a returned view would silently drop that hook (FSDP2
        # warns on every forward). The copy is one value per token.
        with torch.autocast(hidden.device.type, enabled=False):
            return self.summary(hidden.to(self.summary.weight.dtype)).squeeze(-1).float().clone()


class ValueModel(nn.Module):
    """A separate critic: ``backbone`` (a ``transformers`` base model) + :class:`ValueHead`.

    The backbone is a ``PreTrainedModel`` attribute, so a sharding strategy finds and shards it
    per block like any other HF model; the head is a small module of its own.
    """

    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        self.backbone = backbone
        # Trained with the backbone, so in its dtype (not torch's default: under bf16-true that is
        # bf16 only inside Lightning's hooks).
        dtype = next((p.dtype for p in backbone.parameters() if p.is_floating_point()), None)
        self.value_head = ValueHead(backbone.config.hidden_size, dtype=dtype)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None, **model_kwargs: Any) -> Tensor:
        """Values ``[B, T]``; ``model_kwargs`` (position ids, a context-parallel layout) go to the backbone."""
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **model_kwargs
        ).last_hidden_state
        return self.value_head(hidden)


def load_value_model(
    name_or_path: str,
    *,
    dtype: str | torch.dtype | None = None,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    key: str = "name_or_path",
) -> ValueModel:
    """A :class:`ValueModel` whose backbone loads from a causal-LM (or any) checkpoint.

    ``key`` names ``name_or_path`` in errors and warnings (the PPO recipe passes
    ``model.critic.name_or_path``).

    ``AutoModel`` reads the base model's weights out of a ``*ForCausalLM`` checkpoint and skips
    the LM head (vocabulary x hidden parameters the critic would never use). A folder with only a
    config initialises the backbone at random, as ``load_causal_lm`` does.
    """
    from transformers import AutoModel

    from lightning_mem.models import load_pretrained

    backbone = load_pretrained(AutoModel, name_or_path, dtype=dtype, attn_implementation=attn_implementation,
                               trust_remote_code=trust_remote_code, key=key, report_missing=True)
    return ValueModel(backbone)


def critic_values(critic: ValueModel, batch: Experience, *, packed: bool = False) -> Tensor:
    """``[n, R]`` values of the states before each response token (same positions as the logits).
    A critic a strategy split along the sequence runs its slice and the values are gathered
    (:func:`lightning_mem.context_parallel.sequence_forward`).

    ``packed``: the sequences run as one padding-free row (:mod:`lightning_mem.data.packing`);
    positions past a response's end hold 0 (padded, they hold whatever the padding scored; the
    response mask hides both)."""
    layout = layout_of(critic)
    if not packed:
        values = sequence_forward(critic, batch.input_ids, batch.attention_mask, layout)
        return gather_response(values, batch.prompt_lengths, batch.response_ids.shape[1])
    if layout is not None:  # the slices' positions come from the attention mask; restarting ones would be lost
        raise ValueError("packed rows are not split by tensor or context parallelism yet: turn one of them off")
    row = pack_right_padded(batch.input_ids, batch.attention_mask)
    values = critic(input_ids=row.input_ids, attention_mask=None, position_ids=row.position_ids)[0]
    rows, cols = batch.response_mask.nonzero(as_tuple=True)
    picked = values[row.starts[rows] + batch.prompt_lengths[rows] - 1 + cols]
    return values.new_zeros(batch.response_ids.shape).index_put((rows, cols), picked)


class SharedHead:
    """The ``shared`` layout: a :class:`ValueHead` on the actor's final hidden states, stepped by the
    actor's optimizer. Registered by the recipe under :attr:`attribute`."""

    attribute = "value_head"
    reads_actor_hidden = True  # the values come from the actor's forward
    has_own_optimizer = False

    def __init__(self) -> None:
        self.module: ValueHead | None = None

    def build(self, actor: nn.Module, load_critic: Callable[[], ValueModel], *,
              dtype: torch.dtype | None = None) -> ValueHead:
        """A fresh head in ``dtype`` (what trains under the trainer's precision; None: torch's default)."""
        self.module = ValueHead(actor.config.hidden_size, dtype=dtype)
        return self.module

    def actor_param_groups(self) -> list[dict[str, Any]]:
        """Parameter groups the actor's optimizer takes on (no weight decay on a head)."""
        return [{"params": list(self.module.parameters()), "weight_decay": 0.0}]

    def values(self, batch: Experience, actor_hidden: Tensor | None, *, packed: bool = False) -> Tensor:
        """``[n, R]`` from the actor's hidden states at the response positions (packed or not, the
        actor's forward already unpacked them)."""
        if actor_hidden is None:
            raise ValueError("the shared value head reads the actor's hidden states: run the actor with_hidden=True")
        return self.module(actor_hidden)


class SeparateCritic:
    """The ``separate`` layout: a :class:`ValueModel` with its own backbone and its own optimizer."""

    attribute = "critic"
    reads_actor_hidden = False
    has_own_optimizer = True

    def __init__(self) -> None:
        self.module: ValueModel | None = None

    def build(self, actor: nn.Module, load_critic: Callable[[], ValueModel], *,
              dtype: torch.dtype | None = None) -> ValueModel:
        """The critic ``load_critic`` loads, in the dtype it loads in (``dtype`` is the shared head's)."""
        self.module = load_critic()
        return self.module

    def actor_param_groups(self) -> list[dict[str, Any]]:
        return []

    def values(self, batch: Experience, actor_hidden: Tensor | None = None, *, packed: bool = False) -> Tensor:
        return critic_values(self.module, batch, packed=packed)


def value_function(layout: str) -> SharedHead | SeparateCritic:
    """The value function of a critic ``layout`` (``shared`` or ``separate``), not yet built."""
    kinds = {"shared": SharedHead, "separate": SeparateCritic}
    if layout not in kinds:
        raise ValueError(f"critic layout must be one of {sorted(kinds)}, got {layout!r}")
    return kinds[layout]()
