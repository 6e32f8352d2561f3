"""Training configuration: one flat dataclass with TRL's field names, loaded from YAML plus `--key=value` overrides.

Everything is validated here, before any model or dataset is loaded, so a typo costs seconds, not a GPU hour.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dllm_ais.correction import ALPHA_RULES, CORRECTION_METHODS, IS_LEVELS
from dllm_ais.data import TASKS
from dllm_ais.loss import LOSS_TYPES, RATIO_TYPES, REWARD_SCALINGS
from dllm_ais.quantization import PRECISIONS

EMBEDDED_MODEL = "embedded"
POLICIES = ("auto", "diffusion", "autoregressive")
ESTIMATORS = ("one_step", "trajectory")
DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine")


def _choice(*options: str) -> dict:
    return {"choices": options}


@dataclass
class GRPOConfig:
    """All settings of a GRPO run with FP8 rollouts and importance-sampling correction.

    Field names follow TRL's `GRPOConfig` where TRL has the concept; the rest are grouped by pipeline stage.
    """

    # --- model ---
    model_name_or_path: str = field(default=EMBEDDED_MODEL, metadata={
        "help": f"Hub id or local directory of the policy; '{EMBEDDED_MODEL}' = the tiny LLaDA shipped with the package."})
    policy: str = field(default="auto", metadata={**_choice(*POLICIES),
        "help": "diffusion (LLaDA-style masked diffusion) or autoregressive; auto: diffusion iff model_type is llada."})
    dtype: str = field(default="auto", metadata={**_choice(*DTYPES),
        "help": "Trainer weights dtype; auto = bfloat16 on CUDA, float32 on CPU."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Passed to from_pretrained (not needed for LLaDA)."})
    use_peft: bool = field(default=True, metadata={"help": "Train a LoRA adapter (peft) instead of all weights."})
    lora_r: int = 128
    lora_alpha: int = 64
    lora_dropout: float = 0.05
    lora_target_modules: list[str] | str | None = field(default=None, metadata={
        "help": "Module names or a regex; None = the preset for the model type (LLaDA: every block's "
                "q_proj k_proj v_proj attn_out ff_proj up_proj ff_out, never the LM head)."})
    gradient_checkpointing: bool = False

    # --- data and rewards ---
    task: str = field(default="digits", metadata={**_choice(*TASKS), "help": "Task: dataset loader and reward preset."})
    dataset_path: str | None = field(default=None, metadata={"help": "Local file/dir overriding the task's hub dataset."})
    dataset_size: int | None = field(default=None, metadata={"help": "Use at most this many training prompts."})
    eval_size: int = field(default=64, metadata={"help": "Held-out prompts scored before and after training (0 = skip)."})
    reward_funcs: list[str] | None = field(default=None, metadata={
        "help": "Reward function names or 'module:function'; None = the task preset."})
    reward_weights: list[float] | None = None
    max_prompt_length: int = 256

    # --- rollout ---
    rollout_precision: str = field(default="fp8", metadata={**_choice(*PRECISIONS),
        "help": "Precision of the rollout engine; bf16 = no quantization (on-policy baseline)."})
    num_generations: int = field(default=6, metadata={"help": "Completions per prompt (the GRPO group size G)."})
    max_completion_length: int = field(default=256, metadata={"help": "Completion length (diffusion gen_length)."})
    diffusion_steps: int = field(default=128, metadata={"help": "Denoising steps over the whole completion."})
    block_length: int = 32
    temperature: float = 0.9
    remasking: str = field(default="low_confidence", metadata={"help": "Remasking rule name (low_confidence, random, ...)."})
    cfg_scale: float = 0.0
    top_k: int = field(default=0, metadata={"help": "Autoregressive sampling only; 0 = off."})
    top_p: float = field(default=1.0, metadata={"help": "Autoregressive sampling only; 1 = off."})

    # --- likelihood ---
    likelihood_estimator: str = field(default="one_step", metadata={**_choice(*ESTIMATORS),
        "help": "Diffusion log-prob estimator: d1's one-step surrogate or the exact trajectory replay."})
    p_mask_prompt: float = 0.15

    # --- correction ---
    correction: str = field(default="ais", metadata={**_choice(*CORRECTION_METHODS),
        "help": "Rollout-mismatch correction of the policy gradient."})
    is_level: str = field(default="token", metadata=_choice(*IS_LEVELS))
    is_clip: float = field(default=2.0, metadata={"help": "Upper truncation C of the importance ratio."})
    is_clip_low: float | None = None
    is_normalize: bool = False
    ais_rule: str = field(default="gate", metadata=_choice(*ALPHA_RULES))
    ais_kl_scale: float = field(default=1e-3, metadata={"help": "κ: the k3 divergence at which AIS is ~63% on."})
    ais_alpha_max: float = 1.0
    ais_alpha_ema: float = field(default=0.0, metadata={"help": "EMA of α across batches; 0 = per batch."})

    # --- loss ---
    beta: float = field(default=0.04, metadata={"help": "KL coefficient against the reference (adapter disabled)."})
    epsilon: float = 0.5
    epsilon_high: float | None = None
    loss_type: str = field(default="dapo", metadata=_choice(*LOSS_TYPES))
    scale_rewards: str = field(default="none", metadata=_choice(*REWARD_SCALINGS))
    ratio_type: str = field(default="token", metadata=_choice(*RATIO_TYPES))

    # --- optimisation ---
    learning_rate: float = 3e-6
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    max_grad_norm: float = 0.2
    lr_scheduler_type: str = field(default="constant_with_warmup", metadata=_choice(*SCHEDULERS))
    warmup_steps: int = 0
    num_iterations: int = field(default=12, metadata={"help": "μ: optimizer passes over each generation batch."})
    per_device_train_batch_size: int = field(default=6, metadata={"help": "Completions per device per micro-batch."})
    gradient_accumulation_steps: int = 1
    max_steps: int = field(default=100, metadata={"help": "Optimizer steps to run."})
    seed: int = 42
    max_consecutive_skipped_batches: int = field(default=3, metadata={
        "help": "A non-finite reward, log-prob, loss or gradient skips its generation batch (weights untouched); "
                "this many skips in a row stop the run."})

    # --- output ---
    output_dir: str = "outputs/dllm-ais"
    logging_steps: int = 1
    save_steps: int = field(default=0, metadata={"help": "Write a resumable checkpoint-N every this many steps (0 = only "
                                                        "on Ctrl-C / SIGTERM)."})
    save_total_limit: int | None = field(default=None, metadata={
        "help": "Keep only the newest N checkpoint-N directories of this run; None = keep all."})
    resume_from_checkpoint: str | bool | None = field(default=None, metadata={
        "help": "Continue a run exactly where a checkpoint left it: a checkpoint-N dir, or true = the latest in "
                "output_dir. Only output, logging, saving, max_steps and eval_size may change."})
    overwrite_output_dir: bool = field(default=False, metadata={
        "help": "Start afresh in a non-empty output_dir, replacing what dllm-ais wrote there (nothing else)."})
    report_to: list[str] = field(default_factory=list, metadata={"help": "Trackers via accelerate: tensorboard, trackio, wandb."})
    dry_run: bool = field(default=False, metadata={
        "help": "Validate the recipe, then run one step on a tiny stand-in model of the same family."})

    @property
    def generation_batch_size(self) -> int:
        """Completions sampled per device per generation batch (reused for `num_iterations` passes)."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps

    def validate(self) -> "GRPOConfig":
        """Check types and values of every field; raise ConfigError listing every problem with its fix."""
        problems = [p for f in dataclasses.fields(self) for p in _check_field(f, getattr(self, f.name))]
        if problems:  # value checks below assume well-typed fields
            raise ConfigError("Invalid configuration:\n  - " + "\n  - ".join(problems))
        checks = [
            (self.num_generations >= 2, f"num_generations={self.num_generations}: GRPO needs >= 2 completions per prompt"),
            (self.generation_batch_size % max(self.num_generations, 1) == 0,
             f"per_device_train_batch_size * gradient_accumulation_steps = {self.generation_batch_size} must be divisible "
             f"by num_generations={self.num_generations} (whole groups per device)"),
            (self.policy == "autoregressive" or self.max_completion_length % max(self.block_length, 1) == 0,
             f"max_completion_length={self.max_completion_length} must be a multiple of block_length={self.block_length}"),
            (self.policy == "autoregressive"
             or self.diffusion_steps % max(self.max_completion_length // max(self.block_length, 1), 1) == 0,
             f"diffusion_steps={self.diffusion_steps} must be a multiple of the number of blocks "
             f"({self.max_completion_length // max(self.block_length, 1)})"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.p_mask_prompt < 1, "p_mask_prompt must be in [0, 1)"),
            (self.is_clip > 0, "is_clip must be > 0"),
            (self.is_clip_low is None or self.is_clip_low <= self.is_clip, "is_clip_low must be <= is_clip"),
            (self.correction not in ("acr", "ais") or self.is_level == "token",
             f"correction={self.correction} works on token-level ratios: set is_level=token"),
            (self.correction != "ais" or (self.is_clip_low is None and not self.is_normalize),
             "correction=ais mixes with min(rho, is_clip): leave is_clip_low=null and is_normalize=false"),
            (self.likelihood_estimator != "trajectory" or self.cfg_scale == 0,
             "likelihood_estimator=trajectory replays the plain model: set cfg_scale=0 or use one_step"),
            (self.ais_kl_scale > 0, "ais_kl_scale must be > 0"),
            (0 <= self.ais_alpha_max <= 1, "ais_alpha_max must be in [0, 1]"),
            (0 <= self.ais_alpha_ema < 1, "ais_alpha_ema must be in [0, 1)"),
            (self.epsilon > 0, "epsilon must be > 0"),
            (self.beta >= 0, "beta must be >= 0"),
            (self.learning_rate > 0, "learning_rate must be > 0"),
            (self.num_iterations >= 1, "num_iterations must be >= 1"),
            (self.per_device_train_batch_size >= 1, "per_device_train_batch_size must be >= 1"),
            (self.gradient_accumulation_steps >= 1, "gradient_accumulation_steps must be >= 1"),
            (self.max_steps >= 1, "max_steps must be >= 1"),
            (self.eval_size >= 0, "eval_size must be >= 0"),
            (self.save_total_limit is None or self.save_total_limit >= 1,
             "save_total_limit must be >= 1 (or null to keep every checkpoint)"),
            (self.max_consecutive_skipped_batches >= 1, "max_consecutive_skipped_batches must be >= 1"),
            (not (self.overwrite_output_dir and self.resume_from_checkpoint not in (None, False)),
             "resume_from_checkpoint continues the run in output_dir; overwrite_output_dir=true starts afresh: set one"),
            (self.reward_weights is None or self.reward_funcs is not None,
             "reward_weights needs reward_funcs (one weight per function)"),
            (self.reward_weights is None or self.reward_funcs is None or len(self.reward_weights) == len(self.reward_funcs),
             "reward_weights must have one entry per reward function"),
            (not set(self.report_to) - {"tensorboard", "trackio", "wandb"},
             f"report_to={self.report_to}: supported trackers are tensorboard, trackio, wandb"),
        ]
        problems = [message for ok, message in checks if not ok]
        if problems:
            raise ConfigError("Invalid configuration:\n  - " + "\n  - ".join(problems))
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class ConfigError(ValueError):
    """A recipe or override is invalid; the message lists every problem and how to fix it."""


def _check_field(f: dataclasses.Field, value: Any) -> list[str]:
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        return [f"{f.name}={value!r}: choose one of {', '.join(choices)}"]
    if not _matches_type(value, GRPO_FIELD_TYPES[f.name]):
        return [f"{f.name}={value!r}: expected {_type_name(GRPO_FIELD_TYPES[f.name])}"]
    return []


def _matches_type(value: Any, annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_matches_type(value, arm) for arm in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if origin is list:
        (item,) = typing.get_args(annotation)
        return isinstance(value, list) and all(_matches_type(v, item) for v in value)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, annotation)


def _type_name(annotation: Any) -> str:
    return str(annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")


GRPO_FIELD_TYPES = typing.get_type_hints(GRPOConfig)


def _accepts_float(annotation: Any) -> bool:
    return annotation is float or float in typing.get_args(annotation)


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
            overrides[pending] = yaml.safe_load(arg)
            pending = None
            continue
        key, sep, value = arg.removeprefix("--").partition("=")
        key = key.replace("-", "_")
        if sep:
            overrides[key] = yaml.safe_load(value)
        elif arg.startswith("--"):
            pending = key
        else:
            raise ConfigError(f"Cannot parse override {arg!r}: write --key=value (e.g. --learning_rate=1e-5).")
    if pending is not None:
        raise ConfigError(f"Override --{pending} has no value: write --{pending}=VALUE.")
    return overrides


def load_config(recipe: str | Path | None = None, overrides: list[str] | dict[str, Any] | None = None) -> GRPOConfig:
    """Build a validated `GRPOConfig` from a YAML recipe (optional) and command-line overrides (which win)."""
    values: dict[str, Any] = {}
    if recipe is not None:
        path = Path(recipe)
        if not path.is_file():
            raise ConfigError(f"Recipe {str(path)!r} not found. Pass a YAML file, e.g. recipes/llada8b_gsm8k_lora_fp8_ais.yaml.")
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"Recipe {str(path)!r} must be a YAML mapping of field: value.")
        values.update(loaded)
    values.update(parse_overrides(overrides) if isinstance(overrides, list) else (overrides or {}))
    values = {key: _as_float_if_numeric(value) if key in GRPO_FIELD_TYPES and _accepts_float(GRPO_FIELD_TYPES[key])
              else value for key, value in values.items()}
    known = {f.name for f in dataclasses.fields(GRPOConfig)}
    unknown = [k for k in values if k not in known]
    if unknown:
        hints = [f"{k!r}" + (f" (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(k, known, 1)) else "")
                 for k in unknown]
        raise ConfigError("Unknown config key(s): " + ", ".join(hints) + ". Run `dllm-ais train --help` for the fields.")
    return GRPOConfig(**values).validate()


def save_config(config: GRPOConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))


def describe_fields() -> str:
    """One line per field: name, default and help — the body of `dllm-ais train --help`."""
    lines = []
    for f in dataclasses.fields(GRPOConfig):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        extra = f.metadata.get("help", "")
        if "choices" in f.metadata:
            extra = (extra + " " if extra else "") + "[" + "|".join(f.metadata["choices"]) + "]"
        lines.append(f"  {f'--{f.name}={default}':<40} {extra}".rstrip())
    return "\n".join(lines)
