"""Backward per forward: the trajectory-type estimators' pieces and the GRPO loss summed token group by token group
give the gradients, loss and metrics of the all-at-once pass; StepMerge's rollout side and config rules."""

import pytest
import torch

from dllm_ais.choices import TRAJECTORY_ESTIMATORS
from dllm_ais.config import GRPOConfig, LikelihoodSettings
from dllm_ais.grpo import backward_by_pieces
from dllm_ais.likelihood import DIFFUSION_ESTIMATORS, EstimatorSettings, whole_piece
from dllm_ais.loss import TokenLoss, grpo_loss
from conftest import bare_tiny_llada
from dllm_ais.policy import DiffusionPolicy
from dllm_ais.sampling.diffusion import DiffusionSamplerConfig, MaskedDiffusionSampler

MASK, EOS = 127, 126


@pytest.fixture(scope="module")
def model():
    return bare_tiny_llada(MASK, EOS)


@pytest.fixture(scope="module")
def rollout(model):
    """Four random-order rollouts of 8 tokens in 4 steps, the second prompt left padded; the last two tokens of the
    first row past the completion mask."""
    torch.manual_seed(3)
    ids = torch.randint(0, 126, (4, 5))
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :2] = 0
    sampler = MaskedDiffusionSampler(DiffusionSamplerConfig(gen_length=8, block_length=4, steps=4, temperature=0.9,
                                                            mask_token_id=MASK, remasking="random"))
    sampled = sampler.sample(model, ids, attention_mask=attention_mask, generator=torch.Generator().manual_seed(0))
    sampled.completion_mask[0, 6:] = False
    return sampled


def loss_inputs(logp: torch.Tensor, beta: float) -> dict:
    """ℓ_old, ℓ_ref, advantages and weights around `logp` such that some tokens clip on either side."""
    generator = torch.Generator().manual_seed(5)
    noise = lambda: 0.4 * torch.randn(logp.shape, generator=generator)  # noqa: E731
    return dict(logp_old=logp.detach() + noise(), advantages=torch.tensor([1.0, -0.5, 0.7, -1.2]),
                weights=torch.rand(logp.shape, generator=generator) + 0.5, logp_ref=logp.detach() + noise(),
                beta=beta, epsilon=0.2, max_completion_length=8, num_items_in_batch=20.0)


def gradients(model) -> list[torch.Tensor]:
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("estimator, segments, forwards", [("trajectory", 16, 4), ("step_merge", 2, 2)])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_backward_per_piece_gives_the_all_at_once_gradient_loss_metrics_and_entropy(model, rollout, estimator,
                                                                                    segments, forwards, loss_type):
    scorer = DIFFUSION_ESTIMATORS[estimator]
    settings = EstimatorSettings(MASK, 0.9, likelihood_segments=segments)
    model.zero_grad(set_to_none=True)
    logp, entropy = scorer.logprobs(model, rollout, settings, 0, True)
    inputs = loss_inputs(logp, beta=0.04)
    old, advantages = inputs.pop("logp_old"), inputs.pop("advantages")
    loss, metrics = grpo_loss(logp, old, advantages, rollout.completion_mask, loss_type=loss_type, **inputs)
    loss.backward()
    expected = gradients(model)
    assert 0 < metrics["clip_ratio/region_mean"] < 1 and metrics["kl"] > 0

    objective = TokenLoss(old, advantages, rollout.completion_mask, loss_type=loss_type, **inputs)
    events = []
    handle = model.register_forward_pre_hook(lambda module, args: events.append("forward"))
    try:
        done = backward_by_pieces(scorer.logprob_pieces(model, rollout, settings, 0, True), objective,
                                  rollout.completion_mask, lambda piece_loss: (events.append("backward"),
                                                                               piece_loss.backward()), True)
    finally:
        handle.remove()
    assert events == ["forward", "backward"] * forwards  # one per step or segment: never two forwards in one graph
    for got, want in zip(gradients(model), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(done.loss, loss.detach(), rtol=1e-6, atol=1e-8)
    assert objective.metrics(done.metric_sums) == pytest.approx(metrics, rel=1e-6, abs=1e-7)
    torch.testing.assert_close(done.entropy, entropy)
    assert done.finite_logprobs and done.finite_loss


def test_a_non_finite_piece_is_reported_and_still_backpropagated(model, rollout):
    settings = EstimatorSettings(MASK, 0.9, likelihood_segments=2)
    pieces = list(DIFFUSION_ESTIMATORS["step_merge"].logprob_pieces(model, rollout, settings, 0, False))
    pieces[1].logprobs.data[pieces[1].positions] = -torch.inf
    logp = sum(piece.logprobs.detach() for piece in pieces)
    objective = TokenLoss(logp, torch.ones(4), rollout.completion_mask, loss_type="bnpo")
    calls = []
    done = backward_by_pieces(pieces, objective, rollout.completion_mask, calls.append, False)
    assert len(calls) == 2 and not done.finite_logprobs


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_token_loss_over_a_partition_of_the_tokens_sums_to_grpo_loss(loss_type):
    torch.manual_seed(0)
    logp, logp_old = -torch.rand(3, 7), -torch.rand(3, 7)
    mask = torch.rand(3, 7) > 0.2
    logp[~mask] = torch.nan  # never read
    settings = dict(logp_ref=-torch.rand(3, 7), beta=0.1, weights=torch.rand(3, 7), clip_scale=1 + torch.rand(3, 7),
                    loss_type=loss_type, max_completion_length=7, num_items_in_batch=12.0)
    loss, metrics = grpo_loss(logp, logp_old, torch.tensor([1.0, -1.0, 0.5]), mask, **settings)
    objective = TokenLoss(logp_old, torch.tensor([1.0, -1.0, 0.5]), mask, **settings)
    part = torch.randint(0, 3, (3, 7))
    results = [objective(torch.where(part == p, logp, 7.0), part == p) for p in range(3)]  # 7.0: outside, unread
    torch.testing.assert_close(sum(r[0] for r in results), loss)
    sums = {name: sum(r[1][name] for r in results) for name in results[0][1]}
    assert objective.metrics(sums) == pytest.approx(metrics)


def test_ctpo_ratio_takes_the_whole_completion_in_one_piece():
    mask = torch.ones(2, 4, dtype=torch.bool)
    objective = TokenLoss(torch.zeros(2, 4), torch.ones(2), mask, ratio_type="ctpo")
    objective(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="ctpo"):
        objective(torch.zeros(2, 4), positions=torch.eye(2, 4, dtype=torch.bool))


def test_single_forward_estimators_come_as_one_piece(model, rollout):
    settings = EstimatorSettings(MASK, 0.9)
    (piece,) = DIFFUSION_ESTIMATORS["one_step"].logprob_pieces(model, rollout, settings, 3, False)
    assert piece.positions.all()
    torch.testing.assert_close(piece.logprobs, DIFFUSION_ESTIMATORS["one_step"].logprobs(model, rollout, settings, 3,
                                                                                         False))
    assert whole_piece(piece.logprobs, False).positions.all()


@pytest.mark.parametrize("segments, recorded", [(4, True), (9, True), (2, False)])
def test_step_merge_rollout_side_is_the_samplers_record_only_with_a_segment_per_step(model, rollout, segments,
                                                                                     recorded):
    config = DiffusionSamplerConfig(gen_length=8, block_length=4, steps=4, temperature=0.9, mask_token_id=MASK)
    policy = DiffusionPolicy(config, LikelihoodSettings("step_merge", segments=segments))
    rollout_side = policy.rollout_logprobs(model, rollout, seed=0)
    assert (rollout_side is rollout.step_logprobs) == recorded
    torch.testing.assert_close(rollout_side, policy.logprobs(model, rollout, seed=0),
                               atol=1e-5 if recorded else 0, rtol=0)


def test_trajectory_type_estimators_share_the_exact_order_replay_and_score_guidance_as_sampled():
    config = DiffusionSamplerConfig(gen_length=8, block_length=4, steps=4, mask_token_id=MASK)
    for estimator in TRAJECTORY_ESTIMATORS:
        policy = DiffusionPolicy(config, LikelihoodSettings(estimator), likelihood_order="exact")
        assert policy.exact_order_sampler is not None
        likelihood = {"estimator": estimator}
        assert GRPOConfig(likelihood=likelihood, experimental={"likelihood_order": "exact"}).problems() == []
        assert GRPOConfig(likelihood=likelihood, rollout={"cfg_scale": 1.0}).problems() == []  # scored through the sampler
    assert any("likelihood_order=exact orders" in p for p in
               GRPOConfig(likelihood={"estimator": "one_step"}, experimental={"likelihood_order": "exact"}).problems())
    assert any("likelihood.segments" in p for p in GRPOConfig(likelihood={"segments": 0}).problems())
    assert {name for name, e in DIFFUSION_ESTIMATORS.items() if e.pieces is not None} == set(TRAJECTORY_ESTIMATORS)


def test_a_backward_per_forward_across_processes_only_when_every_process_has_the_same_forwards():
    from dllm_ais.grpo import pieces_align_across_processes

    assert pieces_align_across_processes(GRPOConfig(likelihood={"estimator": "trajectory"}))  # the fixed schedule
    assert pieces_align_across_processes(GRPOConfig(likelihood={"estimator": "trajectory"}, rollout={"cache": "dual"}))
    assert not pieces_align_across_processes(GRPOConfig(likelihood={"estimator": "trajectory"},
                                                        rollout={"threshold": 0.9}))
    assert not pieces_align_across_processes(GRPOConfig(likelihood={"estimator": "trajectory"},
                                                        experimental={"rollout_factor": 1.0}))
    assert pieces_align_across_processes(GRPOConfig(likelihood={"estimator": "trajectory"}, rollout={"threshold": 0.9},
                                                    experimental={"likelihood_order": "exact"}))  # replayed on the fixed schedule
    assert pieces_align_across_processes(GRPOConfig(likelihood={"estimator": "trajectory"},
                                                    rollout={"threshold": 0.9, "cache": "dual"}))  # the decoder replay: a piece per block
    assert not pieces_align_across_processes(GRPOConfig(likelihood={"estimator": "trajectory"},
                                                        rollout={"threshold": 0.9, "cache": "dual"},
                                                        experimental={"likelihood_decoder": "exact"}))
