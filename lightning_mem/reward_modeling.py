"""Reward models trained on preference pairs: a sequence classifier scored where it reads, the
Bradley-Terry loss, and the export a PPO run loads as it is.

A reward model is a ``transformers`` ``*ForSequenceClassification`` with one output: its backbone
reads the conversation and a linear head (``score``) turns one position's final hidden state into
the reward. Hugging Face's own forward projects *every* position through the head and then picks,
per row, the rightmost token that is not the pad token. Training here runs the backbone once over a
whole micro-batch (chosen and rejected sides stacked, padded or packed) and applies the head to the
read positions only (:class:`SequenceScorer`), so a packed row of many sequences gives one reward
per sequence, and nothing is projected that is not read.

Where a reward is read (:func:`read_positions`) is Hugging Face's rule, so that the exported
classifier, scored by its own forward (:class:`lightning_mem.rl.reward.RewardModel`, or anyone's),
reads the position training read: the last token of the sequence that is not the pad token. It is
the sequence's last token unless that token *is* the pad token, which happens when the tokenizer
pads with its eos token and the chat template ends a turn with eos (Llama 3 Instruct: pad = eos =
``<|eot_id|>``): Hugging Face then reads the token before it, and so does training.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_mem.checkpointing import staged_directory
from lightning_mem.export import gather_state_dict
from lightning_mem.settings import SettingNotSupported

#: Attribute names of a ``transformers`` sequence classifier's head (decoder models use ``score``,
#: encoder models ``classifier``); peft's sequence-classification task trains the same two.
HEAD_NAMES = ("score", "classifier")


def classifier_of(model: nn.Module) -> nn.Module:
    """The ``transformers`` classifier inside ``model`` (itself, or the base of a peft model)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def head_name(classifier: nn.Module) -> str:
    """The attribute holding ``classifier``'s output head."""
    found = next((name for name in HEAD_NAMES if isinstance(getattr(classifier, name, None), nn.Module)), None)
    if found is None:
        raise ValueError(f"{type(classifier).__name__} has no sequence-classification head ({' or '.join(HEAD_NAMES)})")
    return found


def read_positions(input_ids: Tensor, sequence_ends: Tensor, pad_token_id: int | None) -> Tensor:
    """Where each sequence's reward is read: flat positions into ``input_ids.view(-1)``, the last
    position at or before ``sequence_ends`` (each sequence's last real token) whose token is not
    ``pad_token_id`` (Hugging Face's rule; see the module docstring). On the device, no host sync:
    a running maximum of the non-pad positions, read at the ends."""
    if pad_token_id is None:
        return sequence_ends
    flat = input_ids.reshape(-1)
    index = torch.arange(flat.numel(), device=flat.device)
    last_non_pad = torch.where(flat != pad_token_id, index, torch.full_like(index, -1)).cummax(0).values
    return last_non_pad.index_select(0, sequence_ends).clamp(min=0)


def check_unsplit(strategy: Any) -> None:
    """Refuse a strategy that splits sequences or layers over ranks (``tensor_parallel_size`` or
    ``context_parallel_size`` above 1): a reward is read at one position of each whole sequence,
    which this scorer does not gather from split ranks yet. Data parallelism (FSDP2, DDP, ZeRO)
    is what a reward model at these sizes needs."""
    for key in ("tensor_parallel_size", "context_parallel_size"):
        degree = int(getattr(strategy, key, 1) or 1)
        if degree > 1:
            raise SettingNotSupported(
                key, f"={degree}: the reward model recipe reads each sequence's reward at one position and does not"
                " split sequences or layers over ranks yet; shard with FSDP2 alone (both sizes 1)")


class SequenceScorer(nn.Module):
    """A sequence classifier as training runs it: ``backbone`` over every sequence at once, ``head``
    on the read positions only.

    ``backbone`` and ``head`` are the classifier's own modules (peft's LoRA layers and
    ``modules_to_save`` copy included), registered here as two children: a sharding strategy finds
    the backbone (a ``transformers`` model) and shards it per block, and the head is a unit of its
    own, so each of the two is entered through its own forward. The whole classifier (or the peft
    model around it) is kept beside them, not as a child (the same parameters), for the export.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        classifier = classifier_of(model)
        self.backbone = getattr(classifier, classifier.base_model_prefix)
        self.head = getattr(classifier, head_name(classifier))
        object.__setattr__(self, "model", model)  # not a child: its parameters are the two above

    @property
    def config(self) -> Any:
        return classifier_of(self.model).config

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None, positions: Tensor,
                position_ids: Tensor | None = None) -> Tensor:
        """``[n]`` float32 rewards read at ``positions`` (flat indices into ``input_ids.view(-1)``).

        A packed row (:mod:`lightning_mem.data.packing`) comes with ``position_ids`` restarting per
        sequence and ``attention_mask=None``: the backbone then isolates the sequences."""
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": False}
        if position_ids is not None:
            inputs["position_ids"] = position_ids
        hidden = self.backbone(**inputs).last_hidden_state
        read = hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions)
        return self.head(read).squeeze(-1).float()


def bradley_terry(chosen: Tensor, rejected: Tensor, margin: Tensor | None = None,
                  center_coefficient: float = 0.0) -> Tensor:
    """Each pair's loss, ``[B]``: ``-log sigmoid(r_chosen - r_rejected - margin)`` plus
    ``center_coefficient * (r_chosen + r_rejected)^2`` (the auxiliary term of Eisenstein et al.
    2023, arXiv 2312.09244, as TRL's ``center_rewards_coefficient``: it keeps the rewards centred on
    0 without changing their differences). Their mean over the pairs is TRL's RewardTrainer loss."""
    diff = chosen - rejected
    if margin is not None:
        diff = diff - margin.to(diff.dtype)
    loss = -F.logsigmoid(diff)
    if center_coefficient:
        loss = loss + center_coefficient * (chosen + rejected).square()
    return loss


def pair_metrics(chosen: Tensor, rejected: Tensor) -> dict[str, Tensor]:
    """TRL's RewardTrainer metrics of a batch: ``accuracy`` (chosen scored strictly above rejected;
    a tie counts 0), ``margin`` (mean ``r_chosen - r_rejected``), and the mean, min and max reward
    over both sides. Device tensors: nothing is read back."""
    both = torch.cat([chosen, rejected]).detach()
    return {
        "accuracy": (chosen > rejected).float().mean(),
        "margin": (chosen - rejected).detach().mean(),
        "mean_reward": both.mean(),
        "min_reward": both.min(),
        "max_reward": both.max(),
    }


# ---------------------------------------------------------------------------------------------
# The export: a plain Hugging Face classifier, adapters merged
# ---------------------------------------------------------------------------------------------


def merged_classifier(model: nn.Module, state: dict[str, Tensor]) -> nn.Module:
    """``state`` (the whole state dict of ``model``, a peft model around a classifier) as a plain
    classifier with the adapters merged into its weights and the trained head in place of the
    original. Built on the meta device and given ``state``'s tensors (no second copy of the
    weights), merged by peft's own ``merge_and_unload``."""
    from peft import get_peft_model

    classifier = classifier_of(model)
    with torch.device("meta"):
        fresh = type(classifier)._from_config(copy.deepcopy(classifier.config))
    peft_config = copy.deepcopy(model.peft_config["default"])
    twin = get_peft_model(fresh, peft_config)
    twin.load_state_dict(state, strict=True, assign=True)
    return twin.merge_and_unload()


def export_classifier(trainer: Any, model: nn.Module, tokenizer: Any, out_dir: str | Path) -> None:
    """Write ``model`` (a sequence classifier, or a peft model around one) and ``tokenizer`` to
    ``out_dir`` as a plain Hugging Face classifier that ``AutoModelForSequenceClassification`` (and
    :func:`lightning_mem.rl.reward.load_reward_model`) loads as it is: with adapters, merged into
    the base and the trained head included. Its config names the tokenizer's pad token, which is
    where Hugging Face's forward stops reading. Every rank calls it (the weights are gathered)."""
    state = gather_state_dict(trainer, model)
    if state is not None:
        plain = merged_classifier(model, state) if hasattr(model, "peft_config") else model
        config = plain.config
        config.pad_token_id = tokenizer.pad_token_id
        with staged_directory(out_dir) as out:
            if plain is model:
                plain.save_pretrained(out, state_dict=state, safe_serialization=True)
            else:
                plain.save_pretrained(out, safe_serialization=True)
            tokenizer.save_pretrained(out)
    trainer.strategy.barrier("export_classifier")
