"""The families' own decoding protocols (`dllm-ais eval --protocol dream|sdar|llada2`), each a family record's decoder
(`dllm_ais.models.families`: its rollout settings over d1's, its blocks) applied to a `GRPOConfig`, greedy, one
denoising step per token. d1's protocol, every diffusion family's default and held-out validation's, is
`config.with_d1_protocol`.
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
