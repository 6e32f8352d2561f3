"""Rollout fidelity: the ladder of decoders, the controller, the exact share of groups, and both in a run."""

import dataclasses
import math

import pytest
import torch

from dllm_ais.checkpoint import RunState
from dllm_ais.config import GRPOConfig
from dllm_ais.fidelity import (
    ESS_KEY, K3_KEY, FidelitySettings, FidelityState, exact_group_count, fidelity_ladder, next_fidelity,
)
from dllm_ais.sampling.diffusion import DiffusionSamplerConfig
from conftest import config_of
from test_trainer import make_trainer

FAST_DECODERS = {
    "dual+threshold": DiffusionSamplerConfig(gen_length=64, block_length=16, steps=32, cache="dual", threshold=0.9),
    "prefix refreshed every 2": DiffusionSamplerConfig(gen_length=64, block_length=16, steps=32, cache="prefix",
                                                       cache_refresh_interval=2),
    "factor": DiffusionSamplerConfig(gen_length=64, block_length=16, steps=32, factor=1.0),
    "threshold 0.99 + cache every 4": DiffusionSamplerConfig(gen_length=64, block_length=16, steps=32, cache="dual",
                                                             cache_refresh_interval=4, threshold=0.99),
}


def refresh_interval(config):
    """Steps between cache refreshes inside a block: 1 without a cache, ∞ when refreshed only at block starts."""
    return 1 if config.cache == "none" else config.cache_refresh_interval or math.inf


def commits_per_step_bound(config):
    """A number that falls as parallel commits get stricter: 1 − τ, the factor, or 0 on the fixed schedule."""
    return 1 - config.threshold if config.threshold is not None else config.factor or 0.0


@pytest.mark.parametrize("fast", FAST_DECODERS.values(), ids=FAST_DECODERS)
def test_the_ladder_runs_from_the_configured_decoder_to_the_exact_one_through_valid_ever_more_exact_rungs(fast):
    ladder = fidelity_ladder(fast)
    assert ladder[0] == fast and len(ladder) >= 2
    assert ladder[-1] == dataclasses.replace(fast, cache="none", cache_refresh_interval=None, threshold=None,
                                             factor=None)
    for rung in ladder:
        DiffusionSamplerConfig(**dataclasses.asdict(rung))  # raises on an invalid setting
    for looser, stricter in zip(ladder, ladder[1:]):
        assert refresh_interval(stricter) <= refresh_interval(looser)
        assert commits_per_step_bound(stricter) <= commits_per_step_bound(looser)
        assert (refresh_interval(stricter), commits_per_step_bound(stricter)) != (refresh_interval(looser),
                                                                                  commits_per_step_bound(looser))
    assert fidelity_ladder(ladder[-1]) == [ladder[-1]]  # the exact decoder is a ladder of one rung


def test_the_controller_steps_toward_exact_on_a_large_mismatch_and_relaxes_after_patience_calm_batches():
    settings = FidelitySettings("adaptive", k3_max=0.1, ess_min=0.5, patience=3)
    bad_k3, bad_ess = {K3_KEY: 0.2, ESS_KEY: 0.99}, {K3_KEY: 0.01, ESS_KEY: 0.4}
    calm = {K3_KEY: 0.01, ESS_KEY: 0.99}
    state = FidelityState()
    for diagnostics, expected in [(bad_k3, (1, 0)), (bad_ess, (2, 0)), (bad_k3, (3, 0)),
                                  (bad_k3, (3, 0)),  # never past the exact rung
                                  (calm, (3, 1)), (calm, (3, 2)), (bad_ess, (3, 0)),  # a bad batch resets the count
                                  (calm, (3, 1)), (calm, (3, 2)), (calm, (2, 0)), (calm, (2, 1)), (calm, (2, 2)),
                                  (calm, (1, 0)), (calm, (1, 1)), (calm, (1, 2)), (calm, (0, 0)),
                                  (calm, (0, 0))]:  # never below the configured decoder
        state = next_fidelity(state, diagnostics, settings, top_level=3)
        assert (state.level, state.calm_batches) == expected


@pytest.mark.parametrize("fraction, groups, expected", [
    (0.0, 4, [0, 0, 0]), (1.0, 4, [4, 4, 4]), (0.5, 2, [1, 1, 1]), (0.25, 2, [0, 0, 1]), (0.3, 10, [3, 3, 3]),
])
def test_the_exact_share_rounds_stochastically_to_whole_groups(fraction, groups, expected):
    assert [exact_group_count(fraction, groups, draw) for draw in (0.0, 0.49, 0.5)] == expected
    draws = torch.rand(20_000, generator=torch.Generator().manual_seed(0)).tolist()
    assert sum(exact_group_count(fraction, groups, u) for u in draws) / len(draws) == pytest.approx(fraction * groups,
                                                                                                       abs=0.02)


# the trajectory estimator replaying with the exact model: the ratio that sees the cache (adaptive fidelity's input)
FAST = {"rollout.cache": "dual", "rollout.threshold": 0.9, "likelihood.estimator": "trajectory",
        "experimental.likelihood_decoder": "exact"}


@pytest.mark.parametrize("settings, problem", [
    ({**FAST, "likelihood.estimator": "one_step"}, "experimental.rollout_fidelity=adaptive reacts to the decoder's"),
    ({**FAST, "experimental.likelihood_order": "exact"}, "experimental.rollout_fidelity=adaptive reacts to the decoder's"),
    ({**FAST, "experimental.likelihood_decoder": "rollout"}, "experimental.rollout_fidelity=adaptive reacts to the "),
    ({"likelihood.estimator": "trajectory"}, "experimental.rollout_fidelity=adaptive moves between a fast diffusion"),
])
def test_adaptive_fidelity_needs_fast_rollouts_and_a_ratio_that_sees_the_decoder(settings, problem):
    assert config_of(settings).problems() == []
    (found,) = config_of(settings, **{"experimental.rollout_fidelity": "adaptive"}).problems()
    assert found.startswith(problem) and "rollout_fidelity=fixed" in found


def test_an_exact_share_needs_fast_rollouts_and_the_exact_decoder_needs_a_valid_schedule():
    (found,) = GRPOConfig(experimental={"rollout_exact_fraction": 0.5}).problems()
    assert found.startswith("experimental.rollout_exact_fraction=0.5 mixes exact with fast")
    assert GRPOConfig(experimental={"rollout_exact_fraction": 0.5}, rollout={"threshold": 0.9}).problems() == []
    (found,) = GRPOConfig(rollout={"threshold": 0.9, "steps": 12}).problems()  # 8 blocks
    assert found.startswith("rollout.steps=12 must be a multiple of the number of blocks")
    # held-out validation decodes d1's protocol, max_completion_length / 2 steps, whatever the rollouts' schedule
    (found,) = GRPOConfig(max_completion_length=15, rollout={"block_length": 5, "steps": 15}).problems()
    assert found.startswith("rollout.block_length=5 must be even: held-out validation decodes with d1's protocol")
    assert GRPOConfig(max_completion_length=15, rollout={"block_length": 15, "steps": 15}).problems() == []


ADAPTIVE = {**FAST, "experimental.rollout_fidelity": "adaptive", "experimental.rollout_fidelity_k3_max": 0.0,
            "num_iterations": 1, "max_steps": 3, "save_steps": 1}  # every batch's k3 is above 0


def comparable(history):
    return [{k: v for k, v in record.items() if not k.startswith("timing/")} for record in history]


@pytest.fixture(scope="module")
def adaptive_run(tokenizer, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("adaptive") / "run"
    return make_trainer(tokenizer, output_dir, **ADAPTIVE).train()


def test_adaptive_fidelity_climbs_one_rung_per_mismatched_batch_and_logs_its_decoders(adaptive_run):
    history = adaptive_run.history
    assert [r["rollout/fidelity_level"] for r in history] == [0, 1, 2]
    assert [r["rollout/threshold"] for r in history] == [0.9, 0.95, 0.99]
    assert [r["rollout/cache_refresh_interval"] for r in history] == [0, 4, 2]  # 0: only at each block's start
    assert all(r["rollout_corr/k3_kl"] > 0 for r in history)


def test_the_start_note_says_the_ladder_and_the_rung(tokenizer, tmp_path, capsys):
    make_trainer(tokenizer, tmp_path, **ADAPTIVE)
    (note,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: rollout_fidelity=")]
    assert note.startswith("note: rollout_fidelity=adaptive over cache=dual refresh=block threshold=0.9 -> ")
    assert note.endswith("-> exact, now at rung 0: one rung toward exact after a batch with k3_kl > 0 or ESS < 0.9, "
                         "one back after 8 calm batches.")


def test_a_run_resumed_after_step_1_continues_on_the_same_rungs_with_the_same_metrics(tokenizer, tmp_path,
                                                                                       adaptive_run):
    checkpoint = adaptive_run.output_dir / "checkpoint-1"
    resumed = make_trainer(tokenizer, tmp_path, **ADAPTIVE, resume_from_checkpoint=str(checkpoint))
    assert resumed.fidelity.state == FidelityState(level=1, calm_batches=0)
    assert comparable(resumed.train().history) == comparable(adaptive_run.history)


def test_an_exact_fraction_of_one_half_decodes_half_the_groups_with_the_exact_decoders_steps(tokenizer, tmp_path):
    """Fast decoder: threshold 0 commits a whole block per step (1 step); the exact one takes diffusion_steps=4."""
    trainer = make_trainer(tokenizer, tmp_path, rollout={"threshold": 0.0},
                           experimental={"rollout_exact_fraction": 0.5})
    batch = trainer.make_generation_batch()  # 4 completions in 2 groups of 2: one group each
    assert batch.rollout.num_steps.tolist() == [4, 4, 1, 1]
    assert batch.rollout.commit_step[:2].amax().item() == 3 and batch.rollout.commit_step[2:].amax().item() == 0
    assert batch.metrics["rollout/exact_fraction"] == 0.5
    assert {"rollout/exact_reward", "rollout/fast_reward"} <= set(batch.metrics)
    assert batch.metrics["completions/mean_steps"] == 2.5


def test_a_checkpoint_written_before_the_fidelity_state_resumes_at_rung_0_and_other_missing_fields_still_fail():
    older = {name: 0 for name in RunState.names() if name not in ("rollout_fidelity_state", *RunState.SAVED_APART)}
    older.update(batches=[None], eval_before=None)
    state = RunState.from_state_dict(older, process_index=0, device="cpu")
    assert state.rollout_fidelity_state == {"level": 0, "calm_batches": 0} and state.global_step == 0
    with pytest.raises(KeyError, match="global_step"):
        RunState.from_state_dict({k: v for k, v in older.items() if k != "global_step"}, process_index=0, device="cpu")