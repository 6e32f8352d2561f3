"""The one seam between diffusion and autoregressive policies: how to sample, and how to score a rollout.

Everything downstream — rewards, correction, loss, metrics, the trainer loop — sees only a `Rollout` and
per-token log-probs [B, L], so both policy families share one correction path.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Protocol

import torch
from torch import nn

from dllm_ais.choices import TRAJECTORY_ESTIMATORS
from dllm_ais.data import tokenize_prompts
from dllm_ais.likelihood import DIFFUSION_ESTIMATORS, EstimatorSettings, LogprobPiece, causal_logprobs, whole_piece
from dllm_ais.loading import special_tokens
from dllm_ais.sampling.autoregressive import AutoregressiveSampler, AutoregressiveSamplerConfig
from dllm_ais.sampling.diffusion import DiffusionSamplerConfig, MaskedDiffusionSampler
from dllm_ais.sampling.rollout import Rollout

if TYPE_CHECKING:
    from dllm_ais.config import GRPOConfig

LORA_TARGET_PRESETS: dict[str, str | list[str]] = {
    # `ff_out` names both each block's down-projection and LLaDA's LM head: the regex pins it to blocks.N.
    "llada": r".*\.blocks\.\d+\.(q_proj|k_proj|v_proj|attn_out|ff_proj|up_proj|ff_out)",
    "qwen3": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "qwen2": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}


def lora_target_modules(model_type: str) -> str | list[str]:
    """The LoRA target preset for a transformers `model_type` (ValueError naming the fix if none exists)."""
    if model_type not in LORA_TARGET_PRESETS:
        raise ValueError(f"No LoRA target preset for model_type {model_type!r}; set lora_target_modules explicitly "
                         f"(presets exist for {', '.join(LORA_TARGET_PRESETS)}).")
    return LORA_TARGET_PRESETS[model_type]


class Policy(Protocol):
    """What the trainer needs from a policy family.

    `logprobs(..., compute_entropy=True)` also returns the per-token entropy [B, L] of the distribution each token
    is scored under, from the same forward. `logprob_pieces` gives the same log-probs forward by forward (lazily; a
    single piece for a single-forward estimator), for a backward per forward. `num_estimator_seeds(μ)` tells how
    many distinct estimator draws one generation batch uses: the one-step diffusion surrogate draws fresh masks per
    inner iteration, exact estimators need one.
    """

    def sample(self, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               generator: torch.Generator | None) -> Rollout: ...

    def logprobs(self, model: nn.Module, rollout: Rollout, seed: int,
                 compute_entropy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...

    def logprob_pieces(self, model: nn.Module, rollout: Rollout, seed: int,
                       compute_entropy: bool = False) -> Iterable[LogprobPiece]: ...

    def rollout_logprobs(self, engine_model: nn.Module, rollout: Rollout, seed: int) -> torch.Tensor: ...

    def num_estimator_seeds(self, num_iterations: int) -> int: ...


@dataclass
class DiffusionPolicy:
    """Masked-diffusion policy (LLaDA): the LLaDA sampler plus a diffusion likelihood estimator.

    Rollout-side and trainer-side log-probs use the same estimator with the same seed, so their ratio measures
    the precision mismatch and nothing else. For the trajectory estimator (and step_merge with a segment per step)
    the rollout side is free: it is the sampler's recorded per-step unmasking log-prob. `estimator` names one of
    `DIFFUSION_ESTIMATORS`; `GRPOConfig` checks it and that the trajectory-type estimators, which replay the plain
    model, are not asked to reproduce guidance.
    """

    sampler_config: DiffusionSamplerConfig
    estimator: str = "one_step"
    p_mask_prompt: float = 0.15
    likelihood_order: str = "rollout"
    likelihood_segments: int = 16

    def __post_init__(self):
        self.sampler = MaskedDiffusionSampler(self.sampler_config)
        self.scorer = DIFFUSION_ESTIMATORS[self.estimator]
        self.estimator_settings = EstimatorSettings(self.sampler_config.mask_token_id, self.sampler_config.temperature,
                                                    self.p_mask_prompt, likelihood_segments=self.likelihood_segments)
        self.exact_order_sampler = None
        if self.estimator in TRAJECTORY_ESTIMATORS and self.likelihood_order == "exact":
            exact = dataclasses.replace(self.sampler_config, cache="none", cache_refresh_interval=None, threshold=None,
                                        factor=None)
            self.exact_order_sampler = MaskedDiffusionSampler(exact)

    def sample(self, model, input_ids, attention_mask, generator) -> Rollout:
        """A rollout of the sampler; with `likelihood_order="exact"` its completions replayed by the same `model`
        along the exact decoder's order (`MaskedDiffusionSampler.replay`): `commit_step` and `step_logprobs` are
        then those of that order, and `num_steps` stays the sampler's own."""
        rollout = self.sampler.sample(model, input_ids, attention_mask=attention_mask, generator=generator)
        if self.exact_order_sampler is None:
            return rollout
        return dataclasses.replace(self.exact_order_sampler.replay(model, rollout), num_steps=rollout.num_steps)

    def logprobs(self, model, rollout: Rollout, seed: int, compute_entropy: bool = False):
        return self.scorer.logprobs(model, rollout, self.estimator_settings, seed, compute_entropy)

    def logprob_pieces(self, model, rollout: Rollout, seed: int, compute_entropy: bool = False):
        return self.scorer.logprob_pieces(model, rollout, self.estimator_settings, seed, compute_entropy)

    def rollout_logprobs(self, engine_model, rollout: Rollout, seed: int) -> torch.Tensor:
        if self.scorer.records_rollout_side(self.estimator_settings, rollout):
            return rollout.step_logprobs
        return self.logprobs(engine_model, rollout, seed)

    def num_estimator_seeds(self, num_iterations: int) -> int:
        return num_iterations if self.scorer.fresh_masks_per_iteration else 1


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

    def sample(self, model, input_ids, attention_mask, generator) -> Rollout:
        return self.sampler.sample(model, input_ids, attention_mask=attention_mask, generator=generator)

    def logprobs(self, model, rollout: Rollout, seed: int, compute_entropy: bool = False):
        c = self.sampler_config
        return causal_logprobs(model, rollout.sequences, rollout.attention_mask, rollout.prompt_length,
                               temperature=c.temperature, top_k=c.top_k, top_p=c.top_p, compute_entropy=compute_entropy)

    def logprob_pieces(self, model, rollout: Rollout, seed: int, compute_entropy: bool = False):
        return [whole_piece(self.logprobs(model, rollout, seed, compute_entropy), compute_entropy)]

    def rollout_logprobs(self, engine_model, rollout: Rollout, seed: int) -> torch.Tensor:
        return self.logprobs(engine_model, rollout, seed)

    def num_estimator_seeds(self, num_iterations: int) -> int:
        return 1


def is_diffusion(policy: str, model_type: str | None) -> bool:
    """Whether the `policy` setting (auto, diffusion or autoregressive) names a masked-diffusion policy for a model
    of `model_type`: with auto, whether the model is LLaDA."""
    if policy == "auto":
        return model_type == "llada"
    return policy == "diffusion"


def build_policy(config: "GRPOConfig", model_config, tokenizer, temperature: float | None = None) -> Policy:
    """The diffusion or autoregressive policy for this config (`temperature` overrides, e.g. 0 for greedy eval)."""
    diffusion = is_diffusion(config.policy, getattr(model_config, "model_type", None))
    tokens = special_tokens(tokenizer, model_config, diffusion)
    temperature = config.temperature if temperature is None else temperature
    if diffusion:
        sampler = DiffusionSamplerConfig(
            gen_length=config.max_completion_length, block_length=config.block_length, steps=config.diffusion_steps,
            temperature=temperature, remasking=config.remasking, mask_token_id=tokens.mask_token_id,
            eos_token_ids=tokens.eos_token_ids, pad_token_id=tokens.pad_token_id, cfg_scale=config.cfg_scale,
            cache=config.rollout_cache, cache_refresh_interval=config.rollout_cache_refresh_interval,
            threshold=config.rollout_threshold, factor=config.rollout_factor)
        return DiffusionPolicy(sampler, estimator=config.likelihood_estimator, p_mask_prompt=config.p_mask_prompt,
                               likelihood_order=config.likelihood_order,
                               likelihood_segments=config.likelihood_segments)
    sampler = AutoregressiveSamplerConfig(
        max_new_tokens=config.max_completion_length, temperature=temperature, top_k=config.top_k, top_p=config.top_p,
        eos_token_ids=tokens.eos_token_ids, pad_token_id=tokens.pad_token_id)
    return AutoregressivePolicy(sampler)


def sample_prompts(policy: Policy, model: nn.Module, tokenizer, prompts: list, max_prompt_length: int | None,
                   device: torch.device, generator: torch.Generator | None,
                   micro_batch_size: int | None = None) -> Rollout:
    """Tokenize `prompts` (left padded on one canvas) and roll them out with `policy` on `model`, in micro-batches
    of `micro_batch_size` (default: all at once)."""
    input_ids, attention_mask = tokenize_prompts(tokenizer, prompts, max_prompt_length, device)
    size = micro_batch_size or len(input_ids)
    return Rollout.concatenate([policy.sample(model, input_ids[i:i + size], attention_mask[i:i + size], generator)
                                for i in range(0, len(input_ids), size)])
