"""GRPO loss for diffusion and autoregressive policies, with the cumulative
token ratio of CTPO as an alternative policy ratio.

Formulas: docs/algorithms.md, section "GRPO loss".

Conventions: token tensors are [B, L]; `mask` (bool or 0/1) marks valid completion tokens;
advantages are [B], one per sequence. Invalid positions contribute exactly zero to the loss and
to its gradient, whatever the log-probs hold there (−inf, NaN): inputs are replaced with
`torch.where` before any arithmetic.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from dllm_ais.choices import LOSS_TYPES, RATIO_TYPES, REWARD_SCALINGS
from dllm_ais.correction import LOG_RATIO_BOUND
from dllm_ais.ops import as_token_mask, broadcast_advantages, check_choice, masked_sum, scalars_to_floats

REWARD_STD_EPSILON = 1e-4


def zero_std_groups(rewards: Tensor, num_generations: int) -> Tensor:
    """[N / G] bool: which groups of G = num_generations consecutive rewards [N] are all equal (TRL's
    `frac_reward_zero_std` counts them): their advantages are 0, so with β = 0 their tokens add nothing to the
    loss's gradient."""
    grouped = rewards.view(-1, num_generations)
    return grouped.amax(dim=1) == grouped.amin(dim=1)


def group_advantages(rewards: Tensor, num_generations: int, scale_rewards: str = "none") -> Tensor:
    """Group-relative advantages A_i = r_i − mean_{j ∈ group(i)} r_j for rewards [N] laid out as
    consecutive groups of G = num_generations completions of the same prompt.

    scale_rewards (TRL semantics): "none" (d1 default); "group": A_i / (std_group(r) + 1e-4);
    "batch": A_i / (std_batch(r) + 1e-4), std being the unbiased standard deviation.
    Returns float32 [N].
    """
    check_choice("scale_rewards", scale_rewards, REWARD_SCALINGS)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N]; got shape {tuple(rewards.shape)}")
    if num_generations < 1 or rewards.numel() % num_generations:
        raise ValueError(
            f"the number of rewards ({rewards.numel()}) must be a positive multiple of "
            f"num_generations ({num_generations})"
        )
    if scale_rewards == "group" and num_generations < 2:
        raise ValueError("scale_rewards='group' needs num_generations >= 2 to estimate a std")
    if scale_rewards == "batch" and rewards.numel() < 2:
        raise ValueError("scale_rewards='batch' needs at least 2 rewards to estimate a std")
    grouped = rewards.float().view(-1, num_generations)
    advantages = (grouped - grouped.mean(dim=1, keepdim=True)).flatten()
    if scale_rewards == "group":
        return advantages / (grouped.std(dim=1).repeat_interleave(num_generations) + REWARD_STD_EPSILON)
    if scale_rewards == "batch":
        return advantages / (rewards.float().std() + REWARD_STD_EPSILON)
    return advantages


def k3_kl(logp: Tensor, logp_ref: Tensor) -> Tensor:
    """Elementwise k3 estimate of KL(π_θ ‖ π_ref): exp(ℓ_ref − ℓ_θ) − (ℓ_ref − ℓ_θ) − 1 ≥ 0."""
    log_ratio = logp_ref - logp
    return log_ratio.exp() - log_ratio - 1.0


class CTPORatio(NamedTuple):
    """CTPO's cumulative policy ratio and its position-scaled clip range, all [B, L]."""

    log_ratio: Tensor  # log R_t: value of the capped prefix sum, gradient through ℓ^θ_t only
    log_lower: Tensor  # −c_low · t^p
    log_upper: Tensor  # c_high · t^p
    position_scale: Tensor  # t^p; the dual-clip bound for A < 0 is exp(c_dual · t^p)


def ctpo_log_ratio(
    logp: Tensor,
    logp_old: Tensor,
    mask: Tensor,
    c_low: float = 0.025,
    c_high: float = 0.05,
    power: float = 0.5,
    cap: float = 10.0,
) -> CTPORatio:
    """CTPO cumulative token ratio:
    log R_t = min(sg(Σ_{j≤t} m_j δ_j), cap) + ℓ^θ_t − sg(ℓ^θ_t), δ_j = clamp(ℓ^θ_j − ℓ^old_j, ±20),
    so its value is the (capped) log-ratio of the whole prefix while its gradient is ∇ℓ^θ_t.
    The clip range is log R_t ∈ [−c_low · t^p, c_high · t^p] with t the 1-based count of valid
    tokens up to and including t. Every returned tensor is 0 at invalid positions.
    """
    if not (c_low > 0 and c_high > 0 and power >= 0 and cap > 0):
        raise ValueError(
            f"CTPO needs c_low > 0, c_high > 0, power >= 0 and cap > 0; got c_low={c_low}, "
            f"c_high={c_high}, power={power}, cap={cap}"
        )
    valid = as_token_mask(mask, logp, logp_old)
    logp = torch.where(valid, logp.float(), 0.0)
    log_delta = (logp.detach() - logp_old.detach().float()).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    prefix_log_ratio = torch.where(valid, log_delta, 0.0).cumsum(dim=1).clamp(max=cap)
    log_ratio = prefix_log_ratio + (logp - logp.detach())
    position_scale = torch.where(valid, valid.float().cumsum(dim=1).pow(power), 0.0)
    return CTPORatio(
        log_ratio=torch.where(valid, log_ratio, 0.0),
        log_lower=-c_low * position_scale,
        log_upper=c_high * position_scale,
        position_scale=position_scale,
    )


def loss_coefficients(
    valid: Tensor,
    loss_type: str,
    max_completion_length: int | None,
    num_items_in_batch: int | float | Tensor | None,
) -> Tensor:
    """The per-token normalisation c [B, L] (0 at invalid tokens) with which TRL's aggregations are a plain sum,
    loss = Σ_{b,t} c_{b,t} · L_{b,t}: "grpo" c = 1 / (B · n_b), n_b the valid tokens of row b; "bnpo" 1 / Σ_b n_b;
    "dr_grpo" 1 / (B · max_completion_length); "dapo" 1 / num_items_in_batch, or 1 / Σ_b n_b when None. Fixed up
    front from the mask alone, so the loss of a micro-batch can be summed token group by token group."""
    counts = valid.float()
    if loss_type == "grpo":
        return counts / (valid.shape[0] * counts.sum(dim=1, keepdim=True).clamp(min=1))
    if loss_type == "dr_grpo":
        return counts / (valid.shape[0] * max_completion_length)
    if loss_type == "dapo" and num_items_in_batch is not None:
        return counts / num_items_in_batch
    return counts / counts.sum().clamp(min=1)


class TokenLoss:
    """The clipped GRPO loss of one micro-batch as a sum over its tokens, everything but ℓ_θ fixed up front.

    Per valid token, with r_t the policy ratio, A the sequence's advantage and w_t the weight:
        L_t = −min(r_t A, clip(r_t, lo_t, hi_t) A) · w_t + β · KL_t,  KL_t = k3_kl(ℓ^θ, ℓ^ref),
    and loss = Σ_t c_t · L_t with c from `loss_coefficients`. ratio_type "token": r_t = exp(ℓ^θ_t − ℓ^old_t),
    lo = 1 − ε, hi = 1 + ε_high (ε_high defaults to ε). ratio_type "ctpo": r_t = R_t of `ctpo_log_ratio`,
    lo_t = exp(−c_low·t^p), hi_t = exp(c_high·t^p), and for A < 0 the dual clip floors the surrogate at
    exp(c_dual·t^p)·A (the prefix capped at ctpo_cap). ACR: with clip_scale c_t the upper bound becomes hi_t / c_t
    (for either ratio type).
    Everything is computed in float32; weights, clip_scale and the old/ref log-probs are detached.

    `self(logp, positions)` gives Σ_{t ∈ positions} c_t · L_t and the metrics' sums over those tokens, so that a
    caller holding the log-probs in pieces (`LogprobPiece`, each token in one piece) can backpropagate piece by
    piece: the pieces' losses add up to the loss at once, their gradients to its gradient, and `metrics` of the
    summed sums are the metrics at once. With "token" ratios L_t depends on ℓ^θ_t alone; the "ctpo" ratio's prefix
    needs every token's ℓ^θ, so it takes the whole completion in one piece.
    """

    def __init__(
        self,
        logp_old: Tensor,
        advantages: Tensor,
        mask: Tensor,
        *,
        weights: Tensor | None = None,
        clip_scale: Tensor | None = None,
        logp_ref: Tensor | None = None,
        beta: float = 0.0,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        loss_type: str = "dapo",
        max_completion_length: int | None = None,
        num_items_in_batch: int | float | Tensor | None = None,
        ratio_type: str = "token",
        ctpo_c_low: float = 0.025,
        ctpo_c_high: float = 0.05,
        ctpo_c_dual: float = 0.05,
        ctpo_power: float = 0.5,
        ctpo_cap: float = 10.0,
    ):
        check_choice("loss_type", loss_type, LOSS_TYPES)
        check_choice("ratio_type", ratio_type, RATIO_TYPES)
        epsilon_high = epsilon if epsilon_high is None else epsilon_high
        if not (epsilon >= 0 and epsilon_high >= 0):
            raise ValueError(f"epsilon and epsilon_high must be >= 0; got {epsilon}, {epsilon_high}")
        if not beta >= 0:
            raise ValueError(f"beta must be >= 0; got {beta}")
        if beta > 0 and logp_ref is None:
            raise ValueError("beta > 0 needs logp_ref (reference-policy log-probs); pass it or set beta=0")
        if loss_type == "dr_grpo" and not (max_completion_length and max_completion_length > 0):
            raise ValueError("loss_type='dr_grpo' needs a positive max_completion_length")
        if num_items_in_batch is not None and not num_items_in_batch > 0:
            raise ValueError(f"num_items_in_batch must be > 0 or None; got {num_items_in_batch}")
        optional_token_tensors = [t for t in (weights, clip_scale, logp_ref) if t is not None]
        valid = self.valid = as_token_mask(mask, logp_old, *optional_token_tensors)
        self.logp_old = torch.where(valid, logp_old.detach().float(), 0.0)
        self.advantages = broadcast_advantages(advantages, valid)
        self.weights = valid.float() if weights is None else torch.where(valid, weights.detach().float(), 0.0)
        self.clip_scale = None if clip_scale is None else torch.where(valid, clip_scale.detach().float(), 1.0)
        self.logp_ref = None if logp_ref is None else torch.where(valid, logp_ref.detach().float(), 0.0)
        self.coefficients = loss_coefficients(valid, loss_type, max_completion_length, num_items_in_batch)
        self.beta, self.epsilon, self.epsilon_high, self.ratio_type = beta, epsilon, epsilon_high, ratio_type
        self.ctpo = dict(c_low=ctpo_c_low, c_high=ctpo_c_high, power=ctpo_power, cap=ctpo_cap)
        self.ctpo_c_dual = ctpo_c_dual

    @property
    def takes_pieces(self) -> bool:
        """Whether the loss may be taken over the completion in pieces: with "token" ratios L_t depends on ℓ^θ_t
        alone; the "ctpo" ratio's prefix needs every token's ℓ^θ at once."""
        return self.ratio_type == "token"

    def __call__(self, logp: Tensor, positions: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """(Σ_{t ∈ positions} c_t · L_t, the metrics' sums over the valid tokens at `positions` [B, L] bool; all
        positions when None). Values of `logp` outside the positions never enter (they may be anything)."""
        as_token_mask(self.valid, logp)
        valid = self.valid if positions is None else self.valid & as_token_mask(positions, logp)
        if not self.takes_pieces and not torch.equal(valid, self.valid):
            raise ValueError("the ctpo ratio's prefix needs every token's log-prob: score the whole completion at "
                             "once, or use ratio_type='token'")
        logp = torch.where(valid, logp.float(), 0.0)
        logp_old = torch.where(valid, self.logp_old, 0.0)
        token_advantages = torch.where(valid, self.advantages, 0.0)

        dual_bound = None
        if self.ratio_type == "token":
            log_ratio = logp - logp_old
            lower_bound = torch.full_like(log_ratio, 1.0 - self.epsilon)
            upper_bound = torch.full_like(log_ratio, 1.0 + self.epsilon_high)
        else:
            ctpo = ctpo_log_ratio(logp, logp_old, valid, **self.ctpo)
            log_ratio = ctpo.log_ratio
            lower_bound = ctpo.log_lower.exp()
            upper_bound = ctpo.log_upper.exp()
            dual_bound = (self.ctpo_c_dual * ctpo.position_scale).exp()
        if self.clip_scale is not None:
            upper_bound = upper_bound / self.clip_scale

        ratio = log_ratio.exp()
        clipped_ratio = ratio.clamp(min=lower_bound, max=upper_bound)
        surrogate = torch.minimum(ratio * token_advantages, clipped_ratio * token_advantages)
        if dual_bound is not None:
            surrogate = torch.where(
                token_advantages < 0, torch.maximum(surrogate, dual_bound * token_advantages), surrogate
            )
        per_token_loss = -surrogate * self.weights
        if self.logp_ref is not None:
            kl = k3_kl(logp, torch.where(valid, self.logp_ref, 0.0))
            if self.beta > 0:
                per_token_loss = per_token_loss + self.beta * kl
        loss = torch.where(valid, self.coefficients * per_token_loss, 0.0).sum()

        ratio = ratio.detach()
        clipped_low = (ratio < lower_bound) & (token_advantages < 0)
        clipped_high = (ratio > upper_bound) & (token_advantages > 0)
        sums = {
            "clip_ratio/low_mean": masked_sum(clipped_low.float(), valid),
            "clip_ratio/high_mean": masked_sum(clipped_high.float(), valid),
            "clip_ratio/region_mean": masked_sum((clipped_low | clipped_high).float(), valid),
            "policy_ratio/mean": masked_sum(ratio, valid),
        }
        if dual_bound is not None:
            sums["clip_ratio/dual_mean"] = masked_sum(((ratio > dual_bound) & (token_advantages < 0)).float(), valid)
        if self.logp_ref is not None:
            sums["kl"] = masked_sum(kl.detach(), valid)
        return loss, sums

    def metrics(self, sums: dict[str, Tensor]) -> dict[str, float]:
        """The metrics (python floats, means over the micro-batch's valid tokens) from the pieces' summed sums:
        `clip_ratio/{low,high,region}_mean` (clipped below with A < 0, above with A > 0, either),
        `clip_ratio/dual_mean` (ctpo only), `policy_ratio/mean`, and `kl` (mean k3) when logp_ref is given."""
        count = self.valid.sum().clamp(min=1)
        return scalars_to_floats({name: total / count for name, total in sums.items()})


def grpo_loss(logp: Tensor, logp_old: Tensor, advantages: Tensor, mask: Tensor,
              **settings) -> tuple[Tensor, dict[str, float]]:
    """Clipped GRPO surrogate with per-token correction weights, over the whole micro-batch at once: the loss and
    metrics of `TokenLoss(logp_old, advantages, mask, **settings)` (see it for the formula and the settings).

    Aggregation (TRL, `loss_coefficients`): "grpo" mean over sequences of the per-sequence token mean; "bnpo" sum
    over the number of valid tokens here; "dr_grpo" sum / (B · max_completion_length); "dapo" sum /
    num_items_in_batch — the valid-token count of the whole global batch across gradient accumulation (under DDP,
    which averages gradients, divide it by the number of processes) — or the local valid-token count when None.
    """
    objective = TokenLoss(logp_old, advantages, mask, **settings)
    loss, sums = objective(logp)
    return loss, objective.metrics(sums)
