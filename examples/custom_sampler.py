"""Train with a custom masked-diffusion sampler: a new remasking rule and a subclassed logit stage.

    python examples/custom_sampler.py                       # 4 steps on the embedded tiny LLaDA (digits task)
    python examples/custom_sampler.py --max_steps 30 --eval_size 256

- `margin_scores`, registered as the remasking rule "margin": commit first the positions where the model's top
  candidate leads its runner-up by the most probability.
- `TokenBiasSampler`: its `block_logits` adds a fixed bias to chosen vocabulary ids (here: the digits, which the
  digits task asks for). The likelihood estimators compute their logits through the sampler's `scoring_logits`, so
  the biased distribution is exactly what the trainer scores: with the bf16 engine the importance ratio stays 1.

`GRPOTrainer(config, sampler=...)` builds the sampler from the config's sampler settings (here through
`functools.partial`, for the bias); held-out validation still decodes with the config's exact decoder, and the
custom sampler's own greedy score is reported after training as `eval/rollout_sampler/*`.
"""

from __future__ import annotations

import argparse
import functools

import torch

from dllm_ais import GRPOTrainer
from dllm_ais.config import EMBEDDED_RECIPE, load_config
from dllm_ais.loading import load_tokenizer
from dllm_ais.sampling.diffusion import DiffusionSamplerConfig, MaskedDiffusionSampler, register_remasking_rule
from dllm_ais.trainer import TrainResult


def margin_scores(block_logits: torch.Tensor, candidates: torch.Tensor,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """score = p_(1) − p_(2): the lead of the most probable token over the second, under softmax(block_logits)."""
    top_two = block_logits.float().softmax(dim=-1).topk(2, dim=-1).values
    return top_two[..., 0] - top_two[..., 1]


register_remasking_rule("margin", margin_scores, replace=True)


class TokenBiasSampler(MaskedDiffusionSampler):
    """The LLaDA sampler with ``logits[..., v] += token_bias[v]`` for the given vocabulary ids, at every step (a
    logit stage: sampled, remasked and scored with the bias)."""

    def __init__(self, config: DiffusionSamplerConfig, token_bias: dict[int, float]):
        super().__init__(config)
        self.token_bias = token_bias

    def block_logits(self, *args, **kwargs) -> torch.Tensor:
        logits = super().block_logits(*args, **kwargs)
        bias = torch.zeros(logits.shape[-1], dtype=logits.dtype, device=logits.device)
        bias[list(self.token_bias)] = torch.tensor(list(self.token_bias.values()), dtype=logits.dtype,
                                                   device=logits.device)
        return logits + bias


def main(argv: list[str] | None = None) -> TrainResult:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max_steps", type=int, default=4)
    parser.add_argument("--eval_size", type=int, default=64)
    parser.add_argument("--per_device_train_batch_size", type=int, default=32)
    parser.add_argument("--digit_bias", type=float, default=0.5)
    parser.add_argument("--output_dir", default="outputs/custom-sampler")
    args = parser.parse_args(argv)
    config = load_config(EMBEDDED_RECIPE, {
        "remasking": "margin", "max_steps": args.max_steps, "eval_size": args.eval_size,
        "per_device_train_batch_size": args.per_device_train_batch_size, "output_dir": args.output_dir,
        "overwrite_output_dir": True})
    tokenizer = load_tokenizer(config.model_name_or_path)
    digits = tokenizer.convert_tokens_to_ids([str(digit) for digit in range(10)])
    sampler = functools.partial(TokenBiasSampler, token_bias=dict.fromkeys(digits, args.digit_bias))
    result = GRPOTrainer(config, tokenizer=tokenizer, sampler=sampler).train()
    print(f"trained {result.steps} steps with {TokenBiasSampler.__name__} and remasking=margin; outputs in "
          f"{result.output_dir}")
    return result


if __name__ == "__main__":
    main()
