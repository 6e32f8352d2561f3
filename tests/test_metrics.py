"""The metrics stage's pure functions: TRL's group and completion statistics, verl's warning levels, run logs."""

import json

import pytest
import torch

from dllm_ais.loss import zero_std_groups
from dllm_ais.metrics import (MetricsLog, completion_metrics, console_line, distinct_completions, ends_with_eos,
                              mismatch_warnings, plotted_points, reward_metrics)


def test_reward_metrics_are_trls_group_statistics():
    rewards = torch.tensor([1.0, 1.0, 0.0, 2.0, 0.5, 0.5])  # groups of 2: equal, 0/2, equal
    metrics = reward_metrics(rewards, num_generations=2)
    assert metrics["reward"] == pytest.approx(5 / 6)
    assert metrics["reward_std"] == pytest.approx(torch.tensor([0.0, 2.0]).std().item() / 3)
    assert metrics["frac_reward_zero_std"] == pytest.approx(2 / 3)
    assert zero_std_groups(rewards, 2).tolist() == [True, False, True]
    assert zero_std_groups(torch.tensor([0.1, 0.1 + 1e-12], dtype=torch.float64), 2).tolist() == [False], "equal means equal"


def test_completion_metrics_count_lengths_and_completions_cut_by_the_length_limit():
    eos = (2, 9)
    completion_ids = torch.tensor([[5, 2, 2, 2], [5, 5, 5, 5], [5, 5, 9, 2]])
    lengths = torch.tensor([2, 4, 3])  # through the first end token
    terminated = ends_with_eos(completion_ids, eos)
    assert terminated.tolist() == [True, False, True]
    assert completion_metrics(lengths, terminated) == {
        "completions/mean_length": 3.0, "completions/min_length": 2.0, "completions/max_length": 4.0,
        "completions/clipped_ratio": pytest.approx(1 / 3)}


@pytest.mark.parametrize("key, value, crossed", [
    ("rollout_corr/rollout_is_mean", 0.4, True), ("rollout_corr/rollout_is_mean", 2.1, True),
    ("rollout_corr/rollout_is_mean", 1.0, False), ("rollout_corr/rollout_is_eff_sample_size", 0.29, True),
    ("rollout_corr/rollout_is_eff_sample_size", 0.9, False), ("rollout_corr/kl", -0.11, True),
    ("rollout_corr/kl", 0.05, False), ("rollout_corr/chi2_token", 1.5, True), ("rollout_corr/chi2_token", float("nan"), False),
    ("rollout_corr/rollout_is_std", 1.2, True),
])
def test_mismatch_warnings_use_verls_documented_levels(key, value, crossed):
    assert (key in mismatch_warnings({key: value, "reward": 0.0})) == crossed


def test_console_line_shows_the_renamed_metrics():
    line = console_line(3, 20, {"reward": 0.5, "ais/alpha": 0.25, "rollout_corr/rollout_is_eff_sample_size": 0.9,
                                "rollout_corr/k3_kl": 2e-4, "entropy": 1.5, "loss": -0.01})
    assert line == "step 3/20 | reward 0.500 | α 0.250 | ESS 0.900 | k3 2.00e-04 | H 1.500 | loss -0.0100"


def test_a_resumed_log_keeps_mid_run_validation_lines_but_not_the_closing_one(tmp_path):
    lines = [{"step": 1, "loss": 0.1}, {"step": 2, "loss": 0.2, "eval/reward": 0.3}, {"step": 3, "loss": 0.3},
             {"step": 3, "eval/reward": 0.4, "eval/reward_before": 0.2}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    MetricsLog(tmp_path, resume_step=3).close()
    assert [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == lines[:3]
    samples = [{"step": 1, "prompt": "a"}, {"step": 2, "prompt": "b"}, {"step": 2, "prompt": "c"}]
    (tmp_path / "completions.jsonl").write_text("".join(json.dumps(line) + "\n" for line in samples))
    log = MetricsLog(tmp_path, resume_step=1, name="completions.jsonl")
    log.write({"step": 2, "prompt": "d"})
    log.close()
    assert [json.loads(x)["prompt"] for x in (tmp_path / "completions.jsonl").read_text().splitlines()] == ["a", "d"]


def test_distinct_completions_counts_each_groups_different_completions_within_their_masks():
    ids = torch.tensor([[1, 2, 9], [1, 2, 8], [3, 4, 5], [3, 4, 5]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 1, 1]], dtype=torch.bool)
    assert distinct_completions(ids, mask, num_generations=2).tolist() == [0.5, 0.5]
    assert distinct_completions(ids, torch.ones_like(mask), num_generations=2).tolist() == [1.0, 0.5]


def test_held_out_curves_start_from_the_baseline():
    records = [{"step": 1, "reward": 0.5}, {"step": 60, "eval/accuracy": 0.26},
               {"step": 120, "eval/accuracy": 0.28, "eval/accuracy_before": 0.25}]
    assert plotted_points(records, "eval/accuracy") == [(0, 0.25), (60, 0.26), (120, 0.28)]
    assert plotted_points(records, "reward") == [(1, 0.5)]


def test_hostile_metrics_lines_on_resume_are_damaged_lines_kept_aside_and_the_plot_still_draws(tmp_path, capsys):
    """A 200k-deep nested line (a RecursionError before), values of the wrong types (kept before, then the plot
    crashed after training), an oversized line: each reported as damaged and left out; the valid lines stay."""
    from dllm_ais.metrics import MAX_RECORD_BYTES, MetricsLog, plot_metrics

    valid = [json.dumps({"step": step, "loss": 0.1, "reward": 0.5}) + "\n" for step in (1, 2, 3)]
    hostile = ["[" * 200_000 + "]" * 200_000 + "\n",
               json.dumps({"step": 2, "loss": 0.1, "reward": "high"}) + "\n",
               json.dumps({"step": 2, "reward": [0.5], "loss": {"a": 1}}) + "\n",
               json.dumps({"step": "2", "loss": 0.1}) + "\n",
               json.dumps({"step": 2, "loss": 0.1, "pad": 0.0, "x" * MAX_RECORD_BYTES: 1}) + "\n"]
    (tmp_path / "metrics.jsonl").write_text(valid[0] + "".join(hostile) + "".join(valid[1:]))
    log = MetricsLog(tmp_path, resume_step=3)
    log.close()
    assert [r["step"] for r in log.records] == [1, 2, 3]
    warning = capsys.readouterr().err
    assert "line(s) 2, 3, 4, 5, 6 damaged" in warning and "kept its 3 valid line(s)" in warning
    assert len(list(tmp_path.glob("metrics.jsonl.damaged-*"))) == 1
    assert plot_metrics(log.records, tmp_path / "metrics.png") is not None


def test_completions_lines_may_hold_text_metrics_lines_may_not(tmp_path):
    from dllm_ais.metrics import MetricsLog

    line = json.dumps({"step": 1, "prompt": "2+2", "completion": "4", "reward": 1.0}) + "\n"
    for name, kept in (("completions.jsonl", 1), ("metrics.jsonl", 0)):
        (tmp_path / name).write_text(line)
        log = MetricsLog(tmp_path, resume_step=1, name=name)
        log.close()
        assert len(log.records) == kept


def test_a_metrics_path_that_is_a_directory_is_one_line(tmp_path, capsys):
    from dllm_ais.cli import main

    run = tmp_path / "run"
    (run / "metrics.jsonl").mkdir(parents=True)  # in a directory an earlier run wrote
    (run / ".dllm-ais.json").write_text(json.dumps({"written_by": "dllm-ais", "run_directory": True}))
    assert main(["train", f"--output_dir={run}", "--max_steps=1", "--overwrite_output_dir=true"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "holds metrics.jsonl that is not a regular file" in error, error
    (run / "metrics.jsonl").rmdir()
    (run / "metrics.jsonl").symlink_to(tmp_path / "elsewhere.jsonl")
    with pytest.raises(FileExistsError, match="metrics.jsonl is a symbolic link"):  # the log refuses it too
        MetricsLog(run)
