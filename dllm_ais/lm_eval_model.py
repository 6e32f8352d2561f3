"""lm-evaluation-harness model `dllm_ais`: any benchmark of the harness on any model this library trains.

Importing this module registers the model (it needs the `lm-eval` extra: ``pip install "dllm-ais[lm-eval]"``)::

    dllm-ais lm-eval --model_args pretrained=outputs/dllm-ais/final --tasks arc_easy,gsm8k --batch_size 8
    accelerate launch -m dllm_ais.cli lm-eval --model_args pretrained=GSAI-ML/LLaDA-8B-Instruct --tasks mmlu

Masked-diffusion models (LLaDA):

- `loglikelihood` is LLaDA's evaluation estimate (the `get_loglikelihood` of its harness class, eval_llada.py): the
  Monte-Carlo lower bound on log p(continuation | context) over `mc_num` masked copies of the sequence, scored
  `mc_batch_size` at a time; in each batch of b copies the numbers of masked continuation tokens are stratified,
  n_i = ((k + i·L/b rounded − 1) mod L) + 1 with k ~ U{1, …, L}, each at positions drawn uniformly, and a copy
  contributes (L / n_i) Σ_{masked j} log p_θ(x_j | x̃) (`llada_mask_draw`, `diffusion_loglikelihood`). Its greedy
  flag is LLaDA's check: our exact sampler, one token per step by confidence, reproduces the continuation.
- `generate_until` decodes with `MaskedDiffusionSampler`: d1's protocol by default (greedy, low-confidence remasking,
  blocks of 32, gen_length / 2 steps, no cache), gen_length = `max_gen_toks` rounded up to a whole block, the text cut
  at `max_gen_toks` tokens, its first EOS and the first `until` string.
- `loglikelihood_rolling` (perplexity tasks) is refused: there is no left-to-right factorisation to roll.

Block-diffusion models (SDAR, LLaDA2: `families.is_block_causal`) take the same paths in their own blocks:

- `loglikelihood` is the same Monte-Carlo estimate with the same draws, each masked token scored with its own block
  noisy and the blocks before it clean (`likelihood.noisy_canvas_logits`, the training-mode forward): with the 1/t
  weight, SDAR's block-diffusion ELBO, its own training loss — not an autoregressive score, which SDAR (bidirectional
  inside a block) does not define. The greedy flag: SDAR's decoder, one token per step by confidence in blocks of
  ``block_size`` (the continuation's length rounded up to whole blocks), reproduces the continuation.
- `generate_until` decodes with the family's own protocol (`config.with_sdar_protocol`: blocks of the model's
  ``block_size``, a step per block position, low_confidence_dynamic at 0.9 for SDAR and 0.95 for LLaDA2
  (`config.block_protocol_of`), the exact cache), any sampler setting
  given in --model_args replacing its value; a block_length other than ``block_size`` is refused.

Causal LMs (Qwen3, ...): teacher-forced log-probs and greedy flags as the harness's `hf` model computes them, and
generation with `AutoregressiveSampler` (model.generation_config's EOS ids, as `generate` uses).

Differences from LLaDA's class: every request draws its masks from a generator seeded with `seed` (LLaDA's class draws
from one global stream), so a request scores the same whatever its rank, batch or order, and the choices of a question
share their masks where their lengths agree; log-probs are float32 log-softmax (LLaDA's `cross_entropy` runs in the
logits' dtype), and so are the greedy check's confidences (LLaDA's: float32); the prompt of a long request is cut from
the left to fit `max_length` instead of failing.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text,
                                  resolve_max_length)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string
from torch import Tensor, nn
from tqdm.auto import tqdm

from dllm_ais.choices import CACHE_MODES
from dllm_ais.config import DTYPES, POLICIES, GRPOConfig, block_protocol_of, with_d1_protocol, with_sdar_protocol
from dllm_ais.data import apply_chat_template
from dllm_ais.statistics import standard_error
from dllm_ais.likelihood import (
    LogitsFn,
    MaskDraw,
    causal_position_ids,
    elbo_from_draws,
    mask_generator,
    masked_completion_logprobs,
    plain_logits,
    selective_log_softmax,
)
from dllm_ais.loading import (SpecialTokens, adapter_base, load_model, load_tokenizer, refuse_remote_code,
                              resolve_dtype, resolve_model_path, special_tokens)
from dllm_ais.models.families import is_block_causal
from dllm_ais.policy import diffusion_sampler_config, is_diffusion
from dllm_ais.sampling.autoregressive import AutoregressiveSampler, AutoregressiveSamplerConfig
from dllm_ais.sampling.diffusion import DiffusionSamplerConfig, MaskedDiffusionSampler
from dllm_ais.validation import ConfigError, field_problems, show

logger = logging.getLogger(__name__)
MODEL_NAME = "dllm_ais"
DEFAULT_SEED = 1234  # eval_llada.py's set_seed
DEFAULT_MAX_LENGTH = 2048  # the harness's `hf` default when the config names no context length
D1_BLOCK_LENGTH = 32


# --------------------------------------------------------------------------------------------- diffusion likelihood


@dataclass(frozen=True)
class LikelihoodEstimate:
    """A Monte-Carlo estimate of log p(continuation | context): its value (the mean of `num_samples` per-copy values)
    and standard error s_b / √B over the B = num_samples / batch_size batch means (each an independent unbiased
    estimate; NaN for a single batch)."""

    value: float
    standard_error: float
    num_samples: int


def llada_mask_draw(gen_length: int, batch: int, generator: torch.Generator) -> MaskDraw:
    """One batch of LLaDA's evaluation forward process over a continuation of L = `gen_length` tokens.

    k ~ U{1, …, L}; copy i ∈ [0, b) masks n_i = ((round(k + i·L/b) − 1) mod L) + 1 tokens — stratified counts
    spread over 1..L — at the positions j with σ_i(j) < n_i, σ_i a uniform permutation; its rate is t_i = n_i / L.
    Draws from `generator`: randint for k, then one randperm(L) per copy (eval_llada.py's `_forward_process`, in its
    order).
    """
    start = torch.randint(1, gen_length + 1, (), generator=generator)
    counts = torch.round(torch.linspace(float(start), start + (batch - 1) * (gen_length / batch), steps=batch)).long()
    counts = (counts - 1) % gen_length + 1
    permutations = torch.stack([torch.randperm(gen_length, generator=generator) for _ in range(batch)])
    return MaskDraw(masked=permutations < counts.unsqueeze(1), rate=counts.float() / gen_length)


def check_monte_carlo_sizes(num_samples: int, batch_size: int) -> None:
    """Raise ConfigError unless the number of copies is a positive multiple of the Monte-Carlo batch."""
    if num_samples < 1 or batch_size < 1 or num_samples % batch_size:
        raise ConfigError(f"mc_num={num_samples} must be a positive multiple of mc_batch_size={batch_size} "
                          "(--model_args)")


@torch.no_grad()
def diffusion_loglikelihood(model: nn.Module, context: Tensor, continuation: Tensor, mask_token_id: int,
                            num_samples: int, batch_size: int, generator: torch.Generator,
                            logits_fn: LogitsFn = plain_logits) -> LikelihoodEstimate:
    """LLaDA's Monte-Carlo estimate of log p(continuation | context) for 1-D token tensors: the mean over
    `num_samples` copies of (1 / t) Σ_{masked j} log softmax(f(x̃)_j)[x_j], drawn `batch_size` at a time by
    `llada_mask_draw` (one forward per batch; the context is never masked), scored by `logits_fn`."""
    check_monte_carlo_sizes(num_samples, batch_size)
    sequence = torch.cat([context, continuation]).unsqueeze(0).expand(batch_size, -1)
    attention_mask = torch.ones_like(sequence)
    batch_means = []
    for _ in range(num_samples // batch_size):
        draw = llada_mask_draw(len(continuation), batch_size, generator)
        logprobs = masked_completion_logprobs(model, sequence, attention_mask, len(context), mask_token_id,
                                              draw.masked, logits_fn=logits_fn)
        batch_means.append(elbo_from_draws([logprobs], [draw]).mean())
    means = torch.stack(batch_means).cpu()
    return LikelihoodEstimate(means.mean().item(), standard_error(means), num_samples)


# --------------------------------------------------------------------------------------------- causal likelihood


def left_padded(rows: list[list[int]], pad_token_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Token-id lists as one left-padded [B, max length] batch and its attention mask (1 on real tokens)."""
    width = max(map(len, rows))
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for index, row in enumerate(rows):
        input_ids[index, width - len(row):] = torch.tensor(row, dtype=torch.long)
        attention_mask[index, width - len(row):] = 1
    return input_ids.to(device), attention_mask.to(device)


@torch.no_grad()
def causal_continuation_scores(model: nn.Module, rows: list[list[int]], continuation_lengths: list[int],
                               pad_token_id: int) -> list[tuple[float, bool]]:
    """Per row x (a context followed by its last c tokens, the continuation): Σ_{j in the continuation}
    log softmax(f(x_<j))[x_j] and whether every x_j is the argmax, as the harness's `hf` model scores it: the rows
    without their last token run as one left-padded forward (position ids = cumsum(attention mask) − 1), its LM head
    on the last max(c) positions only."""
    device = next(model.parameters()).device
    input_ids, attention_mask = left_padded([row[:-1] for row in rows], pad_token_id, device)
    next_ids, _ = left_padded([row[1:] for row in rows], pad_token_id, device)
    scored = max(continuation_lengths)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=causal_position_ids(attention_mask),
                   use_cache=False, logits_to_keep=scored).logits
    targets = next_ids[:, -scored:]
    logprobs = selective_log_softmax(logits, targets)
    lengths = torch.tensor(continuation_lengths, device=device).unsqueeze(1)
    in_continuation = torch.arange(scored, device=device) >= scored - lengths
    totals = torch.where(in_continuation, logprobs, 0.0).sum(dim=1)
    greedy = ((logits.argmax(dim=-1) == targets) | ~in_continuation).all(dim=1)
    return list(zip(totals.tolist(), greedy.tolist()))


# --------------------------------------------------------------------------------------------- generation


def protocol_sampler_config(protocol: GRPOConfig, tokens: SpecialTokens, temperature: float,
                            **settings: Any) -> DiffusionSamplerConfig:
    """The sampler a protocol's config decodes with at `temperature`, with the model's special tokens and any sampler
    `settings` that are not None (steps, remasking, cfg_scale, cache, threshold, factor, ...) replaced."""
    chosen = {key: value for key, value in settings.items() if value is not None}
    return dataclasses.replace(diffusion_sampler_config(protocol, tokens, temperature), **chosen)


def d1_sampler_config(gen_length: int, block_length: int, tokens: SpecialTokens, temperature: float,
                      **settings: Any) -> DiffusionSamplerConfig:
    """The sampler of d1's protocol at `gen_length` (`with_d1_protocol`: blocks of min(block_length, gen_length),
    gen_length / 2 steps, low-confidence remasking, no cache, no guidance), see `protocol_sampler_config`."""
    return protocol_sampler_config(with_d1_protocol(GRPOConfig(policy="diffusion"), gen_length, block_length), tokens,
                                   temperature, **settings)


def sdar_sampler_config(gen_length: int, block_size: int, tokens: SpecialTokens, temperature: float,
                        protocol: str = "sdar", **settings: Any) -> DiffusionSamplerConfig:
    """The sampler of a block-diffusion family's protocol at `gen_length` (`with_sdar_protocol`: blocks of the
    model's `block_size`, a step per block position, low_confidence_dynamic at 0.9 for SDAR's, 0.95 for `protocol`
    "llada2", the exact cache), see `protocol_sampler_config`."""
    return protocol_sampler_config(with_sdar_protocol(GRPOConfig(policy="diffusion"), gen_length, block_size, protocol),
                                   tokens, temperature, **settings)


def completion_text(tokenizer, completion_ids: Tensor, completion_mask: Tensor, max_tokens: int,
                    until: list[str]) -> str:
    """The text of one completion: its tokens through the first EOS (`completion_mask`) and at most `max_tokens`,
    decoded without special tokens, cut before the first of the `until` strings."""
    tokens = completion_ids[completion_mask.bool()][:max_tokens]
    return postprocess_generated_text(tokenizer.decode(tokens, skip_special_tokens=True), until, None)


def _grouped_by_kwargs(requests: list) -> dict[str, list[int]]:
    """Request indices grouped by their generation kwargs (one sampler per group)."""
    groups: dict[str, list[int]] = {}
    for index, request in enumerate(requests):
        groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(index)
    return groups


def _batches(indices: list[int], size: int) -> list[list[int]]:
    return [indices[start:start + size] for start in range(0, len(indices), size)]


# --------------------------------------------------------------------------------------------- the harness model


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


@register_model(MODEL_NAME)
class DllmAisLM(TemplateLM):
    """The harness model: a local path, Hub id, `embedded*` name, LoRA adapter directory or merged export
    (`pretrained`), scored and sampled by this library's estimators and samplers (see the module docstring).

    Arguments (``--model_args key=value,...``): dtype (auto = bf16 on CUDA, fp32 on CPU), batch_size (requests per
    forward; also the Monte-Carlo batch unless mc_batch_size), device, device_map ("auto" spreads the model over the
    visible GPUs), policy (auto | diffusion | autoregressive), trust_remote_code, max_length, seed. Diffusion only:
    mc_num (Monte-Carlo copies, LLaDA's default 128), mc_batch_size, is_check_greedy, cfg_scale, gen_length (default:
    max_gen_toks rounded up to a block), block_length (32), steps (gen_length / 2), remasking, cache, threshold,
    factor. Each is checked before anything loads (`ModelArguments`); trust_remote_code=true alone lets a model's own
    code run (`dllm_ais.loading.refuse_remote_code`). Under ``accelerate launch`` each process takes its share of the
    requests on its own device.
    """

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any],
                            additional_config: dict[str, Any] | None = None) -> "DllmAisLM":
        """The model of the --model_args `arg_dict` and the harness's own settings `additional_config` (batch_size,
        device, max_batch_size: passed with the harness's defaults even when not typed); an argument in --model_args
        wins over the harness's (the harness would pass it twice, a TypeError)."""
        harness = {name: value for name, value in (additional_config or {}).items()
                   if value is not None and name not in arg_dict}
        return cls(**arg_dict, **harness)

    @classmethod
    def create_from_arg_string(cls, arg_string: str,
                               additional_config: dict[str, Any] | None = None) -> "DllmAisLM":
        """`create_from_arg_obj` of the --model_args string `key=value,...`."""
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    def __init__(self, **model_args: Any) -> None:
        super().__init__()
        from accelerate import PartialState

        arguments = ModelArguments.parse(model_args)  # every argument checked before anything loads
        state = PartialState(cpu=not torch.cuda.is_available())  # several processes: GPUs, else gloo on CPUs
        self._rank, self._world_size = state.process_index, state.num_processes
        self._device = state.device if self._world_size > 1 else available_device(arguments.device)
        pretrained, trust_remote_code = arguments.pretrained, arguments.trust_remote_code
        refuse_remote_code(pretrained, trust_remote_code)
        self.tokenizer = load_tokenizer(tokenizer_source(pretrained), trust_remote_code)
        model = load_model(pretrained, resolve_dtype(arguments.dtype), trust_remote_code).eval()
        self.model = self._placed(model, arguments.device_map)
        self.diffusion = is_diffusion(arguments.policy, self.model.config.model_type)
        self.tokens = special_tokens(self.tokenizer, self.model.config, self.diffusion)
        config = self.model.config
        self._max_length = arguments.max_length or getattr(config, "max_sequence_length", None) or resolve_max_length(
            config, self.tokenizer, default=DEFAULT_MAX_LENGTH)
        self.batch_size, self.seed = arguments.batch_size, arguments.seed
        self.mc_num, self.mc_batch_size = arguments.mc_num, arguments.monte_carlo_batch
        self.is_check_greedy = arguments.is_check_greedy
        self.gen_length, self.block_length = arguments.gen_length, arguments.block_length
        self.sampler_settings = arguments.sampler_settings
        self.block_size = config.block_size if self.diffusion and is_block_causal(self.model) else None
        self.block_protocol = block_protocol_of(config.model_type)
        if self.block_size is not None:  # its family's protocol, each setting given in model_args replacing its own
            if "block_length" in model_args and arguments.block_length != self.block_size:
                raise ConfigError(f"--model_args block_length={arguments.block_length}: this block-diffusion model "
                                  f"decodes in its blocks of block_size={self.block_size}; leave block_length unset")
            self.block_length = self.block_size
            self.sampler_settings = {name: value for name, value in arguments.sampler_settings.items()
                                     if name in model_args}
        if self.diffusion:
            check_monte_carlo_sizes(self.mc_num, self.mc_batch_size)

    def _placed(self, model: nn.Module, device_map: str | None) -> nn.Module:
        """The model on this process's device, or spread over the visible GPUs by accelerate (`device_map="auto"`)."""
        if device_map is None or self._world_size > 1:
            return model.to(self._device)
        if device_map != "auto":
            self._device = torch.device(device_map)
            return model.to(self._device)
        from accelerate import dispatch_model, infer_auto_device_map

        placement = infer_auto_device_map(model, no_split_module_classes=getattr(model, "_no_split_modules", None))
        self._device = torch.device(next(iter(placement.values())) if placement else "cpu")
        return dispatch_model(model, placement) if len(set(placement.values())) > 1 else model.to(self._device)

    # ---------------------------------------------------------------- what the harness asks of a model

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """The context of a request without one: BOS, else EOS (as the `hf` model)."""
        return self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return apply_chat_template(self.tokenizer, chat_history, add_generation_prompt)

    def all_gather(self, tensor: Tensor) -> Tensor:
        from accelerate.utils import gather

        return gather(tensor) if self._world_size > 1 else tensor

    def gather_object(self, obj, dst: int = 0):
        if self._world_size == 1:
            return [obj]
        gathered = [None] * self._world_size if self._rank == dst else None
        torch.distributed.gather_object(obj, gathered, dst=dst)
        return gathered

    def barrier(self) -> None:
        if self._world_size > 1:
            torch.distributed.barrier()

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """Token ids of `string`, special tokens as the tokenizer adds them unless told (none when the text already
        starts with the prefix token's text), as the `hf` model encodes."""
        if add_special_tokens is None and string.startswith(self.tokenizer.decode(self.prefix_token_id)):
            add_special_tokens = False
        options = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        return self.tokenizer.encode(string, **options)

    # ---------------------------------------------------------------- likelihoods

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(log p(continuation | context), greedy) per ((context, continuation), context ids, continuation ids)."""
        score = self._diffusion_scores if self.diffusion else self._causal_scores
        results = score(requests, disable_tqdm or self._rank != 0)
        for (request, _, _), result in zip(requests, results):
            if request is not None:
                self.cache_hook.add_partial("loglikelihood", request, result)
        return results

    def _causal_scores(self, requests, disable_tqdm: bool) -> list[tuple[float, bool]]:
        """Causal scores in batches of `batch_size`, longest first, each row cut from the left to its last
        max_length + 1 tokens (the `hf` model's window: max_length inputs)."""
        rows = [(context + continuation)[-(self.max_length + 1):] for _, context, continuation in requests]
        lengths = [len(continuation) for _, _, continuation in requests]
        order = sorted(range(len(rows)), key=lambda index: -len(rows[index]))
        results: list[tuple[float, bool] | None] = [None] * len(rows)
        for batch in tqdm(_batches(order, self.batch_size), desc="loglikelihood", disable=disable_tqdm):
            scores = causal_continuation_scores(self.model, [rows[i] for i in batch], [lengths[i] for i in batch],
                                                self.tokens.pad_token_id)
            for index, result in zip(batch, scores):
                results[index] = result
        return results

    def _diffusion_scores(self, requests, disable_tqdm: bool) -> list[tuple[float, bool]]:
        """`diffusion_loglikelihood` and LLaDA's greedy check per request; the context is cut from the left so that
        the sequence fits `max_length`."""
        results = []
        for _, context, continuation in tqdm(requests, desc="loglikelihood", disable=disable_tqdm):
            if len(continuation) >= self.max_length:
                raise ConfigError(f"a continuation of {len(continuation)} tokens does not fit max_length="
                                  f"{self.max_length}; raise max_length (model_args) if the model allows it")
            context = context[-(self.max_length - len(continuation)):]
            estimate = self.estimate_loglikelihood(context, continuation)
            results.append((estimate.value, self.is_check_greedy and self.greedy_reproduces(context, continuation)))
        return results

    def _scorer(self, continuation_length: int) -> MaskedDiffusionSampler:
        """The exact greedy sampler over a continuation of this length, one token per step (LLaDA's greedy check);
        its `scoring_logits` are the logits the estimate scores (with guidance when cfg_scale > 0). A block-diffusion
        model's: SDAR's decoder without the dynamic rule, over the length rounded up to whole blocks."""
        if self.block_size is not None:
            gen_length = -(-continuation_length // self.block_size) * self.block_size
            return MaskedDiffusionSampler(sdar_sampler_config(gen_length, self.block_size, self.tokens, 0.0).exact())
        settings = {**self.sampler_settings, "steps": continuation_length, "remasking": "low_confidence",
                    "cache": "none", "threshold": None, "factor": None}
        return MaskedDiffusionSampler(d1_sampler_config(continuation_length, continuation_length, self.tokens, 0.0,
                                                        **settings))

    def estimate_loglikelihood(self, context: list[int], continuation: list[int]) -> LikelihoodEstimate:
        """`diffusion_loglikelihood` of one request with `mc_num` copies in batches of `mc_batch_size`, its masks drawn
        from `mask_generator(seed)` (a block-diffusion model scores through its training-mode forward, which takes no
        sampler logits)."""
        logits_fn = plain_logits if self.block_size is not None else self._scorer(len(continuation)).scoring_logits
        return diffusion_loglikelihood(self.model, torch.tensor(context, device=self._device),
                                       torch.tensor(continuation, device=self._device), self.tokens.mask_token_id,
                                       self.mc_num, self.mc_batch_size, mask_generator(self.seed), logits_fn)

    def greedy_reproduces(self, context: list[int], continuation: list[int]) -> bool:
        """Whether greedy decoding from the context, one token per step at the most confident masked position,
        yields exactly the continuation (LLaDA's `suffix_greedy_prediction`) as its first tokens."""
        prompt = torch.tensor([context], device=self._device)
        rollout = self._scorer(len(continuation)).sample(self.model, prompt)
        return rollout.completion_ids[0, :len(continuation)].tolist() == list(continuation)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """log p(text) of whole texts (perplexity tasks), causal LMs only: the `hf` model's disjoint rolling windows
        of max_length tokens, each scored given the tokens before it."""
        if self.diffusion:
            raise NotImplementedError("loglikelihood_rolling (perplexity tasks such as wikitext) needs a left-to-right "
                                      "factorisation that a masked-diffusion model does not have; run loglikelihood or "
                                      "generation tasks with this model, or an autoregressive model")
        totals = []
        for (text,) in tqdm([request.args for request in requests], desc="loglikelihood_rolling",
                            disable=disable_tqdm or self._rank != 0):
            windows = [(None, *make_disjoint_window(window)) for window in get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                context_len=1)]
            total = sum(value for value, _ in self._loglikelihood_tokens(windows, disable_tqdm=True))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            totals.append(total)
        return totals

    # ---------------------------------------------------------------- generation

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Completions of each request's context: batches of `batch_size` requests sharing generation kwargs, each
        decoded by this model's sampler and cut at `max_gen_toks` tokens, the first EOS and the first `until` string
        (the decoded EOS among them)."""
        outputs: list[str | None] = [None] * len(requests)
        generator = torch.Generator(self._device).manual_seed(self.seed)
        eos_text = self.tokenizer.decode(self.eot_token_id)
        progress = tqdm(total=len(requests), desc="generate_until", disable=disable_tqdm or self._rank != 0)
        for indices in _grouped_by_kwargs(requests).values():
            kwargs = dict(normalize_gen_kwargs(requests[indices[0]].args[1], 256))
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            max_tokens = kwargs.pop("max_gen_toks")
            sampler, gen_length = self._generation_sampler(max_tokens, kwargs)
            for batch in _batches(indices, self.batch_size):
                input_ids, attention_mask = self._encode_prompts([requests[i].args[0] for i in batch], gen_length)
                rollout = sampler.sample(self.model, input_ids, attention_mask, generator)
                for row, index in enumerate(batch):
                    outputs[index] = completion_text(self.tokenizer, rollout.completion_ids[row],
                                                     rollout.completion_mask[row], max_tokens, until)
                    self.cache_hook.add_partial("generate_until", requests[index].args, outputs[index])
                progress.update(len(batch))
        progress.close()
        return outputs

    def _generation_sampler(self, max_tokens: int, kwargs: dict[str, Any]):
        """(sampler, completion length) for requests of these normalised generation kwargs (`do_sample`,
        `temperature`, and for causal LMs `top_k` / `top_p`)."""
        if not self.diffusion:
            config = AutoregressiveSamplerConfig.from_generation_kwargs(
                max_new_tokens=max_tokens, pad_token_id=self.tokens.pad_token_id, **kwargs)
            return AutoregressiveSampler(config), max_tokens
        do_sample, temperature = kwargs.pop("do_sample", False), float(kwargs.pop("temperature", 0.0))
        if kwargs:
            raise ConfigError(f"generation kwargs {sorted(kwargs)} have no meaning for the masked-diffusion sampler; "
                              "set its settings (block_length, steps, remasking, ...) in --model_args instead")
        block, temperature = self.block_length, temperature if do_sample else 0.0
        gen_length = self.gen_length or -(-max_tokens // block) * block
        if self.block_size is not None:
            config = sdar_sampler_config(gen_length, block, self.tokens, temperature, self.block_protocol,
                                         **self.sampler_settings)
            return MaskedDiffusionSampler(config), gen_length
        steps = self.sampler_settings["steps"] or max(gen_length // 2, 1)
        settings = {**self.sampler_settings, "steps": steps}
        config = d1_sampler_config(gen_length, block, self.tokens, temperature, **settings)
        return MaskedDiffusionSampler(config), gen_length

    def _encode_prompts(self, contexts: list[str], gen_length: int) -> tuple[Tensor, Tensor]:
        """Left-padded token ids and attention mask of `contexts`, each cut from the left to leave `gen_length`
        positions within max_length."""
        budget = self.max_length - gen_length
        if budget < 1:
            raise ConfigError(f"{gen_length} generated tokens leave no room for a prompt within max_length="
                              f"{self.max_length}; lower max_gen_toks (--gen_kwargs) or gen_length")
        return left_padded([self.tok_encode(context)[-budget:] for context in contexts], self.tokens.pad_token_id,
                           self._device)

