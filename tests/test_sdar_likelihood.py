"""SDAR's likelihood: the training-mode forward ([x_t | x_0] under the block-diffusion mask) against the exact cache
of clean blocks, the trajectory replay against a block-by-block reference sampler, and the one-step and masked
estimators scoring each block against the clean blocks before it."""

import pytest
import torch

import dllm_ais  # noqa: F401  (registers "sdar")
from dllm_ais.likelihood import (
    DIFFUSION_ESTIMATORS,
    EstimatorSettings,
    masked_completion_logprobs,
    one_step_logprobs,
    one_step_masked_input,
    step_merge_logprobs,
    trajectory_logprobs,
    trajectory_pieces,
)
from dllm_ais.loading import load_model
from dllm_ais.models import SDARConfig, SDARForCausalLM
from dllm_ais.models.sdar import block_diffusion_inputs, block_diffusion_logits
from dllm_ais.rollout import Rollout
from test_sdar import BLOCK, MASK, OFFICIAL, PAD, left_padded

TEMPERATURE = 0.7


def official_model() -> SDARForCausalLM:
    return load_model(str(OFFICIAL), torch.float32).eval()


def tiny_model() -> SDARForCausalLM:
    torch.manual_seed(0)
    return SDARForCausalLM(SDARConfig(
        vocab_size=272, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, rope_theta=10000.0, block_size=BLOCK,
        initializer_range=0.1, mask_token_id=MASK, pad_token_id=PAD))


def random_tokens(shape, seed: int) -> torch.Tensor:
    return torch.randint(0, PAD, shape, generator=torch.Generator().manual_seed(seed))


def row_blocks(length: int):
    """The position ranges of the model's blocks over an unpadded row of `length` tokens."""
    return [torch.arange(start, min(start + BLOCK, length)) for start in range(0, length, BLOCK)]


@pytest.mark.parametrize("padded", [False, True])
def test_training_forward_equals_each_noisy_block_against_the_cache_of_the_clean_blocks_before_it(padded):
    """The doubled forward's x_t logits of block b are those of block b's noisy tokens run alone against a cache
    written by the clean canvas: the two ways of conditioning on clean context agree, per row, padding or not."""
    model = official_model()
    lengths = [11, 14] if padded else [14, 14]
    rows = [random_tokens((length,), seed) for seed, length in enumerate(lengths)]
    clean, mask = left_padded(rows)
    noisy = clean.masked_fill((torch.rand(clean.shape, generator=torch.Generator().manual_seed(5)) < 0.5)
                              & mask.bool(), MASK)
    with torch.no_grad():
        doubled = block_diffusion_logits(model, noisy, clean, mask if padded else None)
        for index, row in enumerate(rows):
            offset = clean.shape[1] - len(row)
            row_noisy = noisy[index:index + 1, offset:]
            for positions in row_blocks(len(row)):
                cache = model(row[None], use_cache=True).past_key_values
                cached = model(row_noisy[:, positions], past_key_values=cache, cache_position=positions).logits
                torch.testing.assert_close(doubled[index, offset + positions], cached[0], atol=1e-5, rtol=0)


def test_a_four_dimensional_mask_without_position_ids_is_refused():
    model = tiny_model()
    ids = random_tokens((1, 6), 0)
    input_ids, _, mask = block_diffusion_inputs(ids, ids, None, BLOCK)
    with pytest.raises(ValueError, match="needs position_ids"):
        model(input_ids, attention_mask=mask)


def reference_block_sampling(model, prompt: torch.Tensor, gen_length: int, generator: torch.Generator):
    """SDAR's sampling, written plainly, on one unpadded prompt: blocks of the model's block_size from the prompt's
    first token; each block denoised by forwards of that block alone against the cache of the finished blocks,
    sampling every masked position from softmax(logits / τ) and committing 1 or 2 of the most confident; a finished
    block's clean keys/values stored by one more forward. Returns (completion [L], step log-probs [L], global
    commit steps [L])."""
    prompt_length, total = len(prompt), len(prompt) + gen_length
    canvas = torch.cat([prompt, torch.full((gen_length,), MASK)])[None]
    logprobs, commit_step = torch.zeros(total), torch.full((total,), -1)
    step = 0
    with torch.no_grad():
        cache = model(canvas, use_cache=True).past_key_values
        for positions in row_blocks(total):
            if positions[-1] < prompt_length:
                continue
            while (masked := canvas[0, positions] == MASK).any():
                logits = model(canvas[:, positions], past_key_values=cache, cache_position=positions).logits[0]
                scores = (logits / TEMPERATURE).log_softmax(-1)
                proposal = torch.multinomial(scores.exp(), 1, generator=generator).squeeze(1)
                chosen_logprobs = scores.gather(1, proposal[:, None]).squeeze(1)
                count = 1 + int(torch.randint(0, 2, (), generator=generator))
                chosen = torch.where(masked, chosen_logprobs, -torch.inf).topk(min(count, int(masked.sum()))).indices
                canvas[0, positions[chosen]] = proposal[chosen]
                logprobs[positions[chosen]], commit_step[positions[chosen]] = chosen_logprobs[chosen], step
                step += 1
            model(canvas[:, positions], past_key_values=cache, cache_position=positions)
    return canvas[0, prompt_length:], logprobs[prompt_length:], commit_step[prompt_length:]


def reference_rollout(model, prompt_lengths=(5, 7), gen_length=10, seed=0) -> Rollout:
    """A left-padded batch of rollouts of `reference_block_sampling`, one prompt per length."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [random_tokens((length,), seed + length) for length in prompt_lengths]
    sampled = [reference_block_sampling(model, prompt, gen_length, generator) for prompt in prompts]
    sequences, attention_mask = left_padded([torch.cat([prompt, completion])
                                             for prompt, (completion, _, _) in zip(prompts, sampled)])
    return Rollout(sequences=sequences, attention_mask=attention_mask,
                   completion_mask=torch.ones(len(prompts), gen_length, dtype=torch.bool),
                   step_logprobs=torch.stack([logprobs for _, logprobs, _ in sampled]),
                   commit_step=torch.stack([steps for _, _, steps in sampled]),
                   prompt_length=sequences.shape[1] - gen_length)


def test_trajectory_replay_reproduces_the_block_by_block_sampler_in_one_forward_per_round():
    """Every token's recorded log-prob comes back from the training-mode replay (through the registry too, and from
    StepMerge with a segment per step), and the replay takes one forward per round — as many as the most steps one
    block took — not one per step."""
    model = official_model()
    rollout = reference_rollout(model)
    assert bool((rollout.commit_step >= 0).all())
    with torch.no_grad():
        replayed = trajectory_logprobs(model, rollout, MASK, TEMPERATURE)
        settings = EstimatorSettings(mask_token_id=MASK, temperature=TEMPERATURE)
        registered = DIFFUSION_ESTIMATORS["trajectory"].logprobs(model, rollout, settings, 0, False)
        pieces = list(trajectory_pieces(model, rollout, MASK, TEMPERATURE))
        merged = step_merge_logprobs(model, rollout, MASK, TEMPERATURE, num_segments=int(rollout.commit_step.max()) + 1)
    torch.testing.assert_close(replayed, rollout.step_logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(registered, rollout.step_logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(merged, rollout.step_logprobs, atol=1e-5, rtol=0)
    real_prompt_lengths = rollout.attention_mask[:, :rollout.prompt_length].sum(1, keepdim=True)
    blocks = (real_prompt_lengths + torch.arange(rollout.gen_length)) // BLOCK  # [B, L]
    steps_per_block = [len(torch.unique(rollout.commit_step[row][blocks[row] == block]))
                       for row in range(len(blocks)) for block in torch.unique(blocks[row])]
    assert len(pieces) == max(steps_per_block) < len(torch.unique(rollout.commit_step))


def test_trajectory_replay_refuses_a_rollout_that_did_not_decode_block_by_block():
    model = tiny_model()
    rollout = reference_rollout(model)
    rollout.commit_step = rollout.commit_step.flip(1)  # the last block first
    with pytest.raises(ValueError, match="block-by-block decoding"):
        trajectory_logprobs(model, rollout, MASK, TEMPERATURE)


def direct_per_block_logprobs(model, prompt: torch.Tensor, completion: torch.Tensor,
                              masked: torch.Tensor) -> torch.Tensor:
    """On one unpadded row: the log-prob of each masked completion token from a plain forward of the canvas whose
    blocks before the token's block are clean (the prompt as given), its own block noisy (`masked` put under the mask
    id) and the later ones whatever they hold; 0 at the unmasked tokens."""
    canvas = torch.cat([prompt, completion])
    noisy = torch.cat([prompt, completion.masked_fill(masked, MASK)])
    logprobs = torch.zeros(len(completion))
    for positions in row_blocks(len(canvas)):
        if positions[-1] < len(prompt):
            continue
        blocked = torch.where(torch.arange(len(canvas)) >= positions[0], noisy, canvas)
        scores = model(blocked[None]).logits[0, positions].log_softmax(-1)
        token_scores = scores.gather(1, canvas[positions, None]).squeeze(1)
        in_completion = positions >= len(prompt)
        completion_positions = positions[in_completion] - len(prompt)
        logprobs = logprobs.index_put((completion_positions,), torch.where(
            masked[completion_positions], token_scores[in_completion], 0.0))
    return logprobs


def padded_batch(prompt_lengths=(5, 7), gen_length=10):
    prompts = [random_tokens((length,), 20 + length) for length in prompt_lengths]
    completions = [random_tokens((gen_length,), 40 + length) for length in prompt_lengths]
    sequences, attention_mask = left_padded([torch.cat(pair) for pair in zip(prompts, completions)])
    return sequences, attention_mask, sequences.shape[1] - gen_length


@pytest.mark.parametrize("prompt_lengths", [(5, 7), (6, 6)])
def test_one_step_scores_each_block_fully_masked_against_the_clean_blocks_before_it(prompt_lengths):
    """The one-step surrogate of a block-causal model is one per block: every completion token at its block fully
    masked, conditioned on the (d1-masked) prompt and the clean completion blocks before it — equal to a direct
    forward per block, padded or not."""
    model = official_model()
    sequences, attention_mask, prompt_length = padded_batch(prompt_lengths)
    with torch.no_grad():
        scored = one_step_logprobs(model, sequences, attention_mask, prompt_length, MASK, seed=3, p_mask_prompt=0.5)
        noisy = one_step_masked_input(sequences, attention_mask, prompt_length, MASK, seed=3, p_mask_prompt=0.5)
        for row in range(len(sequences)):
            real = attention_mask[row].bool()
            prompt = noisy[row][real][:-(sequences.shape[1] - prompt_length)]
            completion = sequences[row, prompt_length:]
            direct = direct_per_block_logprobs(model, prompt, completion, torch.ones_like(completion, dtype=torch.bool))
            torch.testing.assert_close(scored[row], direct, atol=1e-5, rtol=0)


def test_masked_completion_scores_each_noisy_block_against_the_clean_blocks_before_it():
    """The bound estimators' draws (SDAR's training loss: masks at rate t, 1/t weight) score each masked token with
    its own block noisy and the blocks before it clean."""
    model = official_model()
    sequences, attention_mask, prompt_length = padded_batch()
    gen_length = sequences.shape[1] - prompt_length
    masked = torch.rand(len(sequences), gen_length, generator=torch.Generator().manual_seed(4)) < 0.5
    with torch.no_grad():
        scored = masked_completion_logprobs(model, sequences, attention_mask, prompt_length, MASK, masked)
        for row in range(len(sequences)):
            real = sequences[row][attention_mask[row].bool()]
            direct = direct_per_block_logprobs(model, real[:-gen_length], real[-gen_length:], masked[row])
            torch.testing.assert_close(scored[row], direct, atol=1e-5, rtol=0)


def test_gradients_of_the_training_forward_are_those_of_the_per_block_computation():
    model = tiny_model()
    sequences, attention_mask, prompt_length = padded_batch()
    one_step_logprobs(model, sequences, attention_mask, prompt_length, MASK, seed=0, p_mask_prompt=0.0).sum().backward()
    gradients = {name: parameter.grad.clone() for name, parameter in model.named_parameters()}
    model.zero_grad()
    gen_length = sequences.shape[1] - prompt_length
    for row in range(len(sequences)):
        real = sequences[row][attention_mask[row].bool()]
        direct_per_block_logprobs(model, real[:-gen_length], real[-gen_length:],
                                  torch.ones(gen_length, dtype=torch.bool)).sum().backward()
    for name, parameter in model.named_parameters():
        assert bool(gradients[name].abs().sum() > 0), name
        torch.testing.assert_close(gradients[name], parameter.grad, atol=1e-5, rtol=1e-4, msg=name)
