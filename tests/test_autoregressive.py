"""Autoregressive sampler and the causal-LM log-probs that must reproduce its recorded step log-probs."""

from contextlib import contextmanager

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from dllm_ais.likelihood import causal_logprobs
from dllm_ais.models import LLaDAConfig, LLaDAModelLM
from dllm_ais.sampling.autoregressive import AutoregressiveSampler, AutoregressiveSamplerConfig

EOS, PAD = 2, 0
SAMPLING_SETTINGS = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=12),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=0.9, top_k=20, top_p=0.7),
    dict(temperature=0.0, top_k=5),
]


@pytest.fixture(scope="module")
def model():
    config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         eos_token_id=EOS, pad_token_id=PAD)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module")
def prompts():
    """Three prompts of lengths 6, 4, 2, left-padded with PAD to 6."""
    torch.manual_seed(1)
    input_ids = torch.randint(3, 128, (3, 6))
    attention_mask = torch.ones_like(input_ids)
    for row, pad in enumerate((0, 2, 4)):
        attention_mask[row, :pad] = 0
        input_ids[row, :pad] = PAD
    return input_ids, attention_mask


def sample(model, prompts, seed=0, **settings):
    config = AutoregressiveSamplerConfig(**{"max_new_tokens": 10, **settings})
    return AutoregressiveSampler(config).sample(model, *prompts, generator=torch.Generator().manual_seed(seed))


@contextmanager
def counting_forwards(model):
    """Yield a list that gets one entry per call of `model`."""
    calls = []
    handle = model.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        yield calls
    finally:
        handle.remove()


def test_causal_logprobs_equal_full_log_softmax_gather(model):
    torch.manual_seed(2)
    sequences = torch.randint(3, 128, (2, 9))
    prompt_length = 4
    logits = model(input_ids=sequences).logits
    expected = torch.log_softmax(logits[:, prompt_length - 1 : -1].float(), dim=-1)
    expected = expected.gather(-1, sequences[:, prompt_length:, None]).squeeze(-1)
    got = causal_logprobs(model, sequences, None, prompt_length)
    assert got.shape == (2, 5) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def test_causal_logprobs_ignore_left_padding(model):
    torch.manual_seed(3)
    unpadded = torch.randint(3, 128, (1, 7))
    padded = torch.cat([torch.full((1, 3), PAD), unpadded], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 7, dtype=torch.long)], dim=1)
    alone = causal_logprobs(model, unpadded, None, 4, temperature=0.8, top_k=30)
    with_padding = causal_logprobs(model, padded, mask, 7, temperature=0.8, top_k=30)
    torch.testing.assert_close(with_padding, alone, atol=1e-5, rtol=0)


def test_position_ids_skip_left_padding(model, prompts):
    """RoPE hides a constant position shift up to rounding, so check the positions the model is given."""
    given = []
    handle = model.register_forward_pre_hook(lambda module, args, kwargs: given.append(kwargs["position_ids"]),
                                             with_kwargs=True)
    try:
        rollout = sample(model, prompts, temperature=0.0, eos_token_ids=())
        causal_logprobs(model, rollout.sequences, rollout.attention_mask, rollout.prompt_length)
    finally:
        handle.remove()
    expected = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 0, 0, 1, 2, 3], [0, 0, 0, 0, 0, 1]])
    expected = torch.cat([expected, expected[:, -1:] + torch.arange(1, 11)], dim=1)
    assert torch.equal(torch.cat(given[:-1], dim=1), expected[:, :-1])  # decoding: prompt, then one step at a time
    assert torch.equal(given[-1], expected)  # teacher forcing: the whole sequence at once


def test_causal_logprobs_apply_temperature_and_filters(model):
    torch.manual_seed(4)
    sequences = torch.randint(3, 128, (2, 8))
    logits = model(input_ids=sequences).logits[:, 2:-1].float()
    shaped = logits / 0.5
    kth_largest = shaped.topk(3, dim=-1).values[..., -1:]
    shaped = shaped.masked_fill(shaped < kth_largest, float("-inf"))
    expected = torch.log_softmax(shaped, dim=-1).gather(-1, sequences[:, 3:, None]).squeeze(-1)
    got = causal_logprobs(model, sequences, None, 3, temperature=0.5, top_k=3)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert torch.isneginf(got).any(), "random tokens outside the top 3 must get −inf"
    # the entropy is that of the sampling distribution (3 tokens left), from the same forward
    probabilities = torch.softmax(shaped, dim=-1)
    expected_entropy = -(probabilities * probabilities.clamp(min=1e-30).log()).sum(-1)
    with_entropy, entropy = causal_logprobs(model, sequences, None, 3, temperature=0.5, top_k=3, compute_entropy=True)
    assert torch.equal(with_entropy, got)
    torch.testing.assert_close(entropy, expected_entropy, atol=1e-5, rtol=0)
    assert torch.isfinite(entropy).all() and (entropy <= torch.log(torch.tensor(3.0)) + 1e-6).all()


@pytest.mark.parametrize("settings", SAMPLING_SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_recorded_logprobs_match_causal_logprobs(model, prompts, settings):
    rollout = sample(model, prompts, eos_token_ids=tuple(range(2, 10)), **settings)
    assert rollout.step_logprobs.shape == (3, 10) and rollout.step_logprobs.dtype == torch.float32
    trainer_side = causal_logprobs(model, rollout.sequences, rollout.attention_mask, rollout.prompt_length,
                                   settings["temperature"], settings.get("top_k", 0), settings.get("top_p", 1.0))
    valid = rollout.completion_mask
    assert torch.isfinite(rollout.step_logprobs[valid]).all()
    torch.testing.assert_close(rollout.step_logprobs[valid], trainer_side[valid], atol=1e-5, rtol=0)


def test_greedy_matches_generate(model, prompts):
    rollout = sample(model, prompts, temperature=0.0, eos_token_ids=(EOS,), pad_token_id=PAD)
    input_ids, attention_mask = prompts
    expected = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=10,
                              eos_token_id=EOS, pad_token_id=PAD)[:, input_ids.shape[1] :]
    expected = torch.nn.functional.pad(expected, (0, 10 - expected.shape[1]), value=PAD)
    assert torch.equal(rollout.completion_ids, expected)
    assert rollout.completion_mask.sum(1).tolist() == [3, 1, 10], "this seed's greedy rows end at 3, 1 and never"


def test_completion_mask_through_first_eos_then_pad(model, prompts):
    rollout = sample(model, prompts, seed=5, temperature=1.0, eos_token_ids=tuple(range(2, 20)), pad_token_id=PAD)
    completion, valid = rollout.completion_ids, rollout.completion_mask
    assert torch.equal(rollout.commit_step, torch.arange(10).expand(3, -1))
    assert torch.equal(rollout.attention_mask[:, 6:], torch.ones(3, 10, dtype=torch.long))
    ended = 0
    for row in range(3):
        is_eos = (completion[row] >= 2) & (completion[row] < 20)
        if not is_eos.any():
            assert valid[row].all()
            continue
        first = int(is_eos.nonzero()[0])
        ended += 1
        assert valid[row, : first + 1].all() and not valid[row, first + 1 :].any()
        assert (completion[row, first + 1 :] == PAD).all()
        assert (rollout.step_logprobs[row, first + 1 :] == 0).all()
    assert ended >= 2, "with 18 EOS ids out of 128 most rows should end within 10 tokens"


def test_stops_early_when_every_row_has_finished(model, prompts):
    with counting_forwards(model) as calls:
        rollout = sample(model, prompts, temperature=1.0, eos_token_ids=tuple(range(0, 128)), pad_token_id=PAD)
    assert len(calls) == 1
    assert rollout.completion_ids.shape == (3, 10)
    assert rollout.completion_mask.sum(1).tolist() == [1, 1, 1]
    assert (rollout.completion_ids[:, 1:] == PAD).all()


def test_same_seed_same_rollout(model, prompts):
    first, again = sample(model, prompts, seed=7), sample(model, prompts, seed=7)
    other = sample(model, prompts, seed=8)
    for name in ("sequences", "step_logprobs", "completion_mask", "commit_step"):
        assert torch.equal(getattr(first, name), getattr(again, name))
    assert not torch.equal(first.sequences, other.sequences)


def test_special_tokens_fall_back_to_model_config(model):
    assert AutoregressiveSampler().special_tokens(model) == ((EOS,), PAD)
    sampler = AutoregressiveSampler(AutoregressiveSamplerConfig(eos_token_ids=[5, 6], pad_token_id=7))
    assert sampler.special_tokens(model) == ((5, 6), 7)


@pytest.mark.parametrize("bad", [
    dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1), dict(top_k=2.5),
    dict(max_new_tokens=0), dict(eos_token_ids=("eos",)), dict(pad_token_id="pad"),
])
def test_invalid_config_raises(bad):
    with pytest.raises(ValueError):
        AutoregressiveSamplerConfig(**bad)


def test_generation_kwargs_accept_neutral_values_and_reject_the_rest():
    config = AutoregressiveSamplerConfig.from_generation_kwargs(
        do_sample=False, max_new_tokens=8, eos_token_id=[1, 2], num_beams=1, repetition_penalty=1.0)
    assert (config.temperature, config.max_new_tokens, config.eos_token_ids) == (0.0, 8, (1, 2))
    for unsupported in (dict(repetition_penalty=1.2), dict(num_beams=4), dict(min_p=0.1), dict(diversity_penalty=0.5)):
        with pytest.raises(ValueError, match="does not support: " + next(iter(unsupported))):
            AutoregressiveSamplerConfig.from_generation_kwargs(**unsupported)


def test_bad_inputs_raise_before_any_forward(model, prompts):
    input_ids, attention_mask = prompts
    with counting_forwards(model) as calls:
        sampler = AutoregressiveSampler(AutoregressiveSamplerConfig(max_new_tokens=4))
        with pytest.raises(ValueError, match="left-padded"):
            sampler.sample(model, input_ids, attention_mask.flip(1))
        with pytest.raises(ValueError, match="shape"):
            sampler.sample(model, input_ids, attention_mask[:, 1:])
        with pytest.raises(ValueError, match="max_position_embeddings"):
            too_long = AutoregressiveSampler(AutoregressiveSamplerConfig(max_new_tokens=251))
            too_long.sample(model, input_ids, attention_mask)
        with pytest.raises(ValueError, match="prompt_length"):
            causal_logprobs(model, input_ids, attention_mask, prompt_length=6)
    assert not calls


def test_missing_pad_token_raises():
    config = Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, eos_token_id=None, pad_token_id=None)
    bare = AutoModelForCausalLM.from_config(config)
    bare.generation_config.eos_token_id = None
    with pytest.raises(ValueError, match="pad token"):
        AutoregressiveSampler().sample(bare, torch.ones(1, 3, dtype=torch.long))


def test_masked_diffusion_model_is_rejected():
    llada = LLaDAModelLM(LLaDAConfig(d_model=16, n_heads=2, n_layers=1, mlp_hidden_size=32, vocab_size=32,
                                     embedding_size=32, max_sequence_length=64, mask_token_id=31,
                                     eos_token_id=30, pad_token_id=30))
    with pytest.raises(ValueError, match="MaskedDiffusionSampler"):
        AutoregressiveSampler().sample(llada, torch.ones(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="causal LM"):
        causal_logprobs(llada, torch.ones(1, 5, dtype=torch.long), None, 3)


@pytest.mark.parametrize("eos", [["2"], [2.0], True])
def test_non_integer_eos_ids_are_rejected(eos):
    with pytest.raises(ValueError, match="token ids must be ints"):
        AutoregressiveSamplerConfig(eos_token_ids=eos)
