"""Masked-diffusion sampling: the LLaDA generation algorithm and its options (Dream's decoding, Fast-dLLM's block
cache and parallel decoding, block-causal models such as SDAR and LLaDA2), recording the behaviour policy.

Formulas: docs/algorithms.md, section "Masked-diffusion sampling". The package, in the order a step uses it:

- `rules` — remasking rules: which still-masked positions commit first (registered by name, or a callable);
- `schedule` — how many positions a step commits (LLaDA's even split, Dream's time-linear and ``origin``,
  Fast-dLLM's threshold and factor rules);
- `draw` — the candidates' Gumbel-max draw, their log-probs, Dream's top-p / top-k filter;
- `step` — **the one denoising step** (`denoise_step`): from a block's tokens, its mask state and logits, the
  candidates, their log-probs, the rule's scores and the commits; called by sampling and by the commit-choice replay;
- `canvas` — where prompts and completions sit on the canvas, and the blocks decoded in turn;
- `cache` — the block KV cache of one call (prefix, dual, a block-causal model's exact cache), through the sampling
  forwards the caller hands in (`dllm_ais.sampling.forwards`: eager, or the compiled engine's static ones);
- `choice` — the experimental complete ratio: a stochastic commit rule's recorded choice probability and its replay;
- `editing` — LLaDA2.1's token editing (``editing_threshold``): the edit rule, the rollout's edit record and the
  replay's canvases rebuilt from a rollout's writes (`ReplayedWrites`);
- `sampler_config` — `DiffusionSamplerConfig`, each setting checked where it is declared;
- `sampler` — `MaskedDiffusionSampler`: the loop over blocks, `replay`, `decoder_logits` (the trainer's replay of the
  decoder), `scoring_logits` (the estimators' forward).

The canvas starts as ``[left-padded prompt | MASK x gen_length]`` and is filled in semi-autoregressive blocks of
``block_length`` positions, ``steps / n_blocks`` steps per block. Each step runs one forward, draws a candidate for
every still-masked position of the block (Gumbel-max at temperature τ, argmax at τ = 0), scores them with the
remasking rule and commits the top-scored ones. With τ = 0, ``remasking="low_confidence"`` and no cache the
committed tokens are those of the official LLaDA ``generate``; Dream's ``diffusion_generate`` is options of the same
sampler (``schedule="time_linear"``, its position rules, ``position_temperature``, ``top_p`` / ``top_k``); its logits
at position i − 1 predict position i (`dllm_ais.models.families`).

Faster rollouts change the behaviour policy, and the recorded log-probs are those of the (approximate) logits each
token was drawn from, so the trajectory estimator's ratio sees the approximation: ``cache="prefix" | "dual"`` (the
block's later steps run the block, and everything after it for prefix, against the keys/values of its first step);
``threshold`` / ``factor`` (parallel decoding: each step commits every position above τ_c, or the factor rule's n, at
least one; a block runs until it is filled). Parallel decoding reads the device about once per block: a block runs
the steps the block before it needed with its counts on the device, then reads what is left, and at most once more
after as many steps as its slowest row has masked positions left — the tokens of stepping until the block is filled,
without a host read per step, so the compiled engine replays those steps too; a run longer than a block needs runs
forwards that commit nothing (`MaskedDiffusionSampler._denoise_block_in_parallel`).

Block-causal models (`dllm_ais.models.families`: SDAR, LLaDA2; or ``block_causal=True``) attend causally across
blocks of ``config.block_size`` positions counted from each row's first real token. Their official decoders (one row)
decode the model's own blocks in turn against the cache of the finished blocks. The sampler does the same for a
batch on a block-aligned canvas (`canvas.block_aligned_layout`: each prompt moved right by whole blocks, so that one
slice is every row's current block); where a row's completion starts mid-block, its first block holds the prompt's
tail and its last one is cut at ``gen_length``, unless ``completion_length`` ends the completion before the canvas
does (the positions past it decoded, outside the completion mask). SDAR's settings here: ``block_length`` = its
``block_size``; ``steps`` = its ``denoising_steps`` × the blocks; ``maskgit_plus`` its ``low_confidence_static``,
``left_to_right`` its ``sequential``, ``maskgit_plus`` with ``threshold`` its ``low_confidence_dynamic`` (every
position above the threshold, at least the even schedule's count of the step). LLaDA2's ``generate`` is the same
dynamic rule, its last block decoded whole past its ``gen_length`` and its stop after the block holding EOS
(``stop_at_eos``): `dllm_ais.decoding_protocols.llada2_generate_settings` maps its arguments; LLaDA2.1's adds token
editing (`editing`; `llada21_generate_settings`). Any cache mode is the
exact cache; without ``stop_at_eos`` a stop token ends the completion but not the decoding. Each official decoder's
differences: `dllm_ais.models.families`.

Besides the tokens, every committed token's step and log-probability under the distribution it was drawn from are
recorded in the `Rollout` (``commit_step``, ``step_logprobs``): the behaviour policy the correction compares with the
trainer's. The model is called as ``model(input_ids, attention_mask=…, logits_to_keep=positions)`` and, with a
cache, also with ``past_key_values``, ``cache_position`` and ``use_cache``, as dllm_ais' models take them.

Extension points: a remasking rule (``rule(block_logits [B, Lb, V], candidates [B, Lb], generator) -> scores``,
higher commits first; `register_remasking_rule`); or a subclass of `MaskedDiffusionSampler` overriding one stage of
the step: `block_logits` (the forward and logit processing), `propose_tokens` (the draw and its log-probs; the
log-prob must be that of the distribution sampled) or `choose_positions`. What training with a sampler relies on:
`scoring_logits` (`block_logits` without a cache) is the estimators' ``logits_fn``, so what `block_logits` does is
scored as sampled; the trajectory estimator scores a committed token by softmax(logits / τ), so a subclass whose
`token_logprobs` differs is refused with it (`policy.DiffusionPolicy`); `with_config` gives the same sampler with
other settings.
"""

from dllm_ais.choices import CACHE_MODES
from dllm_ais.sampling.diffusion.cache import BlockCache
from dllm_ais.sampling.diffusion.canvas import CanvasLayout, block_aligned_layout, completion_layout, completion_window
from dllm_ais.sampling.diffusion.choice import committed_set_logprobs, ranked_choice_logprobs, threshold_choice_logprobs
from dllm_ais.sampling.diffusion.draw import (filter_top_p_top_k, gumbel_argmax, masked_positions_first,
                                              perturb_scores_for_sampling, sampling_logprobs)
from dllm_ais.sampling.diffusion.rules import (REMASKING_RULES, RemaskingRule, left_to_right_scores,
                                               low_confidence_scores, negative_entropy_scores, random_scores,
                                               register_remasking_rule, resolve_remasking_rule,
                                               sampled_token_probability_scores, scores_candidate_probability,
                                               scores_sampling_distribution, top_log_odds_scores,
                                               top_probability_scores, top_two_margin_scores)
from dllm_ais.sampling.diffusion.sampler import MaskedDiffusionSampler
from dllm_ais.sampling.diffusion.sampler_config import DiffusionSamplerConfig, SpecialTokenIds
from dllm_ais.sampling.diffusion.schedule import (origin_commit_counts, parallel_commit_counts,
                                                  time_linear_commit_count, transfer_schedule)
from dllm_ais.sampling.diffusion.step import DenoiseStep, denoise_step, threshold_commits

__all__ = [
    "CACHE_MODES", "BlockCache", "CanvasLayout", "DenoiseStep", "DiffusionSamplerConfig", "MaskedDiffusionSampler",
    "REMASKING_RULES", "RemaskingRule", "SpecialTokenIds", "block_aligned_layout", "committed_set_logprobs",
    "completion_layout", "completion_window", "denoise_step", "filter_top_p_top_k", "gumbel_argmax",
    "left_to_right_scores", "low_confidence_scores", "masked_positions_first", "negative_entropy_scores",
    "origin_commit_counts", "parallel_commit_counts", "perturb_scores_for_sampling", "random_scores",
    "ranked_choice_logprobs", "register_remasking_rule", "resolve_remasking_rule", "sampled_token_probability_scores",
    "sampling_logprobs", "scores_candidate_probability", "scores_sampling_distribution", "threshold_choice_logprobs",
    "threshold_commits", "time_linear_commit_count", "top_log_odds_scores", "top_probability_scores",
    "top_two_margin_scores", "transfer_schedule",
]
