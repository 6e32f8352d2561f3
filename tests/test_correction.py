"""Rollout-mismatch corrections: hand-computed weights and diagnostics, and the AIS properties."""
import math

import pytest
import torch

from dllm_ais.choices import ALPHA_RULES, CORRECTION_METHODS
from dllm_ais.config import CorrectionSettings, GRPOConfig
from dllm_ais.correction import (
    RolloutCorrection,
    acr_clip_scale,
    ais_weights,
    correct,
    gate_alpha,
    importance_weights,
    log_importance_ratio,
    logged_name,
    oracle_alpha,
    perplexity_diagnostics,
    ratio_diagnostics,
)
from dllm_ais.loss import TokenLoss, grpo_loss


def logps_with_ratios(ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp_old, logp_rollout) whose token ratios exp(ℓ_old − ℓ_ro) are `ratios`."""
    logp_old = torch.tensor(ratios).log() - 1.0
    return logp_old, torch.full_like(logp_old, -1.0)


def constant_rule(alpha: float):
    def rule(diagnostics: dict[str, float]) -> float:
        return alpha

    return rule


@pytest.fixture
def mismatched_batch():
    """Random log-probs with an FP8-sized-or-larger mismatch, ragged mask, random advantages."""
    generator = torch.Generator().manual_seed(0)
    batch, length = 4, 7
    logp_old = -1.0 - torch.rand(batch, length, generator=generator)
    logp_rollout = logp_old + 0.6 * torch.randn(batch, length, generator=generator)
    lengths = torch.tensor([7, 3, 5, 1])
    mask = torch.arange(length) < lengths.unsqueeze(1)
    advantages = torch.randn(batch, generator=generator)
    return logp_old, logp_rollout, advantages, mask


# ----------------------------------------------------------------------------- log ratio
def test_log_ratio_clamps_and_zeroes_invalid_positions_even_with_garbage():
    logp_old = torch.tensor([[0.0, 0.0, 0.0, float("nan")]])
    logp_rollout = torch.tensor([[-0.5, -30.0, 30.0, float("-inf")]])
    mask = torch.tensor([[1, 1, 1, 0]])
    log_ratio = log_importance_ratio(logp_old, logp_rollout, mask)
    assert log_ratio.dtype == torch.float32 and not log_ratio.requires_grad
    torch.testing.assert_close(log_ratio, torch.tensor([[0.5, 20.0, -20.0, 0.0]]))


def test_log_ratio_rejects_nan_at_valid_tokens():
    logp_old = torch.tensor([[0.0, float("nan")]])
    with pytest.raises(ValueError, match="NaN"):
        log_importance_ratio(logp_old, torch.zeros(1, 2), torch.ones(1, 2))


def test_shape_mismatch_is_reported():
    with pytest.raises(ValueError, match="shape"):
        log_importance_ratio(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))


# ----------------------------------------------------------------------------- diagnostics
def test_ratio_diagnostics_match_hand_computation():
    logp_old, logp_rollout = logps_with_ratios([[0.5, 2.0, 7.0], [3.0, 1.0, 1.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # the empty sequence counts nowhere
    ratios = [0.5, 2.0, 3.0]
    clamped = [0.5, 2.0, 2.0]  # verl: std and ESS of the ratios clamped to [1/C, C], C = 2
    n = len(ratios)
    clamped_mean = sum(clamped) / n
    expected = {
        "rollout_is_min": 0.5,
        "rollout_is_mean": sum(ratios) / n,
        "rollout_is_max": 3.0,
        "rollout_is_std": math.sqrt(sum((r - clamped_mean) ** 2 for r in clamped) / n),
        "rollout_is_eff_sample_size": sum(clamped) ** 2 / (n * sum(r * r for r in clamped)),
        "rollout_is_ratio_fraction_high": 1 / 3,
        "rollout_is_ratio_fraction_low": 0.0,  # 0.5 is not below 1/C
        "k3_kl": sum(r - math.log(r) - 1 for r in ratios) / n,
        "kl": sum(-math.log(r) for r in ratios) / n,
        "chi2_token": sum(r * r for r in ratios) / n - 1,
        "chi2_seq": ((0.5 * 2.0) ** 2 + 3.0**2) / 2 - 1,
        "sampling_logp_difference/mean": sum(abs(math.log(r)) for r in ratios) / n,
        "sampling_logp_difference/max": math.log(3.0),
    }
    diagnostics = ratio_diagnostics(log_importance_ratio(logp_old, logp_rollout, mask), mask)
    assert set(diagnostics) == set(expected)
    for key, value in expected.items():
        assert diagnostics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
        assert isinstance(diagnostics[key], float)


def test_perplexities_are_verls_per_sequence_means():
    logp_old = torch.tensor([[-1.0, -3.0, 9.0], [-0.5, float("nan"), 0.0]])
    logp_rollout = torch.tensor([[-2.0, -2.0, 9.0], [-1.5, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    diagnostics = perplexity_diagnostics(logp_old, logp_rollout, mask)
    # per sequence: mean ℓ_old = -2, -0.5; mean ℓ_ro = -2, -1.5
    assert diagnostics["training_ppl"] == pytest.approx((math.exp(2.0) + math.exp(0.5)) / 2)
    assert diagnostics["rollout_ppl"] == pytest.approx((math.exp(2.0) + math.exp(1.5)) / 2)
    assert diagnostics["ppl_ratio"] == pytest.approx((1.0 + math.exp(-1.0)) / 2)  # training / rollout, as verl
    assert perplexity_diagnostics(logp_old, logp_rollout, torch.zeros(2, 3)) == {
        "training_ppl": 1.0, "rollout_ppl": 1.0, "ppl_ratio": 1.0}


def test_ratio_diagnostics_of_an_empty_mask_are_neutral():
    diagnostics = ratio_diagnostics(torch.randn(2, 3), torch.zeros(2, 3, dtype=torch.bool))
    assert all(math.isfinite(value) for value in diagnostics.values())
    assert diagnostics["rollout_is_mean"] == diagnostics["rollout_is_eff_sample_size"] == 1.0
    assert diagnostics["k3_kl"] == diagnostics["kl"] == diagnostics["chi2_seq"] == 0.0


def test_chi2_seq_stays_finite_for_huge_sequence_ratios():
    mask = torch.ones(1, 50)
    log_ratio = log_importance_ratio(torch.full((1, 50), 15.0), torch.zeros(1, 50), mask)
    diagnostics = ratio_diagnostics(log_ratio, mask)  # Σ log ρ = 750, clamped to 20
    assert diagnostics["chi2_seq"] == pytest.approx(math.exp(40.0) - 1, rel=1e-4)


# ----------------------------------------------------------------------------- TIS / MIS
RATIOS_ONE_SEQUENCE = [[0.5, 1.5, 3.0, 9.0]]
MASK_ONE_SEQUENCE = torch.tensor([[1, 1, 1, 0]])


@pytest.mark.parametrize(
    "mode, clip_low, expected_weights, low, masked",
    [
        ("truncate", None, [0.5, 1.5, 2.0, 0.0], 0.0, None),  # TIS (verl's lower threshold 1/C = 0.5)
        ("truncate", 0.8, [0.8, 1.5, 2.0, 0.0], 1 / 3, None),  # TIS with lower bound
        ("mask", None, [0.5, 1.5, 0.0, 0.0], 0.0, 1 / 3),  # MIS
        ("mask", 0.6, [0.0, 1.5, 0.0, 0.0], 1 / 3, 2 / 3),  # MIS with lower bound
    ],
)
def test_token_level_weights_by_hand(mode, clip_low, expected_weights, low, masked):
    logp_old, logp_rollout = logps_with_ratios(RATIOS_ONE_SEQUENCE)
    weights, diagnostics = importance_weights(
        logp_old, logp_rollout, MASK_ONE_SEQUENCE, mode=mode, clip=2.0, clip_low=clip_low
    )
    torch.testing.assert_close(weights, torch.tensor([expected_weights]))
    assert weights.dtype == torch.float32
    assert diagnostics["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3)
    assert diagnostics["rollout_is_ratio_fraction_low"] == pytest.approx(low)
    assert diagnostics.get("rollout_rs_masked_fraction") == (None if masked is None else pytest.approx(masked))
    applied = expected_weights[:3]
    assert diagnostics["importance_sampling_ratio/min"] == pytest.approx(min(applied))
    assert diagnostics["importance_sampling_ratio/mean"] == pytest.approx(sum(applied) / 3)
    assert diagnostics["importance_sampling_ratio/max"] == pytest.approx(max(applied))
    assert diagnostics["rollout_is_max"] == pytest.approx(3.0)  # pre-truncation


def test_sequence_level_weights_by_hand():
    # sequence ratios: 2 · 0.75 = 1.5; 3 · 1 = 3; 0.5 (second token invalid)
    logp_old, logp_rollout = logps_with_ratios([[2.0, 0.75], [3.0, 1.0], [0.5, 5.0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 0]])
    weights, diagnostics = importance_weights(logp_old, logp_rollout, mask, level="sequence")
    torch.testing.assert_close(weights, torch.tensor([[1.5, 1.5], [2.0, 2.0], [0.5, 0.0]]))
    assert diagnostics["rollout_is_ratio_fraction_high"] == pytest.approx(2 / 5)  # at the sequence level
    assert diagnostics["rollout_is_max"] == pytest.approx(3.0) and diagnostics["rollout_is_min"] == pytest.approx(0.5)
    weights, diagnostics = importance_weights(
        logp_old, logp_rollout, mask, level="sequence", mode="mask", clip_low=0.6
    )
    torch.testing.assert_close(weights, torch.tensor([[1.5, 1.5], [0.0, 0.0], [0.0, 0.0]]))
    assert diagnostics["rollout_rs_masked_fraction"] == pytest.approx(3 / 5)


def test_geometric_level_weights_by_hand():
    # geometric means: sqrt(4 · 1) = 2 (kept), cube root(2 · 4 · 8) = 4 (truncated to 3)
    logp_old, logp_rollout = logps_with_ratios([[4.0, 1.0, 8.0], [2.0, 4.0, 8.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    weights, diagnostics = importance_weights(logp_old, logp_rollout, mask, level="geometric", clip=3.0)
    torch.testing.assert_close(weights, torch.tensor([[2.0, 2.0, 0.0], [3.0, 3.0, 3.0]]))
    assert diagnostics["rollout_is_ratio_fraction_high"] == pytest.approx(3 / 5)


def test_sequence_level_product_is_computed_in_log_space():
    logp_old = torch.full((1, 10), 15.0)  # Σ log ρ = 150, far beyond float range once exponentiated
    mask = torch.ones(1, 10)
    truncated, _ = importance_weights(logp_old, torch.zeros(1, 10), mask, level="sequence")
    masked, _ = importance_weights(logp_old, torch.zeros(1, 10), mask, level="sequence", mode="mask")
    torch.testing.assert_close(truncated, torch.full((1, 10), 2.0))
    torch.testing.assert_close(masked, torch.zeros(1, 10))


def test_normalize_rescales_to_unit_mean_over_valid_tokens():
    logp_old, logp_rollout = logps_with_ratios(RATIOS_ONE_SEQUENCE)
    weights, diagnostics = importance_weights(logp_old, logp_rollout, MASK_ONE_SEQUENCE, normalize=True)
    # TIS weights [0.5, 1.5, 2.0] have mean 4/3
    torch.testing.assert_close(weights, torch.tensor([[0.375, 1.125, 1.5, 0.0]]))
    assert diagnostics["importance_sampling_ratio/mean"] == pytest.approx(1.0)


def test_bad_importance_options_raise():
    logp_old, logp_rollout = logps_with_ratios(RATIOS_ONE_SEQUENCE)
    for options in ({"level": "batch"}, {"mode": "clip"}, {"clip": 0.0}, {"clip_low": 3.0}):
        with pytest.raises(ValueError):
            importance_weights(logp_old, logp_rollout, MASK_ONE_SEQUENCE, **options)


def test_acr_clip_scale_by_hand():
    log_ratio = torch.tensor([[1.0, 2.0, 4.0, 0.5, 8.0]]).log()
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    expected = torch.tensor([[1.0, 1.0, 0.5, 1.0, 1.0]])  # min(1, C/ρ), 1 at the invalid token
    torch.testing.assert_close(acr_clip_scale(log_ratio, mask, clip=2.0), expected)


# ----------------------------------------------------------------------------- AIS
def test_ais_diagnostics_and_gate_by_hand():
    logp_old, logp_rollout = logps_with_ratios(RATIOS_ONE_SEQUENCE)
    advantages = torch.tensor([2.0])
    weights, diagnostics = ais_weights(logp_old, logp_rollout, advantages, MASK_ONE_SEQUENCE, rule="gate",
                                       kl_scale=0.1)
    tis = [0.5, 1.5, 2.0]
    reliability = sum(tis) ** 2 / (3 * sum(w * w for w in tis))
    divergence = sum(r - math.log(r) - 1 for r in [0.5, 1.5, 3.0]) / 3
    amplification = sum((w * 2.0) ** 2 for w in tis) / (3 * 2.0**2)
    alpha = (1 - math.exp(-divergence / 0.1)) * reliability / amplification
    assert diagnostics["reliability"] == pytest.approx(reliability, rel=1e-5)
    assert diagnostics["k3_kl"] == pytest.approx(divergence, rel=1e-5)
    assert diagnostics["variance_amplification"] == pytest.approx(amplification, rel=1e-5)
    assert diagnostics["alpha"] == pytest.approx(alpha, rel=1e-5)
    expected = [(1 - alpha) + alpha * w for w in tis] + [0.0]
    torch.testing.assert_close(weights, torch.tensor([expected]))


def test_mismatch_shift_statistics_by_hand():
    """Four sequences: d_t = (w_t − 1)Â_t; b̂ = mean over the valid tokens; σ̂ clusters by group with the small-sample
    factor G/(G − 1); the severity is z² over its null mean (G − 1)/(G − 3), minus 1."""
    ratios = [[0.5, 1.5, 2.0], [1.25, 0.75, 1.0], [1.5, 0.5, 1.0], [0.8, 1.0, 1.2]]
    logp_old, logp_rollout = logps_with_ratios(ratios)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]])
    advantages = [2.0, -1.0, 0.5, -1.5]
    shifts = [[(w - 1) * a for w, m in zip(row, valid) if m] for row, valid, a in zip(ratios, mask.tolist(), advantages)]
    num_tokens = 9
    bias = sum(map(sum, shifts)) / num_tokens

    def expected(group_size):
        groups = [sum(shifts[i:i + group_size], []) for i in range(0, 4, group_size)]
        G = len(groups)
        se = math.sqrt(G / (G - 1) * sum((sum(g) - len(g) * bias) ** 2 for g in groups)) / num_tokens if G > 1 else 0
        return G, se

    G, se = expected(1)
    _, diagnostics = ais_weights(logp_old, logp_rollout, torch.tensor(advantages), mask, rule="oracle")
    assert diagnostics["num_groups"] == G == 4
    assert diagnostics["mismatch_shift"] == pytest.approx(bias, rel=1e-5)
    assert diagnostics["mismatch_shift_se"] == pytest.approx(se, rel=1e-5)
    assert diagnostics["shift_significance"] == pytest.approx(bias**2 / se**2, rel=1e-4)
    assert diagnostics["severity"] == pytest.approx(max(0.0, bias**2 / se**2 / 3 - 1), rel=1e-4, abs=1e-7)
    assert diagnostics["alpha"] == pytest.approx(bias**2 / (bias**2 + se**2), rel=1e-4)
    assert oracle_alpha(0.0, 0.0) == 0.0

    # pairs of sequences as groups (the completions of one prompt): 2 clusters, too few to measure the noise,
    # so the noise-based rules follow the k3 gate; one group has no standard error at all
    G, se = expected(2)
    _, grouped = ais_weights(logp_old, logp_rollout, torch.tensor(advantages), mask, rule="oracle", group_size=2)
    assert grouped["mismatch_shift"] == pytest.approx(bias, rel=1e-5)
    assert grouped["mismatch_shift_se"] == pytest.approx(se, rel=1e-5)
    assert grouped["severity"] == 0.0
    _, gate = ais_weights(logp_old, logp_rollout, torch.tensor(advantages), mask, rule="gate", group_size=2)
    for rule in ("oracle", "adaptive"):
        _, few = ais_weights(logp_old, logp_rollout, torch.tensor(advantages), mask, rule=rule, group_size=2)
        assert few["alpha"] == gate["alpha"] > 0
    _, one = ais_weights(logp_old, logp_rollout, torch.tensor(advantages), mask, group_size=4)
    assert (one["mismatch_shift_se"], one["shift_significance"], one["alpha"]) == (0.0, 0.0, gate["alpha"])
    with pytest.raises(ValueError, match="group_size"):
        ais_weights(logp_old, logp_rollout, torch.tensor(advantages), mask, group_size=3)


def batch_with_mismatch(correlation: float, scale: float = 0.15, sequences: int = 256, length: int = 12, seed: int = 0):
    """Groups of 4 completions with 0/1 rewards and a per-token log-ratio log ρ = scale · (noise + correlation · Â):
    with correlation 0 the mismatch is unrelated to the rewards (FP8-like noise), otherwise it systematically
    favours one side."""
    generator = torch.Generator().manual_seed(seed)
    rewards = (torch.rand(sequences, generator=generator) < 0.5).float()
    advantages = rewards - rewards.view(-1, 4).mean(1).repeat_interleave(4)
    noise = torch.randn(sequences, length, generator=generator)
    log_ratio = scale * (noise + correlation * advantages.unsqueeze(1))
    logp_rollout = -1.0 - torch.rand(sequences, length, generator=generator)
    return logp_rollout + log_ratio, logp_rollout, advantages, torch.ones(sequences, length, dtype=torch.bool)


def test_adaptive_rule_is_scale_free_where_the_fixed_kl_gate_saturates():
    """Issue: tiny models show k3 ≈ 1e-2 under FP8, so the κ = 1e-3 gate sat at α ≈ 1 whatever the mismatch did.
    The adaptive rule stays low for a large mismatch unrelated to the rewards, over many batches."""
    alphas, gate_alphas, divergences = [], [], []
    for seed in range(20):
        logp_old, logp_rollout, advantages, mask = batch_with_mismatch(correlation=0.0, seed=seed)
        _, adaptive = ais_weights(logp_old, logp_rollout, advantages, mask, group_size=4)
        _, gate = ais_weights(logp_old, logp_rollout, advantages, mask, rule="gate", kl_scale=1e-3)
        alphas.append(adaptive["alpha"])
        gate_alphas.append(gate["alpha"])
        divergences.append(adaptive["k3_kl"])
    assert min(divergences) > 5e-3
    assert min(gate_alphas) > 0.8
    assert sorted(alphas)[len(alphas) // 2] == 0.0  # the median batch: no correction at all
    assert sum(alphas) / len(alphas) < 0.15


def test_adaptive_rule_stays_calibrated_with_few_groups():
    """With 4 groups the noise estimate has 3 degrees of freedom and z² under pure noise is a squared t₃ (mean 3, not
    χ²₁'s 1): (z² − 1)₊ would fire in about 45 % of noise-only batches, the severity against z²'s null mean in
    about 18 %, and α stays as low as with many groups."""
    alphas, fired = [], 0
    for seed in range(200):
        _, diagnostics = ais_weights(*batch_with_mismatch(correlation=0.0, sequences=16, seed=seed), group_size=4)
        alphas.append(diagnostics["alpha"])
        fired += diagnostics["severity"] > 0
    assert fired / len(alphas) < 0.3
    assert sum(alphas) / len(alphas) < 0.15


def test_adaptive_rule_corrects_a_mismatch_that_favours_one_side():
    """About the same divergence, but the engine over-samples the low-reward completions: α rises with the
    systematic part of the mismatch (mean over batches), to full correction once it clearly exceeds the noise."""
    mean_alphas = []
    for correlation in (0.0, 0.1, 0.2, 0.4):
        alphas = [ais_weights(*batch_with_mismatch(correlation=correlation, seed=seed), group_size=4)[1]["alpha"]
                  for seed in range(8)]
        mean_alphas.append(sum(alphas) / len(alphas))
    assert mean_alphas[0] < 0.15 and mean_alphas[-1] > 0.85
    assert all(a < b for a, b in zip(mean_alphas, mean_alphas[1:]))


def test_adaptive_rule_ignores_the_scale_of_the_rewards():
    logp_old, logp_rollout, advantages, mask = batch_with_mismatch(correlation=0.3)
    _, unit = ais_weights(logp_old, logp_rollout, advantages, mask)
    _, scaled = ais_weights(logp_old, logp_rollout, 1000.0 * advantages, mask)
    assert scaled["alpha"] == pytest.approx(unit["alpha"], rel=1e-4)


def test_ais_variance_amplification_is_one_without_advantage_signal(mismatched_batch):
    logp_old, logp_rollout, advantages, mask = mismatched_batch
    _, diagnostics = ais_weights(logp_old, logp_rollout, torch.zeros_like(advantages), mask)
    assert diagnostics["variance_amplification"] == 1.0


def test_ais_property_1_on_policy_recovery(mismatched_batch):
    logp_old, _, advantages, mask = mismatched_batch
    on_policy = logp_old.clone()
    weights, _ = ais_weights(logp_old, on_policy, advantages, mask, rule=constant_rule(0.7))
    assert torch.equal(weights, mask.float())
    weights, diagnostics = ais_weights(logp_old, on_policy, advantages, mask)
    assert diagnostics["alpha"] == 0.0
    assert torch.equal(weights, mask.float())
    # ... and the loss is exactly plain GRPO
    logp = (logp_old + 0.1).requires_grad_()
    corrected, _ = grpo_loss(logp, logp_old, advantages, mask, weights=weights)
    plain, _ = grpo_loss(logp, logp_old, advantages, mask)
    assert torch.equal(corrected, plain)


@pytest.mark.parametrize("clip", [1.0, 1.5, 2.0, 4.0])
@pytest.mark.parametrize("rule", ["gate", "oracle", constant_rule(0.3), constant_rule(1.0)])
def test_ais_property_2_bounded_weights(mismatched_batch, clip, rule):
    logp_old, logp_rollout, advantages, mask = mismatched_batch
    weights, diagnostics = ais_weights(logp_old, 2 * logp_rollout, advantages, mask, clip=clip, rule=rule, kl_scale=0.05)
    assert diagnostics["rollout_is_max"] > clip  # the bound is actually exercised
    assert weights.max().item() <= max(1.0, clip) + 1e-6
    assert weights[mask].square().mean().item() <= clip**2 + 1e-6
    assert torch.all(weights[~mask] == 0)


def test_ais_property_3_endpoints(mismatched_batch):
    logp_old, logp_rollout, advantages, mask = mismatched_batch
    uncorrected, diagnostics = ais_weights(logp_old, logp_rollout, advantages, mask, rule=constant_rule(0.0))
    assert diagnostics["alpha"] == 0.0
    assert torch.equal(uncorrected, mask.float())
    full, diagnostics = ais_weights(logp_old, logp_rollout, advantages, mask, rule=constant_rule(1.0))
    tis, _ = importance_weights(logp_old, logp_rollout, mask)
    assert diagnostics["alpha"] == 1.0
    assert torch.equal(full, tis)
    assert not torch.equal(tis, mask.float())


def test_ais_property_4_gate_monotonicity():
    severities = [0.0, 1e-4, 5e-4, 1e-3, 3e-3, 1e-2]
    by_severity = [gate_alpha(0.9, d, 1.5, scale=1e-3, alpha_max=1.0) for d in severities]
    assert by_severity[0] == 0.0
    assert all(a < b for a, b in zip(by_severity, by_severity[1:]))
    reliabilities = [1.0, 0.8, 0.5, 0.2]
    by_reliability = [gate_alpha(r, 2e-3, 1.5, scale=1e-3) for r in reliabilities]
    assert all(a > b for a, b in zip(by_reliability, by_reliability[1:]))
    amplifications = [1.0, 1.5, 3.0, 10.0]
    by_amplification = [gate_alpha(0.9, 2e-3, v, scale=1e-3) for v in amplifications]
    assert all(a > b for a, b in zip(by_amplification, by_amplification[1:]))
    assert gate_alpha(0.9, 2e-3, 0.5, scale=1e-3) == gate_alpha(0.9, 2e-3, 1.0, scale=1e-3)  # V < 1 never boosts α
    assert gate_alpha(1.0, 1e-3, 1.0, scale=1e-3) == pytest.approx(1 - math.exp(-1))


def test_ais_gate_alpha_is_what_both_gate_rules_use(mismatched_batch):
    logp_old, logp_rollout, advantages, mask = mismatched_batch
    _, d = ais_weights(logp_old, logp_rollout, advantages, mask, rule="gate", kl_scale=0.2, alpha_max=0.8)
    expected = gate_alpha(d["reliability"], d["k3_kl"], d["variance_amplification"], 0.2, 0.8)
    assert 0.0 < d["alpha"] == pytest.approx(expected)
    _, d = ais_weights(logp_old, logp_rollout, advantages, mask, snr_scale=0.5, alpha_max=0.8)
    expected = gate_alpha(d["reliability"], d["severity"], d["variance_amplification"], 0.5, 0.8)
    assert d["alpha"] == pytest.approx(expected)


def test_ais_custom_rule_receives_diagnostics_and_is_validated(mismatched_batch):
    logp_old, logp_rollout, advantages, mask = mismatched_batch
    seen = {}

    def rule(diagnostics):
        seen.update(diagnostics)
        return 3.0  # clamped to 1

    weights, diagnostics = ais_weights(logp_old, logp_rollout, advantages, mask, rule=rule)
    required = {"reliability", "severity", "variance_amplification", "mismatch_shift", "mismatch_shift_se",
                "shift_significance", "num_groups", "k3_kl", "num_tokens", "clip", "snr_scale", "kl_scale", "alpha_max"}
    assert required <= set(seen)
    assert seen["num_tokens"] == mask.sum().item()
    assert diagnostics["alpha"] == 1.0
    with pytest.raises(ValueError, match="non-finite"):
        ais_weights(logp_old, logp_rollout, advantages, mask, rule=constant_rule(float("nan")))
    with pytest.raises(ValueError, match="number"):
        ais_weights(logp_old, logp_rollout, advantages, mask, rule=constant_rule("high"))


def test_ais_alpha_ema(mismatched_batch):
    logp_old, logp_rollout, advantages, mask = mismatched_batch
    _, diagnostics = ais_weights(
        logp_old, logp_rollout, advantages, mask, rule=constant_rule(0.6), previous_alpha=0.2, alpha_ema=0.75
    )
    assert diagnostics["alpha_raw"] == pytest.approx(0.6)
    assert diagnostics["alpha"] == pytest.approx(0.75 * 0.2 + 0.25 * 0.6)


@pytest.mark.parametrize(
    "options", [{"rule": "clever"}, {"kl_scale": 0.0}, {"snr_scale": -1.0}, {"clip": -1.0}, {"alpha_max": 1.5},
                {"alpha_ema": 1.0}]
)
def test_ais_bad_arguments_raise(mismatched_batch, options):
    logp_old, logp_rollout, advantages, mask = mismatched_batch
    with pytest.raises(ValueError) as error:
        ais_weights(logp_old, logp_rollout, advantages, mask, **options)
    if "rule" in options:
        assert all(name in str(error.value) for name in ALPHA_RULES)


# ----------------------------------------------------------------------------- dispatcher
def test_correct_none_keeps_logging_the_mismatch(mismatched_batch):
    logp_old, logp_rollout, advantages, mask = mismatched_batch
    correction = correct(CorrectionSettings("none"), logp_old, logp_rollout, advantages, mask)
    assert torch.equal(correction.weights, mask.float())
    assert correction.clip_scale is None
    assert correction.diagnostics["rollout_corr/k3_kl"] > 1e-3
    assert not any(key.startswith("sampling/importance_sampling_ratio") for key in correction.diagnostics)


def test_correct_logs_under_verl_trl_and_ais_names(mismatched_batch):
    logp_old, logp_rollout, advantages, mask = mismatched_batch
    diagnostics = correct(CorrectionSettings("ais"), logp_old, logp_rollout, advantages, mask).diagnostics
    _, plain = ais_weights(logp_old, logp_rollout, advantages, mask)
    assert diagnostics == {logged_name(key): value for key, value in plain.items()}
    for key in ("rollout_is_mean", "rollout_is_std", "rollout_is_min", "rollout_is_max", "rollout_is_eff_sample_size",
                "rollout_is_ratio_fraction_high", "rollout_is_ratio_fraction_low", "training_ppl", "rollout_ppl",
                "ppl_ratio", "kl", "k3_kl", "chi2_token", "chi2_seq"):
        assert f"rollout_corr/{key}" in diagnostics, key
    for key in ("importance_sampling_ratio/min", "importance_sampling_ratio/mean", "importance_sampling_ratio/max",
                "sampling_logp_difference/mean", "sampling_logp_difference/max"):
        assert f"sampling/{key}" in diagnostics, key
    assert {"ais/alpha", "ais/reliability", "ais/severity", "ais/variance_amplification"} <= set(diagnostics)
    assert all(key.split("/")[0] in ("rollout_corr", "sampling", "ais") for key in diagnostics)


def test_correct_dispatches_to_the_weight_functions(mismatched_batch):
    logp_old, logp_rollout, advantages, mask = mismatched_batch
    tis, _ = importance_weights(logp_old, logp_rollout, mask, level="geometric", clip=1.5)
    assert torch.equal(correct(CorrectionSettings("tis", level="geometric", clip=1.5), logp_old, logp_rollout, advantages, mask).weights, tis)
    mis, _ = importance_weights(logp_old, logp_rollout, mask, mode="mask", clip_low=0.5)
    assert torch.equal(correct(CorrectionSettings("mis", clip_low=0.5), logp_old, logp_rollout, advantages, mask).weights, mis)
    acr = correct(CorrectionSettings("acr", clip=1.2), logp_old, logp_rollout, advantages, mask)
    assert torch.equal(acr.weights, importance_weights(logp_old, logp_rollout, mask, clip=1.2)[0])
    expected_scale = acr_clip_scale(log_importance_ratio(logp_old, logp_rollout, mask), mask, clip=1.2)
    assert torch.equal(acr.clip_scale, expected_scale) and expected_scale.min() < 1
    ais = correct(CorrectionSettings("ais", ais_rule="oracle"), logp_old, logp_rollout, advantages, mask)
    assert torch.equal(ais.weights, ais_weights(logp_old, logp_rollout, advantages, mask, rule="oracle")[0])
    assert "ais/alpha" in ais.diagnostics


def test_correct_rejects_unknown_methods_and_unusable_options(mismatched_batch):
    logp_old, logp_rollout, advantages, mask = mismatched_batch
    with pytest.raises(ValueError) as error:
        RolloutCorrection(CorrectionSettings("fp8"))
    assert all(method in str(error.value) for method in CORRECTION_METHODS)
    with pytest.raises(ValueError, match="level"):
        RolloutCorrection(CorrectionSettings("ais", level="sequence"))
    with pytest.raises(ValueError, match="normalize"):
        RolloutCorrection(CorrectionSettings("ais", normalize=True))


# ----------------------------------------------------------------------------- config fields reach the computation
def test_acr_clip_from_the_config_reaches_the_clip_scale(mismatched_batch):
    logp_old, logp_rollout, advantages, mask = mismatched_batch
    settings = GRPOConfig(correction={"method": "acr", "clip": 1.2}).correction
    correction = correct(settings, logp_old, logp_rollout, advantages, mask)
    log_ratio = log_importance_ratio(logp_old, logp_rollout, mask)
    assert torch.equal(correction.clip_scale, acr_clip_scale(log_ratio, mask, clip=1.2))
    assert not torch.equal(correction.clip_scale, acr_clip_scale(log_ratio, mask, clip=2.0))
    assert torch.equal(correction.weights, importance_weights(logp_old, logp_rollout, mask, clip=1.2)[0])


CTPO_FIELDS = dict(ctpo_c_low=0.1, ctpo_c_high=0.2, ctpo_c_dual=0.3, ctpo_power=0.4, ctpo_cap=0.05)


def test_ctpo_constants_from_the_config_are_the_loss_arguments():
    settings = GRPOConfig(experimental={"ratio_type": "ctpo", **CTPO_FIELDS}).experimental
    assert settings.ctpo_loss_options() == CTPO_FIELDS
    assert GRPOConfig().experimental.ctpo_loss_options() == {
        "ctpo_c_low": 0.025, "ctpo_c_high": 0.05, "ctpo_c_dual": 0.05, "ctpo_power": 0.5, "ctpo_cap": 10.0}


def test_ctpo_cap_from_the_config_caps_the_ratio_in_the_loss():
    """One token, A = −1, ℓ^θ − ℓ^old = 0.3 above the upper clip bound and below the dual bound e^1: the loss is
    the ratio itself, exp(min(0.3, cap))."""
    logp, logp_old, advantages, mask = torch.tensor([[0.3]]), torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1)
    for cap, expected in ((0.05, math.exp(0.05)), (10.0, math.exp(0.3))):
        options = GRPOConfig(experimental={"ratio_type": "ctpo", "ctpo_cap": cap, "ctpo_c_dual": 1.0}).experimental
        loss, _ = grpo_loss(logp, logp_old, advantages, mask, ratio_type="ctpo", **options.ctpo_loss_options())
        assert loss.item() == pytest.approx(expected)


@pytest.mark.parametrize("field, value", [("ctpo_c_low", 0.0), ("ctpo_c_dual", -1.0), ("ctpo_power", -0.5),
                                          ("ctpo_cap", 0.0)])
def test_unusable_ctpo_constants_are_config_problems_naming_the_field(field, value):
    assert any(f"experimental.{field}" in problem
               for problem in GRPOConfig(experimental={field: value}).problems())


def test_the_optimisation_pass_gives_the_loss_the_configs_ctpo_constants(tokenizer, tmp_path, monkeypatch):
    from conftest import tiny_llada
    from dllm_ais import grpo
    from dllm_ais.tasks.digits import make_digits_dataset
    from dllm_ais.trainer import GRPOTrainer

    config = GRPOConfig(task="digits", eval_size=0, num_generations=2, per_device_train_batch_size=2,
                        max_completion_length=4, num_iterations=1, lora_r=2, lora_alpha=4, max_prompt_length=64,
                        dtype="float32", output_dir=str(tmp_path),
                        rollout={"block_length": 4, "steps": 2, "precision": "bf16"},
                        experimental={"ratio_type": "ctpo", **CTPO_FIELDS})
    trainer = GRPOTrainer(config, model=tiny_llada(tokenizer), tokenizer=tokenizer,
                          train_dataset=make_digits_dataset(4, seed=1))
    calls = []

    def recording_loss(*args, **kwargs):
        calls.append(kwargs)
        return TokenLoss(*args, **kwargs)

    monkeypatch.setattr(grpo, "TokenLoss", recording_loss)
    trainer.optimisation_pass(trainer.make_generation_batch(), 0)
    assert calls and all(call["ratio_type"] == "ctpo" and call.items() >= CTPO_FIELDS.items() for call in calls)


def test_the_shift_statistics_stay_on_the_device_of_the_weights():
    """Every statistic is made where the weights are: a CPU scalar among CUDA ones broke `dllm-ais train` on an H100
    (stacking them for the log). Checked on the meta device, which no tensor reaches by accident."""
    from dllm_ais.correction import mismatch_shift_statistics

    weights = torch.ones(8, 5, device="meta")
    statistics = mismatch_shift_statistics(weights, weights, weights.bool(), group_size=2)
    assert {value.device.type for value in statistics.values()} == {"meta"}
