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
through as `--field=value`). Before anything trains, each run's config is resolved as train resolves it and its
held-out prompts are loaded: arms evaluated on different prompts (another eval_size, task or dataset) are refused,
as is eval_size 0. A finished run's `held_out.json` records what made it (`evaluation.result_identity`: the
resolved config's hash, the held-out prompts' hash, the dllm-ais version); the run is reused only when that record
is the planned one — or when its `config.yaml` differs from the planned config only by study knobs added to
dllm-ais since it ran, at their defaults (off: the behaviour it trained with) — and the run beside it agrees with it
(its `config.yaml` and its final model's config are the planned config, its `metrics.jsonl` logs the held-out
numbers the result recomputes to, its `final/` verifies and is of the last step); a run that does not agree is moved
aside whole (`<seed>.set-aside`) and trained again, and a result of another identity is rerun afresh. A
damaged or foreign `held_out.json` (not JSON, not a record dllm-ais wrote, no identity, values that do not match its
prompts) is moved aside, beside the run's directory, and the run trained again; an unfinished run is resumed from
its newest checkpoint when its config allows, else rerun (train itself refuses to replace anything it did not
write). One line per run says which and why. Every report is written by `safe_files.write_file` (staged, renamed,
never through a link), and arm names are escaped in the table (`|`, line breaks).

The table pairs each arm with the baseline seed by seed over the same held-out prompts (Δ ± SE), then aggregates the
seeds' Δ (mean, seed-to-seed SE, 95 % t interval): `comparison.md`, `comparison.json` and `comparison.png` in the
study folder (`comparison-vs-<arm>.*` with `--baseline`; `--report NAME` names them, so that a comparison of some
arms keeps the whole study's beside it). A report file that is a symbolic link is refused before anything trains.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dllm_ais.compare_plan import (Plan, Study, StudyError, plan_runs, planned_identities, read_study,
                                   resolved_config, slug, train_command)
from dllm_ais.compare_report import markdown, plot, report_files, summarise
from dllm_ais.compare_reuse import examine, identity_changes, read_result
from dllm_ais.safe_files import open_appending, write_file


def execute(plan: Plan, threads: int) -> str | None:
    """Train the plan's run unless it is reused; returns None, or one line saying how it failed — also when it
    finished without a result that records the planned identity."""
    run = plan.run
    if plan.reuse:
        return None
    run.log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads)),
           "PYTHONUNBUFFERED": "1"}
    command = train_command(run, plan.restart)
    with os.fdopen(open_appending(run.log), "a") as log:  # appended, never through a link: nothing is lost
        log.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} dllm-ais compare runs: {' '.join(command)}\n")
        log.flush()
        code = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    if code != 0:
        return f"{run.arm} / seed {run.seed} failed (exit {code}); see {run.log}"
    if not os.path.lexists(run.result):
        return f"{run.arm} / seed {run.seed} finished without writing {run.result.name}; see {run.log}"
    record, problem = read_result(run.output_dir)
    if problem is not None:
        changes = [problem]
    else:
        changes = [] if plan.identity is None else identity_changes(record["identity"], plan.identity)
    if changes:
        return f"{run.arm} / seed {run.seed} finished, but {run.result} is not the planned one ({'; '.join(changes)})"
    return None


def run_all(plans: list[Plan], jobs: int) -> int:
    """Train the runs not reused, `jobs` at a time, with a progress bar; returns how many were reused. Raises
    StudyError naming every run that failed, after the others have finished."""
    from tqdm.auto import tqdm

    threads = max(1, (os.cpu_count() or 1) // jobs)
    with ThreadPoolExecutor(jobs) as pool:
        failures = [failure for failure in tqdm(pool.map(lambda plan: execute(plan, threads), plans),
                                                total=len(plans), desc="runs", dynamic_ncols=True) if failure]
    if failures:
        raise StudyError("; ".join(failures))
    return sum(plan.reuse for plan in plans)


def run_study(study_file: Path, seeds: int, extra: list[str], output_dir: Path | None, jobs: int,
              arms: list[str] | None, command: str, baseline: str | None = None,
              report: str | None = None) -> tuple[str, Path]:
    """Train what the study still needs, then write the report: comparison.md/.json/.png against the study's
    baseline, or comparison-vs-<arm>.md/.json/.png against another arm (`baseline`), whose runs are the same;
    `report` names the files instead. Returns the table and the report's path without its suffix."""
    for flag, value in (("--seeds", seeds), ("--jobs", jobs)):
        if value < 1:
            raise StudyError(f"{flag} {value}: must be 1 or more ({flag} N: "
                             f"{'seeds 0..N-1 per arm' if flag == '--seeds' else 'N runs at a time'})")
    study = read_study(study_file)
    if baseline is not None and baseline not in study.arms:
        raise StudyError(f"--baseline: unknown {baseline!r}; the study's arms: {', '.join(study.arms)}")
    if report is None:
        report = "comparison" if baseline in (None, study.baseline) else f"comparison-vs-{slug(baseline)}"
    baseline = baseline or study.baseline
    if arms is not None:
        unknown = sorted(set(arms) - set(study.arms))
        if unknown:
            raise StudyError(f"--arms: unknown {unknown}; the study's arms: {', '.join(study.arms)}")
    kept = {name: o for name, o in study.arms.items() if arms is None or name in arms or name == baseline}
    study = Study(study.name, study.base, study.overrides, kept, baseline)
    study_dir = output_dir or Path("outputs") / "studies" / study.name
    report_files(study_dir, report)  # a bad name or a link is refused before the training, not after it
    runs = plan_runs(study, seeds, extra, study_dir)
    configs = {run: resolved_config(run) for run in runs}
    identities = planned_identities(runs, configs)
    plans = [examine(run, configs[run], identities[run]) for run in runs]
    print("\n".join(plan.line for plan in plans), flush=True)
    reused = run_all(plans, jobs)
    summary = summarise(study, runs)
    header = (f"study {study.name} ({study_file}): base {summary['base']}, overrides {study.overrides or 'none'}"
              f"{', extra ' + ' '.join(extra) if extra else ''}; {seeds} seeds, {len(runs)} runs ({reused} reused), "
              f"{summary['num_prompts']} held-out prompts per run; command: {command}")
    table = markdown(summary, header)
    study_dir.mkdir(parents=True, exist_ok=True)
    table_file, numbers_file, plot_file = report_files(study_dir, report)
    write_file(table_file, table)
    write_file(numbers_file, json.dumps({**summary, "command": command}, indent=2) + "\n")
    plot(summary, plot_file)
    return table, study_dir / report
