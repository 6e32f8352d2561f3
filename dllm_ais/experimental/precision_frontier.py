"""The precision frontier: held-out Δ against bf16 rollouts versus each notch's rollout mismatch, per correction.

    python -m dllm_ais.experimental.precision_frontier                        # the shipped study, 4 seeds, 2 jobs
    python -m dllm_ais.experimental.precision_frontier --seeds 4 --jobs 2 --arms "nvfp4 uncorrected,nvfp4 + AIS"

Runs what the study still needs (`dllm-ais compare STUDY --seeds N`: finished runs are reused), measures each notch's
mismatch on the study's base recipe as `dllm-ais bench mismatch` does (exact token KL, k3 and sequence ESS on the
canvas the recipe's estimator scores, and on the trajectory replay's canvases), then writes into the study folder:

  frontier.md / frontier.json   one row per notch (in order of mismatch): k3, sequence ESS, and per correction the
                                held-out Δ against bf16 rollouts (mean over seeds ± seed SE, each seed paired over
                                the same prompts; the bf16 arm pooled with the null arms' draws, see `frontier`);
                                then the verdict below;
  frontier.png                  Δ (points) against k3, one line per correction, ±1 seed SE bars
                                (`--report NAME` names the three files).

The verdict: the first notch, in order of mismatch, where uncorrected rollouts lose by more than 2 seed SE; there,
whether AIS lands within 2 points of bf16 and above uncorrected by more than 2 SE of their paired difference (per
seed over the same prompts, then over seeds).

A study's arms are `<precision> <correction>` with overrides `rollout.precision` and `correction`; the baseline arm
rolls out in bf16 (`recipes/studies/frontier_llada_digits.yaml`). Other bf16 arms are null arms — the baseline
again with another sampling draw (`experimental.rollout_seed_offset`) — whose Δ shows how far two arms part by
sampling noise alone; the table states it beside the verdict and the plot draws it as a band.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from pathlib import Path
from typing import Any

import torch

from dllm_ais.compare import run_study
from dllm_ais.compare_plan import read_study
from dllm_ais.compare_report import read_report, versus_baseline
from dllm_ais.safe_files import save_figure, write_file

DEFAULT_STUDY = Path(__file__).resolve().parents[2] / "recipes" / "studies" / "frontier_llada_digits.yaml"
UNCORRECTED, AIS = "uncorrected", "+ AIS"
LOSS_STANDARD_ERRORS = 2.0
RESCUE_POINTS = 0.02


def arm_grid(arms: dict[str, dict[str, Any]], baseline: str) -> dict[str, dict[str, str]]:
    """{precision: {correction label: arm name}} of the study's non-baseline arms, the label being the arm name
    after its `rollout.precision` ("int4 + AIS" -> "+ AIS")."""
    grid: dict[str, dict[str, str]] = {}
    for name, overrides in arms.items():
        precision = str(overrides.get("rollout.precision", ""))
        if name == baseline:
            continue
        if not name.startswith(precision + " ") or not precision:
            raise ValueError(f"arm {name!r}: a frontier arm is named '<rollout.precision> <correction>' and sets "
                             f"rollout.precision")
        grid.setdefault(precision, {})[name[len(precision) + 1:]] = name
    return grid


def measure_mismatch(study, precisions: list[str], prompts: int, seed: int) -> dict[str, dict[str, Any]]:
    """{precision: NotchMismatch as a dict} on the study's base recipe with its shared overrides."""
    from dataclasses import asdict

    from dllm_ais.bench.mismatch import measure_notch, validation_prompts
    from dllm_ais.compare_plan import as_argument
    from dllm_ais.config import EMBEDDED_RECIPE, load_config
    from dllm_ais.loading import load_model, load_tokenizer
    from dllm_ais.policy import build_policy

    config = load_config(study.base or EMBEDDED_RECIPE,
                         [*(as_argument(k, v) for k, v in study.overrides.items()), "--output_dir=/tmp/unused"])
    tokenizer = load_tokenizer(config.model_name_or_path)
    model = load_model(config.model_name_or_path, torch.float32).eval()
    input_ids, attention_mask = validation_prompts(config, tokenizer, prompts, seed)
    policy = build_policy(config, model.config, tokenizer, temperature=1.0)
    return {precision: asdict(measure_notch(config, model, policy, precision, input_ids, attention_mask, seed))
            for precision in precisions}


def per_prompt_values(runs: list[str], metric: str) -> list[list[float]]:
    """Each run's held-out `metric` per prompt (after training)."""
    from dllm_ais.checkpoint_choice import read_held_out

    return [read_held_out(Path(run))["after"][metric] for run in runs]


def frontier(summary: dict[str, Any], grid: dict[str, dict[str, str]], mismatch: dict[str, dict[str, Any]]
             ) -> dict[str, Any]:
    """The frontier's rows (notches in order of one-step k3), the null arms and the verdict (module docstring).

    A row's Δ is against bf16 rollouts: per seed and prompt, the mean of the baseline arm and the null arms (the
    baseline's other sampling draws), so that one lucky or unlucky bf16 draw does not move every Δ alike. A null
    arm's own Δ is against the baseline arm alone: how far two bf16 draws part."""
    arms, metric = summary["arms"], summary["metric"]
    null_names = grid.get("bf16", {})
    values = {name: per_prompt_values(arms[name]["runs"], metric)
              for name in [summary["baseline"], *(name for names in grid.values() for name in names.values())]
              if name in arms}
    draws = [values[name] for name in [summary["baseline"], *null_names.values()]]
    pooled = [[sum(prompt) / len(draws) for prompt in zip(*seed_values)] for seed_values in zip(*draws)]

    def versus_bf16(name: str) -> dict[str, Any]:
        return versus_baseline(pooled, values[name])["across_seeds"]

    null = {label: arms[name]["versus_baseline"]["across_seeds"] for label, name in null_names.items()}
    bf16_draws = [versus_baseline(pooled, draw)["across_seeds"]["mean"] for draw in draws]
    rows = []
    for precision in sorted(set(grid) - {"bf16"}, key=lambda p: mismatch[p]["scored_canvas"]["k3"]):
        corrections = {label: versus_bf16(name) for label, name in grid[precision].items() if name in arms}
        rows.append({"precision": precision, "mismatch": mismatch[precision], "corrections": corrections})
    verdict: dict[str, Any] = {"first_losing_notch": None}
    for row in rows:
        uncorrected = row["corrections"].get(UNCORRECTED)
        if uncorrected and uncorrected["mean"] + LOSS_STANDARD_ERRORS * uncorrected["standard_error"] < 0:
            verdict["first_losing_notch"] = row["precision"]
            names = grid[row["precision"]]
            if AIS in row["corrections"]:
                paired = versus_baseline(values[names[UNCORRECTED]], values[names[AIS]])["across_seeds"]
                ais = row["corrections"][AIS]
                verdict.update(ais_minus_uncorrected=paired,
                               ais_within_2_points=ais["mean"] >= -RESCUE_POINTS,
                               ais_above_uncorrected=paired["mean"] > LOSS_STANDARD_ERRORS * paired["standard_error"])
            break
    return {"rows": rows, "null": null, "bf16_draws_vs_pooled": bf16_draws, "verdict": verdict}


def points(total: dict[str, Any] | None) -> str:
    """'mean ± seed SE' in points, or 'not run'."""
    if total is None:
        return "not run"
    error = "" if total["num_seeds"] < 2 else f" ± {100 * total['standard_error']:.1f}"
    return f"{100 * total['mean']:+.1f}{error}"


def markdown(result: dict[str, Any], labels: list[str], header: str) -> str:
    """The frontier table and its verdict."""
    lines = [header, "", "| notch | k3 (scored canvas) · trajectory | sequence ESS (scored canvas) · trajectory | "
             + " | ".join(f"Δ {label}" for label in labels) + " |", "| --- " * (3 + len(labels)) + "|"]
    for row in result["rows"]:
        scored, trajectory = row["mismatch"]["scored_canvas"], row["mismatch"]["trajectory"] or {}
        lines.append(f"| {row['precision']} | {scored['k3']:.1e} · {trajectory.get('k3', math.nan):.1e} | "
                     f"{scored['sequence_ess']:.4f} · {trajectory.get('sequence_ess', math.nan):.4f} | "
                     + " | ".join(points(row["corrections"].get(label)) for label in labels) + " |")
    for label, total in result["null"].items():
        lines.append(f"\nNull arm (bf16 rollouts, {label}: the baseline with another sampling draw): Δ {points(total)} "
                     "points against the baseline arm. Two bf16 draws part by that much; the rows' Δ are against their "
                     "per-prompt mean.")
    verdict = result["verdict"]
    notch = verdict["first_losing_notch"]
    if notch is None:
        lines.append("\nNo notch where uncorrected rollouts lose by more than 2 seed SE: nothing for a correction to "
                     "rescue on this ladder.")
    elif "ais_minus_uncorrected" not in verdict:
        lines.append(f"\nFirst notch where uncorrected rollouts lose by more than 2 seed SE: **{notch}** (AIS not run "
                     "there).")
    else:
        paired = verdict["ais_minus_uncorrected"]
        rescued = verdict["ais_within_2_points"] and verdict["ais_above_uncorrected"]
        lines.append(f"\nFirst notch where uncorrected rollouts lose by more than 2 seed SE: **{notch}**. There AIS is "
                     f"{'within' if verdict['ais_within_2_points'] else 'not within'} 2 points of bf16, and AIS − "
                     f"uncorrected = {points(paired)} points (paired per seed over prompts), "
                     f"{'above' if verdict['ais_above_uncorrected'] else 'not above'} 0 by more than 2 SE: AIS "
                     f"{'rescues' if rescued else 'does not rescue'} this notch.")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], labels: list[str], path: Path) -> None:
    """Δ accuracy (points) against the one-step k3 of each notch, one line per correction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7.5, 4.5))
    for index, label in enumerate(labels):
        cells = [(row["mismatch"]["scored_canvas"]["k3"], row["corrections"][label]) for row in result["rows"]
                 if label in row["corrections"]]
        if not cells:
            continue
        jitter = 1 + 0.04 * (index - (len(labels) - 1) / 2)  # side by side at a shared k3
        axis.errorbar([k3 * jitter for k3, _ in cells], [100 * total["mean"] for _, total in cells],
                      yerr=[100 * total["standard_error"] for _, total in cells], marker="o", capsize=3, label=label)
    if result["null"]:
        draws = [100 * delta for delta in result["bf16_draws_vs_pooled"]]
        axis.axhspan(min(draws), max(draws), color="gray", alpha=0.2,
                     label=f"the {len(draws)} bf16 draws against their mean (the null's spread)")
    for row in result["rows"]:
        axis.annotate(row["precision"], (row["mismatch"]["scored_canvas"]["k3"], 0), textcoords="offset points",
                      xytext=(0, 6), rotation=60, fontsize=7, color="gray")
    save_front(figure, axis, "rollout mismatch: k3 per token on the scored canvas (bench mismatch)", path)


def save_front(figure, axis, xlabel: str, path: Path) -> None:
    """Finish a plot of held-out Δ (points) against a mismatch on a log axis — the zero line, the rescue's 2-point
    line, the labels and legend — and write it to `path`."""
    axis.axhline(0, color="black", linewidth=0.8)
    axis.axhline(-100 * RESCUE_POINTS, color="gray", linewidth=0.8, linestyle="--")
    axis.set_xscale("log")
    axis.set_xlabel(xlabel)
    axis.set_ylabel("held-out Δ vs bf16 rollouts (points)")
    axis.legend(fontsize=8)
    figure.tight_layout()
    save_figure(figure, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dllm_ais.experimental.precision_frontier", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--study", type=Path, default=DEFAULT_STUDY)
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--arms", help="comma-separated arms to run (the baseline always runs); default: all")
    parser.add_argument("--output_dir", type=Path, help="the study folder (default: outputs/studies/<study name>)")
    parser.add_argument("--prompts", type=int, default=128, help="validation prompts for the mismatch")
    parser.add_argument("--report", default="frontier",
                        help="the report's file name (.md, .json, .png) in the study folder")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    command = "python -m dllm_ais.experimental.precision_frontier " + shlex.join(argv if argv is not None
                                                                                 else sys.argv[1:])
    arms = args.arms and [arm.strip() for arm in args.arms.split(",")]
    _, comparison = run_study(args.study, args.seeds, [], args.output_dir, args.jobs, arms, command)
    study, study_dir = read_study(args.study), comparison.parent
    summary = read_report(comparison.with_suffix(".json"))
    study_grid = arm_grid(study.arms, study.baseline)
    trained = {precision: {label: name for label, name in names.items() if name in summary["arms"]}
               for precision, names in study_grid.items()}
    grid = {precision: names for precision, names in trained.items() if names}
    mismatch = measure_mismatch(study, sorted(grid), args.prompts, seed=0)
    result = frontier(summary, grid, mismatch)
    trained_labels = {label for precision, names in grid.items() if precision != "bf16" for label in names}
    labels = [label for label in dict.fromkeys(label for precision, names in study_grid.items() if precision != "bf16"
                                                for label in names) if label in trained_labels]
    draws = f"{summary['baseline']} pooled with {len(result['null'])} null draw(s)" if result["null"] else summary[
        "baseline"]
    header = (f"precision frontier of {study.name} ({args.study.name}): {summary['seeds']} seeds, "
              f"{summary['num_prompts']} held-out prompts, Δ held-out {summary['metric']} vs {draws} in points (mean "
              f"over seeds ± seed SE); mismatch from {args.prompts} validation prompts; command: {command}")
    table = markdown(result, labels, header)
    report = study_dir / args.report
    write_file(report.with_suffix(".md"), table)
    write_file(report.with_suffix(".json"), json.dumps({**result, "command": command}, indent=2) + "\n")
    plot(result, labels, report.with_suffix(".png"))
    print(table + f"\nwritten: {report}.md, .json, .png")


if __name__ == "__main__":
    main()
