"""The reference policy objects: a frozen copy, or the LoRA actor with its adapters off; each
gives the starting policy's logprobs through the recipe's own forward."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from lightning_mem.models import load_causal_lm
from lightning_mem.rl.reference import AdaptersOff, FrozenCopy, disable_dropout, reference_policy
from lightning_mem.rl.rollout import Experience, policy_forward
from lightning_mem.settings import SettingError, settings_at
from tests.helpers import TINY_MODEL


def _experience() -> Experience:
    # Two samples, right-padded: prompt [5, 6] + response [7, 8]; prompt [9] + response [3].
    ids = torch.tensor([[5, 6, 7, 8], [9, 3, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    return Experience(input_ids=ids, attention_mask=mask, prompt_lengths=torch.tensor([2, 1]),
                      response_ids=torch.tensor([[7, 8], [3, 0]]), response_mask=torch.tensor([[1, 1], [1, 0]]),
                      group_ids=torch.tensor([0, 1]))


def _policy() -> torch.nn.Module:
    torch.manual_seed(0)
    return load_causal_lm(str(TINY_MODEL))


def _score(exp: Experience):
    return lambda model: policy_forward(model, exp, chunk_size=None).logprobs


def test_no_reference_without_a_kl_penalty_and_auto_follows_the_actor():
    assert reference_policy("auto", kl_enabled=False, lora=True) is None
    assert isinstance(reference_policy("auto", kl_enabled=True, lora=True), AdaptersOff)
    assert isinstance(reference_policy("auto", kl_enabled=True, lora=False), FrozenCopy)
    assert isinstance(reference_policy("copy", kl_enabled=True, lora=True), FrozenCopy)
    with pytest.raises(ValueError, match="`adapters_off` needs LoRA adapters"):
        reference_policy("adapters_off", kl_enabled=True, lora=False)


def test_a_reference_the_actor_cannot_have_is_refused_even_without_a_kl_penalty():
    # A config error whatever the KL setting, named under the recipe's key.
    with pytest.raises(SettingError, match=r"^`model.reference`: `adapters_off` needs .* \(`model.lora`\)"):
        with settings_at("model"):
            reference_policy("adapters_off", kl_enabled=False, lora=False)
    with pytest.raises(SettingError, match=r"^`reference` must be 'auto', 'copy' or 'adapters_off', got 'frozen'"):
        reference_policy("frozen", kl_enabled=False, lora=True)


def test_frozen_copy_is_frozen_in_eval_without_dropout_and_scores_itself():
    policy = _policy()
    ref = FrozenCopy()
    # A dropout the copy must not keep: its logprobs would differ from pass to pass.
    policy.model.layers[0].self_attn.attention_dropout = 0.5
    module = ref.build(lambda: policy.train())
    assert module is policy and ref.module is policy
    assert not module.training and not any(p.requires_grad for p in module.parameters())
    assert module.model.layers[0].self_attn.attention_dropout == 0.0
    exp = _experience()
    other = _policy()  # the actor it is asked about is not the one it scores
    with torch.no_grad():
        other.lm_head.weight.add_(torch.randn_like(other.lm_head.weight))
        got = ref.logprobs(other, _score(exp))
        torch.testing.assert_close(got, _score(exp)(policy))
        assert not torch.allclose(got, _score(exp)(other))


def test_adapters_off_gives_the_base_policy_and_leaves_the_adapters_on():
    base = _policy()
    exp = _experience()
    with torch.no_grad():
        want = _score(exp)(base)
    actor = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            lora_dropout=0.0, init_lora_weights=False))
    ref = AdaptersOff()
    assert ref.build(lambda: pytest.fail("adapters_off loads no second model")) is None and ref.module is None
    with torch.no_grad():
        on = _score(exp)(actor)
        torch.testing.assert_close(ref.logprobs(actor, _score(exp)), want)
        torch.testing.assert_close(_score(exp)(actor), on)  # the adapters are back on
    assert not torch.allclose(on, want)


def test_disable_dropout_zeroes_dropout_modules_and_attention_dropout():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.3))
    model[0].attention_dropout = 0.1
    assert disable_dropout(model) is model
    assert model[1].p == 0.0 and model[0].attention_dropout == 0.0
