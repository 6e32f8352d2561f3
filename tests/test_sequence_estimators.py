"""Sequence-level diffusion estimators on a tiny LLaDA: mask draws (LLaDA, coupled, SPG's block-wise), the Monte-Carlo
ELBO, SPG's EUBO and sandwich, their spread over tokens, and what the ratio and the corrections make of them."""

import copy
import math

import pytest
import torch

from dllm_ais.config import GRPOConfig
from dllm_ais.correction import CorrectionSettings, correct
from dllm_ais.likelihood import (
    DIFFUSION_ESTIMATORS, BoundSettings, EstimatorSettings, block_mask_draws, elbo_from_draws, eubo_from_draws,
    mask_generator, mc_elbo, random_mask_draws, spread_over_tokens,
)
from dllm_ais.loss import grpo_loss
from dllm_ais.sampling.rollout import Rollout
from test_likelihood import GEN_LENGTH, MASK, PROMPT_LENGTH, canvas, completion_logprobs, model  # noqa: F401

BLOCK = 2
VALID = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]]).bool()  # through the first EOS


def rollout_of(canvas) -> Rollout:
    sequences, attention_mask = canvas
    return Rollout(sequences=sequences, attention_mask=attention_mask, completion_mask=VALID,
                   step_logprobs=torch.zeros(3, GEN_LENGTH), commit_step=torch.zeros(3, GEN_LENGTH, dtype=torch.long),
                   prompt_length=PROMPT_LENGTH)


def settings(**bounds) -> EstimatorSettings:
    return EstimatorSettings(MASK, temperature=0.0, p_mask_prompt=0.0, bounds=BoundSettings(**bounds))


def hand_draw_logprobs(model, canvas, draws):
    """Per draw, naive full-softmax log-probs of every completion token on the canvas with that draw's mask."""
    sequences, attention_mask = canvas
    completion = sequences[:, PROMPT_LENGTH:]
    return [completion_logprobs(model, torch.cat([sequences[:, :PROMPT_LENGTH],
                                                  torch.where(draw.masked, MASK, completion)], dim=1),
                                attention_mask, completion) for draw in draws]


def hand_eubo(logprobs, draws, beta, scored):
    """(N / |S|) (1/β) Σ_{k∈S} log((1/n) Σ_d m_dk p_dk^β / t_d), S the scored positions some draw masks; loops."""
    values = []
    for row in range(scored.shape[0]):
        logs = []
        for k in range(scored.shape[1]):
            terms = [math.exp(beta * lp[row, k].item()) / d.rate[row].item()
                     for lp, d in zip(logprobs, draws) if d.masked[row, k]]
            if scored[row, k] and terms:
                logs.append(math.log(sum(terms) / len(draws)))
        values.append(int(scored[row].sum()) * sum(logs) / len(logs) / beta if logs else 0.0)
    return torch.tensor(values)


# ---------------------------------------------------------------------------------------------
# Mask draws
# ---------------------------------------------------------------------------------------------
def test_coupled_draws_pair_each_draw_with_its_complement():
    coupled = random_mask_draws(4, 7, 3, mask_generator(5), coupled=True)
    plain = random_mask_draws(4, 7, 3, mask_generator(5))
    assert len(coupled) == 6
    for n, draw in enumerate(plain):
        first, complement = coupled[2 * n], coupled[2 * n + 1]
        assert torch.equal(first.masked, draw.masked) and torch.equal(first.rate, draw.rate)
        assert torch.equal(first.masked ^ complement.masked, torch.ones(4, 7, dtype=torch.bool))  # each token once
        torch.testing.assert_close(first.rate + complement.rate, torch.ones(4))


def test_block_draws_follow_spg_block_structure():
    valid = torch.tensor([[1] * 8, [1] * 5 + [0] * 3, [1] + [0] * 7, [0] * 8]).bool()
    draws = block_mask_draws(valid, block_length=2, num_samples=40, generator=mask_generator(0))
    again = block_mask_draws(valid, block_length=2, num_samples=40, generator=mask_generator(0))
    assert all(torch.equal(a.masked, b.masked) for a, b in zip(draws, again))
    chosen_blocks = set()
    for draw in draws:
        for row in range(3):  # the row without valid tokens is checked below
            blocks = draw.masked[row].view(4, 2)
            valid_blocks = valid[row].view(4, 2)
            chosen = min(b for b in range(4) if blocks[b].any())  # earlier blocks clean
            chosen_blocks.add((row, chosen))
            assert valid_blocks[chosen].any(), "the partly masked block holds a valid token"
            assert blocks[chosen + 1:].all(), "later blocks are masked whole"
            masked_valid = (blocks[chosen] & valid_blocks[chosen]).sum()
            assert 1 <= masked_valid <= valid_blocks[chosen].sum()
            assert (blocks[chosen] | valid_blocks[chosen]).all(), "the chosen block's padding is masked"
            expected_rate = (draw.masked[row] & valid[row]).sum() / valid[row].sum()
            assert draw.rate[row].item() == pytest.approx(expected_rate.item())
        assert draw.rate[3].item() == 1.0
    assert {(0, b) for b in range(4)} <= chosen_blocks and {(1, b) for b in range(3)} <= chosen_blocks
    assert (1, 3) not in chosen_blocks, "a block of padding only is never the partly masked one"
    assert {b for row, b in chosen_blocks if row == 2} == {0}


# ---------------------------------------------------------------------------------------------
# Monte-Carlo ELBO with coupled masks and scored positions
# ---------------------------------------------------------------------------------------------
def test_coupled_mc_elbo_equals_hand_pair(model, canvas):
    sequences, attention_mask = canvas
    draws = random_mask_draws(3, GEN_LENGTH, 1, mask_generator(9), coupled=True)
    logprobs = hand_draw_logprobs(model, canvas, draws)
    (first, complement), (lp_first, lp_complement) = draws, logprobs
    expected = 0.5 * (torch.where(first.masked, lp_first, 0.0).sum(1) / first.rate
                      + torch.where(complement.masked, lp_complement, 0.0).sum(1) / complement.rate)
    got = mc_elbo(model, sequences, attention_mask, PROMPT_LENGTH, MASK, num_samples=1, seed=9, coupled=True)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-6)
    scored = mc_elbo(model, sequences, attention_mask, PROMPT_LENGTH, MASK, num_samples=1, seed=9, coupled=True,
                     completion_mask=VALID)
    expected_scored = 0.5 * (torch.where(first.masked & VALID, lp_first, 0.0).sum(1) / first.rate
                             + torch.where(complement.masked & VALID, lp_complement, 0.0).sum(1) / complement.rate)
    torch.testing.assert_close(scored, expected_scored, atol=1e-4, rtol=1e-6)


def test_elbo_estimator_spreads_mc_elbo_over_the_valid_tokens(model, canvas):
    sequences, attention_mask = canvas
    rollout = rollout_of(canvas)
    values = DIFFUSION_ESTIMATORS["elbo"].logprobs(model, rollout, settings(num_samples=2, coupled=True), 4, False)
    elbo = mc_elbo(model, sequences, attention_mask, PROMPT_LENGTH, MASK, num_samples=2, seed=4, coupled=True,
                   completion_mask=VALID)
    torch.testing.assert_close(values.sum(1), elbo, atol=1e-5, rtol=1e-6)
    lengths = VALID.sum(1, keepdim=True)
    assert torch.equal(values, torch.where(VALID, elbo.unsqueeze(1) / lengths, 0.0))


# ---------------------------------------------------------------------------------------------
# The sequence-level ratio
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("estimator", ["elbo", "spg"])
def test_identical_models_give_ratio_and_weights_exactly_one(model, canvas, estimator):
    rollout = rollout_of(canvas)
    advantages = torch.tensor([1.0, -0.5, -0.5])
    scorer = DIFFUSION_ESTIMATORS[estimator].logprobs
    options = settings(num_samples=2, block_masking=estimator == "spg", block_length=BLOCK)
    engine_side = scorer(model, rollout, options, 13, False, advantages)
    trainer_side = scorer(model, rollout, options, 13, False, advantages)
    assert torch.equal(engine_side, trainer_side)
    correction = correct(CorrectionSettings("ais"), trainer_side, engine_side, advantages, VALID)
    assert torch.equal(correction.weights, VALID.float())
    _, metrics = grpo_loss(trainer_side.clone().requires_grad_(), trainer_side, advantages, VALID)
    assert metrics["policy_ratio/mean"] == 1.0


def test_sequence_ratio_and_loss_equal_the_gspo_hand_formula(model, canvas):
    """r_i = exp((v^θ_i − v^old_i) / |o_i|) at every token of sequence i; the dapo loss is then
    −Σ_i |o_i| min(r_i A_i, clip(r_i, 1 ± ε) A_i) / Σ_i |o_i|."""
    sequences, attention_mask = canvas
    rollout = rollout_of(canvas)
    old_model = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in old_model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    options = settings(num_samples=2)
    logp = DIFFUSION_ESTIMATORS["elbo"].logprobs(model, rollout, options, 21, False)
    logp_old = DIFFUSION_ESTIMATORS["elbo"].logprobs(old_model, rollout, options, 21, False)
    v_theta, v_old = (mc_elbo(m, sequences, attention_mask, PROMPT_LENGTH, MASK, 2, seed=21, completion_mask=VALID)
                      for m in (model, old_model))
    lengths = VALID.sum(1).float()
    ratio = ((v_theta - v_old) / lengths).exp()
    token_ratio = (logp - logp_old).exp()
    torch.testing.assert_close(token_ratio, torch.where(VALID, ratio.unsqueeze(1), 1.0), atol=1e-5, rtol=1e-5)

    advantages, epsilon = torch.tensor([1.0, -1.0, 0.5]), 0.01
    loss, _ = grpo_loss(logp, logp_old, advantages, VALID, epsilon=epsilon, loss_type="dapo")
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - epsilon, 1 + epsilon) * advantages)
    expected = -(lengths * surrogate).sum() / lengths.sum()
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ratio, torch.ones(3), atol=1e-3), "the perturbed model must move the ratio"


# ---------------------------------------------------------------------------------------------
# SPG
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block_masking", [False, True])
def test_spg_sides_equal_mc_elbo_and_the_eubo_formula(model, canvas, block_masking):
    sequences, attention_mask = canvas
    rollout = rollout_of(canvas)
    beta, seed = 1.5, 17
    options = dict(num_samples=3, block_masking=block_masking, block_length=BLOCK, eubo_beta=beta)
    spg = DIFFUSION_ESTIMATORS["spg"].logprobs
    positive = spg(model, rollout, settings(**options), seed, False, torch.ones(3))
    eubo_only = spg(model, rollout, settings(**options, mix_weight=1.0), seed, False, -torch.ones(3))
    mixed = spg(model, rollout, settings(**options, mix_weight=0.3), seed, False, torch.tensor([1.0, -1.0, 0.0]))

    generator = mask_generator(seed)
    draws = (block_mask_draws(VALID, BLOCK, 3, generator) if block_masking
             else random_mask_draws(3, GEN_LENGTH, 3, generator))
    logprobs = hand_draw_logprobs(model, canvas, draws)
    elbo = torch.stack([torch.where(d.masked & VALID, lp, 0.0).sum(1) / d.rate
                        for lp, d in zip(logprobs, draws)]).mean(0)
    eubo = hand_eubo(logprobs, draws, beta, VALID)
    if not block_masking:  # LLaDA's random masks: the ELBO side is mc_elbo with the same draws
        torch.testing.assert_close(elbo, mc_elbo(model, sequences, attention_mask, PROMPT_LENGTH, MASK, 3, seed=seed,
                                                 completion_mask=VALID), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(positive.sum(1), elbo, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(eubo_only.sum(1), eubo, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(mixed.sum(1), torch.stack([elbo[0], 0.3 * eubo[1] + 0.7 * elbo[1], elbo[2]]),
                               atol=1e-4, rtol=1e-5)


def test_bound_ordering_on_a_one_token_completion(model, canvas):
    """One completion token: log π(o | c) = log softmax(f(c, MASK))[o] exactly, and for any draws
    ELBO = mean (1/t) log π ≤ log π ≤ (1/β) log mean(π^β / t) = EUBO (t ≤ 1, β ≥ 1)."""
    sequences, attention_mask = canvas
    short = sequences[:, :PROMPT_LENGTH + 1]
    mask = attention_mask[:, :PROMPT_LENGTH + 1]
    fully_masked = short.clone()
    fully_masked[:, PROMPT_LENGTH] = MASK
    logits = model(input_ids=fully_masked, attention_mask=mask).logits[:, PROMPT_LENGTH].float()
    log_likelihood = logits.log_softmax(-1).gather(-1, short[:, PROMPT_LENGTH:]).squeeze(-1)
    rollout = Rollout(sequences=short, attention_mask=mask, completion_mask=torch.ones(3, 1, dtype=torch.bool),
                      step_logprobs=torch.zeros(3, 1), commit_step=torch.zeros(3, 1, dtype=torch.long),
                      prompt_length=PROMPT_LENGTH)
    for seed in range(3):
        elbo = DIFFUSION_ESTIMATORS["spg"].logprobs(model, rollout, settings(num_samples=3), seed, False, torch.ones(3))
        eubo = DIFFUSION_ESTIMATORS["spg"].logprobs(model, rollout, settings(num_samples=3, mix_weight=1.0), seed,
                                                    False, -torch.ones(3))
        assert (elbo.squeeze(1) <= log_likelihood + 1e-6).all() and (log_likelihood <= eubo.squeeze(1) + 1e-6).all()
        assert (eubo - elbo).min() > 0, "strict for draws with t < 1"


def test_single_block_draw_eubo_is_above_elbo_per_token(model, canvas):
    """With SPG's empirical rate t̂ = |S| / N, one draw gives
    ELBO / N = mean_S ℓ ≤ mean_S ℓ − log(t̂) / β = EUBO / N."""
    rollout = rollout_of(canvas)
    for seed in range(4):
        options = settings(num_samples=1, block_masking=True, block_length=BLOCK, mix_weight=1.0)
        elbo = DIFFUSION_ESTIMATORS["spg"].logprobs(model, rollout, options, seed, False, torch.ones(3))
        eubo = DIFFUSION_ESTIMATORS["spg"].logprobs(model, rollout, options, seed, False, -torch.ones(3))
        assert (eubo[VALID] >= elbo[VALID] - 1e-6).all()


def test_spg_gradient_is_finite_and_reaches_the_model(model, canvas):
    rollout = rollout_of(canvas)
    options = settings(num_samples=2, block_masking=True, block_length=BLOCK, mix_weight=0.5)
    advantages = torch.tensor([1.0, -1.0, -1.0])
    values, entropy = DIFFUSION_ESTIMATORS["spg"].logprobs(model, rollout, options, 3, True, advantages)
    values[VALID].sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads) and sum(g.abs().sum() for g in grads) > 0
    model.zero_grad()
    per_sequence = [entropy[row][VALID[row]] for row in range(3)]
    assert all(torch.equal(e, e[:1].expand_as(e)) and (e > 0).all() for e in per_sequence)
    assert (entropy[~VALID] == 0).all()


def test_spg_needs_advantages_and_draw_and_bound_settings_are_checked(model, canvas):
    rollout = rollout_of(canvas)
    with pytest.raises(ValueError, match="advantage"):
        DIFFUSION_ESTIMATORS["spg"].logprobs(model, rollout, settings(), 0, False, None)
    with pytest.raises(ValueError, match="block_length"):
        DIFFUSION_ESTIMATORS["spg"].logprobs(model, rollout, settings(block_masking=True), 0, False, torch.ones(3))
    with pytest.raises(ValueError, match="beta"):
        eubo_from_draws([torch.zeros(1, 2)], random_mask_draws(1, 2, 1, mask_generator(0)), beta=0.5)
    torch.testing.assert_close(spread_over_tokens(torch.tensor([6.0, 3.0, 2.0]), VALID).sum(1),
                               torch.tensor([6.0, 3.0, 2.0]))
    draws = random_mask_draws(2, 3, 1, mask_generator(0))
    assert elbo_from_draws([torch.zeros(2, 3)], draws).shape == (2,)


def test_config_rules_for_sequence_estimators(tmp_path):
    base = dict(output_dir=str(tmp_path))
    assert not GRPOConfig(**base, likelihood={"estimator": "spg"}).problems()
    ctpo = GRPOConfig(**base, likelihood={"estimator": "elbo"}, experimental={"ratio_type": "ctpo"}).problems()
    assert any("sequence-level" in problem and "ratio_type=token" in problem for problem in ctpo)
    coupled = GRPOConfig(**base, likelihood={"estimator": "spg"}, experimental={"elbo_coupled": True}).problems()
    assert any("spg_block_masking" in problem for problem in coupled)
    assert not GRPOConfig(**base, likelihood={"estimator": "spg", "spg_block_masking": False},
                          experimental={"elbo_coupled": True}).problems()
    assert GRPOConfig(**base, likelihood={"spg_eubo_beta": 0.5}).problems()
