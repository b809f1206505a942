"""The dense on-policy signal's parts (lightning_mem/distillation/topk.py): the top-k divergence with
its tail at hand-worked values; the student's log-probs at stored ids read a vocabulary slice at a
time equal to whole logits (values and gradients, fp32, 1e-6), through a plain and a wrapped
output layer; top-k over the whole vocabulary equal to the full divergence; the teacher's top-k
chunk by chunk equal to one log-softmax."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_mem.distillation.divergences import Divergence, reference_rows
from lightning_mem.distillation.topk import student_logprobs_at, teacher_top_k, top_k_divergence

KINDS = [Divergence("forward_kl"), Divergence("reverse_kl"), Divergence("jsd", 0.3)]
IDS = ["forward_kl", "reverse_kl", "jsd"]


def _kl(a: list[float], b: list[float]) -> float:
    return sum(x * math.log(x / y) for x, y in zip(a, b))


@pytest.mark.parametrize("divergence", KINDS, ids=IDS)
def test_the_top_k_divergence_with_its_tail_at_hand_worked_values(divergence):
    """Student 0.5 and 0.3 on the teacher's two likeliest tokens (so 0.2 on the rest), teacher 0.6
    and 0.1 (0.3 on the rest): three outcomes each, both normalised over the whole vocabulary."""
    p, q = [0.5, 0.3, 0.2], [0.6, 0.1, 0.3]
    beta = divergence.beta
    m = [beta * b + (1 - beta) * a for a, b in zip(p, q)]
    want = {"forward_kl": _kl(q, p), "reverse_kl": _kl(p, q), "jsd": beta * _kl(q, m) + (1 - beta) * _kl(p, m)}
    student, teacher = torch.tensor([[0.5, 0.3]]).log(), torch.tensor([[0.6, 0.1]]).log()
    got = top_k_divergence(student, teacher, divergence)
    assert float(got[0]) == pytest.approx(want[divergence.kind], rel=1e-6)
    # Mass moved off the top-k is not free: the same student with its 0.3 on the tail scores worse.
    moved = top_k_divergence(torch.tensor([[0.5, 1e-6]]).log(), teacher, divergence)
    assert float(moved[0]) > float(got[0])


def _problem(n=9, hidden=6, vocab=40, k=5, bias=True):
    torch.manual_seed(0)
    head = nn.Linear(hidden, vocab, bias=bias)
    h = torch.randn(n, hidden, requires_grad=True)
    index = torch.stack([torch.randperm(vocab - 3)[:k] for _ in range(n)])  # width vocab - 3: a padded head
    return head, h, index


def _grads(value, head, h):
    weight = torch.linspace(-1, 1, value.numel()).reshape(value.shape)  # an upstream that is not all ones
    return torch.autograd.grad((value * weight).sum(), [h, *head.parameters()])


@pytest.mark.parametrize("chunk_size", [2, 4, None], ids=["chunk2", "chunk4", "whole"])
@pytest.mark.parametrize("temperature", [1.0, 0.7], ids=["T1", "T0.7"])
def test_the_students_logprobs_at_stored_ids_equal_whole_logits(chunk_size, temperature):
    head, h, index = _problem()
    width = head.out_features - 3
    got = student_logprobs_at(h, head, index, width=width, temperature=temperature, chunk_size=chunk_size)
    want = torch.log_softmax(head(h)[:, :width] / temperature, -1).gather(-1, index)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for a, b in zip(_grads(got, head, h), _grads(want, head, h)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


class _Wrapped(nn.Module):
    """An output layer that is not a plain ``nn.Linear`` (as a LoRA-wrapped or 4-bit one): called as a module."""

    def __init__(self, inner: nn.Linear) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def test_a_wrapped_output_layer_gives_the_same_logprobs_and_gradients():
    head, h, index = _problem(bias=False)
    plain = student_logprobs_at(h, head, index, width=37, chunk_size=3)
    wrapped = student_logprobs_at(h, _Wrapped(head), index, width=37, chunk_size=3)
    torch.testing.assert_close(wrapped, plain, rtol=1e-6, atol=1e-6)
    for a, b in zip(_grads(wrapped, head, h), _grads(plain, head, h)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("divergence", KINDS, ids=IDS)
def test_top_k_over_the_whole_vocabulary_is_the_full_divergence(divergence):
    """The teacher's top-k at ``k`` = the width (every token, no tail) against the student's log-probs
    there, sliced: the full divergence of whole logits, values and gradients."""
    head, h, _ = _problem(vocab=24)
    teacher_head, teacher_hidden = nn.Linear(6, 24), torch.randn(9, 6)
    targets = torch.zeros(9, dtype=torch.long)
    _, top, ids = teacher_top_k(teacher_hidden, teacher_head, targets, k=24, width=24, chunk_size=4)
    got = top_k_divergence(student_logprobs_at(h, head, ids, chunk_size=4), top, divergence, tail=False)
    with torch.no_grad():
        teacher_logits = teacher_head(teacher_hidden)
    want = reference_rows(head(h), teacher_logits, divergence)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for a, b in zip(_grads(got, head, h), _grads(want, head, h)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_the_teachers_top_k_chunk_by_chunk_is_one_log_softmax():
    torch.manual_seed(0)
    head, hidden = nn.Linear(6, 40), torch.randn(11, 6)
    targets = torch.randint(0, 37, (11,))
    target, top, ids = teacher_top_k(hidden, head, targets, k=4, width=37, temperature=0.7, chunk_size=3)
    whole = torch.log_softmax(head(hidden)[:, :37].detach() / 0.7, -1)
    values, index = whole.topk(4, dim=-1)
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), index)
    torch.testing.assert_close(top, values, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(target, whole.gather(-1, targets[:, None])[:, 0], rtol=1e-6, atol=1e-6)
