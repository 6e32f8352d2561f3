"""The --model_args of the `dllm_ais` harness model (`ModelArguments`), each checked before anything loads, and
where they place the model and find its tokenizer.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dllm_ais.choices import CACHE_MODES
from dllm_ais.config import DTYPES, POLICIES
from dllm_ais.lm_eval_requests import d1_sampler_config
from dllm_ais.loading import SpecialTokens, adapter_base, resolve_model_path
from dllm_ais.validation import ConfigError, field_problems, show

logger = logging.getLogger(__name__)
DEFAULT_SEED = 1234  # eval_llada.py's set_seed


D1_BLOCK_LENGTH = 32


def tokenizer_source(pretrained: str) -> str:
    """Where the tokenizer of `pretrained` is: the directory itself, or for an adapter directory without tokenizer
    files its base model."""
    if (Path(resolve_model_path(pretrained)) / "tokenizer_config.json").is_file():
        return pretrained
    return adapter_base(pretrained) or pretrained


BOOLEAN_WORDS = {"true": True, "yes": True, "on": True, "1": True,
                 "false": False, "no": False, "off": False, "0": False}


def harness_value(annotation: Any, value: Any) -> Any:
    """A --model_args value as the harness passes it (its command line makes `-3` the float -3.0 and leaves `no` a
    string, which Python would count as true) in the type `annotation` names, where that is exact: a boolean from
    true/false, yes/no, on/off, 1/0 (any case), an integer from an integral number or its digits, a float from its
    text. Any other value is returned as it is, for `field_problems` to report."""
    kinds = set(typing.get_args(annotation)) or {annotation}
    if bool in kinds:
        if isinstance(value, str):
            return BOOLEAN_WORDS.get(value.strip().lower(), value)
        return bool(value) if type(value) in (int, float) and value in (0, 1) else value
    if isinstance(value, bool):
        return value
    if int in kinds:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str) and re.fullmatch(r"[+-]?\d+", value.strip()):
            return int(value)
    if float in kinds and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def device_problem(name: str, device: str) -> str | None:
    """Why the torch device `device` cannot hold the model on this machine: not a device name, or a CUDA device it
    does not have."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        return f"{name}={show(device)}: not a device name (cpu, cuda, cuda:N)"
    if parsed.type == "cuda" and (parsed.index or 0) >= torch.cuda.device_count():
        return f"{name}={show(device)}: this machine has {torch.cuda.device_count()} CUDA devices"
    return None


# The sampler's settings are checked before the model is loaded, so before its special tokens are known.
UNKNOWN_TOKENS = SpecialTokens(mask_token_id=None, eos_token_ids=(), pad_token_id=None)


@dataclass(frozen=True)
class ModelArguments:
    """The --model_args of the `dllm_ais` harness model (`DllmAisLM`), each checked for its type, range or choices
    by `parse` before anything loads."""

    pretrained: str = "embedded"
    dtype: str = dataclasses.field(default="auto", metadata={"choices": DTYPES})
    batch_size: int = dataclasses.field(default=1, metadata={"range": "[1, inf)"})
    device: str | None = None
    device_map: str | None = None
    policy: str = dataclasses.field(default="auto", metadata={"choices": POLICIES})
    trust_remote_code: bool = False
    max_length: int | None = dataclasses.field(default=None, metadata={"range": "[1, inf)"})
    seed: int = dataclasses.field(default=DEFAULT_SEED, metadata={"range": "[0, inf)"})
    mc_num: int = dataclasses.field(default=128, metadata={"range": "[1, inf)"})
    mc_batch_size: int | None = dataclasses.field(default=None, metadata={"range": "[1, inf)"})
    is_check_greedy: bool = True
    cfg_scale: float = dataclasses.field(default=0.0, metadata={"range": "[0, inf)"})
    gen_length: int | None = dataclasses.field(default=None, metadata={"range": "[1, inf)"})
    block_length: int = dataclasses.field(default=D1_BLOCK_LENGTH, metadata={"range": "[1, inf)"})
    steps: int | None = dataclasses.field(default=None, metadata={"range": "[1, inf)"})
    remasking: str = "low_confidence"
    cache: str = dataclasses.field(default="none", metadata={"choices": CACHE_MODES})
    threshold: float | None = None
    factor: float | None = None

    @classmethod
    def parse(cls, values: dict[str, Any]) -> "ModelArguments":
        """The arguments `values` (as the harness passes them, converted by `harness_value`); ConfigError, in one
        line, naming every unknown or invalid argument."""
        hints = typing.get_type_hints(cls)
        unknown = [show(name) for name in values if name not in hints]
        if unknown:
            raise ConfigError(f"--model_args: unknown argument {', '.join(unknown)}; the dllm_ais model takes "
                              f"{', '.join(hints)}")
        arguments = cls(**{name: harness_value(hints[name], value) for name, value in values.items()})
        invalid = field_problems(arguments)
        invalid.update({name: [f"{name}={show(values[name])}: pass true or false (or yes/no, on/off, 1/0)"]
                        for name in invalid if hints[name] is bool})
        problems = [problem for found in invalid.values() for problem in found]
        if not problems:
            problems = [found for name, device in arguments.placements() if (found := device_problem(name, device))]
        if problems:
            raise ConfigError(f"--model_args: {'; '.join(problems)}")
        steps = arguments.steps if arguments.gen_length else None  # else fitted to each request's gen_length
        try:
            d1_sampler_config(arguments.gen_length or arguments.block_length, arguments.block_length, UNKNOWN_TOKENS,
                              0.0, **{**arguments.sampler_settings, "steps": steps})
        except ValueError as error:
            raise ConfigError(f"--model_args: {error}") from None
        return arguments

    def placements(self) -> list[tuple[str, str]]:
        """(argument, device) for each device these arguments name that must exist here: device_map unless auto,
        and device unless `cuda_missing` (`available_device` then uses the CPU)."""
        named = [("device_map", self.device_map)] if self.device_map not in (None, "auto") else []
        if self.device is not None and not cuda_missing(self.device):
            named.append(("device", self.device))
        return named

    @property
    def monte_carlo_batch(self) -> int:
        """Copies per forward: mc_batch_size, else min(batch_size, mc_num)."""
        return self.mc_batch_size or min(self.batch_size, self.mc_num)

    @property
    def sampler_settings(self) -> dict[str, Any]:
        """The diffusion sampler's settings among these arguments."""
        return {"steps": self.steps, "remasking": self.remasking, "cfg_scale": float(self.cfg_scale),
                "cache": self.cache, "threshold": self.threshold, "factor": self.factor}


def cuda_missing(device: str) -> bool:
    """Whether `device` asks for CUDA on a machine without it (the harness CLI asks for cuda:0 by default)."""
    return device.startswith("cuda") and not torch.cuda.is_available()


def available_device(device: str | None) -> torch.device:
    """`device` when this machine has it; else (none named, or `cuda_missing`) CUDA when available, else the CPU."""
    if device is not None and not cuda_missing(device):
        return torch.device(device)
    if device is not None:
        logger.warning("device %s is not available here; running on the CPU", device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
