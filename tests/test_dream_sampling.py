"""Dream through the one sampler and the estimators: greedy token-for-token equality with Dream's official
`diffusion_generate` (re-implemented below from its published algorithm), sampled distributions against it, the
recorded log-probs against every scorer (the logit shift applied once, in `dllm_ais.models.families`), and the block
cache."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from dllm_ais.likelihood import decoder_trajectory_pieces, one_step_logprobs, sum_pieces, trajectory_logprobs
from dllm_ais.models import DreamConfig, DreamModel
from dllm_ais.models.families import position_logits, shift_logits_right
from dllm_ais.sampling.diffusion import (
    DiffusionSamplerConfig, MaskedDiffusionSampler, filter_top_p_top_k, time_linear_commit_count,
)

VOCAB, MASK, PAD, EOS = 24, 23, 22, 21


class NeverPredictsTheMask(DreamModel):
    """A Dream whose logit for the mask token is −10⁴, as a trained model's effectively is: with a 24-token random
    model the mask token would often win the argmax, and the official loop (which re-reads the mask positions from
    the canvas each step) and ours (which counts a committed position as committed) would then part ways."""

    def forward(self, *args, **kwargs):
        output = super().forward(*args, **kwargs)
        output.logits[..., MASK] = -1e4
        return output


def tiny_dream(seed: int = 0, init: float = 0.3) -> DreamModel:
    torch.manual_seed(seed)
    config = DreamConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0,
                         initializer_range=init, mask_token_id=MASK, pad_token_id=PAD, bos_token_id=EOS,
                         eos_token_id=EOS)
    return NeverPredictsTheMask(config).eval()


def prompts(batch: int = 3, length: int = 5, padded: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 20, (batch, length), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    if padded:
        ids[0, :2], mask[0, :2] = PAD, 0
    return ids, mask


# --- Dream's official generation, written from its published algorithm (generation_utils.py, `_sample`) -----------

def official_top_p(logits, top_p):
    sorted_logits, order = torch.sort(logits, descending=True)
    cumulative = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1)
    remove = cumulative > top_p
    remove[..., 1:] = remove[..., :-1].clone()
    remove[..., 0] = False
    return logits.masked_fill(torch.zeros_like(logits, dtype=torch.bool).scatter(-1, order, remove),
                              torch.finfo(logits.dtype).min)


def official_top_k(logits, top_k):
    kth = torch.topk(logits, min(top_k, logits.shape[-1]))[0][..., -1, None]
    return logits.masked_fill(logits < kth, torch.finfo(logits.dtype).min)


def official_sample_tokens(logits, temperature, top_p, top_k, margin=False, neg_entropy=False):
    if temperature > 0:
        logits = logits / temperature
    if top_p is not None and top_p < 1:
        logits = official_top_p(logits, top_p)
    if top_k is not None:
        logits = official_top_k(logits, top_k)
    probs = torch.softmax(logits, dim=-1)
    if temperature > 0:
        x0 = torch.distributions.Categorical(probs=probs).sample()
        confidence = probs.gather(-1, x0[:, None]).squeeze(-1)
    else:
        confidence, x0 = probs.max(dim=-1)
    if margin:
        top = probs.sort(dim=-1, descending=True).values
        confidence = top[:, 0] - top[:, 1]
    if neg_entropy:
        confidence = (probs * torch.log(probs + 1e-10)).sum(dim=-1)
    return confidence, x0


@torch.no_grad()
def official_diffusion_generate(model, input_ids, attention_mask, max_new_tokens, steps, alg, temperature=0.0,
                                top_p=None, top_k=None, alg_temp=None, eps=1e-3):
    x = F.pad(input_ids, (0, max_new_tokens), value=MASK)
    if attention_mask is not None and bool((attention_mask == 0).any()):
        attention_mask = F.pad(attention_mask, (0, max_new_tokens), value=1)
        tok_idx = attention_mask.long().cumsum(-1) - 1
        tok_idx.masked_fill_(attention_mask == 0, 1)
    else:
        attention_mask, tok_idx = None, None
    timesteps = torch.linspace(1, eps, steps + 1)
    for i in range(steps):
        mask_index = x == MASK
        logits = model(x, attention_mask=attention_mask, position_ids=tok_idx).logits
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        mask_logits = logits[mask_index]
        t, s = timesteps[i], timesteps[i + 1]
        if alg == "origin":
            p_transfer = 1 - s / t if i < steps - 1 else 1
            x0 = torch.full_like(x[mask_index], MASK)
            transfer = torch.rand(*x0.shape) < p_transfer
            _, x0[transfer] = official_sample_tokens(mask_logits[transfer], temperature, top_p, top_k)
            x[mask_index] = x0.clone()
            continue
        confidence, x0 = official_sample_tokens(mask_logits, temperature, top_p, top_k,
                                                margin=alg == "topk_margin", neg_entropy=alg == "entropy")
        num_mask_token = mask_index.sum() / mask_index.shape[0]
        count = int(num_mask_token * (1 - s / t)) if i < steps - 1 else int(num_mask_token)
        full_confidence = torch.full_like(x, -torch.inf, dtype=logits.dtype)
        full_confidence[mask_index] = confidence
        if count > 0:
            if not alg_temp:
                _, transfer_index = torch.topk(full_confidence, count)
            else:
                transfer_index = torch.multinomial(F.softmax(full_confidence / alg_temp, dim=-1), num_samples=count)
            candidates = torch.full_like(x, MASK)
            candidates[mask_index] = x0.clone()
            rows = torch.arange(x.shape[0]).unsqueeze(1).expand_as(transfer_index)
            x[rows, transfer_index] = candidates[rows, transfer_index]
    return x


def dream_sampler(gen_length, steps, remasking, temperature=0.0, **overrides) -> MaskedDiffusionSampler:
    return MaskedDiffusionSampler(DiffusionSamplerConfig(
        gen_length=gen_length, block_length=gen_length, steps=steps, schedule="time_linear", remasking=remasking,
        temperature=temperature, **overrides))


# --- greedy: token for token ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("alg, top_p, top_k", [
    ("maskgit_plus", None, None), ("topk_margin", None, None), ("entropy", None, None),
    ("maskgit_plus", 0.6, None), ("entropy", None, 3), ("topk_margin", 0.8, 4),
])
@pytest.mark.parametrize("gen_length, steps", [(12, 12), (12, 5), (8, 3)])
def test_greedy_decoding_equals_official_dream(alg, top_p, top_k, padded, gen_length, steps):
    model = tiny_dream()
    ids, mask = prompts(padded=padded)
    official = official_diffusion_generate(model, ids, mask, gen_length, steps, alg, top_p=top_p, top_k=top_k)
    sampler = dream_sampler(gen_length, steps, alg, top_p=top_p or 1.0, top_k=top_k or 0)
    ours = sampler.sample(model, ids, mask).sequences
    assert torch.equal(ours, official)


def test_time_linear_schedule_commits_every_position_and_skips_empty_steps():
    counts, left = [], 256
    for step in range(256):
        counts.append(time_linear_commit_count(left, step, 256, 1e-3))
        left -= counts[-1]
    assert left == 0 and counts[0] == 0 and sum(counts) == 256  # ⌊256 · 0.999/256⌋ = 0: the first step commits none
    model = tiny_dream()
    ids, mask = prompts()
    calls = []
    model.register_forward_hook(lambda *args: calls.append(1))
    rollout = dream_sampler(12, 12, "entropy").sample(model, ids, mask)
    assert len(calls) == int(rollout.num_steps.max()) < 12  # no forward at a step that commits nothing
    assert (rollout.commit_step >= 0).all()


# --- sampling: the same distributions ------------------------------------------------------------------------------

def completion_frequencies(sequences: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """[L, V] frequency of each token at each completion position."""
    completion = sequences[:, prompt_length:]
    return F.one_hot(completion, VOCAB).float().mean(dim=0)


@pytest.mark.parametrize("alg, temperature, extra", [
    ("maskgit_plus", 1.0, {}),
    ("entropy", 0.7, {"top_p": 0.9}),
    ("origin", 1.0, {}),
    ("maskgit_plus", 1.0, {"alg_temp": 0.5}),
    ("topk_margin", 1.2, {"top_k": 5}),
])
def test_sampled_distributions_match_official_dream(alg, temperature, extra):
    """Per completion position, the token frequencies of 3,000 samples of ours and of the official algorithm differ by
    a total variation distance within sampling noise (TV of two independent 3,000-sample estimates of the same
    distribution over 24 tokens is ≈ 0.03–0.05; a different distribution, e.g. another rule, gives ≳ 0.1)."""
    model = tiny_dream(init=0.15)
    n, gen_length, steps = 3000, 4, 4
    ids = torch.randint(0, 20, (1, 3), generator=torch.Generator().manual_seed(5)).expand(n, 3).contiguous()
    torch.manual_seed(1)
    official = official_diffusion_generate(model, ids, None, gen_length, steps, alg, temperature=temperature,
                                           top_p=extra.get("top_p"), top_k=extra.get("top_k"),
                                           alg_temp=extra.get("alg_temp"))
    sampler = dream_sampler(gen_length, steps, alg, temperature, top_p=extra.get("top_p", 1.0),
                            top_k=extra.get("top_k", 0), position_temperature=extra.get("alg_temp", 0.0))
    ours = sampler.sample(model, ids, None, generator=torch.Generator().manual_seed(2)).sequences
    total_variation = 0.5 * (completion_frequencies(ours, 3) - completion_frequencies(official, 3)).abs().sum(-1)
    assert total_variation.max() < 0.07, total_variation


def test_a_different_rule_is_told_apart_by_the_distribution_test():
    model = tiny_dream(init=0.15)
    ids = torch.randint(0, 20, (1, 3), generator=torch.Generator().manual_seed(5)).expand(3000, 3).contiguous()
    torch.manual_seed(1)
    official = official_diffusion_generate(model, ids, None, 4, 4, "entropy", temperature=0.3)
    ours = dream_sampler(4, 4, "random", 1.5).sample(model, ids, None, generator=torch.Generator().manual_seed(2))
    total_variation = 0.5 * (completion_frequencies(ours.sequences, 3) - completion_frequencies(official, 3)).abs().sum(-1)
    assert total_variation.max() > 0.1


# --- the recorded behaviour log-probs, scored by the estimators with the shift ---------------------------------------

@pytest.mark.parametrize("settings", [
    dict(block_length=4, steps=8, remasking="low_confidence"),
    dict(block_length=8, steps=4, schedule="time_linear", remasking="entropy", top_p=0.9),
    dict(block_length=8, steps=8, schedule="time_linear", remasking="maskgit_plus", top_k=6, position_temperature=0.3),
    dict(block_length=8, steps=8, schedule="time_linear", remasking="origin"),
])
def test_trajectory_replay_equals_the_recorded_log_probs(settings):
    """The replay scores the unfiltered logits: equal to the recorded log-probs without top-p / top-k, and below them
    with a filter (the draw renormalised over fewer tokens), which is what the trajectory ratio sees of it."""
    model = tiny_dream()
    ids, mask = prompts()
    sampler = MaskedDiffusionSampler(DiffusionSamplerConfig(gen_length=8, temperature=0.8, **settings))
    rollout = sampler.sample(model, ids, mask, generator=torch.Generator().manual_seed(0))
    replayed = trajectory_logprobs(model, rollout, MASK, 0.8, logits_fn=sampler.scoring_logits)
    if "top_p" in settings or "top_k" in settings:
        assert (replayed <= rollout.step_logprobs + 1e-5).all() and (replayed < rollout.step_logprobs - 1e-3).any()
        unfiltered = dataclasses.replace(sampler.config, top_p=1.0, top_k=0)
        rollout = sampler.with_config(unfiltered).sample(model, ids, mask, generator=torch.Generator().manual_seed(0))
        replayed = trajectory_logprobs(model, rollout, MASK, 0.8, logits_fn=sampler.scoring_logits)
    torch.testing.assert_close(replayed, rollout.step_logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache, threshold", [("dual", None), ("prefix", 0.5), ("dual", 0.3)])
def test_decoder_replay_with_a_cache_equals_the_recorded_log_probs(cache, threshold):
    model = tiny_dream()
    ids, mask = prompts()
    sampler = MaskedDiffusionSampler(DiffusionSamplerConfig(gen_length=8, block_length=4, steps=8, temperature=0.9,
                                                            cache=cache, threshold=threshold))
    rollout = sampler.sample(model, ids, mask, generator=torch.Generator().manual_seed(0))
    replayed = sum_pieces(decoder_trajectory_pieces(model, rollout, sampler.decoder_logits, 0.9), False)
    torch.testing.assert_close(replayed, rollout.step_logprobs, rtol=1e-5, atol=1e-5)


def test_a_cache_refreshed_every_step_decodes_as_without_one():
    model = tiny_dream()
    ids, mask = prompts()
    exact = MaskedDiffusionSampler(DiffusionSamplerConfig(gen_length=8, block_length=4, steps=8))
    for cache in ("prefix", "dual"):
        cached = exact.with_config(DiffusionSamplerConfig(gen_length=8, block_length=4, steps=8, cache=cache,
                                                          cache_refresh_interval=1))
        assert torch.equal(cached.sample(model, ids, mask).sequences, exact.sample(model, ids, mask).sequences)


def test_one_step_estimator_reads_each_position_from_the_logits_before_it():
    model = tiny_dream()
    ids, mask = prompts()
    rollout = MaskedDiffusionSampler(DiffusionSamplerConfig(gen_length=8, block_length=8, steps=8, temperature=1.0)
                                     ).sample(model, ids, mask, generator=torch.Generator().manual_seed(0))
    got = one_step_logprobs(model, rollout.sequences, rollout.attention_mask, 5, MASK, seed=0, p_mask_prompt=0.0)
    noisy = torch.cat([ids, torch.full((3, 8), MASK)], dim=1)
    logits = shift_logits_right(model(noisy, attention_mask=rollout.attention_mask).logits)[:, 5:]
    expected = logits.float().log_softmax(-1).gather(-1, rollout.sequences[:, 5:, None]).squeeze(-1)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("keep", [0, 3, torch.tensor([0, 2, 4])])
def test_position_logits_of_a_shifted_family_are_the_forward_one_position_earlier(keep):
    model = tiny_dream()
    ids, mask = prompts()
    everything = shift_logits_right(model(ids, attention_mask=mask).logits)
    if isinstance(keep, torch.Tensor):
        expected = everything[:, keep]
    else:
        expected = everything[:, -keep:] if keep else everything
    torch.testing.assert_close(position_logits(model, ids, mask, keep), expected)


def test_top_p_top_k_filter_keeps_the_official_set_without_tempering_the_logits():
    logits = torch.randn(4, 7, VOCAB, generator=torch.Generator().manual_seed(0))
    for temperature, top_p, top_k in ((0.5, 0.8, 0), (1.0, 1.0, 4), (0.0, 0.7, 3), (2.0, 0.95, 6)):
        filtered = filter_top_p_top_k(logits, temperature, top_p, top_k)
        scaled = logits / temperature if temperature else logits
        official = official_top_k(official_top_p(scaled, top_p), top_k) if top_k else official_top_p(scaled, top_p)
        kept = official > torch.finfo(logits.dtype).min
        assert torch.equal(torch.isfinite(filtered), kept)
        assert torch.equal(filtered[kept], logits[kept])
    assert math.isinf(filter_top_p_top_k(logits, 1.0, 0.5, 0).min())
