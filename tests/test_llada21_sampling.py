"""The masked-diffusion sampler's LLaDA2.1 editing decoder on LLaDA2: the official 2.1 ``generate``'s greedy tokens
(one row per call) token for token over a grid of its settings (mask-to-token threshold, token-to-token editing
threshold, post steps), the prompts of each setting decoded as one left-padded batch, with and without the cache
(tools/make_llada21_generate_fixture.py wrote the official rows, from the checkpoint of test_llada2_sampling.py)."""

import collections

import pytest
import torch

import dllm_ais  # noqa: F401  (registers "llada2_moe")
from dllm_ais.decoding_protocols import llada21_generate_settings
from dllm_ais.sampling.diffusion import DiffusionSamplerConfig, MaskedDiffusionSampler
from test_llada2_sampling import (  # tests/ is on sys.path
    PAD,
    assert_every_official_row,
    assert_grid_stops_at_eos,
    left_padded,
    model,  # noqa: F401  (the fixture: the tiny checkpoint in float32)
    read_official_generate,
    twin,
)


@pytest.fixture(scope="module")
def official() -> dict:
    return read_official_generate("official_generate_21.safetensors")


def editing_threshold(official: dict, setting: dict) -> float | None:
    """The grid row's editing threshold, None where the fixture records editing off (a threshold above 1)."""
    value = setting["editing_threshold"]
    return None if value == float(official["metadata"]["editing_off"]) else value


def llada21_sampler(official: dict, setting: dict, **overrides) -> MaskedDiffusionSampler:
    """The sampler decoding as the official 2.1 generate with the grid row's `setting` (greedy unless overridden;
    `editing_threshold` overrides the row's, None for off)."""
    editing = overrides.pop("editing_threshold", editing_threshold(official, setting))
    fields = llada21_generate_settings(int(setting["gen_length"]), official["block_length"], setting["threshold"],
                                       editing, int(setting["max_post_steps"]), int(setting["num_to_transfer"]))
    fields.update({"temperature": 0.0, "eos_token_ids": (official["eos"],), "pad_token_id": PAD, **overrides})
    return MaskedDiffusionSampler(DiffusionSamplerConfig(**fields))


def edited_rows(official: dict) -> list[int]:
    """The grid rows whose completion differs from the same row's with editing off (an edit shows in it)."""
    off = float(official["metadata"]["editing_off"])
    return [index for index, row in enumerate(official["rows"]) if row["editing_threshold"] != off and not torch.equal(
        official["completions"][index], official["completions"][twin(official, index, editing_threshold=off)])]


def test_the_grid_covers_edits_post_steps_and_stops_at_eos(official):
    """The fixture holds rows changed by editing, rows where the post steps (iterations after the block has no mask)
    change the tokens, between 0 and 1 and between 1 and 16 of them, stops at EOS and the last block past gen_length;
    eos_early_stop changes no token, nor do post steps without editing."""
    completions, rows, off = official["completions"], official["rows"], float(official["metadata"]["editing_off"])
    assert {row["editing_threshold"] for row in rows} - {off} and len(edited_rows(official)) >= len(rows) // 4
    for fewer, more in ((0.0, 1.0), (1.0, 16.0)):
        assert any(row["max_post_steps"] == fewer and not torch.equal(
            completions[index], completions[twin(official, index, max_post_steps=more)])
            for index, row in enumerate(rows))
    assert_grid_stops_at_eos(official)
    for index, row in enumerate(rows):
        if row["editing_threshold"] == off and row["max_post_steps"]:
            assert torch.equal(completions[index], completions[twin(official, index, max_post_steps=0.0)])


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_batched_greedy_editing_decoding_reproduces_every_official_row(model, official, cache):  # noqa: F811
    """Per setting of the grid, the three prompts (3, 4 and 6 tokens: blocks of 4 from each row's first token) as one
    left-padded batch: each row's completion is the official one (`assert_every_official_row`)."""
    assert_every_official_row(model, official, llada21_sampler, cache)


def test_decoding_without_editing_misses_the_official_edits(model, official):  # noqa: F811
    """Negative control: on the setting whose official rows editing changed most, the sampler with editing off gives
    the official editing-off rows, so another completion than the official one for at least one prompt; with editing
    on, its rollout records edits."""
    edited = [index for index in edited_rows(official) if not official["rows"][index]["eos_early_stop"]]
    setting = dict(collections.Counter(tuple(official["rows"][index].items()) for index in edited).most_common(1)[0][0])
    ids, mask = left_padded(official["prompts"])
    plain = llada21_sampler(official, setting, editing_threshold=None).sample(model, ids, mask)
    off, differs = float(official["metadata"]["editing_off"]), 0
    for prompt in range(len(official["prompts"])):
        index = next(i for i, row in enumerate(official["rows"]) if row == setting
                     and int(official["prompt_index"][i]) == prompt)
        got = plain.completion_ids[prompt][plain.completion_mask[prompt]]
        assert torch.equal(got, official["completions"][twin(official, index, editing_threshold=off)])
        differs += not torch.equal(got, official["completions"][index])
    assert differs >= 1
    assert "edits" in llada21_sampler(official, setting).sample(model, ids, mask).records
