"""The families' own decoding protocols, each a set of rollout settings applied to a `GRPOConfig` (`dllm-ais eval
--protocol`; d1's, every diffusion family's default and held-out validation's, is `config.with_d1_protocol`).

This module imports nothing heavy: `dllm-ais --help` must not import torch.
"""

from __future__ import annotations

from dllm_ais.config import D1_ROLLOUT, GRPOConfig, exact_decoding


DREAM_ROLLOUT = {**D1_ROLLOUT, "remasking": "entropy", "schedule": "time_linear"}
# SDAR's own decoder (JetAstra/SDAR): low_confidence_dynamic (the drawn token's probability, every position above the
# threshold and at least the step's scheduled count) at the threshold of the README's inference examples, with the
# exact cache of finished blocks (any cache mode is that cache for a block-causal model)
SDAR_THRESHOLD = 0.9
SDAR_ROLLOUT = {**D1_ROLLOUT, "remasking": "maskgit_plus", "threshold": SDAR_THRESHOLD, "cache": "dual"}


def with_dream_protocol(config: GRPOConfig, gen_length: int) -> GRPOConfig:
    """`config` decoding as Dream's own evaluation does (``diffusion_generate``), greedy: the whole completion as one
    block, one step per token, Dream's entropy rule on its time-linear schedule (`DREAM_ROLLOUT`); `dllm-ais eval
    --protocol dream`. Dream's published runs sample at temperature 0.1 with top-p 0.9; this protocol is greedy."""
    return exact_decoding(config, gen_length, {**DREAM_ROLLOUT, "block_length": gen_length, "steps": gen_length})


def with_sdar_protocol(config: GRPOConfig, gen_length: int, block_size: int) -> GRPOConfig:
    """`config` decoding as SDAR's own generation does (JetAstra/SDAR ``generate.py``), greedy: blocks of the model's
    `block_size`, as many denoising steps per block as it has positions (``denoising_steps = block_length``, 4 for
    the released models), `SDAR_ROLLOUT`'s low_confidence_dynamic at `SDAR_THRESHOLD`, the exact cache; `dllm-ais
    eval --protocol sdar`. ``generate.py``'s own default threshold is 0.85, its README's engines use 0.9; threshold
    1.0 would be the static rule (low_confidence_static)."""
    return exact_decoding(config, gen_length, {**SDAR_ROLLOUT, "block_length": block_size, "steps": gen_length})
