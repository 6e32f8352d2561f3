"""Custom samplers in training: a sampler's logit stage is what every estimator scores; GRPOTrainer(sampler=...)."""

import dataclasses
import functools
import importlib.util
from pathlib import Path

import pytest
import torch

from conftest import tiny_llada, tiny_qwen3
from dllm_ais.components import training_policies
from conftest import config_of
from dllm_ais.config import ConfigError, GRPOConfig, LikelihoodSettings
from dllm_ais.likelihood import one_step_masked_input, plain_logits, selective_log_softmax, trajectory_logprobs
from dllm_ais.policy import DiffusionPolicy, build_policy
from dllm_ais.sampling.diffusion import MaskedDiffusionSampler, sampling_logprobs
from dllm_ais.tasks.digits import digits_reward, make_digits_dataset
from dllm_ais.trainer import GRPOTrainer

TINY = dict(task="digits", eval_size=0, num_generations=2, per_device_train_batch_size=4, gradient_accumulation_steps=1,
            max_completion_length=8, num_iterations=1, max_steps=1, lora_r=4, lora_alpha=8, lora_dropout=0.0,
            learning_rate=1e-3, max_prompt_length=64, temperature=1.0, dtype="float32",
            rollout={"block_length": 8, "steps": 4, "precision": "bf16"}, correction={"method": "ais"})
BIASED_IDS = [8, 9, 10, 11]  # the digits 0-3 in the embedded tokenizer


class BiasedSampler(MaskedDiffusionSampler):
    """Adds `bias` to the logits of `BIASED_IDS` at every step."""

    def __init__(self, config, bias: float = 3.0):
        super().__init__(config)
        self.bias = bias

    def block_logits(self, *args, **kwargs):
        logits = super().block_logits(*args, **kwargs).clone()
        logits[..., BIASED_IDS] += self.bias
        return logits


class TopTwoSampler(MaskedDiffusionSampler):
    """Draws from the two most probable tokens only: its `token_logprobs` is not softmax(logits / τ)."""

    def token_logprobs(self, logits, tokens):
        kept = logits.masked_fill(logits < logits.topk(2, dim=-1).values[..., -1:], -torch.inf)
        return sampling_logprobs(kept, tokens, self.config.temperature)


def config(tmp_path, **overrides) -> GRPOConfig:
    return config_of(TINY, output_dir=str(tmp_path), **overrides)


def make_trainer(tokenizer, tmp_path, sampler=None, policy=None, **overrides) -> GRPOTrainer:
    return GRPOTrainer(config(tmp_path, **overrides), model=tiny_llada(tokenizer), tokenizer=tokenizer,
                       reward_funcs=[digits_reward], train_dataset=make_digits_dataset(8, seed=1), sampler=sampler,
                       policy=policy)


def prompts(tokenizer):
    encoded = tokenizer(["sort 3 9 1 4", "reverse 5 2 7"], return_tensors="pt", padding=True)
    return encoded.input_ids, encoded.attention_mask


def test_a_biased_logit_stage_is_scored_exactly_as_sampled_by_the_trajectory_estimator(tokenizer, tmp_path):
    """bf16 engine, trajectory estimator, a sampler adding +3 to four token ids: the rollout side (the log-probs the
    sampler recorded) equals the trainer's ℓ_old bit for bit, so every ratio is 1; the plain model's replay, which
    the estimator used before it scored through the sampler, is off by far more than rounding."""
    trainer = make_trainer(tokenizer, tmp_path, sampler=BiasedSampler, likelihood={"estimator": "trajectory"})
    batch = trainer.make_generation_batch()
    mask = batch.rollout.completion_mask
    assert torch.equal(batch.logp_old[0][mask], batch.rollout.step_logprobs[mask])
    diagnostics = batch.diagnostics[0]
    assert diagnostics["rollout_corr/rollout_is_min"] == diagnostics["rollout_corr/rollout_is_max"] == 1
    plain = trajectory_logprobs(trainer.unwrapped_model, batch.rollout, tokenizer.mask_token_id, temperature=1.0,
                                logits_fn=plain_logits)
    assert (plain - batch.rollout.step_logprobs)[mask].abs().max() > 0.5


@pytest.mark.parametrize("estimator", ["one_step", "trajectory"])
def test_guidance_is_scored_as_sampled(tokenizer, estimator):
    """cfg_scale = 0.5: the one-step surrogate scores log softmax(u + (s + 1)(c − u)) at the masked canvas (c) and at
    the same canvas with its prompt masked (u), computed here by hand; the trajectory replay equals the guided
    log-probs the sampler recorded."""
    model = tiny_llada(tokenizer).eval()
    run = config_of(TINY, **{"rollout.cfg_scale": 0.5, "likelihood.estimator": estimator,
                             "likelihood.p_mask_prompt": 0.3})
    policy = build_policy(run, model.config, tokenizer)
    ids, attention = prompts(tokenizer)
    rollout = policy.sample(model, ids, attention, torch.Generator().manual_seed(0))
    with torch.no_grad():
        scored = policy.logprobs(model, rollout, seed=7)
        if estimator == "trajectory":
            assert torch.equal(scored, rollout.step_logprobs)
            return
        prompt_length, mask_id = rollout.prompt_length, tokenizer.mask_token_id
        noisy = one_step_masked_input(rollout.sequences, rollout.attention_mask, prompt_length, mask_id, 7, 0.3)
        unconditional_input = noisy.clone()
        unconditional_input[:, :prompt_length] = mask_id
        c = model(noisy, attention_mask=rollout.attention_mask).logits[:, prompt_length:]
        u = model(unconditional_input, attention_mask=rollout.attention_mask).logits[:, prompt_length:]
        guided = selective_log_softmax(u + 1.5 * (c - u), rollout.completion_ids)
        unguided = selective_log_softmax(c, rollout.completion_ids)
    torch.testing.assert_close(scored, guided, atol=1e-5, rtol=0)
    assert (scored - unguided).abs().max() > 1e-2  # the random tiny model is near uniform; rounding is ~1e-6


def test_scoring_logits_keeps_the_last_positions_or_the_given_ones(tokenizer):
    """An int keeps the last positions, a tensor the positions it lists; without processing, the model's own."""
    model = tiny_llada(tokenizer).eval()
    sampler = build_policy(GRPOConfig(**TINY), model.config, tokenizer).sampler
    ids, attention = prompts(tokenizer)
    canvas = torch.cat([ids, torch.randint(0, 20, (2, 8))], dim=1)
    canvas_attention = torch.cat([attention, torch.ones(2, 8, dtype=attention.dtype)], dim=1)
    with torch.no_grad():
        last = sampler.scoring_logits(model, canvas, canvas_attention, 8)
        positions = torch.tensor([ids.shape[1] + 2, canvas.shape[1] - 1])
        listed = sampler.scoring_logits(model, canvas, canvas_attention, positions)
        assert torch.equal(last, plain_logits(model, canvas, canvas_attention, 8))
    torch.testing.assert_close(listed, last[:, [2, 7]])
    with pytest.raises(ValueError, match="gen_length=8"):
        sampler.scoring_logits(model, canvas[:, -8:], canvas_attention[:, -8:], 8)


def test_a_sampler_with_its_own_token_logprobs_is_refused_by_the_trajectory_estimator(tokenizer, tmp_path):
    model = tiny_llada(tokenizer)
    with pytest.raises(ConfigError, match="TopTwoSampler overrides token_logprobs.*likelihood.estimator=one_step"):
        training_policies(config(tmp_path, likelihood={"estimator": "trajectory"}), model.config, tokenizer, TopTwoSampler)
    policy, _, _ = training_policies(config(tmp_path), model.config, tokenizer, TopTwoSampler)
    assert isinstance(policy.sampler, TopTwoSampler)


@pytest.mark.parametrize("given, message", [
    (dict(sampler=object()), "sampler= takes a MaskedDiffusionSampler.*got a object"),
    (dict(sampler=BiasedSampler, policy="x"), "pass sampler= or policy=, not both"),
    (dict(policy=object()),
     "lacks sample, logprobs, rollout_logprobs, logprob_pieces, num_estimator_seeds, scored_positions, "
     "sampler_config"),
    (dict(sampler=lambda sampler_config: "not a sampler"), "built a str, not a MaskedDiffusionSampler"),
    (dict(sampler=lambda sampler_config: MaskedDiffusionSampler(dataclasses.replace(sampler_config, steps=8))),
     "sampler.config differs from sampler_config"),
], ids=["type", "both", "protocol", "factory-type", "factory-config"])
def test_what_the_trainer_cannot_train_with_is_named_at_start(tokenizer, tmp_path, given, message):
    with pytest.raises(ConfigError, match=message):
        training_policies(config(tmp_path), tiny_llada(tokenizer).config, tokenizer, **given)


def test_a_sampler_instance_must_agree_with_the_config(tokenizer, tmp_path):
    """An instance's settings are checked field by field against the config's (named by their config fields); one
    built from the config's own settings trains; a masked-diffusion sampler for an autoregressive run is refused."""
    model_config = tiny_llada(tokenizer).config
    settings = build_policy(config(tmp_path), model_config, tokenizer).sampler_config
    wrong = BiasedSampler(dataclasses.replace(settings, gen_length=16, steps=8, temperature=0.5))
    with pytest.raises(ConfigError, match=r"gen_length=16 \(config max_completion_length: 8\), steps=8 \(config "
                                          r"rollout.steps: 4\), temperature=0.5 \(config temperature: 1.0\)"):
        training_policies(config(tmp_path), model_config, tokenizer, wrong)
    right = BiasedSampler(settings, bias=1.0)
    policy, _, own = training_policies(config(tmp_path), model_config, tokenizer, right)
    assert policy.sampler is right and own.sampler.bias == 1.0 and own.sampler_config.temperature == 0
    with pytest.raises(ConfigError, match="this run's policy is autoregressive"):
        training_policies(config(tmp_path), tiny_qwen3(tokenizer).config, tokenizer, right)


def test_validation_decodes_exactly_and_the_custom_sampler_is_scored_on_its_own(tokenizer, tmp_path):
    """d1's protocol: held-out prompts are decoded by the config's exact (plain, greedy) decoder whatever samples the
    rollouts; the custom sampler's own greedy decoder (a copy at temperature 0) is the `eval/rollout_sampler/*` one.
    A DiffusionPolicy passed as policy= is used as it is, with the same own-sampler score."""
    trainer = make_trainer(tokenizer, tmp_path / "sampler", sampler=functools.partial(BiasedSampler, bias=2.0))
    exact, own = trainer.parts.greedy_policy.sampler, trainer.parts.rollout_sampler_policy.sampler
    assert type(exact) is MaskedDiffusionSampler and exact.config.temperature == 0
    assert isinstance(own, BiasedSampler) and own.bias == 2.0 and own.config.temperature == 0
    policy = DiffusionPolicy.for_sampler(trainer.policy.sampler, likelihood=LikelihoodSettings("one_step", p_mask_prompt=0.15))
    given = make_trainer(tokenizer, tmp_path / "policy", policy=policy)
    assert given.policy is policy and isinstance(given.parts.rollout_sampler_policy.sampler, BiasedSampler)


def test_the_custom_sampler_example_trains_end_to_end(tmp_path, monkeypatch):
    """examples/custom_sampler.py: a registered remasking rule and a biased logit stage, two GRPO steps through
    GRPOTrainer(sampler=...), exact validation before and after, and the custom sampler's own score."""
    from dllm_ais.sampling.diffusion import rules

    monkeypatch.setattr(rules, "REMASKING_RULES", dict(rules.REMASKING_RULES))  # the example registers one
    path = Path(__file__).parents[1] / "examples" / "custom_sampler.py"
    spec = importlib.util.spec_from_file_location("custom_sampler_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    result = example.main(["--max_steps", "2", "--eval_size", "4", "--per_device_train_batch_size", "8",
                           "--output_dir", str(tmp_path)])
    assert result.steps == 2
    closing = result.history[-1]
    assert {"eval/reward", "eval/reward_before", "eval/rollout_sampler/reward"} <= set(closing)
