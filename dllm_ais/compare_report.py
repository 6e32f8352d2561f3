"""A `dllm-ais compare` study's report: each arm paired with the baseline seed by seed over the same held-out
prompts and aggregated over seeds (`summarise`), as a markdown table, JSON numbers and a plot, written only to plain
files of the study folder (`report_files`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from dllm_ais.compare_plan import Run, Study, StudyError, one_line
from dllm_ais.safe_files import link_refusal, read_regular_file, save_figure
from dllm_ais.safe_json import loads_bounded
from dllm_ais.statistics import across_seeds, mean, paired_difference

MAX_REPORT_BYTES = 1 << 30  # a comparison.json holds a few numbers per arm and seed


def read_report(path: Path) -> dict[str, Any]:
    """A compare report's numbers (`comparison.json`, see `run_study`), read through no link and bounded in size."""
    return loads_bounded(read_regular_file(path, MAX_REPORT_BYTES), MAX_REPORT_BYTES, max_depth=8)


def versus_baseline(baseline: list[list[float]], arm: list[list[float]]) -> dict[str, Any]:
    """Per seed s, the paired difference over prompts of the arm's values from the baseline's (same seed, same
    prompts): Δ_s ± SE_s; then the seeds' Δ_s aggregated: mean, seed-to-seed SE and 95 % CI."""
    per_seed = [paired_difference(b, a) for b, a in zip(baseline, arm)]
    total = across_seeds([difference.mean for difference in per_seed])
    return {"per_seed": [{"mean": d.mean, "standard_error": d.standard_error, "num_prompts": d.num_prompts}
                         for d in per_seed],
            "across_seeds": {"mean": total.mean, "standard_error": total.standard_error, "low": total.low,
                             "high": total.high, "num_seeds": total.num_seeds}}


def summarise(study: Study, runs: list[Run]) -> dict[str, Any]:
    """The study's numbers from its finished runs: per arm the held-out accuracy and reward (per seed and their mean
    over seeds) and, for every arm but the baseline, `versus_baseline` on the compared metric — accuracy when every
    run has one, else reward."""
    from dllm_ais.checkpoint_choice import read_held_out

    held_out = {(run.arm, run.seed): read_held_out(run.output_dir)["after"] for run in runs}
    metric = "accuracy" if all(values["accuracy"] is not None for values in held_out.values()) else "reward"
    arms: dict[str, Any] = {}
    for run in runs:
        entry = arms.setdefault(run.arm, {"runs": [], "accuracy": [], "reward": [], metric + "_per_prompt": []})
        values = held_out[(run.arm, run.seed)]
        entry["runs"].append(str(run.output_dir))
        entry["accuracy"].append(math.nan if values["accuracy"] is None else mean(values["accuracy"]))
        entry["reward"].append(mean(values["reward"]))
        entry[metric + "_per_prompt"].append(values[metric])
    for name, entry in arms.items():
        entry["versus_baseline"] = None if name == study.baseline else versus_baseline(
            arms[study.baseline][metric + "_per_prompt"], entry[metric + "_per_prompt"])
    for entry in arms.values():
        del entry[metric + "_per_prompt"]
    return {"study": study.name, "base": str(study.base or "embedded recipe"), "overrides": study.overrides,
            "baseline": study.baseline, "metric": metric, "seeds": len({run.seed for run in runs}),
            "num_prompts": len(held_out[(runs[0].arm, runs[0].seed)]["reward"]), "arms": arms}


def over_seeds(values: list[float]) -> str:
    """'mean ± seed SE' of one value per seed (just the mean for one seed)."""
    total = across_seeds(values)
    return f"{total.mean:.4f}" if total.num_seeds < 2 else f"{total.mean:.4f} ± {total.standard_error:.4f}"


def table_cell(text: str) -> str:
    """`text` as one markdown table cell: `|` escaped, on one line (an arm's name cannot break the table)."""
    return one_line(text.replace("\\", "\\\\").replace("|", "\\|"))


def markdown(summary: dict[str, Any], header: str) -> str:
    """The study as a markdown table: one row per arm."""
    metric = summary["metric"]
    lines = [header, "",
             f"| arm | held-out accuracy | held-out reward | Δ {metric} vs {table_cell(summary['baseline'])}, per "
             "seed (paired over prompts, ± SE) | mean Δ over seeds ± seed SE | 95 % CI |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, entry in summary["arms"].items():
        versus = entry["versus_baseline"]
        if versus is None:
            paired = total = interval = "— (baseline)"
        else:
            paired = "; ".join(f"{d['mean']:+.4f} ± {d['standard_error']:.4f}" for d in versus["per_seed"])
            seeds = versus["across_seeds"]
            total = f"{seeds['mean']:+.4f}" + ("" if seeds["num_seeds"] < 2 else f" ± {seeds['standard_error']:.4f}")
            interval = "— (1 seed)" if seeds["num_seeds"] < 2 else f"[{seeds['low']:+.4f}, {seeds['high']:+.4f}]"
        accuracy = "—" if any(math.isnan(a) for a in entry["accuracy"]) else over_seeds(entry["accuracy"])
        lines.append(f"| {table_cell(name)} | {accuracy} | {over_seeds(entry['reward'])} | {paired} | {total} | "
                     f"{interval} |")
    return "\n".join(lines) + "\n"


def held_out_curve(records: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """(step, held-out reward) of one run's metrics records: the baseline at step 0, every `eval_steps` evaluation
    and the final one."""
    curve = {record["step"]: record["eval/reward"] for record in records if "eval/reward" in record}
    curve.update({0: record["eval/reward_before"] for record in records if "eval/reward_before" in record})
    return sorted(curve.items())


def plot(summary: dict[str, Any], path: Path) -> None:
    """Left: held-out reward over steps per arm (mean over seeds). Right: each arm's Δ from the baseline, one dot per
    seed and the mean with its 95 % CI."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dllm_ais.metrics import read_records

    figure, (curves, deltas) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(summary["arms"])
    for index, name in enumerate(names):
        color = plt.get_cmap("tab10")(index % 10)
        runs = [held_out_curve(read_records(Path(run) / "metrics.jsonl")) for run in summary["arms"][name]["runs"]]
        steps = sorted({step for curve in runs for step, _ in curve})
        curves.plot(steps, [mean([dict(curve)[step] for curve in runs if step in dict(curve)]) for step in steps],
                    label=name, color=color, marker=".")
        versus = summary["arms"][name]["versus_baseline"]
        if versus is not None:
            seeds = versus["across_seeds"]
            deltas.scatter([index] * len(versus["per_seed"]), [d["mean"] for d in versus["per_seed"]], color=color,
                           s=12, alpha=0.6)
            error = 0.0 if math.isnan(seeds["low"]) else seeds["mean"] - seeds["low"]
            deltas.errorbar([index], [seeds["mean"]], yerr=[error], color=color, marker="o", capsize=4)
    curves.set(title="held-out reward (greedy), mean over seeds", xlabel="step")
    curves.legend(fontsize=7)
    deltas.axhline(0.0, color="grey", linewidth=0.8)
    deltas.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=7)
    deltas.set_title(f"Δ {summary['metric']} vs {summary['baseline']}:\nseeds and mean with 95 % CI", fontsize=10)
    for axis in (curves, deltas):
        axis.grid(alpha=0.3)
    figure.tight_layout()
    save_figure(figure, path)


REPORT_SUFFIXES = (".md", ".json", ".png")


def report_files(study_dir: Path, report: str) -> list[Path]:
    """The report's table, numbers and plot in `study_dir`; StudyError when `report` is not a plain file name or one
    of the files is a symbolic link (never written through)."""
    if report in ("", ".", "..") or Path(report).name != report or report.startswith("."):
        raise StudyError(f"--report {report!r}: a file name without a folder (the report is written in the study "
                         "folder), e.g. --report comparison-nvfp4")
    files = [study_dir / f"{report}{suffix}" for suffix in REPORT_SUFFIXES]
    for path in files:
        if path.is_symlink():
            raise StudyError(link_refusal(path))
    return files
