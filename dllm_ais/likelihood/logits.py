"""Logit basics of every likelihood estimator: float32 log-probs of chosen tokens from logits, the sampling
distribution's temperature / top-k / top-p, entropies, the canvas and mask-id checks, and the seeded mask generator.

A canvas is `[left-padded prompt (P) | completion (L)]`, as in `Rollout`. Random masks come from a dedicated CPU
`torch.Generator` seeded by the caller (`mask_generator`), never the global RNG, so one seed gives the same masks on
every device and for every model: this is what makes ℓ_rollout, ℓ_old, ℓ_ref and ℓ_θ of one inner iteration differ
by the policies alone.

Memory: no function here holds a float32 log-softmax (or a float32 copy of the logits) over the whole vocabulary for
every position at once; `selective_log_softmax` works on `chunk_size` rows at a time.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers import TopKLogitsWarper, TopPLogitsWarper

from dllm_ais.models.families import is_block_causal, position_logits
from dllm_ais.models.sdar import block_diffusion_logits
from dllm_ais.rollout import padding_or_none


DEFAULT_CHUNK_ROWS = 512
"""Rows per float32 chunk in `selective_log_softmax`: 512 × 126,464 (LLaDA's vocabulary) × 4 B ≈ 259 MB."""

LogitsProcessor = Callable[[Tensor], Tensor]

LogitsFn = Callable[[nn.Module, Tensor, Tensor, "Tensor | int"], Tensor]
"""`logits_fn(model, input_ids [B, T], attention_mask [B, T], logits_to_keep) -> logits [B, K, V]`: how a diffusion
estimator turns a canvas into the logits it scores. `plain_logits` is the model's own; a sampler's
`MaskedDiffusionSampler.scoring_logits` adds the logit processing it samples with (e.g. guidance), so that an
estimator scores the distribution the sampler drew from. A block-causal family (SDAR) is scored by its training-mode
forward instead (`noisy_canvas_logits`), to which no logit processing applies."""


def plain_logits(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: Tensor | int) -> Tensor:
    """The model's logits predicting the kept positions (`dllm_ais.models.families.position_logits`: the forward's own
    positions, or for a shifted family such as Dream the positions before them)."""
    return position_logits(model, input_ids, attention_mask, logits_to_keep)


def noisy_canvas_logits(model: nn.Module, noisy: Tensor, completion: Tensor, attention_mask: Tensor,
                        logits_to_keep: Tensor | int, logits_fn: LogitsFn = plain_logits) -> Tensor:
    """The logits [B, K, V] a diffusion estimator scores at the kept positions of noisy canvases `noisy`
    [B, P + L] whose clean completions are `completion` [B, L].

    A family whose tokens see the whole canvas: `logits_fn(model, noisy, attention_mask, logits_to_keep)`. A
    block-causal family (SDAR: `is_block_causal`): its training-mode forward (`block_diffusion_logits`), each block
    of `noisy` against the clean blocks before it — those of `noisy` with the completion restored to `completion`
    (the prompt as the estimator gives it, in both copies) — as SDAR is trained and samples; a single forward of a
    canvas with masks in several blocks would condition each block on the noise of the blocks before it."""
    if not is_block_causal(model):
        return logits_fn(model, noisy, attention_mask, logits_to_keep)
    clean = torch.cat([noisy[:, :noisy.shape[1] - completion.shape[1]], completion], dim=1)
    # unpadded canvases share one [2T, 2T] mask rather than one per row
    return block_diffusion_logits(model, noisy, clean, padding_or_none(attention_mask), logits_to_keep)


def _rows_log_prob(rows: Tensor, targets: Tensor, process_logits: LogitsProcessor | None) -> Tensor:
    """log softmax(process(float32(rows)))[target] = s[target] − logsumexp(s) for each row of `rows` [n, V]."""
    scores = rows.float()
    if process_logits is not None:
        scores = process_logits(scores)
    return scores.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - scores.logsumexp(dim=-1)


def _rows_entropy(rows: Tensor, process_logits: LogitsProcessor | None) -> Tensor:
    """H = −Σ_v p_v log p_v of p = softmax(process(float32(rows))) for each row of `rows` [n, V] (detached; a token
    the processing filters out has p = 0 and adds nothing)."""
    with torch.no_grad():
        scores = rows.detach().float()
        if process_logits is not None:
            scores = process_logits(scores)
        return torch.special.entr(scores.softmax(dim=-1)).sum(dim=-1)


def selective_log_softmax(
    logits: Tensor,
    targets: Tensor,
    chunk_size: int = DEFAULT_CHUNK_ROWS,
    process_logits: LogitsProcessor | None = None,
    compute_entropy: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Float32 log-probabilities of `targets` under softmax(logits): ℓ = s[target] − logsumexp(s).

    `logits` [..., V] in any float dtype, `targets` [...] (long) → float32 [...]. The leading dims are
    flattened into N rows and processed `chunk_size` rows at a time, each chunk cast to float32 and,
    when given, passed through `process_logits` (a function [n, V] → [n, V], e.g. `shape_logits` with
    a temperature; it must act row by row) before the log-sum-exp.

    Peak extra memory: about two chunk_size × V float32 buffers (the chunk's float32 copy and the
    log-sum-exp's temporary) plus whatever `process_logits` allocates for it (top-p sorts a few more) —
    never the float32 [N, V] of the naive `log_softmax(logits.float()).gather(...)`, which needs two.
    Under autograd every chunk is activation-checkpointed: its float32 copy is freed after the forward
    and recomputed chunk by chunk in the backward, so the float32 peak stays one chunk; the gradient of
    `logits` itself (the logits' dtype, N × V) comes on top, as in any backward through the logits.

    With `compute_entropy`, returns (log-probs, entropies): the entropy [...] of each row's (processed) distribution,
    detached, computed chunk by chunk from the same logits (one more chunk-sized buffer, no extra forward).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of rows; got {chunk_size}")
    if targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"targets must have the logits' shape without the vocabulary dim, {tuple(logits.shape[:-1])}; "
            f"got {tuple(targets.shape)}"
        )
    vocab = logits.shape[-1]
    rows = logits.reshape(-1, vocab)
    row_targets = targets.reshape(-1)
    if rows.shape[0] == 0:  # still a node of the logits' graph: a backward reaches their forward on every process
        empty = rows.sum(dim=-1, dtype=torch.float32).reshape(targets.shape)
        return (empty, torch.zeros_like(empty)) if compute_entropy else empty
    recompute_in_backward = torch.is_grad_enabled() and logits.requires_grad
    pieces, entropies = [], []
    for chunk, chunk_targets in zip(rows.split(chunk_size), row_targets.split(chunk_size)):
        if recompute_in_backward:
            pieces.append(checkpoint(_rows_log_prob, chunk, chunk_targets, process_logits, use_reentrant=False))
        else:
            pieces.append(_rows_log_prob(chunk, chunk_targets, process_logits))
        if compute_entropy:
            entropies.append(_rows_entropy(chunk, process_logits))
    logprobs = torch.cat(pieces).view(targets.shape)
    return (logprobs, torch.cat(entropies).view(targets.shape)) if compute_entropy else logprobs


def is_plain_int(value: object) -> bool:
    """True for Python ints other than bools (which `isinstance(value, int)` also accepts)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_sampling_parameters(temperature: float, top_k: int, top_p: float) -> None:
    """Raise ValueError unless τ ≥ 0, top_k is an int ≥ 0 (0 = off) and 0 < top_p ≤ 1 (1 = off)."""
    if not temperature >= 0:
        raise ValueError(f"temperature must be ≥ 0 (0 = greedy); got {temperature}")
    if not is_plain_int(top_k) or top_k < 0:
        raise ValueError(f"top_k must be an integer ≥ 0 (0 disables top-k); got {top_k!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1 disables top-p); got {top_p}")


def shape_logits(logits: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """The sampling distribution's logits: s = logits / τ, then top-k, then top-p, over the last dim.

    τ > 0 divides by τ; τ == 0 (greedy) leaves the logits unchanged, so log softmax(s) is the plain
    model distribution. Top-k and top-p are transformers' own `TopKLogitsWarper` / `TopPLogitsWarper`
    (same order as `generate`: temperature, top-k, top-p) and set filtered tokens to −inf. Samplers and
    the trainer-side log-probs both call this, so both see exactly the same distribution. A token that
    the filters remove (e.g. sampled by a slightly different rollout engine) gets log-prob −inf; the
    correction stage clamps log-ratios, so such tokens get weight e^−20.

    Works on any [..., V] tensor in the dtype given (callers pass float32); never modifies `logits`.
    """
    check_sampling_parameters(temperature, top_k, top_p)
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    if top_k == 0 and top_p == 1.0:
        return logits
    rows = logits.reshape(-1, logits.shape[-1])
    if top_k > 0:
        rows = TopKLogitsWarper(top_k)(None, rows)
    if top_p < 1.0:
        rows = TopPLogitsWarper(top_p)(None, rows)
    return rows.view(logits.shape)


def mask_generator(seed: int) -> torch.Generator:
    """A fresh CPU generator seeded with `seed`: the source of every random mask in this module."""
    if not is_plain_int(seed):
        raise ValueError(
            f"seed must be an int (one per inner iteration, shared by ℓ_ro/ℓ_old/ℓ_ref/ℓ_θ); got {seed!r}"
        )
    return torch.Generator(device="cpu").manual_seed(seed)


def _check_canvas(sequences: Tensor, attention_mask: Tensor | None, prompt_length: int) -> Tensor:
    """Validate a [B, P + L] canvas with 1 ≤ P < P + L; return its attention mask (all ones if None)."""
    if sequences.dim() != 2:
        raise ValueError(
            f"sequences must be [batch, prompt + completion] token ids; got shape {tuple(sequences.shape)}"
        )
    if not 0 < prompt_length < sequences.shape[1]:
        raise ValueError(
            f"prompt_length must be between 1 and the sequence length − 1 = {sequences.shape[1] - 1} "
            f"(at least one prompt and one completion position); got {prompt_length}"
        )
    if attention_mask is None:
        return torch.ones_like(sequences)
    if attention_mask.shape != sequences.shape:
        raise ValueError(
            f"attention_mask must have the sequences' shape {tuple(sequences.shape)}; got {tuple(attention_mask.shape)}"
        )
    return attention_mask


def _check_mask_token(model: nn.Module, mask_token_id: int) -> None:
    """Raise ValueError unless `mask_token_id` is an int inside the model's embedding table."""
    if not is_plain_int(mask_token_id):
        raise ValueError(
            "mask_token_id must be the model's mask token id (LLaDA-8B: 126336, config.mask_token_id); "
            f"got {mask_token_id!r}"
        )
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    table_size = getattr(embeddings, "num_embeddings", None)
    if mask_token_id < 0 or (table_size is not None and mask_token_id >= table_size):
        raise ValueError(
            f"mask_token_id={mask_token_id} is outside the model's embedding table of {table_size} tokens; "
            "pass the model's own mask token id (config.mask_token_id)."
        )


def _scatter_to_positions(mask: Tensor, values: Tensor) -> Tensor:
    """A float32 tensor shaped like `mask`, holding `values` (in row-major order) where mask is True, 0 elsewhere."""
    return torch.zeros(mask.shape, dtype=torch.float32, device=values.device).masked_scatter(mask, values)
