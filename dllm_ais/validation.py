"""Checking configuration input before anything is loaded: YAML text, unknown keys, field types and declared ranges.

The checks are driven by each dataclass field's metadata, so a new field is checked by declaring it::

    my_rate: float = field(default=0.1, metadata={"range": "(0, 1]", "help": "..."})
    my_mode: str = field(default="a", metadata={"choices": ("a", "b")})

- ``range``: an interval in the usual notation, "[1, inf)", "(0, 1]", "(-inf, inf)" (any finite number). Infinite
  ends are open, so NaN and ±inf never pass. Every numeric field declares one (a test checks); for a list of numbers
  it applies to each item.
- ``choices``: the allowed values.
- Strings must not be blank, and a list whose default is None ("the preset") must not be empty.

Input is untrusted: YAML is read without aliases (a "billion laughs" recipe would expand exponentially), duplicate
keys and Python tags, recipes are size-capped, and messages show at most `MAX_SHOWN` characters of any value.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

MAX_SHOWN = 60
MAX_PROBLEM_LENGTH = 600
MAX_RECIPE_BYTES = 1 << 20
MAX_LISTED_KEYS = 10
CLOSE_MATCH_CUTOFF = 0.85
FLOAT32_MAX = 3.4028234663852886e38


class ConfigError(ValueError):
    """A recipe or override is invalid; the message lists every problem and how to fix it."""


def problem_list(header: str, problems: list[str]) -> str:
    """`header` and one "  - problem" line per problem, each cut to MAX_PROBLEM_LENGTH characters."""
    return header + "".join("\n  - " + (p if len(p) <= MAX_PROBLEM_LENGTH else p[:MAX_PROBLEM_LENGTH - 3] + "...")
                            for p in problems)


def show(value: Any) -> str:
    """repr(value), cut to MAX_SHOWN characters (values come from untrusted input and may be huge)."""
    try:
        text = repr(value)
    except ValueError:  # an int beyond Python's digit limit
        text = f"<{type(value).__name__} too large to print>"
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN - 3] + "..."


# ------------------------------------------------------------------------------------------------- ranges
@dataclass(frozen=True)
class Interval:
    """A set of allowed numbers written "[low, high]" with "(" / ")" for open ends; "inf" ends are open."""

    text: str
    low: float
    high: float
    low_closed: bool
    high_closed: bool

    @classmethod
    def parse(cls, text: str) -> "Interval":
        match = re.fullmatch(r"([\[(])\s*([^,\s]+)\s*,\s*([^\s\])]+)\s*([\])])", text)
        if match is None:
            raise ValueError(f"range {text!r}: write an interval such as '[1, inf)' or '(0, 1]'")
        low, high = float(match[2]), float(match[3])
        interval = cls(text, low, high, match[1] == "[", match[4] == "]")
        if (interval.low_closed and math.isinf(low)) or (interval.high_closed and math.isinf(high)) or low > high:
            raise ValueError(f"range {text!r}: infinite ends are open and low <= high")
        return interval

    def __contains__(self, value: float) -> bool:
        above = value > self.low or (self.low_closed and value == self.low)
        below = value < self.high or (self.high_closed and value == self.high)
        return above and below

    def describe(self) -> str:
        """The condition in words: "must be >= 1", "must be finite", "must be in (0, 1]"."""
        if math.isinf(self.high):
            if math.isinf(self.low):
                return "must be a finite number"
            return f"must be {'>=' if self.low_closed else '>'} {_number(self.low)}"
        return f"must be in {self.text}"


def _number(value: float) -> str:
    return str(int(value)) if value.is_integer() else str(value)


# ------------------------------------------------------------------------------------------------- types
def matches_type(value: Any, annotation: Any) -> bool:
    """isinstance for the annotations configs use: unions, Optional, list[...], int (not bool), float (int ok)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(matches_type(value, arm) for arm in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if origin is list:
        (item,) = typing.get_args(annotation)
        return isinstance(value, list) and all(matches_type(v, item) for v in value)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, annotation)


def type_name(annotation: Any) -> str:
    return str(annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")


def accepts_float(annotation: Any) -> bool:
    return annotation is float or any(accepts_float(arm) for arm in typing.get_args(annotation))


def is_numeric(annotation: Any) -> bool:
    """int or float, possibly inside Optional / list (bool excluded)."""
    return annotation in (int, float) or any(is_numeric(arm) for arm in typing.get_args(annotation))


# ------------------------------------------------------------------------------------------------- fields
def field_problems(instance: Any) -> dict[str, list[str]]:
    """The problems of each invalid field of the dataclass `instance` (type, choices, blank values, declared range; an
    empty list where None is the default, unless the field's metadata says `empty_means_none`)."""
    hints = typing.get_type_hints(type(instance))
    problems = {f.name: value_problems(f, hints[f.name], getattr(instance, f.name)) for f in dataclasses.fields(instance)}
    return {name: found for name, found in problems.items() if found}


def value_problems(f: dataclasses.Field, annotation: Any, value: Any) -> list[str]:
    shown = f"{f.name}={show(value)}"
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        return [f"{shown}: choose one of {', '.join(map(str, choices))}"]
    if not matches_type(value, annotation):
        return [f"{shown}: expected {type_name(annotation)}"]
    items = value if isinstance(value, list) else [value]
    if any(isinstance(item, str) and not item.strip() for item in items):
        return [f"{shown}: must not be blank"]
    if value == [] and f.default is None and not f.metadata.get("empty_means_none"):
        return [f"{shown}: leave it unset (null) for the default, or give at least one item"]
    numbers = [item for item in items if isinstance(item, (int, float)) and not isinstance(item, bool)]
    if "range" in f.metadata:
        interval = Interval.parse(f.metadata["range"])
        if any(n not in interval for n in numbers):
            return [f"{shown}: {interval.describe()}"]
    if any(_too_large(n, accepts_float(annotation)) for n in numbers):
        return [f"{shown}: too large " + (f"for float32 (at most {FLOAT32_MAX:.3g}), the precision it is used in"
                                           if accepts_float(annotation) else "for a 64-bit integer")]
    return []


def _too_large(number: int | float, as_float: bool) -> bool:
    """Beyond float32 (finite values; inf is the range's business) or beyond int64: the tensors' and libraries' limits."""
    if not as_float:
        return abs(number) >= 2**63
    try:
        return math.isfinite(float(number)) and abs(float(number)) > FLOAT32_MAX
    except OverflowError:  # an int too large for any float
        return True


def numeric_fields_without_range(cls: type) -> list[str]:
    hints = typing.get_type_hints(cls)
    return [f.name for f in dataclasses.fields(cls) if is_numeric(hints[f.name]) and "range" not in f.metadata]


# ------------------------------------------------------------------------------------------------- unknown keys
# Names users bring from TRL, transformers, verl, d1 and dllm that this config lacks, each with what to write here.
# Looked up before any close-match suggestion, so no name is ever mapped to a field of different meaning.
FOREIGN_KEYS = {
    "num_train_epochs": "training length is max_steps (optimizer steps); there are no epochs",
    "total_epochs": "training length is max_steps (optimizer steps); there are no epochs",
    "total_training_steps": "use max_steps",
    "steps_per_generation": "each generation batch serves num_iterations optimizer steps and holds "
                            "per_device_train_batch_size * gradient_accumulation_steps completions per process",
    "generation_batch_size": "a generation batch holds per_device_train_batch_size * gradient_accumulation_steps "
                             "completions per process",
    "train_batch_size": "a generation batch holds per_device_train_batch_size * gradient_accumulation_steps "
                        "completions per process",
    "ppo_mini_batch_size": "use per_device_train_batch_size (micro-batch) and gradient_accumulation_steps",
    "ppo_micro_batch_size_per_gpu": "use per_device_train_batch_size",
    "ppo_epochs": "use num_iterations (optimizer passes over each generation batch)",
    "lr": "use learning_rate",
    "lr_scheduler": "use lr_scheduler_type",
    "warmup_ratio": "use warmup_steps (a number of optimizer steps)",
    "optim": "the optimizer is AdamW: learning_rate, weight_decay, adam_beta1, adam_beta2",
    "adam_epsilon": "AdamW's eps is torch's default (1e-8) and not configurable",
    "bf16": "use dtype=bfloat16 (the trainer's weights dtype; there is no autocast)",
    "fp16": "use dtype=float16 (the trainer's weights dtype; there is no autocast)",
    "torch_dtype": "use dtype",
    "model_init_kwargs": "use dtype and trust_remote_code",
    "model": "use model_name_or_path",
    "model_name": "use model_name_or_path",
    "model_path": "use model_name_or_path",
    "lora_rank": "use lora_r",
    "use_lora": "use use_peft",
    "dataset_name": "set task (one of the built-in tasks) and dataset_path for a local copy of its data",
    "kl_coef": "use beta (KL coefficient against the reference)",
    "kl_loss_coef": "use beta (KL coefficient against the reference)",
    "use_kl_loss": "set beta > 0 for a KL term (0 = none)",
    "clip_ratio": "use epsilon (the ratio is clipped to [1 - epsilon, 1 + epsilon_high])",
    "clip_ratio_low": "use epsilon (the ratio is clipped to [1 - epsilon, 1 + epsilon_high])",
    "clip_ratio_high": "use epsilon_high",
    "epsilon_low": "the lower clip is epsilon (ratio >= 1 - epsilon); epsilon_high sets the upper one",
    "delta": "two-sided (delta) clipping is not supported; use epsilon / epsilon_high",
    "importance_sampling_level": "TRL's GSPO policy-ratio level is not supported (experimental.ratio_type is token "
                                 "or ctpo); correction.level sets the level of the rollout correction",
    "is_clip_high": "use correction.clip (the upper truncation C)",
    "vllm_importance_sampling_correction": "set correction.method (none, tis, mis, acr, ais)",
    "vllm_importance_sampling_mode": "set correction.method=tis (truncate) or mis (mask), and correction.level (token, "
                                     "sequence, geometric)",
    "vllm_importance_sampling_cap": "use correction.clip",
    "vllm_importance_sampling_clip_max": "use correction.clip",
    "rollout_is": "set correction.level (token, sequence, geometric) and correction.method=tis",
    "rollout_is_threshold": "use correction.clip",
    "rollout_rs": "set correction.method=mis (masks instead of truncating)",
    "use_vllm": "rollouts run in the built-in engine; set rollout.precision",
    "loss_agg_mode": "use loss_type (grpo, bnpo, dr_grpo, dapo)",
    "n": "use num_generations",
    "rollout_n": "use num_generations",
    "num_samples": "use num_generations",
    "group_size": "use num_generations",
    "max_new_tokens": "use max_completion_length",
    "max_response_length": "use max_completion_length",
    "response_length": "use max_completion_length",
    "gen_length": "use max_completion_length",
    "max_length": "use max_prompt_length and max_completion_length",
    "steps": "use rollout.steps (denoising steps) or max_steps (optimizer steps)",
    "mask_id": "the mask token comes from the model's config (mask_token_id)",
    "random_masking": "use likelihood.p_mask_prompt",
    "block_size": "use rollout.block_length",
    "rollout_precision_dtype": "use rollout.precision",
    "quantization": "use rollout.precision",
    "entropy_coeff": "entropy regularisation is not supported",
    "push_to_hub": "after training: dllm-ais export OUTPUT_DIR/final DEST --push_to_hub REPO [--private]",
    "hub_model_id": "after training: dllm-ais export OUTPUT_DIR/final DEST --push_to_hub REPO [--private]",
    "hub_private_repo": "after training: dllm-ais export OUTPUT_DIR/final DEST --push_to_hub REPO --private",
    "eval_strategy": "set eval_steps (validation every N steps; 0 = off)",
    "evaluation_strategy": "set eval_steps (validation every N steps; 0 = off)",
    "load_best_model_at_end": "the best checkpoint by metric_for_best_model is named in "
                              "OUTPUT_DIR/best_checkpoint.json; export or evaluate that one",
    "num_generations_eval": "validation is greedy: one completion per prompt",
    "logging_dir": "tracker logs go under output_dir",
}
FOREIGN_PREFIXES = {"vllm_": "rollouts run in the built-in engine; set rollout.precision"}


def unknown_key_problems(keys: list[Any], known: set[str]) -> list[str]:
    """One line per unknown key (at most MAX_LISTED_KEYS): a known foreign name's hint, else a close typo match."""
    unknown = [key for key in keys if key not in known]
    problems = []
    for key in unknown[:MAX_LISTED_KEYS]:
        hint = FOREIGN_KEYS.get(key) if isinstance(key, str) else None
        if hint is None and isinstance(key, str):
            hint = next((text for prefix, text in FOREIGN_PREFIXES.items() if key.startswith(prefix)), None)
        if hint is None and isinstance(key, str) and len(key) <= 64:
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=CLOSE_MATCH_CUTOFF)
            hint = f"did you mean {close[0]!r}?" if close else None
        problems.append(f"unknown key {show(key)}" + (f": {hint}" if hint else ""))
    if len(unknown) > MAX_LISTED_KEYS:
        problems.append(f"... and {len(unknown) - MAX_LISTED_KEYS} more unknown keys")
    if unknown:
        problems[-1] += " (`dllm-ais train --help` lists the fields)"
    return problems


# ------------------------------------------------------------------------------------------------- YAML
class RecipeLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses aliases (*name) and duplicate keys."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(
                None, None, "YAML aliases (*name) are not allowed in recipes; write the value out",
                self.peek_event().start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                if key_node.value in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {show(key_node.value)} appears twice; keep one", key_node.start_mark)
                seen.add(key_node.value)
        return super().construct_mapping(node, deep=deep)


def parse_yaml(text: str, origin: str) -> Any:
    """Parse untrusted YAML; any failure is one ConfigError line `origin:line:column: problem`."""
    try:
        return yaml.load(text, Loader=RecipeLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f"{origin}:{mark.line + 1}:{mark.column + 1}" if mark else origin
        problem = error.problem or ""
        if "python/" in problem:
            problem = "Python tags (!!python/...) are not allowed: a recipe holds plain values"
        elif "constructor for the tag" in problem:
            problem = f"unsupported YAML tag ({problem.rsplit('tag', 1)[-1].strip()}): a recipe holds plain values"
        context = f" ({error.context})" if error.context and error.context != problem else ""
        raise ConfigError(f"{where}: {problem}{context}") from None
    except (yaml.YAMLError, ValueError, RecursionError) as error:  # e.g. an integer beyond Python's digit limit
        raise ConfigError(f"{origin}: cannot read this YAML: {str(error)[:200]}") from None


def read_recipe(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML recipe file (size-capped, parsed by `parse_yaml`)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"Recipe {show(str(path))} not found. Pass a YAML file, e.g. "
                          "recipes/llada8b_gsm8k_lora_fp8_ais.yaml.")
    if path.stat().st_size > MAX_RECIPE_BYTES:
        raise ConfigError(f"{path}: {path.stat().st_size} bytes; a recipe is a small YAML mapping "
                          f"(at most {MAX_RECIPE_BYTES} bytes)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text; a recipe is a YAML file") from None
    loaded = parse_yaml(text, str(path))
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: a recipe is a YAML mapping of field: value, got {type(loaded).__name__}")
    return loaded


# ------------------------------------------------------------------------------------------------- paths
def path_kind(text: str) -> str:
    """"dir", "file", "missing", or "invalid" (no usable path: a NUL byte, a name too long, ...)."""
    try:
        os.stat(text)
    except FileNotFoundError:
        return "missing"
    except (OSError, ValueError):
        return "invalid"
    return "dir" if os.path.isdir(text) else "file"


def looks_local(name: str) -> bool:
    """Whether a model name is meant as a local path: absolute or relative path syntax, more than one '/', or a first
    component that exists here (a Hub id is `name` or `org/name`)."""
    return (name.startswith(("/", "./", "../", "~", "\\")) or name in (".", "..") or name.count("/") > 1
            or ("/" in name and path_kind(name.split("/")[0]) in ("dir", "file")))


def model_path_problem(name: str) -> str | None:
    """Why `model_name_or_path` cannot load, if that is visible without loading: a missing or non-model local
    directory (reported at once instead of being retried as a Hub id), or a name that is no valid Hub id."""
    kind = path_kind(name)
    if kind == "dir":
        if not any(path_kind(str(Path(name) / marker)) == "file" for marker in ("config.json", "adapter_config.json")):
            return (f"model_name_or_path={show(name)}: this directory holds no config.json or adapter_config.json; "
                    "point to a model or adapter directory (e.g. OUTPUT_DIR/final)")
        return None
    if kind == "file":
        return f"model_name_or_path={show(name)} is a file; point to the model directory"
    if looks_local(name):
        return f"model_name_or_path={show(name)}: no such directory; fix the path (a Hub id is written org/name)"
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return f"model_name_or_path={show(name)}: neither a local directory nor a valid Hub id (org/name)"
    return None
