"""The complete ratio's front (issue 49): held-out Δ against bf16 rollouts versus the mismatch the complete ratio
measures, one line per correction, over finished `dllm-ais compare` studies.

    python -m dllm_ais.experimental.complete_ratio_front STUDY [STUDY ...]

A STUDY is a report `dllm-ais compare` wrote against the study's baseline arm (bf16 rollouts,
`recipes/studies/complete_ratio_llada_*.yaml`): its JSON file, or the study folder for its `comparison.json`. Its
other arms named `<rollout precision> <correction>`
("mxfp4 uncorrected", "mxfp4 + AIS (complete ratio)") form its notches; arms rolling out at the baseline's
precision (another decoder, another draw) are not notches and are left out.

- A notch's mismatch: the complete ratio's k3 per scored position as training logged it (`rollout_corr/k3_kl` of
  the notch's arms that logged the commit part, `rollout_corr/commit_k3_kl`, i.e. ran with
  `experimental.complete_ratio`; the mean over their steps and seeds), with the commit part's share. It is the
  engine's distance from the trainer over everything the engine drew, tokens and commit choice, at the weights
  being trained. A notch with no such arm has no measured complete-ratio mismatch and is left out.
- Δ: each arm's held-out metric minus the baseline's, per seed over the same prompts, then the mean over seeds ±
  the seed-to-seed SE.
- The rescue at a notch where uncorrected rollouts lose (by more than 2 seed SE): AIS on the complete ratio (the
  report's first arm labelled "+ AIS (complete ratio ...") within 2 points of bf16 and above the uncorrected arm by
  more than 2 SE of their paired difference (per seed over the same prompts, then over seeds).

Writes complete-ratio-front.md (one row per notch, with the rescue's verdict) and complete-ratio-front.png (Δ against
the mismatch, one line per report and correction) into the first report's folder, beside it (`--report NAME` names
the two files).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from dllm_ais.compare_report import read_report, versus_baseline
from dllm_ais.experimental.precision_frontier import (LOSS_STANDARD_ERRORS, RESCUE_POINTS, per_prompt_values, points,
                                                      save_front)
from dllm_ais.metrics import read_records
from dllm_ais.safe_files import link_refusal, write_file

UNCORRECTED, AIS_COMPLETE_PREFIX = "uncorrected", "+ AIS (complete ratio"  # "+ AIS (complete ratio of sets)" too
COMPLETE_K3, COMMIT_K3 = "rollout_corr/k3_kl", "rollout_corr/commit_k3_kl"


def logged_values(run: str | Path, keys: tuple[str, ...]) -> list[dict[str, float]]:
    """The training records of one run (`metrics.jsonl`, damaged lines skipped) that hold every one of `keys`:
    those values."""
    return [{key: float(record[key]) for key in keys} for record in read_records(Path(run) / "metrics.jsonl")
            if all(isinstance(record.get(key), (int, float)) for key in keys)]


def notch_mismatch(runs: list[str]) -> dict[str, float] | None:
    """The complete ratio's logged k3 and its commit part (means over the records of `runs` that logged both), or
    None when no record did (the runs did not correct with the complete ratio)."""
    records = [record for run in runs for record in logged_values(run, (COMPLETE_K3, COMMIT_K3))]
    if not records:
        return None
    complete = sum(record[COMPLETE_K3] for record in records) / len(records)
    commit = sum(record[COMMIT_K3] for record in records) / len(records)
    return {"k3": complete, "commit_k3": commit, "num_records": len(records)}


def report_path(study: Path) -> Path:
    """A compare report's JSON file: `study` itself, or a study folder's `comparison.json`."""
    return study / "comparison.json" if study.is_dir() else study


def study_front(study: Path) -> dict[str, Any]:
    """One compare report's notches (`study`: its JSON file or the study folder), in order of mismatch:
    {"precision", "mismatch", "corrections": {label: Δ across seeds}, "verdict"} (module docstring), with the
    study's name and compared metric."""
    path = report_path(study)
    summary = read_report(path)
    arms, metric, baseline = summary["arms"], summary["metric"], summary["baseline"]
    baseline_precision = baseline.split()[0]
    notches: dict[str, dict[str, str]] = {}
    for name in arms:
        precision, _, label = name.partition(" ")
        if name != baseline and label and precision != baseline_precision:
            notches.setdefault(precision, {})[label] = name
    values = {name: per_prompt_values(arms[name]["runs"], metric)
              for name in [baseline, *(name for names in notches.values() for name in names.values())]}
    rows = []
    for precision, names in notches.items():
        mismatch = notch_mismatch([run for name in names.values() for run in arms[name]["runs"]])
        if mismatch is None:
            continue
        corrections = {label: versus_baseline(values[baseline], values[name])["across_seeds"]
                       for label, name in names.items()}
        verdict = None
        ais = next((label for label in names if label.startswith(AIS_COMPLETE_PREFIX)), None)
        if UNCORRECTED in names and ais is not None:
            paired = versus_baseline(values[names[UNCORRECTED]], values[names[ais]])["across_seeds"]
            loss = corrections[UNCORRECTED]
            verdict = {"ais_minus_uncorrected": paired,
                       "uncorrected_loses": loss["mean"] + LOSS_STANDARD_ERRORS * loss["standard_error"] < 0,
                       "ais_within_2_points": corrections[ais]["mean"] >= -RESCUE_POINTS,
                       "ais_above_uncorrected": paired["mean"] > LOSS_STANDARD_ERRORS * paired["standard_error"]}
        rows.append({"precision": precision, "mismatch": mismatch, "corrections": corrections, "verdict": verdict})
    rows.sort(key=lambda row: row["mismatch"]["k3"])
    name = summary["study"] if path.stem == "comparison" else f"{summary['study']} ({path.stem})"
    return {"study": name, "report": str(path), "metric": metric, "baseline": baseline,
            "seeds": summary["seeds"], "num_prompts": summary["num_prompts"], "rows": rows}


def verdict_cell(verdict: dict[str, Any] | None) -> str:
    """'rescued' or why not, with AIS − uncorrected in points; '—' without both arms."""
    if verdict is None:
        return "—"
    paired = verdict["ais_minus_uncorrected"]
    if not verdict["uncorrected_loses"]:
        outcome = "no loss to rescue (uncorrected within 2 SE of bf16)"
    elif verdict["ais_within_2_points"] and verdict["ais_above_uncorrected"]:
        outcome = "rescued"
    else:
        reasons = [reason for reason, met in (("not within 2 points of bf16", verdict["ais_within_2_points"]),
                                              ("not above uncorrected by 2 SE", verdict["ais_above_uncorrected"]))
                   if not met]
        outcome = "not rescued: " + ", ".join(reasons)
    return f"{outcome} (AIS − uncorrected {points(paired)})"


def markdown(fronts: list[dict[str, Any]], labels: list[str]) -> str:
    """One row per study and notch: the complete ratio's k3 (its commit share), Δ per correction, the rescue."""
    lines = ["| study | notch | complete-ratio k3 (commit share) | " + " | ".join(f"Δ {label}" for label in labels)
             + " | rescue (AIS on the complete ratio) |", "| --- " * (4 + len(labels)) + "|"]
    for front in fronts:
        for row in front["rows"]:
            mismatch = row["mismatch"]
            share = mismatch["commit_k3"] / mismatch["k3"] if mismatch["k3"] > 0 else math.nan
            lines.append(f"| {front['study']} | {row['precision']} | {mismatch['k3']:.3f} ({share:.0%}) | "
                         + " | ".join(points(row["corrections"].get(label)) for label in labels)
                         + f" | {verdict_cell(row['verdict'])} |")
    notes = [f"{front['study']}: {front['seeds']} seeds × {front['num_prompts']} held-out prompts, "
             f"Δ {front['metric']} vs {front['baseline']} in points (mean over seeds ± seed SE)" for front in fronts]
    return "\n".join(lines) + "\n\n" + "; ".join(notes) + ".\n"


def plot(fronts: list[dict[str, Any]], labels: list[str], path: Path) -> None:
    """Δ (points) against the complete ratio's k3, a colour per correction, a marker per study."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7.5, 4.5))
    markers = "osD^v"
    for study_index, front in enumerate(fronts):
        for label_index, label in enumerate(labels):
            cells = [(row["mismatch"]["k3"], row["corrections"][label]) for row in front["rows"]
                     if label in row["corrections"]]
            if not cells:
                continue
            jitter = 1 + 0.03 * (label_index - (len(labels) - 1) / 2)  # side by side at a shared k3
            axis.errorbar([k3 * jitter for k3, _ in cells], [100 * total["mean"] for _, total in cells],
                          yerr=[100 * total["standard_error"] for _, total in cells], capsize=3,
                          marker=markers[study_index % len(markers)], color=plt.get_cmap("tab10")(label_index),
                          label=f"{front['study']}: {label}")
        for row in front["rows"]:
            axis.annotate(row["precision"], (row["mismatch"]["k3"], 0), textcoords="offset points", xytext=(0, 6),
                          rotation=60, fontsize=7, color="gray")
    save_front(figure, axis, "rollout mismatch: the complete ratio's k3 per position, logged in training", path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dllm_ais.experimental.complete_ratio_front", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("studies", type=Path, nargs="+",
                        help="compare reports: their JSON files, or study folders for their comparison.json")
    parser.add_argument("--report", default="complete-ratio-front",
                        help="the report's file name (.md, .png) in the first report's folder")
    args = parser.parse_args(argv)
    report = report_path(args.studies[0]).parent / Path(args.report).name
    for path in (report.with_suffix(".md"), report.with_suffix(".png")):
        if path.is_symlink():
            raise SystemExit(link_refusal(path))
    fronts = [study_front(study) for study in args.studies]
    labels = list(dict.fromkeys(label for front in fronts for row in front["rows"] for label in row["corrections"]))
    table = markdown(fronts, labels)
    write_file(report.with_suffix(".md"), table)
    plot(fronts, labels, report.with_suffix(".png"))
    print(table + f"\nwritten: {report}.md, .png")


if __name__ == "__main__":
    main()
