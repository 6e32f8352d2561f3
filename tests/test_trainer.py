"""The GRPO loop on tiny models: on-policy recovery, FP8 mismatch, AIS endpoints, determinism, reward errors."""

import dataclasses
import json
import math

import pytest
import torch

from conftest import tiny_dream, tiny_llada, tiny_qwen3
from dllm_ais import grpo
from conftest import config_of
from dllm_ais.config import GRPOConfig
from dllm_ais.correction import CorrectionSettings, correct
from dllm_ais.engine import merged_state_items
from dllm_ais.loss import grpo_loss
from dllm_ais.rewards import RewardFunctionError
from dllm_ais.tasks.digits import digits_reward, make_digits_dataset
from dllm_ais.trainer import GRPOTrainer, NonFiniteError, SkippedBatch

TINY = dict(task="digits", eval_size=0, num_generations=2, per_device_train_batch_size=4, gradient_accumulation_steps=1,
            max_completion_length=8, num_iterations=2, max_steps=2, lora_r=4, lora_alpha=8, lora_dropout=0.0,
            learning_rate=1e-3, max_prompt_length=64, temperature=1.0, dtype="float32",
            rollout={"block_length": 8, "steps": 4})


def digit_fraction_reward(prompts, completions, **kwargs):
    """A dense reward that varies even for random models: the share of digit characters in the completion."""
    texts = [c[0]["content"] for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]


def make_trainer(tokenizer, tmp_path, model_fn=tiny_llada, reward_funcs=None, ais_rule=None, **overrides):
    config = config_of(TINY, output_dir=str(tmp_path), **overrides)
    return GRPOTrainer(config, model=model_fn(tokenizer), tokenizer=tokenizer,
                       reward_funcs=reward_funcs or [digit_fraction_reward, digits_reward],
                       train_dataset=make_digits_dataset(16, seed=1), ais_rule=ais_rule)


def lora_parameters(trainer):
    return {n: p.detach().clone() for n, p in trainer.unwrapped_model.named_parameters() if "lora_" in n}


@pytest.mark.parametrize("model_fn", [tiny_llada, tiny_dream, tiny_qwen3], ids=["llada", "dream", "qwen3"])
def test_bf16_engine_is_on_policy_and_ais_reduces_to_plain_grpo(tokenizer, tmp_path, model_fn):
    trainer = make_trainer(tokenizer, tmp_path, model_fn, rollout={"precision": "bf16"}, correction={"method": "ais"})
    batch = trainer.make_generation_batch()
    for diagnostics in batch.diagnostics:
        assert diagnostics["rollout_corr/rollout_is_min"] == diagnostics["rollout_corr/rollout_is_max"] == 1.0
        assert diagnostics["ais/alpha"] == 0.0
    mask = batch.rollout.completion_mask
    for weights in batch.weights:
        assert torch.equal(weights, mask.float())
    logp = trainer.policy.logprobs(trainer.model, batch.rollout, batch.seeds[0]).requires_grad_()
    args = (logp, batch.logp_old[0], batch.advantages, mask)
    corrected, _ = grpo_loss(*args, weights=batch.weights[0], logp_ref=batch.logp_ref[0], beta=0.04)
    plain, _ = grpo_loss(*args, logp_ref=batch.logp_ref[0], beta=0.04)
    (g1,) = torch.autograd.grad(corrected, logp)
    (g2,) = torch.autograd.grad(plain, logp)
    assert torch.equal(corrected, plain) and torch.equal(g1, g2)


def test_fp8_engine_shows_a_mismatch_and_bounded_ais_weights(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path, rollout={"precision": "fp8"}, correction={"method": "ais", "clip": 2.0})
    batch = trainer.make_generation_batch()
    for diagnostics in batch.diagnostics:
        assert diagnostics["rollout_corr/k3_kl"] > 0
        assert 0.0 <= diagnostics["ais/alpha"] <= 1.0
    for weights in batch.weights:
        assert torch.isfinite(weights).all()
        assert (weights <= 2.0).all() and (weights >= 0).all()


def test_alpha_one_gives_the_tis_update(tokenizer, tmp_path):
    after = {}
    for name, method in {"ais_alpha_1": "ais", "tis": "tis"}.items():
        trainer = make_trainer(tokenizer, tmp_path / name, ais_rule=lambda d: 1.0, max_steps=1,
                               **{"correction.method": method, "rollout.precision": "fp8"})
        batch = trainer.make_generation_batch()
        assert batch.advantages.abs().sum() > 0
        tis = correct(CorrectionSettings("tis", clip=2.0), batch.logp_old[0],
                      trainer.policy.rollout_logprobs(trainer.engine.model, batch.rollout, batch.seeds[0]),
                      batch.advantages, batch.rollout.completion_mask)
        assert torch.equal(batch.weights[0], tis.weights)
        before = lora_parameters(trainer)
        assert trainer.optimisation_pass(batch, 0)["grad_norm"] > 0
        after[name] = lora_parameters(trainer)
        assert any(not torch.equal(before[k], after[name][k]) for k in before)
    for key, value in after["tis"].items():
        assert torch.equal(value, after["ais_alpha_1"][key]), key


@pytest.mark.parametrize("model_fn", [tiny_llada, tiny_qwen3], ids=["llada", "qwen3"])
def test_bypass_mode_takes_the_rollout_logprobs_as_old_and_measures_the_mismatch_in_the_first_update(
        tokenizer, tmp_path, model_fn, monkeypatch):
    settings = {"beta": 0.0, "rollout.precision": "fp8", "correction.method": "none"}  # FP8: a mismatch to measure
    decoupled = make_trainer(tokenizer, tmp_path / "decoupled", model_fn, **settings)
    bypass = make_trainer(tokenizer, tmp_path / "bypass", model_fn, **settings, **{"correction.bypass_mode": True})
    expected = decoupled.make_generation_batch()
    scorers = []
    scored_by = grpo.micro_batched_logprobs
    monkeypatch.setattr(grpo, "micro_batched_logprobs", lambda score, *args: scorers.append(score) or scored_by(
        score, *args))
    batch = bypass.make_generation_batch()
    assert torch.equal(batch.rollout.sequences, expected.rollout.sequences)
    assert scorers == [bypass.policy.rollout_logprobs] * len(batch.seeds)  # no trainer pass for ℓ_old
    rollout_side = bypass.policy.rollout_logprobs(bypass.engine.model, batch.rollout, batch.seeds[0])
    assert torch.equal(batch.logp_old[0], rollout_side)
    assert batch.diagnostics == [{}] * len(batch.seeds) and torch.equal(batch.weights[0], batch.rollout.completion_mask.float())

    mismatch = {key: value for key, value in expected.diagnostics[0].items() if key.startswith("rollout_corr/")}
    assert mismatch["rollout_corr/k3_kl"] > 0
    first, second = bypass.optimisation_pass(batch, 0), bypass.optimisation_pass(batch, 1)
    for key, value in mismatch.items():  # ℓ_θ at θ_old (train mode, no dropout) against ℓ_rollout
        assert first[key] == pytest.approx(value, rel=1e-4, abs=1e-7), key
        assert second[key] == first[key], key
    assert math.isfinite(first["loss"]) and first["grad_norm"] > 0


def test_same_seed_gives_the_same_metrics_and_writes_outputs(tokenizer, tmp_path):
    histories = []
    for run in ("a", "b"):
        result = make_trainer(tokenizer, tmp_path / run, rollout={"precision": "fp8"}).train()
        histories.append([{k: v for k, v in r.items() if not k.startswith("timing/")} for r in result.history])
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        assert len(lines) == 2 and json.loads(lines[0])["step"] == 1
        assert (tmp_path / run / "final" / "adapter_model.safetensors").is_file()
    assert histories[0] == histories[1]
    assert all(math.isfinite(r["loss"]) for r in histories[0])


def test_a_rollout_seed_offset_draws_other_rollouts_of_the_same_prompts(tokenizer, tmp_path, monkeypatch):
    """experimental.rollout_seed_offset moves the sampler's random stream only: the same prompts in the same order,
    other completions (the null arm of a study paired by seed)."""
    calls = []

    def recording_sample_prompts(policies, model, tokenizer, prompts, *args):
        calls.append((list(prompts), args[2].initial_seed()))
        return sample_prompts(policies, model, tokenizer, prompts, *args)

    sample_prompts = grpo.sample_prompts
    monkeypatch.setattr(grpo, "sample_prompts", recording_sample_prompts)
    rewards = []
    for offset in (0, 1):
        trainer = make_trainer(tokenizer, tmp_path / str(offset), max_steps=1, rollout={"precision": "bf16"},
                               experimental={"rollout_seed_offset": offset})
        trainer.train()
        rewards.append(json.loads((tmp_path / str(offset) / "metrics.jsonl").read_text())["reward"])
    (prompts_0, seed_0), (prompts_1, seed_1) = calls
    assert prompts_0 == prompts_1 and seed_1 - seed_0 == 1_000_003
    assert rewards[0] != rewards[1]  # other completions


def test_cached_parallel_rollouts_show_their_approximation_in_the_trajectory_ratio(tokenizer, tmp_path):
    """rollout_cache=dual with rollout_threshold=0.9 and the trajectory estimator: a run with AIS completes, and its
    logged k3 KL (FP8 and cache/parallel approximation; the trainer replays without the cache) is above that of the
    same run without the cache (FP8 only) at every step. Measured margin on this model: 10-30x."""
    settings = {"rollout.precision": "fp8", "likelihood.estimator": "trajectory",
                "experimental.likelihood_decoder": "exact", "correction.method": "ais"}
    cached = make_trainer(tokenizer, tmp_path / "dual", **settings,
                          **{"rollout.cache": "dual", "rollout.threshold": 0.9}).train()
    uncached = make_trainer(tokenizer, tmp_path / "none", **settings).train()
    assert cached.steps == uncached.steps == 2
    for with_cache, without in zip(cached.history, uncached.history):
        assert with_cache["rollout_corr/k3_kl"] > without["rollout_corr/k3_kl"] > 0
        assert math.isfinite(with_cache["loss"]) and 0 <= with_cache["ais/alpha"] <= 1
    assert uncached.history[0]["completions/mean_steps"] == 4  # diffusion_steps
    assert cached.history[0]["completions/mean_steps"] == 8  # never 90 % confident: one token per step


def test_exact_order_replay_sees_precision_only_and_keeps_the_samplers_own_steps(tokenizer, tmp_path):
    """likelihood_order=exact with a dual cache + threshold rollouts and the bf16 engine: the completions are
    replayed along the exact decoder's order on both sides, so the ratio is 1 (the decoder's approximation is unseen,
    as documented); `completions/mean_steps` stays the fast sampler's."""
    run = make_trainer(tokenizer, tmp_path, rollout={"precision": "bf16", "cache": "dual", "threshold": 0.9},
                       likelihood={"estimator": "trajectory"}, experimental={"likelihood_order": "exact"}).train()
    for record in run.history:
        assert record["rollout_corr/k3_kl"] == pytest.approx(0.0, abs=1e-6)
        assert record["completions/mean_steps"] == 8  # one token per step: the threshold sampler's own count


def test_decoder_replay_makes_the_fast_decoder_the_trained_policy(tokenizer, tmp_path):
    """The trajectory estimator with dual cache + threshold rollouts: the trainer replays the decoder's cache along
    its own commits, so with the bf16 engine the ratio is 1 (the approximation is part of the policy, not a
    mismatch), and the weights move."""
    run = make_trainer(tokenizer, tmp_path, rollout={"precision": "bf16", "cache": "dual", "threshold": 0.9},
                       likelihood={"estimator": "trajectory"}).train()  # likelihood_decoder=rollout by default
    for record in run.history:
        assert record["rollout_corr/k3_kl"] == pytest.approx(0.0, abs=1e-6)
        assert record["grad_norm"] > 0 and math.isfinite(record["loss"])


def test_a_block_fraction_scores_one_block_per_iteration_and_trains_on_its_tokens(tokenizer, tmp_path):
    """likelihood_block_fraction=0.5 of 2 blocks: each inner iteration draws one block; ℓ_old, the correction and the
    loss cover its valid tokens alone, and the pass moves the weights."""
    from dllm_ais.grpo import micro_batched_positions

    trainer = make_trainer(tokenizer, tmp_path, seed=2,
                           rollout={"precision": "bf16", "cache": "dual", "block_length": 4},
                           likelihood={"estimator": "trajectory"}, experimental={"likelihood_block_fraction": 0.5})
    batch = trainer.make_generation_batch()
    assert len(batch.seeds) == 2, "one draw of blocks per inner iteration"
    assert batch.advantages.abs().sum() > 0
    valid = batch.rollout.completion_mask.bool()
    for k, seed in enumerate(batch.seeds):
        scored = micro_batched_positions(trainer.policy, batch.rollout, seed, 4)
        assert scored.any() and not (scored & ~valid).any()
        in_block = scored.any(dim=0)
        assert in_block[:4].any() != in_block[4:].any(), "one block of the two"
        assert (batch.logp_old[k][:, ~in_block] == 0).all() and (batch.weights[k][~scored] == 0).all()
        assert (batch.logp_old[k][scored] < 0).all()
        assert batch.diagnostics[k]["rollout_corr/k3_kl"] == pytest.approx(0.0, abs=1e-6)
    before = lora_parameters(trainer)
    metrics = trainer.optimisation_pass(batch, 0)
    assert metrics["grad_norm"] > 0 and math.isfinite(metrics["loss"])
    assert any(not torch.equal(before[k], value) for k, value in lora_parameters(trainer).items())


def test_groups_to_update_keeps_the_informative_groups_and_the_same_count_on_every_process():
    from dllm_ais.grpo import groups_to_update

    def kept_groups(rewards, processes):
        return groups_to_update(torch.tensor(rewards), 2, processes).view(-1, 2)[:, 0].tolist()

    assert kept_groups([1., 1., 0., 1., 0., 0., 1., 0.], 1) == [False, True, False, True]
    assert kept_groups([1., 1., 0., 0.], 1) == [True, False], "nothing to learn: the first group, one step"
    # Two processes of three groups: 2 informative groups on the first, none on the second, which keeps its first two.
    assert kept_groups([0., 1., 1., 1., 1., 0.] + [1., 1., 0., 0., 1., 1.], 2) == [True, False, True, True, True, False]


def test_dropping_zero_std_groups_scores_and_trains_on_the_informative_groups_alone(tokenizer, tmp_path):
    """Rewards [1, 1 | 0, 1]: the first group teaches nothing and is left out of the log-probs, the correction and
    the update; the batch's reward metrics still count it; the kept group's log-probs are those the full batch gets."""
    def half_informative(prompts, completions, **kwargs):
        return [1.0, 1.0, 0.0, 1.0]

    settings = dict(reward_funcs=[half_informative], beta=0.0, num_iterations=1, rollout={"precision": "bf16"},
                    likelihood={"estimator": "trajectory"})
    full = make_trainer(tokenizer, tmp_path / "full", **settings).make_generation_batch()
    trainer = make_trainer(tokenizer, tmp_path / "dropped", drop_zero_std_groups=True, **settings)
    batch = trainer.make_generation_batch()
    assert batch.metrics["frac_reward_zero_std"] == 0.5 and batch.metrics["reward"] == 0.75
    assert batch.advantages.tolist() == [-0.5, 0.5]
    assert torch.equal(batch.rollout.sequences, full.rollout.sequences[2:])
    assert torch.allclose(batch.logp_old[0], full.logp_old[0][2:], atol=1e-5)
    assert batch.weights[0].shape == batch.rollout.completion_mask.shape
    before = lora_parameters(trainer)
    metrics = trainer.optimisation_pass(batch, 0)
    assert metrics["grad_norm"] > 0
    assert any(not torch.equal(before[k], value) for k, value in lora_parameters(trainer).items())


def test_step_merge_trains_with_a_backward_per_segment_and_an_engine_side_when_it_merges_steps(tokenizer, tmp_path):
    """step_merge with 2 segments of the 4 steps: the engine scores the rollout side (bf16: the ratio is 1), the
    optimisation pass backpropagates segment by segment and moves the weights."""
    trainer = make_trainer(tokenizer, tmp_path, num_iterations=1, beta=0.04, rollout={"precision": "bf16"},
                           likelihood={"estimator": "step_merge", "segments": 2})
    batch = trainer.make_generation_batch()
    assert not torch.equal(batch.logp_old[0], batch.rollout.step_logprobs)
    metrics = trainer.optimisation_pass(batch, 0)
    assert metrics["policy_ratio/mean"] == pytest.approx(1.0) and metrics["grad_norm"] > 0
    assert math.isfinite(metrics["loss"]) and metrics["kl"] == pytest.approx(0.0, abs=1e-6)


def test_validation_decodes_exactly_whatever_the_rollouts_use(tokenizer, tmp_path):
    """d1's protocol: a run with fast rollouts (dual cache, threshold) scores its validation prompts with the exact
    decoder — the same per-prompt rewards as a run with exact rollouts — and reports its own sampler's score beside
    it after training (`eval/rollout_sampler/*`). A run whose rollouts go left to right, one token per step, without
    a cache, is validated the same way (low-confidence remasking, max_completion_length / 2 steps) and has its own
    sampler's score too; a run that rolls out with d1's protocol has none."""
    validation = make_digits_dataset(8, seed=5)
    fast = make_trainer(tokenizer, tmp_path / "fast", eval_size=8, rollout={"cache": "dual", "threshold": 0.9})
    exact = make_trainer(tokenizer, tmp_path / "exact", eval_size=8)
    in_order = make_trainer(tokenizer, tmp_path / "in_order", eval_size=8,
                            rollout={"remasking": "left_to_right", "steps": 8})
    for trainer in (fast, in_order):
        exact_decoder = trainer.parts.greedy_policy.sampler_config
        assert (exact_decoder.cache, exact_decoder.threshold, exact_decoder.factor) == ("none", None, None)
        assert (exact_decoder.remasking, exact_decoder.steps) == ("low_confidence", 4)
    assert in_order.policy.sampler_config.remasking == "left_to_right"
    assert in_order.parts.rollout_sampler_policy.sampler_config.remasking == "left_to_right"
    assert exact.parts.rollout_sampler_policy is None
    torch.testing.assert_close(in_order.evaluate(validation).per_prompt_reward,
                               exact.evaluate(validation).per_prompt_reward)
    torch.testing.assert_close(fast.evaluate(validation).per_prompt_reward, exact.evaluate(validation).per_prompt_reward)
    fast.eval_dataset = validation
    closing = fast.train().history[-1]
    assert {"eval/reward", "eval/rollout_sampler/reward", "eval/rollout_sampler/num_prompts"} <= set(closing)


def test_the_rollout_decoders_own_score_can_be_left_out(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path, eval_size=8, max_steps=1, rollout={"cache": "dual"},
                           experimental={"eval_rollout_sampler": False})
    trainer.eval_dataset = make_digits_dataset(8, seed=5)
    closing = trainer.train().history[-1]
    assert "eval/reward" in closing and not any(key.startswith("eval/rollout_sampler/") for key in closing)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_validation_decodes_the_current_weights_merged_when_the_engine_holds_them(tokenizer, tmp_path, monkeypatch,
                                                                                  precision):
    """A bf16 engine holds the trainer's weights with LoRA merged: validation decodes it, synced first (the adapters
    moved since the last generation batch). An FP8 engine is never validated: the trainer's own model is."""
    trainer = make_trainer(tokenizer, tmp_path, eval_size=4, rollout={"precision": precision})
    with torch.no_grad():
        for name, parameter in trainer.unwrapped_model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.1)
    decoded = []
    monkeypatch.setattr("dllm_ais.trainer.evaluate_policy", lambda model, *args, **kwargs: decoded.append(model))
    if precision == "fp8":
        trainer.evaluate(make_digits_dataset(4, seed=5))
        assert not trainer.engine.holds_trainer_weights and decoded == [trainer.unwrapped_model]
        return
    merged = dict(merged_state_items(trainer.unwrapped_model))
    engine_weights = dict(trainer.engine.model.named_parameters())
    assert any(not torch.equal(engine_weights[name], weight) for name, weight in merged.items())
    trainer.evaluate(make_digits_dataset(4, seed=5))
    assert trainer.engine.holds_trainer_weights and decoded == [trainer.engine.model]
    for name, weight in merged.items():
        assert torch.equal(engine_weights[name], weight), name


def test_reward_function_errors_name_the_function(tokenizer, tmp_path):
    def exploding_reward(prompts, completions, **kwargs):
        raise KeyError("no such column")

    def nan_reward(prompts, completions, **kwargs):
        return [float("nan")] * len(completions)

    for fn, error in ((exploding_reward, RewardFunctionError), (nan_reward, SkippedBatch)):
        trainer = make_trainer(tokenizer, tmp_path / fn.__name__, reward_funcs=[fn])
        with pytest.raises(error, match=fn.__name__):
            trainer.make_generation_batch()


def test_lora_preset_wraps_every_llada_block_linear_and_never_the_head(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path)
    wrapped = {n.split("base_model.model.")[-1] for n, m in trainer.unwrapped_model.named_modules() if hasattr(m, "lora_A")}
    expected = {f"model.transformer.blocks.{i}.{leaf}" for i in range(2)
                for leaf in ("q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out")}
    assert wrapped == expected


@pytest.mark.parametrize("estimator", ["one_step", "trajectory", "step_merge", "elbo", "spg"])
def test_every_estimator_scores_a_dream_on_policy_with_its_shift(tokenizer, tmp_path, estimator):
    """A bf16 engine is the trainer: every estimator's rollout side (the engine's, or for the trajectory estimator the
    sampler's recorded log-probs) equals the trainer's ℓ_old on a Dream, so the sampler and every estimator read its
    logits alike (that they read position i at i − 1 is checked in tests/test_dream_sampling.py)."""
    trainer = make_trainer(tokenizer, tmp_path, tiny_dream, rollout={"precision": "bf16"},
                           likelihood={"estimator": estimator, "segments": 2}, correction={"method": "tis"})
    batch = trainer.make_generation_batch()
    for diagnostics in batch.diagnostics:
        assert diagnostics["rollout_corr/rollout_is_min"] == pytest.approx(1.0, abs=1e-4)
        assert diagnostics["rollout_corr/rollout_is_max"] == pytest.approx(1.0, abs=1e-4)


def test_a_dream_trains_with_fp8_rollouts_a_cache_and_dreams_decoding(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path, tiny_dream, max_steps=1, top_p=0.95,
                           rollout={"precision": "fp8", "cache": "dual", "schedule": "time_linear",
                                    "remasking": "entropy"},
                           likelihood={"estimator": "trajectory"}, correction={"method": "ais"})
    before = lora_parameters(trainer)
    record = trainer.train().history[-1]
    assert math.isfinite(record["loss"]) and record["rollout_corr/k3_kl"] > 0 and 0 <= record["ais/alpha"] <= 1
    assert any(not torch.equal(before[name], value) for name, value in lora_parameters(trainer).items())


def test_lora_preset_for_dream(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path, tiny_dream)
    leaves = {n.rsplit(".", 1)[-1] for n, m in trainer.unwrapped_model.named_modules() if hasattr(m, "lora_A")}
    assert leaves == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_lora_preset_for_qwen3(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path, tiny_qwen3)
    leaves = {n.rsplit(".", 1)[-1] for n, m in trainer.unwrapped_model.named_modules() if hasattr(m, "lora_A")}
    assert leaves == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_gradient_accumulation_scores_every_micro_batch_with_the_same_masks(tokenizer, tmp_path):
    """With the one-step estimator, ℓ_θ of the first pass must equal ℓ_old exactly on every micro-batch."""
    trainer = make_trainer(tokenizer, tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                           num_iterations=1, rollout={"precision": "bf16"})
    batch = trainer.make_generation_batch()
    assert batch.diagnostics[0]["rollout_corr/rollout_is_min"] == batch.diagnostics[0]["rollout_corr/rollout_is_max"] == 1.0
    metrics = trainer.optimisation_pass(batch, 0)
    assert metrics["policy_ratio/mean"] == 1.0 and metrics["clip_ratio/region_mean"] == 0.0


def snapshot(trainer):
    """Bit-exact copies of the trainable weights and the whole optimizer state."""
    optimizer = trainer.optimizer.state_dict()
    return ({n: p.detach().clone() for n, p in trainer.unwrapped_model.named_parameters() if p.requires_grad},
            {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for i, s in optimizer["state"].items()})


def assert_bit_identical(before, after):
    for (weights_a, optimizer_a), (weights_b, optimizer_b) in [(before, after)]:
        assert weights_a.keys() == weights_b.keys() and optimizer_a.keys() == optimizer_b.keys()
        for name in weights_a:
            assert torch.equal(weights_a[name], weights_b[name]), name
        for index in optimizer_a:
            for key, value in optimizer_a[index].items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(optimizer_b[index][key])), (index, key)


def nan_like(values):
    return torch.full_like(values, float("nan"))


def inject_reward(trainer, monkeypatch):
    def nan_reward(prompts, completions, **kwargs):
        return [float("nan")] * len(completions)

    trainer.reward_funcs = [nan_reward]


def inject_engine_logprobs(trainer, monkeypatch):
    score = trainer.policy.rollout_logprobs
    monkeypatch.setattr(trainer.policy, "rollout_logprobs", lambda model, rollout, seed, **kw: nan_like(score(model, rollout, seed, **kw)))


def inject_old_logprobs(trainer, monkeypatch):
    score = trainer.policy.logprobs
    monkeypatch.setattr(trainer.policy, "logprobs", lambda model, rollout, seed, **kw: nan_like(score(model, rollout, seed))
                        if model is not trainer.engine.model and not torch.is_grad_enabled() else score(model, rollout, seed, **kw))


def inject_reference_logprobs(trainer, monkeypatch):
    import dllm_ais.grpo as grpo

    reference = grpo.reference_logprobs
    monkeypatch.setattr(grpo, "reference_logprobs", lambda *args: nan_like(reference(*args)))


def inject_policy_logprobs(trainer, monkeypatch):
    pieces = trainer.policy.logprob_pieces

    def infinite_under_grad(model, rollout, seed, compute_entropy=False, advantages=None):
        for piece in pieces(model, rollout, seed, compute_entropy, advantages):
            yield dataclasses.replace(piece, logprobs=piece.logprobs * math.inf) if torch.is_grad_enabled() else piece

    monkeypatch.setattr(trainer.policy, "logprob_pieces", infinite_under_grad)


def inject_loss(trainer, monkeypatch):
    import dllm_ais.grpo as grpo

    loss_fn = grpo.TokenLoss.__call__
    monkeypatch.setattr(grpo.TokenLoss, "__call__",
                        lambda *a, **k: (lambda loss, m: (loss * math.nan, m))(*loss_fn(*a, **k)))


def inject_gradient(trainer, monkeypatch, value=math.nan):
    parameter = next(p for p in trainer.model.parameters() if p.requires_grad)
    parameter.register_hook(lambda grad: torch.full_like(grad, value))


def inject_infinite_gradient(trainer, monkeypatch):
    inject_gradient(trainer, monkeypatch, math.inf)


@pytest.mark.parametrize("inject, stage", [
    (inject_reward, "reward"), (inject_engine_logprobs, "rollout log-probs"), (inject_old_logprobs, "old log-probs"),
    (inject_reference_logprobs, "reference log-probs"), (inject_policy_logprobs, "policy log-probs"),
    (inject_loss, "loss"), (inject_gradient, "gradient"), (inject_infinite_gradient, "gradient"),
], ids=lambda v: getattr(v, "__name__", v))
def test_a_non_finite_stage_skips_the_batch_and_leaves_weights_and_optimizer_untouched(tokenizer, tmp_path, monkeypatch,
                                                                                        inject, stage):
    trainer = make_trainer(tokenizer, tmp_path, num_iterations=1, max_steps=10, beta=0.04,
                           max_consecutive_skipped_batches=2)
    assert trainer.training_step()["skipped_batches"] == 0  # one real step: AdamW now has moments to protect
    before, step, lr = snapshot(trainer), trainer.global_step, trainer.scheduler.get_last_lr()
    inject(trainer, monkeypatch)
    assert trainer.training_step() is None
    assert_bit_identical(before, snapshot(trainer))
    assert (trainer.global_step, trainer.scheduler.get_last_lr(), trainer.skipped_batches) == (step, lr, 1)
    assert all(p.grad is None for p in trainer.model.parameters())
    with pytest.raises(NonFiniteError, match=f"2 generation batches in a row.*non-finite {stage}"):
        trainer.training_step()
    assert_bit_identical(before, snapshot(trainer))


def test_a_finite_step_resets_the_consecutive_skip_count_and_is_logged(tokenizer, tmp_path, monkeypatch):
    calls = iter([0.5, math.nan, 0.5, math.nan, 0.5])

    def flaky_reward(prompts, completions, **kwargs):
        value = next(calls)
        return [value + 0.1 * i for i in range(len(completions))]

    trainer = make_trainer(tokenizer, tmp_path, reward_funcs=[flaky_reward], num_iterations=1, max_steps=3,
                           max_consecutive_skipped_batches=2)
    history = trainer.train().history
    assert [r["step"] for r in history] == [1, 2, 3]
    assert [r["skipped_batches"] for r in history] == [0, 1, 2]


def test_save_refuses_non_finite_weights(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path)
    with torch.no_grad():
        next(p for p in trainer.model.parameters() if p.requires_grad)[0].fill_(math.nan)
    with pytest.raises(NonFiniteError, match="non-finite weights"):
        trainer.save(tmp_path / "final")
    assert not (tmp_path / "final").exists()


TRL_METRICS = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "completions/min_length",
               "completions/max_length", "completions/clipped_ratio", "entropy", "num_tokens", "kl",
               "clip_ratio/region_mean", "sampling/importance_sampling_ratio/min",
               "sampling/importance_sampling_ratio/mean", "sampling/importance_sampling_ratio/max",
               "sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max")
VERL_METRICS = tuple(f"rollout_corr/{name}" for name in (
    "rollout_is_mean", "rollout_is_std", "rollout_is_min", "rollout_is_max", "rollout_is_eff_sample_size",
    "rollout_is_ratio_fraction_high", "rollout_is_ratio_fraction_low", "training_ppl", "rollout_ppl", "ppl_ratio",
    "kl", "k3_kl", "chi2_token", "chi2_seq"))


@pytest.fixture(scope="module")
def scored_run(tokenizer, tmp_path_factory):
    """Three FP8 + AIS steps with a validation every step, a checkpoint every step (keeping one) and completions."""
    output_dir = tmp_path_factory.mktemp("scored")
    trainer = make_trainer(tokenizer, output_dir, eval_size=4, eval_steps=1, save_steps=1, save_total_limit=1,
                           max_steps=3, num_iterations=1, log_completions=True, num_completions_to_print=2,
                           rollout={"precision": "fp8"})
    return trainer, trainer.train().history, output_dir


def test_metrics_carry_trl_and_verl_names_and_the_validation_scores(scored_run):
    _, history, output_dir = scored_run
    assert [r["step"] for r in history[:3]] == [1, 2, 3]
    for record in history[:3]:
        assert set(TRL_METRICS + VERL_METRICS) <= set(record)
        assert {"ais/alpha", "ais/reliability", "eval/reward", "eval/accuracy"} <= set(record)
        assert not [key for key in record if key.startswith(("correction/", "is_ratio", "is_weight"))]
        assert record["entropy"] > 0 and 0 <= record["frac_reward_zero_std"] <= 1
        assert record["completions/min_length"] <= record["completions/mean_length"] <= record["completions/max_length"]
    assert 0 < history[0]["num_tokens"] < history[1]["num_tokens"] < history[2]["num_tokens"]  # cumulative
    lines = [json.loads(line) for line in (output_dir / "completions.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 1, 2, 2, 3, 3]
    assert {"prompt", "completion", "reward", "advantage", "rewards/digits_reward"} <= set(lines[0])


def test_the_best_checkpoint_by_validation_score_is_recorded_and_kept(scored_run):
    trainer, history, output_dir = scored_run
    scores = [r["eval/reward"] for r in history[:3]]
    best_step = scores.index(max(scores)) + 1  # the first of equal scores
    record = json.loads((output_dir / "best_checkpoint.json").read_text())
    assert (record["best_global_step"], record["best_metric"]) == (best_step, max(scores))
    assert record["metric_for_best_model"] == "eval/reward" and trainer.best_global_step == best_step
    best = output_dir / f"checkpoint-{best_step}"
    assert record["best_model_checkpoint"] == str(best)
    assert {p.name for p in output_dir.glob("checkpoint-*")} == {"checkpoint-3", best.name}  # save_total_limit=1
    marker = json.loads((best / ".dllm-ais.json").read_text())
    assert marker["step"] == best_step and marker["validation"]["eval/reward"] == max(scores)


def test_mismatch_warnings_come_once_per_run_and_samples_reach_tracker_tables(scored_run, tmp_path, capsys):
    from tqdm.auto import tqdm

    from dllm_ais.metrics import MetricsLog
    from dllm_ais.reporting import RunReporter

    trainer, _, _ = scored_run
    capsys.readouterr()
    log, progress = MetricsLog(tmp_path), tqdm(disable=True)
    trainer.reporter = RunReporter(trainer.config, trainer.accelerator, log, None, progress)
    degenerate = {"step": 4, "reward": 0.0, "loss": 0.0, "rollout_corr/rollout_is_eff_sample_size": 0.2,
                  "rollout_corr/kl": -0.5, "rollout_corr/chi2_token": 0.5}
    trainer.report(degenerate)
    trainer.report(degenerate)
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 2 and "rollout_is_eff_sample_size = 0.2, below 0.3" in warnings[0]
    assert "|kl| above 0.1" in warnings[1]

    class TableTracker:
        tables = []

        def log_table(self, name, columns, data, step):
            self.tables.append((name, columns, data, step))

    trainer.config.report_to = ["wandb"]
    trainer.accelerator.trackers = [TableTracker(), object()]  # a tracker without tables gets none
    trainer.accelerator.log = lambda metrics, step: None
    trainer.completion_samples = [{"prompt": "sort 3 1", "completion": "1 3", "reward": 1.0}]
    trainer.report(degenerate)
    assert TableTracker.tables == [("completions", ["step", "prompt", "completion", "reward"],
                                    [[trainer.global_step, "sort 3 1", "1 3", 1.0]], trainer.global_step)]
    assert trainer.completion_samples is None
    log.close()


def test_metric_for_best_model_must_be_a_validation_score(tokenizer, tmp_path):
    from dllm_ais.config import ConfigError

    with pytest.raises(ConfigError, match="metric_for_best_model='loss'.*reward, accuracy, rewards/"):
        make_trainer(tokenizer, tmp_path, eval_size=4, eval_steps=1, metric_for_best_model="loss")
