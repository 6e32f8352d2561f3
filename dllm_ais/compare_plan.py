"""A `dllm-ais compare` study: its file (`read_study`), its runs (arm x seed, `plan_runs`), the config and the
held-out identity each resolves to, the `dllm-ais train` command of each, and a run's `Plan` (reuse, train, resume
or rerun: decided in `dllm_ais.compare_reuse`). The study's format and the whole flow: `dllm_ais.compare`.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dllm_ais.config import GRPOConfig

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
        from dllm_ais.checkpoint_choice import HELD_OUT_FILE

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


def one_line(text: str) -> str:
    """`text` with its line breaks (and runs of spaces) as single spaces."""
    return " ".join(text.split())


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


def train_command(run: Run, restart: bool = False) -> list[str]:
    """The run's `dllm-ais train`: fresh into an empty directory, resumed from its newest checkpoint when it has one
    (unless `restart`), else rerun over what an earlier try of it wrote."""
    from dllm_ais.run_dir import run_checkpoints

    command = [sys.executable, "-m", "dllm_ais.cli", "train", *run.arguments, f"--output_dir={run.output_dir}"]
    if run_checkpoints(run.output_dir) and not restart:
        return [*command, "--resume_from_checkpoint=true"]
    if run.output_dir.is_dir() and any(run.output_dir.iterdir()):
        return [*command, "--overwrite_output_dir=true"]
    return command
