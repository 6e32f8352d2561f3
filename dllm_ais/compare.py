"""`dllm-ais compare STUDY.yaml --seeds N`: arms × seeds of one base recipe, paired against a baseline arm.

A study file names a base recipe, the overrides every arm shares, the arms (a name and its overrides) and the
baseline arm (`--baseline ARM` pairs against another arm instead, reusing the same runs):

    base: ../tiny_llada_chain_sum.yaml      # relative to the study file; left out: the embedded recipe
    overrides: {max_steps: 60, eval_size: 256}
    baseline: bf16                          # left out: the first arm
    arms:
      bf16: {rollout.precision: bf16, correction: none}
      int4 + AIS: {rollout.precision: int4, correction: ais}

Every (arm, seed) is one `dllm-ais train` into its own directory of the study folder (the overrides are passed
through as `--field=value`, never read here). A run whose `held_out.json` exists has finished and is reused; an
unfinished one is resumed from its newest checkpoint, or rerun (train itself refuses to replace anything it did not
write). The table pairs each arm with the baseline seed by seed over the same held-out prompts (Δ ± SE), then
aggregates the seeds' Δ (mean, seed-to-seed SE, 95 % t interval): `comparison.md`, `comparison.json` and
`comparison.png` in the study folder (`comparison-vs-<arm>.*` with `--baseline`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dllm_ais.statistics import across_seeds, mean, paired_difference

STUDY_KEYS = ("base", "overrides", "baseline", "arms")


class StudyError(Exception):
    """A study file that cannot be run, or a run of it that failed: one line naming what to fix."""


@dataclass(frozen=True)
class Study:
    """A parsed study file: the base recipe (None: the embedded one), the shared and per-arm overrides, the
    baseline arm."""

    name: str
    base: Path | None
    overrides: dict[str, Any]
    arms: dict[str, dict[str, Any]]
    baseline: str


@dataclass(frozen=True)
class Run:
    """One (arm, seed) of a study: its `dllm-ais train` arguments and its output directory."""

    arm: str
    seed: int
    arguments: tuple[str, ...]
    output_dir: Path

    @property
    def log(self) -> Path:
        """The run's console output, beside its output directory (never inside: train owns that); each attempt is
        appended under a header line naming its command."""
        return self.output_dir.with_suffix(".log")


def read_study(path: Path) -> Study:
    """Parse and check a study file (see the module docstring)."""
    import yaml

    try:
        values = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise StudyError(f"{path}: not YAML ({str(error).splitlines()[0]})") from None
    if not isinstance(values, dict) or not isinstance(values.get("arms"), dict) or not values["arms"]:
        raise StudyError(f"{path}: a study is a mapping with `arms: {{name: {{field: value}}}}` (and optional "
                         f"base, overrides, baseline)")
    unknown = sorted(set(values) - set(STUDY_KEYS))
    if unknown:
        raise StudyError(f"{path}: unknown keys {unknown}; a study has {', '.join(STUDY_KEYS)}")
    arms = {str(name): overrides or {} for name, overrides in values["arms"].items()}
    if not all(isinstance(overrides, dict) for overrides in [*arms.values(), values.get("overrides") or {}]):
        raise StudyError(f"{path}: every arm's overrides and `overrides` are mappings of config fields to values")
    baseline = str(values.get("baseline", next(iter(arms))))
    if baseline not in arms:
        raise StudyError(f"{path}: baseline {baseline!r} is not an arm; arms: {', '.join(arms)}")
    base = values.get("base")
    return Study(path.stem, None if base is None else (path.parent / base).resolve(), values.get("overrides") or {},
                 arms, baseline)


def as_argument(field: str, value: Any) -> str:
    """A config override as the CLI's `--field=value`: strings as they are, other values as compact JSON (YAML) text
    — without spaces, which would make the argument parser take it for the recipe's path."""
    return f"--{field}={value if isinstance(value, str) else json.dumps(value, separators=(',', ':'))}"


def slug(arm: str) -> str:
    """A directory name for an arm: `int4 + AIS` -> `int4-ais`."""
    return "-".join("".join(ch if ch.isalnum() else " " for ch in arm.lower()).split()) or "arm"


def plan_runs(study: Study, seeds: int, extra: list[str], study_dir: Path) -> list[Run]:
    """Every (arm, seed) of the study, baseline first. A run's directory is named by its arm and a hash of everything
    it trains with (base, shared, arm and extra overrides), so a changed arm never reuses an old run."""
    runs = []
    for arm in [study.baseline, *(name for name in study.arms if name != study.baseline)]:
        arguments = ([str(study.base)] if study.base else []) + [
            *(as_argument(k, v) for k, v in {**study.overrides, **study.arms[arm]}.items()), *extra]
        key = hashlib.sha1("\0".join(arguments).encode()).hexdigest()[:8]
        runs += [Run(arm, seed, (*arguments, f"--seed={seed}"), study_dir / f"{slug(arm)}-{key}" / f"seed{seed}")
                 for seed in range(seeds)]
    return runs


def train_command(run: Run) -> list[str]:
    """The run's `dllm-ais train`: fresh into an empty directory, resumed from its newest checkpoint when it has one,
    else rerun over what an earlier try of it wrote."""
    from dllm_ais.checkpoint import run_checkpoints

    command = [sys.executable, "-m", "dllm_ais.cli", "train", *run.arguments, f"--output_dir={run.output_dir}"]
    if run_checkpoints(run.output_dir):
        return [*command, "--resume_from_checkpoint=true"]
    if run.output_dir.is_dir() and any(run.output_dir.iterdir()):
        return [*command, "--overwrite_output_dir=true"]
    return command


def execute(run: Run, threads: int) -> str | None:
    """Train `run` unless it has finished; returns None, or one line saying how it failed."""
    from dllm_ais.checkpoint import read_held_out

    if read_held_out(run.output_dir) is not None:
        return None
    run.log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads)),
           "PYTHONUNBUFFERED": "1"}
    command = train_command(run)
    with run.log.open("a") as log:  # appended: an earlier attempt's output (or another writer's) is never lost
        log.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} dllm-ais compare runs: {' '.join(command)}\n")
        log.flush()
        code = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    if code != 0:
        return f"{run.arm} / seed {run.seed} failed (exit {code}); see {run.log}"
    if read_held_out(run.output_dir) is None:
        return f"{run.arm} / seed {run.seed} finished without a held-out evaluation (eval_size: 0?); see {run.log}"
    return None


def run_all(runs: list[Run], jobs: int) -> int:
    """Train the unfinished runs, `jobs` at a time, with a progress bar; returns how many were reused. Raises
    StudyError naming every run that failed, after the others have finished."""
    from tqdm.auto import tqdm

    from dllm_ais.checkpoint import read_held_out

    reused = sum(read_held_out(run.output_dir) is not None for run in runs)
    threads = max(1, (os.cpu_count() or 1) // jobs)
    with ThreadPoolExecutor(jobs) as pool:
        failures = [failure for failure in tqdm(pool.map(lambda run: execute(run, threads), runs), total=len(runs),
                                                desc="runs", dynamic_ncols=True) if failure]
    if failures:
        raise StudyError("; ".join(failures))
    return reused


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
    from dllm_ais.checkpoint import read_held_out

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


def markdown(summary: dict[str, Any], header: str) -> str:
    """The study as a markdown table: one row per arm."""
    metric = summary["metric"]
    lines = [header, "",
             f"| arm | held-out accuracy | held-out reward | Δ {metric} vs {summary['baseline']}, per seed "
             "(paired over prompts, ± SE) | mean Δ over seeds ± seed SE | 95 % CI |",
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
        lines.append(f"| {name} | {accuracy} | {over_seeds(entry['reward'])} | {paired} | {total} | {interval} |")
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

    figure, (curves, deltas) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(summary["arms"])
    for index, name in enumerate(names):
        color = plt.get_cmap("tab10")(index % 10)
        runs = [held_out_curve([json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()
                                if line.strip()]) for run in summary["arms"][name]["runs"]]
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
    figure.savefig(path, dpi=110)
    plt.close(figure)


def run_study(study_file: Path, seeds: int, extra: list[str], output_dir: Path | None, jobs: int,
              arms: list[str] | None, command: str, baseline: str | None = None) -> tuple[str, Path]:
    """Train what the study still needs, then write the report: comparison.md/.json/.png against the study's
    baseline, or comparison-vs-<arm>.md/.json/.png against another arm (`baseline`), whose runs are the same.
    Returns the table and the report's path without its suffix."""
    study = read_study(study_file)
    if baseline is not None and baseline not in study.arms:
        raise StudyError(f"--baseline: unknown {baseline!r}; the study's arms: {', '.join(study.arms)}")
    report = "comparison" if baseline in (None, study.baseline) else f"comparison-vs-{slug(baseline)}"
    baseline = baseline or study.baseline
    if arms is not None:
        unknown = sorted(set(arms) - set(study.arms))
        if unknown:
            raise StudyError(f"--arms: unknown {unknown}; the study's arms: {', '.join(study.arms)}")
    kept = {name: o for name, o in study.arms.items() if arms is None or name in arms or name == baseline}
    study = Study(study.name, study.base, study.overrides, kept, baseline)
    study_dir = output_dir or Path("outputs") / "studies" / study.name
    runs = plan_runs(study, seeds, extra, study_dir)
    reused = run_all(runs, jobs)
    summary = summarise(study, runs)
    header = (f"study {study.name} ({study_file}): base {summary['base']}, overrides {study.overrides or 'none'}"
              f"{', extra ' + ' '.join(extra) if extra else ''}; {seeds} seeds, {len(runs)} runs ({reused} reused), "
              f"{summary['num_prompts']} held-out prompts per run; command: {command}")
    table = markdown(summary, header)
    study_dir.mkdir(parents=True, exist_ok=True)
    (study_dir / f"{report}.md").write_text(table)
    (study_dir / f"{report}.json").write_text(json.dumps({**summary, "command": command}, indent=2) + "\n")
    plot(summary, study_dir / f"{report}.png")
    return table, study_dir / report
