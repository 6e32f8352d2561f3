"""Each model family's record (`dllm_ais.models.families.FAMILIES`) against its model module: the config class of its
model_type, the mask token, the attention a tiny model built from config computes, the LoRA preset's modules, the
logit shift a trained embedded model reads; the protocols the records name against `choices.EVAL_PROTOCOLS`; an
unknown model_type refused in one line."""

import importlib
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3Config

import dllm_ais  # noqa: F401  (registers the families' model_types)
from dllm_ais.choices import EVAL_PROTOCOLS
from dllm_ais.models import DreamConfig, LLaDA2MoeConfig, LLaDAConfig, SDARConfig
from dllm_ais.models.families import (FAMILIES, family_of, find_family, is_block_causal, is_diffusion_family,
                                      logits_are_shifted, position_logits)
from dllm_ais.policy import lora_target_modules, lora_target_parameters

VOCAB, MASK, LENGTH, BLOCK = 64, 63, 12, 4
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=16, max_position_embeddings=64, pad_token_id=0, eos_token_id=1,
             bos_token_id=1)


def tiny_model(model_type: str) -> torch.nn.Module:
    """A randomly initialised model of `model_type` built from config alone (nothing read from disk)."""
    torch.manual_seed(0)
    if model_type == "llada":
        config = LLaDAConfig(d_model=32, n_heads=2, n_layers=2, mlp_hidden_size=64, vocab_size=VOCAB,
                             embedding_size=VOCAB, max_sequence_length=64, mask_token_id=MASK,
                             pad_token_id=0, eos_token_id=1)
    elif model_type == "Dream":
        config = DreamConfig(**{k: v for k, v in SMALL.items() if k != "head_dim"}, mask_token_id=MASK)
    elif model_type == "sdar":
        config = SDARConfig(**SMALL, max_window_layers=2, block_size=BLOCK, mask_token_id=MASK)
    elif model_type == "llada2_moe":
        config = LLaDA2MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                 num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                 num_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, num_shared_experts=1,
                                 first_k_dense_replace=1, max_position_embeddings=64, block_size=BLOCK,
                                 mask_token_id=MASK, pad_token_id=0)
    else:  # the autoregressive family: transformers' Qwen3
        config = Qwen3Config(**SMALL)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.module is not None], ids=lambda f: f.name)
def test_a_record_matches_its_module_and_config_class(family):
    module = importlib.import_module(f"dllm_ais.models.{family.module}")
    assert callable(module.register_with_auto_classes)
    (model_type,) = family.model_types
    config = AutoConfig.for_model(model_type)
    assert type(config).__module__ == module.__name__
    assert config.mask_token_id == family.mask_token_id
    assert (getattr(config, "block_size", None) is not None) == family.block_causal
    for exported, source in family.exported_files.items():
        assert (Path(module.__file__).parent / f"{source}.py").is_file(), exported
    for target in family.auto_map.values():
        assert target.split(".")[0] + ".py" in family.exported_files


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_a_tiny_model_of_each_family_attends_as_its_record_says(family):
    """Changing the last token changes the logits of earlier positions exactly where the attention lets them see
    it: everywhere (bidirectional), in the last block only (block-causal), nowhere (causal)."""
    model_type = family.model_types[0]
    model = tiny_model(model_type)
    tokens = torch.randint(1, MASK, (1, LENGTH), generator=torch.Generator().manual_seed(1))
    changed = tokens.clone()
    changed[0, -1] = MASK
    with torch.no_grad():
        before, after = (model(ids, attention_mask=torch.ones_like(ids)).logits[0] for ids in (tokens, changed))
    moved = (before - after).abs().amax(dim=-1)[:-1] > 1e-5  # per earlier position
    if family.attention == "bidirectional":
        expected = torch.ones(LENGTH - 1, dtype=torch.bool)
    elif family.attention == "block-causal":
        expected = torch.arange(LENGTH - 1) >= (LENGTH - 1) // BLOCK * BLOCK
    else:
        expected = torch.zeros(LENGTH - 1, dtype=torch.bool)
    assert moved.tolist() == expected.tolist()
    assert is_block_causal(model) == family.block_causal
    assert is_diffusion_family(model) == family.is_diffusion
    assert logits_are_shifted(model) == family.shifted_logits


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.lora_targets is not None], ids=lambda f: f.name)
def test_a_lora_preset_names_linears_of_the_tiny_model_and_never_its_head(family):
    from peft import LoraConfig, get_peft_model

    model_type = family.model_types[0]
    model = tiny_model(model_type)
    parameters = lora_target_parameters(model_type)
    adapted = get_peft_model(model, LoraConfig(r=2, target_modules=lora_target_modules(model_type),
                                               target_parameters=parameters or None))
    wrapped = [name for name, module in adapted.named_modules() if hasattr(module, "lora_A")]
    assert wrapped and not any("lm_head" in name or name.endswith("ff_out") and "blocks" not in name
                               or name.endswith("mlp.gate") for name in wrapped)
    adapted_parameters = {getattr(module, "parameter_name", None) for module in adapted.modules()}
    assert {name.rpartition(".")[2] for name in parameters} <= adapted_parameters


@pytest.mark.parametrize("embedded", ["embedded", "embedded-dream", "embedded-sdar"])
def test_a_trained_model_reads_its_logits_where_its_record_says(embedded):
    """On the embedded models (trained on digits), each answer token, masked alone in the clean prompt and answer,
    scores higher read from the position the record names (i - 1 for a shifted family, i otherwise) than from the
    other reading."""
    from dllm_ais.data import load_task_dataset
    from dllm_ais.loading import load_model, load_tokenizer

    tokenizer, model = load_tokenizer(embedded), load_model(embedded, torch.float32).eval()
    row = load_task_dataset("digits", split="train", size=1, seed=0)[0]
    prompt = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
    answer_ids = tokenizer(row["answer"], add_special_tokens=False).input_ids
    positions = torch.arange(len(prompt_ids), len(prompt_ids) + len(answer_ids))
    ids = torch.tensor([prompt_ids + answer_ids]).repeat(len(answer_ids), 1)
    ids[torch.arange(len(answer_ids)), positions] = model.config.mask_token_id  # copy k: answer token k masked
    targets = torch.tensor(answer_ids)
    scores = {}
    for shifted in (False, True):
        with torch.no_grad():
            logits = position_logits(model, ids, torch.ones_like(ids), shifted=shifted)
        chosen = logits[torch.arange(len(answer_ids)), positions].float().log_softmax(-1)
        scores[shifted] = chosen.gather(-1, targets[:, None]).mean().item()
    assert scores[logits_are_shifted(model)] > scores[not logits_are_shifted(model)], scores


def test_the_protocols_of_the_records_are_the_eval_protocols():
    assert set(EVAL_PROTOCOLS) == {"d1"} | {f.protocol for f in FAMILIES if f.protocol is not None}
    assert {f.eval_protocol for f in FAMILIES} <= set(EVAL_PROTOCOLS)
    assert all((f.protocol_blocks == "block_size") <= f.block_causal for f in FAMILIES)


def test_an_unknown_model_type_is_refused_in_one_line():
    assert find_family("gpt2") is None and not is_diffusion_family("gpt2") and not is_block_causal("gpt2")
    with pytest.raises(ValueError) as refused:
        family_of("gpt2")
    assert "'gpt2'" in str(refused.value) and "\n" not in str(refused.value)
    assert "families.py" in str(refused.value)
    with pytest.raises(ValueError, match="No LoRA target preset for model_type 'gpt2'") as refused:
        lora_target_modules("gpt2")
    assert "\n" not in str(refused.value) and lora_target_parameters("gpt2") == []
