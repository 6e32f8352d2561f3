"""The precision frontier (`python -m dllm_ais.experimental.precision_frontier`): the shipped study covers every notch,
the verdict on synthetic held-out results, and the mismatch measured on the embedded recipe."""

import json
from pathlib import Path

import pytest

from dllm_ais.choices import PRECISIONS
from dllm_ais.compare_plan import Run, Study, read_study
from dllm_ais.compare_report import summarise
from dllm_ais.experimental import precision_frontier as frontier_module
from dllm_ais.experimental.precision_frontier import DEFAULT_STUDY, arm_grid, frontier, markdown, plot

CORRECTIONS = ["uncorrected", "+ TIS", "+ sequence IS", "+ AIS"]


def test_the_shipped_study_trains_every_notch_with_every_correction():
    study = read_study(DEFAULT_STUDY)
    grid = arm_grid(study.arms, study.baseline)
    assert study.arms[study.baseline] == {"rollout.precision": "bf16", "correction": "none"}
    assert grid.pop("bf16") == {"another draw": "bf16 another draw"}
    assert study.arms["bf16 another draw"] == {**study.arms[study.baseline], "experimental.rollout_seed_offset": 1}
    assert sorted(grid) == sorted(p for p in PRECISIONS if p != "bf16")
    assert all(list(names) == CORRECTIONS for names in grid.values())
    assert study.arms["nvfp4 + sequence IS"] == {"rollout.precision": "nvfp4",
                                                 "correction": {"method": "tis", "level": "sequence"}}


def test_an_arm_not_named_by_its_precision_is_refused():
    with pytest.raises(ValueError, match="<rollout.precision> <correction>"):
        arm_grid({"bf16": {"rollout.precision": "bf16"}, "cheap": {"rollout.precision": "int4"}}, "bf16")


def held_out_runs(tmp_path: Path, accuracy: dict[str, list[list[float]]]) -> list[Run]:
    """Finished runs of arms × seeds whose held-out accuracy per prompt is `accuracy[arm][seed]`."""
    runs = []
    for arm, per_seed in accuracy.items():
        for seed, values in enumerate(per_seed):
            output_dir = tmp_path / arm.replace(" ", "_").replace("+", "p") / f"seed{seed}"
            output_dir.mkdir(parents=True)
            (output_dir / "held_out.json").write_text(json.dumps(
                {"before": None, "after": {"accuracy": values, "reward": values}}))
            runs.append(Run(arm, seed, (), output_dir))
    return runs


def synthetic_study(tmp_path: Path, ais_recovers: bool) -> tuple[dict, dict]:
    """Notch "a" (small mismatch) loses nothing; notch "b" loses 4 of 20 prompts per seed uncorrected, and AIS wins
    them back (or not). Returns (summary, grid)."""
    ones, four_lost = [1.0] * 20, [0.0] * 4 + [1.0] * 16
    accuracy = {"bf16": [ones] * 3, "bf16 another draw": [[0.0] + ones[1:], ones, ones],
                "a uncorrected": [ones] * 3, "a + AIS": [ones] * 3,
                "b uncorrected": [four_lost, [0.0] * 5 + [1.0] * 15, four_lost],
                "b + AIS": [ones] * 3 if ais_recovers else [four_lost] * 3}
    runs = held_out_runs(tmp_path, accuracy)
    arms = {name: {"rollout.precision": name.split()[0] if name.startswith("bf16") else name[0]} for name in accuracy}
    summary = summarise(Study("synthetic", None, {}, arms, "bf16"), runs)
    return json.loads(json.dumps(summary)), arm_grid(arms, "bf16")


MISMATCH = {"a": {"scored_canvas": {"k3": 1e-4, "sequence_ess": 0.99}, "trajectory": None},
            "b": {"scored_canvas": {"k3": 1e-2, "sequence_ess": 0.7}, "trajectory": {"k3": 2e-2, "sequence_ess": 0.8}}}


@pytest.mark.parametrize("ais_recovers", [True, False])
def test_the_verdict_names_the_first_losing_notch_and_whether_ais_rescues_it(tmp_path, ais_recovers):
    summary, grid = synthetic_study(tmp_path, ais_recovers)
    result = frontier(summary, grid, MISMATCH)
    assert [row["precision"] for row in result["rows"]] == ["a", "b"]
    verdict = result["verdict"]
    assert verdict["first_losing_notch"] == "b"
    assert verdict["ais_within_2_points"] is ais_recovers and verdict["ais_above_uncorrected"] is ais_recovers
    assert verdict["ais_minus_uncorrected"]["mean"] == pytest.approx(13 / 60 if ais_recovers else 1 / 60)
    assert result["bf16_draws_vs_pooled"] == pytest.approx([1 / 120, -1 / 120])  # seed 0's prompt 0 parts them
    table = markdown(result, ["uncorrected", "+ AIS"], "header")
    assert "| b | 1.0e-02 · 2.0e-02 | 0.7000 · 0.8000 | -20.8 ± 2.2 |" in table  # vs the two bf16 draws' mean
    assert "Null arm (bf16 rollouts, another draw: the baseline with another sampling draw): Δ -1.7 ± 1.7" in table
    assert ("AIS rescues this notch" if ais_recovers else "AIS does not rescue this notch") in table
    plot(result, ["uncorrected", "+ AIS"], tmp_path / "frontier.png")
    assert (tmp_path / "frontier.png").stat().st_size > 0


def test_without_a_null_arm_the_rows_are_against_the_baseline_arm(tmp_path):
    summary, grid = synthetic_study(tmp_path, ais_recovers=True)
    del grid["bf16"]
    row = frontier(summary, grid, MISMATCH)["rows"][1]
    assert row["corrections"]["uncorrected"] == summary["arms"]["b uncorrected"]["versus_baseline"]["across_seeds"]


def test_no_losing_notch_is_said(tmp_path):
    summary, grid = synthetic_study(tmp_path, ais_recovers=True)
    del grid["b"]
    result = frontier(summary, grid, MISMATCH)
    assert result["verdict"] == {"first_losing_notch": None}
    assert "nothing for a correction to rescue" in markdown(result, ["uncorrected", "+ AIS"], "header")


def test_the_mismatch_is_measured_on_the_studys_recipe():
    study = read_study(DEFAULT_STUDY)
    mismatch = frontier_module.measure_mismatch(study, ["bf16", "int8"], prompts=4, seed=0)
    assert mismatch["bf16"]["scored_canvas"]["k3"] == 0 and mismatch["bf16"]["scored_canvas"]["sequence_ess"] == 1
    assert 0 < mismatch["int8"]["scored_canvas"]["k3"] < 1e-2 and mismatch["int8"]["trajectory"]["k3"] > 0
