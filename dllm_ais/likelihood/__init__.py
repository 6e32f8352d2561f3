"""Likelihood stage: per-token log-probs of sampled completions under a policy.

Formulas: docs/algorithms.md, section "Likelihood estimators".

Every estimator is a pure function of the model and tensors; the model is an argument and nothing
here switches grad on or off, so the same call gives ℓ_rollout / ℓ_old / ℓ_ref under `torch.no_grad()`
and ℓ_θ under grad. Canvases are `[left-padded prompt (P) | completion (L)]`, as in `Rollout`.

One module per job, each importing only the ones above it in this list:
- `logits`      float32 log-probs from logits (`selective_log_softmax`), the sampling distribution (`shape_logits`),
                entropies, the canvas checks, the seeded mask generator (`mask_generator`), and the logits every
                diffusion estimator scores on a noisy canvas (`noisy_canvas_logits`: for a block-causal family, SDAR,
                its training-mode forward, each block against the clean blocks before it).
- `one_step`    `one_step_logprobs`, the diffu-GRPO one-step surrogate (default estimator, one forward).
- `trajectory`  `trajectory_logprobs`, the exact log-prob of the recorded denoising trajectory (one forward per step,
                per round of every block's r-th step for SDAR: `trajectory_stages`, or the rollout decoder's own
                logits: `decoder_trajectory_pieces`), and `step_merge_logprobs`, d2's
                StepMerge (one forward per segment); both also piece by piece (`LogprobPiece`).
- `bounds`      `mc_elbo`, LLaDA's Monte-Carlo lower bound (optionally with coupled masks; the `elbo` estimator), and
                `eubo_from_draws` / `sandwiched_log_likelihood`, SPG's upper bound and its sandwich with the ELBO by
                the sign of the advantage (the `spg` estimator), with their `BoundSettings`.
- `causal`      `causal_logprobs`, teacher-forced log-probs of causal LMs under the AR sampler's distribution.
- `registry`    `DIFFUSION_ESTIMATORS`: what a config's `likelihood.estimator` names, with `EstimatorSettings`.
"""
from dllm_ais.likelihood.bounds import (
    BoundSettings,
    MaskDraw,
    block_mask_draws,
    elbo_from_draws,
    eubo_from_draws,
    masked_completion_logprobs,
    mc_elbo,
    random_mask_draws,
    sandwiched_log_likelihood,
    spread_over_tokens,
)
from dllm_ais.likelihood.causal import causal_logprobs, causal_position_ids, require_causal_lm
from dllm_ais.likelihood.logits import (
    DEFAULT_CHUNK_ROWS,
    LogitsFn,
    check_sampling_parameters,
    is_plain_int,
    mask_generator,
    noisy_canvas_logits,
    plain_logits,
    selective_log_softmax,
    shape_logits,
)
from dllm_ais.likelihood.one_step import one_step_logprobs, one_step_masked_input
from dllm_ais.likelihood.registry import (
    DIFFUSION_ESTIMATORS,
    BlockSubset,
    DiffusionEstimator,
    EstimatorSettings,
    scored_positions,
)
from dllm_ais.likelihood.trajectory import (
    LogprobPiece,
    block_step_ranks,
    decoder_trajectory_pieces,
    merges_no_steps,
    step_merge_logprobs,
    step_merge_pieces,
    step_merge_segments,
    sum_pieces,
    trajectory_logprobs,
    trajectory_pieces,
    trajectory_stages,
    whole_piece,
)

__all__ = [
    "DEFAULT_CHUNK_ROWS",
    "DIFFUSION_ESTIMATORS",
    "BlockSubset",
    "BoundSettings",
    "DiffusionEstimator",
    "EstimatorSettings",
    "LogitsFn",
    "MaskDraw",
    "block_mask_draws",
    "block_step_ranks",
    "LogprobPiece",
    "causal_logprobs",
    "causal_position_ids",
    "check_sampling_parameters",
    "decoder_trajectory_pieces",
    "elbo_from_draws",
    "eubo_from_draws",
    "is_plain_int",
    "mask_generator",
    "masked_completion_logprobs",
    "mc_elbo",
    "merges_no_steps",
    "noisy_canvas_logits",
    "one_step_logprobs",
    "one_step_masked_input",
    "plain_logits",
    "random_mask_draws",
    "require_causal_lm",
    "sandwiched_log_likelihood",
    "scored_positions",
    "selective_log_softmax",
    "shape_logits",
    "spread_over_tokens",
    "step_merge_logprobs",
    "step_merge_pieces",
    "step_merge_segments",
    "sum_pieces",
    "trajectory_logprobs",
    "trajectory_pieces",
    "trajectory_stages",
    "whole_piece",
]
