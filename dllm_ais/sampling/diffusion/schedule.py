"""How many positions a denoising step commits: the fixed schedules (LLaDA's even split, Dream's time-linear and
``origin`` counts) and parallel decoding's data-dependent counts (Fast-dLLM's threshold and factor rules)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from dllm_ais.sampling.diffusion.sampler_config import DiffusionSamplerConfig

__all__ = ["origin_commit_counts", "parallel_commit_counts", "scheduled_counts", "scheduled_floor",
           "time_linear_commit_count", "transfer_schedule"]


def transfer_schedule(masked_counts: torch.Tensor, steps: int) -> torch.LongTensor:
    """[B, steps] number of tokens to commit at each step of a block holding `masked_counts` [B] masked positions.

    The count n_b is split evenly, the remainder going one each to the first steps:
    ``schedule[b, s] = n_b // steps + (s < n_b % steps)``, so each row sums to n_b.
    """
    counts = masked_counts.long().reshape(-1, 1)
    step_index = torch.arange(steps, device=counts.device)
    return counts // steps + (step_index < counts % steps).long()


def time_linear_commit_count(masked_count: int, step: int, steps: int, eps: float) -> int:
    """Tokens to commit at `step` (0-based) of `steps` when `masked_count` positions are still masked, on Dream's
    schedule: with t_i = linspace(1, ε, steps + 1)[i], ⌊n (1 − t_{i+1} / t_i)⌋ in float32 as the official code
    computes it, and every remaining position at the last step."""
    if step >= steps - 1:
        return masked_count
    times = torch.linspace(1, eps, steps + 1)
    return int(torch.tensor(float(masked_count)) * (1 - times[step + 1] / times[step]))


def origin_commit_counts(masked_counts: list[int], step: int, steps: int, eps: float,
                         generator: torch.Generator | None) -> list[int]:
    """Per row, how many still-masked positions Dream's ``origin`` rule commits at `step`: each of the n_b positions
    independently with probability p = 1 − t_{i+1} / t_i (every one at the last step), i.e. a Binomial(n_b, p)
    count of uniformly random positions, drawn from `generator`."""
    if step >= steps - 1:
        return list(masked_counts)
    times = torch.linspace(1, eps, steps + 1)
    device = generator.device if generator is not None else torch.device("cpu")
    counts = torch.tensor(masked_counts, dtype=torch.float32, device=device)
    probability = torch.full_like(counts, float(1 - times[step + 1] / times[step]))
    return torch.binomial(counts, probability, generator=generator).long().tolist()


def parallel_commit_counts(
    scores: torch.Tensor, still_masked: torch.Tensor, threshold: float | None = None, factor: float | None = None
) -> torch.LongTensor:
    """[B] how many still-masked block positions to commit this step with parallel decoding.

    With c_(1) ≥ c_(2) ≥ … the row's scores over its still-masked positions (`scores` [B, Lb], `still_masked`
    [B, Lb]; under low_confidence remasking the scores are the candidates' probabilities), the count is the largest
    n with c_(n) > τ (`threshold`) or with (n + 1)(1 − c_(n)) < f (`factor`); at least 1 while the row has a
    masked position, 0 once its block is filled. Committing the top-n scores then commits exactly the positions
    above τ (Fast-dLLM's rule).
    """
    if (threshold is None) == (factor is None):
        raise ValueError("parallel_commit_counts needs exactly one of threshold and factor.")
    masked_counts = still_masked.sum(dim=1)
    ranked = scores.float().masked_fill(~still_masked, -math.inf).sort(dim=1, descending=True).values
    rank = torch.arange(1, ranked.shape[1] + 1, device=ranked.device)
    passes = ranked > threshold if threshold is not None else (rank + 1) * (1 - ranked) < factor
    passes &= rank <= masked_counts.unsqueeze(1)
    largest = (passes * rank).amax(dim=1)
    return torch.minimum(largest.clamp(min=1), masked_counts)



def scheduled_counts(config: "DiffusionSamplerConfig", masked_left: list[int], block_schedule: list[int],
                     step_in_block: int, generator: torch.Generator | None) -> list[int]:
    """Per row, the tokens `config`'s fixed schedule commits at this step of a block: Binomial for ``origin``
    (`origin_commit_counts`), else the schedule's count: ``time_linear``'s of the masked positions left
    `masked_left`, or the even split of a whole block over its steps (`block_schedule`, `transfer_schedule`), at most
    the masked positions left (a block-causal model's first and last blocks hold fewer than block_length)."""
    steps_per_block = config.steps_per_block
    if config.remasking == "origin":
        return origin_commit_counts(masked_left, step_in_block, steps_per_block, config.schedule_eps, generator)
    if config.schedule == "time_linear":
        return [time_linear_commit_count(left, step_in_block, steps_per_block, config.schedule_eps)
                for left in masked_left]
    if step_in_block >= steps_per_block:  # parallel decoding past the schedule's steps
        return [0] * len(masked_left)
    return [min(block_schedule[step_in_block], left) for left in masked_left]


def scheduled_floor(config: "DiffusionSamplerConfig", still_masked: torch.Tensor, scheduled: int,
                    step_in_block: int) -> torch.Tensor:
    """[B] on the device: `config`'s fixed-schedule count at this step of a block-causal model's parallel decoding
    (`scheduled` the even schedule's), of each row's masked positions left (`scheduled_counts` without a host read)."""
    left = still_masked.sum(dim=1)
    if config.schedule == "time_linear":
        steps = config.steps_per_block
        if step_in_block >= steps - 1:
            return left
        times = torch.linspace(1, config.schedule_eps, steps + 1)
        return (left.float() * (1 - times[step_in_block + 1] / times[step_in_block]).to(left.device)).long()
    return left.clamp(max=scheduled)
