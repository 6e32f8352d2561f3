"""Shared fixtures: tiny policies over the embedded tokenizer, built from configs (nothing downloaded)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

from dllm_ais.config import EMBEDDED_MODEL_DIR, GRPOConfig, set_override
from dllm_ais.models import DreamConfig, DreamModel, LLaDAConfig, LLaDAModelLM


@pytest.fixture(scope="session", autouse=True)
def one_intra_op_thread():
    """Tiny models' ops are too small to split across threads, and on a busy 2-core machine the thread hand-offs
    made test files 2-7x slower; every test runs on one intra-op thread."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tokenizer():
    tok = AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    tok.padding_side = "left"
    return tok


def tiny_llada(tokenizer, seed: int = 0) -> LLaDAModelLM:
    torch.manual_seed(seed)
    vocab = len(tokenizer)
    return LLaDAModelLM(LLaDAConfig(
        d_model=64, n_heads=4, n_layers=2, mlp_hidden_size=128, vocab_size=vocab, embedding_size=vocab,
        max_sequence_length=256, mask_token_id=tokenizer.mask_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id))


def bare_tiny_llada(mask_token_id: int, eos_token_id: int, seed: int = 0) -> LLaDAModelLM:
    """A tiny LLaDA over a bare 128-id vocabulary (no tokenizer), in eval mode: the likelihood tests' model."""
    torch.manual_seed(seed)
    return LLaDAModelLM(LLaDAConfig(
        d_model=64, n_heads=4, n_kv_heads=4, n_layers=2, mlp_hidden_size=128, vocab_size=128, embedding_size=128,
        max_sequence_length=256, mask_token_id=mask_token_id, eos_token_id=eos_token_id,
        pad_token_id=eos_token_id)).eval()


def tiny_dream(tokenizer, seed: int = 0) -> DreamModel:
    torch.manual_seed(seed)
    return DreamModel(DreamConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, mask_token_id=tokenizer.mask_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.eos_token_id))


def tiny_qwen3(tokenizer, seed: int = 0):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id))


def config_of(*settings: dict, **overrides) -> GRPOConfig:
    """The `GRPOConfig` of `settings` then `overrides` merged in order; a settings group given more than once is merged
    entry by entry (`rollout={"steps": 4}` then `rollout={"precision": "fp8"}`), as a recipe and its overrides are."""
    values: dict = {}
    for mapping in (*settings, overrides):
        for key, value in mapping.items():
            set_override(values, key, value)
    return GRPOConfig(**values)


def official_fixture_with_tokenizer(name: str, tmp_path_factory, tokenizer):
    """tests/data/<name> (weights and config written by a family's official code) with the embedded tokenizer saved
    beside them, as a model directory the CLI, export and lm-eval load (the config's special ids stay)."""
    import shutil
    from pathlib import Path

    official = Path(__file__).parent / "data" / name
    directory = tmp_path_factory.mktemp(name)
    for file in ("config.json", "model.safetensors"):
        shutil.copyfile(official / file, directory / file)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def official_sdar_dir(tmp_path_factory, tokenizer):
    """tests/data/sdar_official (JetLM's code wrote it; mask 271, pad 270, eos 269) with the embedded tokenizer."""
    return official_fixture_with_tokenizer("sdar_official", tmp_path_factory, tokenizer)


@pytest.fixture(scope="session")
def official_llada2_dir(tmp_path_factory, tokenizer):
    """tests/data/llada2_official (inclusionAI's code wrote it; per-expert keys, blocks of 4) with the embedded
    tokenizer."""
    return official_fixture_with_tokenizer("llada2_official", tmp_path_factory, tokenizer)


def embedded_block_model_answers(name: str, recipe, model_class):
    """Check that the embedded block-diffusion model `name` loads through the Auto classes as `model_class` with
    blocks of 4 and the tokenizer's mask token, and that greedy rollouts with its recipe's decoder (prefix cache,
    blocks of 4) answer digits prompts (mean reward above a broken model's ~0: > 0.4); returns (model, config)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dllm_ais.config import EMBEDDED_MODELS, load_config
    from dllm_ais.data import tokenize_prompts
    from dllm_ais.loading import load_tokenizer
    from dllm_ais.policy import DiffusionPolicy, build_policy
    from dllm_ais.tasks.digits import digits_reward, make_digits_dataset

    path = EMBEDDED_MODELS[name]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert AutoConfig.from_pretrained(path).model_type == model.config.model_type
    assert isinstance(model, model_class) and model.config.block_size == 4
    tokenizer = load_tokenizer(name)
    assert model.config.mask_token_id == tokenizer.mask_token_id == tokenizer.convert_tokens_to_ids("<|mdm_mask|>")
    config = load_config(recipe)
    assert config.model_name_or_path == name
    policy = build_policy(config, model.config, tokenizer, temperature=0.0)
    assert isinstance(policy, DiffusionPolicy)
    assert (policy.sampler_config.cache, policy.sampler_config.block_length) == ("prefix", 4)
    rows = make_digits_dataset(32, seed=7)
    ids, attention = tokenize_prompts(tokenizer, rows["prompt"], config.max_prompt_length)
    with torch.no_grad():
        completions = policy.sample(model, ids, attention, None).completion_ids
    assert completions.shape == (len(rows), config.max_completion_length)
    assert not (completions == tokenizer.mask_token_id).any()  # every position committed
    texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
    rewards = digits_reward(rows["prompt"], [[{"role": "assistant", "content": text}] for text in texts],
                            answer=rows["answer"])
    # the warm start's greedy reward is well above a broken model's ~0 (its sort-order noise leaves the rest)
    assert sum(rewards) / len(rewards) > 0.4, texts
    return model, config
