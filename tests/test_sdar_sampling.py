"""The masked-diffusion sampler on a block-causal model (SDAR): the official greedy generation token for token (one
row, and the same row inside a left-padded batch), the exact cache of finished blocks against full forwards, the
recorded log-probs against a teacher-forced replay, SDAR's dynamic threshold rule."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import dllm_ais  # noqa: F401  (registers "sdar")
from dllm_ais.loading import load_model
from dllm_ais.sampling.diffusion import (
    DiffusionSamplerConfig,
    MaskedDiffusionSampler,
    completion_window,
    filter_top_p_top_k,
    sampling_logprobs,
)
from dllm_ais.sampling.diffusion.choice import recorded_choice
from dllm_ais.sampling.forwards import StaticForwards
from test_sdar import left_padded  # tests/ is on sys.path

OFFICIAL = Path(__file__).parent / "data" / "sdar_official"
MASK, PAD, BLOCK = 271, 270, 4


@pytest.fixture(scope="module")
def model():
    return load_model(str(OFFICIAL), torch.float32).eval()


@pytest.fixture(scope="module")
def official() -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(prompt [1, P], the official generation [1, P + completion], its generate.py settings)."""
    with safe_open(OFFICIAL / "official_outputs.safetensors", "pt") as handle:
        settings = json.loads(handle.metadata()["generation"])
    outputs = load_file(OFFICIAL / "official_outputs.safetensors")
    return outputs["prompt_ids"], outputs["generated_ids"], settings


def sdar_sampler(gen_length: int = 12, **overrides) -> MaskedDiffusionSampler:
    """The official generate's greedy settings of the fixture: blocks of 4, 4 denoising steps per block,
    low_confidence_static (the drawn token's probability: maskgit_plus)."""
    fields = dict(gen_length=gen_length, block_length=BLOCK, steps=4 * gen_length // BLOCK, temperature=0.0,
                  remasking="maskgit_plus", cache="dual")
    fields.update(overrides)
    return MaskedDiffusionSampler(DiffusionSamplerConfig(**fields))


def other_prompts() -> list[torch.Tensor]:
    """Prompts whose lengths differ from the fixture's (6) mod the block: 3 (inside the first block), 8 (two whole
    blocks), 9."""
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(0, PAD, (length,), generator=generator) for length in (3, 8, 9)]


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_greedy_decoding_reproduces_the_official_generation(model, official, cache):
    """The official generate (batch 1) filled blocks up to 16 positions (prompt 6 + 10); our completion of 12
    positions holds those blocks whole (later blocks never change earlier ones) and a last block cut at 18."""
    prompt, generated, settings = official
    assert (settings["block_length"], settings["denoising_steps"]) == (BLOCK, 4)
    assert settings["remasking_strategy"] == "low_confidence_static"
    rollout = sdar_sampler(cache=cache).sample(model, prompt)
    length = generated.shape[1]
    assert torch.equal(rollout.sequences[:, :length], generated)
    assert rollout.commit_step[0, 2:6].min() > rollout.commit_step[0, :2].max()  # the prompt's block first


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_every_row_of_a_left_padded_batch_decodes_as_it_does_alone(model, official, cache):
    """Rows whose prompts end at different offsets in their blocks: each row's blocks are its own (from its first
    real token), so the batch decodes each row as the official one-row generate does — the fixture's row gives the
    official tokens — and the exact cache (or none) gives the same tokens."""
    prompt, generated, _ = official
    rows = [prompt[0], *other_prompts()]
    ids, mask = left_padded(rows)
    sampler = sdar_sampler(cache=cache)
    batch = sampler.sample(model, ids, mask)
    completion_length = generated.shape[1] - prompt.shape[1]
    assert torch.equal(batch.completion_ids[0, :completion_length], generated[0, prompt.shape[1]:])
    for index, row in enumerate(rows):
        alone = sdar_sampler(cache="none").sample(model, row[None])
        assert torch.equal(batch.completion_ids[index], alone.completion_ids[0]), index
        torch.testing.assert_close(batch.step_logprobs[index], alone.step_logprobs[0], atol=1e-5, rtol=0)
    assert torch.equal(batch.prompt_ids, ids) and torch.equal(batch.attention_mask[:, :ids.shape[1]], mask)


@pytest.mark.parametrize("settings", [dict(temperature=0.8), dict(temperature=1.0, top_p=0.9),
                                      dict(temperature=0.8, threshold=0.3)])
def test_recorded_logprobs_equal_a_teacher_forced_replay_without_cache(model, official, settings):
    """The cache is exact: the log-probs recorded while sampling with it equal those of the no-cache replay along
    the rollout's commit order (`decoder_logits`: one full block-causal forward per step)."""
    prompt, _, _ = official
    ids, mask = left_padded([prompt[0], *other_prompts()])
    sampler = sdar_sampler(**settings)
    rollout = sampler.sample(model, ids, mask, generator=torch.Generator().manual_seed(0))
    uncached = sampler.with_config(dataclasses.replace(sampler.config, cache="none"))
    assert torch.equal(uncached.sample(model, ids, mask, generator=torch.Generator().manual_seed(0)).sequences,
                       rollout.sequences)  # the same draws from the same logits
    replayed = torch.full(rollout.step_logprobs.shape, float("nan"))
    for replay in (uncached, sampler):
        for window, committed, logits, _ in replay.decoder_logits(model, rollout):
            logits = filter_top_p_top_k(logits, sampler.config.temperature, sampler.config.top_p, sampler.config.top_k)
            logprobs = sampling_logprobs(logits, completion_window(rollout.completion_ids, window),
                                         sampler.config.temperature)
            for row, position in committed.nonzero().tolist():
                index = window.start + position if isinstance(window, slice) else int(window[row, position])
                replayed[row, index] = logprobs[row, position]
        torch.testing.assert_close(replayed, rollout.step_logprobs, atol=1e-5, rtol=0)


def test_dynamic_threshold_commits_at_least_the_step_count(model, official):
    """SDAR's low_confidence_dynamic: every position above the threshold, at least the static schedule's count —
    a threshold nothing passes is the static decoder, one everything passes fills each block in one step."""
    prompt, _, _ = official
    ids, mask = left_padded([prompt[0], *other_prompts()])
    static = sdar_sampler().sample(model, ids, mask)
    never = sdar_sampler(threshold=1.0).sample(model, ids, mask)
    assert torch.equal(never.sequences, static.sequences) and torch.equal(never.commit_step, static.commit_step)
    always = sdar_sampler(threshold=0.0).sample(model, ids, mask)
    for row in range(ids.shape[0]):
        starts = (mask[row].sum() + torch.arange(12)) // BLOCK  # each completion position's block in its row
        for block in starts.unique():
            assert always.commit_step[row, starts == block].unique().numel() == 1


def test_stochastic_commit_choice_replays_to_its_recorded_logprobs(model, official):
    prompt, _, _ = official
    ids, mask = left_padded([prompt[0], *other_prompts()])
    sampler = sdar_sampler(temperature=0.9, position_temperature=0.5)
    rollout = sampler.sample(model, ids, mask, generator=torch.Generator().manual_seed(1))
    assert recorded_choice(rollout).logprobs.ne(0).any()
    torch.testing.assert_close(sampler.choice_logprobs(model, rollout), recorded_choice(rollout).logprobs, atol=1e-5, rtol=0)


def test_block_length_must_be_the_models_block_size(model, official):
    prompt, _, _ = official
    with pytest.raises(ValueError, match="block_length=2 differs from the model's block_size=4"):
        sdar_sampler(block_length=2, steps=12).sample(model, prompt)


def test_right_padded_prompts_are_refused(model):
    ids, mask = left_padded(other_prompts())
    with pytest.raises(ValueError, match="must be left-padded"):
        sdar_sampler().sample(model, ids.flip(1), mask.flip(1))


def test_the_compiled_engines_static_forwards_decode_as_the_model_does(model, official):
    """With static forwards (`rollout.compile`; here without CUDA graphs, which need a GPU) the cache lives in the
    engine's buffers of the canvas shape, written in place: the same tokens and log-probs as the eager cache."""
    prompt, _, _ = official
    ids, mask = left_padded([prompt[0], *other_prompts()])
    sampler = sdar_sampler(temperature=0.8)
    eager = sampler.sample(model, ids, mask, generator=torch.Generator().manual_seed(2))
    forwards = StaticForwards(model, cuda_graphs=False)
    for _ in range(2):  # the second call reuses the buffers
        static = sampler.sample(model, ids, mask, generator=torch.Generator().manual_seed(2), forwards=forwards)
        assert torch.equal(static.sequences, eager.sequences)
        torch.testing.assert_close(static.step_logprobs, eager.step_logprobs, atol=1e-5, rtol=0)
    assert len(forwards.buffers) == 1
