"""The one seam between diffusion and autoregressive policies: how to sample, and how to score a rollout.

Everything downstream — rewards, correction, loss, metrics, the trainer loop — sees only a `Rollout` and
per-token log-probs [B, L], so both policy families share one correction path.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol

import torch
from torch import nn

from dllm_ais.choices import (SEQUENCE_ESTIMATORS, TRAJECTORY_ESTIMATORS, block_fraction_problem,
                              editing_estimator_problem, editing_family_problem, replays_decoder)
from dllm_ais.data import tokenize_prompts
from dllm_ais.likelihood import (
    DIFFUSION_ESTIMATORS, BlockSubset, BoundSettings, EstimatorSettings, LogprobPiece, causal_logprobs,
    scored_positions, whole_piece,
)
from dllm_ais.loading import SpecialTokens, special_tokens
from dllm_ais.models.families import FAMILIES, find_family, is_block_causal, is_diffusion_family
from dllm_ais.sampling.autoregressive import AutoregressiveSampler, AutoregressiveSamplerConfig
from dllm_ais.sampling.diffusion import DiffusionSamplerConfig, MaskedDiffusionSampler, resolve_remasking_rule
from dllm_ais.sampling.forwards import EagerForwards
from dllm_ais.rollout import Rollout
from dllm_ais.settings import LikelihoodSettings
from dllm_ais.validation import ConfigError

if TYPE_CHECKING:
    from dllm_ais.config import GRPOConfig


def lora_target_parameters(model_type: str) -> list[str]:
    """The LoRA `target_parameters` preset of a transformers `model_type`'s family (its record's
    `lora_target_parameters`: stacked experts LoRA adapts directly); empty for most."""
    family = find_family(model_type)
    return list(family.lora_target_parameters) if family is not None else []


def lora_target_modules(model_type: str) -> str | list[str]:
    """The LoRA target preset of a transformers `model_type`'s family (its record's `lora_targets`); ValueError naming
    the fix if it has none."""
    family = find_family(model_type)
    if family is None or family.lora_targets is None:
        presets = [name for family in FAMILIES if family.lora_targets is not None for name in family.model_types]
        raise ValueError(f"No LoRA target preset for model_type {model_type!r}; set lora_target_modules explicitly "
                         f"(presets exist for {', '.join(presets)}).")
    targets = family.lora_targets
    return targets if isinstance(targets, str) else list(targets)


class Policy(Protocol):
    """What the trainer needs from a policy (``GRPOTrainer(config, policy=...)`` takes any object providing it).

    `sample` completes left-padded prompts into a `Rollout` (all randomness from `generator`). `logprobs` scores a
    rollout's completion tokens [B, L] under `model` (the trainer: ℓ_old without grad, ℓ_θ with grad; the same
    `seed` gives the same estimator draws); with `compute_entropy=True` it also returns the per-token entropy [B, L]
    of the distribution each token is scored under, from the same forward. `rollout_logprobs` is the rollout side,
    ℓ_rollout, of the same estimator under the engine's model (or the log-probs the sampler recorded), so that
    exp(ℓ_old − ℓ_rollout) sees the engine's mismatch and nothing else. `num_estimator_seeds(μ)` tells how many
    distinct estimator draws one generation batch uses: the one-step diffusion surrogate draws fresh masks per inner
    iteration, exact estimators need one. `logprob_pieces` gives the same log-probs forward by forward (lazily; a
    single piece for a single-forward estimator), for a backward per forward. `advantages` [B] (optional) are the
    scored sequences' advantages, for estimators that score a sequence by its advantage's sign (SPG); the others
    ignore them. `scored_positions(rollout, seed)` [B, L] bool names the completion tokens the estimate with `seed`
    scores (the valid ones, or a drawn subset of them): the correction and the loss run over those, the log-probs
    hold 0 at the others.
    `sampler_config.eos_token_ids` are the tokens that end a completion (the `completions/clipped_ratio` metric
    counts those without one).
    """

    sampler_config: Any

    def sample(self, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               generator: torch.Generator | None, forwards: EagerForwards | None = None) -> Rollout: ...

    def logprobs(self, model: nn.Module, rollout: Rollout, seed: int, compute_entropy: bool = False,
                 advantages: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...

    def rollout_logprobs(self, engine_model: nn.Module, rollout: Rollout, seed: int,
                         advantages: torch.Tensor | None = None) -> torch.Tensor: ...

    def logprob_pieces(self, model: nn.Module, rollout: Rollout, seed: int, compute_entropy: bool = False,
                       advantages: torch.Tensor | None = None) -> Iterable[LogprobPiece]: ...

    def num_estimator_seeds(self, num_iterations: int) -> int: ...

    def scored_positions(self, rollout: Rollout, seed: int) -> torch.Tensor: ...


@dataclass
class DiffusionPolicy:
    """Masked-diffusion policy (LLaDA): a `MaskedDiffusionSampler` plus a diffusion likelihood estimator.

    `sampler` defaults to the plain ``MaskedDiffusionSampler(sampler_config)``; a subclass instance (its config
    equal to `sampler_config`, see `for_sampler`) samples instead. Rollout-side and trainer-side log-probs use the
    same estimator with the same seed, so their ratio measures the engine's mismatch and nothing else. Every
    estimator computes its logits with the sampler's `MaskedDiffusionSampler.scoring_logits` (its `block_logits`
    without a cache), so guidance and a subclass's logit processing are scored as sampled. For the trajectory
    estimator (and step_merge with a segment per step) the rollout side is free: the sampler's recorded per-step
    log-prob (`token_logprobs`), which the trainer side scores as softmax(logits / τ); a sampler overriding
    `token_logprobs` is therefore refused with the trajectory-type estimators. With a block cache and
    `likelihood_decoder="rollout"` the trajectory estimator scores the sampler's own cached logits instead
    (`MaskedDiffusionSampler.decoder_logits`): the fast decoder is the policy trained. `estimator` names one of
    `DIFFUSION_ESTIMATORS` (`likelihood.estimator`, the config's `likelihood` settings group itself); `bounds` are
    the elbo and spg estimators' settings; the experimental `likelihood_block_fraction` < 1 has a trajectory-type
    estimator score a random share of the blocks per inner iteration (`BlockSubset`). The experimental
    `commit_choice_gradient` (a stochastic commit rule, the decoder replayed) adds the commit choice's log-prob to
    the log-probs the loss differentiates (`logprob_pieces`), so the policy gradient holds the commit order's score
    function; `logprobs`, the no-grad side the correction reads, stays the tokens' (`choice_logprobs` is the rest).
    """

    sampler_config: DiffusionSamplerConfig
    likelihood: LikelihoodSettings = dataclasses.field(default_factory=LikelihoodSettings)
    likelihood_order: str = "rollout"
    likelihood_decoder: str = "rollout"
    sampler: MaskedDiffusionSampler | None = None
    bounds: BoundSettings = dataclasses.field(default_factory=BoundSettings)
    likelihood_block_fraction: float = 1.0
    commit_choice_gradient: bool = False

    @classmethod
    def for_sampler(cls, sampler: MaskedDiffusionSampler, **settings) -> "DiffusionPolicy":
        """The policy sampling with `sampler` (its config is the policy's `sampler_config`); `settings` are the other
        fields (likelihood, likelihood_order, likelihood_decoder, bounds, likelihood_block_fraction)."""
        return cls(sampler.config, sampler=sampler, **settings)

    def __post_init__(self):
        if self.sampler is None:
            self.sampler = MaskedDiffusionSampler(self.sampler_config)
        elif self.sampler.config != self.sampler_config:
            raise ValueError("DiffusionPolicy: sampler.config differs from sampler_config; build it with "
                             "DiffusionPolicy.for_sampler(sampler, ...)")
        self.scorer = DIFFUSION_ESTIMATORS[self.estimator]
        problem = block_fraction_problem(self.likelihood_block_fraction, self.estimator)
        if problem:
            raise ValueError(problem)
        if (self.sampler_config.editing_threshold is not None and self.estimator in TRAJECTORY_ESTIMATORS
                and not self.replays_decoder):
            raise ValueError(editing_estimator_problem(self.estimator))
        block_subset = None if self.likelihood_block_fraction == 1 else BlockSubset(
            self.likelihood_block_fraction, self.sampler_config.block_length)
        if self.scorer.recorded_by_sampler and overrides(self.sampler, "token_logprobs"):
            raise ValueError(
                f"{type(self.sampler).__name__} overrides token_logprobs, but the {self.estimator} estimator scores "
                "softmax(logits / temperature) against the log-probs the sampler records: move that processing into "
                "block_logits (scored exactly as sampled), or use likelihood.estimator=one_step")
        self.estimator_settings = EstimatorSettings(self.sampler_config.mask_token_id, self.sampler_config.temperature,
                                                    self.likelihood.p_mask_prompt, logits_fn=self.sampler.scoring_logits,
                                                    bounds=self.bounds, likelihood_segments=self.likelihood.segments,
                                                    decoder_logits=self.sampler.decoder_logits
                                                    if self.replays_decoder else None, block_subset=block_subset)
        self.choice_sampler = self.sampler if self.replays_decoder else self.sampler.with_config(dataclasses.replace(
            self.sampler_config, cache="none", cache_refresh_interval=None, cache_dtype="none"))
        self.loss_estimator_settings = self.estimator_settings
        if self.commit_choice_gradient:
            if not (self.replays_decoder and self.sampler_config.position_temperature > 0):
                raise ValueError("commit_choice_gradient scores the commit choice from the replayed decoder's logits: "
                                 "it needs likelihood.estimator=trajectory with a rollout.cache replayed as sampled "
                                 "and position_temperature > 0")
            self.loss_estimator_settings = dataclasses.replace(
                self.estimator_settings, decoder_choice_replay=self.sampler.commit_choice_replay)
        self.exact_order_sampler = None
        if self.estimator in TRAJECTORY_ESTIMATORS and self.likelihood_order == "exact":
            self.exact_order_sampler = self.sampler.with_config(self.sampler_config.exact())

    @property
    def estimator(self) -> str:
        """The name of the likelihood estimator (`likelihood.estimator`)."""
        return self.likelihood.estimator

    @property
    def replays_decoder(self) -> bool:
        """Whether the trajectory estimator scores the decoder's own (cached) logits
        (`dllm_ais.choices.replays_decoder`)."""
        return replays_decoder(self.estimator, self.likelihood_order, self.likelihood_decoder, self.sampler_config.cache,
                               self.sampler_config.editing_threshold is not None)

    def with_decoder(self, sampler_config: DiffusionSamplerConfig) -> "DiffusionPolicy":
        """This policy (its sampler's class and stages, its estimator) decoding with other sampler settings; the
        commit choice's gradient kept where that decoder still draws its choice and replays a cache."""
        drawn = sampler_config.position_temperature > 0 and sampler_config.cache != "none"
        return dataclasses.replace(self, sampler_config=sampler_config, sampler=self.sampler.with_config(sampler_config),
                                   commit_choice_gradient=self.commit_choice_gradient and drawn)

    def sample(self, model, input_ids, attention_mask, generator, forwards=None) -> Rollout:
        """A rollout of the sampler (its forwards run by `forwards`: the rollout engine's, or None = the model as it
        is); with `likelihood_order="exact"` its completions replayed by the same `model` along the exact decoder's
        order (`MaskedDiffusionSampler.replay`): `commit_step` and `step_logprobs` are then those of that order, and
        `num_steps` stays the sampler's own."""
        rollout = self.sampler.sample(model, input_ids, attention_mask=attention_mask, generator=generator,
                                      forwards=forwards)
        if self.exact_order_sampler is None:
            return rollout
        return dataclasses.replace(self.exact_order_sampler.replay(model, rollout), num_steps=rollout.num_steps)

    def logprobs(self, model, rollout: Rollout, seed: int, compute_entropy: bool = False, advantages=None):
        return self.scorer.logprobs(model, rollout, self.estimator_settings, seed, compute_entropy, advantages)

    def logprob_pieces(self, model, rollout: Rollout, seed: int, compute_entropy: bool = False, advantages=None):
        return self.scorer.logprob_pieces(model, rollout, self.loss_estimator_settings, seed, compute_entropy,
                                          advantages)

    def rollout_logprobs(self, engine_model, rollout: Rollout, seed: int, advantages=None) -> torch.Tensor:
        if self.scorer.records_rollout_side(self.estimator_settings, rollout):
            return rollout.step_logprobs
        return self.logprobs(engine_model, rollout, seed, advantages=advantages)

    def choice_logprobs(self, model, rollout: Rollout, seed: int = 0, advantages=None) -> torch.Tensor:
        """`model`'s log-probs [B, L] of the rollout's recorded commit choices and discarded candidates
        (`MaskedDiffusionSampler.choice_logprobs`), replayed by the decoder whose logits the trajectory estimator
        scores: the rollout's cached decoder when it replays it (`replays_decoder`), else the uncached one. The
        trainer's side of the complete ratio (`experimental.complete_ratio`); the rollout's is
        the rollout's `CommitChoiceRecord`. `seed` and `advantages` are unused (the replay is exact)."""
        return self.choice_sampler.choice_logprobs(model, rollout)

    def num_estimator_seeds(self, num_iterations: int) -> int:
        return num_iterations if self.scorer.draws_per_iteration(self.estimator_settings) else 1

    def scored_positions(self, rollout: Rollout, seed: int) -> torch.Tensor:
        return scored_positions(self.estimator_settings, rollout, seed)


@dataclass
class AutoregressivePolicy:
    """Causal-LM policy (Qwen3, Llama, ...): KV-cached decoding and teacher-forced log-probs.

    Both sides apply the same temperature/top-k/top-p processing. The rollout side is recomputed by a teacher-forced
    forward of the engine model rather than taken from the decoding loop, so that with the bf16 engine the ratio is
    1 to float rounding (incremental KV-cache decoding is not bit-identical to a full forward).
    """

    sampler_config: AutoregressiveSamplerConfig

    def __post_init__(self):
        self.sampler = AutoregressiveSampler(self.sampler_config)

    def sample(self, model, input_ids, attention_mask, generator, forwards=None) -> Rollout:
        return self.sampler.sample(model, input_ids, attention_mask=attention_mask, generator=generator,
                                   forwards=forwards)

    def logprobs(self, model, rollout: Rollout, seed: int, compute_entropy: bool = False, advantages=None):
        c = self.sampler_config
        return causal_logprobs(model, rollout.sequences, rollout.attention_mask, rollout.prompt_length,
                               temperature=c.temperature, top_k=c.top_k, top_p=c.top_p, compute_entropy=compute_entropy)

    def logprob_pieces(self, model, rollout: Rollout, seed: int, compute_entropy: bool = False, advantages=None):
        return [whole_piece(self.logprobs(model, rollout, seed, compute_entropy), compute_entropy)]

    def rollout_logprobs(self, engine_model, rollout: Rollout, seed: int, advantages=None) -> torch.Tensor:
        return self.logprobs(engine_model, rollout, seed)

    def num_estimator_seeds(self, num_iterations: int) -> int:
        return 1

    def scored_positions(self, rollout: Rollout, seed: int) -> torch.Tensor:
        return rollout.completion_mask.bool()


def scores_rollout_by_forward(policy: Policy, rollout: Rollout) -> bool:
    """Whether `policy.rollout_logprobs` computes ℓ_rollout by the same forward as `policy.logprobs` computes ℓ_old,
    run on the engine's model: the autoregressive teacher-forced pass, and every diffusion estimator whose rollout
    side the sampler does not record (the trajectory-type estimators' is recorded while decoding). With an engine that
    shares the trainer's model (the unified precision flow) ℓ_old then equals ℓ_rollout and needs no pass of its
    own. A custom policy is not assumed to."""
    if isinstance(policy, AutoregressivePolicy):
        return True
    return isinstance(policy, DiffusionPolicy) and not policy.scorer.records_rollout_side(policy.estimator_settings,
                                                                                          rollout)


def overrides(sampler: MaskedDiffusionSampler, stage: str) -> bool:
    """Whether `sampler`'s class replaces the `MaskedDiffusionSampler` method named `stage`."""
    return getattr(type(sampler), stage) is not getattr(MaskedDiffusionSampler, stage)


def is_diffusion(policy: str, model_type: str | None) -> bool:
    """Whether the `policy` setting (auto, diffusion or autoregressive) names a masked-diffusion policy for a model
    of `model_type`: with auto, whether the model is of a masked-diffusion family (LLaDA, Dream, SDAR:
    `dllm_ais.models.families`). ConfigError for policy=autoregressive with a block-causal model (SDAR), whose
    positions see the rest of their block: scored as a causal LM, each token would see itself."""
    if policy == "autoregressive" and is_block_causal(model_type):
        raise ConfigError(f"model_type {model_type!r} is block diffusion (each position sees the rest of its block), "
                          "not a causal LM: set policy to auto or diffusion.")
    if policy == "auto":
        return is_diffusion_family(model_type)
    return policy == "diffusion"


CONFIG_FIELD_OF_SAMPLER_SETTING = {
    "gen_length": "max_completion_length", "block_length": "rollout.block_length", "steps": "rollout.steps",
    "remasking": "rollout.remasking", "cfg_scale": "rollout.cfg_scale", "cache": "rollout.cache",
    "cache_refresh_interval": "rollout.cache_refresh_interval", "cache_dtype": "rollout.cache_dtype",
    "threshold": "rollout.threshold", "factor": "experimental.rollout_factor", "schedule": "rollout.schedule",
    "position_temperature": "experimental.rollout_position_temperature",
    "commit_choice_as_set": "experimental.commit_choice_as_set", "top_p": "top_p", "top_k": "top_k",
    "editing_threshold": "rollout.editing_threshold", "max_post_steps": "rollout.max_post_steps",
    "record_routing": "experimental.routing_record"}
"""The `GRPOConfig` field behind each `DiffusionSamplerConfig` setting the config sets (temperature and the special
token ids come from elsewhere)."""


def diffusion_sampler_config(config: "GRPOConfig", tokens: SpecialTokens, temperature: float) -> DiffusionSamplerConfig:
    """The masked-diffusion sampler settings of `config` (the fields `CONFIG_FIELD_OF_SAMPLER_SETTING` names) at
    `temperature`, with the model's special tokens."""
    return DiffusionSamplerConfig(
        **{setting: operator.attrgetter(field)(config) for setting, field in CONFIG_FIELD_OF_SAMPLER_SETTING.items()},
        temperature=temperature, mask_token_id=tokens.mask_token_id, eos_token_ids=tokens.eos_token_ids,
        pad_token_id=tokens.pad_token_id)


def block_causal_setting_problems(sampler_config: DiffusionSamplerConfig, model_config) -> list[str]:
    """The sampler settings a block-causal model (SDAR: `families.is_block_causal`) of `model_config` cannot decode
    with, one line each ([] for another model): a block length other than the model's ``block_size``, and what
    `DiffusionSamplerConfig.block_causal_problems` lists (guidance, an FP8 or refreshed cache, ...). The settings are
    named as the sampler's; their config fields are `CONFIG_FIELD_OF_SAMPLER_SETTING`."""
    if not is_block_causal(getattr(model_config, "model_type", None)):
        return []
    problems = sampler_config.block_causal_problems()
    block_size = getattr(model_config, "block_size", None)
    if block_size is not None and block_size != sampler_config.block_length:
        problems.append(f"block_length={sampler_config.block_length} differs from the model's block_size={block_size}: "
                        f"set rollout.block_length to {block_size}")
    return problems


CustomSampler = MaskedDiffusionSampler | Callable[[DiffusionSamplerConfig], MaskedDiffusionSampler]
"""What ``GRPOTrainer(sampler=...)`` takes: a sampler, or a callable building one from the run's
`DiffusionSamplerConfig` (the subclass itself, or e.g. ``functools.partial(MySampler, bias=...)``)."""


def bound_settings(config: "GRPOConfig") -> BoundSettings:
    """The Monte-Carlo bound settings (elbo and spg estimators) of this config."""
    return BoundSettings(num_samples=config.likelihood.elbo_samples, coupled=config.experimental.elbo_coupled,
                         block_masking=config.likelihood.spg_block_masking, block_length=config.rollout.block_length,
                         eubo_beta=config.likelihood.spg_eubo_beta, mix_weight=config.experimental.spg_mix_weight)


def build_policy(config: "GRPOConfig", model_config, tokenizer, temperature: float | None = None,
                 sampler: CustomSampler | None = None) -> Policy:
    """The diffusion or autoregressive policy for this config (`temperature` overrides, e.g. 0 for greedy eval).

    `sampler` (diffusion only) samples instead of the plain `MaskedDiffusionSampler`: a callable (a subclass, a
    factory) is called with the config's sampler settings; an instance, whose config must be those settings at the
    config's temperature (`custom_policy_problems`), is used as it is, or through
    `MaskedDiffusionSampler.with_config` at another `temperature`.
    """
    diffusion = is_diffusion(config.policy, getattr(model_config, "model_type", None))
    tokens = special_tokens(tokenizer, model_config, diffusion)
    temperature = config.temperature if temperature is None else temperature
    if diffusion:
        sampler_config = diffusion_sampler_config(config, tokens, temperature)
        if sampler_config.editing_threshold is not None and not is_block_causal(getattr(model_config, "model_type", None)):
            raise ConfigError(editing_family_problem(getattr(model_config, "model_type", None)))
        problems = block_causal_setting_problems(sampler_config, model_config)
        if problems:
            raise ConfigError(f"model_type {model_config.model_type!r} decodes block by block and cannot run with these "
                              f"rollout settings: {'; '.join(problems)} (position_temperature is "
                              "experimental.rollout_position_temperature).")
        if isinstance(sampler, MaskedDiffusionSampler):
            sampler = sampler if sampler.config == sampler_config else sampler.with_config(sampler_config)
        elif sampler is not None:
            built = sampler(sampler_config)
            if not isinstance(built, MaskedDiffusionSampler):
                raise ValueError(f"sampler= built a {type(built).__name__}, not a MaskedDiffusionSampler: pass a "
                                 "MaskedDiffusionSampler subclass, or a callable returning one of its instances")
            sampler = built
        experimental = config.experimental
        return DiffusionPolicy(sampler_config, config.likelihood, likelihood_order=experimental.likelihood_order,
                               likelihood_decoder=experimental.likelihood_decoder, sampler=sampler,
                               bounds=bound_settings(config),
                               likelihood_block_fraction=experimental.likelihood_block_fraction,
                               commit_choice_gradient=experimental.commit_choice_gradient)
    sampler = AutoregressiveSamplerConfig(
        max_new_tokens=config.max_completion_length, temperature=temperature, top_k=config.top_k, top_p=config.top_p,
        eos_token_ids=tokens.eos_token_ids, pad_token_id=tokens.pad_token_id)
    return AutoregressivePolicy(sampler)


POLICY_METHODS = tuple(name for name, value in vars(Policy).items() if callable(value) and not name.startswith("_"))
TOKEN_ID_FIELDS = ("mask_token_id", "eos_token_ids", "pad_token_id")


def _sampler_setting_problems(expected: DiffusionSamplerConfig, sampler: MaskedDiffusionSampler) -> list[str]:
    """The settings of `sampler.config` that differ from `expected` (the run config's), in one line naming each with
    its config field; remasking rules compare as the callables they resolve to."""
    differences = []
    for field in dataclasses.fields(DiffusionSamplerConfig):
        got, want = getattr(sampler.config, field.name), getattr(expected, field.name)
        same = (resolve_remasking_rule(got) is resolve_remasking_rule(want) if field.name == "remasking"
                else got == want)
        if not same:
            source = ("the model's and tokenizer's" if field.name in TOKEN_ID_FIELDS
                      else f"config {CONFIG_FIELD_OF_SAMPLER_SETTING.get(field.name, field.name)}")
            differences.append(f"{field.name}={got!r} ({source}: {want!r})")
    if not differences:
        return []
    return [f"the sampler's settings differ from the config's, which record the run and its held-out decoder: "
            f"{', '.join(differences)}; pass the sampler's class or a factory (the trainer builds it from the config), "
            "or set both alike (a remasking callable: register it with register_remasking_rule, name it in remasking)"]


def custom_policy_problems(config: "GRPOConfig", model_config, tokenizer, sampler: CustomSampler | None = None,
                           policy: Policy | None = None) -> list[str]:
    """Why `GRPOTrainer(config, sampler=..., policy=...)` cannot train with what it was given, one line each; [] when
    it can.

    `sampler` must be a `MaskedDiffusionSampler` instance or a callable building one (`CustomSampler`), for a
    diffusion policy; an instance's settings must equal the config's (`diffusion_sampler_config`: rollouts,
    metrics, checkpoints and the held-out decoder follow the config). `policy` must provide the `Policy` methods and
    ``sampler_config.eos_token_ids``; a `DiffusionPolicy` must also agree with the config's sampler settings and its
    estimator settings.
    """
    if sampler is not None and policy is not None:
        return ["pass sampler= or policy=, not both (a policy holds its sampler)"]
    problems = []
    if policy is not None:
        missing = [name for name in POLICY_METHODS if not callable(getattr(policy, name, None))]
        if not hasattr(getattr(policy, "sampler_config", None), "eos_token_ids"):
            missing.append("sampler_config.eos_token_ids")
        if missing:
            return [f"policy= must provide the dllm_ais.policy.Policy protocol; {type(policy).__name__} lacks "
                    f"{', '.join(missing)}"]
        if not isinstance(policy, DiffusionPolicy):
            return []
        problems = [f"policy.{name}={getattr(policy, name)!r} but the config's {field} is "
                    f"{operator.attrgetter(field)(config)!r}"
                    for name, field in (("likelihood", "likelihood"),
                                        ("likelihood_order", "experimental.likelihood_order"),
                                        ("likelihood_decoder", "experimental.likelihood_decoder"),
                                        ("likelihood_block_fraction", "experimental.likelihood_block_fraction"))
                    if getattr(policy, name) != operator.attrgetter(field)(config)]
        if policy.estimator in SEQUENCE_ESTIMATORS and policy.bounds != bound_settings(config):
            problems.append(f"policy.bounds={policy.bounds!r} differ from the config's elbo_* / spg_* settings "
                            f"({bound_settings(config)!r})")
        sampler = policy.sampler
    if sampler is None:
        return problems
    is_instance = isinstance(sampler, MaskedDiffusionSampler)
    if not (is_instance or callable(sampler)):
        return [f"sampler= takes a MaskedDiffusionSampler, or a callable building one from a DiffusionSamplerConfig "
                f"(e.g. its subclass), got a {type(sampler).__name__}: pass another kind of sampler as policy=, an "
                "object with the dllm_ais.policy.Policy methods"]
    model_type = getattr(model_config, "model_type", None)
    if not is_diffusion(config.policy, model_type):
        return [f"sampler= is a masked-diffusion sampler, but this run's policy is autoregressive (policy="
                f"{config.policy}, model_type {model_type}): set policy=diffusion for a masked-diffusion model"]
    if is_instance:
        expected = diffusion_sampler_config(config, special_tokens(tokenizer, model_config, True), config.temperature)
        problems += _sampler_setting_problems(expected, sampler)
    return problems


def sample_prompts(policy: Policy | list[Policy], model: nn.Module, tokenizer, prompts: list,
                   max_prompt_length: int | None, device: torch.device, generator: torch.Generator | None,
                   micro_batch_size: int | None = None, forwards: EagerForwards | None = None) -> Rollout:
    """Tokenize `prompts` (left padded on one canvas) and roll them out on `model` with `policy` — or with
    `policy[i]` for prompt i, consecutive prompts of one policy together — in micro-batches of `micro_batch_size`
    (default: all of one policy at once), its forwards run by `forwards` (the rollout engine's; None = the model
    as it is)."""
    input_ids, attention_mask = tokenize_prompts(tokenizer, prompts, max_prompt_length, device)
    policies = policy if isinstance(policy, list) else [policy] * len(input_ids)
    rollouts, start = [], 0
    for _, run in itertools.groupby(policies, key=id):
        stop = start + len(list(run))
        size = micro_batch_size or stop - start
        rollouts += [policies[start].sample(model, input_ids[i:min(i + size, stop)],
                                            attention_mask[i:min(i + size, stop)], generator, forwards)
                     for i in range(start, stop, size)]
        start = stop
    return Rollout.concatenate(rollouts)
