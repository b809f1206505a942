"""The teacher role: frozen and placed per phase (parked on the host outside its forward), the same
loss resident or parked, its log-probs for on-policy use, and the vocabulary cases (a shared
tokenizer, a padded output layer cut to the shared width, another tokenizer refused in one line)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch import nn

from lightning_mem.distillation import (
    Divergence,
    DistillationSettings,
    LogitDistillation,
    Teacher,
    TeacherSettings,
    held_models,
    reference_rows,
    shared_vocabulary,
)
from lightning_mem.logits import next_token_targets, score_tokens
from lightning_mem.models import load_causal_lm, load_tokenizer
from lightning_mem.offload import module_location, module_residency
from lightning_mem.settings import SettingError
from tests.helpers import REPO, TINY_MODEL

STUDENT = REPO / "assets" / "tiny-llama-student"
TOKENS = 307  # the tiny tokenizer's
CPU = torch.device("cpu")


def _save_model(folder, *, seed: int, vocab_size: int | None = None, tokenizer_from=TINY_MODEL):
    """A tiny teacher with seeded weights on disk (and ``tokenizer_from``'s tokenizer files)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(TINY_MODEL)
    if vocab_size is not None:
        config.vocab_size = vocab_size
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copyfile(tokenizer_from / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return _save_model(tmp_path_factory.mktemp("teacher"), seed=1)


def _batch():
    torch.manual_seed(3)
    ids = torch.randint(5, TOKENS, (3, 12))
    mask = torch.ones_like(ids)
    mask[2, 9:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :4] = -100
    positions, targets = next_token_targets(ids, labels)
    return ids, mask, positions, targets


def _distillation(teacher_dir, placement: str, **settings) -> LogitDistillation:
    kd = LogitDistillation(DistillationSettings(TeacherSettings(str(teacher_dir), placement=placement), **settings))
    kd.check(str(STUDENT))
    kd.teacher.load(student_device=CPU, compute_dtype=torch.float32, width=kd.vocabulary.width)
    return kd


def test_the_teacher_is_frozen_without_dropout(teacher_dir):
    kd = _distillation(teacher_dir, "device")
    model = kd.teacher.model
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, nn.Dropout))
    assert model.config.attention_dropout == 0.0


def test_a_parked_teacher_is_on_the_device_only_inside_its_forward(teacher_dir):
    """``placement: host``: everything but the output layer lives on the host (the ledger of
    :mod:`lightning_mem.offload`; on a CPU host and device are one memory) outside ``on_device``,
    returns to the student's device for the forward, and goes back after it. The output layer,
    which the student's loss reads, stays."""
    kd = _distillation(teacher_dir, "host")
    teacher = kd.teacher
    head = teacher.model.get_output_embeddings()
    parked = teacher._parked
    assert parked and all(head is not m and head not in list(m.modules()) for m in parked)
    parked_params = {id(p) for m in parked for p in m.parameters()}
    assert parked_params == {id(p) for p in teacher.model.parameters()} - {id(head.weight)}
    assert teacher.location == "host"
    assert all(set(module_residency(m).home.values()) == {CPU} for m in parked)  # they return to the student's device
    ids, mask, positions, _ = _batch()
    host_storage = [p.data_ptr() for m in parked for p in m.parameters()]
    seen, hidden = [], []
    for _ in range(2):
        with teacher.on_device():
            seen.append(teacher.location)
            hidden.append(teacher.hidden_states(ids, mask, positions))
        assert teacher.location == "host" and all(module_location(m) == "host" for m in parked)
        # Frozen: the host copy is kept, parking again drops the device one (no copy back, no new buffers).
        assert [p.data_ptr() for m in parked for p in m.parameters()] == host_storage
    assert seen == ["device", "device"] and torch.equal(hidden[0], hidden[1])
    assert hidden[0].shape == (positions.numel(), teacher.model.config.hidden_size) and not hidden[0].requires_grad


def _step(kd: LogitDistillation):
    """The SFT recipe's distilled loss and the student's gradients, from a seeded student."""
    torch.manual_seed(5)
    student = load_causal_lm(str(STUDENT), dtype="float32")
    ids, mask, positions, targets = _batch()
    teacher_hidden = kd.teacher_hidden(ids, mask, positions)
    scores = score_tokens(student, ids, mask, positions, targets, chunk_size=4,
                          extra=kd.in_forward(teacher_hidden, chunk_size=4))
    loss = kd.mix(-scores.logprobs.sum(), scores.extra.sum())
    loss.backward()
    return loss.detach(), [p.grad for p in student.parameters()]


@pytest.mark.parametrize("loss, top_k", [("forward_kl", None), ("jsd", 16)])
def test_resident_parked_and_own_device_teachers_give_the_same_loss_and_gradients(teacher_dir, loss, top_k):
    """``host`` and a device named by itself (here the CPU, the student's too) against ``device``."""
    resident_loss, resident_grads = _step(_distillation(teacher_dir, "device", loss=loss, top_k=top_k))
    assert resident_loss.item() > 0
    for placement in ("host", "cpu"):
        other_loss, other_grads = _step(_distillation(teacher_dir, placement, loss=loss, top_k=top_k))
        assert torch.equal(resident_loss, other_loss), placement
        assert all(torch.equal(a, b) for a, b in zip(resident_grads, other_grads)), placement


def test_the_distilled_loss_is_the_textbook_one(teacher_dir):
    """The recipe's path (the teacher's hidden rows, the student's beside its chunked cross-entropy,
    the sliced divergence) against both models' whole logits with plain autograd: the same loss
    and student gradients."""
    kd = _distillation(teacher_dir, "host", loss="jsd", beta=0.3, temperature=1.5, kd_ratio=0.7)
    loss, grads = _step(kd)
    torch.manual_seed(5)
    student = load_causal_lm(str(STUDENT), dtype="float32")
    ids, mask, positions, targets = _batch()
    rows = lambda logits: logits.reshape(-1, logits.shape[-1])[positions]  # noqa: E731
    with kd.teacher.on_device(), torch.no_grad():
        teacher_logits = rows(kd.teacher.model(input_ids=ids, attention_mask=mask).logits)
    student_logits = rows(student(input_ids=ids, attention_mask=mask).logits)
    ce = -torch.log_softmax(student_logits, -1).gather(-1, targets[:, None]).sum()
    divergence = reference_rows(student_logits, teacher_logits, Divergence("jsd", 0.3), temperature=1.5).sum()
    want = 0.3 * ce + 0.7 * divergence
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-5)
    for got, expected in zip(grads, [p.grad for p in student.parameters()]):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


def test_the_teachers_logprobs_are_its_log_softmax_at_the_targets(teacher_dir):
    """What on-policy distillation reads: ``[n]`` floats, equal to the whole logits' log-softmax."""
    kd = _distillation(teacher_dir, "host")
    ids, mask, positions, targets = _batch()
    with kd.teacher.on_device():
        got = kd.teacher.logprobs(ids, mask, positions, targets, chunk_size=5, temperature=2.0)
    with torch.no_grad():
        logits = kd.teacher.model(input_ids=ids, attention_mask=mask).logits
    want = torch.log_softmax(logits.reshape(-1, logits.shape[-1])[positions] / 2.0, -1).gather(-1, targets[:, None])[:, 0]
    assert got.shape == targets.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_an_on_policy_teacher_parks_whole_and_scores_with_its_own_output_layer(teacher_dir):
    """``output_layer_with_student=False`` (on-policy distillation reads log-probs only): every
    parameter parks, the output layer too, and :meth:`Teacher.logprobs` gives the resident values."""
    resident = Teacher(TeacherSettings(str(teacher_dir)))
    resident.load(student_device=CPU, compute_dtype=torch.float32, width=TOKENS)
    parked = Teacher(TeacherSettings(str(teacher_dir), placement="host"))
    parked.load(student_device=CPU, compute_dtype=torch.float32, width=TOKENS)
    assert {id(p) for m in parked._parked for p in m.parameters()} == {id(p) for p in parked.model.parameters()}
    ids, mask, positions, targets = _batch()
    with parked.on_device():
        got = parked.logprobs(ids, mask, positions, targets, chunk_size=3)
    assert parked.location == "host"
    assert torch.equal(got, resident.logprobs(ids, mask, positions, targets, chunk_size=3))


def test_held_models_finds_the_teacher_outside_the_module_tree(teacher_dir):
    class Owner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.student = nn.Linear(2, 2)
            self.distillation = _distillation(teacher_dir, "device")

    owner = Owner()
    assert held_models(owner) == [owner.distillation.teacher.model]
    assert not any(k.startswith("distillation") for k in owner.state_dict())  # never in a checkpoint


# -- vocabularies ------------------------------------------------------------------------------------


def test_the_same_tokenizer_is_shared_at_the_models_width(teacher_dir):
    shared = shared_vocabulary(str(STUDENT), str(teacher_dir))
    assert (shared.tokens, shared.student_rows, shared.teacher_rows, shared.width) == (TOKENS, TOKENS, TOKENS, TOKENS)


def test_a_padded_output_layer_is_cut_to_the_shared_width(tmp_path):
    """Qwen2.5-7B's 152,064 rows against 151,936: here a teacher of 320 rows on the 307-token
    tokenizer; the loss reads a view of its first 307 rows (no copy)."""
    padded = _save_model(tmp_path / "padded", seed=2, vocab_size=320)
    shared = shared_vocabulary(str(STUDENT), str(padded))
    assert (shared.student_rows, shared.teacher_rows, shared.width) == (TOKENS, 320, TOKENS)
    teacher = Teacher(TeacherSettings(str(padded)), output_layer_with_student=True)
    teacher.load(student_device=CPU, compute_dtype=torch.float32, width=shared.width)
    full = teacher.model.get_output_embeddings().weight
    assert full.shape[0] == 320
    cut = teacher.output_layer
    assert type(cut) is nn.Linear and cut.weight.shape == (TOKENS, full.shape[1])
    assert cut.weight.data_ptr() == full.data_ptr()


def _other_tokenizer(folder):
    """The tiny tokenizer with two ordinary tokens' ids swapped: the same size, another mapping."""
    folder.mkdir()
    shutil.copyfile(TINY_MODEL / "config.json", folder / "config.json")
    shutil.copyfile(TINY_MODEL / "tokenizer_config.json", folder / "tokenizer_config.json")
    data = json.loads((TINY_MODEL / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = [t for t, i in vocab.items() if i in (100, 101)]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (folder / "tokenizer.json").write_text(json.dumps(data))
    return folder


def test_another_tokenizer_is_refused_in_one_line_naming_both_models(tmp_path):
    other = _other_tokenizer(tmp_path / "other")
    assert len(load_tokenizer(str(other))) == TOKENS  # sizes alone would not tell
    with pytest.raises(SettingError) as error:
        shared_vocabulary(str(STUDENT), str(other), key="model.distillation.teacher.name_or_path")
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("`model.distillation.teacher.name_or_path`: the teacher")
    assert str(other) in message and str(STUDENT) in message and "id 100" in message
    assert "across tokenizers is not built" in message


def test_an_output_layer_narrower_than_the_tokenizer_is_refused(tmp_path):
    narrow = tmp_path / "narrow"
    narrow.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TINY_MODEL / name, narrow / name)
    config = json.loads((TINY_MODEL / "config.json").read_text())
    (narrow / "config.json").write_text(json.dumps({**config, "vocab_size": 300}))
    with pytest.raises(SettingError, match="has 307 tokens, but .* an output layer of 300 rows"):
        shared_vocabulary(str(STUDENT), str(narrow))


def test_bad_teacher_settings_name_their_key():
    with pytest.raises(SettingError, match=r"^`placement` must be 'device', 'host' or a device"):
        TeacherSettings(str(TINY_MODEL), placement="gpu7")
    with pytest.raises(SettingError, match=r"`dtype`: unknown dtype"):
        TeacherSettings(str(TINY_MODEL), dtype="bf17")
    with pytest.raises(SettingError, match=r"^`teacher.name_or_path`: model path"):
        DistillationSettings({"name_or_path": "./missing"})
    with pytest.raises(SettingError, match=r"^`top_k` must be"):
        DistillationSettings(TeacherSettings(str(TINY_MODEL)), top_k=0)


@pytest.mark.gpu
def test_a_parked_teacher_leaves_the_gpu_outside_its_forward(teacher_dir):
    """On CUDA: the parked parts' tensors are host tensors outside the forward and CUDA tensors in
    it; the output layer stays on the GPU throughout."""
    device = torch.device("cuda")
    kd = LogitDistillation(DistillationSettings(TeacherSettings(str(teacher_dir), placement="host")))
    kd.check(str(STUDENT))
    kd.teacher.load(student_device=device, compute_dtype=torch.float32, width=kd.vocabulary.width)
    head = kd.teacher.model.get_output_embeddings().weight
    body = [p for m in kd.teacher._parked for p in m.parameters()]
    assert head.device.type == "cuda" and all(p.device.type == "cpu" for p in body)
    ids, mask, positions, _ = (t.to(device) for t in _batch())
    with kd.teacher.on_device():
        assert all(p.device.type == "cuda" for p in body)
        hidden = kd.teacher.hidden_states(ids, mask, positions)
    assert hidden.device.type == "cuda" and all(p.device.type == "cpu" for p in body)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second CUDA device")
def test_a_teacher_on_a_device_of_its_own_sends_its_hidden_states_to_the_students(teacher_dir):
    """``placement: cuda:1``: the teacher's forward on the second device, its hidden states and a
    copy of its output layer on the student's; the loss equals a resident teacher's."""
    student_device = torch.device("cuda:0")
    kd = LogitDistillation(DistillationSettings(TeacherSettings(str(teacher_dir), placement="cuda:1")))
    kd.check(str(STUDENT))
    kd.teacher.load(student_device=student_device, compute_dtype=torch.float32, width=kd.vocabulary.width)
    assert next(kd.teacher.model.parameters()).device == torch.device("cuda:1")
    assert kd.teacher.output_layer.weight.device == student_device
    ids, mask, positions, _ = (t.to(student_device) for t in _batch())
    hidden = kd.teacher_hidden(ids, mask, positions)
    assert hidden.device == student_device
