"""On-policy distillation's parts (lightning_mem/rl/distillation.py): the reverse-KL advantage at
hand-worked values and how it joins GRPO's and GAE's advantages; the teacher's log-probs of sampled
tokens (a teacher equal to the student gives zero advantage, a padded output layer the unpadded
log-probs); another tokenizer refused in one line; the memory plan's teacher phase and the parked
teacher's place in each phase; the rules of a reward-free objective."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import recipes.ppo as ppo
from lightning_mem.models import load_causal_lm
from lightning_mem.offload import module_location
from lightning_mem.rl.algorithms import grpo_advantages
from lightning_mem.rl.config import GRPOConfig, KLConfig, PPOConfig
from lightning_mem.rl.distillation import OnPolicyDistillation, TeacherConfig, reverse_kl_advantages
from lightning_mem.rl.memory_plan import PhaseMemory, PhaseMemoryPlan, PhasePlacement
from lightning_mem.rl.rollout import GenerationConfig, RolloutEngine, policy_forward
from lightning_mem.settings import SettingError, settings_at
from recipes.rewards import ArithmeticReward
from tests.distillation.test_teacher import _other_tokenizer, _save_model
from tests.helpers import ARITH, TINY_MODEL

CPU = torch.device("cpu")
EOS, PAD = 1, 0


# -- the advantage -----------------------------------------------------------------------------------


def test_the_reverse_kl_advantage_at_hand_worked_values():
    student = torch.tensor([[-1.0, -2.0, -0.5], [-0.25, -3.0, -1.0]])
    teacher = torch.tensor([[-0.5, -3.0, -4.0], [-0.25, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    # coef * (log q - log p) per token, on the mask only, not summed over later tokens (discount 0).
    want = torch.tensor([[2 * 0.5, 2 * -1.0, 0.0], [0.0, 2 * 2.0, 0.0]])
    assert torch.equal(reverse_kl_advantages(student, teacher, mask, coef=2.0), want)


def _experience():
    """Two groups of four (as tests/recipes/test_ppo.py's GRPO case), with the behaviour policy's and
    a teacher's log-probs of each sampled token."""
    lengths = [2, 2, 2, 2, 2, 6, 6, 6]
    mask = torch.tensor([[1] * n + [0] * (6 - n) for n in lengths])
    torch.manual_seed(0)
    old = -torch.rand(8, 6) * 3 * mask
    teacher = -torch.rand(8, 6) * 3 * mask
    return SimpleNamespace(
        response_mask=mask, scores=torch.tensor([1.0, 1, 1, 1, 1, 0, 0, 0]),
        group_ids=torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]), old_logprobs=old, teacher_logprobs=teacher,
        ref_logprobs=None, engine_logprobs=None, loss_mask=None, correction_weights=None, sample_stats={}, sample_keep=None,
        old_values=torch.rand(8, 6) * mask,
    )


def _module(estimator: str, teacher: TeacherConfig | None, **kw) -> ppo.PPOModule:
    module = ppo.PPOModule(name_or_path=str(TINY_MODEL), reward=ArithmeticReward(), advantage_estimator=estimator,
                           grpo=GRPOConfig(group_size=4), kl=KLConfig(coef=0.0), teacher=teacher, **kw)
    module._sum_over_ranks = lambda value: value  # one process, no trainer attached
    return module


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_the_teachers_term_is_added_after_the_estimators_normalisation(estimator):
    """A_t = A_t^reward + coef * (log q - log p_old): GRPO's group-normalised advantage (and GAE's
    whitened one) exactly as without a teacher, plus the teacher's term as it is; GAE's returns
    (what the critic learns) are the reward's alone."""
    coef = 0.5
    plain, distilled = _experience(), _experience()
    _module(estimator, None).advantages(plain)
    _module(estimator, TeacherConfig(str(TINY_MODEL), coef=coef)).advantages(distilled)
    mask = plain.response_mask
    term = coef * (distilled.teacher_logprobs - distilled.old_logprobs) * mask
    torch.testing.assert_close(distilled.advantages, plain.advantages + term, rtol=0, atol=1e-7)
    if estimator == "grpo":  # the reward's part, by hand: the all-alike group 0, group 1 normalised
        torch.testing.assert_close(plain.advantages, grpo_advantages(plain.scores, plain.group_ids, mask))
    else:
        assert torch.equal(distilled.returns, plain.returns)
    log_ratio = ((distilled.old_logprobs - distilled.teacher_logprobs) * mask).sum()
    assert float(distilled.sample_stats["teacher_kl"]) == pytest.approx(float(log_ratio), rel=1e-6)
    assert "teacher_kl" not in plain.sample_stats


# -- the teacher's log-probs of sampled tokens -------------------------------------------------------


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return _save_model(tmp_path_factory.mktemp("teacher"), seed=1)


def _rollout(model_dir, n: int = 6):
    """Responses sampled from the model at ``model_dir`` to the first ``n`` arithmetic prompts."""
    from lightning_mem.data import PromptDataModule

    data = PromptDataModule(str(ARITH / "prompts.jsonl"), tokenizer=str(model_dir), batch_size=n, max_prompt_length=64)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    model = load_causal_lm(str(model_dir), dtype="float32").eval()
    torch.manual_seed(4)
    engine = RolloutEngine(GenerationConfig(max_new_tokens=5), eos_token_ids=[EOS], pad_token_id=PAD)
    return model, engine.generate(model, batch["input_ids"], batch["attention_mask"])


def _distillation(folder, **config) -> OnPolicyDistillation:
    distillation = OnPolicyDistillation(TeacherConfig(str(folder), **config))
    distillation.check(str(TINY_MODEL))
    distillation.teacher.load(student_device=CPU, compute_dtype=torch.float32, width=distillation.vocabulary.width)
    return distillation


def _score(distillation, exp, *, temperature=1.0, chunk_size=3, packed=False):
    halves = lambda lengths: [list(range(len(lengths)))[::2], list(range(len(lengths)))[1::2]]  # noqa: E731
    with distillation.teacher.on_device():
        distillation.score(exp, halves, temperature=temperature, chunk_size=chunk_size, packed=packed)
    return exp.teacher_logprobs


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_a_teacher_equal_to_the_student_gives_zero_advantage(teacher_dir, packed):
    """The student's behaviour log-probs (the actor's pass over its samples) and the teacher's of the
    same tokens, the teacher being the same weights: every advantage is 0, as is the KL estimate."""
    student, exp = _rollout(teacher_dir)
    with torch.no_grad():
        exp.old_logprobs = policy_forward(student, exp, temperature=0.7, chunk_size=4, packed=packed).logprobs
    distillation = _distillation(teacher_dir, placement="host")
    _score(distillation, exp, temperature=0.7, packed=packed)
    mask = exp.response_mask.bool()
    assert mask.sum() > 10 and bool((exp.teacher_logprobs[mask] < 0).all())
    torch.testing.assert_close(exp.teacher_logprobs, exp.old_logprobs, rtol=0, atol=1e-5)
    advantages = distillation.advantages(exp, torch.zeros_like(exp.old_logprobs))
    assert float(advantages.abs().max()) <= 1e-5 and abs(float(exp.sample_stats["teacher_kl"])) < 1e-4


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_the_teachers_top_k_and_the_students_divergence_from_it(teacher_dir, packed):
    """With ``top_k`` the teacher's phase keeps, at every sampled position, its ``k`` likeliest
    tokens' log-probs (over its whole vocabulary) and their ids, equal to a whole log-softmax of its
    logits; the update's divergence (``policy_forward``'s ``extra``, inside the student's forward,
    a vocabulary slice at a time) equals the one computed from both models' whole logits."""
    from lightning_mem.distillation.divergences import Divergence
    from lightning_mem.distillation.topk import top_k_divergence
    from lightning_mem.rl.rollout import gather_response

    student, exp = _rollout(TINY_MODEL)
    distillation = _distillation(teacher_dir, top_k=5, coef=0, divergence="jsd", beta=0.3)
    _score(distillation, exp, temperature=0.7, packed=packed)
    mask, width = exp.response_mask.bool(), exp.response_ids.shape[1]
    assert exp.teacher_topk_logprobs.shape == (*mask.shape, 5) and exp.teacher_topk_ids.dtype == torch.int32

    def logprobs(model):
        with torch.no_grad():
            logits = model(input_ids=exp.input_ids, attention_mask=exp.attention_mask).logits
        return torch.log_softmax(gather_response(logits, exp.prompt_lengths, width) / 0.7, -1)

    teacher = logprobs(distillation.teacher.model)
    top, ids = teacher.topk(5, dim=-1)
    assert torch.equal(exp.teacher_topk_ids[mask].long(), ids[mask])
    torch.testing.assert_close(exp.teacher_topk_logprobs[mask], top[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(exp.teacher_logprobs[mask], teacher.gather(-1, exp.response_ids[..., None])[..., 0][mask],
                               rtol=1e-5, atol=1e-5)
    dense = distillation.in_forward(exp, temperature=0.7, chunk_size=3)
    got = policy_forward(student, exp, temperature=0.7, chunk_size=3, packed=packed, extra=dense).extra
    want = top_k_divergence(logprobs(student).gather(-1, ids), top, Divergence("jsd", 0.3))
    assert mask.sum() > 10 and bool((want[mask] > 0).all())
    torch.testing.assert_close(got[mask], want[mask], rtol=1e-5, atol=1e-6)
    assert bool((got[~mask] == 0).all())
    assert OnPolicyDistillation(TeacherConfig(str(teacher_dir))).in_forward(exp, temperature=1.0, chunk_size=3) is None


def _padded_copy(source, folder, rows: int):
    """``source`` with ``rows`` output rows (and embeddings): its own rows as they are, the new ones
    large, so that a softmax over them would move every log-prob."""
    import shutil

    model = load_causal_lm(str(source), dtype="float32")
    width = model.config.vocab_size
    model.resize_token_embeddings(rows, mean_resizing=False)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head[width:] = torch.randn(rows - width, head.shape[1]) * 3
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copyfile(source / name, folder / name)
    return folder


def test_a_padded_output_layer_gives_the_unpadded_teachers_logprobs(teacher_dir, tmp_path):
    """Qwen2.5-7B's 152,064 rows against the 0.5B's 151,936, here 320 against 307: the padded
    teacher's log-probs are taken over the shared tokenizer's 307 rows, equal to the unpadded one's."""
    padded_dir = _padded_copy(teacher_dir, tmp_path / "padded", 320)
    _, exp = _rollout(TINY_MODEL)
    unpadded = _score(_distillation(teacher_dir), exp).clone()
    padded_teacher = _distillation(padded_dir)
    assert padded_teacher.vocabulary.teacher_rows == 320 and padded_teacher.vocabulary.width == 307
    padded = _score(padded_teacher, exp)
    torch.testing.assert_close(padded, unpadded, rtol=1e-6, atol=1e-6)
    # Over all 320 rows they would differ: the cut is what makes them equal.
    with torch.no_grad():
        logits = padded_teacher.teacher.model(input_ids=exp.input_ids, attention_mask=exp.attention_mask).logits
    first = int(exp.prompt_lengths[0]) - 1  # the position predicting sample 0's first response token
    whole = torch.log_softmax(logits[0, first], -1)[exp.response_ids[0, 0]]
    assert abs(float(whole) - float(unpadded[0, 0])) > 1e-2


def test_another_tokenizer_is_refused_in_one_line_naming_both_models(tmp_path):
    other = _other_tokenizer(tmp_path / "other")
    distillation = OnPolicyDistillation(TeacherConfig(str(other)))
    with pytest.raises(SettingError) as error, settings_at("model"):
        distillation.check(str(TINY_MODEL))
    message = str(error.value)
    assert "\n" not in message and message.startswith("`model.teacher.name_or_path`: the teacher")
    assert str(other) in message and str(TINY_MODEL) in message and "not built" in message


# -- the memory plan's teacher phase --------------------------------------------------------------


def test_the_teacher_phase_keeps_the_score_phases_placement_unless_the_plan_sets_its_own():
    plan = PhaseMemoryPlan(score=PhasePlacement(actor_optimizer="host", reference="host"))
    assert plan.placement("teacher") is plan.score
    assert plan.host_placements() == ["score.actor_optimizer", "score.reference"]  # no "teacher." copies
    own = PhaseMemoryPlan(teacher=PhasePlacement(actor_optimizer="host", reward_model="host"))
    own.validate()  # the teacher phase computes with none of the plan's components
    assert own.placement("teacher") is own.teacher
    assert own.host_placements() == ["teacher.actor_optimizer", "teacher.reward_model"]
    assert own.offloads_modules() == ["teacher.reward_model"]


@pytest.mark.parametrize("placement", ["host", "device"])
def test_a_parked_teacher_is_on_the_device_in_its_phase_only(teacher_dir, placement):
    """``placement: host``: the residency ledger says host in every phase but the teacher's, also
    after an exception inside it; ``device``: resident throughout. The plan's own components follow
    the teacher phase's placement (here the actor's optimizer state, parked in that phase only)."""
    distillation = _distillation(teacher_dir, placement=placement)
    model = distillation.teacher.model
    actor = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(actor.parameters())
    actor(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    plan = PhaseMemoryPlan(teacher=PhasePlacement(actor_optimizer="host"))
    memory = PhaseMemory(plan, actor_optimizer=optimizer, teacher=distillation.teacher)
    seen = {}
    for phase in ("rollout", "score", "teacher", "train"):
        with memory.phase(phase):
            seen[phase] = (module_location(model), memory.locations["actor_optimizer"])
    away = "host" if placement == "host" else "device"
    assert seen == {"rollout": (away, "device"), "score": (away, "device"), "teacher": ("device", "host"),
                    "train": (away, "device")}
    with pytest.raises(RuntimeError, match="simulated"), memory.phase("teacher"):
        raise RuntimeError("out of memory (simulated) in the teacher's forward")
    assert module_location(model) == away and memory.locations["actor_optimizer"] == "device"


# -- a reward-free objective ----------------------------------------------------------------------


def _build(**kw):
    return ppo.PPOModule(name_or_path=str(TINY_MODEL), **kw)


def test_the_teacher_alone_trains_without_a_reward_and_nothing_alone_is_refused():
    module = _build(reward=None, teacher=TeacherConfig(str(TINY_MODEL)), advantage_estimator="grpo")
    assert module.distillation is not None and not module.on_policy  # the behaviour log-probs are scored first
    with pytest.raises(SettingError, match=r"^set exactly one of `model.reward` \(a rule's class_path\) and `model.reward_model`"
                                           r" .*, or neither beside `model.teacher`; this config sets neither$"):
        _build(reward=None, advantage_estimator="grpo")


@pytest.mark.parametrize(("estimator", "settings", "message"), [
    ("gae", {}, r"^`model.advantage_estimator: gae` learns from the reward, and with `model.teacher` alone \(no"
                r" `model.reward` or `model.reward_model`\) every score is 0: use a critic-free estimator"),
    ("remax", {}, r"^`model.advantage_estimator: remax` learns from the reward"),
    ("grpo", {"ppo": PPOConfig(filter_groups=True)}, r"^`model.ppo.filter_groups: true` drops every group that scored"
                                                      r" alike, and with `model.teacher` alone"),
])
def test_a_reward_free_objective_refuses_what_learns_from_the_reward(estimator, settings, message):
    with pytest.raises(SettingError, match=message):
        _build(reward=None, teacher=TeacherConfig(str(TINY_MODEL)), advantage_estimator=estimator,
               generation=GenerationConfig(max_new_tokens=4), **settings)


def test_teacher_settings_name_their_keys():
    with pytest.raises(SettingError, match=r"^`model.teacher.coef` must be positive without `model.teacher.top_k`"
                                           r" \(then the one-sample advantage is the teacher's only signal\), got 0$"):
        _build(reward=None, teacher={"name_or_path": str(TINY_MODEL), "coef": 0}, advantage_estimator="grpo")
    with pytest.raises(SettingError, match=r"^`model.teacher.coef` must be >= 0, got -1"):
        _build(reward=None, teacher={"name_or_path": str(TINY_MODEL), "coef": -1, "top_k": 4}, advantage_estimator="grpo")
    with pytest.raises(SettingError, match=r"^`model.teacher.divergence` must be 'forward_kl', 'reverse_kl' or 'jsd', got 'kl'$"):
        _build(reward=None, teacher={"name_or_path": str(TINY_MODEL), "top_k": 4, "divergence": "kl"},
               advantage_estimator="grpo")
    with pytest.raises(SettingError, match=r"^`model.teacher.top_k` must be positive or null, got 0$"):
        _build(reward=None, teacher={"name_or_path": str(TINY_MODEL), "top_k": 0}, advantage_estimator="grpo")
    with pytest.raises(SettingError, match=r"^`model.teacher.placement` must be 'device', 'host' or a device"):
        _build(reward=None, teacher={"name_or_path": str(TINY_MODEL), "placement": "gpu7"}, advantage_estimator="grpo")
