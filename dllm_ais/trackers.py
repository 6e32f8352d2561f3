"""Experiment trackers (through accelerate): which exist, which are installed, and how a run names itself there.

`report_to` takes TRL's forms: a tracker name, a list of names, "none" (no tracker) or "all" (every supported tracker
that is installed). Only the standard library is imported here, so the config stays light.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

TRACKER_MODULES = {  # report_to name -> modules providing it (accelerate accepts either for tensorboard)
    "tensorboard": ("tensorboard", "tensorboardX"),
    "trackio": ("trackio",),
    "wandb": ("wandb",),
}
TRACKERS = tuple(TRACKER_MODULES)
INSTALL_HINT = 'pip install "dllm-ais[trackers]"'


def tracker_installed(name: str) -> bool:
    return any(importlib.util.find_spec(module) is not None for module in TRACKER_MODULES[name])


def normalize_report_to(value):
    """TRL's `report_to` forms as a list of tracker names: "x" -> ["x"], "none" -> [], "all" -> the installed ones.

    Values of any other type are returned unchanged for the config's type check to report.
    """
    if value is None:
        return []
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        return value
    if "all" in names:
        return [name for name in TRACKERS if tracker_installed(name)]
    return [name for name in names if name != "none"]


def missing_tracker_problems(report_to: list[str]) -> list[str]:
    """One problem (naming `report_to` and the pip command) per requested tracker that is not installed."""
    return [f"report_to={report_to}: {name} is not installed; {INSTALL_HINT} (or pip install {TRACKER_MODULES[name][0]}),"
            " or set report_to=none" for name in report_to if name in TRACKER_MODULES and not tracker_installed(name)]


def tracker_init_kwargs(run_name: str | None, output_dir: str) -> dict[str, dict]:
    """accelerate `init_trackers(init_kwargs=...)` naming the run (default: the output directory's name).

    TensorBoard has no run name: it writes under `<output_dir>/dllm-ais/`.
    """
    name = run_name or Path(output_dir).name
    return {"wandb": {"name": name}, "trackio": {"name": name}}


def log_table(trackers, name: str, rows: list[dict], step: int) -> None:
    """Log `rows` (dicts with the same keys) as the table `name` to every tracker that has tables (wandb, ClearML in
    accelerate); the others get nothing (the rows are in completions.jsonl)."""
    columns = list(rows[0])
    for tracker in trackers:
        if hasattr(tracker, "log_table"):
            tracker.log_table(name, columns=columns, data=[[row.get(column) for column in columns] for row in rows],
                              step=step)
