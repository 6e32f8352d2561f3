"""`dllm-ais compare`: study files, the paired statistics against the baseline, and a tiny study end to end (two arms
x two seeds of a 2-step run), rerun without retraining."""

import json
import math
from pathlib import Path

import pytest

from dllm_ais import compare
from dllm_ais.cli import main
from dllm_ais.compare_plan import StudyError, Run, as_argument, read_study, train_command
from dllm_ais.compare_report import versus_baseline
from dllm_ais.statistics import across_seeds, paired_difference, standard_error, t_quantile_975

STUDIES = Path(__file__).resolve().parent.parent / "recipes" / "studies"
TINY = {"max_steps": 2, "eval_size": 4, "dataset_size": 8, "per_device_train_batch_size": 4, "num_generations": 2,
        "num_iterations": 1, "eval_rollout_sampler": False}


def test_paired_statistics_on_a_known_input():
    """Seed 0: d = (1, 0, 0, 0), Δ 0.25 ± 0.25; seed 1: d = (0, 0, 1, 1), Δ 0.5 ± 1/√12; over the two seeds: mean
    0.375, seed SE 0.125, 95 % CI 0.375 ± 12.706 x 0.125 (t with one degree of freedom)."""
    versus = versus_baseline([[0, 1, 1, 0], [1, 1, 0, 0]], [[1, 1, 1, 0], [1, 1, 1, 1]])
    assert [(d["mean"], d["num_prompts"]) for d in versus["per_seed"]] == [(0.25, 4), (0.5, 4)]
    assert [d["standard_error"] for d in versus["per_seed"]] == pytest.approx([0.25, 1 / math.sqrt(12)])
    seeds = versus["across_seeds"]
    assert (seeds["mean"], seeds["standard_error"], seeds["num_seeds"]) == pytest.approx((0.375, 0.125, 2))
    assert (seeds["low"], seeds["high"]) == pytest.approx((0.375 - 12.706 * 0.125, 0.375 + 12.706 * 0.125))


def test_statistics_edge_cases():
    assert math.isnan(standard_error([1.0])) and math.isnan(across_seeds([0.2]).low)
    assert across_seeds([0.2]).mean == 0.2
    assert t_quantile_975(3) == 3.182 and t_quantile_975(35) == 2.042 and t_quantile_975(1000) == 1.96
    with pytest.raises(ValueError, match="same prompts"):
        paired_difference([1.0, 0.0], [1.0])


def test_shipped_studies_keep_the_scripts_arms():
    """The studies that replaced scripts/compare_corrections.py and compare_rollouts.py: five correction arms per
    model and task; the rollout grid's 5 + 21 + 28 arms, each paired with its estimator's exact rollouts."""
    corrections = {path.stem: read_study(path) for path in STUDIES.glob("corrections_*.yaml")}
    assert sorted(corrections) == ["corrections_llada_chain_sum", "corrections_llada_digits",
                                   "corrections_qwen3_chain_sum", "corrections_qwen3_digits"]
    for study in corrections.values():
        assert list(study.arms) == ["bf16 (reference)", "int4 uncorrected", "int4 + TIS", "int4 + MIS", "int4 + AIS"]
        assert study.baseline == "bf16 (reference)" and study.overrides["correction.bypass_mode"] is False
        assert study.base is None or study.base.is_file()
    rollouts = {path.stem: read_study(path) for path in STUDIES.glob("rollouts_*.yaml")}
    assert {name: len(study.arms) for name, study in rollouts.items()} == {
        "rollouts_estimators": 5, "rollouts_one_step": 21, "rollouts_trajectory": 28}
    assert rollouts["rollouts_trajectory"].arms["trajectory@decoder dual+t0.9 AIS"] == {
        "likelihood.estimator": "trajectory", "experimental.likelihood_order": "rollout",
        "experimental.likelihood_decoder": "rollout", "rollout.cache": "dual", "rollout.threshold": 0.9,
        "correction": "ais"}
    assert rollouts["rollouts_one_step"].arms["one_step exact AIS"]["rollout.threshold"] is None


def test_a_bad_study_is_one_line(tmp_path):
    study = tmp_path / "study.yaml"
    study.write_text("arms: {a: {correction: none}}\nbaseline: b\n")
    with pytest.raises(StudyError, match="baseline 'b' is not an arm; arms: a"):
        read_study(study)
    study.write_text("arms: {a: {}}\nseeds: 3\n")
    with pytest.raises(StudyError, match=r"unknown keys \['seeds'\]"):
        read_study(study)
    study.write_text("arms: {a: {}, 'b (x, y)': {}}\n")
    with pytest.raises(StudyError, match=r"arm names \['b \(x, y\)'\] hold a comma, which --arms splits on"):
        read_study(study)


def test_an_unfinished_run_is_rerun_over_its_own_outputs(tmp_path):
    run = Run("a", 0, ("--correction=none", "--seed=0"), tmp_path / "a" / "seed0")
    assert train_command(run)[-1] == f"--output_dir={run.output_dir}"  # fresh
    run.output_dir.mkdir(parents=True)
    (run.output_dir / "metrics.jsonl").write_text("")
    assert train_command(run)[-1] == "--overwrite_output_dir=true"  # train refuses anything it did not write


def write_study(path: Path, arms: dict) -> Path:
    path.write_text(json.dumps({"overrides": TINY, "baseline": "none", "arms": arms}))  # JSON is YAML
    return path


@pytest.mark.slow
def test_compare_runs_arms_by_seeds_then_reuses_them(tmp_path, monkeypatch, capsys):
    study = write_study(tmp_path / "tiny.yaml", {"none": {"correction": "none"}, "ais": {"correction": "ais"}})
    folder = tmp_path / "study"
    assert main(["compare", str(study), "--seeds", "2", "--jobs", "2", f"--output_dir={folder}"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in out.splitlines()
            if line.startswith("| none") or line.startswith("| ais")}
    assert set(rows) == {"none", "ais"} and rows["none"][2].strip() == "— (baseline)"
    assert "4 runs (0 reused)" in out and "4 held-out prompts per run" in out
    numbers = json.loads((folder / "comparison.json").read_text())
    ais = numbers["arms"]["ais"]
    assert numbers["metric"] == "accuracy" and len(ais["runs"]) == 2 and numbers["seeds"] == 2
    per_seed = []
    for run_dir, seed in zip(ais["runs"], range(2)):
        baseline_dir = numbers["arms"]["none"]["runs"][seed]
        values = [json.loads((Path(d) / "held_out.json").read_text())["after"]["accuracy"]
                  for d in (baseline_dir, run_dir)]
        per_seed.append(paired_difference(*values).mean)
    assert [d["mean"] for d in ais["versus_baseline"]["per_seed"]] == pytest.approx(per_seed)
    assert ais["versus_baseline"]["across_seeds"]["mean"] == pytest.approx(sum(per_seed) / 2)
    assert (folder / "comparison.md").read_text().startswith("study tiny") and (folder / "comparison.png").is_file()

    finished = {run: (Path(run) / "metrics.jsonl").stat().st_mtime_ns for arm in numbers["arms"].values()
                for run in arm["runs"]}
    monkeypatch.setattr(compare.subprocess, "call", lambda *args, **kwargs: pytest.fail("a finished run was retrained"))
    assert main(["compare", str(study), "--seeds", "2", f"--output_dir={folder}"]) == 0
    assert "4 runs (4 reused)" in capsys.readouterr().out
    assert {run: (Path(run) / "metrics.jsonl").stat().st_mtime_ns for run in finished} == finished

    table = (folder / "comparison.md").read_text()
    assert main(["compare", str(study), "--seeds", "2", "--baseline", "ais", f"--output_dir={folder}"]) == 0
    assert "comparison-vs-ais.md" in capsys.readouterr().out and (folder / "comparison-vs-ais.png").is_file()
    versus_ais = json.loads((folder / "comparison-vs-ais.json").read_text())
    assert versus_ais["baseline"] == "ais" and versus_ais["arms"]["ais"]["versus_baseline"] is None
    assert [d["mean"] for d in versus_ais["arms"]["none"]["versus_baseline"]["per_seed"]] == pytest.approx(
        [-d for d in per_seed])
    assert (folder / "comparison.md").read_text() == table
    assert main(["compare", str(study), "--baseline", "bf16", f"--output_dir={folder}"]) == 1
    assert capsys.readouterr().err == "error: --baseline: unknown 'bf16'; the study's arms: none, ais\n"

    assert main(["compare", str(study), "--seeds", "2", "--arms", "ais", "--report", "comparison-ais-only",
                 f"--output_dir={folder}"]) == 0
    assert "comparison-ais-only.md" in capsys.readouterr().out
    assert json.loads((folder / "comparison-ais-only.json").read_text())["arms"].keys() == {"none", "ais"}
    assert (folder / "comparison.md").read_text() == table  # the whole study's report is kept
    for name in ("../elsewhere", ".hidden", ""):
        assert main(["compare", str(study), "--report", name, f"--output_dir={folder}"]) == 1
        assert capsys.readouterr().err.startswith(f"error: --report {name!r}: a file name without a folder")
    user_file = tmp_path / "notes.md"
    user_file.write_text("a user's notes\n")
    (folder / "linked.md").symlink_to(user_file)
    assert main(["compare", str(study), "--report", "linked", f"--output_dir={folder}"]) == 1
    assert "is a symbolic link" in capsys.readouterr().err and user_file.read_text() == "a user's notes\n"


@pytest.mark.slow
def test_failed_runs_are_named_with_their_logs(tmp_path, capsys):
    study = write_study(tmp_path / "bad.yaml", {"none": {"corection": "none"}, "typo": {"corection": "ais"},
                                                "left out": {}})
    assert main(["compare", str(study), "--seeds", "1", "--arms", "typo", f"--output_dir={tmp_path / 'study'}"]) == 1
    error = capsys.readouterr().err
    assert "error: none / seed 0 failed (exit 2); see " in error and "; typo / seed 0 failed" in error
    assert "left out" not in error
    log = Path(error.strip().split("see ")[-1])
    assert "corection" in log.read_text()
    assert main(["compare", str(study), "--seeds", "1", "--arms", "typo", f"--output_dir={tmp_path / 'study'}"]) == 1
    attempts = log.read_text().split("=== ")[1:]  # the second attempt appended its output: the first's is kept
    assert len(attempts) == 2 and all(" dllm-ais compare runs: " in a and "corection" in a for a in attempts)


def test_a_mapping_override_reaches_train_as_one_argument_that_parses_back():
    """A settings group given as a mapping in an arm (`correction: {method: tis, level: sequence}`) becomes one argv
    element without spaces: with a space, the train command's argument parser takes it for the recipe's path."""
    from dllm_ais.cli import build_parser
    from dllm_ais.config import parse_overrides

    argument = as_argument("correction", {"method": "tis", "level": "sequence"})
    assert " " not in argument
    args, overrides = build_parser().parse_known_args(["train", argument])
    assert args.recipe is None and parse_overrides(overrides) == {"correction": {"method": "tis", "level": "sequence"}}
