"""The four loss aggregation modes on a hand-computed batch, and their split into a per-micro-batch
numerator and a mini-batch denominator."""

from __future__ import annotations

import pytest
import torch

from lightning_mem.rl.loss_aggregation import LOSS_AGG_MODES, aggregate, counts, denominator, token_weights, weighted_sum

# Row 0: 3 tokens (1, 2, 3); row 1: 1 token (4); row 2: fully masked (a filtered sample, inf loss).
LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [float("inf"), 5.0, 5.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4),  # 4 tokens
        ("seq-mean-token-sum", (6 + 4) / 2),  # 2 sequences: the masked row is not one
        ("seq-mean-token-mean", (6 / 3 + 4 / 1) / 2),
        ("seq-mean-token-sum-norm", (6 + 4) / (2 * 8)),  # horizon L = 8
    ],
)
def test_each_mode_on_a_hand_computed_batch(mode, expected):
    loss = LOSS.clone().requires_grad_()
    out = aggregate(loss, MASK, mode, horizon=8)
    assert out.item() == pytest.approx(expected)
    out.backward()
    assert torch.isfinite(loss.grad).all() and (loss.grad[2] == 0).all()  # the masked row: no gradient, no NaN


def test_single_token_responses_make_the_sequence_modes_agree():
    loss, mask = torch.tensor([[2.0, 7.0], [4.0, 7.0]]), torch.tensor([[1, 0], [1, 0]])
    values = {mode: aggregate(loss, mask, mode, horizon=1).item() for mode in LOSS_AGG_MODES}
    assert values == pytest.approx(dict.fromkeys(LOSS_AGG_MODES, 3.0))


def test_all_masked_batch_gives_zero_not_nan():
    for mode in LOSS_AGG_MODES:
        assert aggregate(torch.ones(2, 3), torch.zeros(2, 3), mode, horizon=3).item() == 0.0


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batch_numerators_over_the_mini_batch_denominator_give_the_whole(mode):
    torch.manual_seed(0)
    loss = torch.randn(6, 5)
    mask = (torch.rand(6, 5) > 0.3).long()
    mask[4] = 0
    tokens, sequences = counts(mask)
    denom = denominator(mode, tokens, sequences, horizon=5).float()
    parts = sum((loss[i:i + 2] * token_weights(mask[i:i + 2], mode)).sum() for i in range(0, 6, 2))
    torch.testing.assert_close(parts / denom, aggregate(loss, mask, mode, horizon=5))


def test_bad_mode_and_missing_horizon():
    with pytest.raises(ValueError, match="unknown loss aggregation mode 'sum'"):
        token_weights(MASK, "sum")
    with pytest.raises(ValueError, match="horizon"):
        denominator("seq-mean-token-sum-norm", 4, 2)


def test_sequence_losses_split_into_micro_batches_give_verls_mean_over_responses():
    """GSPO and GMPO per token, aggregated by their default mode over micro-batches of 2 rows, are
    the mean of the per-response losses over the whole batch (verl's objective for both), and so is
    the gradient; a fully masked row counts for nothing."""
    from lightning_mem.rl.policy_losses import geo_mean_loss, gspo_loss

    torch.manual_seed(1)
    old = -torch.rand(6, 4, dtype=torch.float64)
    logprobs = (old + 0.4 * torch.randn(6, 4, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(6, 1, dtype=torch.float64).expand(6, 4)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0], [1, 1, 0, 0]])
    for loss_fn in (gspo_loss, geo_mean_loss):
        whole = loss_fn(logprobs, old, adv, mask, clip_low=0.1, clip_high=0.1).loss
        per_response = [whole[i, 0] for i in range(6) if mask[i].any()]
        expected = sum((whole[i] * mask[i]).sum() / mask[i].sum() for i in range(6) if mask[i].any()) / 5
        tokens, sequences = counts(mask)
        denom = denominator("seq-mean-token-mean", tokens, sequences).to(torch.float64)
        parts = 0.0
        for i in range(0, 6, 2):
            micro = loss_fn(logprobs[i:i + 2], old[i:i + 2], adv[i:i + 2], mask[i:i + 2], clip_low=0.1, clip_high=0.1)
            parts = parts + weighted_sum(micro.loss, token_weights(mask[i:i + 2], "seq-mean-token-mean"))
        (split_grad,) = torch.autograd.grad(parts / denom, logprobs)
        (whole_grad,) = torch.autograd.grad(expected, logprobs)
        torch.testing.assert_close(parts / denom, expected)
        torch.testing.assert_close(split_grad, whole_grad)
        if loss_fn is geo_mean_loss:  # one loss per response, the same on each of its tokens
            torch.testing.assert_close(expected, sum(per_response) / 5)
