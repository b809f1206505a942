"""TIS and MIS weights, token and sequence level, on hand-computed log-probs; no inf for a
sequence whose log-ratio sum overflows exp."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_mem.rl.rollout_correction import correction_weights, mismatch_kl

LOG = math.log
# per-token ratios pi_old / pi_engine: row 0: 3, 0.5, 1; row 1: 1.5 (one token); row 2: fully masked
OLD = torch.tensor([[LOG(3.0), LOG(0.5), 0.0], [LOG(1.5), 0.0, 0.0], [50.0, 0.0, 0.0]])
ENGINE = torch.zeros(3, 3)
MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])


def test_token_tis_caps_each_weight():
    c = correction_weights(OLD, ENGINE, MASK, mode="tis", level="token", upper=2.0)
    torch.testing.assert_close(c.weights, torch.tensor([[2.0, 0.5, 1.0], [1.5, 0, 0], [0, 0, 0]]))
    assert c.affected.sum() == 1 and c.affected[0, 0]


def test_sequence_tis_weighs_the_whole_response():
    c = correction_weights(OLD, ENGINE, MASK, mode="tis", level="sequence", upper=2.0)
    # row 0: 3 * 0.5 * 1 = 1.5 on every token; row 1: 1.5
    torch.testing.assert_close(c.weights, torch.tensor([[1.5, 1.5, 1.5], [1.5, 0, 0], [0, 0, 0]]))
    assert not c.affected.any()


def test_token_mis_drops_tokens_outside_the_bounds():
    c = correction_weights(OLD, ENGINE, MASK, mode="mis", level="token", upper=2.0, lower=0.6)
    torch.testing.assert_close(c.weights, torch.tensor([[0.0, 0.0, 1.0], [1.0, 0, 0], [0, 0, 0]]))
    assert c.affected.sum() == 2


def test_sequence_mis_drops_whole_responses_and_survives_overflow():
    old = torch.tensor([[60.0, 60.0], [0.1, -0.1]])  # row 0: exp(120) overflows float32
    c = correction_weights(old, torch.zeros(2, 2), torch.ones(2, 2), mode="mis", level="sequence", upper=2.0)
    torch.testing.assert_close(c.weights, torch.tensor([[0.0, 0.0], [1.0, 1.0]]))
    t = correction_weights(old, torch.zeros(2, 2), torch.ones(2, 2), mode="tis", level="sequence", upper=2.0)
    torch.testing.assert_close(t.weights, torch.tensor([[2.0, 2.0], [1.0, 1.0]]))


def test_mismatch_kl_is_zero_when_they_agree_and_positive_otherwise():
    kl = mismatch_kl(OLD, ENGINE, MASK)
    assert kl[0, 2] == 0 and (kl[2] == 0).all()
    assert kl[0, 0].item() == pytest.approx(2.0 - LOG(3.0))  # rho - 1 - log rho, rho = 3
    assert (kl >= 0).all()
