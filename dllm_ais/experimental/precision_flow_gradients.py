"""Which gradient does the unified precision flow follow? Its LoRA gradient against the high-precision trainer's.

    python -m dllm_ais.experimental.precision_flow_gradients                    # the embedded LLaDA, four notches
    python -m dllm_ais.experimental.precision_flow_gradients --precisions fp8,mxfp4 --prompts 128

Completions of `--prompts` validation prompts are sampled (temperature 1) by the high-precision model with a LoRA on
every block linear (its B perturbed, so every adapter matrix has a gradient). For each notch, a copy of that model is
made to compute the engine's numerics (`engine.quantize_trainer_model_`: gradients straight through the quantizers),
and the gradient of the recipe estimator's log-likelihood of the completions with respect to the LoRA parameters is
compared with the high-precision model's, on the same estimator draw: their cosine and the ratio of their norms.
A cosine near 1 means the unified trainer climbs the policy's own gradient; far below 1, the straight-through
gradient of the quantized model points elsewhere.
"""

from __future__ import annotations

import argparse
import copy

import torch
from peft import LoraConfig, get_peft_model

from dllm_ais.bench.mismatch import validation_prompts
from dllm_ais.config import EMBEDDED_RECIPE, load_config
from dllm_ais.engine import RolloutEngine, quantize_trainer_model_
from dllm_ais.loading import load_model, load_tokenizer
from dllm_ais.policy import build_policy, lora_target_modules


def lora_gradient(policy, model, rollout, seed: int) -> torch.Tensor:
    """The gradient of Σ ℓ over the rollout's completion tokens (`policy.logprobs`, estimator draw `seed`) with
    respect to `model`'s trainable parameters, flattened."""
    model.zero_grad(set_to_none=True)
    (policy.logprobs(model, rollout, seed=seed) * rollout.completion_mask).sum().backward()
    return torch.cat([param.grad.flatten() for param in model.parameters() if param.requires_grad])


def gradient_agreement(high_precision: torch.Tensor, unified: torch.Tensor) -> tuple[float, float]:
    """(cosine, |unified| / |high precision|) of two gradients."""
    cosine = torch.nn.functional.cosine_similarity(high_precision, unified, dim=0).item()
    return cosine, (unified.norm() / high_precision.norm()).item()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dllm_ais.experimental.precision_flow_gradients",
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default=str(EMBEDDED_RECIPE))
    parser.add_argument("--precisions", default="fp8,int4,nvfp4,mxfp4")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    config = load_config(args.recipe, ["--output_dir=/tmp/unused"])
    tokenizer = load_tokenizer(config.model_name_or_path)
    base = load_model(config.model_name_or_path, torch.float32).eval()
    torch.manual_seed(args.seed)
    model = get_peft_model(base, LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha,
                                            target_modules=lora_target_modules(base.config.model_type)))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.01)
    policy = build_policy(config, base.config, tokenizer, temperature=1.0)
    input_ids, attention_mask = validation_prompts(config, tokenizer, args.prompts, args.seed)
    rollout = policy.sample(RolloutEngine(model, "bf16").model, input_ids, attention_mask,
                            torch.Generator().manual_seed(args.seed))
    high_precision = lora_gradient(policy, model, rollout, args.seed)
    print(f"{config.model_name_or_path}, {config.likelihood.estimator} estimator, LoRA r={config.lora_r}, "
          f"{args.prompts} prompts sampled in high precision, float32, CPU")
    for precision in args.precisions.split(","):
        unified = copy.deepcopy(model)
        quantize_trainer_model_(unified, precision)
        cosine, norm_ratio = gradient_agreement(high_precision, lora_gradient(policy, unified, rollout, args.seed))
        print(f"{precision:<18} cosine(unified, high precision) {cosine:.3f} | norm unified / high precision "
              f"{norm_ratio:.2f}", flush=True)


if __name__ == "__main__":
    main()
