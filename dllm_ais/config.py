"""Training configuration: one flat dataclass with TRL's field names, loaded from YAML plus `--key=value` overrides.

Everything is validated here, before any model or dataset is loaded, so a typo costs seconds, not a GPU hour. Each
field declares its allowed values in its metadata (`choices`, `range`, see `dllm_ais.validation`); `--help` shows them.
This module imports nothing heavy: `dllm-ais --help` must not import torch.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dllm_ais.choices import (
    ALPHA_RULES, CACHE_MODES, CORRECTION_METHODS, ESTIMATORS, FIDELITY_MODES, IS_LEVELS, LIKELIHOOD_DECODERS,
    LIKELIHOOD_ORDERS, LOSS_TYPES, PRECISIONS, RATIO_TYPES, REWARD_SCALINGS, SEQUENCE_ESTIMATORS, TRAJECTORY_ESTIMATORS,
    block_fraction_problem, replays_decoder,
)
from dllm_ais.tasks import TaskNames
from dllm_ais.trackers import TRACKERS, normalize_report_to
from dllm_ais.validation import (
    ConfigError, Interval, accepts_float, field_problems, model_path_problem, parse_yaml, path_kind, problem_list,
    read_recipe, show, unknown_key_problems,
)

EMBEDDED_MODEL = "embedded"
EMBEDDED_MODELS = {  # name usable as model_name_or_path -> directory shipped inside the package
    EMBEDDED_MODEL: Path(__file__).parent / "assets" / "tiny_llada",
    f"{EMBEDDED_MODEL}-qwen3": Path(__file__).parent / "assets" / "tiny_qwen3",
    # the long-completion warm starts on reasoning-gym chain sums (recipes/tiny_{llada,qwen3}_chain_sum.yaml)
    f"{EMBEDDED_MODEL}-llada-chain-sum": Path(__file__).parent / "assets" / "tiny_llada_chain_sum",
    f"{EMBEDDED_MODEL}-qwen3-chain-sum": Path(__file__).parent / "assets" / "tiny_qwen3_chain_sum",
}
EMBEDDED_MODEL_DIR = EMBEDDED_MODELS[EMBEDDED_MODEL]
EMBEDDED_RECIPE = EMBEDDED_MODEL_DIR / "recipe.yaml"
POLICIES = ("auto", "diffusion", "autoregressive")
DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine")


# d1's evaluation decoder, whatever the length: LLaDA's own sampler, no block cache, no parallel commits, no guidance
D1_SAMPLER_FIELDS = {"remasking": "low_confidence", "rollout_cache": "none", "rollout_threshold": None,
                     "rollout_factor": None, "rollout_cache_refresh_interval": None, "cfg_scale": 0.0}


def d1_protocol_fields(gen_length: int, block_length: int) -> dict[str, Any]:
    """The config fields of d1's evaluation decoder at ``gen_length``: `D1_SAMPLER_FIELDS` with blocks of
    min(block_length, gen_length) and gen_length / 2 steps (two tokens per step). Held-out validation and
    `dllm-ais eval` both decode with it."""
    return {"max_completion_length": gen_length, "block_length": min(block_length, gen_length),
            "diffusion_steps": max(gen_length // 2, 1), **D1_SAMPLER_FIELDS}


def _choice(*options: str) -> dict:
    return {"choices": options}


# Upper bounds far beyond any real run, so an absurd value fails here instead of hanging or exhausting memory later.
MAX_SIZE = 65_536  # batch sizes, group size, LoRA rank
MAX_TOKENS = 1_048_576
MAX_PROMPTS = 10_000_000  # the digits task generates this many

AT_LEAST_ONE = {"range": "[1, inf)"}
NON_NEGATIVE = {"range": "[0, inf)"}
POSITIVE = {"range": "(0, inf)"}
PATH = {"path": True}  # "~" is expanded


@dataclass
class GRPOConfig:
    """All settings of a GRPO run with FP8 rollouts and importance-sampling correction.

    Field names follow TRL's `GRPOConfig` where TRL has the concept; the rest are grouped by pipeline stage.
    """

    # --- model ---
    model_name_or_path: str = field(default=EMBEDDED_MODEL, metadata={**PATH,
        "help": f"Hub id or local directory of the policy; {', '.join(map(repr, EMBEDDED_MODELS))} = the tiny models "
                "shipped with the package (LLaDA and Qwen3 on digits and on chain sums)."})
    policy: str = field(default="auto", metadata={**_choice(*POLICIES),
        "help": "diffusion (LLaDA-style masked diffusion) or autoregressive; auto: diffusion iff model_type is llada."})
    dtype: str = field(default="auto", metadata={**_choice(*DTYPES),
        "help": "Trainer weights dtype; auto = bfloat16 on CUDA, float32 on CPU."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Passed to from_pretrained (not needed for LLaDA)."})
    use_peft: bool = field(default=True, metadata={"help": "Train a LoRA adapter (peft) instead of all weights."})
    lora_r: int = field(default=128, metadata={"range": f"[1, {MAX_SIZE}]"})
    lora_alpha: int = field(default=64, metadata={"range": f"(0, {MAX_SIZE}]"})
    lora_dropout: float = field(default=0.05, metadata={"range": "[0, 1)"})
    lora_target_modules: list[str] | str | None = field(default=None, metadata={
        "help": "Module names or a regex; None = the preset for the model type (LLaDA: every block's "
                "q_proj k_proj v_proj attn_out ff_proj up_proj ff_out, never the LM head)."})
    gradient_checkpointing: bool = False

    # --- data and rewards ---
    task: str = field(default="digits", metadata={"choices": TaskNames(), "help": "Task: dataset loader and reward preset."})
    task_args: dict = field(default_factory=dict, metadata={
        "help": "Settings of a task that takes them (reasoning_gym: {dataset: countdown, min_numbers: 3, ...}); "
                "on the command line --task_args.KEY=VALUE sets one, --task_args='{...}' all."})
    dataset_path: str | None = field(default=None, metadata={**PATH,
        "help": "Local file/dir overriding the task's hub dataset."})
    dataset_size: int | None = field(default=None, metadata={"range": f"[1, {MAX_PROMPTS}]",
        "help": "Use at most this many training prompts."})
    eval_size: int = field(default=64, metadata={"range": f"[0, {MAX_PROMPTS}]",
        "help": "Validation prompts scored before and after training and every eval_steps (0 = skip); `dllm-ais eval` "
                "uses the full test split."})
    reward_funcs: list[str] | None = field(default=None, metadata={
        "help": "Reward function names or 'module:function'; None = the task preset."})
    reward_weights: list[float] | None = field(default=None, metadata={"range": "[-1000000, 1000000]"})
    max_prompt_length: int = field(default=256, metadata=AT_LEAST_ONE)

    # --- rollout ---
    rollout_precision: str = field(default="fp8", metadata={**_choice(*PRECISIONS),
        "help": "Precision of the rollout engine; bf16 = no quantization (on-policy baseline)."})
    num_generations: int = field(default=6, metadata={"range": f"[2, {MAX_SIZE}]",
        "help": "Completions per prompt (the GRPO group size G)."})
    max_completion_length: int = field(default=256, metadata={"range": f"[1, {MAX_TOKENS}]",
        "help": "Completion length (diffusion gen_length)."})
    diffusion_steps: int = field(default=128, metadata={**AT_LEAST_ONE, "help": "Denoising steps over the whole completion."})
    block_length: int = field(default=32, metadata=AT_LEAST_ONE)
    temperature: float = field(default=0.9, metadata=NON_NEGATIVE)
    remasking: str = field(default="low_confidence", metadata={"help": "Remasking rule name (low_confidence, random, ...)."})
    cfg_scale: float = field(default=0.0, metadata={**NON_NEGATIVE,
        "help": "Diffusion classifier-free guidance s: logits = u + (s + 1)(c - u), u with the prompt masked (two "
                "forwards' worth per step); every likelihood estimator scores the guided logits, as sampled (as d1)."})
    rollout_cache: str = field(default="none", metadata={**_choice(*CACHE_MODES),
        "help": "Diffusion block KV cache (Fast-dLLM): none = official algorithm; prefix / dual reuse keys/values "
                "within a block (approximate: the trajectory estimator's ratio sees it, the one-step one does not)."})
    rollout_threshold: float | None = field(default=None, metadata={"range": "[0, 1]",
        "help": "Diffusion parallel decoding: commit every block position with confidence > this (>= 1 per step; "
                "Fast-dLLM: 0.9); diffusion_steps then no longer applies. None = the fixed step schedule."})
    rollout_factor: float | None = field(default=None, metadata={**POSITIVE,
        "help": "Diffusion parallel decoding, Fast-dLLM's factor rule: each step commits the largest n with "
                "(n + 1)(1 - c_(n)) < this (>= 1 per step; Fast-dLLM: 1.0); instead of rollout_threshold. None = off."})
    rollout_cache_refresh_interval: int | None = field(default=None, metadata={**AT_LEAST_ONE,
        "help": "With rollout_cache: also refresh the cache every this many steps inside a block (1 = every step, "
                "the uncached algorithm). None = only at each block's first step."})
    rollout_fidelity: str = field(default="fixed", metadata={**_choice(*FIDELITY_MODES),
        "help": "Diffusion fast rollouts: fixed = always the configured decoder; adaptive = a ladder from it to the "
                "exact decoder (finer cache refreshes, stricter thresholds), one rung toward exact after a batch whose "
                "importance ratio shows a large mismatch, one back after rollout_fidelity_patience calm batches. "
                "Needs likelihood_estimator=trajectory with likelihood_order=rollout (the ratio that sees the decoder)."})
    rollout_fidelity_k3_max: float = field(default=0.05, metadata={**NON_NEGATIVE,
        "help": "rollout_fidelity=adaptive: a batch whose rollout_corr/k3_kl exceeds this moves one rung toward exact."})
    rollout_fidelity_ess_min: float = field(default=0.9, metadata={"range": "[0, 1]",
        "help": "rollout_fidelity=adaptive: a batch whose rollout_corr/rollout_is_eff_sample_size is below this moves "
                "one rung toward exact (0 = off)."})
    rollout_fidelity_patience: int = field(default=8, metadata={"range": "[1, 1000000]",
        "help": "rollout_fidelity=adaptive: calm generation batches in a row after which the decoder moves one rung "
                "back toward the fast one."})
    rollout_exact_fraction: float = field(default=0.0, metadata={"range": "[0, 1]",
        "help": "Diffusion fast rollouts: the share of each process' GRPO groups (whole groups) decoded by the exact "
                "decoder (no cache, fixed schedule), the rest by the fast one; 0 = none."})
    top_k: int = field(default=0, metadata={**NON_NEGATIVE, "help": "Autoregressive sampling only; 0 = off."})
    top_p: float = field(default=1.0, metadata={"range": "(0, 1]", "help": "Autoregressive sampling only; 1 = off."})

    # --- likelihood ---
    likelihood_estimator: str = field(default="one_step", metadata={**_choice(*ESTIMATORS),
        "help": "Diffusion log-prob estimator: d1's one-step surrogate (one forward), the exact trajectory replay (one "
                "forward per denoising step), d2's StepMerge (the steps merged into likelihood_segments segments, one "
                "forward each), LLaDA's Monte-Carlo ELBO (elbo) or SPG's ELBO/EUBO sandwich (spg). elbo and spg estimate one log-likelihood "
                "per completion and give each of its tokens an equal share: the policy ratio and the IS weights are "
                "then GSPO's length-normalised sequence ratio, automatically (epsilon clips it per sequence)."})
    likelihood_segments: int = field(default=16, metadata={"range": f"[1, {MAX_TOKENS}]",
        "help": "step_merge: N, the contiguous segments the denoising steps are merged into; each segment's tokens are "
                "scored at the canvas of its first step (one forward per segment). N >= diffusion_steps is the exact "
                "trajectory; N = 1 is d1's one-step surrogate with an unmasked prompt; d2 found 16 the best trade."})
    p_mask_prompt: float = field(default=0.15, metadata={"range": "[0, 1)",
        "help": "Probability of masking each prompt token in the one_step, elbo and spg estimators' canvases."})
    elbo_samples: int = field(default=2, metadata={"range": "[1, 1024]",
        "help": "elbo and spg: Monte-Carlo draws of the masking process per estimate, one forward each (SPG's num_t)."})
    elbo_coupled: bool = field(default=False, metadata={
        "help": "elbo and spg without block masking: pair each draw (rate t) with its complement (rate 1 - t), so "
                "every token is scored once per pair (coupled-GRPO); doubles the forwards."})
    spg_eubo_beta: float = field(default=1.5, metadata={"range": "[1, inf)",
        "help": "spg: the EUBO's exponent beta (SPG: 1.5 for GSM8K and MATH, 2 for Countdown, 1 for Sudoku)."})
    spg_mix_weight: float = field(default=0.5, metadata={"range": "[0, 1]",
        "help": "spg: negative-advantage completions score w * EUBO + (1 - w) * ELBO (1 = EUBO alone, 0 = ELBO)."})
    spg_block_masking: bool = field(default=True, metadata={
        "help": "spg: SPG's block-wise masks (earlier blocks clean, one block partly masked, later blocks masked) "
                "instead of LLaDA's random masks."})
    likelihood_block_fraction: float = field(default=1.0, metadata={"range": "(0, 1]",
        "help": "Trajectory-type estimators (trajectory, step_merge): the share of the completion's blocks (of "
                "block_length) scored per inner iteration, drawn at random (at least one block): the update replays "
                "those blocks' denoising steps only, and the correction (is_level=sequence: the scored tokens' ratio) and "
                "the loss run over their tokens (TRL DDPO's train_timestep_fraction, by blocks). 1 = every block."})
    likelihood_order: str = field(default="rollout", metadata={**_choice(*LIKELIHOOD_ORDERS),
        "help": "Trajectory-type estimators (trajectory, step_merge): the commit order they score. rollout = the "
                "order the rollout sampler took (the ratio sees a cache's logit error); exact = the completion "
                "replayed by the engine along the exact decoder's order (no cache, fixed schedule, low confidence), so training happens at the states the "
                "exact decoder visits; the ratio then sees precision only and the fast decoder's approximation is unseen."})
    likelihood_decoder: str = field(default="rollout", metadata={**_choice(*LIKELIHOOD_DECODERS),
        "help": "trajectory estimator with a rollout_cache: the logits it scores each step with. rollout = the rollout "
                "decoder's own, its block cache replayed as sampled (the fast decoder is the policy trained; the ratio "
                "sees precision only; a cached step's forward runs the block only); exact = the model's, a full "
                "forward per step (the ratio sees the cache's logit error; measured: far worse training). Without a "
                "cache both are the same replay."})

    # --- correction ---
    correction: str = field(default="ais", metadata={**_choice(*CORRECTION_METHODS),
        "help": "Rollout-mismatch correction of the policy gradient."})
    is_level: str = field(default="token", metadata=_choice(*IS_LEVELS))
    is_clip: float = field(default=2.0, metadata={**POSITIVE,
        "help": "Upper truncation C of the importance ratio (tis, mis, ais); with correction=acr also the clip scale "
                "c_t = min(1, C / rho_t) that widens the loss's upper clip bound to (1 + epsilon_high) / c_t."})
    is_clip_low: float | None = field(default=None, metadata=NON_NEGATIVE)
    is_normalize: bool = False
    ais_rule: str = field(default="adaptive", metadata={**_choice(*ALPHA_RULES),
        "help": "How AIS sets α: adaptive = when the mismatch's systematic shift of the gradient signal stands out "
                "of the batch's gradient noise (scale-free); gate = k3 KL against ais_kl_scale; oracle = plug-in MSE."})
    ais_snr_scale: float = field(default=4.0, metadata={**POSITIVE,
        "help": "adaptive rule: the excess significance (z² − 1) of the mismatch shift at which AIS is ~63% on."})
    ais_kl_scale: float = field(default=1e-3, metadata={**POSITIVE,
        "help": "gate rule: κ, the k3 divergence at which AIS is ~63% on."})
    ais_alpha_max: float = field(default=1.0, metadata={"range": "[0, 1]"})
    ais_alpha_ema: float = field(default=0.0, metadata={"range": "[0, 1)", "help": "EMA of α across batches; 0 = per batch."})
    bypass_mode: bool = field(default=False, metadata={
        "help": "verl's rollout_correction.bypass_mode: the rollout's log-probs are the old ones (pi_old = pi_rollout), "
                "so the trainer's no-grad pass over each generation batch is skipped and the loss's clipped ratio "
                "pi_theta / pi_rollout carries the rollout mismatch; its rollout_corr/* diagnostics are measured on the "
                "batch's first update, where theta = theta_old. Needs correction=none."})

    # --- loss ---
    beta: float = field(default=0.04, metadata={**NON_NEGATIVE,
        "help": "KL coefficient against the reference (adapter disabled)."})
    epsilon: float = field(default=0.5, metadata=POSITIVE)
    epsilon_high: float | None = field(default=None, metadata=POSITIVE)
    loss_type: str = field(default="dapo", metadata=_choice(*LOSS_TYPES))
    scale_rewards: str = field(default="none", metadata=_choice(*REWARD_SCALINGS))
    drop_zero_std_groups: bool = field(default=False, metadata={
        "help": "Leave the GRPO groups whose rewards are all equal (frac_reward_zero_std; their advantages are 0) out "
                "of the log-probs, the correction and the update, which then replay the informative groups only "
                "(DAPO's dynamic-sampling filter, without resampling to refill the batch; the loss is normalised over "
                "the kept groups). Needs beta=0."})
    ratio_type: str = field(default="token", metadata=_choice(*RATIO_TYPES))
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

    # --- optimisation ---
    learning_rate: float = field(default=3e-6, metadata=POSITIVE)
    weight_decay: float = field(default=0.1, metadata=NON_NEGATIVE)
    adam_beta1: float = field(default=0.9, metadata={"range": "[0, 1)"})
    adam_beta2: float = field(default=0.99, metadata={"range": "[0, 1)"})
    max_grad_norm: float = field(default=0.2, metadata={**POSITIVE, "help": "Gradient-norm clip."})
    lr_scheduler_type: str = field(default="constant_with_warmup", metadata=_choice(*SCHEDULERS))
    warmup_steps: int = field(default=0, metadata=NON_NEGATIVE)
    num_iterations: int = field(default=12, metadata={"range": "[1, 1024]", "help": "μ: optimizer passes over each generation batch."})
    per_device_train_batch_size: int = field(default=6, metadata={"range": f"[1, {MAX_SIZE}]",
        "help": "Completions per device per micro-batch."})
    gradient_accumulation_steps: int = field(default=1, metadata={"range": f"[1, {MAX_SIZE}]"})
    per_device_eval_batch_size: int | None = field(default=None, metadata={"range": f"[1, {MAX_SIZE}]",
        "help": "Prompts per device per held-out batch; null = per_device_train_batch_size."})
    max_steps: int = field(default=100, metadata={**AT_LEAST_ONE, "help": "Optimizer steps to run."})
    seed: int = field(default=42, metadata={"range": "[0, 2147483647]"})
    max_consecutive_skipped_batches: int = field(default=3, metadata={"range": "[1, 1000000]",
        "help": "A non-finite reward, log-prob, loss or gradient skips its generation batch (weights untouched); "
                "this many skips in a row stop the run."})

    # --- output ---
    output_dir: str = field(default="outputs/dllm-ais", metadata=PATH)
    logging_steps: int = field(default=1, metadata={**AT_LEAST_ONE, "help": "Log every N optimizer steps."})
    save_steps: int = field(default=0, metadata={**NON_NEGATIVE, "help": "Write a resumable checkpoint-N every this "
                                                 "many steps (0 = only on Ctrl-C / SIGTERM)."})
    save_total_limit: int | None = field(default=None, metadata={"range": "[1, 1000000]",
        "help": "Keep only the newest N checkpoint-N directories of this run (and the best one); None = keep all."})
    eval_steps: int = field(default=0, metadata={**NON_NEGATIVE, "help": "Score the eval_size validation prompts "
                                                 "(greedy) every this many steps, logged as eval/*; 0 = off."})
    eval_rollout_sampler: bool = field(default=True, metadata={
        "help": "After training, also score the validation prompts with a greedy copy of the rollout decoder when it "
                "decodes otherwise than d1's protocol (a cache, parallel commits, another order, guidance, a custom "
                "sampler), logged as eval/rollout_sampler/*: one more validation pass, with the fast decoder."})
    metric_for_best_model: str = field(default="reward", metadata={
        "help": "Validation score that ranks checkpoints (eval/<name>: reward, accuracy, rewards/<fn>/mean); the best "
                "is recorded in output_dir/best_checkpoint.json."})
    greater_is_better: bool = True
    log_completions: bool = field(default=False, metadata={
        "help": "Write a few prompt/completion/reward samples per logged step to completions.jsonl (and a tracker "
                "table where the tracker has one)."})
    num_completions_to_print: int = field(default=4, metadata={"range": f"[1, {MAX_SIZE}]",
        "help": "Samples per logged step with log_completions."})
    resume_from_checkpoint: str | bool | None = field(default=None, metadata={
        "help": "Continue a run exactly where a checkpoint left it: a checkpoint-N dir, or true = the latest in "
                "output_dir. Only max_steps and the output, logging, saving, tracking and eval_steps fields may change."})
    overwrite_output_dir: bool = field(default=False, metadata={
        "help": "Start afresh in a non-empty output_dir, replacing what dllm-ais wrote there (nothing else)."})
    report_to: list[str] = field(default_factory=list, metadata={
        "help": f"Trackers via accelerate ({', '.join(TRACKERS)}): a name, a list, none or all (the installed ones)."})
    run_name: str | None = field(default=None, metadata={"help": "The run's name in the trackers; None = output_dir's name."})
    dry_run: bool = field(default=False, metadata={
        "help": "Validate the recipe, then run one step on a tiny stand-in model of the same family."})

    def __post_init__(self) -> None:
        self.report_to = normalize_report_to(self.report_to)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.metadata.get("path") and isinstance(value, str) and value.startswith("~"):
                setattr(self, f.name, os.path.expanduser(value))

    @property
    def best_metric_key(self) -> str:
        """`metric_for_best_model` as the logged key: `eval/<name>`."""
        name = self.metric_for_best_model
        return name if name.startswith("eval/") else f"eval/{name}"

    @property
    def fast_rollouts(self) -> bool:
        """Whether rollouts decode approximately (a block KV cache or parallel commits)."""
        return self.rollout_cache != "none" or self.rollout_threshold is not None or self.rollout_factor is not None

    @property
    def unseen_approximation(self) -> str | None:
        """What the importance ratio of this run cannot see of its fast rollouts, said once at start; None when it
        sees everything (exact rollouts) — measured costs in BENCHMARKS.md, "Fast rollouts"."""
        if not self.fast_rollouts or self.policy == "autoregressive":
            return None
        if self.replays_decoder:
            return ("the trajectory estimator replays the fast decoder itself (likelihood_decoder=rollout): the cache "
                    "and parallel commits are part of the policy trained, and the ratio sees the precision alone; "
                    "held-out evaluation decodes exactly, and on the embedded task what the fast decoder learned carried "
                    "over to it: -0.3 +/- 2.3 points against exact rollouts (10 seeds, README \"Fast rollouts and what "
                    "they cost\")")
        if self.ratio_sees_decoder:
            return ("the trajectory estimator scores the fast sampler's own order: its ratio sees the cache's logit "
                    "error but not the shift of the visited canvas states; on the embedded task dual cache + threshold "
                    "0.9 rollouts cost this estimator 30 points of exact-decoding accuracy (3 seeds, README \"Fast "
                    "rollouts and what they cost\"; likelihood_decoder=exact): the default likelihood_decoder=rollout "
                    "trains the fast decoder itself instead")
        return ("the fast decoder's approximation (cache, parallel commits) is not seen by the importance ratio, "
                "which compares the engine and the trainer on the same canvases; only the rollout precision is")

    @property
    def ratio_sees_decoder(self) -> bool:
        """Whether the importance ratio sees the rollout decoder's approximation (cache, parallel commits): only the
        trajectory estimator scoring the rollout's own commit order compares the fast decoder's recorded log-probs
        with the trainer's exact replay; the other estimators (step_merge's engine side too, with fewer segments than
        steps), and the replay along the exact order, score both sides on the same canvases and see the rollout
        precision only."""
        return self.likelihood_estimator == "trajectory" and self.likelihood_order == "rollout" and not self.replays_decoder

    @property
    def replays_decoder(self) -> bool:
        """Whether the trajectory estimator scores the rollout decoder's own (cached) logits
        (`dllm_ais.choices.replays_decoder`)."""
        return replays_decoder(self.likelihood_estimator, self.likelihood_order, self.likelihood_decoder,
                               self.rollout_cache)

    def decoding(self, exact: bool) -> "GRPOConfig":
        """This config as an evaluation decodes: `exact` = d1's protocol at this completion and block length
        (`d1_protocol_fields`), whatever the rollouts use (order, steps, cache, parallel commits, guidance), else the
        rollout sampler; either way without the trajectory estimator's order replay."""
        protocol = d1_protocol_fields(self.max_completion_length, self.block_length) if exact else {}
        return dataclasses.replace(self, likelihood_order="rollout", **protocol)

    @property
    def eval_batch_size(self) -> int:
        """Prompts per held-out batch: `per_device_eval_batch_size`, else `per_device_train_batch_size`."""
        return self.per_device_eval_batch_size or self.per_device_train_batch_size

    @property
    def generation_batch_size(self) -> int:
        """Completions sampled per device per generation batch (reused for `num_iterations` passes)."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps

    def problems(self) -> list[str]:
        """Every problem of this config, each naming the field and the fix; [] when it is valid.

        Field by field (type, choices, range); then the names and paths the config refers to (local model, dataset
        file, reward functions), of the fields valid on their own; then, when every field is, the rules across fields.
        """
        invalid = field_problems(self)
        problems = [problem for found in invalid.values() for problem in found] + _reference_problems(self, set(invalid))
        if invalid:  # the rules below assume well-typed fields
            return problems
        block_fraction = block_fraction_problem(self.likelihood_block_fraction, self.likelihood_estimator)
        checks = [
            (self.generation_batch_size % self.num_generations == 0,
             f"per_device_train_batch_size * gradient_accumulation_steps = {self.generation_batch_size} must be divisible "
             f"by num_generations={self.num_generations} (whole groups per device)"),
            (self.policy == "autoregressive" or self.max_completion_length % self.block_length == 0,
             f"max_completion_length={self.max_completion_length} must be a multiple of block_length={self.block_length}"),
            (self.rollout_threshold is None or self.rollout_factor is None,
             "rollout_threshold and rollout_factor are two parallel-decoding rules: set one of them"),
            (self.policy == "autoregressive"
             or self.diffusion_steps % max(self.max_completion_length // self.block_length, 1) == 0,
             f"diffusion_steps={self.diffusion_steps} must be a multiple of the number of blocks, max_completion_length "
             f"/ block_length = {self.max_completion_length // self.block_length} (the exact decoder, which "
             "rollout_fidelity, rollout_exact_fraction and likelihood_order=exact use, follows its fixed schedule)"),
            (self.policy == "autoregressive" or self.block_length % 2 == 0
             or self.block_length >= self.max_completion_length,
             f"block_length={self.block_length} must be even: held-out validation decodes with d1's protocol, "
             f"max_completion_length / 2 = {self.max_completion_length // 2} steps, a whole number per block"),
            (self.policy == "autoregressive" or self.diffusion_steps <= self.max_completion_length,
             f"diffusion_steps={self.diffusion_steps} must be <= max_completion_length={self.max_completion_length} "
             "(at most one denoising step per token)"),
            (self.ratio_type != "ctpo" or self.likelihood_estimator not in SEQUENCE_ESTIMATORS,
             f"likelihood_estimator={self.likelihood_estimator} is sequence-level (one ratio per completion): set "
             "ratio_type=token, or a token-level estimator (one_step, trajectory, step_merge) for ctpo"),
            (not (self.likelihood_estimator == "spg" and self.spg_block_masking and self.elbo_coupled),
             "elbo_coupled pairs random masks and spg_block_masking draws block masks: set one of them to false"),
            (block_fraction is None, block_fraction),
            (not self.drop_zero_std_groups or self.beta == 0,
             f"drop_zero_std_groups leaves out groups whose KL term (beta={self.beta}) still has a gradient: set "
             "beta=0, or drop_zero_std_groups=false"),
            (self.likelihood_block_fraction == 1 or self.ratio_type == "token",
             f"likelihood_block_fraction={self.likelihood_block_fraction} scores some tokens only, and ratio_type="
             f"{self.ratio_type}'s prefix needs every token: set ratio_type=token, or likelihood_block_fraction=1"),
            (self.likelihood_order == "rollout" or self.likelihood_estimator in TRAJECTORY_ESTIMATORS,
             f"likelihood_order={self.likelihood_order} orders the trajectory estimator's replay: set "
             f"likelihood_estimator to one of {', '.join(TRAJECTORY_ESTIMATORS)}, or likelihood_order=rollout"),
            (not self.replays_decoder or self.rollout_exact_fraction == 0,
             f"rollout_exact_fraction={self.rollout_exact_fraction} decodes some groups exactly, but "
             "likelihood_decoder=rollout replays every completion with the configured (cached) decoder: set "
             "likelihood_decoder=exact, or rollout_exact_fraction=0"),
            (self.rollout_fidelity == "fixed" or (self.policy != "autoregressive" and self.fast_rollouts),
             f"rollout_fidelity={self.rollout_fidelity} moves between a fast diffusion decoder and the exact one: set "
             "rollout_cache, rollout_threshold or rollout_factor, or rollout_fidelity=fixed"),
            (self.rollout_fidelity == "fixed" or self.policy == "autoregressive" or self.ratio_sees_decoder,
             f"rollout_fidelity={self.rollout_fidelity} reacts to the decoder's mismatch, which only the trajectory "
             "estimator's ratio sees: set likelihood_estimator=trajectory, likelihood_order=rollout and "
             "likelihood_decoder=exact, or rollout_fidelity=fixed"),
            (self.rollout_exact_fraction == 0 or (self.policy != "autoregressive" and self.fast_rollouts),
             f"rollout_exact_fraction={self.rollout_exact_fraction} mixes exact with fast diffusion rollouts: set "
             "rollout_cache, rollout_threshold or rollout_factor, or rollout_exact_fraction=0"),
            (not (self.overwrite_output_dir and self.resume_from_checkpoint not in (None, False)),
             "resume_from_checkpoint continues the run in output_dir; overwrite_output_dir=true starts afresh: set one"),
            (not self.bypass_mode or self.correction == "none",
             f"bypass_mode takes the rollout's log-probs as the old ones, so correction={self.correction} would see "
             "ratios of exactly 1: set correction=none (the loss's clipped ratio then carries the mismatch), or "
             "bypass_mode=false"),
            (not self.bypass_mode or self.rollout_fidelity == "fixed",
             f"rollout_fidelity={self.rollout_fidelity} reads the mismatch before the update, which bypass_mode measures "
             "during it: set rollout_fidelity=fixed, or bypass_mode=false"),
            (self.eval_steps == 0 or self.eval_size > 0,
             f"eval_steps={self.eval_steps} scores the validation split: set eval_size > 0, or eval_steps=0"),
            (not (self.eval_steps and self.save_steps) or self.save_steps % self.eval_steps == 0,
             f"save_steps={self.save_steps} must be a multiple of eval_steps={self.eval_steps}, so that every "
             "checkpoint has a validation score to be ranked by"),
            (self.reward_weights is None or self.reward_funcs is not None,
             "reward_weights needs reward_funcs (one weight per function)"),
            (self.reward_weights is None or self.reward_funcs is None or len(self.reward_weights) == len(self.reward_funcs),
             "reward_weights must have one entry per reward function"),
            (not set(self.report_to) - set(TRACKERS),
             f"report_to={show(self.report_to)}: supported trackers are {', '.join(TRACKERS)} (or none, all)"),
        ]
        return problems + [message for ok, message in checks if not ok] + _correction_problems(self)

    def validate(self) -> "GRPOConfig":
        """Raise ConfigError listing every problem (see `problems`) with its fix; return self when valid."""
        problems = self.problems()
        if problems:
            raise ConfigError(_problem_list(problems))
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


GRPO_FIELD_TYPES = typing.get_type_hints(GRPOConfig)


def _problem_list(problems: list[str]) -> str:
    return problem_list("Invalid configuration:", problems)


def _correction_problems(config: GRPOConfig) -> list[str]:
    """The correction's rules (`dllm_ais.correction.CorrectionSettings`, their one home) applied to `config`."""
    from dllm_ais.correction import CorrectionSettings, CorrectionSettingsError

    try:
        CorrectionSettings.from_config(config)
    except CorrectionSettingsError as error:
        return error.problems
    return []


def _reference_problems(config: GRPOConfig, invalid: set[str]) -> list[str]:
    """What the config names must exist: a local model directory, the dataset file, the task's settings
    (`task_args`), reward and remasking names.

    Fields in `invalid` (already reported) are skipped.
    """
    from dllm_ais.rewards import resolve_reward_functions
    from dllm_ais.tasks import get_task
    from dllm_ais.sampling.diffusion import resolve_remasking_rule

    problems = []
    if "model_name_or_path" not in invalid:
        problems.append(model_path_problem(config.model_name_or_path))
    if not {"dataset_path", "task"} & invalid:
        if config.dataset_path is not None and path_kind(config.dataset_path) in ("missing", "invalid"):
            problems.append(f"dataset_path={show(config.dataset_path)}: no such file or directory")
        task = get_task(config.task)
        if "task_args" not in invalid:
            problems.extend(task.task_args_problems(config.task_args))
        if task.generate is not None and config.dataset_path is not None:
            problems.append(f"dataset_path: the {task.name} task is generated and reads no files; leave dataset_path "
                            "unset")
        elif task.generate is None and task.hub_train is None and task.hub_test is None and config.dataset_path is None:
            problems.append(f"task={config.task} has no default dataset: set dataset_path to a local file of its rows")
    if "output_dir" not in invalid and path_kind(config.output_dir) in ("file", "invalid"):
        problems.append(f"output_dir={show(config.output_dir)}: not a usable directory path (a file, or an invalid name)")
    # `module:function` names are imported only when a run starts (GRPOTrainer), never while reading a config.
    for name in [] if "reward_funcs" in invalid else config.reward_funcs or []:
        try:
            if ":" not in name:
                resolve_reward_functions([name])
            elif not all(name.partition(":")[::2]):
                raise ValueError("write 'package.module:function'")
        except ValueError as error:
            problems.append(f"reward_funcs: {show(name)}: {error}")
    if "remasking" not in invalid:
        try:
            resolve_remasking_rule(config.remasking)
        except ValueError as error:
            problems.append(f"remasking={show(config.remasking)}: {error}")
    return [problem for problem in problems if problem]


def _as_float_if_numeric(value: Any) -> Any:
    """YAML 1.1 reads `1e-5` (no dot) as a string; accept it as the number users meant."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """Turn `--key=value` / `--key value` / `key=value` strings into a dict; values are parsed as YAML scalars/lists."""
    overrides: dict[str, Any] = {}
    pending: str | None = None
    for arg in args:
        if pending is not None:
            overrides[pending] = parse_yaml(arg, f"--{pending}")
            pending = None
            continue
        key, sep, value = arg.removeprefix("--").partition("=")
        key = key.replace("-", "_")
        if sep:
            overrides[key] = parse_yaml(value, f"--{key}")
        elif arg.startswith("--"):
            pending = key
        else:
            raise ConfigError(f"Cannot parse override {show(arg)}: write --key=value (e.g. --learning_rate=1e-5).")
    if pending is not None:
        raise ConfigError(f"Override --{pending[:60]} has no value: write --{pending[:60]}=VALUE.")
    return overrides


def set_override(values: dict[str, Any], key: str, value: Any) -> None:
    """Set ``values[key] = value``; a key ``field.entry`` of a mapping field (``task_args.min_numbers``) sets that one
    entry of the mapping, keeping the recipe's others."""
    name, dot, entry = key.partition(".") if isinstance(key, str) else (key, "", "")
    if not (dot and entry and GRPO_FIELD_TYPES.get(name) is dict):
        values[key] = value
        return
    mapping = values.get(name)
    values[name] = {**(mapping if isinstance(mapping, dict) else {}), entry: value}


def load_config(recipe: str | Path | None = None, overrides: list[str] | dict[str, Any] | None = None) -> GRPOConfig:
    """Build a validated `GRPOConfig` from a YAML recipe (optional) and command-line overrides (which win).

    Raises ConfigError listing every problem at once: unknown keys (with a hint), then each field's problems.
    """
    values: dict[str, Any] = read_recipe(recipe) if recipe is not None else {}
    for key, value in (parse_overrides(overrides) if isinstance(overrides, list) else (overrides or {})).items():
        set_override(values, key, value)
    known = {key: _as_float_if_numeric(value) if accepts_float(GRPO_FIELD_TYPES[key]) else value
             for key, value in values.items() if key in GRPO_FIELD_TYPES}
    problems = unknown_key_problems(list(values), set(GRPO_FIELD_TYPES))
    config = GRPOConfig(**known)
    problems += config.problems()
    if problems:
        raise ConfigError(_problem_list(problems))
    return config


def save_config(config: GRPOConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))


def describe_fields() -> str:
    """One line per field: name, default, help, choices and range — the body of `dllm-ais train --help`."""
    lines = []
    for f in dataclasses.fields(GRPOConfig):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        extra = [f.metadata.get("help", "")]
        if "choices" in f.metadata:
            extra.append("[" + "|".join(f.metadata["choices"]) + "]")
        if "range" in f.metadata:
            extra.append(Interval.parse(f.metadata["range"]).describe().replace("must be ", ""))
        lines.append(f"  {f'--{f.name}={default}':<40} {' '.join(e for e in extra if e)}".rstrip())
    return "\n".join(lines)
