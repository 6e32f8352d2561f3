"""The statistics every comparison in dllm-ais reports: standard errors, paired differences over the same prompts,
and the aggregation of one value per seed into a mean with its seed-to-seed standard error and 95 % interval.

Evaluation (before/after training), the benchmarks (a variant against the reference decoder) and `dllm-ais compare`
(an arm against the baseline arm) all pair by prompt first, then, for several seeds, aggregate over seeds. The
functions take any one-dimensional sequence of numbers (a list or a tensor) and return plain floats; no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# Student t, two-sided 95 %, by degrees of freedom; between tabulated values the next smaller df is used (wider).
T_QUANTILE_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
                  10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101,
                  19: 2.093, 20: 2.086, 25: 2.060, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}
NORMAL_QUANTILE_975 = 1.960


def floats(values: Sequence[float]) -> list[float]:
    """`values` (a list, tuple or one-dimensional tensor) as a list of Python floats."""
    return [float(value) for value in (values.tolist() if hasattr(values, "tolist") else values)]


def mean(values: Sequence[float]) -> float:
    """The arithmetic mean; NaN for no values."""
    values = floats(values)
    return sum(values) / len(values) if values else math.nan


def standard_error(values: Sequence[float]) -> float:
    """s / √n with the sample standard deviation s (n − 1 in the denominator); NaN below two values."""
    values = floats(values)
    n = len(values)
    if n < 2:
        return math.nan
    centre = sum(values) / n
    return math.sqrt(sum((value - centre) ** 2 for value in values) / (n - 1) / n)


def t_quantile_975(degrees_of_freedom: int) -> float:
    """The two-sided 95 % Student t quantile at `degrees_of_freedom` (the nearest tabulated df below it; the normal
    quantile past the table)."""
    if degrees_of_freedom < 1:
        raise ValueError(f"a t quantile needs at least one degree of freedom, got {degrees_of_freedom}")
    if degrees_of_freedom > max(T_QUANTILE_975):
        return NORMAL_QUANTILE_975
    return T_QUANTILE_975[max(df for df in T_QUANTILE_975 if df <= degrees_of_freedom)]


@dataclass(frozen=True)
class PairedDifference:
    """after − before over the same prompts: the mean difference, its standard error and the number of prompts."""

    mean: float
    standard_error: float
    num_prompts: int

    def __str__(self) -> str:
        return f"Δ {self.mean:+.4f} ± {self.standard_error:.4f} SE, {self.num_prompts} prompts"


def paired_difference(before: Sequence[float], after: Sequence[float]) -> PairedDifference:
    """Mean of d_i = after_i − before_i over prompts i and its paired standard error s_d / √n.

    Pairing removes the prompt-to-prompt variance that two independent means would carry, so a change is significant
    when |mean| exceeds a few standard errors.
    """
    before, after = floats(before), floats(after)
    if len(before) != len(after):
        raise ValueError(f"paired values must cover the same prompts; got {len(before)} and {len(after)} values")
    differences = [a - b for a, b in zip(after, before)]
    return PairedDifference(mean(differences), standard_error(differences), len(differences))


@dataclass(frozen=True)
class SeedAggregate:
    """One value per seed summarised: their mean, the seed-to-seed standard error of that mean, and its 95 %
    confidence interval (t distribution, n − 1 degrees of freedom; NaN bounds with one seed)."""

    mean: float
    standard_error: float
    low: float
    high: float
    num_seeds: int

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def __str__(self) -> str:
        if self.num_seeds < 2:
            return f"{self.mean:+.4f} (1 seed)"
        return (f"{self.mean:+.4f} ± {self.standard_error:.4f} SE, 95 % CI [{self.low:+.4f}, {self.high:+.4f}], "
                f"{self.num_seeds} seeds")


def across_seeds(values: Sequence[float]) -> SeedAggregate:
    """Mean over seeds of one value per seed, its standard error and 95 % t interval."""
    values = floats(values)
    centre, error = mean(values), standard_error(values)
    if len(values) < 2:
        return SeedAggregate(centre, math.nan, math.nan, math.nan, len(values))
    half = t_quantile_975(len(values) - 1) * error
    return SeedAggregate(centre, error, centre - half, centre + half, len(values))
