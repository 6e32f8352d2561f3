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

from dllm_ais.choices import LOSS_TYPES, REWARD_SCALINGS, replays_decoder
from dllm_ais.config_rules import cross_field_problems, reference_problems
from dllm_ais.settings import (
    AT_LEAST_ONE, GROUP, GROUP_SHORTHANDS, MAX_PROMPTS, MAX_SIZE, MAX_TOKENS, MOVED_FIELDS, NON_NEGATIVE, PATH, POSITIVE,
    SETTINGS_GROUPS, CorrectionSettings, ExperimentalSettings, LikelihoodSettings, RolloutSettings, SettingsGroup, choice,
)
from dllm_ais.safe_files import write_file
from dllm_ais.tasks import TaskNames
from dllm_ais.trackers import TRACKERS, normalize_report_to
from dllm_ais.validation import (
    ConfigError, accepts_float, field_problems, parse_yaml, problem_list, read_recipe, show, unknown_key_problems,
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


# d1's evaluation decoder, whatever the length: LLaDA's own sampler, no block cache, no parallel commits, no guidance,
# no token editing (held-out validation decodes exactly; eval/rollout_sampler/* scores the rollout's editing decoder)
D1_ROLLOUT = {"remasking": "low_confidence", "schedule": "even", "cache": "none", "cache_dtype": "none",
              "threshold": None, "cache_refresh_interval": None, "cfg_scale": 0.0, "editing_threshold": None}


def exact_decoding(config: "GRPOConfig", gen_length: int, rollout: dict) -> "GRPOConfig":
    """`config` decoding ``gen_length`` tokens with the rollout settings `rollout`, no top-p / top-k, no factor rule,
    the top-scored positions and the rollout's own commit order (no commit choice to score or differentiate)."""
    experimental = dataclasses.replace(config.experimental, rollout_factor=None, rollout_position_temperature=0.0,
                                       likelihood_order="rollout", commit_choice_gradient=False,
                                       commit_choice_as_set=False, routing_record=False)
    return dataclasses.replace(config, max_completion_length=gen_length, top_p=1.0, top_k=0, experimental=experimental,
                               rollout=dataclasses.replace(config.rollout, **rollout))


def with_d1_protocol(config: "GRPOConfig", gen_length: int, block_length: int | None = None) -> "GRPOConfig":
    """`config` decoding with d1's evaluation protocol at ``gen_length``: `D1_ROLLOUT`, blocks of
    min(block_length, gen_length) (default: the config's), gen_length / 2 steps (two tokens per step). Held-out
    validation and `dllm-ais eval` both decode with it, for every diffusion family."""
    block_length = min(block_length or config.rollout.block_length, gen_length)
    return exact_decoding(config, gen_length, {**D1_ROLLOUT, "block_length": block_length,
                                                "steps": max(gen_length // 2, 1)})


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
    lora_target_parameters: list[str] | None = field(default=None, metadata={"empty_means_none": True,
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
        parts = "the cache, parallel commits and token edits" if self.rollout.editing_threshold is not None else (
            "the cache and parallel commits")
        if self.replays_decoder:
            return ("the trajectory estimator replays the fast decoder itself (experimental.likelihood_decoder="
                    f"rollout): {parts} are part of the policy trained, and the ratio sees the precision alone; "
                    "held-out evaluation decodes exactly (what that costs: BENCHMARKS.md, \"Fast rollouts\")")
        if self.ratio_sees_decoder:
            return ("the trajectory estimator scores the fast sampler's own order: its ratio sees the cache's logit "
                    "error but not the shift of the visited canvas states (what that costs: BENCHMARKS.md, \"Fast "
                    "rollouts\"; experimental.likelihood_decoder=rollout trains the fast decoder itself instead)")
        return (f"the fast decoder's approximation ({parts}) is not seen by the importance ratio, which compares "
                "the engine and the trainer on the same canvases; only the rollout precision is")

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
                               self.experimental.likelihood_decoder, self.rollout.cache,
                               self.rollout.editing_threshold is not None)

    def decoding(self, exact: bool) -> "GRPOConfig":
        """This config as an evaluation decodes: `exact` = d1's protocol at this completion and block length
        (`with_d1_protocol`), whatever the rollouts use (order, steps, cache, parallel commits, guidance), else the
        rollout sampler; either way without the trajectory estimator's order replay or a routing record."""
        if exact:
            return with_d1_protocol(self, self.max_completion_length)
        return dataclasses.replace(self, experimental=dataclasses.replace(self.experimental, likelihood_order="rollout",
                                                                          routing_record=False))

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
                    + reference_problems(self, invalid_names))
        if invalid or group_problems:  # the rules below assume well-typed fields
            return problems
        return problems + cross_field_problems(self)

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
    """`values` as the nested mapping of the current layout: names of earlier releases — flat ones, or a group's
    field moved to another group — moved to their place (`renamed_items`), dotted names nested (`set_override`)."""
    result: dict[str, Any] = {}
    for key, value in renamed_items(_with_moved_group_fields(values), origin):
        set_override(result, key, value)
    return result


def _with_moved_group_fields(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with each settings group's field that moved to another group (``correction.complete_ratio`` in a
    nested ``correction:`` mapping) taken out of its mapping as a dotted name, for `renamed_items` to move."""
    result = dict(values)
    for group, entries in values.items():
        if group not in SETTINGS_GROUPS or not isinstance(entries, dict):
            continue
        moved = {name for name in entries if isinstance(name, str) and f"{group}.{name}" in MOVED_FIELDS}
        if moved:
            result[group] = {name: value for name, value in entries.items() if name not in moved}
            result.update({f"{group}.{name}": entries[name] for name in moved})
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
