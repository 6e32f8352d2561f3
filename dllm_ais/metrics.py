"""Metrics stage: per-step JSONL records, one-line console summaries and end-of-run plots."""

from __future__ import annotations

import json
import math
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
    """Appends one JSON object per logged step to `<output_dir>/metrics.jsonl` (flushed at once, so a crash keeps it)."""

    def __init__(self, output_dir: str | Path):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.records: list[dict[str, Any]] = []
        self._file = self.path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self.records.append(clean)
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


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
