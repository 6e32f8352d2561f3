"""Training configuration: `GRPOConfig`, TRL's field names at the top level and the pipeline's own stages in settings
groups (`rollout`, `likelihood`, `correction`, and the study knobs behind `experimental`), loaded from YAML plus
`--key=value` / `--group.key=value` overrides (or `--key value`).

Everything is validated here, before any model or dataset is loaded, so a typo costs seconds, not a GPU hour. Each
field declares its allowed values in its metadata (`choices`, `range`, see `dllm_ais.validation`); `--help` shows them.
This module imports nothing heavy: `dllm-ais --help` must not import torch.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from dllm_ais.choices import (
    BATCH_SCALED_PRECISIONS, LOSS_TYPES, REWARD_SCALINGS, SEQUENCE_ESTIMATORS, TRAJECTORY_ESTIMATORS,
    block_fraction_problem, replays_decoder,
)
from dllm_ais.settings import (
    AT_LEAST_ONE, GROUP, GROUP_SHORTHANDS, MAX_PROMPTS, MAX_SIZE, MAX_TOKENS, MOVED_FIELDS, NON_NEGATIVE, PATH, POSITIVE,
    SETTINGS_GROUPS, CorrectionSettings, ExperimentalSettings, LikelihoodSettings, RolloutSettings, SettingsGroup, choice,
)
from dllm_ais.safe_files import write_file
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
    # a tiny Dream on digits, AR-initialised from the tiny Qwen3 (recipes/tiny_dream_digits.yaml)
    f"{EMBEDDED_MODEL}-dream": Path(__file__).parent / "assets" / "tiny_dream",
    # a tiny SDAR (block diffusion) on digits, the tiny Qwen3 continued by block-diffusion SFT
    # (recipes/tiny_sdar_digits.yaml)
    f"{EMBEDDED_MODEL}-sdar": Path(__file__).parent / "assets" / "tiny_sdar",
    # a tiny LLaDA2 (mixture-of-experts block diffusion) on digits, the tiny Qwen3's weights mapped into it, then
    # block-diffusion SFT (recipes/tiny_llada2_digits.yaml)
    f"{EMBEDDED_MODEL}-llada2": Path(__file__).parent / "assets" / "tiny_llada2",
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
D1_ROLLOUT = {"remasking": "low_confidence", "schedule": "even", "cache": "none", "cache_dtype": "none",
              "threshold": None, "cache_refresh_interval": None, "cfg_scale": 0.0}
DREAM_ROLLOUT = {**D1_ROLLOUT, "remasking": "entropy", "schedule": "time_linear"}
# SDAR's own decoder (JetAstra/SDAR): low_confidence_dynamic (the drawn token's probability, every position above the
# threshold and at least the step's scheduled count) at the threshold of the README's inference examples, with the
# exact cache of finished blocks (any cache mode is that cache for a block-causal model)
SDAR_THRESHOLD = 0.9
SDAR_ROLLOUT = {**D1_ROLLOUT, "remasking": "maskgit_plus", "threshold": SDAR_THRESHOLD, "cache": "dual"}
# LLaDA2's own decoder (inclusionAI's generate): the same rule at its default threshold 0.95 (its minimal_topk and EOS
# early stop are not the sampler's: docs/architecture.md, "Model families")
LLADA2_THRESHOLD = 0.95
LLADA2_ROLLOUT = {**SDAR_ROLLOUT, "threshold": LLADA2_THRESHOLD}
BLOCK_PROTOCOL_ROLLOUTS = {"sdar": SDAR_ROLLOUT, "llada2": LLADA2_ROLLOUT}
"""The block-causal families' own decodings, by `dllm-ais eval --protocol` name (`with_sdar_protocol`)."""
FAMILY_BLOCK_PROTOCOLS = {"sdar": "sdar", "llada2_moe": "llada2"}
"""A block-causal model_type's own protocol (`block_protocol_of`)."""


def block_protocol_of(model_type: str | None) -> str:
    """The eval protocol a block-causal `model_type` decodes with by default: its family's own (SDAR's otherwise)."""
    return FAMILY_BLOCK_PROTOCOLS.get(model_type, "sdar")


def _exact_decoding(config: "GRPOConfig", gen_length: int, rollout: dict) -> "GRPOConfig":
    """`config` decoding ``gen_length`` tokens with the rollout settings `rollout`, no top-p / top-k, no factor rule,
    the top-scored positions and the rollout's own commit order (no commit choice to score or differentiate)."""
    experimental = dataclasses.replace(config.experimental, rollout_factor=None, rollout_position_temperature=0.0,
                                       likelihood_order="rollout", commit_choice_gradient=False,
                                       commit_choice_as_set=False)
    return dataclasses.replace(config, max_completion_length=gen_length, top_p=1.0, top_k=0, experimental=experimental,
                               rollout=dataclasses.replace(config.rollout, **rollout))


def with_d1_protocol(config: "GRPOConfig", gen_length: int, block_length: int | None = None) -> "GRPOConfig":
    """`config` decoding with d1's evaluation protocol at ``gen_length``: `D1_ROLLOUT`, blocks of
    min(block_length, gen_length) (default: the config's), gen_length / 2 steps (two tokens per step). Held-out
    validation and `dllm-ais eval` both decode with it, for every diffusion family."""
    block_length = min(block_length or config.rollout.block_length, gen_length)
    return _exact_decoding(config, gen_length, {**D1_ROLLOUT, "block_length": block_length,
                                                "steps": max(gen_length // 2, 1)})


def with_dream_protocol(config: "GRPOConfig", gen_length: int) -> "GRPOConfig":
    """`config` decoding as Dream's own evaluation does (``diffusion_generate``), greedy: the whole completion as one
    block, one step per token, Dream's entropy rule on its time-linear schedule (`DREAM_ROLLOUT`); `dllm-ais eval
    --protocol dream`. Dream's published runs sample at temperature 0.1 with top-p 0.9; this protocol is greedy."""
    return _exact_decoding(config, gen_length, {**DREAM_ROLLOUT, "block_length": gen_length, "steps": gen_length})


def with_sdar_protocol(config: "GRPOConfig", gen_length: int, block_size: int, name: str = "sdar") -> "GRPOConfig":
    """`config` decoding as SDAR's own generation does (JetAstra/SDAR ``generate.py``), greedy: blocks of the model's
    `block_size`, as many denoising steps per block as it has positions (``denoising_steps = block_length``, 4 for
    the released models), `SDAR_ROLLOUT`'s low_confidence_dynamic at `SDAR_THRESHOLD`, the exact cache; `dllm-ais
    eval --protocol sdar`. ``generate.py``'s own default threshold is 0.85, its README's engines use 0.9; threshold
    1.0 would be the static rule (low_confidence_static). `name` "llada2": LLaDA2's own (`LLADA2_ROLLOUT`, the same at
    `LLADA2_THRESHOLD`, in its blocks; `dllm-ais eval --protocol llada2`)."""
    return _exact_decoding(config, gen_length, {**BLOCK_PROTOCOL_ROLLOUTS[name], "block_length": block_size,
                                                "steps": gen_length})




@dataclass
class GRPOConfig:
    """All settings of a GRPO run with FP8 rollouts and importance-sampling correction.

    Field names follow TRL's `GRPOConfig` where TRL has the concept; the rest are grouped by pipeline stage.
    """

    # --- model ---
    model_name_or_path: str = field(default=EMBEDDED_MODEL, metadata={**PATH,
        "help": f"Hub id or local directory of the policy; {', '.join(map(repr, EMBEDDED_MODELS))} = the tiny models "
                "shipped with the package (LLaDA and Qwen3 on digits and on chain sums, Dream, SDAR and LLaDA2 on "
                "digits)."})
    policy: str = field(default="auto", metadata={**choice(*POLICIES),
        "help": "diffusion (LLaDA-style masked diffusion) or autoregressive; auto: diffusion for llada, Dream, sdar and "
                "llada2_moe."})
    dtype: str = field(default="auto", metadata={**choice(*DTYPES),
        "help": "Trainer weights dtype; auto = bfloat16 on CUDA, float32 on CPU."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Passed to from_pretrained (not needed for LLaDA)."})
    use_peft: bool = field(default=True, metadata={"help": "Train a LoRA adapter (peft) instead of all weights."})
    lora_r: int = field(default=128, metadata={"range": f"[1, {MAX_SIZE}]"})
    lora_alpha: int = field(default=64, metadata={"range": f"(0, {MAX_SIZE}]"})
    lora_dropout: float = field(default=0.05, metadata={"range": "[0, 1)"})
    lora_target_modules: list[str] | str | None = field(default=None, metadata={
        "help": "Module names or a regex; None = the preset for the model type (LLaDA: every block's "
                "q_proj k_proj v_proj attn_out ff_proj up_proj ff_out, never the LM head)."})
    lora_target_parameters: list[str] | None = field(default=None, metadata={
        "help": "Parameters LoRA adapts directly (peft's target_parameters: stacked MoE experts, one adapter per "
                "expert; needs lora_dropout 0), matched by name suffix; None = the preset for the model type "
                "(LLaDA2: experts.gate_up_proj experts.down_proj; none for the others), [] = none. The router "
                "(mlp.gate.weight) stays frozen unless named here."})
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

    # --- rollout and sampling (TRL's names) ---
    num_generations: int = field(default=6, metadata={"range": f"[2, {MAX_SIZE}]",
        "help": "Completions per prompt (the GRPO group size G)."})
    max_completion_length: int = field(default=256, metadata={"range": f"[1, {MAX_TOKENS}]",
        "help": "Completion length (diffusion gen_length)."})
    temperature: float = field(default=0.9, metadata=NON_NEGATIVE)
    top_k: int = field(default=0, metadata={**NON_NEGATIVE, "help": "Sample from the k most probable tokens; 0 = off."})
    top_p: float = field(default=1.0, metadata={"range": "(0, 1]",
        "help": "Sample from the top-p nucleus (diffusion: Dream's order, top-p then top-k); 1 = off."})

    # --- the pipeline's own stages: one group each ---
    rollout: RolloutSettings = field(default_factory=lambda: RolloutSettings(), metadata={GROUP: True})
    likelihood: LikelihoodSettings = field(default_factory=lambda: LikelihoodSettings(), metadata={GROUP: True})
    correction: CorrectionSettings = field(default_factory=lambda: CorrectionSettings(), metadata={GROUP: True})

    # --- loss ---
    beta: float = field(default=0.04, metadata={**NON_NEGATIVE,
        "help": "KL coefficient against the reference (adapter disabled)."})
    epsilon: float = field(default=0.5, metadata=POSITIVE)
    epsilon_high: float | None = field(default=None, metadata=POSITIVE)
    loss_type: str = field(default="dapo", metadata=choice(*LOSS_TYPES))
    scale_rewards: str = field(default="none", metadata=choice(*REWARD_SCALINGS))
    drop_zero_std_groups: bool = field(default=False, metadata={
        "help": "Leave the GRPO groups whose rewards are all equal (frac_reward_zero_std; their advantages are 0) out "
                "of the log-probs, the correction and the update, which then replay the informative groups only "
                "(DAPO's dynamic-sampling filter, without resampling to refill the batch; the loss is normalised over "
                "the kept groups). Needs beta=0."})

    # --- optimisation ---
    learning_rate: float = field(default=3e-6, metadata=POSITIVE)
    weight_decay: float = field(default=0.1, metadata=NON_NEGATIVE)
    adam_beta1: float = field(default=0.9, metadata={"range": "[0, 1)"})
    adam_beta2: float = field(default=0.99, metadata={"range": "[0, 1)"})
    max_grad_norm: float = field(default=0.2, metadata={**POSITIVE, "help": "Gradient-norm clip."})
    lr_scheduler_type: str = field(default="constant_with_warmup", metadata=choice(*SCHEDULERS))
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

    experimental: ExperimentalSettings = field(default_factory=lambda: ExperimentalSettings(), metadata={GROUP: True})

    def __post_init__(self) -> None:
        self.report_to = normalize_report_to(self.report_to)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.metadata.get("path") and isinstance(value, str) and value.startswith("~"):
                setattr(self, f.name, os.path.expanduser(value))
            if f.metadata.get(GROUP):
                setattr(self, f.name, as_group(f.name, value))

    @property
    def best_metric_key(self) -> str:
        """`metric_for_best_model` as the logged key: `eval/<name>`."""
        name = self.metric_for_best_model
        return name if name.startswith("eval/") else f"eval/{name}"

    @property
    def fast_rollouts(self) -> bool:
        """Whether rollouts decode approximately (a block KV cache or parallel commits)."""
        return (self.rollout.cache != "none" or self.rollout.threshold is not None
                or self.experimental.rollout_factor is not None)

    @property
    def unseen_approximation(self) -> str | None:
        """What the importance ratio of this run cannot see of its fast rollouts, said once at start; None when it
        sees everything (exact rollouts). What each costs is measured in BENCHMARKS.md, "Fast rollouts"."""
        if not self.fast_rollouts or self.policy == "autoregressive":
            return None
        if self.replays_decoder:
            return ("the trajectory estimator replays the fast decoder itself (experimental.likelihood_decoder="
                    "rollout): the cache and parallel commits are part of the policy trained, and the ratio sees the "
                    "precision alone; held-out evaluation decodes exactly (what that costs: BENCHMARKS.md, \"Fast "
                    "rollouts\")")
        if self.ratio_sees_decoder:
            return ("the trajectory estimator scores the fast sampler's own order: its ratio sees the cache's logit "
                    "error but not the shift of the visited canvas states (what that costs: BENCHMARKS.md, \"Fast "
                    "rollouts\"; experimental.likelihood_decoder=rollout trains the fast decoder itself instead)")
        return ("the fast decoder's approximation (cache, parallel commits) is not seen by the importance ratio, "
                "which compares the engine and the trainer on the same canvases; only the rollout precision is")

    @property
    def ratio_sees_decoder(self) -> bool:
        """Whether the importance ratio sees the rollout decoder's approximation (cache, parallel commits): only the
        trajectory estimator scoring the rollout's own commit order compares the fast decoder's recorded log-probs
        with the trainer's exact replay; the other estimators (step_merge's engine side too, with fewer segments than
        steps), and the replay along the exact order, score both sides on the same canvases and see the rollout
        precision only."""
        return (self.likelihood.estimator == "trajectory" and self.experimental.likelihood_order == "rollout"
                and not self.replays_decoder)

    @property
    def replays_decoder(self) -> bool:
        """Whether the trajectory estimator scores the rollout decoder's own (cached) logits
        (`dllm_ais.choices.replays_decoder`)."""
        return replays_decoder(self.likelihood.estimator, self.experimental.likelihood_order,
                               self.experimental.likelihood_decoder, self.rollout.cache)

    def decoding(self, exact: bool) -> "GRPOConfig":
        """This config as an evaluation decodes: `exact` = d1's protocol at this completion and block length
        (`with_d1_protocol`), whatever the rollouts use (order, steps, cache, parallel commits, guidance), else the
        rollout sampler; either way without the trajectory estimator's order replay."""
        if exact:
            return with_d1_protocol(self, self.max_completion_length)
        return dataclasses.replace(self, experimental=dataclasses.replace(self.experimental, likelihood_order="rollout"))

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

        Field by field (type, choices, range), each settings group by its own rules; then the names and paths the
        config refers to (local model, dataset file, reward functions), of the fields valid on their own; then, when
        every field is, the rules across fields and groups.
        """
        invalid = field_problems(self)
        group_problems = [problem for name in SETTINGS_GROUPS for problem in getattr(self, name).problems()]
        invalid_names = set(invalid) | {f"{name}.{field}" for name in SETTINGS_GROUPS
                                         for field in field_problems(getattr(self, name))}
        problems = ([problem for found in invalid.values() for problem in found] + group_problems
                    + _reference_problems(self, invalid_names))
        if invalid or group_problems:  # the rules below assume well-typed fields
            return problems
        rollout, likelihood, experimental = self.rollout, self.likelihood, self.experimental
        diffusion = self.policy != "autoregressive"
        block_fraction = block_fraction_problem(experimental.likelihood_block_fraction, likelihood.estimator)
        checks = [
            (self.generation_batch_size % self.num_generations == 0,
             f"per_device_train_batch_size * gradient_accumulation_steps = {self.generation_batch_size} must be divisible "
             f"by num_generations={self.num_generations} (whole groups per device)"),
            (not diffusion or self.max_completion_length % rollout.block_length == 0,
             f"max_completion_length={self.max_completion_length} must be a multiple of rollout.block_length="
             f"{rollout.block_length}"),
            (rollout.threshold is None or experimental.rollout_factor is None,
             "rollout.threshold and experimental.rollout_factor are two parallel-decoding rules: set one of them"),
            (not diffusion or rollout.steps % max(self.max_completion_length // rollout.block_length, 1) == 0,
             f"rollout.steps={rollout.steps} must be a multiple of the number of blocks, max_completion_length / "
             f"rollout.block_length = {self.max_completion_length // rollout.block_length} (the exact decoder, which "
             "held-out evaluation and the exact-order experiments use, follows its fixed schedule)"),
            (not diffusion or rollout.block_length % 2 == 0 or rollout.block_length >= self.max_completion_length,
             f"rollout.block_length={rollout.block_length} must be even: held-out validation decodes with d1's "
             f"protocol, max_completion_length / 2 = {self.max_completion_length // 2} steps, a whole number per block"),
            (not diffusion or rollout.steps <= self.max_completion_length,
             f"rollout.steps={rollout.steps} must be <= max_completion_length={self.max_completion_length} "
             "(at most one denoising step per token)"),
            (experimental.ratio_type != "ctpo" or likelihood.estimator not in SEQUENCE_ESTIMATORS,
             f"likelihood.estimator={likelihood.estimator} is sequence-level (one ratio per completion): set "
             "experimental.ratio_type=token, or a token-level estimator (one_step, trajectory, step_merge) for ctpo"),
            (not (likelihood.estimator == "spg" and likelihood.spg_block_masking and experimental.elbo_coupled),
             "experimental.elbo_coupled pairs random masks and likelihood.spg_block_masking draws block masks: set one "
             "of them to false"),
            (block_fraction is None, block_fraction),
            (not (rollout.precision_flow == "unified" and rollout.precision in BATCH_SCALED_PRECISIONS and diffusion
                  and likelihood.estimator in TRAJECTORY_ESTIMATORS),
             f"rollout.precision={rollout.precision} scales activations over the whole batch, and "
             f"likelihood.estimator={likelihood.estimator} takes ℓ_rollout from the sampler's batch while the trainer "
             "replays micro-batches, so the unified flow would not compute one set of numbers: use a per-row or "
             "per-block notch (fp8, mxfp4, ...), likelihood.estimator=one_step, or rollout.precision_flow=split"),
            (not self.drop_zero_std_groups or self.beta == 0,
             f"drop_zero_std_groups leaves out groups whose KL term (beta={self.beta}) still has a gradient: set "
             "beta=0, or drop_zero_std_groups=false"),
            (experimental.likelihood_block_fraction == 1 or experimental.ratio_type == "token",
             f"experimental.likelihood_block_fraction={experimental.likelihood_block_fraction} scores some tokens "
             f"only, and ratio_type={experimental.ratio_type}'s prefix needs every token: set experimental.ratio_type="
             "token, or experimental.likelihood_block_fraction=1"),
            (experimental.likelihood_order == "rollout" or likelihood.estimator in TRAJECTORY_ESTIMATORS,
             f"experimental.likelihood_order={experimental.likelihood_order} orders the trajectory estimator's "
             f"replay: set likelihood.estimator to one of {', '.join(TRAJECTORY_ESTIMATORS)}, or "
             "experimental.likelihood_order=rollout"),
            (not self.replays_decoder or experimental.rollout_exact_fraction == 0,
             f"experimental.rollout_exact_fraction={experimental.rollout_exact_fraction} decodes some groups exactly, "
             "but experimental.likelihood_decoder=rollout replays every completion with the configured (cached) "
             "decoder: set experimental.likelihood_decoder=exact, or experimental.rollout_exact_fraction=0"),
            (experimental.rollout_fidelity == "fixed" or (diffusion and self.fast_rollouts),
             f"experimental.rollout_fidelity={experimental.rollout_fidelity} moves between a fast diffusion decoder "
             "and the exact one: set rollout.cache, rollout.threshold or experimental.rollout_factor, or "
             "experimental.rollout_fidelity=fixed"),
            (experimental.rollout_fidelity == "fixed" or not diffusion or self.ratio_sees_decoder,
             f"experimental.rollout_fidelity={experimental.rollout_fidelity} reacts to the decoder's mismatch, which "
             "only the trajectory estimator's ratio sees: set likelihood.estimator=trajectory, "
             "experimental.likelihood_order=rollout and experimental.likelihood_decoder=exact, or "
             "experimental.rollout_fidelity=fixed"),
            (experimental.rollout_exact_fraction == 0 or (diffusion and self.fast_rollouts),
             f"experimental.rollout_exact_fraction={experimental.rollout_exact_fraction} mixes exact with fast "
             "diffusion rollouts: set rollout.cache, rollout.threshold or experimental.rollout_factor, or "
             "experimental.rollout_exact_fraction=0"),
            (not (self.overwrite_output_dir and self.resume_from_checkpoint not in (None, False)),
             "resume_from_checkpoint continues the run in output_dir; overwrite_output_dir=true starts afresh: set one"),
            (not self.correction.complete_ratio or (diffusion and likelihood.estimator == "trajectory"
                                                     and experimental.likelihood_order == "rollout"),
             "correction.complete_ratio multiplies the trajectory's token ratio by the commit choice's: set "
             "likelihood.estimator=trajectory and experimental.likelihood_order=rollout (a diffusion policy), or "
             "correction.complete_ratio=false"),
            (not self.correction.complete_ratio or (experimental.rollout_position_temperature > 0
                                                     and experimental.rollout_factor is None),
             "correction.complete_ratio needs a commit choice with a probability: set "
             "experimental.rollout_position_temperature > 0 (Gumbel-top-k commits, or with rollout.threshold "
             "independent commits with probability sigmoid((confidence - threshold) / T)) and leave "
             "experimental.rollout_factor unset, or correction.complete_ratio=false"),
            (not self.correction.complete_ratio or (experimental.rollout_fidelity == "fixed"
                                                     and experimental.rollout_exact_fraction == 0),
             "correction.complete_ratio replays every completion with the configured decoder, and "
             "experimental.rollout_fidelity / rollout_exact_fraction decode some with another: set "
             "experimental.rollout_fidelity=fixed and experimental.rollout_exact_fraction=0, or "
             "correction.complete_ratio=false"),
            (not experimental.commit_choice_as_set or (experimental.rollout_position_temperature > 0
                                                        and self.rollout.threshold is None
                                                        and experimental.rollout_factor is None
                                                        and self.rollout.schedule == "even"),
             "experimental.commit_choice_as_set scores a fixed count's drawn positions as a set: set "
             "experimental.rollout_position_temperature > 0, rollout.threshold=null, no experimental.rollout_factor "
             "and rollout.schedule=even, or experimental.commit_choice_as_set=false"),
            (not experimental.commit_choice_gradient or (diffusion and self.replays_decoder
                                                          and experimental.rollout_position_temperature > 0
                                                          and experimental.rollout_factor is None),
             "experimental.commit_choice_gradient differentiates the commit choice's log-prob from the replayed "
             "decoder's logits: set likelihood.estimator=trajectory, a rollout.cache (prefix or dual) with "
             "experimental.likelihood_decoder=rollout, experimental.rollout_position_temperature > 0 and no "
             "experimental.rollout_factor, or experimental.commit_choice_gradient=false"),
            (not experimental.commit_choice_gradient or (self.beta == 0 and experimental.rollout_fidelity == "fixed"
                                                          and experimental.rollout_exact_fraction == 0),
             "experimental.commit_choice_gradient needs every completion decoded by the configured decoder and no "
             "KL term (whose reference log-probs hold no commit choice): set beta=0, "
             "experimental.rollout_fidelity=fixed and experimental.rollout_exact_fraction=0, or "
             "experimental.commit_choice_gradient=false"),
            (not self.correction.bypass_mode or experimental.rollout_fidelity == "fixed",
             f"experimental.rollout_fidelity={experimental.rollout_fidelity} reads the mismatch before the update, "
             "which correction.bypass_mode measures during it: set experimental.rollout_fidelity=fixed, or "
             "correction.bypass_mode=false"),
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
        return problems + [message for ok, message in checks if not ok]

    def validate(self) -> "GRPOConfig":
        """Raise ConfigError listing every problem (see `problems`) with its fix; return self when valid."""
        problems = self.problems()
        if problems:
            raise ConfigError(_problem_list(problems))
        return self

    def to_dict(self) -> dict[str, Any]:
        """Every field, the groups as nested mappings (the layout of a recipe)."""
        return dataclasses.asdict(self)


def as_group(name: str, value: Any) -> SettingsGroup:
    """The settings group `name` from a group object, a mapping of its fields, or (correction) the shorthand string
    of its method. Raises ConfigError for an unknown key or another type."""
    group = SETTINGS_GROUPS[name]
    if isinstance(value, group):
        return value
    if isinstance(value, str) and name in GROUP_SHORTHANDS:
        value = {GROUP_SHORTHANDS[name]: value}
    fields = _group_field_names(group)
    if not isinstance(value, dict):
        raise ConfigError(_problem_list([f"{name}={show(value)}: expected a mapping of {name}.* settings (e.g. "
                                         f"--{name}.{fields[0]}=...)"]))
    problems = unknown_key_problems([f"{name}.{key}" for key in value], {f"{name}.{f}" for f in fields})
    if problems:
        raise ConfigError(_problem_list(problems))
    types = typing.get_type_hints(group)
    return group(**{key: _as_float_if_numeric(item) if accepts_float(types[key]) else item
                    for key, item in value.items()})


def _group_field_names(group: type[SettingsGroup]) -> list[str]:
    return [f.name for f in dataclasses.fields(group)]


GRPO_FIELD_TYPES = typing.get_type_hints(GRPOConfig)


def _problem_list(problems: list[str]) -> str:
    return problem_list("Invalid configuration:", problems)


def _reference_problems(config: GRPOConfig, invalid: set[str]) -> list[str]:
    """What the config names must exist: a local model directory, the dataset file, the task's settings
    (`task_args`), reward and remasking names.

    Fields in `invalid` (already reported; a group's as ``group.field``) are skipped.
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
    if "rollout.remasking" not in invalid:
        try:
            resolve_remasking_rule(config.rollout.remasking)
        except ValueError as error:
            problems.append(f"rollout.remasking={show(config.rollout.remasking)}: {error}")
    return [problem for problem in problems if problem]


def _as_float_if_numeric(value: Any) -> Any:
    """YAML 1.1 reads `1e-5` (no dot) as a string; accept it as the number users meant."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def field_type(key: str) -> Any:
    """The type of the field `key` (a field, ``group.field``, or a flat name of an earlier release); None for a key
    that names no field."""
    name, _, entry = MOVED_FIELDS.get(key, key).partition(".")
    if name in SETTINGS_GROUPS and entry:
        return typing.get_type_hints(SETTINGS_GROUPS[name]).get(entry)
    return None if entry else GRPO_FIELD_TYPES.get(name)


def _is_flag(arg: str) -> bool:
    """Whether the command-line word `arg` is an option (`--key`, `-h`) rather than a value (a negative number is a
    value)."""
    if not arg.startswith("-"):
        return False
    try:
        float(arg)
    except ValueError:
        return True
    return False


def _is_boolean_word(arg: str) -> bool:
    """Whether `arg` reads (YAML) as true or false."""
    try:
        return isinstance(yaml.safe_load(arg), bool)
    except yaml.YAMLError:
        return False


def joined_overrides(args: list[str], own_option: Callable[[str], bool] = lambda arg: False) -> list[str]:
    """The command-line words `args` with each override written `--key=value`: `--key value` joined, and a field that
    takes true (`--dry_run`, `--resume_from_checkpoint`) alone, followed by another option or nothing, as
    `--key=true`; a field that only holds true/false takes the next word as its value only when it is true/false (so
    `--dry_run recipe.yaml` leaves the recipe positional). Options for which `own_option` is true (a command's own,
    `--model DIR`) and every other word are left as they are. ConfigError naming the flag when another field's
    option has no value."""
    joined, index = [], 0
    while index < len(args):
        arg, following = args[index], args[index + 1:index + 2]
        index += 1
        if arg == "--" or not arg.startswith("--") or "=" in arg or own_option(arg):
            joined.append(arg)
            continue
        kind = field_type(arg[2:].replace("-", "_"))
        takes_true = kind is bool or bool in typing.get_args(kind)
        if following and not _is_flag(following[0]) and (kind is not bool or _is_boolean_word(following[0])):
            joined.append(f"{arg}={following[0]}")
            index += 1
        elif takes_true:
            joined.append(f"{arg}=true")
        else:
            raise ConfigError(f"{arg[:60]} has no value: write {arg[:60]} VALUE or {arg[:60]}=VALUE.")
    return joined


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """Turn `--key=value` / `--key value` / `key=value` strings (a boolean field's `--key` alone: true, see
    `joined_overrides`) into a dict; values are parsed as YAML scalars/lists."""
    overrides: dict[str, Any] = {}
    for arg in joined_overrides(args):
        key, sep, value = arg.removeprefix("--").partition("=")
        if not sep:
            raise ConfigError(f"Cannot parse override {show(arg)}: write --key=value or --key value (e.g. "
                              "--learning_rate=1e-5).")
        key = key.replace("-", "_")
        overrides[key] = parse_yaml(value, f"--{key}")
    return overrides


def set_override(values: dict[str, Any], key: str, value: Any) -> None:
    """Set ``values[key] = value``; a key ``name.entry`` of a settings group (``rollout.cache``) or of a mapping field
    (``task_args.min_numbers``) sets that one entry, keeping the recipe's others, and a mapping given to a whole
    settings group (``rollout: {cache: dual}``, or ``correction: tis``, short for ``{method: tis}``) is merged into the
    group's entries set so far."""
    name, dot, entry = key.partition(".") if isinstance(key, str) else (key, "", "")
    if dot and entry and (name in SETTINGS_GROUPS or GRPO_FIELD_TYPES.get(name) is dict):
        values[name] = {**_group_entries(name, values.get(name)), entry: value}
    elif key in SETTINGS_GROUPS and isinstance(_group_entries(key, value), dict) and value not in ({}, None):
        values[key] = {**_group_entries(key, values.get(key)), **_group_entries(key, value)}
    else:
        values[key] = value


def _group_entries(name: str, value: Any) -> Any:
    """The entries set so far of the group or mapping field `name` from its raw value: a mapping as it is, a group's
    shorthand string as its mapping, nothing as {}."""
    if isinstance(value, str) and name in GROUP_SHORTHANDS:
        return {GROUP_SHORTHANDS[name]: value}
    return value if isinstance(value, dict) else {} if value is None else value


def renamed_items(values: dict[str, Any], origin: str) -> list[tuple[str, Any]]:
    """The (key, value) pairs of `values` (a recipe, overrides, a saved config) with every flat name of earlier releases
    renamed to its place in a settings group (`MOVED_FIELDS`: ``rollout_cache`` -> ``rollout.cache``), logging one line
    that names each move and where `origin` used it."""
    moved = {key: MOVED_FIELDS[key] for key in values if isinstance(key, str) and key in MOVED_FIELDS}
    if moved:
        logging.getLogger(__name__).warning(
            "%s uses flat names of an earlier release, read as: %s", origin,
            ", ".join(f"{old} -> {new}" for old, new in moved.items()))
    return [(moved.get(key, key), value) for key, value in values.items()]


def canonical_values(values: dict[str, Any], origin: str = "the config") -> dict[str, Any]:
    """`values` as the nested mapping of the current layout: flat names of earlier releases moved into their settings
    groups (`renamed_items`), dotted names nested (`set_override`)."""
    result: dict[str, Any] = {}
    for key, value in renamed_items(values, origin):
        set_override(result, key, value)
    return result


def flat_settings(values: dict[str, Any]) -> dict[str, Any]:
    """A config's mapping (`GRPOConfig.to_dict`, a canonical recipe) with each settings group's fields as
    ``group.field`` entries, for comparing two configs field by field."""
    return {f"{key}.{name}" if key in SETTINGS_GROUPS and isinstance(value, dict) else key: item
            for key, value in values.items()
            for name, item in (value.items() if key in SETTINGS_GROUPS and isinstance(value, dict) else [(key, value)])}


def changed_settings(recipe_path: str | Path, config: "GRPOConfig", unchanging: frozenset[str]) -> list[str]:
    """`field: old -> new` for every field outside `unchanging` whose value in the recipe at `recipe_path` (a run's
    saved config.yaml: what it trained with) differs from `config`'s; ConfigError when the file does not read as a
    recipe."""
    saved = flat_settings(canonical_values(read_recipe(recipe_path), str(Path(recipe_path).parent)))
    defaults = flat_settings(GRPOConfig().to_dict())
    return [f"{name}: {show(saved.get(name, defaults[name]))} -> {show(value)}"
            for name, value in flat_settings(config.to_dict()).items()
            if name not in unchanging and saved.get(name, defaults[name]) != value]


def settings_added_since(recipe_path: str | Path, config: "GRPOConfig") -> list[str]:
    """The fields of `config` (``group.field``) that the recipe at `recipe_path` does not name: for a run's saved
    config.yaml (every field of its release), the settings added to dllm-ais since the run was configured;
    ConfigError when the file does not read as a recipe."""
    saved = flat_settings(canonical_values(read_recipe(recipe_path), str(Path(recipe_path).parent)))
    return [name for name in flat_settings(config.to_dict()) if name not in saved]


def recipe_setting(values: dict[str, Any], name: str) -> Any:
    """The value of the field `name` (``group.field`` for a settings group's) in the nested mapping `values` (a
    recipe, a saved config), or None when it is not set there."""
    for key in name.split("."):
        if not isinstance(values, dict):
            return None
        values = values.get(key)
    return values


def load_config(recipe: str | Path | None = None, overrides: list[str] | dict[str, Any] | None = None) -> GRPOConfig:
    """Build a validated `GRPOConfig` from a YAML recipe (optional) and command-line overrides (which win); settings
    groups are nested mappings in the recipe and dotted names on the command line (``--rollout.cache=dual``).

    Raises ConfigError listing every problem at once: unknown keys (with a hint), then each field's problems.
    """
    values = canonical_values(read_recipe(recipe), str(recipe)) if recipe is not None else {}
    overrides = parse_overrides(overrides) if isinstance(overrides, list) else (overrides or {})
    for key, value in renamed_items(overrides, "the command line"):
        set_override(values, key, value)
    known = {key: _as_float_if_numeric(value) if accepts_float(GRPO_FIELD_TYPES[key]) else value
             for key, value in values.items() if key in GRPO_FIELD_TYPES}
    problems = unknown_key_problems(list(values), set(GRPO_FIELD_TYPES))
    for name, group in SETTINGS_GROUPS.items():
        entries = known.get(name)
        if isinstance(entries, dict):
            fields = _group_field_names(group)
            problems += unknown_key_problems([f"{name}.{key}" for key in entries], {f"{name}.{f}" for f in fields})
            known[name] = {key: value for key, value in entries.items() if key in fields}
        elif name in known and not isinstance(entries, group):
            problems.append(f"{name}={show(entries)}: expected a mapping of {name}.* settings (e.g. "
                            f"--{name}.{_group_field_names(group)[0]}=...)")
            del known[name]
    config = GRPOConfig(**known)
    problems += config.problems()
    if problems:
        raise ConfigError(_problem_list(problems))
    return config


def save_config(config: GRPOConfig, path: str | Path) -> None:
    """Write `config` as a recipe to `path` (staged and renamed, never through a link: `safe_files.write_file`)."""
    write_file(path, yaml.safe_dump(config.to_dict(), sort_keys=False))


# The top-level fields' sections in `--help` and docs/configuration.md: (title, the section's first field)
TOP_LEVEL_SECTIONS = (("model", "model_name_or_path"), ("data and rewards", "task"),
                      ("sampling (TRL's names)", "num_generations"), ("loss", "beta"),
                      ("optimisation", "learning_rate"), ("output and run", "output_dir"))
HELP_WIDTH = 150


def config_sections() -> list[tuple[str, str, list[dataclasses.Field]]]:
    """(title, option prefix, fields) of each section of the config: the top-level fields by `TOP_LEVEL_SECTIONS`,
    then each settings group (prefix ``group.``)."""
    top = [f for f in dataclasses.fields(GRPOConfig) if not f.metadata.get(GROUP)]
    starts = [next(i for i, f in enumerate(top) if f.name == first) for _, first in TOP_LEVEL_SECTIONS]
    sections = [(title, "", top[start:end]) for (title, _), start, end
                in zip(TOP_LEVEL_SECTIONS, starts, [*starts[1:], len(top)])]
    return sections + [(f"{name}: {group.TITLE}", f"{name}.", list(dataclasses.fields(group)))
                       for name, group in SETTINGS_GROUPS.items()]


def describe_fields() -> str:
    """The body of `dllm-ais train --help`: each section of the config under its heading, one line per field
    (``--name=default  help [choices] range``, the help's first sentence, at most `HELP_WIDTH` characters; the full
    text is in docs/configuration.md, `configuration_reference`)."""
    lines = []
    for title, prefix, fields in config_sections():
        lines += [f"{title}:"] + [_field_line(prefix, f) for f in fields] + [""]
    return "\n".join(lines).rstrip()


def configuration_reference() -> str:
    """docs/configuration.md: every field of every section with its default, its full help, choices and range
    (a test keeps the file equal to this)."""
    lines = ["# Configuration reference", "",
             "Generated from `dllm_ais/config.py` by `dllm_ais.config.configuration_reference` (the test suite checks it "
             "is current). Set a field in "
             "a YAML recipe (settings groups as nested mappings: `rollout: {cache: dual}`) or on the command line "
             "(`--learning_rate=1e-5`, `--rollout.cache=dual`). The `experimental` group holds study knobs: they may "
             "change between releases.", ""]
    for title, prefix, fields in config_sections():
        lines += [f"## {title}", "", "| field | default | description |", "| --- | --- | --- |"]
        lines += [f"| `{prefix}{f.name}` | `{_default(f)}` | {_field_text(f, full=True)} |" for f in fields]
        lines.append("")
    return "\n".join(lines)


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _field_text(f: dataclasses.Field, full: bool) -> str:
    """A field's help (the first sentence unless `full`), choices and range."""
    help_text = f.metadata.get("help", "")
    extra = [help_text if full else _first_sentence(help_text)]
    if "choices" in f.metadata:
        extra.append("[" + "|".join(f.metadata["choices"]) + "]")
    if "range" in f.metadata:
        extra.append(Interval.parse(f.metadata["range"]).describe().replace("must be ", ""))
    return " ".join(e for e in extra if e).replace("|", "\\|" if full else "|")


def _field_line(prefix: str, f: dataclasses.Field) -> str:
    """``  --prefix.name=default  help [choices] range`` of one field, cut to `HELP_WIDTH` characters."""
    line = f"  {f'--{prefix}{f.name}={_default(f)}':<44} {_field_text(f, full=False)}".rstrip()
    return line if len(line) <= HELP_WIDTH else line[:HELP_WIDTH - 1] + "…"


def _first_sentence(text: str) -> str:
    """`text` up to the end of its first sentence (a period followed by a space)."""
    head, period, _ = text.partition(". ")
    return head + "." if period else text
