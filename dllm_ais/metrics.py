"""Metrics stage: per-step JSONL records, one-line console summaries and end-of-run plots."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

CONSOLE_FIELDS = (  # (metric key, console label, format)
    ("reward", "reward", ".3f"),
    ("correction/alpha", "α", ".3f"),
    ("correction/ess", "ESS", ".3f"),
    ("correction/k3_kl", "k3", ".2e"),
    ("clip_ratio/region_mean", "clip", ".3f"),
    ("loss", "loss", "+.4f"),
)
PLOTTED = ("reward", "correction/alpha", "correction/ess", "correction/k3_kl", "correction/is_fraction_truncated", "kl")


def console_line(step: int, max_steps: int, metrics: dict[str, float]) -> str:
    """`step 3/20 | reward 0.412 | α 0.120 | ESS 0.981 | k3 2.10e-04 | clip 0.000 | loss -0.0123`."""
    parts = [f"step {step}/{max_steps}"]
    parts += [f"{label} {metrics[key]:{fmt}}" for key, label, fmt in CONSOLE_FIELDS if key in metrics]
    return " | ".join(parts)


class MetricsLog:
    """One JSON object per logged step in `<output_dir>/metrics.jsonl`, flushed and synced at once (a crash keeps it).

    The file belongs to one run: a fresh run starts it empty; a run resumed at step N keeps the training lines of
    `previous` (its metrics.jsonl, by default this one) up to step N and continues after them.
    """

    def __init__(self, output_dir: str | Path, resume_step: int | None = None, previous: str | Path | None = None):
        self.path = Path(output_dir) / "metrics.jsonl"
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
    """The leading complete training lines of a metrics.jsonl with `step` <= the given one (a run's closing
    held-out line, a torn last line and anything after them are dropped)."""
    kept = []
    with path.open("rb") as file:
        for line in file:
            try:
                record = json.loads(line)
            except ValueError:
                break
            if not line.endswith(b"\n") or record.get("step", step + 1) > step or "eval/reward" in record:
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
