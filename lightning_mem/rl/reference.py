"""The reference policy: what the KL penalty measures the actor against.

Two kinds, one interface (``logprobs(actor, score)``):

- :class:`FrozenCopy`: a second copy of the starting policy, frozen. Costs a model's weights;
  the memory plan can park it on the host outside the score phase.
- :class:`AdaptersOff`: a LoRA actor with its adapters switched off *is* the starting policy, so
  no second copy is loaded.

``score`` is the recipe's forward (model -> response-token logprobs), so a reference computes
its logprobs exactly as the actor's are computed (same chunking, same temperature).
"""

from __future__ import annotations

from typing import Callable, Literal, get_args

from torch import Tensor, nn

from lightning_mem.settings import SettingError

ReferenceMode = Literal["auto", "copy", "adapters_off"]


def disable_dropout(model: nn.Module) -> nn.Module:
    """PPO compares one forward's logprobs with another's: dropout would make the ratio noise."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    return model


class FrozenCopy:
    """A frozen copy of the starting policy (``module``, built by :meth:`build`)."""

    mode = "copy"

    def __init__(self) -> None:
        self.module: nn.Module | None = None

    def build(self, load_policy: Callable[[], nn.Module]) -> nn.Module:
        """Load the copy, without dropout, frozen and in eval mode; the caller registers it."""
        self.module = disable_dropout(load_policy()).requires_grad_(False).eval()
        return self.module

    def logprobs(self, actor: nn.Module, score: Callable[[nn.Module], Tensor]) -> Tensor:
        return score(self.module)


class AdaptersOff:
    """The actor's own base: a peft model with its adapters disabled for the forward."""

    mode = "adapters_off"
    module = None  # nothing of its own to load, place or checkpoint

    def build(self, load_policy: Callable[[], nn.Module]) -> None:
        return None

    def logprobs(self, actor: nn.Module, score: Callable[[nn.Module], Tensor]) -> Tensor:
        with actor.disable_adapter():  # the base model = the policy before training
            return score(actor)


def reference_policy(mode: ReferenceMode, *, kl_enabled: bool, lora: bool) -> FrozenCopy | AdaptersOff | None:
    """The reference a run needs: none without a KL penalty; ``auto`` switches a LoRA actor's
    adapters off and copies any other actor. A mode the actor cannot have is an error either way.

    Raises:
        SettingError: naming ``reference`` (and ``lora``).
    """
    if mode not in get_args(ReferenceMode):
        raise SettingError("reference", f" must be 'auto', 'copy' or 'adapters_off', got {mode!r}")
    if mode == "adapters_off" and not lora:
        raise SettingError(
            "reference", ": `adapters_off` needs LoRA adapters on the actor (`lora`); without them there is nothing to disable",
            siblings=("lora",),
        )
    if not kl_enabled:
        return None
    if mode == "auto":
        mode = "adapters_off" if lora else "copy"
    return AdaptersOff() if mode == "adapters_off" else FrozenCopy()
