"""`--dry_run`: validate a (GPU) recipe on any machine by running one GRPO step on a tiny stand-in model.

The stand-in keeps the recipe's policy family, precision, estimator, correction, loss and LoRA settings; only
sizes shrink (tiny model of the same architecture, 2 completions of 16 tokens, one step) and, when the task's
data lives on the Hub, the task's sample rows (same format) replace it.
"""

from __future__ import annotations

import dataclasses
import tempfile

import datasets
import torch

from dllm_ais.config import EMBEDDED_MODEL, GRPOConfig
from dllm_ais.correction import MIN_GROUPS_FOR_NOISE
from dllm_ais.data import examples_from_rows, load_task_dataset
from dllm_ais.loading import load_model_config, load_tokenizer
from dllm_ais.models.families import FAMILIES
from dllm_ais.policy import is_diffusion
from dllm_ais.tasks import get_task
from dllm_ais.trackers import missing_tracker_problems


def recipe_model_type(config: GRPOConfig) -> str | None:
    """The recipe model's model_type without downloading weights: from its config.json if reachable, else guessed
    from the model name (a family record's `name_hints`, the longest hint the name contains: "llada2" before
    "llada"); None when neither tells."""
    try:
        return load_model_config(config.model_name_or_path, config.trust_remote_code).model_type
    except (OSError, ValueError):
        name = config.model_name_or_path.lower()
        hints = [(len(hint), family.model_types[0]) for family in FAMILIES for hint in family.name_hints if hint in name]
        return max(hints)[1] if hints else None


def recipe_is_diffusion(config: GRPOConfig) -> bool:
    """The recipe's policy family, without downloading weights (`recipe_model_type`)."""
    return is_diffusion(config.policy, recipe_model_type(config) if config.policy == "auto" else None)


def stand_in_model(diffusion: bool, tokenizer, model_type: str | None = None, block_size: int = 4) -> torch.nn.Module:
    """A randomly initialised tiny model of the recipe's family over the embedded tokenizer's vocabulary: a Dream
    for model_type Dream, an SDAR of `block_size` for model_type sdar, a LLaDA2 MoE of `block_size` (4 experts in 2
    groups, 2 per token, a shared one, the first layer dense) for model_type llada2_moe, else a LLaDA for a diffusion
    recipe and a Qwen3 for an autoregressive one."""
    torch.manual_seed(0)
    vocab = len(tokenizer)
    if diffusion and model_type == "llada2_moe":
        from dllm_ais.models import LLaDA2MoeConfig, LLaDA2MoeModelLM

        return LLaDA2MoeModelLM(LLaDA2MoeConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_experts=4, num_shared_experts=1, num_experts_per_tok=2, n_group=2,
            topk_group=1, moe_intermediate_size=16, first_k_dense_replace=1, max_position_embeddings=4096,
            rope_theta=10000.0, block_size=block_size, mask_token_id=tokenizer.mask_token_id,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    if diffusion and model_type == "sdar":
        from dllm_ais.models import SDARConfig, SDARForCausalLM

        return SDARForCausalLM(SDARConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, max_window_layers=2,
            rope_theta=10000.0, block_size=block_size, mask_token_id=tokenizer.mask_token_id,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.eos_token_id))
    if diffusion and model_type == "Dream":
        from dllm_ais.models import DreamConfig, DreamModel

        return DreamModel(DreamConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, mask_token_id=tokenizer.mask_token_id,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.eos_token_id))
    if diffusion:
        from dllm_ais.models import LLaDAConfig, LLaDAModelLM

        return LLaDAModelLM(LLaDAConfig(
            d_model=64, n_heads=4, n_layers=2, mlp_hidden_size=128, vocab_size=vocab, embedding_size=vocab,
            max_sequence_length=4096, mask_token_id=tokenizer.mask_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id))
    from transformers import AutoModelForCausalLM, Qwen3Config

    return AutoModelForCausalLM.from_config(Qwen3Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id))


def dry_run_dataset(config: GRPOConfig) -> datasets.Dataset:
    task = get_task(config.task)
    if task.generate is not None or config.dataset_path:
        return load_task_dataset(config.task, "train", path=config.dataset_path, size=4, seed=config.seed,
                                 task_args=config.task_args)
    return examples_from_rows(datasets.Dataset.from_list(list(task.sample_rows)), task)


def run_dry_run(config: GRPOConfig) -> dict:
    """Run one step of the recipe on a stand-in and print what ran; returns the step's metrics."""
    with tempfile.TemporaryDirectory(prefix="dllm-ais-dry-run-") as scratch:
        step = run_one_step_on_stand_in(config, scratch)
    print(f"dry run OK: recipe valid ({config.model_name_or_path}, task={config.task}, "
          f"policy={'diffusion' if recipe_is_diffusion(config) else 'autoregressive'}, "
          f"rollout.precision={config.rollout.precision}, correction.method={config.correction.method}); one step on a tiny "
          f"stand-in: reward={step['reward']:.3f} alpha={step.get('ais/alpha', float('nan')):.3f} "
          f"loss={step['loss']:+.4f}")
    for problem in missing_tracker_problems(config.report_to):  # dry runs log to no tracker; a real run checks them
        print(f"note: a real run would stop here: {problem}")
    return step


def run_one_step_on_stand_in(config: GRPOConfig, output_dir: str) -> dict:
    """One GRPO step of `config`'s recipe on the embedded tiny model, writing into the scratch `output_dir`."""
    from dllm_ais.trainer import GRPOTrainer

    diffusion = recipe_is_diffusion(config)
    block = min(config.rollout.block_length, 8)
    small = dataclasses.replace(
        config, model_name_or_path=EMBEDDED_MODEL, policy="diffusion" if diffusion else "autoregressive",
        dtype="float32", num_generations=2, per_device_train_batch_size=2 * MIN_GROUPS_FOR_NOISE,
        gradient_accumulation_steps=1, num_iterations=1, max_steps=1, eval_size=0, eval_steps=0,
        rollout=dataclasses.replace(config.rollout, block_length=block, steps=block),
        max_completion_length=2 * block, max_prompt_length=4096, report_to=[], save_steps=0,
        dry_run=False, resume_from_checkpoint=None, overwrite_output_dir=False, lora_target_modules=None,
        output_dir=output_dir)
    tokenizer = load_tokenizer(EMBEDDED_MODEL)
    model = stand_in_model(diffusion, tokenizer, recipe_model_type(config), block_size=block)
    trainer = GRPOTrainer(small, model=model, tokenizer=tokenizer,
                          train_dataset=dry_run_dataset(config))
    return trainer.train().history[-1]
