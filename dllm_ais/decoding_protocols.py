"""The families' own decoding protocols (`dllm-ais eval --protocol dream|sdar|llada2`), each a family record's
decoder (`dllm_ais.models.families`: its rollout settings over d1's, its blocks) applied to a `GRPOConfig`, greedy,
one denoising step per token. d1's protocol, every diffusion family's default and held-out validation's, is
`config.with_d1_protocol`. And LLaDA2's official ``generate`` as the sampler's settings (`llada2_generate_settings`).
"""

from __future__ import annotations

from dllm_ais.config import D1_ROLLOUT, GRPOConfig, exact_decoding
from dllm_ais.models.families import FAMILIES, ModelFamily, family_of


def protocol_family(name: str) -> ModelFamily:
    """The family whose own decoder the protocol `name` is; ValueError for a name no family's record gives."""
    found = next((family for family in FAMILIES if family.protocol == name), None)
    if found is None:
        raise ValueError(f"no model family decodes with a protocol named {name!r}")
    return found


def protocol_rollout(family: ModelFamily) -> dict:
    """The rollout settings of `family`'s own decoder: d1's (`D1_ROLLOUT`) with its record's `protocol_rollout`."""
    return {**D1_ROLLOUT, **family.protocol_rollout}


def with_family_protocol(config: GRPOConfig, family: ModelFamily, gen_length: int,
                         block_size: int | None = None) -> GRPOConfig:
    """`config` decoding with `family`'s own decoder at ``gen_length``, greedy: `protocol_rollout`, blocks of the
    whole completion or of the model's `block_size` (the record's `protocol_blocks`), one step per token."""
    block_length = gen_length if family.protocol_blocks == "completion" else block_size
    return exact_decoding(config, gen_length, {**protocol_rollout(family), "block_length": block_length,
                                               "steps": gen_length})


DREAM_ROLLOUT = protocol_rollout(family_of("Dream"))
SDAR_ROLLOUT = protocol_rollout(family_of("sdar"))
SDAR_THRESHOLD = SDAR_ROLLOUT["threshold"]


def with_dream_protocol(config: GRPOConfig, gen_length: int) -> GRPOConfig:
    """`config` decoding as Dream's own evaluation does (``diffusion_generate``), greedy: the whole completion as one
    block, one step per token, Dream's entropy rule on its time-linear schedule (`DREAM_ROLLOUT`); `dllm-ais eval
    --protocol dream`."""
    return with_family_protocol(config, family_of("Dream"), gen_length)


def with_sdar_protocol(config: GRPOConfig, gen_length: int, block_size: int) -> GRPOConfig:
    """`config` decoding as SDAR's own generation does (JetAstra/SDAR ``generate.py``), greedy: blocks of the model's
    `block_size`, as many denoising steps per block as it has positions (``denoising_steps = block_length``, 4 for
    the released models), `SDAR_ROLLOUT`'s low_confidence_dynamic at `SDAR_THRESHOLD`, the exact cache; `dllm-ais
    eval --protocol sdar`. Threshold 1.0 would be the static rule (low_confidence_static). Its differences from
    ``generate.py``: `dllm_ais.models.families`."""
    return with_family_protocol(config, family_of("sdar"), gen_length, block_size)


def llada2_generate_settings(gen_length: int, block_length: int, steps: int, threshold: float,
                             minimal_topk: int = 1) -> dict:
    """The `DiffusionSamplerConfig` settings that decode as LLaDA2's official ``generate`` with these arguments
    (``steps`` per block), batched; temperature, top_p and top_k carry over as they are, and any cache mode is the
    exact cache.

    ``generate`` runs ``min(steps, gen_length // minimal_topk)`` steps in each block (the even schedule of a whole
    block), committing at each step every masked position whose confidence (the drawn token's probability:
    ``maskgit_plus``) exceeds `threshold`, or, when fewer do, the step's scheduled count of top-confidence
    positions: the parallel threshold rule with the block-causal floor. Its blocks are the model's, from the prompt's
    first token, its last one decoded whole past `gen_length`: here the canvas holds enough blocks for every row's
    last one (``gen_length + block_length − 1`` rounded up to whole blocks) and the completion ends at `gen_length`
    (``completion_length``). It stops after the block holding EOS (``stop_at_eos``); ``eos_early_stop`` stops
    within that block, which changes no token. The differences: `dllm_ais.models.families`."""
    steps_per_block = min(steps, gen_length // minimal_topk)
    if steps_per_block < 1:
        raise ValueError(f"minimal_topk={minimal_topk} > gen_length={gen_length} leaves no step per block")
    blocks = -(-(gen_length + block_length - 1) // block_length)
    return {"gen_length": blocks * block_length, "block_length": block_length, "steps": steps_per_block * blocks,
            "threshold": threshold, "remasking": "maskgit_plus", "completion_length": gen_length,
            "stop_at_eos": True}


def llada21_generate_settings(gen_length: int, block_length: int, threshold: float, editing_threshold: float | None,
                              max_post_steps: int, num_to_transfer: int = 1) -> dict:
    """The `DiffusionSamplerConfig` settings that decode as LLaDA2.1's official ``generate`` with these arguments,
    batched (`llada2_generate_settings` for what it shares with 2.0: the canvas past `gen_length`, maskgit_plus).

    Each iteration of a block commits the masked positions whose confidence exceeds `threshold`, at least
    `num_to_transfer` of them (the even schedule of ``block_length / num_to_transfer`` steps per block, whose every
    count is `num_to_transfer`), and edits the filled ones above `editing_threshold` (None: no editing, the decoder
    of 2.0 with that floor); a block ends on an iteration that began with no mask and edited nothing, or after
    `max_post_steps` iterations without a mask (`dllm_ais.sampling.diffusion.editing`). Its ``steps`` and
    ``minimal_topk`` decode nothing. It stops after a block only with ``eos_early_stop`` (when the completion so far
    holds no mask and an EOS), 2.0 after any block holding EOS: both return the completion through its first EOS,
    which the blocks after it do not change, so the sampler stops at it either way (``stop_at_eos``). The differences
    from the official code: `dllm_ais.models.families`."""
    if num_to_transfer < 1 or block_length % num_to_transfer:
        raise ValueError(f"num_to_transfer={num_to_transfer} must be a positive divisor of block_length={block_length}")
    blocks = -(-(gen_length + block_length - 1) // block_length)
    settings = {"gen_length": blocks * block_length, "block_length": block_length,
                "steps": block_length // num_to_transfer * blocks, "threshold": threshold, "remasking": "maskgit_plus",
                "completion_length": gen_length, "stop_at_eos": True}
    if editing_threshold is not None:
        settings.update(editing_threshold=editing_threshold, max_post_steps=max_post_steps)
    return settings
