"""The logits path: chunked log-probs / entropy equal the full-logits computation, gradients included,
for plain, tied, LoRA and 4-bit models; backward recomputes each chunk; and at a 151,936-token
vocabulary the peak of tracked bytes stays within 1.5x one micro-batch's bf16 logits."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_mem.logits import check_supported, next_token_targets, response_targets, score_tokens

VOCAB = 509  # not a multiple of anything a chunk size here is


def tiny(seed: int = 0, *, vocab: int = VOCAB, tied: bool = False, layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config)


def batch(seed: int = 1, rows: int = 3, width: int = 23):
    """Right-padded rows of different lengths; labels -100 on a prompt and on padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (rows, width), generator=g)
    mask = torch.ones_like(ids)
    labels = ids.clone()
    for r in range(rows):
        length = width - 4 * r
        mask[r, length:] = 0
        labels[r, length:] = -100
        labels[r, : 3 + r] = -100
    return ids, mask, labels


def reference(model: nn.Module, ids, mask, labels, temperature: float = 1.0):
    """Log-probs and entropies from the model's full logits, the textbook way."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    shifted = labels[:, 1:]
    keep = shifted != -100
    picked = logp.gather(-1, shifted.clamp(min=0).unsqueeze(-1)).squeeze(-1)[keep]
    entropy = -(logp.exp() * logp).sum(-1)[keep]
    return picked, entropy


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def assert_grads_close(got: dict, expected: dict, rel: float = 1e-5) -> None:
    """Each gradient within ``rel`` of the reference, relative to its norm (fp32 sums in another order
    differ by rounding, elementwise large on entries near 0)."""
    assert got.keys() == expected.keys() and got
    for name, g in expected.items():
        error = float((got[name] - g).norm() / g.norm().clamp(min=1e-12))
        assert error <= rel, (name, error)


@pytest.mark.parametrize("chunk_size", [None, 1, 7, 64])
@pytest.mark.parametrize("tied", [False, True])
def test_chunked_equals_the_full_logits_with_gradients(chunk_size, tied):
    model = tiny(tied=tied)
    ids, mask, labels = batch()
    temperature = 0.7
    want_lp, want_ent = reference(model, ids, mask, labels, temperature)
    (want_lp.sum() + 0.3 * want_ent.sum()).backward()
    want_grads = grads(model)

    positions, targets = next_token_targets(ids, labels)
    got = score_tokens(model, ids, mask, positions, targets, chunk_size=chunk_size, temperature=temperature,
                       with_entropy=True)
    torch.testing.assert_close(got.logprobs, want_lp, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.entropy, want_ent, rtol=1e-5, atol=1e-6)
    (got.logprobs.sum() + 0.3 * got.entropy.sum()).backward()
    assert_grads_close(grads(model), want_grads)
    # The output layer is back in place, and the model works as before.
    assert isinstance(model.get_output_embeddings(), nn.Linear)
    assert model(input_ids=ids).logits.shape == (*ids.shape, VOCAB)


def test_entropy_as_a_metric_has_no_gradient_and_the_same_value():
    model = tiny()
    ids, mask, labels = batch()
    positions, targets = next_token_targets(ids, labels)
    with_grad = score_tokens(model, ids, mask, positions, targets, chunk_size=5, with_entropy=True)
    metric = score_tokens(model, ids, mask, positions, targets, chunk_size=5, with_entropy=True, entropy_grad=False)
    assert with_grad.entropy.requires_grad and not metric.entropy.requires_grad
    torch.testing.assert_close(metric.entropy, with_grad.entropy.detach())


def test_backward_recomputes_each_chunk_instead_of_keeping_its_logits():
    model = tiny()
    ids, mask, labels = batch()
    positions, targets = next_token_targets(ids, labels)
    calls: list[int] = []
    model.lm_head.register_forward_hook(lambda mod, args, out: calls.append(out.shape[0]))
    n, chunk = positions.numel(), 8
    chunks = -(-n // chunk)
    scores = score_tokens(model, ids, mask, positions, targets, chunk_size=chunk)
    assert len(calls) == chunks and max(calls) == chunk  # only scored positions, a chunk at a time
    scores.logprobs.sum().backward()
    assert len(calls) == 2 * chunks  # every chunk's logits made again in backward
    calls.clear()
    with torch.no_grad():
        score_tokens(model, ids, mask, positions, targets, chunk_size=chunk)
    assert len(calls) == chunks  # no recomputation without gradients


def test_hidden_states_of_the_scored_positions():
    model = tiny()
    ids, mask, labels = batch()
    positions, targets = next_token_targets(ids, labels)
    scores = score_tokens(model, ids, mask, positions, targets, chunk_size=4, with_hidden=True)
    last = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(scores.hidden, last.reshape(-1, last.shape[-1])[positions])


def test_response_targets_place_each_response_token_after_its_prompt():
    # Right-padded: sample 0 = prompt [5, 6] + response [7, 8]; sample 1 = prompt [9] + response [3].
    response_ids = torch.tensor([[7, 8], [3, 0]])
    response_mask = torch.tensor([[1, 1], [1, 0]])
    positions, targets, (rows, cols) = response_targets(torch.tensor([2, 1]), response_ids, response_mask, width=4)
    assert positions.tolist() == [1, 2, 4] and targets.tolist() == [7, 8, 3]
    assert rows.tolist() == [0, 0, 1] and cols.tolist() == [0, 1, 0]


def test_lora_model_and_its_adapters_off_base():
    from peft import LoraConfig, get_peft_model

    base = tiny()
    ids, mask, labels = batch()
    want_base, _ = reference(base, ids, mask, labels)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                            init_lora_weights=False))
    want_lp, _ = reference(model, ids, mask, labels)
    want_lp.sum().backward()
    want_grads = grads(model)
    positions, targets = next_token_targets(ids, labels)
    got = score_tokens(model, ids, mask, positions, targets, chunk_size=6)
    torch.testing.assert_close(got.logprobs, want_lp, rtol=1e-5, atol=1e-6)
    got.logprobs.sum().backward()
    assert_grads_close(grads(model), want_grads)
    with model.disable_adapter():
        off = score_tokens(model, ids, mask, positions, targets, chunk_size=6)
    torch.testing.assert_close(off.logprobs, want_base.detach(), rtol=1e-5, atol=1e-6)


def test_4bit_lora_model(tmp_path):
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    from lightning_mem.quantization import QuantizationSettings, load_quantized_causal_lm, materialize_random_weights
    from tests.helpers import TINY_MODEL

    base = materialize_random_weights(str(TINY_MODEL), tmp_path / "base", seed=0)
    model = load_quantized_causal_lm(str(base), QuantizationSettings(compute_dtype="float32"))
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"],
                                             lora_dropout=0.0, init_lora_weights=False)).train()
    ids, mask, labels = batch()
    ids = ids % model.config.vocab_size
    labels = torch.where(labels == -100, labels, ids)
    want_lp, want_ent = reference(model, ids, mask, labels)
    (want_lp.sum() + want_ent.sum()).backward()
    want_grads = grads(model)
    positions, targets = next_token_targets(ids, labels)
    got = score_tokens(model, ids, mask, positions, targets, chunk_size=5, with_entropy=True)
    torch.testing.assert_close(got.logprobs, want_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.entropy, want_ent, rtol=1e-5, atol=1e-5)
    (got.logprobs.sum() + got.entropy.sum()).backward()
    assert_grads_close(grads(model), want_grads)


def test_a_model_that_post_processes_logits_is_refused():
    model = tiny()
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match=r"final_logit_softcapping.*`model.logits_chunk_size: null`"):
        check_supported(model, key="model.logits_chunk_size")  # the key the recipes pass


# -- exact bytes at a real vocabulary, on fake tensors ----------------------------------------------

BIG_VOCAB, SCORED = 151_936, 4096


def _tracked_peak_above_weights(run) -> float:
    """Peak of MemTracker's tracked bytes minus parameters and buffers, as a multiple of one
    micro-batch's bf16 logits (SCORED x BIG_VOCAB x 2 bytes). Runs on fake tensors: no real memory."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    mode = FakeTensorMode()
    with mode:
        # The tiny architecture with Qwen2.5's vocabulary.
        model = tiny(vocab=BIG_VOCAB, layers=4)
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            run(model, mode)
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    weights = sum(v for k, v in peak.items() if k != "Total" and getattr(k, "value", "") in ("Parameter", "Buffer"))
    return (peak["Total"] - weights) / (SCORED * BIG_VOCAB * 2)


def _fake_inputs(mode, rows: int, width: int, unscored: int):
    ids = torch.randint(0, BIG_VOCAB, (rows, width))
    labels = ids.clone()
    labels[:, :unscored] = -100
    positions, targets = next_token_targets(ids, labels)  # real index tensors, made outside the fake mode
    assert positions.numel() == SCORED
    return [mode.from_tensor(t) for t in (ids, torch.ones_like(ids), positions, targets)]


def test_sft_step_peak_is_at_most_one_and_a_half_micro_batch_logits():
    def sft_step(model, mode):
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            ids, mask, positions, targets = _fake_inputs(mode, 4, 1025, 0)
        (-score_tokens(model, ids, mask, positions, targets).logprobs.sum()).backward()

    ratio = _tracked_peak_above_weights(sft_step)
    assert ratio <= 1.5, ratio  # measured 1.22 at chunk 512 (unchunked: 6.35)


def test_ppo_score_pass_peak():
    def score(model, mode):
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            ids, mask, positions, targets = _fake_inputs(mode, 4, 1056, 32)
        with torch.no_grad():
            score_tokens(model, ids, mask, positions, targets)

    ratio = _tracked_peak_above_weights(score)
    assert ratio <= 1.5, ratio  # measured 0.51 (unchunked: 4.0)


def test_ppo_train_micro_batch_peak():
    def train(model, mode):
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            ids, mask, positions, targets = _fake_inputs(mode, 4, 1056, 32)
        out = score_tokens(model, ids, mask, positions, targets, with_entropy=True, entropy_grad=False, with_hidden=True)
        (-out.logprobs.sum() + out.hidden.float().square().mean()).backward()

    ratio = _tracked_peak_above_weights(train)
    assert ratio <= 1.5, ratio  # measured 1.24 (unchunked: 6.4)
