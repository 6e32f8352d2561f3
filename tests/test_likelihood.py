"""Likelihood stage on a tiny LLaDA: chunked log-softmax, one-step surrogate, trajectory replay, StepMerge, MC ELBO."""

from contextlib import contextmanager
from functools import partial

import pytest
import torch

from dllm_ais.likelihood import (
    mc_elbo,
    merges_no_steps,
    one_step_logprobs,
    one_step_masked_input,
    selective_log_softmax,
    shape_logits,
    step_merge_logprobs,
    step_merge_segments,
    trajectory_logprobs,
)
from conftest import bare_tiny_llada
from dllm_ais.sampling.rollout import Rollout

MASK, EOS = 127, 126
PROMPT_LENGTH, GEN_LENGTH = 5, 6


@pytest.fixture(scope="module")
def model():
    return bare_tiny_llada(MASK, EOS)


@pytest.fixture(scope="module")
def canvas():
    """Three [prompt | completion] sequences; prompts left-padded by 0, 2 and 4 EOS tokens."""
    torch.manual_seed(1)
    sequences = torch.randint(0, 126, (3, PROMPT_LENGTH + GEN_LENGTH))
    attention_mask = torch.ones_like(sequences)
    for row, pad in enumerate((0, 2, 4)):
        attention_mask[row, :pad] = 0
        sequences[row, :pad] = EOS
    return sequences, attention_mask


@contextmanager
def counting_forwards(model):
    """Yield a list that gets one entry per call of `model`."""
    calls = []
    handle = model.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        yield calls
    finally:
        handle.remove()


def completion_logprobs(model, noisy, attention_mask, targets, temperature=0.0):
    """Naive reference: full float32 log_softmax(logits / τ) at the completion positions, gathered at targets."""
    logits = model(input_ids=noisy, attention_mask=attention_mask).logits[:, PROMPT_LENGTH:].float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


# ---------------------------------------------------------------------------------------------
# selective_log_softmax / shape_logits
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_size", [1, 4, 7, 21, 512])
def test_selective_log_softmax_equals_naive_gather(dtype, chunk_size):
    torch.manual_seed(0)
    logits = (3 * torch.randn(3, 7, 50)).to(dtype)  # N = 21 rows: 4 does not divide it, 7 and 21 do
    targets = torch.randint(0, 50, (3, 7))
    expected = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    got = selective_log_softmax(logits, targets, chunk_size=chunk_size)
    assert got.dtype == torch.float32 and got.shape == (3, 7)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_selective_log_softmax_gradient_equals_naive():
    torch.manual_seed(0)
    logits = torch.randn(4, 5, 30, dtype=torch.float64)
    kept_by_top_k = logits.topk(10, dim=-1).indices
    targets = kept_by_top_k.gather(-1, torch.randint(0, 10, (4, 5, 1))).squeeze(-1)
    weights = torch.randn(4, 5)
    process = partial(shape_logits, temperature=0.7, top_k=10)

    chunked = logits.clone().requires_grad_()
    (selective_log_softmax(chunked, targets, chunk_size=3, process_logits=process) * weights).sum().backward()
    naive = logits.clone().requires_grad_()
    log_probs = torch.log_softmax(process(naive.float()), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (log_probs * weights).sum().backward()
    assert chunked.grad.abs().sum() > 0
    torch.testing.assert_close(chunked.grad, naive.grad, atol=1e-5, rtol=0)


def test_selective_log_softmax_of_no_rows_is_zeros_still_in_the_logits_graph():
    """No rows to score (a step writing nothing on this process): zeros, float32, whose backward still reaches the
    forward that made the logits (under FSDP2 every process must run that backward)."""
    logits = torch.randn(2, 3, 7, requires_grad=True)
    none = torch.zeros(2, 3, dtype=torch.bool)
    values, entropy = selective_log_softmax(logits[none], torch.zeros(0, dtype=torch.long), compute_entropy=True)
    assert values.shape == entropy.shape == (0,) and values.dtype == torch.float32 and not entropy.requires_grad
    reached = []
    logits.register_hook(reached.append)
    values.sum().backward()
    assert len(reached) == 1 and not reached[0].any()


def test_selective_log_softmax_keeps_at_most_one_float32_chunk_for_backward():
    """Under grad, the tensors autograd keeps never include a float32 copy of all [N, V] logits."""
    logits = torch.randn(64, 200, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 200, (64,))
    saved_float32_bytes = []

    def pack(tensor):
        if tensor.dtype == torch.float32:
            saved_float32_bytes.append(tensor.numel() * 4)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        naive = torch.log_softmax(logits.float(), dim=-1)[torch.arange(64), targets]
    assert sum(saved_float32_bytes) >= 64 * 200 * 4, "the hook must see the naive version's float32 activations"
    saved_float32_bytes.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        values = selective_log_softmax(logits, targets, chunk_size=16)
    assert sum(saved_float32_bytes) <= 16 * 200 * 4
    torch.testing.assert_close(values, naive.detach(), atol=1e-5, rtol=0)
    values.sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_shape_logits_temperature_then_top_k_then_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -3.0]]).repeat(2, 3, 1)  # any [..., V] shape
    original = logits.clone()
    assert torch.equal(shape_logits(logits, temperature=0.0), logits)
    torch.testing.assert_close(shape_logits(logits, temperature=0.5), logits * 2)
    top2 = shape_logits(logits, temperature=1.0, top_k=2)
    assert torch.isfinite(top2[..., :2]).all() and torch.isneginf(top2[..., 2:]).all()
    # probabilities of [2, 1, 0, -1, -3]: 0.638, 0.235, 0.086, ...; top_p = 0.8 keeps the smallest set with mass ≥ 0.8
    top_p = shape_logits(logits, temperature=1.0, top_p=0.8)
    assert torch.isfinite(top_p[..., :2]).all() and torch.isneginf(top_p[..., 2:]).all()
    # τ = 0.25 sharpens before top-p: the first token alone then holds > 0.98 of the mass
    sharp = shape_logits(logits, temperature=0.25, top_k=3, top_p=0.9)
    assert torch.isfinite(sharp[..., 0]).all() and torch.isneginf(sharp[..., 1:]).all()
    assert torch.equal(logits, original)


@pytest.mark.parametrize("bad", [
    dict(temperature=-1.0), dict(top_k=-2), dict(top_k=1.5), dict(top_k=True), dict(top_p=0.0), dict(top_p=1.1),
])
def test_shape_logits_rejects_bad_parameters(bad):
    with pytest.raises(ValueError):
        shape_logits(torch.zeros(2, 5), **bad)


# ---------------------------------------------------------------------------------------------
# One-step surrogate
# ---------------------------------------------------------------------------------------------
def test_one_step_masks_come_from_the_seed(canvas):
    sequences, attention_mask = canvas
    first = one_step_masked_input(sequences, attention_mask, PROMPT_LENGTH, MASK, seed=3, p_mask_prompt=0.5)
    again = one_step_masked_input(sequences, attention_mask, PROMPT_LENGTH, MASK, seed=3, p_mask_prompt=0.5)
    other = one_step_masked_input(sequences, attention_mask, PROMPT_LENGTH, MASK, seed=4, p_mask_prompt=0.5)
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert (first[:, PROMPT_LENGTH:] == MASK).all()
    torch.manual_seed(0)
    global_state = torch.get_rng_state()
    one_step_masked_input(sequences, attention_mask, PROMPT_LENGTH, MASK, seed=3)
    assert torch.equal(torch.get_rng_state(), global_state), "the global RNG must not be consumed"


def test_one_step_equals_hand_computation(model, canvas):
    sequences, attention_mask = canvas
    draws = torch.rand((3, PROMPT_LENGTH), generator=torch.Generator().manual_seed(11))
    noisy = sequences.clone()
    noisy[:, :PROMPT_LENGTH][(draws < 0.4) & attention_mask[:, :PROMPT_LENGTH].bool()] = MASK
    noisy[:, PROMPT_LENGTH:] = MASK
    expected = completion_logprobs(model, noisy, attention_mask, sequences[:, PROMPT_LENGTH:])
    got = one_step_logprobs(model, sequences, attention_mask, PROMPT_LENGTH, MASK, seed=11, p_mask_prompt=0.4)
    assert got.shape == (3, GEN_LENGTH) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    again = one_step_logprobs(model, sequences, attention_mask, PROMPT_LENGTH, MASK, seed=11, p_mask_prompt=0.4)
    other = one_step_logprobs(model, sequences, attention_mask, PROMPT_LENGTH, MASK, seed=12, p_mask_prompt=0.4)
    assert torch.equal(got, again) and not torch.allclose(got, other)
    with counting_forwards(model) as calls:
        scored, entropy = one_step_logprobs(model, sequences, attention_mask, PROMPT_LENGTH, MASK, seed=11,
                                            p_mask_prompt=0.4, compute_entropy=True)
    assert len(calls) == 1 and torch.equal(scored, got)
    torch.testing.assert_close(entropy, completion_entropy(model, noisy, attention_mask), atol=1e-5, rtol=0)


def test_one_step_never_masks_padding(canvas):
    sequences, attention_mask = canvas
    noisy = one_step_masked_input(sequences, attention_mask, PROMPT_LENGTH, MASK, seed=0, p_mask_prompt=1.0)
    prompt_real = attention_mask[:, :PROMPT_LENGTH].bool()
    assert (noisy[:, :PROMPT_LENGTH][prompt_real] == MASK).all()
    assert (noisy[:, :PROMPT_LENGTH][~prompt_real] == EOS).all()


def test_one_step_prompt_mask_rate_matches_probability():
    sequences = torch.randint(0, 126, (200, 110))
    attention_mask = torch.ones_like(sequences)
    attention_mask[:100, :20] = 0  # half the rows have 20 padding positions
    noisy = one_step_masked_input(sequences, attention_mask, 100, MASK, seed=5, p_mask_prompt=0.15)
    real = attention_mask[:, :100].bool()
    rate = (noisy[:, :100][real] == MASK).float().mean().item()  # 18,000 real prompt tokens: σ ≈ 0.0027
    assert abs(rate - 0.15) < 0.012


def test_one_step_gradient_flows(model, canvas):
    sequences, attention_mask = canvas
    model.zero_grad()
    values = one_step_logprobs(model, sequences, attention_mask, PROMPT_LENGTH, MASK, seed=1)
    assert values.requires_grad
    values.mean().backward()
    first_query = model.model.transformer.blocks[0].q_proj.weight.grad
    assert first_query is not None and first_query.abs().sum() > 0
    model.zero_grad()


# ---------------------------------------------------------------------------------------------
# Trajectory estimator
# ---------------------------------------------------------------------------------------------
def hand_rollout(canvas) -> Rollout:
    sequences, attention_mask = canvas
    commit_step = torch.tensor([[0, 0, 1, 1, 2, 3], [2, 0, 3, 1, 0, 2], [1, 1, 0, 0, 3, 3]])
    return Rollout(sequences=sequences, attention_mask=attention_mask,
                   completion_mask=torch.ones_like(commit_step).bool(), step_logprobs=torch.zeros(3, GEN_LENGTH),
                   commit_step=commit_step, prompt_length=PROMPT_LENGTH)


def completion_entropy(model, noisy, attention_mask, temperature=0.0):
    """Naive reference: the entropy of softmax(logits / τ) at each completion position."""
    logits = model(input_ids=noisy, attention_mask=attention_mask).logits[:, PROMPT_LENGTH:].float()
    log_probabilities = torch.log_softmax(logits / temperature if temperature > 0 else logits, dim=-1)
    return -(log_probabilities.exp() * log_probabilities).sum(-1)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_trajectory_equals_hand_replay(model, canvas, temperature):
    rollout = hand_rollout(canvas)
    completion = rollout.completion_ids
    expected = torch.zeros(3, GEN_LENGTH)
    expected_entropy = torch.zeros(3, GEN_LENGTH)
    for step in range(4):
        noisy = rollout.sequences.clone()
        noisy[:, PROMPT_LENGTH:][rollout.commit_step >= step] = MASK
        values = completion_logprobs(model, noisy, rollout.attention_mask, completion, temperature)
        expected = torch.where(rollout.commit_step == step, values, expected)
        entropy = completion_entropy(model, noisy, rollout.attention_mask, temperature)
        expected_entropy = torch.where(rollout.commit_step == step, entropy, expected_entropy)
    for steps_per_forward in (1, 3, 4):
        got = trajectory_logprobs(model, rollout, MASK, temperature, steps_per_forward=steps_per_forward)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    with counting_forwards(model) as calls:
        got, entropy = trajectory_logprobs(model, rollout, MASK, temperature, steps_per_forward=4, compute_entropy=True)
    assert len(calls) == 1  # the entropy comes from the same forward
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, expected_entropy, atol=1e-5, rtol=0)


def test_trajectory_runs_one_forward_per_batch_of_steps(model, canvas):
    rollout = hand_rollout(canvas)
    with counting_forwards(model) as calls:
        trajectory_logprobs(model, rollout, MASK, 0.9, steps_per_forward=3)
    assert len(calls) == 2  # 4 distinct steps, 3 per forward


@pytest.mark.parametrize("padded", [False, True])
def test_trajectory_reproduces_diffusion_sampler_logprobs(model, padded):
    from dllm_ais.sampling.diffusion import DiffusionSamplerConfig, MaskedDiffusionSampler

    torch.manual_seed(2)
    ids = torch.randint(0, 126, (3, 5))
    attention_mask = None
    if padded:
        attention_mask = torch.ones_like(ids)
        attention_mask[1, :2] = 0
        ids[1, :2] = EOS
    sampler = MaskedDiffusionSampler(DiffusionSamplerConfig(gen_length=8, block_length=4, steps=4, temperature=0.9,
                                                            mask_token_id=MASK))
    rollout = sampler.sample(model, ids, attention_mask=attention_mask, generator=torch.Generator().manual_seed(0))
    assert torch.equal(rollout.commit_step.unique(), torch.arange(4)), "4 denoising steps in all, numbered globally"
    one_at_a_time = trajectory_logprobs(model, rollout, MASK, temperature=0.9, steps_per_forward=1)
    three_at_a_time = trajectory_logprobs(model, rollout, MASK, temperature=0.9, steps_per_forward=3)
    assert one_at_a_time.shape == (3, 8)
    torch.testing.assert_close(one_at_a_time, rollout.step_logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(three_at_a_time, one_at_a_time, atol=1e-5, rtol=0)


def test_trajectory_gradient_flows(model, canvas):
    model.zero_grad()
    trajectory_logprobs(model, hand_rollout(canvas), MASK, 1.0, steps_per_forward=2).sum().backward()
    head = model.model.transformer.ff_out.weight.grad
    assert head is not None and head.abs().sum() > 0
    model.zero_grad()


# ---------------------------------------------------------------------------------------------
# Monte-Carlo ELBO
# ---------------------------------------------------------------------------------------------
def test_mc_elbo_is_a_finite_nonpositive_bound_deterministic_per_seed(model, canvas):
    sequences, attention_mask = canvas
    elbo = mc_elbo(model, sequences, attention_mask, PROMPT_LENGTH, MASK, num_samples=4, seed=0)
    assert elbo.shape == (3,) and elbo.dtype == torch.float32
    assert torch.isfinite(elbo).all() and (elbo <= 0).all()
    assert torch.equal(elbo, mc_elbo(model, sequences, attention_mask, PROMPT_LENGTH, MASK, num_samples=4, seed=0))
    other_seed = mc_elbo(model, sequences, attention_mask, PROMPT_LENGTH, MASK, num_samples=4, seed=1)
    assert not torch.allclose(elbo, other_seed)


def test_mc_elbo_single_draw_equals_hand_computation(model, canvas):
    sequences, attention_mask = canvas
    generator = torch.Generator().manual_seed(9)
    mask_rate = 1.0 - torch.rand(3, generator=generator)
    draws = torch.rand((3, GEN_LENGTH), generator=generator)
    masked = (draws < mask_rate[:, None]) | (draws == draws.min(dim=1, keepdim=True).values)
    completion = sequences[:, PROMPT_LENGTH:]
    noisy = torch.cat([sequences[:, :PROMPT_LENGTH], torch.where(masked, MASK, completion)], dim=1)
    token_logprobs = completion_logprobs(model, noisy, attention_mask, completion)
    expected = torch.where(masked, token_logprobs, 0.0).sum(1) / mask_rate
    got = mc_elbo(model, sequences, attention_mask, PROMPT_LENGTH, MASK, num_samples=1, seed=9)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-6)
    assert masked.any(dim=1).all()


# ---------------------------------------------------------------------------------------------
# Errors, raised before any forward pass
# ---------------------------------------------------------------------------------------------
def test_bad_arguments_raise_before_any_forward(model, canvas):
    sequences, attention_mask = canvas
    rollout = hand_rollout(canvas)
    uncommitted = Rollout(**{**rollout.__dict__, "commit_step": rollout.commit_step - 1})
    bad_calls = {
        "prompt_length": lambda: one_step_logprobs(model, sequences, attention_mask, 0, MASK, seed=0),
        "sequence length": lambda: mc_elbo(model, sequences, attention_mask, sequences.shape[1], MASK, 2, seed=0),
        "embedding table": lambda: one_step_logprobs(model, sequences, attention_mask, PROMPT_LENGTH, 128, seed=0),
        "mask_token_id must": lambda: trajectory_logprobs(model, rollout, None, 1.0),
        "p_mask_prompt": lambda: one_step_logprobs(model, sequences, attention_mask, PROMPT_LENGTH, MASK, 0, 1.5),
        "seed must": lambda: one_step_logprobs(model, sequences, attention_mask, PROMPT_LENGTH, MASK, seed=0.5),
        "attention_mask must": lambda: one_step_logprobs(model, sequences, attention_mask[:, 1:], PROMPT_LENGTH, MASK,
                                                         seed=0),
        "steps_per_forward": lambda: trajectory_logprobs(model, rollout, MASK, 1.0, steps_per_forward=0),
        "never committed": lambda: trajectory_logprobs(model, uncommitted, MASK, 1.0),
        "temperature": lambda: trajectory_logprobs(model, rollout, MASK, -1.0),
        "num_samples": lambda: mc_elbo(model, sequences, attention_mask, PROMPT_LENGTH, MASK, 0, seed=0),
    }
    with counting_forwards(model) as calls:
        for message, call in bad_calls.items():
            with pytest.raises(ValueError, match=message):
                call()
    assert not calls


# ---------------------------------------------------------------------------------------------
# StepMerge (d2)
# ---------------------------------------------------------------------------------------------
def test_step_merge_segments_split_each_rows_steps_into_contiguous_near_equal_segments():
    # row 0: 10 steps 0..9; row 1: parallel decoding left it the global steps 0, 2, 5, 9 (4 of its own)
    commit_step = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [0, 0, 2, 2, 2, 5, 9, 9, 5, 0]])
    segments = step_merge_segments(commit_step, 4)
    assert segments[0].tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 3, 3]  # ⌊r·4/10⌋: 3, 2, 3, 2 steps
    assert segments[1].tolist() == [0, 0, 1, 1, 1, 2, 3, 3, 2, 0]  # its 4 steps, one segment each
    assert step_merge_segments(commit_step, 1).eq(0).all()
    assert torch.equal(step_merge_segments(commit_step, 10)[0], commit_step[0])
    assert not merges_no_steps(commit_step, 4) and merges_no_steps(commit_step, 10)
    with pytest.raises(ValueError, match="segments"):
        step_merge_segments(commit_step, 0)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_step_merge_equals_hand_replay_of_segment_start_canvases(model, canvas, temperature):
    """Two segments of the hand rollout's 4 steps: steps {0, 1} scored at the step-0 canvas, {2, 3} at step 2's."""
    rollout = hand_rollout(canvas)
    completion = rollout.completion_ids
    expected = torch.zeros(3, GEN_LENGTH)
    for first_step, steps in ((0, (0, 1)), (2, (2, 3))):
        noisy = rollout.sequences.clone()
        noisy[:, PROMPT_LENGTH:][rollout.commit_step >= first_step] = MASK
        values = completion_logprobs(model, noisy, rollout.attention_mask, completion, temperature)
        inside = (rollout.commit_step == steps[0]) | (rollout.commit_step == steps[1])
        expected = torch.where(inside, values, expected)
    with counting_forwards(model) as calls:
        got = step_merge_logprobs(model, rollout, MASK, temperature, num_segments=2)
    assert len(calls) == 2
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    with counting_forwards(model) as calls:  # both segments' canvases stacked in one forward: the same values
        stacked = step_merge_logprobs(model, rollout, MASK, temperature, num_segments=2, segments_per_forward=2)
    assert len(calls) == 1
    torch.testing.assert_close(stacked, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_step_merge_with_a_segment_per_step_is_the_trajectory_and_one_segment_the_unmasked_prompt_one_step(
        model, canvas, temperature):
    rollout = hand_rollout(canvas)
    trajectory, trajectory_entropy = trajectory_logprobs(model, rollout, MASK, temperature, compute_entropy=True)
    for segments in (4, 7):
        merged, entropy = step_merge_logprobs(model, rollout, MASK, temperature, segments, compute_entropy=True)
        torch.testing.assert_close(merged, trajectory, atol=1e-6, rtol=0)
        torch.testing.assert_close(entropy, trajectory_entropy, atol=1e-6, rtol=0)
    # N = 1: every token scored at the fully masked completion, the prompt as it is (d1 with p_mask_prompt = 0)
    noisy = rollout.sequences.clone()
    noisy[:, PROMPT_LENGTH:] = MASK
    expected = completion_logprobs(model, noisy, rollout.attention_mask, rollout.completion_ids, temperature)
    one_segment = step_merge_logprobs(model, rollout, MASK, temperature, num_segments=1)
    torch.testing.assert_close(one_segment, expected, atol=1e-5, rtol=0)
    if temperature == 0.0:
        sequences, attention_mask = canvas
        one_step = one_step_logprobs(model, sequences, attention_mask, PROMPT_LENGTH, MASK, seed=0, p_mask_prompt=0.0)
        torch.testing.assert_close(one_segment, one_step, atol=1e-6, rtol=0)


@pytest.mark.parametrize("remasking, threshold", [("random", None), ("low_confidence", 0.007)])
def test_step_merge_on_sampled_random_order_and_parallel_commit_rollouts(model, remasking, threshold):
    """Rollouts of the sampler in random order, and with parallel commits (rows take different steps): N ≥ the steps
    gives the sampler's record; fewer segments run N forwards and score every token at its segment's start."""
    from dllm_ais.sampling.diffusion import DiffusionSamplerConfig, MaskedDiffusionSampler

    torch.manual_seed(3)
    ids = torch.randint(0, 126, (4, 5))
    sampler = MaskedDiffusionSampler(DiffusionSamplerConfig(gen_length=8, block_length=4, steps=8, temperature=0.9,
                                                            mask_token_id=MASK, remasking=remasking,
                                                            threshold=threshold))
    rollout = sampler.sample(model, ids, generator=torch.Generator().manual_seed(0))
    steps = rollout.num_steps
    if threshold is not None:  # on this model's confidences: 3 or 4 steps, a row skipping global step 1
        assert (steps < 8).all() and steps.unique().numel() > 1, "parallel commits: rows take different steps"
    exact = step_merge_logprobs(model, rollout, MASK, 0.9, num_segments=int(steps.max()))
    torch.testing.assert_close(exact, rollout.step_logprobs, atol=1e-5, rtol=0)
    segments = step_merge_segments(rollout.commit_step, 2)
    with counting_forwards(model) as calls:
        merged = step_merge_logprobs(model, rollout, MASK, 0.9, num_segments=2)
    assert len(calls) == 2
    for segment in range(2):
        rows, columns = (segments == segment).nonzero(as_tuple=True)
        first_step = torch.where(segments == segment, rollout.commit_step, 10**6).min(dim=1).values
        noisy = rollout.sequences.clone()
        noisy[:, 5:][rollout.commit_step >= first_step.unsqueeze(1)] = MASK
        logits = model(input_ids=noisy).logits[:, 5:].float() / 0.9
        values = torch.log_softmax(logits, -1).gather(-1, rollout.completion_ids.unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(merged[rows, columns], values[rows, columns], atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------
# The trajectory scored by the rollout decoder itself (likelihood_decoder=rollout)
# ---------------------------------------------------------------------------------------------
def decoder_sampler(**settings):
    from dllm_ais.sampling.diffusion import DiffusionSamplerConfig, MaskedDiffusionSampler

    settings = {"gen_length": 8, "block_length": 4, "steps": 4, **settings}
    return MaskedDiffusionSampler(DiffusionSamplerConfig(temperature=0.9, mask_token_id=MASK, **settings))


@pytest.mark.parametrize("settings", [dict(cache="dual"), dict(cache="prefix"), dict(cache="dual", threshold=0.007),
                                      dict(cache="dual", steps=8, cache_refresh_interval=2), dict(threshold=0.007)])
def test_decoder_replay_reproduces_the_cached_samplers_record(model, settings):
    """The replay recomputes each token's logits as sampling did (cache, refreshes, parallel commits): the sampler's
    recorded log-probs exactly, for rows sampled in two calls (other global step numbers) and replayed together."""
    from dllm_ais.likelihood import decoder_trajectory_pieces, sum_pieces

    sampler = decoder_sampler(**settings)
    torch.manual_seed(4)
    ids = torch.randint(0, 126, (4, 5))
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :2] = 0
    ids[1, :2] = EOS
    generator = torch.Generator().manual_seed(0)
    rollout = Rollout.concatenate([sampler.sample(model, ids[:2], attention_mask[:2], generator),
                                   sampler.sample(model, ids[2:], attention_mask[2:], generator)])
    replayed = sum_pieces(decoder_trajectory_pieces(model, rollout, sampler.decoder_logits, 0.9), False)
    torch.testing.assert_close(replayed, rollout.step_logprobs, atol=1e-5, rtol=0)
    if "cache" in settings:  # the exact model's replay differs: that difference is what the cache costs
        assert (trajectory_logprobs(model, rollout, MASK, 0.9) - rollout.step_logprobs).abs().max() > 1e-3


def test_decoder_replay_without_cache_is_the_trajectory_and_its_gradient_flows_through_the_cache(model, canvas):
    from dllm_ais.likelihood import decoder_trajectory_pieces, sum_pieces

    rollout = hand_rollout(canvas)
    plain = decoder_sampler(gen_length=GEN_LENGTH, block_length=GEN_LENGTH, steps=4)
    with counting_forwards(model) as calls:
        pieces = list(decoder_trajectory_pieces(model, rollout, plain.decoder_logits, 0.8))
    assert len(pieces) == 1 and len(calls) == 4, "one piece per block, one forward per step"
    torch.testing.assert_close(sum_pieces(pieces, False), trajectory_logprobs(model, rollout, MASK, 0.8),
                               atol=1e-5, rtol=0)
    cached = decoder_sampler(gen_length=GEN_LENGTH, block_length=GEN_LENGTH, steps=4, cache="dual")
    model.zero_grad()
    sum_pieces(decoder_trajectory_pieces(model, rollout, cached.decoder_logits, 0.8), False).sum().backward()
    first_layer = model.model.transformer.blocks[0].k_proj.weight.grad  # reached through the cached keys too
    assert first_layer is not None and torch.isfinite(first_layer).all() and first_layer.abs().sum() > 0
    model.zero_grad()


# ---------------------------------------------------------------------------------------------
# Scoring a random share of the blocks (likelihood_block_fraction)
# ---------------------------------------------------------------------------------------------
def test_block_subset_draws_whole_blocks_by_seed_among_those_holding_valid_tokens():
    from dllm_ais.likelihood import BlockSubset

    subset = BlockSubset(0.5, 4)
    valid = torch.ones(2, 14, dtype=torch.bool)  # blocks of 4, 4, 4 and 2 positions: 2 of the 4 drawn
    drawn = subset.positions(valid, seed=3)
    per_block = [drawn[start:start + 4] for start in range(0, 14, 4)]
    assert all(block.all() or not block.any() for block in per_block)
    assert sum(bool(block.any()) for block in per_block) == 2
    torch.testing.assert_close(subset.positions(valid, seed=3), drawn)
    draws = [tuple(subset.positions(valid, seed=s).tolist()) for s in range(40)]
    assert len(set(draws)) == 6, "every pair of the 4 blocks, by seed"
    valid[:, 5:] = False  # rows ending in the second block: the two blocks holding valid tokens, every time
    assert all(subset.positions(valid, seed=s)[:8].all() for s in range(10))
    valid[:, 3:] = False  # one block holds valid tokens: it, and an empty one to make two
    assert all(subset.positions(valid, seed=s)[:4].all() and subset.positions(valid, seed=s).sum() in (6, 8)
               for s in range(10))
    assert BlockSubset(0.01, 4).positions(valid, seed=0).sum() == 4, "at least one block"
    assert BlockSubset(1.0, 4).positions(valid, seed=0).all()
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="likelihood_block_fraction"):
            BlockSubset(bad, 4)


def blocked_rollout(model, sampler, rows=3):
    torch.manual_seed(5)
    ids = torch.randint(0, 126, (rows, 5))
    return sampler.sample(model, ids, torch.ones_like(ids), torch.Generator().manual_seed(1))


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_scoring_a_block_subset_replays_those_blocks_steps_alone(model, cache):
    """With positions covering one block, the trajectory (exact or decoder replay) gives that block's tokens the
    values of the full replay, 0 elsewhere, and runs only the forwards of that block's steps."""
    from dllm_ais.likelihood import decoder_trajectory_pieces, sum_pieces, trajectory_pieces

    sampler = decoder_sampler(cache=cache)  # 8 tokens in 2 blocks of 4, 2 steps per block
    rollout = blocked_rollout(model, sampler)
    second_block = torch.zeros(3, 8, dtype=torch.bool)
    second_block[:, 4:] = True
    if cache == "none":
        score = partial(trajectory_pieces, model, rollout, MASK, 0.9)
    else:
        score = partial(decoder_trajectory_pieces, model, rollout, sampler.decoder_logits, 0.9)
    full = sum_pieces(score(), False)
    with counting_forwards(model) as calls:
        pieces = list(score(positions=second_block))
    assert len(calls) == 2, "the second block's two steps only"
    assert all(not piece.positions[:, :4].any() for piece in pieces)
    torch.testing.assert_close(sum_pieces(pieces, False), torch.where(second_block, full, 0.0), atol=1e-6, rtol=0)


def test_step_merge_scores_a_block_subset_with_its_segments_alone(model):
    from dllm_ais.likelihood import step_merge_pieces, sum_pieces

    rollout = blocked_rollout(model, decoder_sampler(steps=8))  # 4 steps per block
    first_block = torch.zeros(3, 8, dtype=torch.bool)
    first_block[:, :4] = True
    full = sum_pieces(step_merge_pieces(model, rollout, MASK, 0.9, num_segments=4), False)
    with counting_forwards(model) as calls:
        subset = sum_pieces(step_merge_pieces(model, rollout, MASK, 0.9, num_segments=4, positions=first_block), False)
    assert len(calls) == 2, "the two segments of the first block's four steps"
    torch.testing.assert_close(subset, torch.where(first_block, full, 0.0), atol=1e-6, rtol=0)


def test_policy_with_a_block_fraction_draws_blocks_per_iteration():
    from dllm_ais.config import LikelihoodSettings
    from dllm_ais.policy import DiffusionPolicy
    from dllm_ais.sampling.diffusion import DiffusionSamplerConfig

    config = DiffusionSamplerConfig(gen_length=8, block_length=4, steps=4, temperature=0.9, mask_token_id=MASK)
    policy = DiffusionPolicy(config, LikelihoodSettings("trajectory"), likelihood_block_fraction=0.5)
    assert policy.num_estimator_seeds(3) == 3, "a fresh draw of blocks per inner iteration"
    assert DiffusionPolicy(config, LikelihoodSettings("trajectory")).num_estimator_seeds(3) == 1
    completion_mask = torch.ones(2, 8, dtype=torch.bool)
    completion_mask[1, 6:] = False
    rollout = Rollout(sequences=torch.zeros(2, 13, dtype=torch.long), attention_mask=torch.ones(2, 13),
                      completion_mask=completion_mask, step_logprobs=torch.zeros(2, 8),
                      commit_step=torch.zeros(2, 8, dtype=torch.long), prompt_length=5)
    scored = [policy.scored_positions(rollout, seed) for seed in range(8)]
    assert all(s.sum(dim=1)[0] == 4 and not (s & ~completion_mask).any() for s in scored), "one block, valid tokens"
    assert any(s[:, :4].any() for s in scored) and any(s[:, 4:].any() for s in scored)
    with pytest.raises(ValueError, match="likelihood_block_fraction=0.5 .* likelihood.estimator=one_step"):
        DiffusionPolicy(config, LikelihoodSettings("one_step"), likelihood_block_fraction=0.5)
