"""The settings groups of the pipeline's stages: `rollout` (the engine's precision and the diffusion decoder),
`likelihood` (the diffusion log-prob estimator), `correction` (the rollout-mismatch correction, bypass mode included)
and `experimental` (study knobs). Each group is one frozen dataclass that checks its own fields and rules; the stage it
belongs to takes the group object itself, and `dllm_ais.config.GRPOConfig` holds one of each.

This module imports nothing heavy and nothing above `choices` and `validation`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dllm_ais.choices import (
    ALPHA_RULES, CACHE_DTYPES, CACHE_MODES, COMMIT_SCHEDULES, CORRECTION_METHODS, ESTIMATORS, FIDELITY_MODES, IS_LEVELS, LIKELIHOOD_DECODERS,
    LIKELIHOOD_ORDERS, PRECISION_FLOWS, PRECISIONS, RATIO_TYPES,
)
from dllm_ais.validation import field_problems


def choice(*options: str) -> dict:
    """A field's metadata allowing only `options`."""
    return {"choices": options}


# Upper bounds far beyond any real run, so an absurd value fails here instead of hanging or exhausting memory later.
MAX_SIZE = 65_536  # batch sizes, group size, LoRA rank
MAX_TOKENS = 1_048_576
MAX_PROMPTS = 10_000_000  # the digits task generates this many

AT_LEAST_ONE = {"range": "[1, inf)"}
NON_NEGATIVE = {"range": "[0, inf)"}
POSITIVE = {"range": "(0, inf)"}
PATH = {"path": True}  # "~" is expanded


GROUP = "group"  # metadata key of the GRPOConfig fields that hold a settings group


class SettingsGroup:
    """A group of settings of one pipeline stage, named `NAME` in recipes (`rollout: {cache: dual}`) and on the command
    line (`--rollout.cache=dual`). Each group checks its own fields and rules (`problems`); the stage it belongs to
    takes the group object itself. Groups are frozen: `dataclasses.replace` makes a changed copy."""

    NAME = ""
    TITLE = ""

    def problems(self) -> list[str]:
        """Every problem of this group's fields (type, choices, range) and of its rules, each naming the field as
        `NAME.field`; [] when valid."""
        invalid = field_problems(self)
        found = [f"{self.NAME}.{problem}" for problems in invalid.values() for problem in problems]
        return found if invalid else found + self.rule_problems()

    def rule_problems(self) -> list[str]:
        """The group's rules across its own fields (its fields are well typed when this runs)."""
        return []


@dataclass(frozen=True)
class RolloutSettings(SettingsGroup):
    """How the rollout engine samples: its precision, and the masked-diffusion decoder (LLaDA's sampler with
    Fast-dLLM's block cache and parallel commits). TRL's sampling names (temperature, top_k, top_p,
    num_generations, max_completion_length) stay at the top level."""

    NAME = "rollout"
    TITLE = "the rollout engine's precision and the masked-diffusion decoder"

    precision: str = field(default="fp8", metadata={**choice(*PRECISIONS),
        "help": "Precision of the rollout engine; bf16 = no quantization (on-policy baseline)."})
    precision_flow: str = field(default="split", metadata={**choice(*PRECISION_FLOWS),
        "help": "split = the engine is a quantized copy of the policy and the trainer computes in high precision; "
                "unified = one model: the trainer computes with the engine's quantized linears (gradients straight "
                "through; LoRA beside the quantized base, full fine-tuning quantized on the fly), so ℓ_old = "
                "ℓ_rollout wherever both are one forward."})
    steps: int = field(default=128, metadata={**AT_LEAST_ONE, "help": "Denoising steps over the whole completion."})
    block_length: int = field(default=32, metadata={**AT_LEAST_ONE, "help": "Semi-autoregressive block length."})
    remasking: str = field(default="low_confidence", metadata={
        "help": "Which masked positions commit first: low_confidence, random, left_to_right (LLaDA); maskgit_plus, "
                "topk_margin, entropy, origin (Dream); top_probability (low_confidence reading no candidate: the "
                "complete ratio's fixed-count rule), top_log_odds (its log-odds: a drawn order that separates "
                "near-certain positions); or a rule registered with register_remasking_rule."})
    cfg_scale: float = field(default=0.0, metadata={**NON_NEGATIVE,
        "help": "Classifier-free guidance s: logits = u + (s + 1)(c - u), u with the prompt masked (two forwards per "
                "step); every likelihood estimator scores the guided logits, as sampled (as d1)."})
    cache: str = field(default="none", metadata={**choice(*CACHE_MODES),
        "help": "Block KV cache (Fast-dLLM): none = the official algorithm; prefix / dual reuse keys/values within a "
                "block (approximate: docs/algorithms.md says what the importance ratio sees of it)."})
    cache_refresh_interval: int | None = field(default=None, metadata={**AT_LEAST_ONE,
        "help": "With a cache: also refresh it every this many steps inside a block (1 = every step, the uncached "
                "algorithm). null = only at each block's first step."})
    cache_dtype: str = field(default="none", metadata={**choice(*CACHE_DTYPES),
        "help": "Storage of the block KV cache: none = the model's dtype; fp8 = e4m3 with one scale per row and head, "
                "dequantized when read (needs a cache)."})
    threshold: float | None = field(default=None, metadata={"range": "[0, 1]",
        "help": "Parallel decoding: commit every block position with confidence > this (>= 1 per step; Fast-dLLM: "
                "0.9); steps then no longer applies. null = the fixed step schedule."})
    editing_threshold: float | None = field(default=None, metadata={"range": "[0, 1]",
        "help": "LLaDA2.1's token-to-token editing: a filled position of the block is overwritten when the model's "
                "token there differs with probability above this (LLaDA2.1: 0.5). Needs a block-causal family "
                "(LLaDA2) and rollout.threshold. null = off."})
    max_post_steps: int = field(default=16, metadata={"range": f"[0, {MAX_TOKENS}]",
        "help": "With rollout.editing_threshold: the most steps a block runs after its last mask is filled (a block "
                "also ends on a step that edits nothing)."})
    schedule: str = field(default="even", metadata={**choice(*COMMIT_SCHEDULES),
        "help": "Tokens committed per step: even = LLaDA's split of each block over its steps; time_linear = "
                "Dream's floor(n (1 - s/t)) of the n still masked, t = linspace(1, 1e-3, steps + 1)."})
    compile: bool | None = field(default=None, metadata={
        "help": "Compiled engine: each transformer block compiled once (torch.compile) and the sampling forwards "
                "replayed as CUDA graphs, the KV cache in static buffers. null = on with CUDA, off on CPU."})
    batch_size: int | None = field(default=None, metadata={"range": "[1, 65536]",
        "help": "Completions decoded per rollout call; null = all of a process's generations for the step at once "
                "(throughput grows with the batch), a number caps it (memory)."})

    def rule_problems(self) -> list[str]:
        problems = []
        if self.cache_dtype != "none" and self.cache == "none":
            problems.append(f"rollout.cache_dtype={self.cache_dtype} stores the block KV cache, and rollout.cache=none "
                            "keeps none: set rollout.cache to prefix or dual, or rollout.cache_dtype=none")
        if self.editing_threshold is not None and self.threshold is None:
            problems.append(f"rollout.editing_threshold={self.editing_threshold} edits while the threshold rule fills "
                            "the masks: set rollout.threshold (LLaDA2.1: 0.7), or rollout.editing_threshold=null")
        if self.precision_flow == "unified" and self.compile:
            problems.append("rollout.compile=true compiles the split engine's own copy of the model, and "
                            "rollout.precision_flow=unified samples with the trainer's model: set rollout.compile=false "
                            "(or null), or rollout.precision_flow=split")
        return problems


@dataclass(frozen=True)
class LikelihoodSettings(SettingsGroup):
    """How a completion's log-probs are estimated under a diffusion policy (the same estimator, with the same random
    masks, on the rollout engine, the trainer and the reference)."""

    NAME = "likelihood"
    TITLE = "the diffusion log-prob estimator"

    estimator: str = field(default="one_step", metadata={**choice(*ESTIMATORS),
        "help": "one_step = d1's surrogate (one forward); trajectory = the exact replay of the denoising steps (one "
                "forward per step); step_merge = d2's StepMerge (the steps merged into `segments`); elbo = LLaDA's "
                "Monte-Carlo bound; spg = SPG's ELBO/EUBO sandwich. elbo and spg give each token an equal share of one "
                "log-likelihood per completion: the ratio is then GSPO's length-normalised sequence ratio."})
    segments: int = field(default=16, metadata={"range": f"[1, {MAX_TOKENS}]",
        "help": "step_merge: N, the contiguous segments the denoising steps are merged into (one forward each); "
                "N >= rollout.steps is the exact trajectory, N = 1 d1's surrogate with an unmasked prompt."})
    p_mask_prompt: float = field(default=0.15, metadata={"range": "[0, 1)",
        "help": "Probability of masking each prompt token in the one_step, elbo and spg estimators' canvases."})
    elbo_samples: int = field(default=2, metadata={"range": "[1, 1024]",
        "help": "elbo and spg: Monte-Carlo draws of the masking process per estimate, one forward each (SPG's num_t)."})
    spg_eubo_beta: float = field(default=1.5, metadata={"range": "[1, inf)",
        "help": "spg: the EUBO's exponent beta (SPG: 1.5 for GSM8K and MATH, 2 for Countdown, 1 for Sudoku)."})
    spg_block_masking: bool = field(default=True, metadata={
        "help": "spg: SPG's block-wise masks (earlier blocks clean, one block partly masked, later blocks masked) "
                "instead of LLaDA's random masks."})


@dataclass(frozen=True)
class CorrectionSettings(SettingsGroup):
    """The rollout-mismatch correction (`dllm_ais.correction.correct`): `method` is "none" (w = 1, the ratio
    diagnostics still logged), "tis" / "mis" (importance weights at `level`, truncating / masking at `clip` and
    `clip_low`, optionally `normalize`d), "acr" (token TIS weights plus the ACR clip scale) or "ais" (adaptive
    importance sampling with `ais_rule`, `ais_snr_scale`, `ais_kl_scale`, `ais_alpha_max` and the EMA `ais_alpha_ema`
    of α across generation batches). `bypass_mode` is verl's: the
    rollout's log-probs are the old ones, so the loss's clipped ratio π_θ / π_rollout carries the mismatch.
    In a recipe, `correction: tis` is short for `correction: {method: tis}`."""

    NAME = "correction"
    TITLE = "the rollout-mismatch correction (AIS first), bypass mode included"

    method: str = field(default="ais", metadata={**choice(*CORRECTION_METHODS),
        "help": "Rollout-mismatch correction of the policy gradient."})
    level: str = field(default="token", metadata={**choice(*IS_LEVELS),
        "help": "Ratio level: per token, per sequence (product), or geometric (the sequence's mean log-ratio)."})
    clip: float = field(default=2.0, metadata={**POSITIVE,
        "help": "Upper truncation C of the importance ratio (tis, mis, ais); with method=acr also the clip scale "
                "c_t = min(1, C / rho_t) that widens the loss's upper clip bound to (1 + epsilon_high) / c_t."})
    clip_low: float | None = field(default=None, metadata={**NON_NEGATIVE,
        "help": "Lower bound of the ratio (tis truncates to it, mis masks below it); null = 1 / clip."})
    normalize: bool = field(default=False, metadata={"help": "tis and mis: divide the weights by their batch mean."})
    ais_rule: str = field(default="adaptive", metadata={**choice(*ALPHA_RULES),
        "help": "How AIS sets α: adaptive = when the mismatch's systematic shift of the gradient signal stands out "
                "of the batch's gradient noise (scale-free); gate = k3 KL against ais_kl_scale; oracle = plug-in MSE."})
    ais_snr_scale: float = field(default=4.0, metadata={**POSITIVE,
        "help": "adaptive rule: the excess significance (z² − 1) of the mismatch shift at which AIS is ~63% on."})
    ais_kl_scale: float = field(default=1e-3, metadata={**POSITIVE,
        "help": "gate rule: κ, the k3 divergence at which AIS is ~63% on."})
    ais_alpha_max: float = field(default=1.0, metadata={"range": "[0, 1]", "help": "Upper bound of α."})
    ais_alpha_ema: float = field(default=0.0, metadata={"range": "[0, 1)",
        "help": "EMA of α across generation batches; 0 = per batch."})
    bypass_mode: bool = field(default=False, metadata={
        "help": "verl's rollout_correction.bypass_mode: the rollout's log-probs are the old ones, so the trainer's "
                "no-grad pass over each generation batch is skipped and the loss's clipped ratio pi_theta / "
                "pi_rollout carries the mismatch, measured on the batch's first update. Needs method=none (or "
                "experimental.complete_ratio, whose commit ratio the method then weights)."})

    def rule_problems(self) -> list[str]:
        checks = [
            (self.clip_low is None or self.clip_low <= self.clip,
             f"correction.clip_low must lie in [0, correction.clip={self.clip}]; got {self.clip_low}"),
            (self.method not in ("acr", "ais") or self.level == "token",
             f"correction.method={self.method} works on token-level ratios: set correction.level=token (got "
             f"{self.level!r})"),
            (self.method != "ais" or (self.clip_low is None and not self.normalize),
             "correction.method=ais mixes with min(rho, correction.clip): leave correction.clip_low=null and "
             "correction.normalize=false"),
        ]
        return [message for ok, message in checks if not ok]


@dataclass(frozen=True)
class ExperimentalSettings(SettingsGroup):
    """Study knobs behind a door: each is measured in docs/notes/ and used by no shipped recipe's defaults; names and
    meaning may change between releases."""

    NAME = "experimental"
    TITLE = "study knobs behind a door (may change between releases)"

    rollout_factor: float | None = field(default=None, metadata={**POSITIVE,
        "help": "Parallel decoding, Fast-dLLM's factor rule: each step commits the largest n with (n + 1)(1 - c_(n)) "
                "< this (>= 1 per step; Fast-dLLM: 1.0); instead of rollout.threshold. null = off."})
    rollout_position_temperature: float = field(default=0.0, metadata={**NON_NEGATIVE,
        "help": "T > 0 makes the commit choice a recorded draw: Dream's alg_temp (positions drawn from softmax(score "
                "/ T) instead of the top scores); with rollout.threshold, independent commits with probability "
                "sigmoid((score - threshold) / T), one drawn from softmax(score / T) when none. 0 = deterministic."})
    commit_choice_as_set: bool = field(default=False, metadata={
        "help": "With rollout_position_temperature > 0 and a fixed count: the commit choice's log-prob (the complete "
                "ratio's commit term) is the committed set's, the draw order within a step summed out, instead of "
                "the drawn order's. Even schedule, at most 5 commits a step."})
    complete_ratio: bool = field(default=False, metadata={
        "help": "The importance ratio also holds the diffusion decoder's commit choice: rho = token ratio x commit "
                "ratio, the commit choice's (and its discarded candidates') log-prob replayed by the trainer against "
                "the one the sampler recorded. Needs likelihood.estimator=trajectory and a stochastic commit rule, "
                "rollout_position_temperature > 0 (docs/algorithms.md, 'The complete ratio'; its verdict: "
                "BENCHMARKS.md)."})
    commit_choice_gradient: bool = field(default=False, metadata={
        "help": "With rollout_position_temperature > 0: the loss's log-probs also hold the commit choice's (the "
                "drawn order's score function joins the policy gradient; PPO's ratio is then the whole step's). "
                "Needs likelihood.estimator=trajectory, a rollout.cache replayed as sampled, beta=0."})
    rollout_seed_offset: int = field(default=0, metadata={"range": "[0, 1000000]",
        "help": "Shifts the rollout sampler's random stream only (data order, initialisation and estimator masks "
                "keep the seed's): a run with another offset is another sampling draw of the same run, the null arm "
                "of a study that pairs arms by seed. 0 = the seed's own stream."})
    rollout_fidelity: str = field(default="fixed", metadata={**choice(*FIDELITY_MODES),
        "help": "Fast rollouts: fixed = always the configured decoder; adaptive = a ladder from it to the exact "
                "decoder, one rung toward exact after a batch whose importance ratio shows a large mismatch, one back "
                "after rollout_fidelity_patience calm batches. Needs likelihood.estimator=trajectory, "
                "likelihood_order=rollout and likelihood_decoder=exact (the ratio that sees the decoder)."})
    rollout_fidelity_k3_max: float = field(default=0.05, metadata={**NON_NEGATIVE,
        "help": "rollout_fidelity=adaptive: a batch whose rollout_corr/k3_kl exceeds this moves one rung toward exact."})
    rollout_fidelity_ess_min: float = field(default=0.9, metadata={"range": "[0, 1]",
        "help": "rollout_fidelity=adaptive: a batch whose rollout_corr/rollout_is_eff_sample_size is below this moves "
                "one rung toward exact (0 = off)."})
    rollout_fidelity_patience: int = field(default=8, metadata={"range": "[1, 1000000]",
        "help": "rollout_fidelity=adaptive: calm generation batches in a row after which the decoder moves one rung "
                "back toward the fast one."})
    rollout_exact_fraction: float = field(default=0.0, metadata={"range": "[0, 1]",
        "help": "Fast rollouts: the share of each process' GRPO groups (whole groups) decoded by the exact decoder, "
                "the rest by the fast one; 0 = none."})
    likelihood_block_fraction: float = field(default=1.0, metadata={"range": "(0, 1]",
        "help": "trajectory and step_merge: the share of the completion's blocks scored per inner iteration, drawn at "
                "random (at least one): the update replays those blocks' steps only, and the correction and the loss "
                "run over their tokens (TRL DDPO's train_timestep_fraction, by blocks). 1 = every block."})
    likelihood_order: str = field(default="rollout", metadata={**choice(*LIKELIHOOD_ORDERS),
        "help": "trajectory and step_merge: the commit order scored. rollout = the rollout sampler's; exact = the "
                "completion replayed along the exact decoder's order (the ratio then sees precision only)."})
    likelihood_decoder: str = field(default="rollout", metadata={**choice(*LIKELIHOOD_DECODERS),
        "help": "trajectory with a rollout.cache: the logits scored each step. rollout = the rollout decoder's own, "
                "its cache replayed as sampled (the fast decoder is the policy trained; the ratio sees precision "
                "only); exact = the model's full forward (the ratio sees the cache's logit error). Without a cache "
                "both are the same replay."})
    routing_replay: bool = field(default=False, metadata={
        "help": "Mixture-of-experts models (LLaDA2.x): the trainer's likelihood passes route every token to the experts "
                "the rollout engine chooses on the same forward (rollout routing replay; weights from the trainer's own "
                "router). Needs likelihood.estimator=trajectory along the rollout's order, no cached-decoder replay, "
                "the split precision flow, a notch not scaled over the batch, no gradient checkpointing."})
    routing_record: bool = field(default=False, metadata={
        "help": "Mixture-of-experts models (LLaDA2.x): the rollout engine records the experts every (position, step, "
                "layer) used while sampling, and the trajectory estimator's decoder replay forces them on every "
                "forward (the sampled routing exactly, block cache and batch-scaled notches included). Needs "
                "likelihood.estimator=trajectory with likelihood_decoder=rollout and a rollout.cache, "
                "rollout.compile=false, no gradient checkpointing, routing_replay=false."})
    elbo_coupled: bool = field(default=False, metadata={
        "help": "elbo and spg without block masking: pair each draw (rate t) with its complement (rate 1 - t), so "
                "every token is scored once per pair (coupled-GRPO); doubles the forwards."})
    spg_mix_weight: float = field(default=0.5, metadata={"range": "[0, 1]",
        "help": "spg: negative-advantage completions score w * EUBO + (1 - w) * ELBO (1 = EUBO alone, 0 = ELBO)."})
    ratio_type: str = field(default="token", metadata={**choice(*RATIO_TYPES),
        "help": "The loss's policy ratio: token = GRPO's per-token ratio; ctpo = CTPO's cumulative prefix ratio."})
    ctpo_c_low: float = field(default=0.025, metadata={**POSITIVE,
        "help": "ratio_type=ctpo: the clip range's lower end, log R_t >= -ctpo_c_low * t^ctpo_power (t = valid-token "
                "position)."})
    ctpo_c_high: float = field(default=0.05, metadata={**POSITIVE,
        "help": "ratio_type=ctpo: the clip range's upper end, log R_t <= ctpo_c_high * t^ctpo_power."})
    ctpo_c_dual: float = field(default=0.05, metadata={**POSITIVE,
        "help": "ratio_type=ctpo: dual clip for negative advantages, the surrogate floored at "
                "exp(ctpo_c_dual * t^ctpo_power) * A."})
    ctpo_power: float = field(default=0.5, metadata={**NON_NEGATIVE,
        "help": "ratio_type=ctpo: p, the clip range widens as t^p with the valid-token position t (0 = constant)."})
    ctpo_cap: float = field(default=10.0, metadata={**POSITIVE,
        "help": "ratio_type=ctpo: cap on the cumulative prefix log-ratio sum_{j<=t} (logp_j - logp_old_j)."})
    eval_rollout_sampler: bool = field(default=True, metadata={
        "help": "After training, also score the validation prompts with a greedy copy of the rollout decoder when it "
                "decodes otherwise than d1's protocol, logged as eval/rollout_sampler/* (one more validation pass)."})

    def ctpo_loss_options(self) -> dict[str, float]:
        """CTPO's constants as the keyword arguments of `dllm_ais.loss.TokenLoss` (used with ratio_type=ctpo)."""
        return {"ctpo_c_low": self.ctpo_c_low, "ctpo_c_high": self.ctpo_c_high, "ctpo_c_dual": self.ctpo_c_dual,
                "ctpo_power": self.ctpo_power, "ctpo_cap": self.ctpo_cap}


SETTINGS_GROUPS: dict[str, type[SettingsGroup]] = {
    group.NAME: group for group in (RolloutSettings, LikelihoodSettings, CorrectionSettings, ExperimentalSettings)}
GROUP_SHORTHANDS = {"correction": "method"}  # `correction: tis` = `correction: {method: tis}`

# Where each flat field of earlier releases now lives: a recipe, override or checkpoint using the old name still loads,
# with a one-line hint naming the new place.
MOVED_FIELDS = {
    "rollout_precision": "rollout.precision", "diffusion_steps": "rollout.steps", "block_length": "rollout.block_length",
    "remasking": "rollout.remasking", "cfg_scale": "rollout.cfg_scale", "rollout_cache": "rollout.cache",
    "rollout_cache_refresh_interval": "rollout.cache_refresh_interval", "rollout_threshold": "rollout.threshold",
    "likelihood_estimator": "likelihood.estimator", "likelihood_segments": "likelihood.segments",
    "p_mask_prompt": "likelihood.p_mask_prompt", "elbo_samples": "likelihood.elbo_samples",
    "spg_eubo_beta": "likelihood.spg_eubo_beta", "spg_block_masking": "likelihood.spg_block_masking",
    "is_level": "correction.level", "is_clip": "correction.clip", "is_clip_low": "correction.clip_low",
    "is_normalize": "correction.normalize", "ais_rule": "correction.ais_rule", "ais_snr_scale": "correction.ais_snr_scale",
    "ais_kl_scale": "correction.ais_kl_scale", "ais_alpha_max": "correction.ais_alpha_max",
    "ais_alpha_ema": "correction.ais_alpha_ema", "bypass_mode": "correction.bypass_mode",
    "correction.complete_ratio": "experimental.complete_ratio",
    **{name: f"experimental.{name}" for name in (
        "rollout_factor", "rollout_fidelity", "rollout_fidelity_k3_max", "rollout_fidelity_ess_min",
        "rollout_fidelity_patience", "rollout_exact_fraction", "likelihood_block_fraction", "likelihood_order",
        "likelihood_decoder", "elbo_coupled", "spg_mix_weight", "ratio_type", "ctpo_c_low", "ctpo_c_high",
        "ctpo_c_dual", "ctpo_power", "ctpo_cap", "eval_rollout_sampler")},
}
