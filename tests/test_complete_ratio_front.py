"""The complete ratio's front (`python -m dllm_ais.experimental.complete_ratio_front`) on synthetic finished studies:
notches, the logged mismatch, the paired Δ and the rescue's verdict."""

import json
from pathlib import Path

import pytest
from test_precision_frontier import held_out_runs

from dllm_ais.compare_plan import Study, plan_runs, read_study, resolved_config
from dllm_ais.compare_report import summarise
from dllm_ais.experimental.complete_ratio_front import main, notch_mismatch, study_front

ONES, FOUR_LOST = [1.0] * 20, [0.0] * 4 + [1.0] * 16


def write_metrics(run_dir: Path, records: list[dict]) -> None:
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))


def synthetic_study(tmp_path: Path, ais_recovers: bool) -> Path:
    """A study folder: bf16 baseline, a bf16 arm with another decoder (not a notch), MXFP4 uncorrected losing 4 of
    20 prompts a seed, MXFP4 + AIS on the complete ratio winning them back (or not), and an MXFP8 notch that never
    ran the complete ratio (no measured mismatch)."""
    accuracy = {"bf16 (reference)": [ONES] * 3, "bf16 deterministic decoder": [FOUR_LOST] * 3,
                "mxfp4 uncorrected": [FOUR_LOST, [0.0] * 5 + [1.0] * 15, FOUR_LOST],
                "mxfp4 + AIS (complete ratio)": [ONES] * 3 if ais_recovers else [FOUR_LOST] * 3,
                "mxfp8 uncorrected": [ONES] * 3}
    runs = held_out_runs(tmp_path, accuracy)
    for run in runs:
        logged = run.arm == "mxfp4 + AIS (complete ratio)"
        write_metrics(run.output_dir, [{"step": step, "rollout_corr/k3_kl": 0.1 * step,
                                        **({"rollout_corr/commit_k3_kl": 0.08 * step} if logged else {})}
                                       for step in (1, 2)] + [{"step": 3, "eval/reward": 0.5}])
    summary = summarise(Study("synthetic", None, {}, {name: {} for name in accuracy}, "bf16 (reference)"), runs)
    (tmp_path / "comparison.json").write_text(json.dumps(summary))
    return tmp_path


def test_the_mismatch_is_the_logged_complete_ratio_k3_and_a_run_without_it_has_none(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    write_metrics(run, [{"step": 1, "rollout_corr/k3_kl": 0.2, "rollout_corr/commit_k3_kl": 0.1},
                        {"step": 2, "rollout_corr/k3_kl": 0.4, "rollout_corr/commit_k3_kl": 0.3}])
    with (run / "metrics.jsonl").open("a") as log:
        log.write('{"step": 3, "rollout_corr/k3_kl": NaN, "rollout_corr/commit_k3_kl": 9}\n{"step": 4, "rollout_co')
    assert notch_mismatch([str(run)]) == pytest.approx({"k3": 0.3, "commit_k3": 0.2, "num_records": 2})
    write_metrics(run, [{"step": 1, "rollout_corr/k3_kl": 0.2}])
    assert notch_mismatch([str(run)]) is None


@pytest.mark.parametrize("ais_recovers", [True, False])
def test_the_front_pairs_each_notch_with_bf16_and_says_whether_ais_rescues_it(tmp_path, ais_recovers):
    front = study_front(synthetic_study(tmp_path, ais_recovers))
    assert [row["precision"] for row in front["rows"]] == ["mxfp4"]  # mxfp8 logged no complete ratio; bf16 is no notch
    row = front["rows"][0]
    assert row["mismatch"] == pytest.approx({"k3": 0.15, "commit_k3": 0.12, "num_records": 6})
    assert row["corrections"]["uncorrected"]["mean"] == pytest.approx(-13 / 60)
    assert row["corrections"]["+ AIS (complete ratio)"]["mean"] == pytest.approx(0.0 if ais_recovers else -0.2)
    verdict = row["verdict"]
    assert verdict["ais_within_2_points"] is ais_recovers and verdict["ais_above_uncorrected"] is ais_recovers
    assert verdict["ais_minus_uncorrected"]["mean"] == pytest.approx(13 / 60 if ais_recovers else 1 / 60)
    assert verdict["uncorrected_loses"]


def test_the_report_is_written_beside_the_first_study_and_never_through_a_link(tmp_path, capsys):
    study = synthetic_study(tmp_path / "study", ais_recovers=False)
    main([str(study)])
    table = (study / "complete-ratio-front.md").read_text()
    assert "| synthetic | mxfp4 | 0.150 (80%) | -21.7 ± 1.7 | -20.0 ± 0.0 |" in table
    assert ("not rescued: not within 2 points of bf16, not above uncorrected by 2 SE (AIS − uncorrected +1.7 ± 1.7)"
            in table)
    assert (study / "complete-ratio-front.png").stat().st_size > 0
    target = tmp_path / "elsewhere.md"
    target.write_text("a user's notes\n")
    (study / "linked.md").symlink_to(target)
    no_loss = tmp_path / "no-loss"
    summary = json.loads((study / "comparison.json").read_text())
    summary["arms"]["mxfp4 uncorrected"]["runs"] = summary["arms"]["bf16 (reference)"]["runs"]
    no_loss.mkdir()
    (no_loss / "comparison.json").write_text(json.dumps(summary))
    main([str(no_loss)])
    assert "no loss to rescue (uncorrected within 2 SE of bf16)" in (no_loss / "complete-ratio-front.md").read_text()
    with pytest.raises(SystemExit, match="symbolic link"):
        main([str(study), "--report", "linked"])
    assert target.read_text() == "a user's notes\n"


def test_a_named_report_of_the_same_study_is_one_more_line_beside_the_first(tmp_path, capsys):
    study = synthetic_study(tmp_path / "study", ais_recovers=False)
    summary = json.loads((study / "comparison.json").read_text())
    summary["arms"] = {name.replace("mxfp4", "nvfp4"): arm for name, arm in summary["arms"].items()}
    (study / "comparison-nvfp4.json").write_text(json.dumps(summary))
    main([str(study), str(study / "comparison-nvfp4.json")])
    table = (study / "complete-ratio-front.md").read_text()
    assert "| synthetic | mxfp4 | 0.150 (80%) |" in table
    assert "| synthetic (comparison-nvfp4) | nvfp4 | 0.150 (80%) |" in table


def test_every_arm_of_the_complete_ratio_studies_resolves_and_only_a_drawn_choice_carries_the_complete_ratio(tmp_path):
    studies = sorted((Path(__file__).resolve().parent.parent / "recipes" / "studies").glob("complete_ratio_*.yaml"))
    assert [path.stem for path in studies] == ["complete_ratio_llada_chain_sum_decoders",
                                               "complete_ratio_llada_chain_sum_log_odds",
                                               "complete_ratio_llada_chain_sum_t001", "complete_ratio_llada_digits"]
    for path in studies:
        study = read_study(path)
        for run in plan_runs(study, 1, [], tmp_path / path.stem):
            config = resolved_config(run)
            assert config is not None, f"{path.name}: arm {run.arm!r} does not resolve"
            temperature = config.experimental.rollout_position_temperature
            assert not config.experimental.complete_ratio or temperature > 0
            assert run.arm != study.baseline or config.rollout.precision == "bf16"
