"""SDAR through the GRPO trainer: every estimator and correction on a tiny random SDAR, FP8 rollouts, the complete
ratio, the LoRA preset, the exact cache's recorded log-probs against the trainer's replay, and the settings a
block-causal model refuses at model load."""

import math

import pytest
import torch

from conftest import config_of
from dllm_ais.config import ConfigError
from dllm_ais.dry_run import stand_in_model
from dllm_ais.policy import build_policy
from dllm_ais.tasks.digits import digits_reward, make_digits_dataset
from dllm_ais.trainer import GRPOTrainer
from dllm_ais.sampling.diffusion.choice import recorded_choice
from test_trainer import lora_parameters

BLOCK = 4
SDAR_TINY = dict(task="digits", eval_size=0, num_generations=2, per_device_train_batch_size=4,
                 gradient_accumulation_steps=1, max_completion_length=8, num_iterations=2, max_steps=2, lora_r=4,
                 lora_alpha=8, lora_dropout=0.0, learning_rate=1e-3, max_prompt_length=64, temperature=1.0,
                 dtype="float32", weight_decay=0.0, rollout={"block_length": BLOCK, "steps": 4})


def distinct_characters(prompts, completions, **kwargs):
    """A reward that varies between a random model's completions: how many distinct characters each holds."""
    return [float(len(set(completion[0]["content"]))) for completion in completions]


def tiny_sdar(tokenizer, block_size: int = BLOCK):
    return stand_in_model(True, tokenizer, "sdar", block_size=block_size)


def sdar_trainer(tokenizer, tmp_path, model=None, **overrides) -> GRPOTrainer:
    config = config_of(SDAR_TINY, output_dir=str(tmp_path), **overrides)
    return GRPOTrainer(config, model=model or tiny_sdar(tokenizer), tokenizer=tokenizer,
                       reward_funcs=[distinct_characters, digits_reward], train_dataset=make_digits_dataset(16, seed=1))


def assert_trains(trainer: GRPOTrainer) -> dict:
    """Two training steps: finite losses, gradients, LoRA weights moved (no weight decay); returns the last step's
    record."""
    before = lora_parameters(trainer)
    history = trainer.train().history
    assert len(history) == 2 and all(math.isfinite(record["loss"]) for record in history)
    assert all(record["frac_reward_zero_std"] < 1 and record["grad_norm"] > 0 for record in history)
    assert any(not torch.equal(before[name], value) for name, value in lora_parameters(trainer).items())
    return history[-1]


@pytest.mark.parametrize("estimator", ["one_step", "trajectory", "step_merge", "elbo", "spg"])
def test_every_estimator_trains_an_sdar_on_policy(tokenizer, tmp_path, estimator):
    """policy auto picks the diffusion policy for model_type sdar; with a bf16 engine (the trainer's weights) every
    estimator's rollout side equals ℓ_old, and two steps train."""
    trainer = sdar_trainer(tokenizer, tmp_path, rollout={"precision": "bf16"},
                           likelihood={"estimator": estimator, "segments": 2}, correction={"method": "tis"})
    assert trainer.policy.sampler.config.block_length == BLOCK
    record = assert_trains(trainer)
    assert record["rollout_corr/rollout_is_min"] == pytest.approx(1.0, abs=1e-4)
    assert record["rollout_corr/rollout_is_max"] == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize("correction", [{"method": "none"}, {"method": "tis"}, {"method": "mis"},
                                        {"method": "acr"}, {"method": "ais"},
                                        {"method": "none", "bypass_mode": True}],
                         ids=["none", "tis", "mis", "acr", "ais", "bypass"])
def test_every_correction_trains_an_sdar_with_fp8_rollouts(tokenizer, tmp_path, correction):
    """FP8 rollouts on SDAR: the engine quantizes its linears like any model's and the mismatch shows in k3."""
    trainer = sdar_trainer(tokenizer, tmp_path, rollout={"precision": "fp8"}, correction=correction,
                           likelihood={"estimator": "trajectory"})
    assert {name.rsplit(".", 1)[-1] for name in trainer.engine.quantized_modules} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert len(trainer.engine.quantized_modules) == 7 * trainer.engine.model.config.num_hidden_layers
    record = assert_trains(trainer)
    if not correction.get("bypass_mode"):
        assert record["rollout_corr/k3_kl"] > 0


@pytest.mark.parametrize("decoding", [{"rollout": {"cache": "prefix"}, "experimental": {"likelihood_order": "exact"}},
                                      {"rollout": {"threshold": 0.5}}], ids=["exact_order_replay", "parallel"])
def test_sdar_trains_along_the_exact_decoders_order_and_with_parallel_commits(tokenizer, tmp_path, decoding):
    """The trajectory estimator along the exact decoder's order (a replay of the completions block by block), and
    rollouts with SDAR's low_confidence_dynamic parallel commits: on policy with a bf16 engine, and they train."""
    trainer = sdar_trainer(tokenizer, tmp_path, **{**decoding, "rollout": {"precision": "bf16", **decoding["rollout"]}},
                           likelihood={"estimator": "trajectory"}, correction={"method": "ais"})
    assert assert_trains(trainer)["rollout_corr/k3_kl"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("decoder", ["exact", "rollout"])
def test_the_exact_caches_recorded_logprobs_are_the_trainers_trajectory_replay(tokenizer, tmp_path, decoder):
    """Rollouts decoded with SDAR's exact cache of finished blocks record log-probs the trainer's trajectory replay
    reproduces: its training-mode forward (each block against the clean blocks before it, likelihood_decoder=exact:
    to float rounding) or the cached decoder replayed (rollout: exactly) — k3 = 0 on a bf16 engine, through the
    trainer's own step."""
    trainer = sdar_trainer(tokenizer, tmp_path, max_steps=1, rollout={"precision": "bf16", "cache": "prefix"},
                           likelihood={"estimator": "trajectory"}, correction={"method": "ais"},
                           experimental={"likelihood_decoder": decoder})
    batch = trainer.make_generation_batch()
    assert trainer.policy.replays_decoder == (decoder == "rollout")
    if decoder == "rollout":  # the cache written forward for forward as sampling wrote it: the recorded values
        assert torch.equal(batch.logp_old[0], batch.rollout.step_logprobs)
    torch.testing.assert_close(batch.logp_old[0], batch.rollout.step_logprobs, atol=1e-5, rtol=0)
    assert batch.diagnostics[0]["rollout_corr/k3_kl"] == pytest.approx(0.0, abs=1e-6)


def test_the_complete_ratio_trains_an_sdar(tokenizer, tmp_path):
    """A stochastic commit choice (rollout_position_temperature) on SDAR's blocks: the trainer replays it (commit
    ratio 1 on a bf16 engine) and trains."""
    trainer = sdar_trainer(tokenizer, tmp_path, rollout={"precision": "bf16", "cache": "prefix"},
                           likelihood={"estimator": "trajectory"},
                           correction={"method": "tis"},
                           experimental={"rollout_position_temperature": 0.5, "complete_ratio": True})
    batch = trainer.make_generation_batch()
    choice_old = trainer.policy.choice_logprobs(trainer.model, batch.rollout)
    torch.testing.assert_close(choice_old, recorded_choice(batch.rollout).logprobs, atol=1e-5, rtol=0)
    assert_trains(trainer)


def test_lora_preset_for_sdar(tokenizer, tmp_path):
    trainer = sdar_trainer(tokenizer, tmp_path)
    leaves = {n.rsplit(".", 1)[-1] for n, m in trainer.unwrapped_model.named_modules() if hasattr(m, "lora_A")}
    assert leaves == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


@pytest.mark.parametrize(("overrides", "named"), [
    ({"rollout": {"block_length": 8, "steps": 4}}, "set rollout.block_length to 4"),
    ({"rollout": {"cfg_scale": 1.0}}, "cfg_scale > 0"),
    ({"rollout": {"cache": "prefix", "cache_dtype": "fp8"}}, "cache_dtype='fp8'"),
    ({"rollout": {"cache": "dual", "cache_refresh_interval": 2}}, "cache_refresh_interval"),
    ({"rollout": {"threshold": 0.5}, "experimental": {"rollout_position_temperature": 0.5}},
     "threshold with position_temperature > 0"),
])
def test_settings_sdar_cannot_decode_with_are_refused_at_model_load(tokenizer, tmp_path, overrides, named):
    """One line naming the setting, before any rollout (the trainer builds its policies right after loading)."""
    with pytest.raises(ConfigError, match=f"model_type 'sdar' decodes block by block.*{named}") as error:
        sdar_trainer(tokenizer, tmp_path, **overrides)
    assert "\n" not in str(error.value).strip().split("Cannot start the run:")[-1].strip()


def test_policy_autoregressive_is_refused_for_an_sdar(tokenizer, tmp_path):
    """SDAR's positions see the rest of their block: scored as a causal LM each token would see itself."""
    model = tiny_sdar(tokenizer)
    with pytest.raises(ConfigError, match="model_type 'sdar' is block diffusion.*set policy to auto or diffusion"):
        build_policy(config_of(SDAR_TINY, policy="autoregressive"), model.config, tokenizer)
