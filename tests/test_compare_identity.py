"""`dllm-ais compare` reuses a run only when its `held_out.json` records what the study would train now: the resolved
config's hash, the held-out prompts' hash and the dllm-ais version. A changed base recipe reruns; a damaged or
foreign result is named, kept aside and rerun, never tabled; arms on different held-out prompts, eval_size 0 and
`--seeds`/`--jobs` below 1 are refused before anything trains.

The fast tests train with `train_stand_in`: the real directory checks (`prepare_output_dir`), `config.yaml` and
`held_out.json` (`write_held_out`) of the config the real `dllm-ais train` command line resolves to, without the
training. The slow test trains for real."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from dllm_ais import compare, compare_plan, compare_reuse
from dllm_ais.checkpoint_choice import CONFIG_FILE, HELD_OUT_FILE, prepare_output_dir, write_held_out
from dllm_ais.cli import build_parser, main
from dllm_ais.config import EMBEDDED_RECIPE, load_config, save_config
from dllm_ais.data import load_task_dataset
from dllm_ais.evaluation import EvalResult, config_sha256, held_out_metrics, held_out_record, result_identity
from dllm_ais.run_dir import atomic_directory
from dllm_ais.run_lock import release_run_lock

TINY = {"max_steps": 2, "eval_size": 4, "dataset_size": 8, "per_device_train_batch_size": 4, "num_generations": 2,
        "num_iterations": 1, "experimental.eval_rollout_sampler": False}


def train_stand_in(command: list[str], **_) -> int:
    """What `dllm-ais train` leaves in its output_dir for `command`, without training: its directory taken as train
    takes it (foreign files refused, an earlier run's outputs replaced), its `config.yaml`, its `final/` (a marked
    model directory of step max_steps), a `metrics.jsonl` closing with the held-out metrics and a `held_out.json`
    of the held-out prompts train would load (every reward 0.5)."""
    args, overrides = build_parser().parse_known_args(command[3:])
    config = load_config(args.recipe or EMBEDDED_RECIPE, overrides)
    prepare_output_dir(config)
    release_run_lock(config.output_dir)
    output_dir = Path(config.output_dir)
    save_config(config, output_dir / "config.yaml")
    with atomic_directory(output_dir / "final", overwrite=True, kind="final", step=config.max_steps) as staging:
        (staging / "adapter_model.safetensors").write_bytes(b"weights")
        save_config(config, staging / CONFIG_FILE)
    held_out = load_task_dataset(config.task, split="validation", size=config.eval_size, seed=config.seed)
    values = torch.full((len(held_out),), 0.5)
    result = EvalResult(values, values.clone(), {"reward": values})
    closing = {"step": config.max_steps, **held_out_metrics(result, result)}
    (output_dir / "metrics.jsonl").write_text(json.dumps(closing) + "\n")
    write_held_out(config, held_out, result, result)
    return 0


@pytest.fixture
def trains(monkeypatch):
    """The runs compare trains (their output_dir), in order, each trained by `train_stand_in`."""
    trained = []

    def call(command, **kwargs):
        trained.append(Path(command[-1 if command[-1].startswith("--output_dir") else -2].split("=", 1)[1]))
        return train_stand_in(command, **kwargs)

    monkeypatch.setattr(compare.subprocess, "call", call)
    return trained


def write_study(folder: Path, arms: dict, base: Path | None = None, overrides: dict | None = None) -> Path:
    study = folder / "study.yaml"
    study.write_text(json.dumps({**({"base": str(base)} if base else {}), "overrides": overrides or TINY,
                                 "baseline": next(iter(arms)), "arms": arms}))
    return study


def compare_lines(out: str) -> dict[str, str]:
    """compare's one line per run, by `seed S arm A`."""
    return {line.split(":")[0]: line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("seed ")}


def study_runs(study: Path, folder: Path, seeds: int) -> list[compare_plan.Run]:
    return compare_plan.plan_runs(compare_plan.read_study(study), seeds, [], folder)


def test_an_edited_base_recipe_reruns_every_run_with_the_new_value(tmp_path, trains, capsys):
    """The attack: a study on a base recipe file, run; then `learning_rate` edited in that YAML and the study run
    again. Old code: "2 runs (2 reused)", the old learning rate in every config.yaml."""
    recipe = tmp_path / "base.yaml"
    shutil.copy(EMBEDDED_RECIPE, recipe)
    study = write_study(tmp_path, {"none": {"correction": "none"}, "ais": {"correction": "ais"}}, base=recipe)
    folder = tmp_path / "study"
    assert main(["compare", str(study), "--seeds", "1", f"--output_dir={folder}"]) == 0
    assert "2 runs (0 reused)" in capsys.readouterr().out and len(trains) == 2

    recipe.write_text(recipe.read_text().replace("learning_rate: 5.0e-4", "learning_rate: 1.0e-3"))
    assert main(["compare", str(study), "--seeds", "1", f"--output_dir={folder}"]) == 0
    out = capsys.readouterr().out
    assert "2 runs (0 reused)" in out and len(trains) == 4
    for run in study_runs(study, folder, 1):
        line = compare_lines(out)[f"seed 0 arm {run.arm}"]
        assert line.startswith("rerun — config changed since it ran (learning_rate: 0.0005 -> 0.001) (config hash ")
        assert load_config(run.output_dir / "config.yaml").learning_rate == 1e-3
        recorded = json.loads(run.result.read_text())["identity"]
        assert recorded["config_sha256"] == config_sha256(compare_plan.resolved_config(run))

    assert main(["compare", str(study), "--seeds", "1", f"--output_dir={folder}"]) == 0
    out = capsys.readouterr().out
    assert "2 runs (2 reused)" in out and len(trains) == 4
    assert all(line.startswith("reused — its result records the same config") for line in compare_lines(out).values())


def finished_study(tmp_path: Path, capsys) -> tuple[Path, Path, compare_plan.Run]:
    """A one-arm, one-seed study trained once; returns (study file, study folder, its run)."""
    study = write_study(tmp_path, {"none": {"correction": "none"}})
    folder = tmp_path / "study"
    assert main(["compare", str(study), "--seeds", "1", f"--output_dir={folder}"]) == 0
    capsys.readouterr()
    return study, folder, study_runs(study, folder, 1)[0]


def truncated(record: dict) -> str:
    text = json.dumps(record)
    return text[:len(text) // 2]


def one_value_short(record: dict) -> str:
    record["after"]["reward"] = record["after"]["reward"][:-1]
    return json.dumps(record)


def without_identity(record: dict) -> str:
    return json.dumps({"before": record["before"], "after": record["after"]})  # the format of earlier releases


@pytest.mark.parametrize(("damage", "named"), [
    (truncated, "not JSON: truncated, or not written by dllm-ais"),
    (lambda record: "{}", "not a result record written by dllm-ais"),
    (one_value_short, "3 after reward values for the 4 prompts it records"),
    (without_identity, "no record of the config, prompts and version that made it (earlier releases wrote none)"),
    (lambda record: json.dumps({**record, "identity": {"config": "?"}}), "no record of the config, prompts and "
                                                                         "version that made it"),
])
def test_a_damaged_or_foreign_result_is_named_kept_aside_and_rerun(tmp_path, trains, capsys, damage, named):
    """Old code: a JSONDecodeError, KeyError or ValueError traceback, or the planted values in the table."""
    study, folder, run = finished_study(tmp_path, capsys)
    text = damage(json.loads(run.result.read_text()))
    run.result.write_text(text)
    assert main(["compare", str(study), "--seeds", "1", f"--output_dir={folder}"]) == 0
    out = capsys.readouterr().out
    aside = run.output_dir.with_name("seed0.held_out.damaged.json")
    assert compare_lines(out)["seed 0 arm none"] == (f"rerun — {run.result} is damaged or foreign ({named}); kept as "
                                                     f"{aside}")
    assert aside.read_text() == text and trains[-1] == run.output_dir and "1 runs (0 reused)" in out
    assert json.loads(run.result.read_text())["identity"]["num_prompts"] == 4


def test_a_planted_result_in_a_run_never_trained_is_kept_aside_and_the_run_trained(tmp_path, trains, capsys):
    """A `held_out.json` put where a run of the study would go, with numbers but no record of what made them. Old
    code: the planted numbers in the table, "1 runs (1 reused)". A second damaged file is kept beside the first."""
    study = write_study(tmp_path, {"none": {"correction": "none"}})
    folder = tmp_path / "study"
    run = study_runs(study, folder, 1)[0]
    planted = json.dumps({"before": None, "after": {"accuracy": [1.0] * 4, "reward": [1.0] * 4}})
    for attempt in (1, 2):
        run.output_dir.mkdir(parents=True, exist_ok=True)
        run.result.write_text(planted)
        assert main(["compare", str(study), "--seeds", "1", f"--output_dir={folder}"]) == 0
        out = capsys.readouterr().out
        aside = run.output_dir.with_name("seed0.held_out.damaged" + ("" if attempt == 1 else "-2") + ".json")
        assert f"kept as {aside}" in compare_lines(out)["seed 0 arm none"] and aside.read_text() == planted
        assert "| none | 0.5000 |" in out and len(trains) == attempt


def test_a_result_of_other_prompts_or_another_version_is_rerun(tmp_path, trains, capsys):
    """A whole record whose identity is not the planned one — another dllm-ais version, other held-out prompts —
    is rerun (afresh over its own run), saying which part differs."""
    study, folder, run = finished_study(tmp_path, capsys)
    record = json.loads(run.result.read_text())
    planned = dict(record["identity"])
    record["identity"] = {**planned, "dllm_ais_version": "0.0.1", "prompts_sha256": "0" * 64}
    run.result.write_text(json.dumps(record))
    assert main(["compare", str(study), "--seeds", "1", f"--output_dir={folder}"]) == 0
    line = compare_lines(capsys.readouterr().out)["seed 0 arm none"]
    assert line == (f"rerun — made by dllm-ais '0.0.1', this is {planned['dllm_ais_version']!r}; held-out prompts "
                    f"changed (4 → 4 prompts, prompts hash 000000000000 → {planned['prompts_sha256'][:12]})")
    assert json.loads(run.result.read_text())["identity"] == planned and len(trains) == 2
    assert not list(folder.rglob("*.damaged*.json"))  # dllm-ais' own stale result is replaced, not kept aside


def as_configured_before(run: compare_plan.Run, missing: str) -> None:
    """Make `run` look trained by a release without the setting `missing` (``group.field`` or a top-level field):
    its config.yaml without it, its result recording that release's config hash."""
    import yaml

    saved = yaml.safe_load((run.output_dir / "config.yaml").read_text())
    group, _, name = missing.rpartition(".")
    del (saved[group] if group else saved)[name]
    (run.output_dir / "config.yaml").write_text(yaml.safe_dump(saved))
    record = json.loads(run.result.read_text())
    record["identity"]["config_sha256"] = "0" * 64
    run.result.write_text(json.dumps(record))


@pytest.mark.parametrize(("missing", "arm", "reused"), [
    ("experimental.commit_choice_as_set", {}, True),
    ("experimental.rollout_seed_offset", {"experimental.rollout_seed_offset": 3}, False),
    ("weight_decay", {}, False),
])
def test_a_run_from_before_a_study_knob_existed_is_reused_at_its_default(tmp_path, trains, capsys, missing, arm,
                                                                          reused):
    """A study knob added since a run trained is off at its default, which is what the run trained: the run is
    reused, saying so. A knob the study sets away from its default, or any other setting added since, reruns."""
    study = write_study(tmp_path, {"none": {"correction": "none", **arm}})
    folder = tmp_path / "study"
    assert main(["compare", str(study), "--seeds", "1", f"--output_dir={folder}"]) == 0
    capsys.readouterr()
    as_configured_before(study_runs(study, folder, 1)[0], missing)
    assert main(["compare", str(study), "--seeds", "1", f"--output_dir={folder}"]) == 0
    line = compare_lines(capsys.readouterr().out)["seed 0 arm none"]
    if reused:
        assert line.startswith("reused — its config.yaml is the planned config but for study knobs added since it "
                               f"ran, at their defaults ({missing}); the same held-out prompts") and len(trains) == 1
    else:
        assert line.startswith("rerun — config changed since it ran") and len(trains) == 2


def test_arms_on_different_held_out_prompts_are_refused_before_training(tmp_path, trains, capsys):
    """Old code: every run trained, then a ValueError traceback from the paired difference."""
    study = write_study(tmp_path, {"small": {"eval_size": 4}, "big": {"eval_size": 8}, "same": {"correction": "tis"}})
    assert main(["compare", str(study), "--seeds", "2", f"--output_dir={tmp_path / 'study'}"]) == 1
    assert capsys.readouterr().err == (
        "error: arms small (eval_size 4), same (eval_size 4) vs big (eval_size 8) are evaluated on different held-out "
        "prompts (seed 0); a paired comparison needs the same: set eval_size, task and dataset in the study's shared "
        "overrides, not per arm\n")
    study = write_study(tmp_path, {"none": {}, "blind": {"eval_size": 0}})
    assert main(["compare", str(study), "--seeds", "1", f"--output_dir={tmp_path / 'study'}"]) == 1
    assert capsys.readouterr().err == ("error: arms blind: eval_size 0 evaluates no held-out prompts, and compare "
                                       "pairs runs on them; set eval_size > 0 in the study's shared overrides\n")
    assert trains == [] and not (tmp_path / "study").exists()


@pytest.mark.parametrize("arguments", [["--seeds", "0"], ["--jobs", "0"], ["--seeds", "-2"], ["--jobs", "-1"]])
def test_seeds_or_jobs_below_one_are_one_line_errors(tmp_path, trains, capsys, arguments):
    """Old code: an IndexError, ValueError or ZeroDivisionError traceback (--seeds 0 after loading nothing; --jobs 0
    from the thread pool)."""
    study = write_study(tmp_path, {"none": {"correction": "none"}})
    assert main(["compare", str(study), *arguments, f"--output_dir={tmp_path / 'study'}"]) == 1
    flag, value = arguments
    assert capsys.readouterr().err.startswith(f"error: {flag} {value}: must be 1 or more (")
    assert trains == [] and not (tmp_path / "study").exists()


def test_an_unfinished_run_whose_config_changed_is_rerun_not_resumed(tmp_path):
    """A run with a checkpoint and no result, whose recipe changed since it started: a resume would be refused (the
    checkpoint's config differs), so it is rerun afresh; with an unchanged config (or only max_steps) it resumes."""
    study = write_study(tmp_path, {"none": {"correction": "none"}})
    run = study_runs(study, tmp_path / "study", 1)[0]
    config = compare_plan.resolved_config(run)
    (run.output_dir / "checkpoint-1").mkdir(parents=True)
    (run.output_dir / "checkpoint-1" / ".dllm-ais.json").write_text(json.dumps({"written_by": "dllm-ais"}))
    identity = result_identity(config, None)
    arm = {**TINY, "correction": "none"}
    for saved, action in ((config, "resume"), (load_config(EMBEDDED_RECIPE, {**arm, "max_steps": 1}), "resume"),
                          (load_config(EMBEDDED_RECIPE, {**arm, "learning_rate": 1e-3}), "rerun")):
        save_config(saved, run.output_dir / "config.yaml")
        plan = compare_reuse.examine(run, config, identity)
        assert plan.line.startswith(f"seed 0 arm none: {action} — ")
    assert "(learning_rate: 0.001 -> 0.0005): a resume would be refused" in plan.line
    assert compare_plan.train_command(run, plan.restart)[-1] == "--overwrite_output_dir=true"


@pytest.mark.slow
def test_real_training_reruns_an_edited_recipe_and_a_truncated_result(tmp_path, capsys):
    """The same attacks with `dllm-ais train` itself: the result it writes is reused as is, an edited learning rate
    in the base recipe reruns the run (config.yaml shows it), a truncated held_out.json is kept aside and rerun."""
    recipe = tmp_path / "base.yaml"
    shutil.copy(EMBEDDED_RECIPE, recipe)
    study = write_study(tmp_path, {"none": {"correction": "none"}}, base=recipe)
    folder = tmp_path / "study"
    arguments = ["compare", str(study), "--seeds", "1", f"--output_dir={folder}"]
    run = study_runs(study, folder, 1)[0]
    assert main(arguments) == 0 and "1 runs (0 reused)" in capsys.readouterr().out
    assert main(arguments) == 0 and "1 runs (1 reused)" in capsys.readouterr().out

    recipe.write_text(recipe.read_text().replace("learning_rate: 5.0e-4", "learning_rate: 1.0e-3"))
    assert main(arguments) == 0
    assert "rerun — config changed since it ran (learning_rate: 0.0005 -> 0.001)" in capsys.readouterr().out
    assert load_config(run.output_dir / "config.yaml").learning_rate == 1e-3

    text = run.result.read_text()
    run.result.write_text(text[:len(text) // 2])
    assert main(arguments) == 0
    out = capsys.readouterr().out
    assert f"kept as {run.output_dir.with_name('seed0.held_out.damaged.json')}" in out and "1 runs (0 reused)" in out
    assert main(arguments) == 0 and "1 runs (1 reused)" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------ issue 62: the run beside it
def test_an_arm_folder_holding_only_a_planted_result_is_set_aside_and_trained(tmp_path, trains, capsys):
    """The attack: a `held_out.json` whose identity is the planned one (computed as compare computes it), planted
    in an arm folder that holds nothing else. Old code: "reused", then `[Errno 2] … metrics.jsonl`. Now: the
    folder is set aside (kept), the run trained, one line saying why."""
    study = write_study(tmp_path, {"none": {"correction": "none"}})
    folder = tmp_path / "study"
    run = study_runs(study, folder, 1)[0]
    config = compare_plan.resolved_config(run)
    held_out = load_task_dataset(config.task, split="validation", size=config.eval_size, seed=config.seed)
    ones = torch.ones(len(held_out))
    run.output_dir.mkdir(parents=True)
    run.result.write_text(json.dumps(held_out_record(result_identity(config, held_out), None,
                                                     EvalResult(ones, ones.clone(), {"reward": ones}))))
    planted = run.result.read_text()
    assert main(["compare", str(study), "--seeds", "1", f"--output_dir={folder}"]) == 0
    out = capsys.readouterr().out
    aside = run.output_dir.with_name("seed0.set-aside")
    assert compare_lines(out)["seed 0 arm none"] == (
        "run — its result does not agree with the run beside it (its config.yaml is missing or not a regular file); "
        f"the run directory is kept as {aside}")
    assert (aside / HELD_OUT_FILE).read_text() == planted and trains == [run.output_dir]
    assert "| none | 0.5000 |" in out and "1 runs (0 reused)" in out


def copy_arm(source: compare_plan.Run, destination: compare_plan.Run, planned: dict) -> None:
    """The attack: `cp -r` one arm's finished run over another's, its result's identity edited to the other's."""
    shutil.rmtree(destination.output_dir)
    shutil.copytree(source.output_dir, destination.output_dir)
    record = json.loads(destination.result.read_text())
    record["identity"] = planned
    record["after"] = record["before"] = {"accuracy": [1.0] * 4, "reward": [1.0] * 4}
    destination.result.write_text(json.dumps(record))


def edit_config(run: compare_plan.Run) -> None:
    """Make the copy's config.yaml say what `run`'s arm plans."""
    save_config(compare_plan.resolved_config(run), run.output_dir / "config.yaml")


def edit_config_and_metrics(run: compare_plan.Run) -> None:
    """`edit_config`, and the copy's metrics.jsonl made to log the edited values."""
    edit_config(run)
    metrics = run.output_dir / "metrics.jsonl"
    metrics.write_text(metrics.read_text().replace("0.5", "1.0"))


def edit_all_but_final(run: compare_plan.Run, step: int) -> None:
    """`edit_config_and_metrics`, and the step its final/ records set to `step`."""
    edit_config_and_metrics(run)
    marker = json.loads((run.output_dir / "final" / ".dllm-ais.json").read_text())
    (run.output_dir / "final" / ".dllm-ais.json").write_text(json.dumps({**marker, "step": step}))


@pytest.mark.parametrize(("edit", "named"), [
    (lambda run: None, "its config.yaml is not the planned config (correction.method: 'none' -> 'ais'"),
    (edit_config, "its metrics.jsonl logs eval/reward 0.5, its result gives 1"),
    (edit_config_and_metrics,
     "its final/dllm_ais_config.yaml is not the planned config (correction.method: 'none' -> 'ais'"),
    (lambda run: edit_all_but_final(run, step=1), "its final/ is of step 1, not 2"),
])
def test_a_run_copied_from_another_arm_with_its_identity_edited_is_set_aside_and_rerun(tmp_path, trains, capsys,
                                                                                        edit, named):
    """The attack: arm ais's run replaced by a copy of arm none's, its result's identity edited to ais's and its
    values to 1.0 — then also its config.yaml, its metrics, its final model's step. Old code: tabled as ais (1.0000, Δ +0.5000) while its
    config.yaml says `method: none`. Now the first part that disagrees is named, the copy kept aside, the run
    trained again, and the table holds what it trained."""
    study = write_study(tmp_path, {"none": {"correction": "none"}, "ais": {"correction": "ais"}})
    folder = tmp_path / "study"
    assert main(["compare", str(study), "--seeds", "1", f"--output_dir={folder}"]) == 0
    capsys.readouterr()
    none, ais = study_runs(study, folder, 1)
    copy_arm(none, ais, json.loads(ais.result.read_text())["identity"])
    edit(ais)
    assert main(["compare", str(study), "--seeds", "1", f"--output_dir={folder}"]) == 0
    out = capsys.readouterr().out
    line = compare_lines(out)["seed 0 arm ais"]
    assert line.startswith(f"run — its result does not agree with the run beside it ({named}") and \
        line.endswith(f"the run directory is kept as {ais.output_dir.with_name('seed0.set-aside')}"), line
    assert compare_lines(out)["seed 0 arm none"].startswith("reused — ")
    assert "| ais | 0.5000 | 0.5000 | +0.0000" in out and trains[-1] == ais.output_dir


def test_arm_names_with_a_newline_or_a_bar_keep_the_table_whole(tmp_path, trains, capsys):
    """Arms named `a|b` and `c<newline>d`: one row each, the bar escaped, the name on one line; one line per run."""
    study = write_study(tmp_path, {"a|b": {"correction": "none"}, "c\nd": {"correction": "none"}})
    assert main(["compare", str(study), "--seeds", "1", f"--output_dir={tmp_path / 'study'}"]) == 0
    out = capsys.readouterr().out
    assert {"seed 0 arm a|b", "seed 0 arm c d"} <= set(compare_lines(out))
    table = (tmp_path / "study" / "comparison.md").read_text().splitlines()
    rows = [line for line in table if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows[2:]] == ["| a\\|b", "| c d"]
    assert all(row.replace("\\|", "").count("|") == 7 for row in rows)
