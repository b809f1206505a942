"""The preference losses at hand-worked values (each expected number from its formula in plain
`math`), the reference-free ones without a reference, weighted mixtures, gradients, metrics and the
settings' one-line errors."""

from __future__ import annotations

import math

import pytest
import torch
from jsonargparse import ArgumentParser

from lightning_mem.cli import check_setting_groups
from lightning_mem.preference_losses import (
    LOSS_TYPES,
    REFERENCE_FREE,
    PreferenceLossSettings,
    SequenceLogps,
    preference_loss,
    preference_metrics,
)
from lightning_mem.settings import SettingError, settings_at

LN2 = math.log(2)


def softplus(x: float) -> float:
    """-log sigma(-x) = log(1 + e^x)."""
    return math.log1p(math.exp(x))


def nls(x: float) -> float:
    """-log sigma(x)."""
    return softplus(-x)


def sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def side(sums, tokens=None) -> SequenceLogps:
    sums = torch.tensor(sums, dtype=torch.float32)
    tokens = torch.ones(len(sums), dtype=torch.long) if tokens is None else torch.tensor(tokens)
    return SequenceLogps(sums, tokens)


def ratios(chosen, rejected, tokens_c=None, tokens_r=None):
    """Policy and reference sides whose summed log-ratios are ``chosen`` and ``rejected``: the
    reference sits at -20 per sequence, the policy at -20 + ratio."""
    n = len(chosen)
    return (side([-20.0 + d for d in chosen], tokens_c), side([-20.0 + d for d in rejected], tokens_r),
            side([-20.0] * n, tokens_c), side([-20.0] * n, tokens_r))


def losses(settings, *sides):
    return preference_loss(settings, *sides).pair_losses


def close(actual: torch.Tensor, expected) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float32), rtol=1e-5, atol=1e-6)


def random_sides(batch=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    sums = [-(torch.rand(batch, generator=g) * 30 + 2) for _ in range(4)]
    tokens = [torch.randint(1, 40, (batch,), generator=g) for _ in range(2)]
    return (SequenceLogps(sums[0], tokens[0]), SequenceLogps(sums[1], tokens[1]),
            SequenceLogps(sums[2], tokens[0]), SequenceLogps(sums[3], tokens[1]))


# --- DPO's sigmoid and cDPO -------------------------------------------------------------------


def test_sigmoid_with_the_policy_at_the_reference_is_ln2_with_zero_rewards():
    pc, pr = side([-12.0, -30.0], [4, 9]), side([-15.0, -7.0], [5, 2])
    out = preference_loss(PreferenceLossSettings(), pc, pr, pc, pr)
    close(out.pair_losses, [LN2, LN2])
    close(out.chosen_rewards, [0.0, 0.0])
    close(out.rejected_rewards, [0.0, 0.0])
    assert out.nll_weight == 0.0


def test_sigmoid_matches_torchtunes_hand_values():
    # torchtune's DPO test: beta 0.1, margins 0, 10, 20
    out = losses(PreferenceLossSettings(beta=0.1), *ratios([0.0, 10.0, 20.0], [0.0, 0.0, 0.0]))
    torch.testing.assert_close(out, torch.tensor([0.693147, 0.313262, 0.126928]), rtol=0, atol=1e-6)


def test_cdpo_smoothing_mixes_in_the_flipped_label():
    # x = beta * D = 1: (1 - eps) * -log s(1) + eps * -log s(-1); at x = 0 both are ln 2
    out = losses(PreferenceLossSettings(label_smoothing=0.1), *ratios([10.0, 0.0], [0.0, 0.0]))
    close(out, [0.9 * nls(1.0) + 0.1 * nls(-1.0), LN2])
    # nls(-1) - nls(1) = 1 exactly, so the smoothed loss is 0.1 above the plain one
    assert out[0].item() == pytest.approx(nls(1.0) + 0.1, abs=1e-6)


def test_sigmoid_norm_divides_each_log_ratio_by_its_tokens():
    # Dc = 8 over 4 tokens, Dr = -6 over 3 tokens: beta * (2 - -2) = 0.4
    out = losses(PreferenceLossSettings(loss_type="sigmoid_norm"), *ratios([8.0], [-6.0], [4], [3]))
    close(out, [nls(0.4)])


# --- the rest of TRL DPOTrainer's menu ---------------------------------------------------------


def test_ipo_squares_the_per_token_mean_margin_not_the_sum():
    # Dc = 4 over 4 tokens (mean 1), Dr = -2 over 2 tokens (mean -1): margin 2; 1 / (2 beta) = 1
    out = losses(PreferenceLossSettings(loss_type="ipo", beta=0.5), *ratios([4.0], [-2.0], [4], [2]))
    close(out, [(2.0 - 1.0) ** 2])  # with sums it would be (6 - 1)^2 = 25


def test_hinge():
    out = losses(PreferenceLossSettings(loss_type="hinge"), *ratios([5.0, 10.0, 20.0], [0.0, 0.0, 0.0]))
    close(out, [0.5, 0.0, 0.0])


def test_robust_is_unbiased_for_the_flip_rate():
    eps = 0.2
    out = losses(PreferenceLossSettings(loss_type="robust", label_smoothing=eps), *ratios([10.0], [0.0]))
    close(out, [((1 - eps) * nls(1.0) - eps * nls(-1.0)) / (1 - 2 * eps)])


def test_exo_pair_is_the_kl_to_the_smoothed_label():
    eps = 1e-3
    out = losses(PreferenceLossSettings(loss_type="exo_pair", label_smoothing=eps), *ratios([0.0, 10.0], [0.0, 0.0]))
    at_zero = 0.5 * (math.log(0.5) - math.log(1 - eps)) + 0.5 * (math.log(0.5) - math.log(eps))
    at_one = sig(1) * (math.log(sig(1)) - math.log(1 - eps)) + sig(-1) * (math.log(sig(-1)) - math.log(eps))
    close(out, [at_zero, at_one])


def test_bco_pair_has_no_reward_shift_and_reads_its_own_pair_only():
    # Decision (docs/dpo.md): TRL since its DPO refactor uses delta = 0; TRL <= 0.28 shifted by a
    # running mean of the batch rewards. Here a pair's loss is the same alone or among others.
    s = PreferenceLossSettings(loss_type="bco_pair")
    close(losses(s, *ratios([10.0, 0.0], [-10.0, 0.0])), [2 * nls(1.0), 2 * LN2])
    alone = losses(s, *ratios([10.0], [-10.0]))
    among = losses(s, *ratios([10.0, 300.0, -250.0], [-10.0, 200.0, 40.0]))
    assert alone[0].item() == among[0].item()


def test_nca_pair():
    out = losses(PreferenceLossSettings(loss_type="nca_pair"), *ratios([10.0], [-10.0]))
    close(out, [nls(1.0) + 0.5 * nls(-1.0) + 0.5 * nls(1.0)])


def test_sppo_hard_pulls_the_log_ratios_to_plus_minus_half_over_beta():
    out = losses(PreferenceLossSettings(loss_type="sppo_hard", beta=0.5), *ratios([3.0], [-2.0]))
    close(out, [(3 - 1) ** 2 + (-2 + 1) ** 2])


def test_apo_zero_and_apo_down():
    out = losses(PreferenceLossSettings(loss_type="apo_zero"), *ratios([0.0, 10.0], [0.0, -10.0]))
    close(out, [1.0, 1 - sig(1) + sig(-1)])
    out = losses(PreferenceLossSettings(loss_type="apo_down"), *ratios([10.0], [10.0]))
    close(out, [sig(1) + 1 - sig(0)])


def test_discopop_blends_logistic_and_exponential():
    tau = 0.05
    out = losses(PreferenceLossSettings(loss_type="discopop"), *ratios([0.0, 10.0], [0.0, 0.0]))
    blend = [nls(x) * (1 - sig(x / tau)) + math.exp(-x) * sig(x / tau) for x in (0.0, 1.0)]
    close(out, blend)
    assert blend[0] == pytest.approx(0.5 * LN2 + 0.5)


def test_discopop_stays_finite_where_exp_overflows():
    # beta * D = -100: exp(100) * sigma(-2000) is inf * 0 written as a product; the loss is the
    # logistic branch, -log sigma(-100) ~ 100
    pc, pr, rc, rr = ratios([-1000.0], [0.0])
    pc.sums.requires_grad_(True)
    out = preference_loss(PreferenceLossSettings(loss_type="discopop"), pc, pr, rc, rr)
    out.pair_losses.sum().backward()
    assert out.pair_losses.item() == pytest.approx(100.0, rel=1e-6)
    assert pc.sums.grad.item() == pytest.approx(-0.1, rel=1e-5)  # d/dS_c of -log s(0.1 S_c) at far left


def test_aot_compares_sorted_margins_over_the_micro_batch():
    # policy margins (S_c - S_r) 3 and -1, reference margins 0 and 2, beta 1:
    # sorted [-1, 3] - [0, 2] = [-1, 1] (pair by pair it would be [3, -3])
    pc, pr = side([-10.0, -12.0]), side([-13.0, -11.0])
    rc, rr = side([-10.0, -10.0]), side([-10.0, -12.0])
    out = losses(PreferenceLossSettings(loss_type="aot", beta=1.0), pc, pr, rc, rr)
    close(out, [nls(-1.0), nls(1.0)])
    # one pair: nothing to sort, it is DPO's sigmoid
    one = [SequenceLogps(x.sums[:1], x.tokens[:1]) for x in (pc, pr, rc, rr)]
    close(losses(PreferenceLossSettings(loss_type="aot", beta=1.0), *one), [nls(3.0)])


def test_aot_unpaired_sorts_chosen_and_rejected_log_ratios_apart():
    out = losses(PreferenceLossSettings(loss_type="aot_unpaired", beta=1.0), *ratios([2.0, -1.0], [0.0, 3.0]))
    close(out, [nls(-1.0), nls(-1.0)])  # [-1, 2] - [0, 3]


# --- reference-free: SimPO, ORPO, SFT ----------------------------------------------------------


def test_simpo_on_mean_logps_with_its_margin_and_no_reference():
    s = PreferenceLossSettings(loss_type="simpo", beta=2.0, gamma=0.5)
    assert not s.needs_reference
    pc, pr = side([-4.0], [4]), side([-6.0], [3])  # means -1 and -2
    out = preference_loss(s, pc, pr, None, None)
    close(out.pair_losses, [nls(2.0 * (-1 + 2) - 0.5)])
    close(out.chosen_rewards, [-2.0])  # beta * mean, TRL CPOTrainer's rewards
    close(out.rejected_rewards, [-4.0])
    ignored = preference_loss(s, pc, pr, side([-100.0], [4]), side([3.0], [3]))
    assert torch.equal(ignored.pair_losses, out.pair_losses)
    assert PreferenceLossSettings(loss_type="simpo").beta == 0.1  # TRL CPOConfig's default


def test_orpo_is_nll_plus_lambda_log_odds_ratio_of_means_in_fp32():
    s = PreferenceLossSettings(loss_type="orpo", orpo_lambda=0.1)
    assert not s.needs_reference
    # chosen mean log 1/2 (odds 1), rejected mean log 1/4 (odds 1/3): log odds ratio ln 3,
    # -lambda * log sigma(ln 3) = lambda * ln(4/3)
    pc = SequenceLogps(torch.tensor([3 * math.log(0.5)], dtype=torch.bfloat16), torch.tensor([3]))
    pr = SequenceLogps(torch.tensor([2 * math.log(0.25)], dtype=torch.float64), torch.tensor([2]))
    out = preference_loss(s, pc, pr, None, None)
    assert out.pair_losses.dtype == torch.float32
    mean_c = float(torch.tensor(3 * math.log(0.5), dtype=torch.bfloat16)) / 3  # bf16 holds the sum, not exactly
    log_odds = (mean_c - math.log(0.25)) - (math.log1p(-math.exp(mean_c)) - math.log1p(-0.25))
    close(out.pair_losses, [0.1 * nls(log_odds)])
    assert 0.1 * nls(math.log(3)) == pytest.approx(0.1 * math.log(4 / 3))
    assert out.nll_weight == 1.0
    close(out.chosen_rewards, [0.1 * mean_c])
    with_ref = preference_loss(s, pc, pr, side([0.0]), side([0.0]))
    assert torch.equal(with_ref.pair_losses, out.pair_losses)


def test_orpo_at_a_certain_sequence_is_finite():
    s = PreferenceLossSettings(loss_type="orpo")
    pc = SequenceLogps(torch.tensor([0.0], requires_grad=True), torch.tensor([5]))
    out = preference_loss(s, pc, side([-3.0], [3]), None, None)
    out.pair_losses.sum().backward()
    assert torch.isfinite(out.pair_losses).all() and torch.isfinite(pc.sums.grad).all()


def test_sft_is_a_coefficient_on_the_recipes_nll():
    s = PreferenceLossSettings(loss_type="sft")
    assert not s.needs_reference
    out = preference_loss(s, side([-3.0, -4.0], [2, 2]), side([-5.0, -1.0], [1, 1]), None, None)
    close(out.pair_losses, [0.0, 0.0])
    assert out.nll_weight == 1.0
    # RPO: DPO plus alpha times the NLL
    rpo = PreferenceLossSettings(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5])
    out = preference_loss(rpo, *ratios([10.0], [0.0]))
    close(out.pair_losses, [nls(1.0)])
    assert out.nll_weight == 0.5


# --- mixtures (MPO), gradients, metrics ---------------------------------------------------------


def test_weighted_types_are_the_weighted_sum_of_each_alone():
    sides = random_sides()
    mix = PreferenceLossSettings(loss_type=["sigmoid", "bco_pair", "sft", "ipo", "simpo", "orpo"],
                                 loss_weights=[0.8, 0.2, 1.0, 0.3, 0.5, 2.0], label_smoothing=0.05)
    assert mix.needs_reference  # a reference-free loss mixed with one that reads a reference
    out = preference_loss(mix, *sides)
    expected = torch.zeros(6)
    for name, weight in zip(mix.loss_types, mix.weights):
        alone = PreferenceLossSettings(loss_type=name, label_smoothing=0.05 if name in ("sigmoid", "simpo") else 0.0)
        expected += weight * losses(alone, *sides)
    torch.testing.assert_close(out.pair_losses, expected)
    assert out.nll_weight == pytest.approx(1.0 + 2.0)  # sft's and orpo's
    # with a reference read, the rewards are DPO's: beta times the summed log-ratio
    torch.testing.assert_close(out.chosen_rewards, 0.1 * (sides[0].sums - sides[2].sums))
    mpo = PreferenceLossSettings(loss_type=["sigmoid", "bco_pair", "sft"], loss_weights=[0.8, 0.2, 1])
    assert mpo.weights == (0.8, 0.2, 1.0) and preference_loss(mpo, *sides).nll_weight == 1.0


@pytest.mark.parametrize("name", [n for n in LOSS_TYPES if n != "sft"])
def test_gradients_reach_the_policy_and_never_the_reference(name):
    pc, pr, rc, rr = random_sides()
    for x in (pc, pr, rc, rr):
        x.sums.requires_grad_(True)
    s = PreferenceLossSettings(loss_type=name, label_smoothing=0.1 if name == "exo_pair" else 0.0)
    out = preference_loss(s, pc, pr, rc, rr)
    out.pair_losses.sum().backward()
    assert rc.sums.grad is None and rr.sums.grad is None
    assert pc.sums.grad.abs().sum() > 0 and pr.sums.grad.abs().sum() > 0
    assert not out.chosen_rewards.requires_grad and not out.rejected_rewards.requires_grad


def test_sigmoid_gradient_at_the_reference_is_half_beta():
    # d/dS_c of -log s(beta D) = -beta * s(-beta D) = -0.05 at D = 0; +0.05 for rejected
    pc, pr, rc, rr = ratios([0.0], [0.0])
    pc.sums.requires_grad_(True), pr.sums.requires_grad_(True)
    preference_loss(PreferenceLossSettings(), pc, pr, rc, rr).pair_losses.sum().backward()
    close(pc.sums.grad, [-0.05])
    close(pr.sums.grad, [0.05])


def test_metrics_under_trls_names_with_strict_accuracy():
    # rewards (beta 0.1): chosen 1.0, 0.5, 0.0 against rejected 0.0, 0.5 (a tie), 2.0
    pc, pr, rc, rr = ratios([10.0, 5.0, 0.0], [0.0, 5.0, 20.0])
    pc.sums.requires_grad_(True)
    out = preference_loss(PreferenceLossSettings(), pc, pr, rc, rr)
    metrics = preference_metrics(out, pc, pr)
    assert set(metrics) == {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                            "logps/chosen", "logps/rejected"}
    assert all(m.dim() == 0 and not m.requires_grad for m in metrics.values())
    expected = {"rewards/chosen": 0.5, "rewards/rejected": 2.5 / 3, "rewards/accuracies": 1 / 3,
                "rewards/margins": (1.0 + 0.0 - 2.0) / 3, "logps/chosen": (-10 - 15 - 20) / 3,
                "logps/rejected": (-20 - 15 + 0) / 3}
    for key, value in expected.items():
        assert metrics[key].item() == pytest.approx(value, abs=1e-6), key


def test_missing_reference_is_one_line_naming_the_loss_types():
    with pytest.raises(SettingError, match=r"`model\.dpo\.loss_type` \['sigmoid'\] compare the policy with a reference"):
        with settings_at("model.dpo"):
            preference_loss(PreferenceLossSettings(loss_type=["sigmoid", "sft"]), side([-1.0]), side([-2.0]), None, None)


# --- settings ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"loss_type": "dpo"}, r"`dpo\.loss_type` must be one of sigmoid, sigmoid_norm, hinge, .*, simpo, orpo .* got unknown 'dpo'"),
    ({"loss_type": []}, r"`dpo\.loss_type` must be one of .* got an empty list"),
    ({"loss_type": 3}, r"`dpo\.loss_type` must be a name or a list of names, got 3"),
    ({"loss_type": ["sigmoid", "sigmoid"]}, r"`dpo\.loss_type` lists 'sigmoid' twice"),
    ({"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0]}, r"`dpo\.loss_weights` needs one weight per `dpo\.loss_type` entry \(2\), got 1"),
    ({"loss_weights": [-1.0]}, r"`dpo\.loss_weights` must be finite numbers >= 0, got -1.0"),
    ({"beta": 0.0}, r"`dpo\.beta` must be positive, got 0.0"),
    ({"beta": -0.1}, r"`dpo\.beta` must be positive"),
    ({"label_smoothing": 0.5}, r"`dpo\.label_smoothing` must be in \[0, 0.5\), got 0.5"),
    ({"label_smoothing": -0.1}, r"`dpo\.label_smoothing` must be in \[0, 0.5\)"),
    ({"loss_type": "exo_pair"}, r"`dpo\.label_smoothing` must be above 0 with `dpo\.loss_type` exo_pair"),
    ({"loss_type": "hinge", "label_smoothing": 0.1}, r"`dpo\.label_smoothing` is read by sigmoid, .*; `dpo\.loss_type` \['hinge'\] reads none"),
])
def test_bad_settings_name_their_key(kwargs, message):
    with pytest.raises(SettingError, match=message):
        with settings_at("dpo"):
            PreferenceLossSettings(**kwargs)


def test_needs_reference_only_without_a_reference_free_only_list():
    assert set(REFERENCE_FREE) == {"sft", "simpo", "orpo"}
    assert not PreferenceLossSettings(loss_type=["simpo", "sft", "orpo"]).needs_reference
    assert PreferenceLossSettings(loss_type=["orpo", "apo_zero"]).needs_reference
    assert all(PreferenceLossSettings(loss_type=n, label_smoothing=0.1 if n == "exo_pair" else 0.0).needs_reference
               for n in LOSS_TYPES if n not in REFERENCE_FREE)


class _Module:  # a recipe's constructor as the CLI sees it
    def __init__(self, dpo: PreferenceLossSettings = PreferenceLossSettings()) -> None:
        self.dpo = dpo


def test_the_settings_parse_from_yaml_keys_and_errors_name_the_full_key():
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(_Module, "model")
    config = parser.parse_args(["--model.dpo.loss_type", "[sigmoid, sft]", "--model.dpo.loss_weights", "[1, 0.5]",
                                "--model.dpo.label_smoothing", "0.1"])
    check_setting_groups(_Module, config.model, "model")
    built = parser.instantiate(config).model.dpo
    assert built.loss_types == ("sigmoid", "sft") and built.weights == (1.0, 0.5) and built.label_smoothing == 0.1
    bad = parser.parse_args(["--model.dpo.loss_type", "[sigmoid, simpo]", "--model.dpo.loss_weights", "[1]"])
    with pytest.raises(SettingError, match=r"^`model\.dpo\.loss_weights` needs one weight per `model\.dpo\.loss_type`"):
        check_setting_groups(_Module, bad.model, "model")
