"""The sampler's settings (`DiffusionSamplerConfig`), each checked where it is declared, and the token ids and
family facts one sampling call resolves (`SpecialTokenIds`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from dllm_ais.choices import CACHE_DTYPES, CACHE_MODES, COMMIT_SCHEDULES
from dllm_ais.models.families import is_block_causal, logits_are_shifted
from dllm_ais.rollout import token_id_tuple
from dllm_ais.sampling.diffusion.rules import RemaskingRule, resolve_remasking_rule

__all__ = ["MAX_COMMITS_SCORED_AS_SET", "DiffusionSamplerConfig", "SpecialTokenIds", "pad_equals_mask_problem", "resolve_special_tokens"]


MAX_COMMITS_SCORED_AS_SET = 5
"""The most positions a step may commit when its choice is scored as a set (`committed_set_logprobs` sums over every
order of them: 5! = 120)."""


def pad_equals_mask_problem(pad_token_id: int | None, mask_token_id: int | None) -> str | None:
    """The one-line problem when prompts are padded with the mask id, else None."""
    if pad_token_id is not None and pad_token_id == mask_token_id:
        return (
            f"pad_token_id equals mask_token_id ({mask_token_id}): padded prompt positions would be taken for masked "
            "positions and overwritten. Left-pad prompts with another id (LLaDA pads with its EOS id)."
        )
    return None


@dataclass
class DiffusionSamplerConfig:
    """Settings of the masked-diffusion sampler (LLaDA's `generate` arguments plus the behaviour-policy options).

    Attributes:
        gen_length: completion positions L; a multiple of `block_length`.
        block_length: positions per semi-autoregressive block (and per cache refresh).
        steps: denoising steps (= forward passes without CFG) in all; a multiple of the number of blocks. Unused with
            `threshold` or `factor`, where each block runs until it is filled (but for a block-causal model's floor).
        temperature: τ of the Gumbel-max candidate draw; 0 = greedy.
        remasking: which masked positions to commit: a name in `REMASKING_RULES` ("low_confidence", "random",
            "left_to_right") or a callable ``rule(block_logits, candidates, generator) -> scores`` (higher commits
            first).
        mask_token_id: the model's mask token (126336 for LLaDA-8B); None = ``model.config.mask_token_id``.
        eos_token_ids: tokens ending a completion (its mask runs through the first of them);
            empty = ``model.config.eos_token_id``.
        pad_token_id: the id prompts are left-padded with, checked to differ from the mask id;
            None = ``model.config.pad_token_id``.
        cfg_scale: classifier-free guidance s; logits = u + (s + 1)(c − u) with u from the prompt fully masked.
        cache: block KV cache: "none" (the official algorithm: every step a full forward), "prefix" (later steps of
            a block recompute the block and everything after it) or "dual" (they recompute the block only); the
            other positions' keys/values come from the block's first step. Needs a model whose forward takes
            ``past_key_values``, ``cache_position`` and ``use_cache`` as dllm_ais' LLaDA does.
        cache_refresh_interval: with a cache, also refresh it every this many steps inside a block (1 = every step,
            which is exactly the uncached algorithm); None = only at each block's first step.
        cache_dtype: storage of the cached keys/values while sampling: "none" (the model's dtype) or "fp8" (e4m3 with
            one scale per batch row and head, dequantized when read: dllm_ais.sampling.fp8_cache); `decoder_logits`
            replays with the cache in the model's dtype.
        threshold: parallel decoding: each step commits every still-masked block position whose score (the
            candidate's probability under low_confidence) exceeds τ_c, at least one (Fast-dLLM's rule).
        factor: parallel decoding: each step commits the largest n with (n + 1)(1 − c_(n)) < f, at least one.
            With either rule a block runs until it is filled and the steps taken vary per row.
        schedule: tokens committed per step of a block with the fixed schedule: "even" (LLaDA: the block's masked
            count split evenly over its steps, `transfer_schedule`) or "time_linear" (Dream: ⌊n (1 − t_{i+1}/t_i)⌋
            of the n still masked, t = linspace(1, `schedule_eps`, steps + 1), `time_linear_commit_count`).
            Steps at which no row commits a token run no forward.
        schedule_eps: ε, the last time of the time-linear schedule (Dream's ``eps``, 1e-3).
        top_p, top_k: the tokens a candidate may be drawn from: the top-p nucleus of softmax(logits / τ), then its
            top k (Dream's ``top_p`` / ``top_k``; `filter_top_p_top_k`); 1 and 0 = off. The remasking rule and the
            recorded log-probs see the filtered distribution (what was drawn from); the estimators score the
            unfiltered logits (`scoring_logits`, `decoder_logits`), so the trajectory ratio sees the filter as an
            approximation of the rollout, as TRL and verl score theirs.
        position_temperature: T > 0 makes the commit choice a draw with a recorded probability (the complete
            ratio, docs/algorithms.md): with a fixed count, the positions drawn from softmax(score / T) without
            replacement instead of the top scores (Dream's ``alg_temp``; Plackett–Luce); with `threshold`, each
            masked position committed with probability σ((score − threshold) / T), one drawn from softmax(score / T)
            when none is (`threshold_commits`). The rollout then records `choice_logprobs`, `commit_rank` and
            `discarded_candidates`. 0 = the deterministic rules (top scores; every score above the threshold).
        commit_choice_as_set: with a fixed count and T > 0, the choice's recorded log-probability is its set's
            (`committed_set_logprobs`: the draw order within the step summed out) instead of the drawn order's; at
            most `MAX_COMMITS_SCORED_AS_SET` commits a step, on the even schedule.
        logits_shifted: whether the model's logits at position i − 1 predict position i (Dream);
            None = from ``model.config.model_type`` (`dllm_ais.models.families`).
        block_causal: whether the model attends causally across blocks of ``model.config.block_size`` positions
            (SDAR: module docstring, "Block-causal models"); None = from ``model.config.model_type``.
        completion_length: the completion ends after this many positions (None = `gen_length`): the positions past
            it are decoded with the rest but lie outside ``completion_mask`` (LLaDA2's ``generate`` decodes its last
            block whole past its ``gen_length``: `dllm_ais.decoding_protocols.llada2_generate_settings`).
        stop_at_eos: stop after the first block at whose end every row's completion is final: each position before
            its first stop token (or before `completion_length`) committed (LLaDA2's ``generate`` stops after the
            block holding EOS). The blocks after stay masked, outside ``completion_mask`` (commit_step −1); the
            completion's tokens are those of decoding on, as finished blocks never change. One host read per block.
        editing_threshold: token editing (LLaDA2.1's T2T; None = off): at each step of a block, every filled completion
            position of the block draws a token too and is overwritten by it when it differs and its probability
            exceeds this; a row's block ends on a step that began with no mask and edited nothing, or after
            `max_post_steps` such steps (`dllm_ais.sampling.diffusion.editing`). A block-causal model with
            `threshold` only (the masks commit by the threshold rule meanwhile).
        max_post_steps: with editing, the most steps a row's block runs after its last mask is filled.
        record_routing: record the experts each (position, step, layer) of a mixture-of-experts model used while
            sampling (`Rollout.records["routing"]`: `dllm_ais.sampling.diffusion.routing_record`), which the decoder
            replay (`decoder_logits`) then forces; a block-causal model with its block cache, eager forwards.

    The cache and parallel decoding change the behaviour policy; the recorded log-probs stay those of the
    distribution each token was drawn from, and the correction treats the change like quantization.
    """

    gen_length: int = 256
    block_length: int = 32
    steps: int = 128
    temperature: float = 0.0
    remasking: str | RemaskingRule = "low_confidence"
    mask_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    cfg_scale: float = 0.0
    cache: str = "none"
    cache_refresh_interval: int | None = None
    cache_dtype: str = "none"
    threshold: float | None = None
    factor: float | None = None
    schedule: str = "even"
    schedule_eps: float = 1e-3
    top_p: float = 1.0
    top_k: int = 0
    position_temperature: float = 0.0
    commit_choice_as_set: bool = False
    logits_shifted: bool | None = None
    block_causal: bool | None = None
    completion_length: int | None = None
    stop_at_eos: bool = False
    editing_threshold: float | None = None
    max_post_steps: int = 16
    record_routing: bool = False

    @property
    def steps_per_block(self) -> int:
        """The fixed schedule's steps in each block: steps / (gen_length / block_length), at least 1."""
        return max(self.steps // max(self.gen_length // self.block_length, 1), 1)

    @property
    def max_commits_per_step(self) -> int:
        """The most positions one step of the even schedule commits: ⌈block_length / steps per block⌉."""
        return -(-self.block_length // self.steps_per_block)

    @property
    def parallel_decoding(self) -> bool:
        """True when a parallel-decoding rule (threshold or factor) replaces the fixed step schedule."""
        return self.threshold is not None or self.factor is not None

    def refreshes_cache(self, step_in_block: int) -> bool:
        """Whether the block cache is rebuilt at this forward of a block (0 = its first): at the first, and every
        `cache_refresh_interval` forwards after it (a step that commits nothing runs none)."""
        interval = self.cache_refresh_interval
        return step_in_block == 0 or (interval is not None and step_in_block % interval == 0)

    def exact(self) -> "DiffusionSamplerConfig":
        """These settings without the approximations: no cache, no parallel commits (the fixed schedule of `steps`),
        and so no token editing (`editing_threshold` None), which edits only beside the threshold rule."""
        return dataclasses.replace(self, cache="none", cache_refresh_interval=None, cache_dtype="none", threshold=None,
                                   factor=None, editing_threshold=None)

    def __post_init__(self) -> None:
        self.eos_token_ids = token_id_tuple(self.eos_token_ids)
        problems = [
            f"{name}={value} must be a positive integer"
            for name, value in (("gen_length", self.gen_length), ("block_length", self.block_length), ("steps", self.steps))
            if value <= 0
        ]
        if not problems and self.gen_length % self.block_length:
            problems.append(
                f"gen_length={self.gen_length} is not a multiple of block_length={self.block_length}: "
                "choose a block_length that divides gen_length"
            )
        if not problems and not self.parallel_decoding and self.steps % (self.gen_length // self.block_length):
            n_blocks = self.gen_length // self.block_length
            problems.append(
                f"steps={self.steps} is not a multiple of the number of blocks gen_length/block_length={n_blocks}: "
                f"use e.g. steps={max(n_blocks, self.steps // n_blocks * n_blocks)} or {(self.steps // n_blocks + 1) * n_blocks}"
            )
        if self.temperature < 0:
            problems.append(f"temperature={self.temperature} must be >= 0 (0 = greedy decoding)")
        if self.cfg_scale < 0:
            problems.append(f"cfg_scale={self.cfg_scale} must be >= 0 (0 = no classifier-free guidance)")
        if self.cache not in CACHE_MODES:
            problems.append(f"cache={self.cache!r}: choose one of {', '.join(CACHE_MODES)}")
        if self.cache_refresh_interval is not None and (
            isinstance(self.cache_refresh_interval, bool) or not isinstance(self.cache_refresh_interval, int)
            or self.cache_refresh_interval < 1
        ):
            problems.append(f"cache_refresh_interval={self.cache_refresh_interval!r} must be a positive int or None")
        if self.cache_dtype not in CACHE_DTYPES:
            problems.append(f"cache_dtype={self.cache_dtype!r}: choose one of {', '.join(CACHE_DTYPES)}")
        elif self.cache_dtype != "none" and self.cache == "none":
            problems.append(f"cache_dtype={self.cache_dtype!r} stores the block KV cache: set cache to prefix or dual")
        if self.threshold is not None and self.factor is not None:
            problems.append("threshold and factor are two parallel-decoding rules: set one of them")
        if self.threshold is not None and not 0 <= self.threshold <= 1:
            problems.append(f"threshold={self.threshold} must be a confidence in [0, 1] (Fast-dLLM uses 0.9)")
        if self.factor is not None and not (math.isfinite(self.factor) and self.factor > 0):
            problems.append(f"factor={self.factor} must be a finite number > 0 (Fast-dLLM uses 1.0)")
        if self.schedule not in COMMIT_SCHEDULES:
            problems.append(f"schedule={self.schedule!r}: choose one of {', '.join(COMMIT_SCHEDULES)}")
        if not 0 < self.schedule_eps < 1:
            problems.append(f"schedule_eps={self.schedule_eps} must be in (0, 1) (Dream uses 1e-3)")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p={self.top_p} must be in (0, 1] (1 = off)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            problems.append(f"top_k={self.top_k!r} must be an integer >= 0 (0 = off)")
        if not (math.isfinite(self.position_temperature) and self.position_temperature >= 0):
            problems.append(f"position_temperature={self.position_temperature} must be >= 0 (0 = top scores)")
        if self.commit_choice_as_set and not (self.position_temperature > 0 and not self.parallel_decoding
                                              and self.schedule == "even"
                                              and self.max_commits_per_step <= MAX_COMMITS_SCORED_AS_SET):
            problems.append("commit_choice_as_set scores a fixed count's drawn positions as a set: it needs "
                            "position_temperature > 0, no threshold or factor, the even schedule and at most "
                            f"{MAX_COMMITS_SCORED_AS_SET} commits a step (block_length / steps per block)")
        if self.remasking == "top_log_odds" and self.parallel_decoding:
            problems.append("remasking='top_log_odds' scores log-odds, which a threshold or factor on a confidence in "
                            "[0, 1] does not read: use top_probability with parallel decoding")
        if self.remasking == "origin":
            if self.parallel_decoding:
                problems.append("remasking='origin' commits a random number of positions per step: it takes no "
                                "threshold or factor")
            if self.cache_refresh_interval is not None:
                problems.append("remasking='origin' may commit nothing in a row for several steps, which a cache "
                                "refreshed every cache_refresh_interval steps cannot replay: leave the interval unset")
        if self.completion_length is not None and not (
                isinstance(self.completion_length, int) and not isinstance(self.completion_length, bool)
                and 0 < self.completion_length <= self.gen_length):
            problems.append(f"completion_length={self.completion_length!r} must be an int in [1, gen_length="
                            f"{self.gen_length}] (None = gen_length)")
        problems.extend(self.editing_problems())
        pad_problem = pad_equals_mask_problem(self.pad_token_id, self.mask_token_id)
        if pad_problem:
            problems.append(pad_problem)
        if self.block_causal:
            problems.extend(self.block_causal_problems())
        if problems:
            raise ValueError("Invalid DiffusionSamplerConfig: " + "; ".join(problems) + ".")
        resolve_remasking_rule(self.remasking)

    def editing_problems(self) -> list[str]:
        """What token editing (`editing_threshold`) does not take."""
        if self.editing_threshold is None:
            return []
        problems = []
        if isinstance(self.editing_threshold, bool) or not 0 <= self.editing_threshold <= 1:
            problems.append(f"editing_threshold={self.editing_threshold!r} must be a probability in [0, 1] (LLaDA2.1 "
                            "uses 0.5 in its quality mode; None = no editing)")
        if isinstance(self.max_post_steps, bool) or not isinstance(self.max_post_steps, int) or self.max_post_steps < 0:
            problems.append(f"max_post_steps={self.max_post_steps!r} must be an int >= 0")
        if self.threshold is None:
            problems.append("editing_threshold edits while the threshold rule fills the masks: set threshold too "
                            "(LLaDA2.1 uses 0.7)")
        if self.position_temperature > 0:
            problems.append("editing_threshold with position_temperature > 0: a drawn commit choice is not defined "
                            "for edits")
        if self.block_causal is False:
            problems.append("editing_threshold needs a block-causal model (LLaDA2.1), whose finished blocks are "
                            "never re-read from a cache that an edit would make stale")
        return problems

    def block_causal_problems(self) -> list[str]:
        """The settings a block-causal model's decoding does not take (module docstring, "Block-causal models")."""
        problems = []
        if self.cfg_scale > 0:
            problems.append("cfg_scale > 0: classifier-free guidance is not defined for a block-causal model")
        if self.cache_dtype != "none":
            problems.append(f"cache_dtype={self.cache_dtype!r}: a block-causal model's cache of finished blocks is "
                            "kept in the model's dtype")
        if self.cache_refresh_interval is not None:
            problems.append("cache_refresh_interval: a block-causal model's cache is exact and never refreshed")
        if self.threshold is not None and self.position_temperature > 0:
            problems.append("threshold with position_temperature > 0 is not implemented for a block-causal model")
        n_blocks = self.gen_length // self.block_length
        if self.parallel_decoding and self.steps % n_blocks:
            problems.append(f"steps={self.steps} is not a multiple of the number of blocks {n_blocks}: a block-causal "
                            "model's parallel decoding commits at least the per-block schedule of steps / blocks steps")
        return problems


@dataclass(frozen=True)
class SpecialTokenIds:
    """The token ids a sampling run uses, resolved from the sampler config with the model config as fallback, and
    whether the model's logits at position i − 1 predict position i (`logits_shifted`, Dream) and whether it attends
    causally across blocks (`block_causal`, SDAR)."""

    mask: int
    eos: tuple[int, ...]
    logits_shifted: bool = False
    block_causal: bool = False


def resolve_special_tokens(config: "DiffusionSamplerConfig", model: Any) -> SpecialTokenIds:
    """Mask and EOS ids of a sampling call from the sampler `config`, falling back to ``model.config``; raises when they are missing
    or when the pad id (config, else model config) equals the mask id."""
    model_config = getattr(model, "config", None)
    mask = config.mask_token_id
    if mask is None:
        mask = getattr(model_config, "mask_token_id", None)
    if mask is None:
        raise ValueError(
            "No mask token id: set DiffusionSamplerConfig(mask_token_id=...) (126336 for LLaDA-8B) "
            "or model.config.mask_token_id."
        )
    eos = config.eos_token_ids or token_id_tuple(getattr(model_config, "eos_token_id", None))
    if not eos:
        raise ValueError(
            "No EOS token id, so completions could not be cut at their end: set "
            "DiffusionSamplerConfig(eos_token_ids=(...)) or model.config.eos_token_id."
        )
    pad = config.pad_token_id
    if pad is None:
        pad = getattr(model_config, "pad_token_id", None)
    pad_problem = pad_equals_mask_problem(pad, mask)
    if pad_problem:
        raise ValueError(pad_problem)
    shifted = config.logits_shifted
    block_causal = is_block_causal(model) if config.block_causal is None else config.block_causal
    if config.editing_threshold is not None and not block_causal:
        raise ValueError("editing_threshold (token editing) needs a block-causal model such as LLaDA2.1; "
                         f"{type(model).__name__} is not one: leave editing_threshold unset.")
    if block_causal:
        block_size = getattr(model_config, "block_size", None)
        problems = config.block_causal_problems()
        if block_size is not None and block_size != config.block_length:
            problems.append(f"block_length={config.block_length} differs from the model's block_size="
                            f"{block_size}: set rollout.block_length to {block_size}")
        if problems:
            raise ValueError("This sampler cannot decode a block-causal model: " + "; ".join(problems) + ".")
    return SpecialTokenIds(mask=int(mask), eos=eos,
                           logits_shifted=logits_are_shifted(model) if shifted is None else shifted,
                           block_causal=block_causal)
