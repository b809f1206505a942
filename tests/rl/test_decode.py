"""The static decode loop (lightning_mem.rl.decode): greedy rollouts equal Hugging Face ``generate``
token for token, eager and compiled; the compiled step compiles once over rollouts of different
prompt widths (and after the cache is freed); a LoRA actor samples merged and gets its weights back
bit for bit; the estimate's stand-in runs one decode step."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from lightning_mem.lora import LoraSettings, apply_lora, merged_adapters
from lightning_mem.models import load_causal_lm
from lightning_mem.rl.decode import StaticDecoder, bucketed, estimated_decode, sample_tokens, supports_static_decode
from lightning_mem.rl.rollout import GenerationConfig, RolloutEngine
from lightning_mem.settings import SettingError, settings_at
from tests.helpers import TINY_MODEL

EOS, PAD = 1, 0


def _model(attn: str = "sdpa", lora: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    model = load_causal_lm(str(TINY_MODEL), attn_implementation=attn)
    if lora:
        model = apply_lora(model, LoraSettings(r=8, lora_dropout=0.0, target_modules="all-linear"))
        for name, param in model.named_parameters():
            if "lora_B" in name:  # B = 0 at init would make the adapters (and merging them) a no-op
                torch.nn.init.normal_(param, std=0.05)
    return model.eval()


@pytest.fixture(scope="module")
def tiny():
    return _model()


def _prompts(width: int, rows: int = 5, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of lengths 1..width (row 0 full width)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 200, (rows, width), generator=g)
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    lengths[0] = width
    mask = (torch.arange(width)[None, :] >= (width - lengths)[:, None]).long()
    return ids.masked_fill(mask == 0, PAD), mask


def _greedy_generate(model, ids, mask, new=10):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=[EOS],
                          pad_token_id=PAD, temperature=None, top_p=None, top_k=None)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_greedy_static_loop_equals_generate_token_for_token(attn):
    model = _model(attn)
    decoder = StaticDecoder(prompt_bucket=8)
    for width in (3, 8, 13):
        ids, mask = _prompts(width, seed=width)
        got = decoder.generate(model, ids, mask, max_new_tokens=10, eos_token_ids=[EOS], pad_token_id=PAD, do_sample=False)
        assert torch.equal(got, _greedy_generate(model, ids, mask)), f"{attn}, prompt width {width}"


def test_compiled_step_compiles_once_over_prompt_widths_and_a_freed_cache(tiny):
    counter = CompileCounter()
    decoder = StaticDecoder(prompt_bucket=32, compile=True, backend=counter)
    for width in (4, 9, 17, 31):  # one bucket: the same cache shape every time
        ids, mask = _prompts(width, seed=width)
        got = decoder.generate(tiny, ids, mask, max_new_tokens=10, eos_token_ids=[EOS], pad_token_id=PAD, do_sample=False)
        assert torch.equal(got, _greedy_generate(tiny, ids, mask)), f"prompt width {width}"
    assert counter.frame_count == 1
    cache = decoder.cache
    decoder.generate(tiny, *_prompts(5), max_new_tokens=10, eos_token_ids=[EOS], pad_token_id=PAD, do_sample=False)
    assert decoder.cache is cache  # same shape: reset and reused
    assert decoder.free() and decoder.cache is None
    decoder.generate(tiny, *_prompts(6), max_new_tokens=10, eos_token_ids=[EOS], pad_token_id=PAD, do_sample=False)
    assert counter.frame_count == 1  # a new cache of the same shape: no recompile


def test_the_loop_stops_once_every_row_has_ended(tiny):
    """Every token ends a row here, so all rows end at their first token; the loop notices at its
    first check (every 4 tokens): 3 decode steps ran, not 39, and the rest is padding."""
    ids, mask = _prompts(6)
    decoder = StaticDecoder(prompt_bucket=8, check_every=4)
    calls = []
    step = decoder._decode_step(tiny)
    decoder._step = lambda *a: calls.append(1) or step(*a)
    every_token = list(range(tiny.config.vocab_size))
    out = decoder.generate(tiny, ids, mask, max_new_tokens=40, eos_token_ids=every_token, pad_token_id=PAD, do_sample=False)
    assert out.shape == (5, 46) and len(calls) == 3
    assert out[:, 7:].eq(PAD).all() and out[:, 6].ne(PAD).all()


def test_sampling_draws_the_tempered_softmax():
    """The exponential race draws from softmax(logits / T): frequencies over many draws match it."""
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    draws = sample_tokens(logits.expand(40000, -1), temperature=0.7, do_sample=True)
    freq = torch.bincount(draws, minlength=5).double() / draws.numel()
    torch.testing.assert_close(freq, (logits / 0.7).softmax(-1).double(), atol=0.01, rtol=0)
    assert sample_tokens(logits[None], temperature=0.7, do_sample=False).tolist() == [0]


def test_lora_rollout_samples_merged_and_puts_the_weights_back_bit_for_bit():
    model = _model(lora=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids, mask = _prompts(7)
    plain = RolloutEngine(GenerationConfig(max_new_tokens=8, do_sample=False, merge_lora=False), eos_token_ids=[EOS],
                          pad_token_id=PAD).generate(model, ids, mask)
    engine = RolloutEngine(GenerationConfig(max_new_tokens=8, do_sample=False, kv_cache="static"), eos_token_ids=[EOS],
                           pad_token_id=PAD)
    fast = engine.generate(model, ids, mask)
    assert torch.equal(fast.response_ids, plain.response_ids)  # fp32: merged or not, the same greedy tokens
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    layers = [m for m in model.modules() if hasattr(m, "merged_adapters")]
    assert layers and not any(m.merged for m in layers)
    with merged_adapters(model) as merged:
        assert merged == len(layers) and all(m.merged for m in layers)
    with merged_adapters(model, enabled=False) as merged:
        assert merged == 0


def test_estimate_stand_in_runs_one_decode_step(tiny):
    ids, mask = _prompts(6)
    decoder = StaticDecoder(prompt_bucket=8, compile=True, backend=CompileCounter())
    calls = []
    original = decoder._eager_step

    def counting(model):
        step = original(model)
        return lambda *a: calls.append(1) or step(*a)

    decoder._eager_step = counting
    with estimated_decode(fill_token=7):
        out = decoder.generate(tiny, ids, mask, max_new_tokens=12, eos_token_ids=[EOS], pad_token_id=PAD)
    assert len(calls) == 1 and out[:, 6:].eq(7).all()
    with estimated_decode(fill_token=EOS):  # the warm-up: every response ends at once
        out = decoder.generate(tiny, ids, mask, max_new_tokens=12, eos_token_ids=[EOS], pad_token_id=PAD)
    assert len(calls) == 1 and out[:, 6].eq(EOS).all()


def test_settings_and_what_the_loop_refuses(tiny):
    assert bucketed(1, 64) == 64 and bucketed(64, 64) == 64 and bucketed(65, 64) == 128
    assert supports_static_decode(tiny) is None
    with pytest.raises(SettingError, match=r"`model.generation.compile: true` .* `model.generation.kv_cache: static`"), \
            settings_at("model.generation"):
        GenerationConfig(compile=True)
    flash = _model()
    flash.config._attn_implementation = "flash_attention_2"
    assert "flash_attention_2" in supports_static_decode(flash)


def test_groups_prefilled_once_sample_as_if_each_row_had_its_own_prefill(tiny):
    """GRPO's rows (each prompt `group` times in a row): prefilled once per prompt, copied to its rows;
    greedy output equals the plain loop's, and the prefill ran on rows / group rows."""
    ids, mask = _prompts(7, rows=3)
    group = 4
    ids, mask = ids.repeat_interleave(group, dim=0), mask.repeat_interleave(group, dim=0)
    plain = StaticDecoder(prompt_bucket=8).generate(tiny, ids, mask, max_new_tokens=6, eos_token_ids=[EOS],
                                                     pad_token_id=PAD, do_sample=False)
    seen = []
    hook = tiny.model.embed_tokens.register_forward_hook(lambda m, a, out: seen.append(tuple(a[0].shape)))
    try:
        shared = StaticDecoder(prompt_bucket=8).generate(tiny, ids, mask, max_new_tokens=6, eos_token_ids=[EOS],
                                                          pad_token_id=PAD, do_sample=False, group_size=group)
    finally:
        hook.remove()
    assert torch.equal(shared, plain)
    assert seen[0] == (3, 8) and all(shape == (12, 1) for shape in seen[1:])
