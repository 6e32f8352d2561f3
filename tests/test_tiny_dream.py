"""The embedded tiny Dream (`embedded-dream`, `tools/build_tiny_model.py --family dream`) and its recipe
(`recipes/tiny_dream_digits.yaml`): it loads through the Auto classes as a Dream, greedy rollouts with the recipe's
decoder settings answer the digits task, and the recipe's GRPO steps run."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

import dllm_ais  # noqa: F401  (registers "Dream")
from dllm_ais.config import EMBEDDED_MODELS, load_config
from dllm_ais.data import tokenize_prompts
from dllm_ais.loading import load_tokenizer
from dllm_ais.models import DreamModel
from dllm_ais.policy import DiffusionPolicy, build_policy
from dllm_ais.sampling.diffusion import MaskedDiffusionSampler
from dllm_ais.tasks.digits import digits_reward, make_digits_dataset
from dllm_ais.trainer import GRPOTrainer

RECIPE = Path(__file__).parents[1] / "recipes" / "tiny_dream_digits.yaml"
TOOLS = Path(__file__).resolve().parents[1] / "tools"


def builder():
    """tools/build_tiny_model.py as a module (registered before it runs: it defines dataclasses)."""
    if "build_tiny_model" not in sys.modules:
        spec = importlib.util.spec_from_file_location("build_tiny_model", TOOLS / "build_tiny_model.py")
        sys.modules["build_tiny_model"] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["build_tiny_model"]


def test_qwen3_to_dream_map_keeps_every_weight_but_the_query_key_norms(tokenizer):
    """Every Dream weight is the Qwen3 one of the same name (the q/k/v biases zero), and with Qwen3's q_norm/k_norm
    taken out a one-layer pair gives the same logits at the last position, the one a causal mask lets see everything
    (with more layers the earlier positions' keys differ: Dream's see the later tokens)."""
    def qwen3_model(layers):
        torch.manual_seed(0)
        return Qwen3ForCausalLM(Qwen3Config(
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
            tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)).eval()

    qwen3 = qwen3_model(2)
    source = qwen3.state_dict()
    dream = builder().dream_from_qwen3(qwen3, tokenizer)
    assert dream.config.model_type == "Dream" and dream.config.mask_token_id == tokenizer.mask_token_id
    for name, tensor in dream.state_dict().items():
        assert not tensor.any() if name.endswith("_proj.bias") else torch.equal(tensor, source[name]), name
    assert {name for name in source if name not in dream.state_dict()} == {
        f"model.layers.{i}.self_attn.{norm}.weight" for i in range(2) for norm in ("q_norm", "k_norm")}

    qwen3 = qwen3_model(1)
    dream = builder().dream_from_qwen3(qwen3, tokenizer).eval()
    for layer in qwen3.model.layers:
        layer.self_attn.q_norm, layer.self_attn.k_norm = torch.nn.Identity(), torch.nn.Identity()
    ids = torch.randint(7, len(tokenizer), (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(dream(ids).logits[:, -1], qwen3(ids).logits[:, -1], atol=1e-5, rtol=1e-5)


def test_embedded_dream_loads_as_dream_and_a_greedy_rollout_with_the_recipes_settings_answers():
    path = EMBEDDED_MODELS["embedded-dream"]
    assert AutoConfig.from_pretrained(path).model_type == "Dream"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert isinstance(model, DreamModel) and model.config.architectures == ["DreamModel"]
    tokenizer = load_tokenizer("embedded-dream")
    assert model.config.mask_token_id == tokenizer.mask_token_id == tokenizer.convert_tokens_to_ids("<|mdm_mask|>")

    config = load_config(RECIPE)
    assert config.model_name_or_path == "embedded-dream"
    policy = build_policy(config, model.config, tokenizer, temperature=0.0)
    assert isinstance(policy, DiffusionPolicy)
    sampler_config = policy.sampler_config
    assert (sampler_config.cache, sampler_config.threshold, sampler_config.block_length) == ("dual", 0.9, 16)
    assert sampler_config.mask_token_id == tokenizer.mask_token_id

    rows = make_digits_dataset(32, seed=7)
    ids, attention = tokenize_prompts(tokenizer, rows["prompt"], config.max_prompt_length)
    with torch.no_grad():
        rollout = MaskedDiffusionSampler(sampler_config).sample(model, ids, attention)
    completions = rollout.completion_ids
    assert completions.shape == (len(rows), config.max_completion_length)
    assert not (completions == tokenizer.mask_token_id).any()  # every position committed
    assert torch.equal(rollout.sequences[:, :ids.shape[1]], ids)
    texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
    rewards = digits_reward(rows["prompt"], [[{"role": "assistant", "content": text}] for text in texts],
                            answer=rows["answer"])
    # the warm start's greedy reward is ~0.7 (its sort-order noise leaves the rest); a broken shift or mask id is ~0
    assert sum(rewards) / len(rewards) > 0.4, texts


@pytest.mark.slow  # two GRPO steps of the shipped recipe, smaller batches, no held-out evaluation
def test_the_recipes_grpo_steps_run(tmp_path):
    config = load_config(RECIPE, {"max_steps": 2, "per_device_train_batch_size": 16, "eval_size": 0,
                                  "output_dir": str(tmp_path)})
    result = GRPOTrainer(config).train()
    assert result.steps == 2 and len(result.history) >= 2
    losses = [entry["loss"] for entry in result.history if "loss" in entry]
    assert losses and all(math.isfinite(loss) for loss in losses)
    assert (tmp_path / "final" / "adapter_model.safetensors").is_file()
