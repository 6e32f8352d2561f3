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
