"""The masked-diffusion sampler on LLaDA2: the official ``generate``'s greedy tokens (one row per call) token for token
over a grid of its settings, the prompts of each setting decoded as one left-padded batch, with and without the
cache (tools/make_llada2_generate_fixture.py wrote the official rows); the stop after the block holding EOS; the
recorded log-probs of such a rollout against the trainer's replay."""

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import dllm_ais  # noqa: F401  (registers "llada2_moe")
from dllm_ais.decoding_protocols import llada2_generate_settings
from dllm_ais.loading import SpecialTokens, load_model
from dllm_ais.lm_eval_requests import block_protocol_sampler_config
from dllm_ais.models.families import family_of
from dllm_ais.sampling.diffusion import (DiffusionSamplerConfig, MaskedDiffusionSampler, completion_window,
                                         sampling_logprobs)

OFFICIAL = Path(__file__).parent / "data" / "llada2_official"
PAD = 270


@pytest.fixture(scope="module")
def model():
    return load_model(str(OFFICIAL), torch.float32).eval()


def read_official_generate(name: str) -> dict:
    """The official generate fixture OFFICIAL/`name` (official_generate.safetensors, or LLaDA2.1's
    official_generate_21.safetensors): its prompts (1-D rows), EOS id, block length, metadata and per grid row its
    settings, prompt and completion."""
    path = OFFICIAL / name
    with safe_open(path, "pt") as handle:
        metadata = handle.metadata()
    tensors = load_file(path)
    names = metadata["settings"].split(",")
    rows = [dict(zip(names, values)) for values in tensors["settings"].tolist()]
    return {"prompts": [row[row >= 0] for row in tensors["prompts"]], "eos": int(metadata["eos_id"]),
            "block_length": int(metadata["block_length"]), "metadata": metadata, "rows": rows,
            "prompt_index": tensors["prompt_index"], "completions": [row[row >= 0] for row in tensors["completions"]]}


@pytest.fixture(scope="module")
def official() -> dict:
    return read_official_generate("official_generate.safetensors")


def left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows right-aligned behind pad tokens, and their attention mask."""
    width = max(len(row) for row in rows)
    ids, mask = torch.full((len(rows), width), PAD), torch.zeros(len(rows), width, dtype=torch.long)
    for index, row in enumerate(rows):
        ids[index, width - len(row):], mask[index, width - len(row):] = row, 1
    return ids, mask


def llada2_sampler(official: dict, setting: dict, **overrides) -> MaskedDiffusionSampler:
    """The sampler decoding as the official generate with the grid row's `setting` (greedy unless overridden)."""
    fields = llada2_generate_settings(int(setting["gen_length"]), official["block_length"], int(setting["steps"]),
                                      setting["threshold"], int(setting["minimal_topk"]))
    fields.update({"temperature": 0.0, "eos_token_ids": (official["eos"],), "pad_token_id": PAD, **overrides})
    return MaskedDiffusionSampler(DiffusionSamplerConfig(**fields))


def decoder_settings(official: dict) -> list[dict]:
    """The grid's settings but eos_early_stop (the sampler's settings do not depend on it), each once."""
    seen = []
    for row in official["rows"]:
        setting = {key: value for key, value in row.items() if key != "eos_early_stop"}
        if setting not in seen:
            seen.append(setting)
    return seen


def twin(official: dict, index: int, **change) -> int:
    """The grid row of row `index`'s prompt whose settings are `index`'s with `change`."""
    wanted = {**official["rows"][index], **change}
    prompt = official["prompt_index"][index]
    return next(i for i, row in enumerate(official["rows"]) if official["prompt_index"][i] == prompt and row == wanted)


def assert_grid_stops_at_eos(official: dict) -> None:
    """The fixture's rows stop at EOS (some, not all), its prompts end a block's 0, 2 and 3 positions in, and
    eos_early_stop changes no row's tokens."""
    completions, rows = official["completions"], official["rows"]
    stopped = [bool((completion == official["eos"]).any()) for completion in completions]
    assert 0 < sum(stopped) < len(stopped)
    assert {len(prompt) % official["block_length"] for prompt in official["prompts"]} == {0, 2, 3}
    for index, row in enumerate(rows):
        if row["eos_early_stop"]:
            assert torch.equal(completions[index], completions[twin(official, index, eos_early_stop=0.0)])


def test_the_grid_covers_stops_at_eos_and_early_stop_changes_no_token(official):
    """The fixture exercises the EOS stop and the last block past gen_length; eos_early_stop's return within the
    block holds the tokens of the stop after it."""
    assert_grid_stops_at_eos(official)


def assert_every_official_row(model, official: dict, sampler_of, cache: str) -> None:
    """Per setting of the grid, the three prompts as one left-padded batch decoded by ``sampler_of(official, setting,
    cache=cache)``: each row's completion (through its first EOS, at most gen_length tokens) is the official one."""
    ids, mask = left_padded(official["prompts"])
    for setting in decoder_settings(official):
        rollout = sampler_of(official, setting, cache=cache).sample(model, ids, mask)
        for index, row in enumerate(official["rows"]):
            if {key: value for key, value in row.items() if key != "eos_early_stop"} != setting:
                continue
            prompt = int(official["prompt_index"][index])
            got = rollout.completion_ids[prompt][rollout.completion_mask[prompt]]
            assert torch.equal(got, official["completions"][index]), (setting, prompt)


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_batched_greedy_decoding_reproduces_every_official_row(model, official, cache):
    """Per setting of the grid, the three prompts (3, 4 and 6 tokens: blocks of 4 from each row's first token) as one
    left-padded batch: each row's completion is the official one (`assert_every_official_row`)."""
    assert_every_official_row(model, official, llada2_sampler, cache)


def test_stop_at_eos_leaves_the_blocks_after_masked(model, official):
    """With every row's completion final, the sampler decodes no further block: the positions after stay the mask
    id, never committed, and the completion's tokens are those of decoding on."""
    ids, mask = left_padded(official["prompts"])
    setting = dict(gen_length=8, steps=4, threshold=0.95, minimal_topk=1)
    stopped = llada2_sampler(official, setting).sample(model, ids, mask)
    decoded = llada2_sampler(official, setting, stop_at_eos=False).sample(model, ids, mask)
    assert torch.equal(stopped.completion_mask, decoded.completion_mask)
    kept = stopped.completion_mask
    assert torch.equal(stopped.completion_ids[kept], decoded.completion_ids[kept])
    unfilled = stopped.commit_step < 0
    assert unfilled.any() and not (unfilled & kept).any() and not (decoded.commit_step < 0).any()
    assert (stopped.completion_ids[unfilled] == model.config.mask_token_id).all()
    assert (stopped.step_logprobs[unfilled] == 0).all()


@pytest.mark.parametrize("threshold", [0.95, 0.3])
def test_recorded_logprobs_equal_the_trainers_replay(model, official, threshold):
    """Sampled at τ = 1 with the official decoder's settings (its last block past gen_length, the EOS stop), every
    committed token's recorded log-prob is the one `decoder_logits` recomputes, without the cache and with it."""
    ids, mask = left_padded(official["prompts"])
    setting = dict(gen_length=6, steps=2, threshold=threshold, minimal_topk=1)
    sampler = llada2_sampler(official, setting, temperature=1.0, cache="dual")
    rollout = sampler.sample(model, ids, mask, generator=torch.Generator().manual_seed(0))
    committed_positions = rollout.commit_step >= 0
    for replay in (sampler, sampler.with_config(dataclasses.replace(sampler.config, cache="none"))):
        replayed = torch.full(rollout.step_logprobs.shape, float("nan"))
        for window, committed, logits, _ in replay.decoder_logits(model, rollout):
            logprobs = sampling_logprobs(logits, completion_window(rollout.completion_ids, window), 1.0)
            for row, position in committed.nonzero().tolist():
                index = window.start + position if isinstance(window, slice) else int(window[row, position])
                replayed[row, index] = logprobs[row, position]
        assert not replayed[~committed_positions].isfinite().any()
        torch.testing.assert_close(replayed[committed_positions], rollout.step_logprobs[committed_positions],
                                   atol=1e-5, rtol=0)


def test_the_llada2_eval_protocol_decodes_the_official_defaults(model, official):
    """LLaDA2's default eval protocol (a step per block position, threshold 0.95, the exact cache) gives the official
    generate's tokens at those settings for a prompt of whole blocks (its last block then ends at gen_length)."""
    tokens = SpecialTokens(mask_token_id=model.config.mask_token_id, eos_token_ids=(official["eos"],),
                           pad_token_id=PAD)
    config = block_protocol_sampler_config(family_of("llada2_moe"), 8, official["block_length"], tokens, 0.0)
    assert (config.threshold, config.steps, config.cache) == (0.95, 8, "dual")
    prompt = next(i for i, row in enumerate(official["prompts"]) if len(row) == official["block_length"])
    rollout = MaskedDiffusionSampler(config).sample(model, official["prompts"][prompt][None])
    index = next(i for i, row in enumerate(official["rows"]) if int(official["prompt_index"][i]) == prompt and row == {
        "gen_length": 8.0, "steps": 4.0, "threshold": 0.95, "minimal_topk": 1.0, "eos_early_stop": 0.0})
    assert torch.equal(rollout.completion_ids[0][rollout.completion_mask[0]], official["completions"][index])


def test_completion_length_is_checked():
    with pytest.raises(ValueError, match="completion_length"):
        DiffusionSamplerConfig(gen_length=8, block_length=4, steps=8, completion_length=9)
    with pytest.raises(ValueError, match="minimal_topk"):
        llada2_generate_settings(gen_length=4, block_length=4, steps=4, threshold=0.9, minimal_topk=5)
