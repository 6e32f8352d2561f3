"""Rollout-mismatch corrections: importance weights between the rollout engine and the trainer.

Formulas: docs/algorithms.md, section "Rollout-mismatch corrections".

The rollout engine (e.g. FP8) samples from a behaviour policy μ that differs slightly from the
trainer's policy π_old (BF16). The functions here turn per-token log-probs ℓ^old and ℓ^ro into
per-token weights w_t that the GRPO loss multiplies into its per-token terms
together with diagnostics (python floats) to log every step.

Conventions (helpers in dllm_ais.ops): token tensors are [B, L]; `mask` (bool or 0/1) marks valid completion tokens;
advantages are [B], one per sequence. Every returned weight tensor is detached float32 and 0 at
invalid positions. Per token, log ρ_t = clamp(ℓ^old_t − ℓ^ro_t, −20, 20) and ρ_t = exp(log ρ_t).

`ais_weights` is **this project's formulation** of Adaptive Importance Sampling: the AIS paper
describes the idea (three batch diagnostics mixed into one coefficient α) but not its formula.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Union

import torch
from torch import Tensor

from dllm_ais.choices import IS_LEVELS
from dllm_ais.settings import CorrectionSettings
from dllm_ais.ops import (
    as_token_mask,
    broadcast_advantages,
    check_choice,
    masked_mean,
    masked_sum,
    normalised_effective_sample_size,
    scalars_to_floats,
)

LOG_RATIO_BOUND = 20.0
IS_MODES = ("truncate", "mask")

AlphaRule = Union[str, Callable[[dict[str, float]], float]]

# Where each diagnostic is logged (`correct` prefixes them): verl's rollout-correction names and semantics under
# `rollout_corr/`, TRL's under `sampling/`, and everything else (the AIS diagnostics) under `ais/`.
VERL_DIAGNOSTICS = (
    "rollout_is_mean", "rollout_is_std", "rollout_is_min", "rollout_is_max", "rollout_is_eff_sample_size",
    "rollout_is_ratio_fraction_high", "rollout_is_ratio_fraction_low", "rollout_rs_masked_fraction",
    "training_ppl", "rollout_ppl", "ppl_ratio", "kl", "k3_kl", "chi2_token", "chi2_seq",
)
COMMIT_DIAGNOSTICS = ("commit_k3_kl", "commit_eff_sample_size", "commit_seq_log_ratio_mean")
"""The commit part of the complete ratio (`experimental.complete_ratio`), logged beside the token ones under
`rollout_corr/`."""
TRL_DIAGNOSTICS = (
    "importance_sampling_ratio/min", "importance_sampling_ratio/mean", "importance_sampling_ratio/max",
    "sampling_logp_difference/mean", "sampling_logp_difference/max",
)

_NEUTRAL_RATIO_DIAGNOSTICS = {
    "rollout_is_mean": 1.0,
    "rollout_is_std": 0.0,
    "rollout_is_min": 1.0,
    "rollout_is_max": 1.0,
    "rollout_is_eff_sample_size": 1.0,
    "rollout_is_ratio_fraction_high": 0.0,
    "rollout_is_ratio_fraction_low": 0.0,
    "kl": 0.0,
    "k3_kl": 0.0,
    "chi2_token": 0.0,
    "chi2_seq": 0.0,
    "sampling_logp_difference/mean": 0.0,
    "sampling_logp_difference/max": 0.0,
}
_NEUTRAL_PERPLEXITIES = {"training_ppl": 1.0, "rollout_ppl": 1.0, "ppl_ratio": 1.0}


def logged_name(key: str) -> str:
    """The name a diagnostic is logged under: `rollout_corr/<key>` for verl's, `sampling/<key>` for TRL's,
    `ais/<key>` for the rest (α and the AIS diagnostics); the commit ratio's (`COMMIT_DIAGNOSTICS`) under
    `rollout_corr/` too."""
    if key in VERL_DIAGNOSTICS or key in COMMIT_DIAGNOSTICS:
        return f"rollout_corr/{key}"
    return f"sampling/{key}" if key in TRL_DIAGNOSTICS else f"ais/{key}"


# ---------------------------------------------------------------------------------------------
# Ratios and their diagnostics
# ---------------------------------------------------------------------------------------------
def log_importance_ratio(logp_old: Tensor, logp_rollout: Tensor, mask: Tensor) -> Tensor:
    """log ρ_t = clamp(ℓ^old_t − ℓ^ro_t, −20, 20) at valid tokens, 0 elsewhere (detached float32).

    Raises ValueError when a valid token's log-ratio is NaN (a NaN log-prob, or −inf in both).
    """
    valid = as_token_mask(mask, logp_old, logp_rollout)
    log_ratio = logp_old.detach().float() - logp_rollout.detach().float()
    num_nan = int((torch.isnan(log_ratio) & valid).sum())
    if num_nan:
        raise ValueError(
            f"{num_nan} valid completion tokens have a NaN log-ratio (logp_old or logp_rollout is "
            "NaN there, or both are -inf): check the likelihood estimator and the completion mask"
        )
    return torch.where(valid, log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND), 0.0)


def ratio_diagnostics(
    log_ratio: Tensor,
    mask: Tensor,
    *,
    level: str = "token",
    clip: float = 2.0,
    clip_low: float | None = None,
) -> dict[str, float]:
    """Pre-truncation statistics of the ratios over the N valid tokens, under verl's and TRL's names.

    With ρ the ratio at `level` (token ρ_t, or the sequence / geometric ratio broadcast to its tokens, see
    `importance_weights`), C = `clip` and C_low = `clip_low` (1/C when None), as verl's rollout correction:
    - `rollout_is_{mean,min,max}` of ρ; `rollout_is_std` (population) and `rollout_is_eff_sample_size`
      = (Σ w)² / (N Σ w²) of w = clamp(ρ, C_low, C);
    - `rollout_is_ratio_fraction_high` / `_low`: the fraction of tokens with ρ > C / ρ < C_low.
    From the token ratios ρ_t = exp(log ρ_t), whatever the level:
    - `kl` = mean(−log ρ) and `k3_kl` = mean(ρ − log ρ − 1), two estimates of KL(μ ‖ π_old);
    - `chi2_token` = mean(ρ²) − 1; `chi2_seq` = mean over sequences with a valid token of ρ_seq² − 1, with
      log ρ_seq = clamp(Σ_t m_t log ρ_t, −20, 20);
    - TRL's `sampling_logp_difference/{mean,max}` of |log ρ_t| = |ℓ^old − ℓ^ro|.
    With N = 0 the neutral values are returned (ratios 1, divergences and fractions 0, ESS 1).
    """
    check_choice("level", level, IS_LEVELS)
    valid = as_token_mask(mask, log_ratio)
    if not bool(valid.any()):
        return dict(_NEUTRAL_RATIO_DIAGNOSTICS)
    lower = 1.0 / clip if clip_low is None else clip_low
    log_ratio = log_ratio.detach().float()
    ratio = log_ratio.exp()
    level_ratio = _level_log_ratio(log_ratio, valid, level).exp()
    clamped = level_ratio.clamp(min=lower, max=clip)
    clamped_mean = masked_mean(clamped, valid)
    sequence_log_ratio = masked_sum(log_ratio, valid, dim=1).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    logp_difference = log_ratio.abs()
    return scalars_to_floats({
        "rollout_is_mean": masked_mean(level_ratio, valid),
        "rollout_is_std": masked_mean((clamped - clamped_mean).square(), valid).sqrt(),
        "rollout_is_min": torch.where(valid, level_ratio, math.inf).amin(),
        "rollout_is_max": torch.where(valid, level_ratio, -math.inf).amax(),
        "rollout_is_eff_sample_size": normalised_effective_sample_size(clamped, valid),
        "rollout_is_ratio_fraction_high": masked_mean((level_ratio > clip).float(), valid),
        "rollout_is_ratio_fraction_low": masked_mean((level_ratio < lower).float(), valid),
        "kl": masked_mean(-log_ratio, valid),
        "k3_kl": masked_mean(ratio - log_ratio - 1.0, valid),
        "chi2_token": masked_mean(ratio.square(), valid) - 1.0,
        "chi2_seq": masked_mean((2.0 * sequence_log_ratio).exp(), valid.any(dim=1)) - 1.0,
        "sampling_logp_difference/mean": masked_mean(logp_difference, valid),
        "sampling_logp_difference/max": torch.where(valid, logp_difference, 0.0).amax(),
    })


def perplexity_diagnostics(logp_old: Tensor, logp_rollout: Tensor, mask: Tensor) -> dict[str, float]:
    """verl's perplexities, averaged over the sequences with a valid token (per-sequence values first):
    `training_ppl` = mean_b exp(−mean_t ℓ^old), `rollout_ppl` = mean_b exp(−mean_t ℓ^ro) and
    `ppl_ratio` = mean_b exp(mean_t ℓ^ro − mean_t ℓ^old), the training over the rollout perplexity (> 1 when the
    trainer finds the sampled tokens less likely than the engine did). 1 each when no token is valid."""
    valid = as_token_mask(mask, logp_old, logp_rollout)
    sequences = valid.any(dim=1)
    if not bool(sequences.any()):
        return dict(_NEUTRAL_PERPLEXITIES)
    mean_old = masked_mean(logp_old.detach().float(), valid, dim=1)
    mean_rollout = masked_mean(logp_rollout.detach().float(), valid, dim=1)
    return scalars_to_floats({
        "training_ppl": masked_mean((-mean_old).exp(), sequences),
        "rollout_ppl": masked_mean((-mean_rollout).exp(), sequences),
        "ppl_ratio": masked_mean((mean_rollout - mean_old).exp(), sequences),
    })


def commit_ratio_diagnostics(choice_old: Tensor, choice_rollout: Tensor, mask: Tensor) -> dict[str, float]:
    """The commit part of the complete ratio alone, over the valid positions: with log ρ^c_t = clamp(c^old_t −
    c^ro_t, ±20) the commit choice's log-ratio at position t (`sampling.diffusion.choice.CommitChoice.step_logprobs`, replayed
    by the trainer and recorded by the sampler) and log ρ^c_b = clamp(Σ_t log ρ^c_t, ±20) a sequence's,
    `commit_k3_kl` = mean_t(ρ^c_t − log ρ^c_t − 1), `commit_eff_sample_size` = (Σ_b ρ^c_b)² / (n Σ_b (ρ^c_b)²) over
    the n sequences with a valid position, and `commit_seq_log_ratio_mean` = mean_b log ρ^c_b."""
    valid = as_token_mask(mask, choice_old, choice_rollout)
    sequences = valid.any(dim=1)
    if not bool(sequences.any()):
        return {"commit_k3_kl": 0.0, "commit_eff_sample_size": 1.0, "commit_seq_log_ratio_mean": 0.0}
    log_ratio = log_importance_ratio(choice_old, choice_rollout, valid)
    sequence_log_ratio = masked_sum(log_ratio, valid, dim=1).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    shifted = (sequence_log_ratio - sequence_log_ratio[sequences].max()).exp()  # ESS is scale-free
    return scalars_to_floats({
        "commit_k3_kl": masked_mean(log_ratio.exp() - log_ratio - 1.0, valid),
        "commit_eff_sample_size": normalised_effective_sample_size(shifted, sequences),
        "commit_seq_log_ratio_mean": masked_mean(sequence_log_ratio, sequences),
    })


def carry_unscored_terms(log_terms: Tensor, scored: Tensor) -> Tensor:
    """[B, L] `log_terms` with each row's terms after its last `scored` position added to that position (a row with
    none scored unchanged). The complete ratio is the whole trajectory's: the positions after a completion's first
    EOS, which the loss does not score, were drawn and chosen too, and their part of the ratio rides on the last
    scored position (the EOS), so that a sequence's sum over its scored positions is the trajectory's."""
    scored = scored.bool()
    positions = torch.arange(scored.shape[1], device=scored.device)
    last = torch.where(scored, positions, -1).amax(dim=1, keepdim=True)
    tail = positions > last
    carried = torch.where(tail & (last >= 0), log_terms, 0.0).sum(dim=1, keepdim=True)
    return log_terms + torch.where(positions == last, carried, 0.0)


def _level_log_ratio(log_ratio: Tensor, valid: Tensor, level: str) -> Tensor:
    """The log-ratio at `level`, broadcast to every token of its sequence:
    token: log ρ_t; sequence: clamp(Σ_t m_t log ρ_t, ±20); geometric: mean_t log ρ_t."""
    if level == "token":
        return log_ratio
    if level == "sequence":
        per_sequence = masked_sum(log_ratio, valid, dim=1).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    else:
        per_sequence = masked_mean(log_ratio, valid, dim=1)
    return torch.where(valid, per_sequence.unsqueeze(1), 0.0)


def _weight_summary(weights: Tensor, valid: Tensor) -> dict[str, Tensor]:
    """TRL's `importance_sampling_ratio/{min,mean,max}`: the weights applied, over the valid tokens."""
    return {
        "importance_sampling_ratio/min": torch.where(valid, weights, math.inf).amin(),
        "importance_sampling_ratio/mean": masked_mean(weights, valid),
        "importance_sampling_ratio/max": torch.where(valid, weights, -math.inf).amax(),
    }


# ---------------------------------------------------------------------------------------------
# TIS / MIS / sequence / geometric importance weights, ACR
# ---------------------------------------------------------------------------------------------
def importance_weights(
    logp_old: Tensor,
    logp_rollout: Tensor,
    mask: Tensor,
    *,
    level: str = "token",
    mode: str = "truncate",
    clip: float = 2.0,
    clip_low: float | None = None,
    normalize: bool = False,
) -> tuple[Tensor, dict[str, float]]:
    """Importance weights w_t from the ratio ρ at `level` (token ρ_t, sequence
    ρ_seq = exp(Σ_t m_t log ρ_t), or geometric ρ_geo = exp(mean_t log ρ_t), each broadcast to
    the sequence's tokens), with C = `clip` and C_low = `clip_low` (0 when None):

    - mode "truncate" (TIS): w = min(ρ, C), and max(·, C_low) when clip_low is given;
    - mode "mask" (MIS): w = ρ · 1[C_low ≤ ρ ≤ C].
    With `normalize`, w ← w / mean_valid(w) afterwards, so the mean weight over valid tokens is 1.

    Returns (weights, diagnostics): `ratio_diagnostics` at `level` with these thresholds,
    `perplexity_diagnostics`, `importance_sampling_ratio/{min,mean,max}` of the returned weights, and in mode
    "mask" `rollout_rs_masked_fraction`: the fraction of valid tokens whose weight was zeroed.
    """
    check_choice("level", level, IS_LEVELS)
    check_choice("mode", mode, IS_MODES)
    if not clip > 0:
        raise ValueError(f"clip must be > 0; got {clip}")
    lower = 0.0 if clip_low is None else clip_low
    if not 0 <= lower <= clip:
        raise ValueError(f"clip_low must lie in [0, clip={clip}]; got {clip_low}")
    valid = as_token_mask(mask, logp_old, logp_rollout)
    log_ratio = log_importance_ratio(logp_old, logp_rollout, valid)
    ratio = _level_log_ratio(log_ratio, valid, level).exp()
    outside = valid & ((ratio > clip) | (ratio < lower))
    if mode == "truncate":
        weights = ratio.clamp(min=lower, max=clip)
    else:
        weights = torch.where(outside, 0.0, ratio)
    weights = torch.where(valid, weights, 0.0)
    if normalize:
        mean_weight = masked_mean(weights, valid)
        weights = torch.where(mean_weight > 0, weights / mean_weight, weights)
    diagnostics = ratio_diagnostics(log_ratio, valid, level=level, clip=clip, clip_low=clip_low)
    diagnostics.update(perplexity_diagnostics(logp_old, logp_rollout, valid))
    summary = _weight_summary(weights, valid)
    if mode == "mask":
        summary["rollout_rs_masked_fraction"] = masked_mean(outside.float(), valid)
    diagnostics.update(scalars_to_floats(summary))
    return weights, diagnostics


def acr_clip_scale(log_ratio: Tensor, mask: Tensor, clip: float = 2.0) -> Tensor:
    """QuRL adaptive clipping range: c_t = min(1, C/ρ_t) = exp(min(0, log C − log ρ_t)),
    detached float32, 1 at invalid positions. The loss widens its upper clip bound to
    (1 + ε_high)/c_t, so TIS truncation at C does not also shrink the trust region."""
    if not clip > 0:
        raise ValueError(f"clip must be > 0; got {clip}")
    valid = as_token_mask(mask, log_ratio)
    scale = (math.log(clip) - log_ratio.detach().float()).clamp(max=0.0).exp()
    return torch.where(valid, scale, 1.0)


# ---------------------------------------------------------------------------------------------
# AIS (this project's formulation)
# ---------------------------------------------------------------------------------------------
def gate_alpha(
    reliability: float,
    severity: float,
    variance_amplification: float,
    scale: float,
    alpha_max: float = 1.0,
) -> float:
    """The AIS gate: α = α_max · (1 − exp(−severity / scale)) · R / max(1, V), with R the weight reliability and
    V the variance amplification. α is 0 without severity, grows with it (63 % of the way at severity = scale),
    and backs off as the weights degenerate (R falls) or inflate the gradient signal (V rises).

    The "adaptive" rule (default) passes the mismatch shift's significance in noise units, (z² − 1)₊, with a
    dimensionless scale; the "gate" rule passes the k3 divergence D with a scale κ in KL units."""
    return alpha_max * -math.expm1(-severity / scale) * reliability / max(1.0, variance_amplification)


def oracle_alpha(mismatch_shift: float, mismatch_shift_se: float) -> float:
    """Plug-in MSE-optimal mix of a biased and an unbiased estimate: α = b̂² / (b̂² + σ̂²), with b̂ the mismatch
    shift and σ̂ its standard error; α = 0 when both are 0. (b̂² overestimates b² by σ̂² on average, so with no
    systematic shift this α averages about 0.3, not 0.)"""
    bias_squared = mismatch_shift**2
    total = bias_squared + mismatch_shift_se**2
    return bias_squared / total if total > 0 else 0.0


MIN_GROUPS_FOR_NOISE = 4
"""The adaptive and oracle rules measure the batch's gradient noise across its GRPO groups; with fewer groups
than this the noise estimate has no usable reference distribution (t² with < 3 degrees of freedom has no mean),
and α follows the k3 gate instead."""


def mismatch_shift_statistics(tis_weights: Tensor, token_advantages: Tensor, valid: Tensor,
                              group_size: int = 1) -> dict[str, Tensor]:
    """How much the correction would move the policy-gradient signal, and how much of that is systematic.

    With d_t = (w_t − 1) Â_t per valid token (the change TIS makes to token t's signal Â_t), over the N valid
    tokens and the batch's G groups (consecutive runs of `group_size` sequences: GRPO's completions of one prompt):

    - `mismatch_shift` b̂ = mean_t d_t: the shift of the surrogate's signal that leaving the mismatch uncorrected
      keeps (the uncorrected gradient's bias, seen through the advantages);
    - `mismatch_shift_se` σ̂: its cluster-robust standard error with the groups as clusters and the small-sample
      factor G/(G − 1), σ̂² = G/(G − 1) · Σ_g (Σ_{t∈g} d_t − N_g b̂)² / N² — a completion's tokens share its
      advantage, and a group's advantages are measured from their common mean, so the batch's independent units
      are its prompts (σ̂ = 0 with one group);
    - `shift_significance` z² = b̂² / σ̂² (0 when σ̂ = 0): the shift in units of the batch's own gradient noise.
      When the mismatch is unrelated to the rewards (noise, exploration) z² is approximately a squared Student t
      with G − 1 degrees of freedom, of mean (G − 1)/(G − 3) (→ 1, a χ²₁ draw, for many groups); when it
      systematically favours low- or high-advantage completions z² grows with the batch.
    - `severity` = (z² (G − 3)/(G − 1) − 1)₊: the excess over what noise alone gives on average, the default
      rule's severity; 0 with fewer than `MIN_GROUPS_FOR_NOISE` groups, where that reference does not exist.
    - `num_groups` G.
    """
    if group_size < 1 or valid.shape[0] % group_size:
        raise ValueError(f"group_size must divide the batch of {valid.shape[0]} sequences; got {group_size}")
    num_groups = valid.shape[0] // group_size
    shift = torch.where(valid, (tis_weights - 1.0) * token_advantages, 0.0)
    num_tokens = valid.sum().float()
    shift_mean = shift.sum() / num_tokens.clamp(min=1)

    def per_group(values: Tensor) -> Tensor:
        return values.sum(dim=1).view(-1, group_size).sum(dim=1)

    residual = per_group(shift) - per_group(valid.float()) * shift_mean  # per group: Σ_t d_t − N_g b̂
    small_sample = num_groups / (num_groups - 1) if num_groups > 1 else 0.0
    standard_error = (small_sample * residual.square().sum()).sqrt() / num_tokens.clamp(min=1)
    significance = torch.where(standard_error > 0, shift_mean.square() / standard_error.square().clamp(min=1e-30), 0.0)
    null_mean = (num_groups - 1) / (num_groups - 3) if num_groups >= MIN_GROUPS_FOR_NOISE else math.inf
    return {
        "mismatch_shift": shift_mean,
        "mismatch_shift_se": standard_error,
        "shift_significance": significance,
        "severity": (significance / null_mean - 1.0).clamp(min=0.0),
        "num_groups": torch.tensor(float(num_groups), device=shift_mean.device),
    }


def _mixing_coefficient(rule: AlphaRule, rule_inputs: dict[str, float]) -> float:
    """α from the rule (built-in name or user callable on the diagnostics), clamped to [0, 1]."""
    if rule in ("adaptive", "oracle") and rule_inputs["num_groups"] < MIN_GROUPS_FOR_NOISE:
        rule = "gate"  # too few groups to measure the batch's noise
    if rule == "adaptive":
        raw = gate_alpha(rule_inputs["reliability"], rule_inputs["severity"], rule_inputs["variance_amplification"],
                         rule_inputs["snr_scale"], rule_inputs["alpha_max"])
    elif rule == "gate":
        raw = gate_alpha(rule_inputs["reliability"], rule_inputs["k3_kl"], rule_inputs["variance_amplification"],
                         rule_inputs["kl_scale"], rule_inputs["alpha_max"])
    elif rule == "oracle":
        raw = oracle_alpha(rule_inputs["mismatch_shift"], rule_inputs["mismatch_shift_se"])
    else:
        raw = rule(dict(rule_inputs))
    rule_name = rule if isinstance(rule, str) else getattr(rule, "__name__", repr(rule))
    try:
        alpha = float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"AIS rule {rule_name} returned {raw!r}; it must return a number") from None
    if not math.isfinite(alpha):
        raise ValueError(f"AIS rule {rule_name} returned a non-finite alpha ({alpha})")
    return min(max(alpha, 0.0), 1.0)


def ais_weights(
    logp_old: Tensor,
    logp_rollout: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip: float = 2.0,
    rule: AlphaRule = "adaptive",
    snr_scale: float = 4.0,
    kl_scale: float = 1e-3,
    alpha_max: float = 1.0,
    previous_alpha: float | None = None,
    alpha_ema: float = 0.0,
    group_size: int = 1,
) -> tuple[Tensor, dict[str, float]]:
    """AIS effective weights ŵ_t = (1 − α) + α · w_t at valid tokens (0 elsewhere), with
    w_t = min(ρ_t, C) the TIS weight — this project's formulation of AIS.

    Batch diagnostics over the N valid tokens (Â_t = advantage of token t's sequence):
    reliability R = (Σ w)²/(N Σ w²); variance_amplification V = Σ (w Â)² / Σ Â² (1 when all Â are 0);
    the divergence D = mean(ρ − log ρ − 1) (`k3_kl`); and the mismatch shift of the gradient signal with its
    noise and significance (`mismatch_shift_statistics` over the G groups of `group_size` consecutive sequences,
    the completions of one prompt: b̂, σ̂, z², severity = (z² (G − 3)/(G − 1) − 1)₊).

    α comes from `rule`:
    - "adaptive" (default): `gate_alpha(R, severity, V, snr_scale)` — scale-free: the mismatch is corrected
      when its systematic effect on the gradient stands out of the batch's own gradient noise (z² ≫ its null
      mean), however large D is in absolute terms (tiny models under FP8 show D ≈ 1e-2, LLaDA-8B ≈ 1e-3);
    - "gate": `gate_alpha(R, D, V, kl_scale)` — the divergence against a fixed KL scale κ;
    - "oracle": `oracle_alpha(b̂, σ̂)`;
    - a callable taking the diagnostics dict (plus `clip`, `snr_scale`, `kl_scale`, `alpha_max`) and
      returning a number.
    "adaptive" and "oracle" need the batch's noise: with fewer than `MIN_GROUPS_FOR_NOISE` groups they follow
    "gate".
    α is clamped to [0, 1] (`alpha_max` is the gates' ceiling). With previous_alpha given and alpha_ema > 0,
    α ← alpha_ema · previous_alpha + (1 − alpha_ema) · α (`alpha_raw` is the value before smoothing).
    ŵ lies between 1 and w_t, so ŵ ≤ max(1, C); α = 0 gives ŵ = 1 and α = 1 gives exactly the TIS weights.
    """
    settings = CorrectionSettings("ais", clip=clip, ais_rule=rule if isinstance(rule, str) else "adaptive",
                                  ais_snr_scale=snr_scale, ais_kl_scale=kl_scale, ais_alpha_max=alpha_max,
                                  ais_alpha_ema=alpha_ema)
    if problems := settings.problems():
        raise ValueError("; ".join(problems))
    return _ais_weights(settings, logp_old, logp_rollout, advantages, mask, previous_alpha, group_size, rule)


def _ais_weights(settings: CorrectionSettings, logp_old: Tensor, logp_rollout: Tensor, advantages: Tensor,
                 mask: Tensor, previous_alpha: float | None, group_size: int,
                 rule: AlphaRule) -> tuple[Tensor, dict[str, float]]:
    if previous_alpha is not None and not 0 <= previous_alpha <= 1:
        raise ValueError(f"previous_alpha must lie in [0, 1] or be None; got {previous_alpha}")
    clip, alpha_ema = settings.clip, settings.ais_alpha_ema
    valid = as_token_mask(mask, logp_old, logp_rollout)
    token_advantages = broadcast_advantages(advantages, valid)

    tis_weights, diagnostics = importance_weights(logp_old, logp_rollout, valid, clip=clip)
    advantage_energy = masked_sum(token_advantages.square(), valid)
    diagnostics.update(scalars_to_floats({
        "reliability": normalised_effective_sample_size(tis_weights, valid),
        "variance_amplification": torch.where(
            advantage_energy > 0,
            masked_sum((tis_weights * token_advantages).square(), valid) / advantage_energy,
            1.0,
        ),
        **mismatch_shift_statistics(tis_weights, token_advantages, valid, group_size),
        "num_tokens": valid.sum().float(),
    }))

    alpha = _mixing_coefficient(rule, {**diagnostics, "clip": clip, "snr_scale": settings.ais_snr_scale,
                                       "kl_scale": settings.ais_kl_scale, "alpha_max": settings.ais_alpha_max})
    diagnostics["alpha_raw"] = alpha
    if previous_alpha is not None and alpha_ema > 0:
        alpha = alpha_ema * previous_alpha + (1.0 - alpha_ema) * alpha
    diagnostics["alpha"] = alpha

    # lerp is exact at both ends: α = 0 → 1, α = 1 → w, and w = 1 → 1 for every α.
    effective = torch.where(valid, torch.lerp(torch.ones_like(tis_weights), tis_weights, alpha), 0.0)
    diagnostics.update(scalars_to_floats(_weight_summary(effective, valid)))
    return effective, diagnostics


# ---------------------------------------------------------------------------------------------
# The settings, their rules, and the correction of a generation batch
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Correction:
    """A correction's output for the loss: detached float32 per-token weights [B, L] (0 at
    invalid positions), the ACR clip scale c_t [B, L] (None unless method "acr"), and the
    diagnostics to log."""

    weights: Tensor
    clip_scale: Tensor | None
    diagnostics: dict[str, float]


def correct(settings: CorrectionSettings, logp_old: Tensor, logp_rollout: Tensor, advantages: Tensor, mask: Tensor,
            previous_alpha: float | None = None, group_size: int = 1, rule: AlphaRule | None = None) -> Correction:
    """Apply the rollout-mismatch correction `settings.method` (the config's `correction` settings group,
    `dllm_ais.config.CorrectionSettings`); `previous_alpha` is the smoothed α of the previous generation batch (AIS
    with ais_alpha_ema > 0), `group_size` the GRPO group size G (AIS's noise is measured across groups) and `rule`
    replaces `settings.ais_rule` (e.g. a callable diagnostics → α).

    For "none" the level, clip and clip_low are only the diagnostics' thresholds. The diagnostics come under the
    names they are logged with (`logged_name`): verl's rollout-correction metrics `rollout_corr/*`, TRL's
    `sampling/importance_sampling_ratio/{min,mean,max}` (the weights applied; absent for "none") and
    `sampling/sampling_logp_difference/{mean,max}`, and the AIS diagnostics (α, ...) `ais/*`.
    """
    method = settings.method
    valid = as_token_mask(mask, logp_old, logp_rollout)
    if method == "none":
        log_ratio = log_importance_ratio(logp_old, logp_rollout, valid)
        diagnostics = ratio_diagnostics(log_ratio, valid, level=settings.level, clip=settings.clip,
                                        clip_low=settings.clip_low)
        diagnostics.update(perplexity_diagnostics(logp_old, logp_rollout, valid))
        return Correction(valid.float(), None, _logged(diagnostics))
    if method == "ais":
        weights, diagnostics = _ais_weights(settings, logp_old, logp_rollout, advantages, valid, previous_alpha,
                                            group_size, rule or settings.ais_rule)
        return Correction(weights, None, _logged(diagnostics))
    weights, diagnostics = importance_weights(
        logp_old, logp_rollout, valid, level=settings.level, mode="mask" if method == "mis" else "truncate",
        clip=settings.clip, clip_low=settings.clip_low, normalize=settings.normalize,
    )
    clip_scale = None
    if method == "acr":
        clip_scale = acr_clip_scale(log_importance_ratio(logp_old, logp_rollout, valid), valid, settings.clip)
    return Correction(weights, clip_scale, _logged(diagnostics))


def _logged(diagnostics: dict[str, float]) -> dict[str, float]:
    return {logged_name(key): value for key, value in diagnostics.items()}


class RolloutCorrection:
    """The correction a run applies to each generation batch: its settings (the config's `correction` group), the
    GRPO group size, the α rule (`settings.ais_rule`, or a callable) and, for AIS, the moving average of α
    (`previous_alpha`, the state a checkpoint keeps).

    Every correction mode goes through here. In bypass mode (verl's) the old log-probs are the rollout's, so there is
    nothing to weight: the weights are 1, and the mismatch is measured in the batch's first update instead
    (`first_update_diagnostics`, where θ = θ_old)."""

    def __init__(self, settings: CorrectionSettings, group_size: int = 1, rule: AlphaRule | None = None):
        problems = settings.problems()
        if problems or group_size < 1:
            raise ValueError("; ".join(problems or [f"the group size must be >= 1; got {group_size}"]))
        self.settings = settings
        self.group_size = group_size
        self.rule = rule or settings.ais_rule
        self.previous_alpha: float | None = None

    def __call__(self, pairs: list[tuple[Tensor, Tensor]], advantages: Tensor, masks: list[Tensor],
                 choice_pair: tuple[Tensor, Tensor] | None = None) -> list[Correction]:
        """One `Correction` per estimator seed's (ℓ_old, ℓ_rollout), over that seed's scored positions `masks[i]`
        [B, L]; AIS's α average then advances once, over the seeds. In bypass mode: weights 1 at the scored
        positions and no diagnostics (see `first_update_diagnostics`).

        `choice_pair` (c_old, c_rollout) [B, L] (`experimental.complete_ratio`): the commit choice's log-probs, the
        trainer's and the sampler's; every method then corrects with the complete ratio, ℓ + c on both sides (in
        bypass mode, where ℓ_old = ℓ_rollout, the commit ratio alone), and the diagnostics gain the commit part's
        (`commit_ratio_diagnostics`)."""
        if choice_pair is None and self.settings.bypass_mode:
            return [Correction(mask.float(), None, {}) for mask in masks]
        if choice_pair is not None:
            choice_old, choice_rollout = choice_pair
            pairs = [(carry_unscored_terms(old + choice_old, mask), carry_unscored_terms(rollout + choice_rollout, mask))
                     for (old, rollout), mask in zip(pairs, masks, strict=True)]
        corrections = [correct(self.settings, old, rollout, advantages, mask, self.previous_alpha, self.group_size,
                               self.rule)
                       for (old, rollout), mask in zip(pairs, masks, strict=True)]
        if choice_pair is not None:
            for correction, mask in zip(corrections, masks):
                correction.diagnostics.update(_logged(commit_ratio_diagnostics(choice_old, choice_rollout, mask)))
        if self.settings.method == "ais":
            self.previous_alpha = sum(c.diagnostics["ais/alpha"] for c in corrections) / len(corrections)
        return corrections

    def first_update_diagnostics(self, logp_theta: Tensor, logp_rollout: Tensor, scored: Tensor) -> dict[str, float]:
        """Bypass mode's mismatch diagnostics (`rollout_corr/*`, `sampling/sampling_logp_difference/*`): those of
        method none between ℓ_θ [B, L] of a batch's first update, where θ = θ_old (no optimizer step has been taken
        since the batch was sampled), and ℓ_rollout [B, L], over the `scored` positions."""
        return correct(self.settings, logp_theta, logp_rollout, logp_theta.new_zeros(len(logp_theta)),
                       scored).diagnostics
