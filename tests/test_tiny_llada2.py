"""The embedded tiny LLaDA2 (`embedded-llada2`, `tools/build_tiny_model.py --family llada2`) and its recipe
(`recipes/tiny_llada2_digits.yaml`, shipped as the asset's `recipe.yaml`): it loads through the Auto classes as a
LLaDA2 MoE, greedy rollouts with the recipe's decoder settings answer the digits task, the recipe's FP8 engine
quantizes its experts, and the recipe's dry run passes."""

import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import dllm_ais  # noqa: F401  (registers "llada2_moe")
from dllm_ais.cli import main
from dllm_ais.config import EMBEDDED_MODELS, load_config
from dllm_ais.data import tokenize_prompts
from dllm_ais.engine import RolloutEngine
from dllm_ais.loading import load_tokenizer
from dllm_ais.models import LLaDA2MoeModelLM
from dllm_ais.policy import DiffusionPolicy, build_policy
from dllm_ais.tasks.digits import digits_reward, make_digits_dataset

RECIPE = Path(__file__).parents[1] / "recipes" / "tiny_llada2_digits.yaml"


def test_the_asset_ships_the_recipe():
    assert (EMBEDDED_MODELS["embedded-llada2"] / "recipe.yaml").read_text() == RECIPE.read_text()


def test_embedded_llada2_loads_as_llada2_and_a_greedy_rollout_with_the_recipes_settings_answers():
    path = EMBEDDED_MODELS["embedded-llada2"]
    assert AutoConfig.from_pretrained(path).model_type == "llada2_moe"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert isinstance(model, LLaDA2MoeModelLM) and model.config.block_size == 4
    assert (model.config.num_experts, model.config.num_experts_per_tok) == (8, 2)
    assert sum(param.numel() for param in model.parameters()) * 4 < 4 * 2**20  # a few MB, as the other tiny models
    tokenizer = load_tokenizer("embedded-llada2")
    assert model.config.mask_token_id == tokenizer.mask_token_id == tokenizer.convert_tokens_to_ids("<|mdm_mask|>")

    config = load_config(RECIPE)
    assert config.model_name_or_path == "embedded-llada2"
    policy = build_policy(config, model.config, tokenizer, temperature=0.0)
    assert isinstance(policy, DiffusionPolicy)
    assert (policy.sampler_config.cache, policy.sampler_config.block_length) == ("prefix", 4)

    rows = make_digits_dataset(32, seed=7)
    ids, attention = tokenize_prompts(tokenizer, rows["prompt"], config.max_prompt_length)
    with torch.no_grad():
        rollout = policy.sample(model, ids, attention, None)
    completions = rollout.completion_ids
    assert completions.shape == (len(rows), config.max_completion_length)
    assert not (completions == tokenizer.mask_token_id).any()  # every position committed
    texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
    rewards = digits_reward(rows["prompt"], [[{"role": "assistant", "content": text}] for text in texts],
                            answer=rows["answer"])
    # the warm start's greedy reward is well above a broken model's ~0 (its sort-order noise leaves the rest)
    assert sum(rewards) / len(rewards) > 0.4, texts
    engine = RolloutEngine(model, config.rollout.precision)
    assert sum(name.endswith("mlp.experts") for name in engine.quantized_modules) == 3  # every MoE layer's experts


def test_the_recipes_dry_run_passes(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert main(["train", str(RECIPE), "--dry_run=true"]) == 0
    out = capsys.readouterr().out
    assert "dry run OK" in out and "policy=diffusion" in out
    assert list(tmp_path.iterdir()) == []
