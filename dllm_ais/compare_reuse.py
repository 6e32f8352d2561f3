"""Whether a finished `dllm-ais compare` run can be reused: its `held_out.json` records the planned identity
(config, held-out prompts, dllm-ais version) and the run beside it agrees with it (config.yaml, metrics.jsonl,
final/); what to do otherwise (`examine`). The rules: `dllm_ais.compare`'s docstring.
"""

from __future__ import annotations

import itertools
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dllm_ais.compare_plan import Plan, Run
from dllm_ais.statistics import mean

if TYPE_CHECKING:
    from dllm_ais.config import GRPOConfig

AGREEMENT = {"rel_tol": 1e-5, "abs_tol": 1e-6}  # a float32 mean the run logged against the same mean of its result


def read_result(output_dir: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(the record, None) of the `held_out.json` in a run's `output_dir` that dllm-ais wrote whole
    (`evaluation.held_out_problem`), or (None, why it is damaged or foreign)."""
    from dllm_ais.checkpoint_choice import read_held_out
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
    from dllm_ais.checkpoint_choice import CONFIG_FILE
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
    from dllm_ais.checkpoint_choice import RESUMABLE_CHANGES
    from dllm_ais.run_dir import run_checkpoints
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
