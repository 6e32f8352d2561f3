"""GRPO loss: advantages, clipping, aggregation, weights, ACR, KL and CTPO against hand values."""
import math

import pytest
import torch

from dllm_ais.loss import LOSS_TYPES, ctpo_log_ratio, group_advantages, grpo_loss, k3_kl

RAGGED_MASK = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)  # 5 valid tokens
RAGGED_ADVANTAGES = torch.tensor([1.5, -0.5])


def single_token_batch(ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One valid token per sequence with policy ratio r_b: (logp leaf, logp_old, mask), [B, 1]."""
    logp_old = torch.full((len(ratios), 1), -1.0)
    logp = (logp_old + torch.tensor(ratios).log().unsqueeze(1)).requires_grad_()
    return logp, logp_old, torch.ones(len(ratios), 1, dtype=torch.bool)


# ----------------------------------------------------------------------------- advantages
def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 6.0])
    centred = torch.tensor([-1.0, 0.0, 1.0, -2.0, -2.0, 4.0])
    torch.testing.assert_close(group_advantages(rewards, 3), centred)
    group_std = torch.tensor([1.0] * 3 + [math.sqrt(12.0)] * 3)  # unbiased std within each group
    torch.testing.assert_close(group_advantages(rewards, 3, "group"), centred / (group_std + 1e-4))
    batch_std = math.sqrt(26.0 / 5.0)  # unbiased std of all six rewards (mean 2)
    torch.testing.assert_close(group_advantages(rewards, 3, "batch"), centred / (batch_std + 1e-4))


@pytest.mark.parametrize(
    "num_rewards, num_generations, scale", [(5, 3, "none"), (6, 0, "none"), (6, 3, "std"), (4, 1, "group")]
)
def test_group_advantages_rejects_bad_input(num_rewards, num_generations, scale):
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(num_rewards), num_generations, scale)


def test_k3_kl_by_hand():
    logp = torch.tensor([math.log(0.5), math.log(0.3)])
    logp_ref = torch.tensor([math.log(0.25), math.log(0.3)])
    expected = torch.tensor([0.5 + math.log(2.0) - 1.0, 0.0])  # ref/θ = 0.5: ρ − log ρ − 1
    torch.testing.assert_close(k3_kl(logp, logp_ref), expected)


# ----------------------------------------------------------------------------- aggregation
@pytest.mark.parametrize(
    "loss_type, options, normaliser",
    [
        ("grpo", {}, torch.tensor([[2.0 * 2], [3.0 * 2]])),  # per-sequence length × number of sequences
        ("bnpo", {}, torch.tensor([[5.0], [5.0]])),  # valid tokens in this batch
        ("dr_grpo", {"max_completion_length": 4}, torch.tensor([[8.0], [8.0]])),  # B · max length
        ("dapo", {"num_items_in_batch": 10}, torch.tensor([[10.0], [10.0]])),  # global valid tokens
        ("dapo", {}, torch.tensor([[5.0], [5.0]])),  # local fallback
    ],
)
def test_on_policy_gradient_is_reinforce_with_the_loss_type_normaliser(loss_type, options, normaliser):
    logp = torch.randn(2, 3, generator=torch.Generator().manual_seed(1)).requires_grad_()
    loss, metrics = grpo_loss(
        logp, logp.detach(), RAGGED_ADVANTAGES, RAGGED_MASK, loss_type=loss_type, **options
    )
    loss.backward()
    per_token = -RAGGED_ADVANTAGES.unsqueeze(1) * RAGGED_MASK / normaliser  # −A ∇ℓ / normaliser
    torch.testing.assert_close(logp.grad, per_token)
    torch.testing.assert_close(loss, per_token.sum())
    assert metrics["policy_ratio/mean"] == pytest.approx(1.0)
    assert metrics["clip_ratio/region_mean"] == 0.0


def test_dr_grpo_needs_max_completion_length_and_bad_names_are_listed():
    logp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="max_completion_length"):
        grpo_loss(logp, logp, RAGGED_ADVANTAGES, RAGGED_MASK, loss_type="dr_grpo")
    with pytest.raises(ValueError) as error:
        grpo_loss(logp, logp, RAGGED_ADVANTAGES, RAGGED_MASK, loss_type="sum")
    assert all(repr(name) in str(error.value) for name in LOSS_TYPES)
    with pytest.raises(ValueError, match="ratio_type"):
        grpo_loss(logp, logp, RAGGED_ADVANTAGES, RAGGED_MASK, ratio_type="sequence")


# ----------------------------------------------------------------------------- clipping
def test_clipping_by_hand():
    logp, logp_old, mask = single_token_batch([1.5, 0.5, 0.5, 1.5])
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, metrics = grpo_loss(logp, logp_old, advantages, mask, epsilon=0.2, loss_type="bnpo")
    # objectives: min(1.5, 1.2) = 1.2 (high clip); min(−0.5, −0.8) = −0.8 (low clip);
    #             min(0.5, 0.8) = 0.5; min(−1.5, −1.2) = −1.5 (clip inactive for A < 0)
    assert loss.item() == pytest.approx(-(1.2 - 0.8 + 0.5 - 1.5) / 4)
    loss.backward()
    # unclipped tokens: ∂(−r A / 4)/∂ℓ = −r A / 4
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0], [0.0], [-0.5 / 4], [1.5 / 4]]))
    assert metrics["clip_ratio/low_mean"] == pytest.approx(0.25)
    assert metrics["clip_ratio/high_mean"] == pytest.approx(0.25)
    assert metrics["clip_ratio/region_mean"] == pytest.approx(0.5)
    assert metrics["policy_ratio/mean"] == pytest.approx(1.0)


def test_epsilon_high_widens_only_the_upper_bound():
    logp, logp_old, mask = single_token_batch([1.5, 0.5])
    advantages = torch.tensor([1.0, -1.0])
    loss, metrics = grpo_loss(logp, logp_old, advantages, mask, epsilon=0.2, epsilon_high=0.6, loss_type="bnpo")
    assert loss.item() == pytest.approx(-(1.5 - 0.8) / 2)
    assert metrics["clip_ratio/high_mean"] == 0.0 and metrics["clip_ratio/low_mean"] == 0.5


def test_weights_multiply_the_per_token_terms():
    logp = torch.zeros(2, 3, requires_grad=True)
    weights = torch.tensor([[2.0, 0.5, 7.0], [1.0, 3.0, 0.0]])
    loss, _ = grpo_loss(logp, logp.detach(), RAGGED_ADVANTAGES, RAGGED_MASK, weights=weights, loss_type="bnpo")
    loss.backward()
    expected_grad = -RAGGED_ADVANTAGES.unsqueeze(1) * weights * RAGGED_MASK / 5
    torch.testing.assert_close(logp.grad, expected_grad)
    assert loss.item() == pytest.approx(-(1.5 * 2.5 - 0.5 * 4.0) / 5)


def test_acr_clip_scale_widens_the_upper_bound():
    logp, logp_old, mask = single_token_batch([1.5])
    advantages = torch.tensor([1.0])
    clipped, clipped_metrics = grpo_loss(logp, logp_old, advantages, mask, epsilon=0.2)
    widened, widened_metrics = grpo_loss(
        logp, logp_old, advantages, mask, epsilon=0.2, clip_scale=torch.tensor([[0.5]])
    )
    assert clipped.item() == pytest.approx(-1.2) and clipped_metrics["clip_ratio/high_mean"] == 1.0
    assert widened.item() == pytest.approx(-1.5) and widened_metrics["clip_ratio/high_mean"] == 0.0
    (gradient,) = torch.autograd.grad(widened, logp)
    assert gradient.item() == pytest.approx(-1.5)


# ----------------------------------------------------------------------------- KL
def test_beta_adds_the_mean_k3_kl():
    generator = torch.Generator().manual_seed(2)
    logp = torch.randn(2, 3, generator=generator).requires_grad_()
    logp_old = logp.detach() + 0.1 * torch.randn(2, 3, generator=generator)
    logp_ref = logp.detach() + 0.3 * torch.randn(2, 3, generator=generator)
    plain, _ = grpo_loss(logp, logp_old, RAGGED_ADVANTAGES, RAGGED_MASK, loss_type="bnpo")
    penalised, metrics = grpo_loss(
        logp, logp_old, RAGGED_ADVANTAGES, RAGGED_MASK, logp_ref=logp_ref, beta=0.1, loss_type="bnpo"
    )
    mean_kl = k3_kl(logp.detach(), logp_ref)[RAGGED_MASK].mean().item()
    assert mean_kl > 0
    assert metrics["kl"] == pytest.approx(mean_kl, rel=1e-5)
    assert penalised.item() == pytest.approx(plain.item() + 0.1 * mean_kl, rel=1e-5)
    same_as_policy, metrics = grpo_loss(
        logp, logp_old, RAGGED_ADVANTAGES, RAGGED_MASK, logp_ref=logp.detach(), beta=0.1, loss_type="bnpo"
    )
    assert metrics["kl"] == 0.0
    assert same_as_policy.item() == pytest.approx(plain.item())
    with pytest.raises(ValueError, match="logp_ref"):
        grpo_loss(logp, logp_old, RAGGED_ADVANTAGES, RAGGED_MASK, beta=0.1)


# ----------------------------------------------------------------------------- CTPO
def test_ctpo_bounds_grow_with_the_square_root_of_the_valid_position():
    mask = torch.tensor([[1, 0, 1, 1, 1]], dtype=torch.bool)
    ctpo = ctpo_log_ratio(torch.zeros(1, 5), torch.zeros(1, 5), mask)
    root_position = torch.tensor([[1.0, 0.0, math.sqrt(2), math.sqrt(3), 2.0]])  # t counts valid tokens
    torch.testing.assert_close(ctpo.position_scale, root_position)
    torch.testing.assert_close(ctpo.log_upper, 0.05 * root_position)
    torch.testing.assert_close(ctpo.log_lower, -0.025 * root_position)


def test_ctpo_log_ratio_is_the_prefix_sum_with_gradient_through_the_current_token_only():
    mask = torch.tensor([[1, 0, 1, 1, 1]], dtype=torch.bool)
    logp_old = torch.full((1, 5), -2.0)
    logp = (logp_old + torch.tensor([[0.1, 5.0, -0.3, 0.05, 0.2]])).requires_grad_()
    log_ratio = ctpo_log_ratio(logp, logp_old, mask).log_ratio
    torch.testing.assert_close(log_ratio, torch.tensor([[0.1, 0.0, -0.2, -0.15, 0.05]]))
    for position in range(5):
        (gradient,) = torch.autograd.grad(log_ratio[0, position], logp, retain_graph=True)
        expected = torch.zeros(1, 5)
        expected[0, position] = float(mask[0, position])
        torch.testing.assert_close(gradient, expected)


def test_ctpo_prefix_log_ratio_is_capped():
    ctpo = ctpo_log_ratio(torch.full((1, 3), 15.0), torch.zeros(1, 3), torch.ones(1, 3), cap=10.0)
    torch.testing.assert_close(ctpo.log_ratio, torch.full((1, 3), 10.0))


def test_ctpo_loss_clips_by_position_and_dual_clips_negative_advantages():
    logp, logp_old, mask = single_token_batch([math.exp(0.5), math.exp(0.5)])
    advantages = torch.tensor([-1.0, 1.0])
    loss, metrics = grpo_loss(
        logp, logp_old, advantages, mask, ratio_type="ctpo", ctpo_c_dual=0.2, loss_type="bnpo"
    )
    # t = 1: upper bound exp(0.05), dual bound exp(0.2); r = exp(0.5) exceeds both.
    # A = −1: max(min(−r, −e^0.05), −e^0.2) = −e^0.2; A = +1: min(r, e^0.05) = e^0.05.
    assert loss.item() == pytest.approx((math.exp(0.2) - math.exp(0.05)) / 2)
    assert metrics["clip_ratio/dual_mean"] == 0.5 and metrics["clip_ratio/high_mean"] == 0.5
    (gradient,) = torch.autograd.grad(loss, logp)
    assert torch.all(gradient == 0)
    loose, _ = grpo_loss(logp, logp_old, advantages, mask, ratio_type="ctpo", ctpo_c_dual=1.0, loss_type="bnpo")
    assert loose.item() == pytest.approx((math.exp(0.5) - math.exp(0.05)) / 2)


# ----------------------------------------------------------------------------- masking
@pytest.mark.parametrize("ratio_type", ["token", "ctpo"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo"])
def test_masked_garbage_never_leaks(ratio_type, loss_type):
    nan, inf = float("nan"), float("inf")
    logp = torch.tensor([[-1.0, -0.5, nan], [-2.0, -inf, inf]], requires_grad=True)
    logp_old = torch.tensor([[-1.02, -0.4, -inf], [-2.0, nan, 3.0]])  # inside every clip range
    logp_ref = torch.tensor([[-1.0, -0.6, nan], [-1.9, inf, -inf]])
    weights = torch.tensor([[1.0, 2.0, nan], [0.5, inf, nan]])
    clip_scale = torch.tensor([[1.0, 0.5, 0.0], [1.0, 0.0, nan]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    loss, metrics = grpo_loss(
        logp, logp_old, RAGGED_ADVANTAGES, mask, weights=weights, clip_scale=clip_scale,
        logp_ref=logp_ref, beta=0.04, loss_type=loss_type, ratio_type=ratio_type,
    )
    loss.backward()
    assert torch.isfinite(loss)
    assert all(math.isfinite(value) for value in metrics.values())
    assert torch.all(torch.isfinite(logp.grad))
    assert torch.all(logp.grad[~mask] == 0) and torch.all(logp.grad[mask] != 0)
