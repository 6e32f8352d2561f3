"""The numerical work behind the `dllm_ais` harness model's requests (`dllm_ais.lm_eval_model`, whose docstring
states the protocols): LLaDA's Monte-Carlo log-likelihood estimate (`llada_mask_draw`, `diffusion_loglikelihood`),
the causal LM's teacher-forced scores (`causal_continuation_scores`), the samplers of d1's and SDAR's protocols,
and a completion's text.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import torch
from lm_eval.models.utils import postprocess_generated_text
from torch import Tensor, nn

from dllm_ais.config import GRPOConfig, with_d1_protocol
from dllm_ais.decoding_protocols import protocol_family, with_family_protocol
from dllm_ais.likelihood import (LogitsFn, MaskDraw, causal_position_ids, elbo_from_draws, masked_completion_logprobs,
                                 plain_logits, selective_log_softmax)
from dllm_ais.loading import SpecialTokens
from dllm_ais.models.families import ModelFamily
from dllm_ais.policy import diffusion_sampler_config
from dllm_ais.sampling.diffusion import DiffusionSamplerConfig
from dllm_ais.statistics import standard_error
from dllm_ais.validation import ConfigError


@dataclass(frozen=True)
class LikelihoodEstimate:
    """A Monte-Carlo estimate of log p(continuation | context): its value (the mean of `num_samples` per-copy values)
    and standard error s_b / √B over the B = num_samples / batch_size batch means (each an independent unbiased
    estimate; NaN for a single batch)."""

    value: float
    standard_error: float
    num_samples: int


def llada_mask_draw(gen_length: int, batch: int, generator: torch.Generator) -> MaskDraw:
    """One batch of LLaDA's evaluation forward process over a continuation of L = `gen_length` tokens.

    k ~ U{1, …, L}; copy i ∈ [0, b) masks n_i = ((round(k + i·L/b) − 1) mod L) + 1 tokens — stratified counts
    spread over 1..L — at the positions j with σ_i(j) < n_i, σ_i a uniform permutation; its rate is t_i = n_i / L.
    Draws from `generator`: randint for k, then one randperm(L) per copy (eval_llada.py's `_forward_process`, in its
    order).
    """
    start = torch.randint(1, gen_length + 1, (), generator=generator)
    counts = torch.round(torch.linspace(float(start), start + (batch - 1) * (gen_length / batch), steps=batch)).long()
    counts = (counts - 1) % gen_length + 1
    permutations = torch.stack([torch.randperm(gen_length, generator=generator) for _ in range(batch)])
    return MaskDraw(masked=permutations < counts.unsqueeze(1), rate=counts.float() / gen_length)


def check_monte_carlo_sizes(num_samples: int, batch_size: int) -> None:
    """Raise ConfigError unless the number of copies is a positive multiple of the Monte-Carlo batch."""
    if num_samples < 1 or batch_size < 1 or num_samples % batch_size:
        raise ConfigError(f"mc_num={num_samples} must be a positive multiple of mc_batch_size={batch_size} "
                          "(--model_args)")


@torch.no_grad()
def diffusion_loglikelihood(model: nn.Module, context: Tensor, continuation: Tensor, mask_token_id: int,
                            num_samples: int, batch_size: int, generator: torch.Generator,
                            logits_fn: LogitsFn = plain_logits) -> LikelihoodEstimate:
    """LLaDA's Monte-Carlo estimate of log p(continuation | context) for 1-D token tensors: the mean over
    `num_samples` copies of (1 / t) Σ_{masked j} log softmax(f(x̃)_j)[x_j], drawn `batch_size` at a time by
    `llada_mask_draw` (one forward per batch; the context is never masked), scored by `logits_fn`."""
    check_monte_carlo_sizes(num_samples, batch_size)
    sequence = torch.cat([context, continuation]).unsqueeze(0).expand(batch_size, -1)
    attention_mask = torch.ones_like(sequence)
    batch_means = []
    for _ in range(num_samples // batch_size):
        draw = llada_mask_draw(len(continuation), batch_size, generator)
        logprobs = masked_completion_logprobs(model, sequence, attention_mask, len(context), mask_token_id,
                                              draw.masked, logits_fn=logits_fn)
        batch_means.append(elbo_from_draws([logprobs], [draw]).mean())
    means = torch.stack(batch_means).cpu()
    return LikelihoodEstimate(means.mean().item(), standard_error(means), num_samples)


def left_padded(rows: list[list[int]], pad_token_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Token-id lists as one left-padded [B, max length] batch and its attention mask (1 on real tokens)."""
    width = max(map(len, rows))
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for index, row in enumerate(rows):
        input_ids[index, width - len(row):] = torch.tensor(row, dtype=torch.long)
        attention_mask[index, width - len(row):] = 1
    return input_ids.to(device), attention_mask.to(device)


@torch.no_grad()
def causal_continuation_scores(model: nn.Module, rows: list[list[int]], continuation_lengths: list[int],
                               pad_token_id: int) -> list[tuple[float, bool]]:
    """Per row x (a context followed by its last c tokens, the continuation): Σ_{j in the continuation}
    log softmax(f(x_<j))[x_j] and whether every x_j is the argmax, as the harness's `hf` model scores it: the rows
    without their last token run as one left-padded forward (position ids = cumsum(attention mask) − 1), its LM head
    on the last max(c) positions only."""
    device = next(model.parameters()).device
    input_ids, attention_mask = left_padded([row[:-1] for row in rows], pad_token_id, device)
    next_ids, _ = left_padded([row[1:] for row in rows], pad_token_id, device)
    scored = max(continuation_lengths)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=causal_position_ids(attention_mask),
                   use_cache=False, logits_to_keep=scored).logits
    targets = next_ids[:, -scored:]
    logprobs = selective_log_softmax(logits, targets)
    lengths = torch.tensor(continuation_lengths, device=device).unsqueeze(1)
    in_continuation = torch.arange(scored, device=device) >= scored - lengths
    totals = torch.where(in_continuation, logprobs, 0.0).sum(dim=1)
    greedy = ((logits.argmax(dim=-1) == targets) | ~in_continuation).all(dim=1)
    return list(zip(totals.tolist(), greedy.tolist()))


def protocol_sampler_config(protocol: GRPOConfig, tokens: SpecialTokens, temperature: float,
                            **settings: Any) -> DiffusionSamplerConfig:
    """The sampler a protocol's config decodes with at `temperature`, with the model's special tokens and any sampler
    `settings` that are not None (steps, remasking, cfg_scale, cache, threshold, factor, ...) replaced."""
    chosen = {key: value for key, value in settings.items() if value is not None}
    return dataclasses.replace(diffusion_sampler_config(protocol, tokens, temperature), **chosen)


def d1_sampler_config(gen_length: int, block_length: int, tokens: SpecialTokens, temperature: float,
                      **settings: Any) -> DiffusionSamplerConfig:
    """The sampler of d1's protocol at `gen_length` (`with_d1_protocol`: blocks of min(block_length, gen_length),
    gen_length / 2 steps, low-confidence remasking, no cache, no guidance), see `protocol_sampler_config`."""
    return protocol_sampler_config(with_d1_protocol(GRPOConfig(policy="diffusion"), gen_length, block_length), tokens,
                                   temperature, **settings)


def block_protocol_sampler_config(family: ModelFamily, gen_length: int, block_size: int, tokens: SpecialTokens,
                                  temperature: float, **settings: Any) -> DiffusionSamplerConfig:
    """The sampler of a block-causal `family`'s default protocol (its record's `eval_protocol`: blocks of the model's
    `block_size`, a step per block position, low_confidence_dynamic at 0.9 for SDAR, 0.95 for LLaDA2.x, the exact
    cache) at `gen_length`, see `protocol_sampler_config`."""
    decoding = with_family_protocol(GRPOConfig(policy="diffusion"), protocol_family(family.eval_protocol), gen_length,
                                    block_size)
    return protocol_sampler_config(decoding, tokens, temperature, **settings)


def completion_text(tokenizer, completion_ids: Tensor, completion_mask: Tensor, max_tokens: int,
                    until: list[str]) -> str:
    """The text of one completion: its tokens through the first EOS (`completion_mask`) and at most `max_tokens`,
    decoded without special tokens, cut before the first of the `until` strings."""
    tokens = completion_ids[completion_mask.bool()][:max_tokens]
    return postprocess_generated_text(tokenizer.decode(tokens, skip_special_tokens=True), until, None)


def grouped_by_kwargs(requests: list) -> dict[str, list[int]]:
    """Request indices grouped by their generation kwargs (one sampler per group)."""
    groups: dict[str, list[int]] = {}
    for index, request in enumerate(requests):
        groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(index)
    return groups


def batches(indices: list[int], size: int) -> list[list[int]]:
    return [indices[start:start + size] for start in range(0, len(indices), size)]
