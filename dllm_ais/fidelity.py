"""Rollout fidelity: which diffusion decoder samples each generation batch.

Fast rollouts (a block KV cache, parallel commits) bias the policy gradient by more than importance sampling
recovers. Two settings trade some of their speed back for fidelity:

- `rollout_fidelity=adaptive`: the decoder is a rung of a ladder (`fidelity_ladder`) from the configured fast
  decoder (rung 0) to the exact one (the last rung: no cache, the fixed step schedule). After each generation batch
  the controller `next_fidelity` — a pure function of the previous `FidelityState` and the batch's correction
  diagnostics — moves one rung toward exact when the importance ratio shows a large mismatch (k3 KL above
  `rollout_fidelity_k3_max`, or the ratio's effective sample size below `rollout_fidelity_ess_min`; both are
  computed for every correction method), and one rung back toward fast after `rollout_fidelity_patience` calm
  batches in a row — the pattern of dynamic loss scaling (back off at once, grow again after a calm interval).
  This only means something when the ratio sees the decoder: `GRPOConfig.ratio_sees_decoder`.
- `rollout_exact_fraction`: that share of each process' GRPO groups (whole groups, so each group's advantages
  compare completions of one decoder) is decoded by the exact decoder, the rest by the current rung
  (`exact_group_count`).

`RolloutFidelity` holds the ladder's policies, the state (checkpointed) and the exact share; `grpo` asks it for one
policy per prompt.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import Tensor

from dllm_ais.sampling.diffusion import DiffusionSamplerConfig

if TYPE_CHECKING:
    from dllm_ais.config import GRPOConfig
    from dllm_ais.policy import Policy

CACHE_REFRESH_RUNGS = (4, 2)  # refresh intervals inside a block; the rung after them has no cache (= interval 1)
THRESHOLD_RUNGS = (0.95, 0.99)  # confidence thresholds; the rung after them is the fixed step schedule
FACTOR_RUNGS = (0.5, 0.25)  # multiples of the configured factor; the rung after them is the fixed step schedule
K3_KEY, ESS_KEY = "rollout_corr/k3_kl", "rollout_corr/rollout_is_eff_sample_size"


def _cache_axis(config: DiffusionSamplerConfig) -> list[dict[str, Any]]:
    """The cache settings from the configured one to none: refresh intervals finer than the configured one."""
    if config.cache == "none":
        return [{}]
    configured = config.cache_refresh_interval or math.inf  # None: refreshed only at each block's first step
    finer = [{"cache_refresh_interval": interval} for interval in CACHE_REFRESH_RUNGS if interval < configured]
    return [{}, *finer, {"cache": "none", "cache_refresh_interval": None}]


def _parallel_axis(config: DiffusionSamplerConfig) -> list[dict[str, Any]]:
    """The parallel-decoding settings from the configured one to the fixed schedule: stricter thresholds or
    smaller factors (fewer tokens committed per step)."""
    if config.threshold is not None:
        stricter = [{"threshold": threshold} for threshold in THRESHOLD_RUNGS if threshold > config.threshold]
    elif config.factor is not None:
        stricter = [{"factor": config.factor * multiple} for multiple in FACTOR_RUNGS]
    else:
        return [{}]
    return [{}, *stricter, {"threshold": None, "factor": None}]


def fidelity_ladder(config: DiffusionSamplerConfig) -> list[DiffusionSamplerConfig]:
    """The decoders from `config` (rung 0) to `config.exact()` (the last rung), each more exact than the one
    before: rung k takes the k-th setting of each approximation's axis (its last once the axis is exhausted),

    - cache: the configured refresh interval, then 4, then 2 (those finer than it), then no cache;
    - threshold τ: τ, then 0.95, 0.99 (those above τ), then the fixed schedule; factor f: f, f/2, f/4, then the
      fixed schedule.

    E.g. dual cache + τ = 0.9: (dual, None, 0.9) → (dual, 4, 0.95) → (dual, 2, 0.99) → exact. A decoder without
    approximation is a ladder of one rung.
    """
    axes = [_cache_axis(config), _parallel_axis(config)]
    length = max(len(axis) for axis in axes)
    rungs = [dataclasses.replace(config, **{key: value for axis in axes
                                            for key, value in axis[min(rung, len(axis) - 1)].items()})
             for rung in range(length - 1)]
    return rungs + [config.exact()]


@dataclass(frozen=True)
class FidelitySettings:
    """The config's `rollout_fidelity*` and `rollout_exact_fraction` fields (see `GRPOConfig`)."""

    mode: str = "fixed"
    k3_max: float = 0.05
    ess_min: float = 0.9
    patience: int = 8
    exact_fraction: float = 0.0

    @classmethod
    def from_config(cls, config: "GRPOConfig") -> "FidelitySettings":
        return cls(config.experimental.rollout_fidelity, config.experimental.rollout_fidelity_k3_max, config.experimental.rollout_fidelity_ess_min,
                   config.experimental.rollout_fidelity_patience, config.experimental.rollout_exact_fraction)


@dataclass(frozen=True)
class FidelityState:
    """Where the controller stands: the rung `level` (0 = the configured fast decoder) and the calm batches in a
    row since it last moved (counted toward relaxing; 0 at rung 0, where there is nothing to relax)."""

    level: int = 0
    calm_batches: int = 0


def mismatch_too_large(diagnostics: dict[str, float], settings: FidelitySettings) -> bool:
    """Whether a batch's ratio diagnostics (logged names) show the decoder biasing the gradient: k3 KL above
    `k3_max` or the effective sample size below `ess_min`."""
    return diagnostics[K3_KEY] > settings.k3_max or diagnostics[ESS_KEY] < settings.ess_min


def next_fidelity(state: FidelityState, diagnostics: dict[str, float], settings: FidelitySettings,
                  top_level: int) -> FidelityState:
    """The controller: the state after a batch with these `diagnostics`, on a ladder of rungs 0..`top_level`.

    A large mismatch (`mismatch_too_large`) moves one rung toward exact (never past `top_level`); otherwise the
    batch is calm, and `patience` calm batches in a row move one rung back toward fast (never below 0).
    """
    if mismatch_too_large(diagnostics, settings):
        return FidelityState(min(state.level + 1, top_level), 0)
    if state.level == 0:
        return FidelityState(0, 0)
    calm = state.calm_batches + 1
    return FidelityState(state.level - 1, 0) if calm >= settings.patience else FidelityState(state.level, calm)


def exact_group_count(fraction: float, num_groups: int, draw: float) -> int:
    """How many of `num_groups` groups to decode exactly: ⌊fraction · num_groups + u⌋ with u = `draw` ∈ [0, 1),
    the stochastic rounding of fraction · num_groups (its expectation over u ~ U(0, 1) is exact)."""
    return min(math.floor(fraction * num_groups + draw), num_groups)


def decoder_metrics(config: DiffusionSamplerConfig) -> dict[str, float]:
    """A decoder's settings as metrics: `rollout/cache_refresh_interval` (0 = refreshed only at each block's
    first step; absent without a cache) and `rollout/threshold` or `rollout/factor` (absent on the fixed schedule)."""
    metrics = {}
    if config.cache != "none":
        metrics["rollout/cache_refresh_interval"] = float(config.cache_refresh_interval or 0)
    if config.threshold is not None:
        metrics["rollout/threshold"] = float(config.threshold)
    if config.factor is not None:
        metrics["rollout/factor"] = float(config.factor)
    return metrics


def exact_share_metrics(decoded_exactly: Tensor, rewards: Tensor) -> dict[str, float]:
    """The split of a batch [B] between the exact share and the fast decoder: `rollout/exact_fraction` (the share
    of completions in the exact share) and the mean reward of each part, `rollout/exact_reward` and
    `rollout/fast_reward` (each present when its part is not empty)."""
    metrics = {"rollout/exact_fraction": decoded_exactly.float().mean().item()}
    for name, part in (("exact", decoded_exactly), ("fast", ~decoded_exactly)):
        if part.any():
            metrics[f"rollout/{name}_reward"] = rewards[part].float().mean().item()
    return metrics


def describe_decoder(config: DiffusionSamplerConfig) -> str:
    """`cache=dual refresh=4 threshold=0.95`, or `exact` without approximations."""
    parts = []
    if config.cache != "none":
        parts.append(f"cache={config.cache} refresh={config.cache_refresh_interval or 'block'}")
    if config.threshold is not None:
        parts.append(f"threshold={config.threshold:g}")
    if config.factor is not None:
        parts.append(f"factor={config.factor:g}")
    return " ".join(parts) or "exact"


class RolloutFidelity:
    """The decoders a run samples with: the policies of the ladder's rungs (one rung for a policy without a
    diffusion sampler), the controller's `state` (the checkpointed part) and the exact share of the groups."""

    def __init__(self, settings: FidelitySettings, policy: "Policy"):
        self.settings = settings
        sampler_config = getattr(policy, "sampler_config", None)
        ladder = fidelity_ladder(sampler_config) if isinstance(sampler_config, DiffusionSamplerConfig) else []
        self.policies = [policy] + [policy.with_decoder(rung) for rung in ladder[1:]]
        self.state = FidelityState()

    @classmethod
    def from_config(cls, config: "GRPOConfig", policy: "Policy") -> "RolloutFidelity":
        return cls(FidelitySettings.from_config(config), policy)

    @property
    def top_level(self) -> int:
        return len(self.policies) - 1

    @property
    def policy(self) -> "Policy":
        """The policy of the current rung."""
        return self.policies[self.state.level]

    def exact_prompts(self, num_prompts: int, group_size: int, seed: int) -> int:
        """How many prompts of a process' generation batch (consecutive groups of `group_size`) the exact decoder
        samples: `exact_group_count` whole groups, its rounding draw seeded by `seed` (the batch's first estimator
        seed, `grpo.estimator_seeds`: the run's seed, the generation batch and the process), so a rerun (or a
        resumed run) splits alike."""
        draw = random.Random(seed)
        return exact_group_count(self.settings.exact_fraction, num_prompts // group_size, draw.random()) * group_size

    def prompt_policies(self, num_prompts: int, num_exact: int) -> list["Policy"]:
        """One policy per prompt: the exact decoder's for the first `num_exact`, the current rung's for the rest."""
        return [self.policies[-1]] * num_exact + [self.policy] * (num_prompts - num_exact)

    def metrics(self) -> dict[str, float]:
        """The current rung as metrics (`rollout/fidelity_level` and `decoder_metrics`); {} with one rung."""
        if self.top_level == 0:
            return {}
        return {"rollout/fidelity_level": float(self.state.level),
                **decoder_metrics(self.policy.sampler_config)}

    def update(self, diagnostics: list[dict[str, float]]) -> None:
        """Advance the controller (adaptive mode) on a batch's diagnostics, one dict per estimator seed (averaged)."""
        if self.settings.mode != "adaptive":
            return
        mean = {key: sum(d[key] for d in diagnostics) / len(diagnostics) for key in (K3_KEY, ESS_KEY)}
        self.state = next_fidelity(self.state, mean, self.settings, self.top_level)

    def start_note(self) -> str | None:
        """One line said at start about the decoders (None when there is nothing to say)."""
        settings = self.settings
        if settings.mode != "adaptive" and settings.exact_fraction == 0:
            return None
        decoders = describe_decoder(self.policy.sampler_config)
        if settings.mode == "adaptive":
            ladder = " -> ".join(describe_decoder(policy.sampler_config) for policy in self.policies)
            decoders = (f"rollout_fidelity=adaptive over {ladder}, now at rung {self.state.level}: one rung toward "
                        f"exact after a batch with k3_kl > {settings.k3_max:g} or ESS < {settings.ess_min:g}, one back "
                        f"after {settings.patience} calm batches")
        if settings.exact_fraction > 0:
            return (f"note: rollout_exact_fraction={settings.exact_fraction:g} of the GRPO groups are decoded exactly, "
                    f"the rest by {decoders}.")
        return f"note: {decoders}."
