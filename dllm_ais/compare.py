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

import hashlib
import itertools
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dllm_ais.safe_files import link_refusal, open_appending, read_regular_file, save_figure, write_file
from dllm_ais.safe_json import loads_bounded
from dllm_ais.statistics import across_seeds, mean, paired_difference

if TYPE_CHECKING:
    from dllm_ais.config import GRPOConfig

STUDY_KEYS = ("base", "overrides", "baseline", "arms")
MAX_REPORT_BYTES = 1 << 30  # a comparison.json holds a few numbers per arm and seed
AGREEMENT = {"rel_tol": 1e-5, "abs_tol": 1e-6}  # a float32 mean the run logged against the same mean of its result


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
    """One (arm, seed) of a study: its config overrides (`--field=value`), its output directory and its recipe
    (None: the embedded one)."""

    arm: str
    seed: int
    overrides: tuple[str, ...]
    output_dir: Path
    recipe: Path | None = None

    @property
    def arguments(self) -> tuple[str, ...]:
        """The run's `dllm-ais train` arguments: its recipe, then its overrides."""
        return ((str(self.recipe),) if self.recipe else ()) + self.overrides

    @property
    def log(self) -> Path:
        """The run's console output, beside its output directory (never inside: train owns that); each attempt is
        appended under a header line naming its command."""
        return self.output_dir.with_suffix(".log")

    @property
    def result(self) -> Path:
        """The run's `held_out.json`: present once it has finished."""
        from dllm_ais.checkpoint import HELD_OUT_FILE

        return self.output_dir / HELD_OUT_FILE


@dataclass(frozen=True)
class Plan:
    """What compare does with one run: reuse its result, or train it — afresh over its outputs when `restart`, else
    as `train_command` chooses (fresh, resumed) — and why (`reason`). `identity` is the `result_identity` its
    held-out result must record; None when its config does not resolve (its train then names the problem)."""

    run: Run
    reuse: bool
    restart: bool
    reason: str
    identity: dict[str, Any] | None

    @property
    def line(self) -> str:
        """`seed S arm A: reused|run|resume|rerun — why`."""
        if self.reuse:
            action = "reused"
        else:
            actions = {"--resume_from_checkpoint=true": "resume", "--overwrite_output_dir=true": "rerun"}
            action = actions.get(train_command(self.run, self.restart)[-1], "run")
        return f"seed {self.run.seed} arm {one_line(self.run.arm)}: {action} — {self.reason}"


def read_report(path: Path) -> dict[str, Any]:
    """A compare report's numbers (`comparison.json`, see `run_study`), read through no link and bounded in size."""
    return loads_bounded(read_regular_file(path, MAX_REPORT_BYTES), MAX_REPORT_BYTES, max_depth=8)


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
    with_comma = [name for name in arms if "," in name]
    if with_comma:
        raise StudyError(f"{path}: arm names {with_comma} hold a comma, which --arms splits on: rename them")
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
    """Every (arm, seed) of the study, baseline first. A run's directory is named by its arm and a hash of the
    arguments it trains with (base recipe's path, shared, arm and extra overrides); what those arguments resolve to
    (the recipe's content included) is checked against a finished run's result by `examine`."""
    runs = []
    for arm in [study.baseline, *(name for name in study.arms if name != study.baseline)]:
        overrides = [*(as_argument(k, v) for k, v in {**study.overrides, **study.arms[arm]}.items()), *extra]
        arguments = ([str(study.base)] if study.base else []) + overrides
        key = hashlib.sha1("\0".join(arguments).encode()).hexdigest()[:8]
        runs += [Run(arm, seed, (*overrides, f"--seed={seed}"), study_dir / f"{slug(arm)}-{key}" / f"seed{seed}",
                     study.base) for seed in range(seeds)]
    return runs


def resolved_config(run: Run) -> GRPOConfig | None:
    """The `GRPOConfig` `dllm-ais train` resolves for `run` (its recipe, then its overrides); None when it does not
    resolve (the run's train then names the problem in its log)."""
    from dllm_ais.config import EMBEDDED_RECIPE, ConfigError, load_config

    try:
        return load_config(run.recipe or EMBEDDED_RECIPE, [*run.overrides, f"--output_dir={run.output_dir}"])
    except ConfigError:
        return None


def planned_identities(runs: list[Run], configs: dict[Run, GRPOConfig | None]) -> dict[Run, dict[str, Any] | None]:
    """Each run's `result_identity`: its config's hash and its held-out prompts' (loaded as train loads them).
    StudyError, before anything trains, when an arm evaluates no held-out prompts (eval_size 0) or when the arms of
    one seed are evaluated on different prompts — the table pairs them prompt by prompt."""
    from dllm_ais.data import load_task_dataset
    from dllm_ais.evaluation import result_identity

    resolved = [run for run in runs if configs[run] is not None]
    without = sorted({run.arm for run in resolved if configs[run].eval_size == 0})
    if without:
        raise StudyError(f"arms {', '.join(without)}: eval_size 0 evaluates no held-out prompts, and compare pairs "
                         f"runs on them; set eval_size > 0 in the study's shared overrides")
    prompts: dict[str, Any] = {}
    identities: dict[Run, dict[str, Any] | None] = dict.fromkeys(runs)
    for run in resolved:
        config = configs[run]
        source = (config.task, config.dataset_path, config.eval_size, config.seed, config.task_args)
        key = json.dumps(source, sort_keys=True, default=str)
        if key not in prompts:
            try:
                prompts[key] = load_task_dataset(config.task, split="validation", path=config.dataset_path,
                                                 size=config.eval_size, seed=config.seed, task_args=config.task_args)
            except Exception as error:  # noqa: BLE001 - its train would fail alike: named here, before any run
                raise StudyError(f"arm {run.arm}: its held-out prompts do not load "
                                 f"({str(error).splitlines()[0] if str(error) else type(error).__name__})") from None
        identities[run] = result_identity(config, prompts[key])
    for seed in sorted({run.seed for run in resolved}):
        groups: dict[str, list[str]] = {}
        for run in resolved:
            if run.seed == seed:
                groups.setdefault(identities[run]["prompts_sha256"], []).append(
                    f"{run.arm} (eval_size {configs[run].eval_size})")
        if len(groups) > 1:
            raise StudyError(f"arms {' vs '.join(', '.join(arms) for arms in groups.values())} are evaluated on "
                             f"different held-out prompts (seed {seed}); a paired comparison needs the same: set "
                             "eval_size, task and dataset in the study's shared overrides, not per arm")
    return identities


def read_result(output_dir: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(the record, None) of the `held_out.json` in a run's `output_dir` that dllm-ais wrote whole
    (`evaluation.held_out_problem`), or (None, why it is damaged or foreign)."""
    from dllm_ais.checkpoint import read_held_out
    from dllm_ais.evaluation import held_out_problem
    from dllm_ais.safe_files import FileTooLarge

    try:
        record = read_held_out(output_dir)
    except FileTooLarge as error:
        return None, f"{error.size} bytes, more than a result holds"
    except OSError:
        return None, "not a regular file"
    except ValueError:
        return None, "not JSON: truncated, or not written by dllm-ais"
    problem = held_out_problem(record)
    return (None, problem) if problem else (record, None)


def set_aside(path: Path, run_dir: Path, label: str, suffix: str = "") -> Path:
    """Move `path` (a run's damaged or foreign `held_out.json`, or the run directory `run_dir` itself) beside
    `run_dir`, to `<run dir>.<label>[-N]<suffix>` — never over another entry — so that rerunning the run deletes
    nothing the user may want; returns where it went."""
    names = (f"{run_dir.name}.{label}{'' if number == 1 else f'-{number}'}{suffix}" for number in itertools.count(1))
    aside = next(run_dir.with_name(name) for name in names if not os.path.lexists(run_dir.with_name(name)))
    os.rename(path, aside)
    return aside


def logged_held_out(record: dict[str, Any]) -> dict[str, float]:
    """The closing metrics a run logs of its held-out evaluation (`evaluation.held_out_metrics`), recomputed from
    its result `record`: the reward's mean and number of prompts, the accuracy's mean, the baseline reward's mean."""
    after, before = record["after"], record["before"]
    values = {"eval/reward": mean(after["reward"]), "eval/num_prompts": float(len(after["reward"]))}
    if after["accuracy"] is not None:
        values["eval/accuracy"] = mean(after["accuracy"])
    if before is not None:
        values["eval/reward_before"] = mean(before["reward"])
    return values


def config_disagreement(output_dir: Path, name: str, config: GRPOConfig) -> str | None:
    """Why the config the run in `output_dir` saved as `name` (its `config.yaml`, its final model's) is not `config`
    — missing, not a regular file, not a recipe, or another value of a field the result depends on — or None."""
    from dllm_ais.evaluation import UNHASHED_FIELDS

    path = output_dir / name
    if not path.is_file() or path.is_symlink():
        return f"its {name} is missing or not a regular file"
    fields = changed_fields(path, config, UNHASHED_FIELDS)
    if fields is None:
        return f"its {name} does not read as a recipe"
    return f"its {name} is not the planned config ({'; '.join(fields[:4])})" if fields else None


def metrics_disagreement(output_dir: Path, config: GRPOConfig, record: dict[str, Any]) -> str | None:
    """Why the run's `metrics.jsonl` does not show the result `record` — missing or not a regular file, no closing
    held-out line, one of another step than `max_steps`, or numbers other than the ones recomputed from `record`
    (`logged_held_out`) — or None."""
    from dllm_ais.metrics import read_records

    try:
        records = read_records(output_dir / "metrics.jsonl")
    except OSError:
        return "its metrics.jsonl is missing or not a regular file"
    closing = [line for line in records if "eval/reward" in line and "loss" not in line]
    if not closing:
        return "its metrics.jsonl logs no closing held-out evaluation"
    if closing[-1].get("step") != config.max_steps:
        return (f"its metrics.jsonl logs the held-out evaluation at step {closing[-1].get('step')}, not "
                f"{config.max_steps}")
    for key, value in logged_held_out(record).items():
        logged = closing[-1].get(key)
        if not isinstance(logged, (int, float)) or not math.isclose(logged, value, **AGREEMENT):
            return f"its metrics.jsonl logs {key} {logged}, its result gives {value:.6g}"
    return None


def final_disagreement(output_dir: Path, config: GRPOConfig) -> str | None:
    """Why the run's `final/` is not the model its result was evaluated on — missing, not a final model dllm-ais
    wrote, damaged (`run_dir.verify_checkpoint`), of another step than `max_steps`, or saved with another config —
    or None."""
    from dllm_ais.checkpoint import CONFIG_FILE
    from dllm_ais.run_dir import directory_kind, provenance, verify_checkpoint

    final = output_dir / "final"
    if final.is_symlink() or directory_kind(final) != "final":
        return "its final/ is missing or not a final model dllm-ais wrote"
    if (damage := verify_checkpoint(final, kind="final")) is not None:
        return f"its final/ is damaged ({damage})"
    step = provenance(final).get("step")
    if step != config.max_steps:
        return f"its final/ is of step {step}, not {config.max_steps}"
    return config_disagreement(output_dir, f"final/{CONFIG_FILE}", config)


def run_disagreement(output_dir: Path, config: GRPOConfig, record: dict[str, Any]) -> str | None:
    """Why the run in `output_dir` is not the one that made its result `record` — its own resolved config, its
    metrics and its final model each checked against the result — or None when they agree."""
    return (config_disagreement(output_dir, "config.yaml", config)
            or metrics_disagreement(output_dir, config, record) or final_disagreement(output_dir, config))


def changed_fields(saved: Path, config: GRPOConfig, unchanging: frozenset[str]) -> list[str] | None:
    """`field: old -> new` for every field outside `unchanging` whose value in a run's saved config (`saved`: its
    `config.yaml`, what it trained with) differs from `config`'s; None when that file does not read as a recipe."""
    from dllm_ais.config import ConfigError, changed_settings

    try:
        return changed_settings(saved, config, unchanging)
    except ConfigError:
        return None


def experimental_settings_added(output_dir: Path, config: GRPOConfig) -> list[str] | None:
    """The experimental settings added to dllm-ais since the run in `output_dir` was configured (absent from its
    `config.yaml`), when every setting added since is one; None when another was, or the file does not read as a
    recipe. A study knob's default is the behaviour before it existed (`ExperimentalSettings`), so a run whose
    config differs from the planned one only by such settings at their defaults trained what is planned."""
    from dllm_ais.config import ConfigError, settings_added_since

    try:
        added = settings_added_since(output_dir / "config.yaml", config)
    except ConfigError:
        return None
    return added if all(name.startswith("experimental.") for name in added) else None


def identity_changes(recorded: dict[str, Any], planned: dict[str, Any], fields: list[str] | None = None) -> list[str]:
    """How the `result_identity` a result records differs from the planned one, one phrase per part (dllm-ais
    version, config with its changed `fields` when known, held-out prompts); [] when they are the same."""
    from dllm_ais.validation import show

    changes = []
    if recorded.get("dllm_ais_version") != planned["dllm_ais_version"]:
        changes.append(f"made by dllm-ais {show(recorded.get('dllm_ais_version'))}, this is "
                       f"{planned['dllm_ais_version']!r}")
    if recorded["config_sha256"] != planned["config_sha256"]:
        what = f" ({'; '.join(fields[:4])}{'; …' if len(fields) > 4 else ''})" if fields else ""
        changes.append(f"config changed since it ran{what} (config hash {recorded['config_sha256'][:12]} → "
                       f"{planned['config_sha256'][:12]})")
    if (recorded["prompts_sha256"], recorded["num_prompts"]) != (planned["prompts_sha256"], planned["num_prompts"]):
        changes.append(f"held-out prompts changed ({recorded['num_prompts']} → {planned['num_prompts']} prompts, "
                       f"prompts hash {recorded['prompts_sha256'][:12]} → {planned['prompts_sha256'][:12]})")
    return changes


def examine(run: Run, config: GRPOConfig | None, identity: dict[str, Any] | None) -> Plan:
    """What to do with `run` and why: reuse its result when it records `identity` and the run beside it agrees
    with it (`run_disagreement`: its config.yaml, metrics.jsonl and final/); when the run does not agree, move the
    whole run directory aside (`set_aside`) and train it afresh; rerun it afresh when the result records another
    identity (a changed recipe, prompts or dllm-ais version); when its result is damaged or foreign, move the file
    aside and train it like an unfinished run: resumed from its newest checkpoint unless its `config.yaml` shows a
    change a resume refuses, else afresh."""
    from dllm_ais.checkpoint import RESUMABLE_CHANGES, run_checkpoints
    from dllm_ais.evaluation import UNHASHED_FIELDS

    reasons = []
    if os.path.lexists(run.result):
        record, problem = read_result(run.output_dir)
        if problem is not None:
            aside = set_aside(run.result, run.output_dir, "held_out.damaged", ".json")
            reasons.append(f"{run.result} is damaged or foreign ({problem}); kept as {aside}")
        elif identity is None:
            return Plan(run, False, False, "its config does not resolve; its train names the problem", None)
        else:
            recorded = record["identity"]
            fields = (changed_fields(run.output_dir / "config.yaml", config, UNHASHED_FIELDS)
                      if recorded["config_sha256"] != identity["config_sha256"] else None)
            added = experimental_settings_added(run.output_dir, config) if fields == [] else None
            if added:  # the config it trained is the planned one: its hash predates the settings added
                recorded = {**recorded, "config_sha256": identity["config_sha256"]}
            changes = identity_changes(recorded, identity, fields)
            if changes:
                return Plan(run, False, True, "; ".join(changes), identity)
            if (disagreement := run_disagreement(run.output_dir, config, record)) is not None:
                aside = set_aside(run.output_dir, run.output_dir, "set-aside")
                return Plan(run, False, False, f"its result does not agree with the run beside it ({disagreement}); "
                            f"the run directory is kept as {aside}", identity)
            config_part = (f"its config.yaml is the planned config but for study knobs added since it ran, at their "
                           f"defaults ({', '.join(added[:4])}{', …' if len(added) > 4 else ''}); the same"
                           if added else f"its result records the same config (hash {identity['config_sha256'][:12]}),")
            return Plan(run, True, False, f"{config_part} held-out prompts ({identity['prompts_sha256'][:12]}) and "
                        f"dllm-ais {identity['dllm_ais_version']}", identity)
    if not (run.output_dir.is_dir() and any(run.output_dir.iterdir())):
        return Plan(run, False, False, "; ".join(reasons) or "not run yet", identity)
    if run_checkpoints(run.output_dir):
        saved = run.output_dir / "config.yaml"
        changes = None if config is None else changed_fields(saved, config, RESUMABLE_CHANGES)
        if changes:
            reasons.append(f"unfinished, and its config changed since it started ({'; '.join(changes[:4])}): a "
                           "resume would be refused")
            return Plan(run, False, True, "; ".join(reasons), identity)
        return Plan(run, False, False, "; ".join(reasons) or "unfinished: continues from its newest checkpoint",
                    identity)
    return Plan(run, False, False, "; ".join(reasons) or "unfinished, with no checkpoint to resume from", identity)


def train_command(run: Run, restart: bool = False) -> list[str]:
    """The run's `dllm-ais train`: fresh into an empty directory, resumed from its newest checkpoint when it has one
    (unless `restart`), else rerun over what an earlier try of it wrote."""
    from dllm_ais.checkpoint import run_checkpoints

    command = [sys.executable, "-m", "dllm_ais.cli", "train", *run.arguments, f"--output_dir={run.output_dir}"]
    if run_checkpoints(run.output_dir) and not restart:
        return [*command, "--resume_from_checkpoint=true"]
    if run.output_dir.is_dir() and any(run.output_dir.iterdir()):
        return [*command, "--overwrite_output_dir=true"]
    return command


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


def one_line(text: str) -> str:
    """`text` with its line breaks (and runs of spaces) as single spaces."""
    return " ".join(text.split())


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
