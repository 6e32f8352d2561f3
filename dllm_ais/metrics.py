"""Metrics stage: the step's TRL/verl metrics, per-step JSONL records, console lines and end-of-run plots.

Names follow the libraries users read them in: TRL's GRPO metrics (`reward`, `reward_std`, `frac_reward_zero_std`,
`completions/*`, `entropy`, `num_tokens`, `clip_ratio/*`, `kl`, `sampling/*`), verl's rollout-correction metrics
(`rollout_corr/*`, see `dllm_ais.correction`), the AIS diagnostics (`ais/*`) and the validation scores (`eval/*`).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Callable

import torch

CONSOLE_FIELDS = (  # (metric key, console label, format)
    ("reward", "reward", ".3f"),
    ("frac_reward_zero_std", "zero-std", ".2f"),
    ("ais/alpha", "α", ".3f"),
    ("ais/shift_significance", "z²", ".1f"),
    ("rollout_corr/rollout_is_eff_sample_size", "ESS", ".3f"),
    ("rollout_corr/k3_kl", "k3", ".2e"),
    ("clip_ratio/region_mean", "clip", ".3f"),
    ("entropy", "H", ".3f"),
    ("loss", "loss", "+.4f"),
)
EVAL_CONSOLE_FIELDS = (("eval/reward", "reward", ".4f"), ("eval/accuracy", "accuracy", ".4f"))
PLOTTED = ("reward", "eval/reward", "eval/accuracy", "frac_reward_zero_std", "entropy", "completions/mean_length",
           "ais/alpha", "ais/shift_significance", "rollout_corr/rollout_is_eff_sample_size", "rollout_corr/k3_kl",
           "rollout_corr/rollout_is_ratio_fraction_high", "kl")

# verl's documented warning levels for the rollout/trainer mismatch: (metric, crossed?, the level)
MISMATCH_WARNING_LEVELS: tuple[tuple[str, Callable[[float], bool], str], ...] = (
    ("rollout_corr/rollout_is_mean", lambda value: not 0.5 <= value <= 2.0, "outside [0.5, 2]"),
    ("rollout_corr/rollout_is_std", lambda value: value > 1.0, "above 1"),
    ("rollout_corr/rollout_is_eff_sample_size", lambda value: value < 0.3, "below 0.3"),
    ("rollout_corr/kl", lambda value: abs(value) > 0.1, "|kl| above 0.1"),
    ("rollout_corr/chi2_token", lambda value: value > 1.0, "above 1"),
)


def console_line(step: int, max_steps: int, metrics: dict[str, float]) -> str:
    """`step 3/20 | reward 0.412 | zero-std 0.25 | α 0.120 | ESS 0.981 | k3 2.10e-04 | clip 0.000 | H 1.234 | loss
    -0.0123`."""
    parts = [f"step {step}/{max_steps}"]
    parts += [f"{label} {metrics[key]:{fmt}}" for key, label, fmt in CONSOLE_FIELDS if key in metrics]
    return " | ".join(parts)


def eval_line(step: int, metrics: dict[str, float], best: str) -> str:
    """`step 20 validation | reward 0.4120 | accuracy 0.3125 | best eval/reward 0.4500 at step 10`."""
    parts = [f"step {step} validation"]
    parts += [f"{label} {metrics[key]:{fmt}}" for key, label, fmt in EVAL_CONSOLE_FIELDS if key in metrics]
    return " | ".join(parts + [best])


def mismatch_warnings(metrics: dict[str, float]) -> dict[str, str]:
    """The verl warning levels these metrics cross: metric name -> one line saying so (NaN crosses nothing)."""
    return {key: f"{key} = {metrics[key]:.4g}, {level} (verl's warning level): the rollout engine samples from a "
                 "noticeably different distribution than the trainer scores; watch the correction's metrics, or try "
                 "a higher rollout_precision (or, with the trajectory estimator, no rollout_cache/rollout_threshold)"
            for key, crossed, level in MISMATCH_WARNING_LEVELS
            if key in metrics and math.isfinite(metrics[key]) and crossed(metrics[key])}


def reward_metrics(rewards: torch.Tensor, num_generations: int) -> dict[str, float]:
    """TRL's reward statistics of a batch [B] of groups of `num_generations` consecutive completions: `reward` (the
    mean), `reward_std` (the mean over groups of the within-group sample std) and `frac_reward_zero_std` (the share
    of groups whose rewards are all equal: their advantages are 0, they teach nothing)."""
    group_std = rewards.float().view(-1, num_generations).std(dim=1)
    return {"reward": rewards.float().mean().item(), "reward_std": group_std.mean().item(),
            "frac_reward_zero_std": torch.isclose(group_std, torch.zeros_like(group_std)).float().mean().item()}


def distinct_completions(completion_ids: torch.Tensor, completion_mask: torch.Tensor, num_generations: int) -> torch.Tensor:
    """[groups] the share of distinct completions in each group of `num_generations` consecutive rows (1 = all
    different, 1/G = one completion G times): the group's exploration. Tokens outside `completion_mask` are ignored."""
    tokens = completion_ids.masked_fill(~completion_mask.bool(), -1).view(-1, num_generations, completion_ids.shape[1])
    return torch.tensor([len({tuple(row) for row in group.tolist()}) / num_generations for group in tokens])


def ends_with_eos(completion_ids: torch.Tensor, eos_token_ids: tuple[int, ...]) -> torch.Tensor:
    """[B] bool: whether each completion [B, L] holds an end token, i.e. stopped before max_completion_length."""
    return torch.isin(completion_ids, torch.tensor(eos_token_ids, device=completion_ids.device)).any(dim=1)


def completion_metrics(lengths: torch.Tensor, terminated: torch.Tensor) -> dict[str, float]:
    """TRL's `completions/{mean,min,max}_length` of the completions' lengths [B] (tokens through the first end
    token) and `completions/clipped_ratio`, the share that hit max_completion_length without an end token."""
    lengths = lengths.float()
    return {"completions/mean_length": lengths.mean().item(), "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(),
            "completions/clipped_ratio": 1.0 - terminated.float().mean().item()}


class MetricsLog:
    """One JSON object per record in `<output_dir>/<name>` (one per logged step in metrics.jsonl, one per sampled
    completion in completions.jsonl), flushed and synced at once (a crash keeps it).

    The file belongs to one run: a fresh run starts it empty; a run resumed at step N keeps the lines of `previous`
    (the file of the run it resumes, by default this one) up to step N and continues after them.
    """

    def __init__(self, output_dir: str | Path, resume_step: int | None = None, previous: str | Path | None = None,
                 name: str = "metrics.jsonl"):
        self.path = Path(output_dir) / name
        self.path.parent.mkdir(parents=True, exist_ok=True)
        previous = Path(previous) if previous is not None else self.path
        kept = _lines_up_to(previous, resume_step) if resume_step is not None and previous.is_file() else []
        self.records: list[dict[str, Any]] = [json.loads(line) for line in kept]
        if self.path.is_file() and previous.resolve() == self.path.resolve():
            os.truncate(self.path, sum(len(line) for line in kept))
            self._file = self.path.open("ab")
        else:
            self._file = self.path.open("wb")
            self._file.write(b"".join(kept))
        self._sync()

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self.records.append(clean)
        self._file.write((json.dumps(clean) + "\n").encode())
        self._sync()

    def _sync(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


def _lines_up_to(path: Path, step: int) -> list[bytes]:
    """The leading complete lines of a run's JSONL file with `step` <= the given one (a run's closing held-out line —
    validation scores without training metrics —, a torn last line and anything after them are dropped)."""
    kept = []
    with path.open("rb") as file:
        for line in file:
            try:
                record = json.loads(line)
            except ValueError:
                break
            closing = "eval/reward" in record and "loss" not in record
            if not line.endswith(b"\n") or record.get("step", step + 1) > step or closing:
                break
            kept.append(line)
    return kept


def plot_metrics(records: list[dict[str, Any]], path: str | Path, keys: tuple[str, ...] = PLOTTED) -> Path | None:
    """Save a grid of metric-versus-step panels (one per key present) to `path`; returns it, or None if nothing to plot."""
    present = [k for k in keys if any(r.get(k) is not None for r in records)]
    if not present:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = min(3, len(present))
    rows = math.ceil(len(present) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.0 * rows), squeeze=False)
    for ax, key in zip(axes.flat, present):
        points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        ax.plot(*zip(*points), marker=".", linewidth=1)
        ax.set_title(key, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(present):]:
        ax.axis("off")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return Path(path)
