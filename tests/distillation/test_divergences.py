"""The distillation divergences: sliced equals whole-logits (values and gradients, fp32, 1e-6) for
forward KL, reverse KL, generalized JSD and top-k; values worked by hand; JSD's beta ends; and the
bytes a slice may hold at a 151,936-token vocabulary, exact on fake tensors."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from benchmarks.distillation import loss_transients
from lightning_mem.distillation import Divergence, distillation_divergence, reference_rows

N, HS, HT, V = 37, 16, 24, 101  # V: no chunk or slice size divides it


def _heads(bias: bool, teacher_rows: int = V):
    return nn.Linear(HS, V, bias=bias), nn.Linear(HT, teacher_rows, bias=bias)


def _grads(hs: torch.Tensor, head: nn.Linear) -> list[torch.Tensor]:
    out = [hs.grad.clone(), head.weight.grad.clone()] + ([head.bias.grad.clone()] if head.bias is not None else [])
    hs.grad = None
    head.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("kind, beta", [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.3), ("jsd", 0.9)])
@pytest.mark.parametrize("top_k", [None, 7], ids=["all", "top7"])
@pytest.mark.parametrize("temperature, bias", [(1.0, False), (2.0, True)], ids=["T1", "T2-bias"])
def test_sliced_equals_the_whole_logits(kind, beta, top_k, temperature, bias):
    """Per-row values and the gradients of a per-row weighted sum (a per-token upstream gradient),
    with a teacher layer of 5 padded rows cut to the shared width, slices of a few columns."""
    student, teacher = _heads(bias, teacher_rows=V + 5)
    hs, ht = torch.randn(N, HS, requires_grad=True), torch.randn(N, HT)
    weights = torch.rand(N)
    div = Divergence(kind, beta)
    got = distillation_divergence(hs, student, ht, teacher, divergence=div, temperature=temperature, width=V,
                                  top_k=top_k, chunk_size=3)
    (got * weights).sum().backward()
    assert teacher.weight.grad is None  # the teacher gets none
    got_grads = _grads(hs, student)
    with torch.no_grad():
        teacher_logits = teacher(ht)[:, :V]
    want = reference_rows(student(hs), teacher_logits, div, temperature=temperature, top_k=top_k)
    (want * weights).sum().backward()
    torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-6)
    for a, b in zip(got_grads, _grads(hs, student)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_the_module_call_path_equals_the_sliced_path():
    """A head that is not a plain nn.Linear (a subclass here, as FSDP2 or peft make) is called per
    chunk with a recompute: the same values and gradients."""

    class Wrapped(nn.Linear):
        pass

    student, teacher = _heads(bias=False)
    wrapped = Wrapped(HS, V, bias=False)
    wrapped.weight = nn.Parameter(student.weight.detach().clone())
    hs, ht = torch.randn(N, HS, requires_grad=True), torch.randn(N, HT)
    div = Divergence("jsd", 0.4)
    sliced = distillation_divergence(hs, student, ht, teacher, divergence=div, chunk_size=5)
    sliced.sum().backward()
    called = distillation_divergence(hs, wrapped, ht, teacher, divergence=div, chunk_size=5)
    called.sum().backward()
    torch.testing.assert_close(called, sliced, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(wrapped.weight.grad, student.weight.grad, rtol=1e-6, atol=1e-6)


def _rows(p: list[float]) -> torch.Tensor:
    """Logits whose softmax is ``p`` (log-probs are logits)."""
    return torch.tensor([p]).log()


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
def test_identical_distributions_diverge_by_zero(kind):
    z = torch.randn(4, 9)
    assert reference_rows(z, z, Divergence(kind)).abs().max() < 1e-6


def test_two_token_values_worked_by_hand():
    """p = (0.5, 0.5) student, q = (0.9, 0.1) teacher.

    KL(q || p) = 0.9 ln(0.9/0.5) + 0.1 ln(0.1/0.5) = 0.368064
    KL(p || q) = 0.5 ln(0.5/0.9) + 0.5 ln(0.5/0.1) = 0.510826
    JSD(beta 1/2), m = (0.7, 0.3): 0.5 [0.9 ln(0.9/0.7) + 0.1 ln(0.1/0.3)]
        + 0.5 [0.5 ln(0.5/0.7) + 0.5 ln(0.5/0.3)] = 0.5 (0.116322) + 0.5 (0.087177) = 0.101749
    """
    p, q = _rows([0.5, 0.5]), _rows([0.9, 0.1])
    forward = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)
    reverse = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    jsd = 0.5 * (0.9 * math.log(0.9 / 0.7) + 0.1 * math.log(0.1 / 0.3)) + 0.5 * (0.5 * math.log(0.5 / 0.7) + 0.5 * math.log(0.5 / 0.3))
    assert (round(forward, 6), round(reverse, 6), round(jsd, 6)) == (0.368064, 0.510826, 0.101749)
    for kind, value in (("forward_kl", forward), ("reverse_kl", reverse), ("jsd", jsd)):
        assert reference_rows(p, q, Divergence(kind, 0.5)).item() == pytest.approx(value, abs=1e-6)
        student, teacher = nn.Linear(2, 2, bias=False), nn.Linear(2, 2, bias=False)
        with torch.no_grad():  # identity heads: the hidden rows are the logits
            student.weight.copy_(torch.eye(2))
            teacher.weight.copy_(torch.eye(2))
        got = distillation_divergence(p, student, q, teacher, divergence=Divergence(kind, 0.5))
        assert got.item() == pytest.approx(value, abs=1e-6)


def test_temperature_divides_both_models_logits():
    zs, zt = torch.randn(3, 11), torch.randn(3, 11)
    div = Divergence("forward_kl")
    torch.testing.assert_close(reference_rows(zs, zt, div, temperature=2.5), reference_rows(zs / 2.5, zt / 2.5, div))


def test_jsd_at_beta_0_and_1_is_forward_and_reverse_kl_and_its_formula_tends_to_them():
    """TRL's convention: beta 0 and 1 are forward and reverse KL exactly; the mixture formula itself
    goes to 0 at both ends, its ratio to beta (to 1 - beta) to forward (reverse) KL."""
    zs, zt = torch.randn(5, 13, dtype=torch.float64), torch.randn(5, 13, dtype=torch.float64)
    forward = reference_rows(zs, zt, Divergence("forward_kl"))
    reverse = reference_rows(zs, zt, Divergence("reverse_kl"))
    torch.testing.assert_close(reference_rows(zs, zt, Divergence("jsd", 0.0)), forward)
    torch.testing.assert_close(reference_rows(zs, zt, Divergence("jsd", 1.0)), reverse)
    small = 1e-6
    torch.testing.assert_close(reference_rows(zs, zt, Divergence("jsd", small)) / small, forward, rtol=1e-4, atol=0)
    torch.testing.assert_close(reference_rows(zs, zt, Divergence("jsd", 1 - small)) / small, reverse, rtol=1e-4, atol=0)


def test_top_k_sums_over_the_teachers_k_tokens_unrenormalised():
    """Forward KL over the teacher's 2 most likely of 4 tokens, full-vocabulary log-probs:
    q = (0.6, 0.3, 0.05, 0.05), p = (0.25,) * 4 -> 0.6 ln(0.6/0.25) + 0.3 ln(0.3/0.25) = 0.579978 (not renormalised over the two)."""
    q, p = _rows([0.6, 0.3, 0.05, 0.05]), _rows([0.25] * 4)
    want = 0.6 * math.log(0.6 / 0.25) + 0.3 * math.log(0.3 / 0.25)
    assert round(want, 6) == 0.579978
    assert reference_rows(p, q, Divergence("forward_kl"), top_k=2).item() == pytest.approx(want, abs=1e-6)
    identity = nn.Linear(4, 4, bias=False)
    with torch.no_grad():
        identity.weight.copy_(torch.eye(4))
    got = distillation_divergence(p, identity, q, identity, divergence=Divergence("forward_kl"), top_k=2)
    assert got.item() == pytest.approx(want, abs=1e-6)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="divergence must be one of"):
        Divergence("kl")
    with pytest.raises(ValueError, match=r"beta must be in \[0, 1\]"):
        Divergence("jsd", 1.5)
    student, teacher = _heads(bias=False)
    with pytest.raises(ValueError, match="top_k"):
        distillation_divergence(torch.randn(2, HS), student, torch.randn(2, HT), teacher,
                                divergence=Divergence(), top_k=V + 1)


@pytest.mark.parametrize("kind, top_k, chunk", [("jsd", None, 512), ("forward_kl", None, 128), ("reverse_kl", 64, 512)])
def test_a_slice_holds_at_most_one_and_a_half_chunks_of_fp32_logits(kind, top_k, chunk):
    """At Qwen2.5's vocabulary (151,936), the 0.5B student's and 7B teacher's widths, 2,048 scored
    tokens, bf16 autocast: forward and backward each allocate at most 1.5 x [chunk, vocab] fp32
    beyond their inputs and the gradients they return (benchmarks/distillation.py measures 8,192)."""
    forward, backward = loss_transients(kind, top_k, tokens=2048, chunk=chunk)
    budget = 1.5 * chunk * 151_936 * 4
    assert max(forward, backward) <= budget, (forward / budget, backward / budget)
