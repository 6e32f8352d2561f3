"""Metrics stage: the step's TRL/verl metrics, per-step JSONL records, console lines and end-of-run plots.

Names follow the libraries users read them in: TRL's GRPO metrics (`reward`, `reward_std`, `frac_reward_zero_std`,
`completions/*`, `entropy`, `num_tokens`, `clip_ratio/*`, `kl`, `sampling/*`), verl's rollout-correction metrics
(`rollout_corr/*`, see `dllm_ais.correction`), the AIS diagnostics (`ais/*`), the rollout decoders (`rollout/*`, see
`dllm_ais.fidelity`) and the validation scores (`eval/*`).
"""

from __future__ import annotations

import errno
import json
import math
import os
import sys
import time
import weakref
from pathlib import Path
from typing import Any, Callable

import torch

from dllm_ais.loss import zero_std_groups
from dllm_ais.safe_files import (check_regular_or_absent, copy_regular_file, open_appending, open_regular_file,
                                 save_figure, write_file)
from dllm_ais.safe_json import loads_bounded

CONSOLE_FIELDS = (  # (metric key, console label, format)
    ("reward", "reward", ".3f"),
    ("frac_reward_zero_std", "zero-std", ".2f"),
    ("ais/alpha", "α", ".3f"),
    ("ais/shift_significance", "z²", ".1f"),
    ("rollout_corr/rollout_is_eff_sample_size", "ESS", ".3f"),
    ("rollout_corr/k3_kl", "k3", ".2e"),
    ("rollout/fidelity_level", "rung", ".0f"),
    ("clip_ratio/region_mean", "clip", ".3f"),
    ("entropy", "H", ".3f"),
    ("loss", "loss", "+.4f"),
)
EVAL_CONSOLE_FIELDS = (("eval/reward", "reward", ".4f"), ("eval/accuracy", "accuracy", ".4f"))
PLOTTED = ("reward", "eval/reward", "eval/accuracy", "frac_reward_zero_std", "entropy", "completions/mean_length",
           "ais/alpha", "ais/shift_significance", "rollout_corr/rollout_is_eff_sample_size", "rollout_corr/k3_kl",
           "rollout_corr/rollout_is_ratio_fraction_high", "kl", "rollout/fidelity_level")

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
                 "a higher rollout.precision (or, with the trajectory estimator, no rollout.cache/rollout.threshold)"
            for key, crossed, level in MISMATCH_WARNING_LEVELS
            if key in metrics and math.isfinite(metrics[key]) and crossed(metrics[key])}


def reward_metrics(rewards: torch.Tensor, num_generations: int) -> dict[str, float]:
    """TRL's reward statistics of a batch [B] of groups of `num_generations` consecutive completions: `reward` (the
    mean), `reward_std` (the mean over groups of the within-group sample std) and `frac_reward_zero_std` (the share
    of groups whose rewards are all equal: their advantages are 0, they teach nothing; `loss.zero_std_groups`)."""
    group_std = rewards.float().view(-1, num_generations).std(dim=1)
    return {"reward": rewards.float().mean().item(), "reward_std": group_std.mean().item(),
            "frac_reward_zero_std": zero_std_groups(rewards, num_generations).float().mean().item()}


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
    completion in completions.jsonl). The file is opened for appending and every record is one whole line written by
    one `write` call (a process killed at any moment leaves whole lines); `sync` — run before every checkpoint is
    committed (`sync_logs_in`) and at `close` — puts them on the disk.

    The file belongs to one run: a fresh run starts it empty; a run resumed at step N keeps the valid lines of
    `previous` (the file of the run it resumes, by default this one) up to step N and continues after them. Damaged
    lines never cut the file short: they are reported with their line numbers, every valid line up to step N is
    kept, and a damaged file of this run is first copied aside (`<name>.damaged-<time>`) so that nothing is lost.
    The new starting content replaces the file by a rename, never by truncating it, and the lines are appended
    through a descriptor opened without following a link (`safe_files`): a link put in the file's place, before or
    during the run, is refused or never written through.
    """

    def __init__(self, output_dir: str | Path, resume_step: int | None = None, previous: str | Path | None = None,
                 name: str = "metrics.jsonl"):
        self.path = Path(output_dir) / name
        self.path.parent.mkdir(parents=True, exist_ok=True)
        previous = Path(previous) if previous is not None else self.path
        for path in {self.path, previous}:
            check_regular_or_absent(path)
        kept: list[bytes] = []
        if resume_step is not None and previous.is_file():
            kept, damaged = lines_up_to(previous, resume_step, TEXT_FIELDS.get(name, ()))
            if damaged:
                report_damaged_lines(previous, damaged, kept, resume_step, keep_copy=previous.resolve() == self.path.resolve())
        self.records: list[dict[str, Any]] = [json.loads(line) for line in kept]
        write_file(self.path, b"".join(kept))
        self._descriptor = open_appending(self.path)
        _open_logs.add(self)

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self.records.append(clean)
        line = (json.dumps(clean) + "\n").encode()
        written = os.write(self._descriptor, line)
        if written != len(line):  # a regular file takes a whole write unless the disk is full
            raise OSError(errno.ENOSPC, f"{self.path}: only {written} of {len(line)} bytes of a line written")

    def sync(self) -> None:
        """Put every line written so far on the disk."""
        os.fsync(self._descriptor)

    def close(self) -> None:
        if self._descriptor is not None:
            self.sync()
            os.close(self._descriptor)
            self._descriptor = None
            _open_logs.discard(self)


_open_logs: "weakref.WeakSet[MetricsLog]" = weakref.WeakSet()


def sync_logs_in(directory: str | Path) -> None:
    """Sync the open logs of the run in `directory` (before a checkpoint is committed: its step's lines are then on
    disk too, so a resume from it finds them)."""
    directory = Path(directory).resolve()
    for log in list(_open_logs):
        if log.path.parent.resolve() == directory:
            log.sync()


MAX_RECORD_BYTES = 1 << 20  # a metrics line is ~2 KB; a completions line holds one prompt and its completion
MAX_RECORD_KEYS, MAX_KEY_CHARS = 4096, 256
TEXT_FIELDS = {"completions.jsonl": ("prompt", "completion")}  # the only fields of a run's logs that hold text


def parse_record(line: bytes, text_fields: tuple[str, ...] = ()) -> dict[str, Any] | None:
    """The record one line of a run's JSONL log holds when it has the shape dllm-ais writes, else None (a damaged
    line): a whole line of at most `MAX_RECORD_BYTES`, one flat JSON object (no nesting: parsed with a depth bound)
    of at most `MAX_RECORD_KEYS` short keys, an integer `step` >= 0 when present, every value a finite number, a
    boolean or null — or a string, for the `text_fields` only. (A NaN or inf marks a line dllm-ais did not write: it
    writes them as null.)"""
    try:
        record = loads_bounded(line, MAX_RECORD_BYTES, max_depth=1) if line.endswith(b"\n") else None
    except ValueError:
        return None
    if not isinstance(record, dict) or len(record) > MAX_RECORD_KEYS:
        return None
    step = record.get("step", 0)
    if type(step) is not int or step < 0:
        return None
    for key, value in record.items():
        allowed = (int, float, bool, type(None), str) if key in text_fields else (int, float, bool, type(None))
        if len(key) > MAX_KEY_CHARS or not isinstance(value, allowed):
            return None
        if isinstance(value, float) and not math.isfinite(value):  # `MetricsLog.write` writes null for NaN and inf
            return None
    return record


def read_records(path: str | Path, text_fields: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """The valid records (`parse_record`) of a run's JSONL log, read through no link (`safe_files`), in order;
    damaged lines are skipped."""
    with open_regular_file(path) as file:
        return [record for line in file if (record := parse_record(line, text_fields)) is not None]


def lines_up_to(path: Path, step: int, text_fields: tuple[str, ...] = ()) -> tuple[list[bytes], list[int]]:
    """(the valid lines of a run's JSONL file with `step` <= the given one, the numbers of its damaged lines).

    A valid line is one `parse_record` accepts (`text_fields` may hold text); damaged lines (torn, cut, NUL bytes,
    other types, nested or oversized JSON) are skipped, never a reason to drop what follows them. A run's closing
    held-out line (validation scores without training metrics) and lines past `step` belong to steps the resumed
    run writes again, and are left out."""
    kept, damaged = [], []
    with open_regular_file(path) as file:
        for number, line in enumerate(file, start=1):
            record = parse_record(line, text_fields)
            if record is None:
                damaged.append(number)
                continue
            closing = "eval/reward" in record and "loss" not in record
            if not closing and isinstance(record.get("step"), int) and record["step"] <= step:
                kept.append(line)
    return kept, damaged


def report_damaged_lines(path: Path, damaged: list[int], kept: list[bytes], step: int, keep_copy: bool) -> None:
    """Warn (one line on stderr) that `path` has damaged lines; with `keep_copy`, first copy it aside."""
    numbers = ", ".join(map(str, damaged[:10])) + (f" and {len(damaged) - 10} more" if len(damaged) > 10 else "")
    aside = ""
    if keep_copy:
        copy = copy_regular_file(path, path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}"))
        aside = f"; the original file is kept as {copy}"
    print(f"warning: {path}: line(s) {numbers} damaged (not a whole JSON record of a run's log), left out; kept its {len(kept)} "
          f"valid line(s) up to step {step}{aside}", file=sys.stderr)


def plotted_points(records: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    """(step, value) of `key` over `records`, led by the run's baseline at step 0 when a record holds `<key>_before`
    (the closing record's held-out score before training)."""
    baseline = [(0, r[f"{key}_before"]) for r in records if r.get(f"{key}_before") is not None][:1]
    return baseline + [(r["step"], r[key]) for r in records if r.get(key) is not None]


def plot_metrics(records: list[dict[str, Any]], path: str | Path, keys: tuple[str, ...] = PLOTTED) -> Path | None:
    """Save a grid of metric-versus-step panels (one per key present; `plotted_points`) to `path` as a PNG (staged
    and renamed, never written through a link: `safe_files.save_figure`); returns it, or None if nothing to
    plot."""
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
        ax.plot(*zip(*plotted_points(records, key)), marker=".", linewidth=1)
        ax.set_title(key, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(present):]:
        ax.axis("off")
    figure.tight_layout()
    return save_figure(figure, path)
