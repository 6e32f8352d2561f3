"""Likelihood stage: per-token log-probs of sampled completions under a policy.

Formulas: docs/algorithms.md, section "Likelihood estimators".

Every estimator is a pure function of the model and tensors; the model is an argument and nothing
here switches grad on or off, so the same call gives ℓ_rollout / ℓ_old / ℓ_ref under `torch.no_grad()`
and ℓ_θ under grad. Canvases are `[left-padded prompt (P) | completion (L)]`, as in `Rollout`.

Masked-diffusion policies (LLaDA):
- `one_step_logprobs`   the diffu-GRPO one-step surrogate (default estimator, one forward).
- `trajectory_logprobs` the exact log-prob of the recorded denoising trajectory (one forward per step).
- `step_merge_logprobs` d2's StepMerge: the trajectory's steps merged into N segments (one forward per segment).
- `mc_elbo`             LLaDA's Monte-Carlo lower bound on log p(completion | prompt), optionally with coupled
                        (complementary) masks; the `elbo` estimator.
- `eubo_from_draws`, `sandwiched_log_likelihood`  SPG's upper bound and its sandwich with the ELBO by the sign of
                        the advantage, over LLaDA's or SPG's block-wise masks; the `spg` estimator.
The last two are sequence-level: `DiffusionEstimator` says how their one number per completion meets the
token-level stages.
Causal LMs:
- `causal_logprobs`     teacher-forced log-probs under the sampling distribution the AR sampler used.

Random masks come from a dedicated CPU `torch.Generator` seeded by the caller, never the global RNG,
so one seed gives the same masks on every device and for every model: this is what makes ℓ_rollout,
ℓ_old, ℓ_ref and ℓ_θ of one inner iteration differ by the policies alone.

The trajectory-type estimators (`choices.TRAJECTORY_ESTIMATORS`) also come forward by forward (`trajectory_pieces`,
`step_merge_pieces`): each `LogprobPiece` scores the tokens of one forward, so the optimisation pass can backpropagate
it before the next forward runs and the peak memory does not grow with the number of steps.

Memory: no function here holds a float32 log-softmax (or a float32 copy of the logits) over the whole
vocabulary for every position at once; `selective_log_softmax` works on `chunk_size` rows at a time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from itertools import groupby
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers import TopKLogitsWarper, TopPLogitsWarper

if TYPE_CHECKING:  # a runtime import would cycle: the samplers import this module
    from dllm_ais.sampling.rollout import Rollout

__all__ = [
    "DEFAULT_CHUNK_ROWS",
    "DIFFUSION_ESTIMATORS",
    "BlockSubset",
    "BoundSettings",
    "DiffusionEstimator",
    "EstimatorSettings",
    "LogitsFn",
    "MaskDraw",
    "block_mask_draws",
    "LogprobPiece",
    "causal_logprobs",
    "causal_position_ids",
    "check_sampling_parameters",
    "elbo_from_draws",
    "eubo_from_draws",
    "is_plain_int",
    "mask_generator",
    "masked_completion_logprobs",
    "mc_elbo",
    "merges_no_steps",
    "one_step_logprobs",
    "one_step_masked_input",
    "plain_logits",
    "random_mask_draws",
    "require_causal_lm",
    "sandwiched_log_likelihood",
    "scored_positions",
    "selective_log_softmax",
    "shape_logits",
    "spread_over_tokens",
    "step_merge_logprobs",
    "step_merge_pieces",
    "step_merge_segments",
    "sum_pieces",
    "trajectory_logprobs",
    "trajectory_pieces",
    "whole_piece",
]

DEFAULT_CHUNK_ROWS = 512
"""Rows per float32 chunk in `selective_log_softmax`: 512 × 126,464 (LLaDA's vocabulary) × 4 B ≈ 259 MB."""

LogitsProcessor = Callable[[Tensor], Tensor]
LogitsFn = Callable[[nn.Module, Tensor, Tensor, "Tensor | int"], Tensor]
"""`logits_fn(model, input_ids [B, T], attention_mask [B, T], logits_to_keep) -> logits [B, K, V]`: how a diffusion
estimator turns a canvas into the logits it scores. `plain_logits` is the model's own; a sampler's
`MaskedDiffusionSampler.scoring_logits` adds the logit processing it samples with (e.g. guidance), so that an
estimator scores the distribution the sampler drew from."""


def plain_logits(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: Tensor | int) -> Tensor:
    """The model's logits at the kept positions: `model(input_ids, attention_mask, logits_to_keep).logits`."""
    return model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=logits_to_keep).logits


# ---------------------------------------------------------------------------------------------
# Numerical cores
# ---------------------------------------------------------------------------------------------
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
    if rows.shape[0] == 0:
        empty = torch.zeros(targets.shape, dtype=torch.float32, device=logits.device)
        return (empty, empty.clone()) if compute_entropy else empty
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


# ---------------------------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------------------------
def mask_generator(seed: int) -> torch.Generator:
    """A fresh CPU generator seeded with `seed`: the source of every random mask in this module."""
    if not is_plain_int(seed):
        raise ValueError(
            f"seed must be an int (one per inner iteration, shared by ℓ_ro/ℓ_old/ℓ_ref/ℓ_θ); got {seed!r}"
        )
    return torch.Generator(device="cpu").manual_seed(seed)


def causal_position_ids(attention_mask: Tensor) -> Tensor:
    """position_ids = cumsum(attention_mask) − 1, clamped at 0: left padding does not shift positions."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def require_causal_lm(model: nn.Module, caller: str) -> None:
    """Raise ValueError if `model` is a masked-diffusion (LLaDA) or encoder-decoder model."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) == "llada":
        raise ValueError(
            f"{caller} needs a causal LM, but this is a LLaDA masked-diffusion model (bidirectional, no KV cache). "
            "Use MaskedDiffusionSampler with one_step_logprobs / trajectory_logprobs instead."
        )
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"{caller} supports decoder-only causal LMs; got an encoder-decoder model ({config.model_type})."
        )


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


# ---------------------------------------------------------------------------------------------
# Masked-diffusion estimators
# ---------------------------------------------------------------------------------------------
def one_step_masked_input(
    sequences: Tensor,
    attention_mask: Tensor | None,
    prompt_length: int,
    mask_token_id: int,
    seed: int,
    p_mask_prompt: float = 0.15,
) -> Tensor:
    """The diffu-GRPO input canvas: every completion token → mask; each real prompt token → mask w.p. p.

    The prompt mask is `torch.rand((B, P), generator=mask_generator(seed)) < p_mask_prompt`, drawn on
    the CPU and then moved, restricted to real tokens (attention_mask == 1): padding stays as it is.
    Returns a new [B, P + L] long tensor; `sequences` is not modified.
    """
    attention_mask = _check_canvas(sequences, attention_mask, prompt_length)
    if not 0 <= p_mask_prompt <= 1:
        raise ValueError(f"p_mask_prompt must be a probability in [0, 1] (d1 default 0.15); got {p_mask_prompt}")
    batch = sequences.shape[0]
    draws = torch.rand((batch, prompt_length), generator=mask_generator(seed)).to(sequences.device)
    masked_prompt = (draws < p_mask_prompt) & attention_mask[:, :prompt_length].bool()
    prompt = sequences[:, :prompt_length].masked_fill(masked_prompt, mask_token_id)
    completion = torch.full_like(sequences[:, prompt_length:], mask_token_id)
    return torch.cat([prompt, completion], dim=1)


def one_step_logprobs(
    model: nn.Module,
    sequences: Tensor,
    attention_mask: Tensor | None,
    prompt_length: int,
    mask_token_id: int,
    seed: int,
    p_mask_prompt: float = 0.15,
    chunk_size: int = DEFAULT_CHUNK_ROWS,
    compute_entropy: bool = False,
    logits_fn: LogitsFn = plain_logits,
) -> Tensor | tuple[Tensor, Tensor]:
    """diffu-GRPO one-step surrogate: ℓ(o^k) = log softmax(f(x̃)_{P+k})[o^k], one forward for all k.

    x̃ = `one_step_masked_input(...)` (all completion tokens masked, each real prompt token masked with
    probability p_mask_prompt, drawn from a generator seeded with `seed`); plain softmax, no temperature
    (as d1). Reuse the same `seed` for ℓ_rollout, ℓ_old, ℓ_ref and ℓ_θ of one inner iteration.
    Returns [B, L] float32 for every completion position (apply the completion mask downstream); with
    `compute_entropy`, also the entropy [B, L] of the distribution scored at each position (from the same logits).
    """
    _check_mask_token(model, mask_token_id)
    attention_mask = _check_canvas(sequences, attention_mask, prompt_length)
    noisy = one_step_masked_input(sequences, attention_mask, prompt_length, mask_token_id, seed, p_mask_prompt)
    gen_length = sequences.shape[1] - prompt_length
    logits = logits_fn(model, noisy, attention_mask, gen_length)
    return selective_log_softmax(logits, sequences[:, prompt_length:], chunk_size, compute_entropy=compute_entropy)


@dataclass(frozen=True)
class LogprobPiece:
    """What one forward of a piecewise estimator scores: `positions` [B, L] bool, the completion tokens it scores;
    `logprobs` [B, L] float32, their log-probs there and 0 elsewhere; `entropy` [B, L] (detached, 0 elsewhere) when
    asked for. An estimator's log-probs are the sum of its pieces, and every completion token is in exactly one."""

    positions: Tensor
    logprobs: Tensor
    entropy: Tensor | None = None


def whole_piece(scored: Tensor | tuple[Tensor, Tensor], compute_entropy: bool) -> LogprobPiece:
    """One piece covering every completion position, from an estimator's output (log-probs, or with
    `compute_entropy` the pair (log-probs, entropies))."""
    logprobs, entropy = scored if compute_entropy else (scored, None)
    return LogprobPiece(torch.ones_like(logprobs, dtype=torch.bool), logprobs, entropy)


def sum_pieces(pieces: Iterable[LogprobPiece], compute_entropy: bool) -> Tensor | tuple[Tensor, Tensor]:
    """The log-probs [B, L] (and with `compute_entropy` the entropies) the pieces add up to."""
    logprobs = entropy = 0
    for piece in pieces:
        logprobs = logprobs + piece.logprobs
        if compute_entropy:
            entropy = entropy + piece.entropy
    return (logprobs, entropy) if compute_entropy else logprobs


def _check_commit_steps(rollout: Rollout) -> None:
    """Raise ValueError unless `rollout.commit_step` is [B, L] and names the step of every completion token."""
    commit_step = rollout.commit_step
    if commit_step.shape != rollout.completion_ids.shape:
        raise ValueError(
            f"rollout.commit_step must be [B, L] = {tuple(rollout.completion_ids.shape)}; "
            f"got {tuple(commit_step.shape)}"
        )
    if bool((commit_step < 0).any()):
        raise ValueError(
            "rollout.commit_step has negative entries (positions never committed); the trajectory-type estimators "
            "need the step of every completion token — use a rollout from a sampler that records it."
        )


def _check_staged_scoring(model: nn.Module, rollout: Rollout, mask_token_id: int, temperature: float,
                          stages_per_forward: int, name: str) -> None:
    """The argument checks of the trajectory-type estimators (`name`: what their stages_per_forward is called),
    raised before any forward."""
    _check_mask_token(model, mask_token_id)
    check_sampling_parameters(temperature, top_k=0, top_p=1.0)
    if not is_plain_int(stages_per_forward) or stages_per_forward < 1:
        raise ValueError(f"{name} must be a positive int; got {stages_per_forward!r}")
    _check_commit_steps(rollout)
    _check_canvas(rollout.sequences, rollout.attention_mask, rollout.prompt_length)


def _staged_pieces(model: nn.Module, rollout: Rollout, stage: Tensor, mask_token_id: int, temperature: float,
                   stages_per_forward: int, chunk_size: int, compute_entropy: bool,
                   logits_fn: LogitsFn, positions: Tensor | None = None) -> Iterator[LogprobPiece]:
    """The shared core of the trajectory-type estimators: the completion scored stage by stage.

    `stage` [B, L] ≥ 0 says at which stage each completion token is scored, monotone in its commit step within a
    row. For each distinct stage s the canvas is `rollout.sequences` with every completion position of stage ≥ s
    reset to the mask id, and the tokens of stage s get ℓ = log softmax(f(canvas_s) / τ)[token] (τ = 0: plain
    softmax). One piece per forward, `stages_per_forward` canvases stacked along the batch; each forward computes
    logits only at the columns its stages score. Lazy: a forward runs when its piece is asked for. `positions`
    [B, L] bool (None: all) restricts the scoring to those tokens: a stage none of them is in takes no forward.
    """
    completion = rollout.completion_ids
    attention_mask = _check_canvas(rollout.sequences, rollout.attention_mask, rollout.prompt_length)
    scale = partial(shape_logits, temperature=temperature)
    batch = completion.shape[0]
    wanted = torch.ones_like(completion, dtype=torch.bool) if positions is None else positions.bool()
    for stages in torch.unique(stage[wanted]).split(stages_per_forward):
        stage_index = stages.view(-1, 1, 1)  # [S, 1, 1]
        hidden = stage.unsqueeze(0) >= stage_index  # [S, B, L]: still masked at the stage's canvas
        scored = (stage.unsqueeze(0) == stage_index) & wanted  # [S, B, L]: scored at this stage
        columns = scored.any(dim=1).any(dim=0).nonzero().flatten()  # [C] the positions these stages score
        canvases = torch.cat(
            [rollout.prompt_ids.expand(len(stages), -1, -1), torch.where(hidden, mask_token_id, completion)], dim=2
        )
        logits = logits_fn(model, canvases.flatten(0, 1), attention_mask.repeat(len(stages), 1),
                           columns + rollout.prompt_length).unflatten(0, (len(stages), batch))  # [S, B, C, V]
        kept = scored[..., columns]
        targets = completion[:, columns].expand(len(stages), -1, -1)
        values = selective_log_softmax(logits[kept], targets[kept], chunk_size, process_logits=scale,
                                       compute_entropy=compute_entropy)
        logprobs, entropy = values if compute_entropy else (values, None)
        yield LogprobPiece(
            scored.any(dim=0),
            _scatter_to_positions(scored, logprobs).sum(dim=0),
            None if entropy is None else _scatter_to_positions(scored, entropy).sum(dim=0),
        )


def trajectory_pieces(
    model: nn.Module,
    rollout: Rollout,
    mask_token_id: int,
    temperature: float,
    steps_per_forward: int = 1,
    chunk_size: int = DEFAULT_CHUNK_ROWS,
    compute_entropy: bool = False,
    logits_fn: LogitsFn = plain_logits,
    positions: Tensor | None = None,
) -> Iterator[LogprobPiece]:
    """`trajectory_logprobs` forward by forward: one `LogprobPiece` per forward (the tokens committed at its steps),
    computed when asked for, so that a caller can backpropagate each piece before the next forward runs; only the
    tokens at `positions` [B, L] (None: all), and only the steps that commit one of them. Arguments are checked at
    the call, before any forward."""
    _check_staged_scoring(model, rollout, mask_token_id, temperature, steps_per_forward, "steps_per_forward")
    return _staged_pieces(model, rollout, rollout.commit_step, mask_token_id, temperature, steps_per_forward,
                          chunk_size, compute_entropy, logits_fn, positions)


def trajectory_logprobs(
    model: nn.Module,
    rollout: Rollout,
    mask_token_id: int,
    temperature: float,
    steps_per_forward: int = 1,
    chunk_size: int = DEFAULT_CHUNK_ROWS,
    compute_entropy: bool = False,
    logits_fn: LogitsFn = plain_logits,
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact log-prob of the recorded denoising trajectory, token by token: [B, L] float32.

    For each distinct step t of `rollout.commit_step`, the canvas before t is `rollout.sequences` with
    every completion position whose commit_step ≥ t reset to the mask id; the tokens committed at t get
    ℓ = log softmax(f(canvas_t) / τ)[token] at their positions (τ = 0: plain softmax) — the quantity a
    masked-diffusion sampler records in `rollout.step_logprobs`, which is therefore this estimator's
    rollout-side value. Samplers that alter the logits further (classifier-free guidance, EOS
    suppression) record their altered distribution; this replay scores what `logits_fn` returns: the
    plain model by default, the sampler's processing with its `MaskedDiffusionSampler.scoring_logits`.

    Cost: one forward per distinct step, `steps_per_forward` canvases stacked along the batch per
    forward (memory grows linearly with it; the result does not depend on it). Each forward computes
    logits only at the completion positions committed at its steps (one position per step in
    autoregressive order), not over the whole completion. Under grad, every forward stays in the graph
    until the backward; `trajectory_pieces` hands them out one at a time instead.

    With `compute_entropy`, also returns the entropy [B, L] of the distribution each token was scored under (at the
    step that committed it), from the same logits.
    """
    return sum_pieces(trajectory_pieces(model, rollout, mask_token_id, temperature, steps_per_forward, chunk_size,
                                        compute_entropy, logits_fn), compute_entropy)


DecoderLogitsFn = Callable[[nn.Module, "Rollout", "Tensor | None"], Iterable[tuple[slice, Tensor, Tensor]]]
"""`decoder_logits(model, rollout, positions)` yields, step by step and block by block, ``(block, committed [B, Lb],
logits [B, Lb, V])``: the logits the rollout's decoder drew the block's tokens committed at that step from,
recomputed by `model` (`MaskedDiffusionSampler.decoder_logits`: its block cache included), for the blocks holding
one of `positions` [B, L] (None: every block)."""


def decoder_trajectory_pieces(
    model: nn.Module,
    rollout: Rollout,
    decoder_logits: DecoderLogitsFn,
    temperature: float,
    chunk_size: int = DEFAULT_CHUNK_ROWS,
    compute_entropy: bool = False,
    positions: Tensor | None = None,
) -> Iterator[LogprobPiece]:
    """The trajectory estimator scored with the rollout decoder's own logits, one `LogprobPiece` per block (per block
    holding one of `positions` [B, L], whose tokens alone it scores; None: all).

    Where `trajectory_pieces` scores each step's canvas with a full forward (the exact model), this scores each
    committed token by ℓ = log softmax(f_dec(s_t) / τ)[token], f_dec the decoder's logits at the step that
    committed it — with a block KV cache, attending to the keys/values of the block's last refresh, as sampling did.
    On the engine this is exactly what the sampler recorded (`Rollout.step_logprobs`), so the ratio against the
    trainer's value sees the precision alone, and the policy being trained is the cached decoder itself. One piece
    per block: a block's steps share the graph of its cache.
    """
    check_sampling_parameters(temperature, top_k=0, top_p=1.0)
    _check_commit_steps(rollout)
    scale = partial(shape_logits, temperature=temperature)
    completion = rollout.completion_ids
    wanted = torch.ones_like(completion, dtype=torch.bool) if positions is None else positions.bool()
    for _, steps in groupby(decoder_logits(model, rollout, positions), key=lambda step: step[0].start):
        logprobs = entropy = 0
        piece_positions = torch.zeros_like(completion, dtype=torch.bool)
        for block, step_committed, logits in steps:
            committed = step_committed & wanted[:, block]
            values = selective_log_softmax(logits[committed], completion[:, block][committed], chunk_size,
                                           process_logits=scale, compute_entropy=compute_entropy)
            step_logprobs, step_entropy = values if compute_entropy else (values, None)
            placed = torch.zeros_like(completion, dtype=torch.bool)
            placed[:, block] = committed
            piece_positions |= placed
            logprobs = logprobs + _scatter_to_positions(placed, step_logprobs)
            if compute_entropy:
                entropy = entropy + _scatter_to_positions(placed, step_entropy)
        yield LogprobPiece(piece_positions, logprobs, entropy if compute_entropy else None)


def _row_step_ranks(commit_step: Tensor) -> tuple[Tensor, Tensor]:
    """(rank [B, L], steps [B]): each token's commit step numbered among its row's distinct steps (0, 1, ...), and
    the number of distinct steps of each row (parallel decoding lets rows skip global step indices)."""
    present = torch.zeros(commit_step.shape[0], int(commit_step.max()) + 1, dtype=torch.long,
                          device=commit_step.device).scatter_(1, commit_step, 1)
    return (present.cumsum(dim=1) - 1).gather(1, commit_step), present.sum(dim=1)


def step_merge_segments(commit_step: Tensor, num_segments: int) -> Tensor:
    """The segment [B, L] of each completion token when each row's T denoising steps are merged into N contiguous
    segments of (nearly) equal length: the token committed at the row's r-th distinct step (r = 0 … T − 1) is in
    segment ⌊r · N / T⌋, so a segment spans ⌊T/N⌋ or ⌈T/N⌉ steps (exactly T/N when N divides T) and N ≥ T leaves
    every step a segment of its own."""
    if not is_plain_int(num_segments) or num_segments < 1:
        raise ValueError(f"the number of segments must be an int >= 1; got {num_segments!r}")
    rank, steps = _row_step_ranks(commit_step)
    return rank * num_segments // steps.unsqueeze(1)


def merges_no_steps(commit_step: Tensor, num_segments: int) -> bool:
    """Whether N = `num_segments` segments leave every step of every row a segment of its own (N ≥ each row's
    step count): step_merge is then the trajectory estimator exactly."""
    return bool((_row_step_ranks(commit_step)[1] <= num_segments).all())


def step_merge_pieces(
    model: nn.Module,
    rollout: Rollout,
    mask_token_id: int,
    temperature: float,
    num_segments: int,
    segments_per_forward: int = 1,
    chunk_size: int = DEFAULT_CHUNK_ROWS,
    compute_entropy: bool = False,
    logits_fn: LogitsFn = plain_logits,
    positions: Tensor | None = None,
) -> Iterator[LogprobPiece]:
    """`step_merge_logprobs` forward by forward: one `LogprobPiece` per forward (the tokens committed inside its
    segments), computed when asked for; only the tokens at `positions` [B, L] (None: all), and only the segments
    holding one of them. Arguments are checked at the call, before any forward."""
    _check_staged_scoring(model, rollout, mask_token_id, temperature, segments_per_forward,
                          "segments_per_forward")
    segments = step_merge_segments(rollout.commit_step, num_segments)
    return _staged_pieces(model, rollout, segments, mask_token_id, temperature, segments_per_forward, chunk_size,
                          compute_entropy, logits_fn, positions)


def step_merge_logprobs(
    model: nn.Module,
    rollout: Rollout,
    mask_token_id: int,
    temperature: float,
    num_segments: int,
    segments_per_forward: int = 1,
    chunk_size: int = DEFAULT_CHUNK_ROWS,
    compute_entropy: bool = False,
    logits_fn: LogitsFn = plain_logits,
) -> Tensor | tuple[Tensor, Tensor]:
    """d2's StepMerge: the recorded trajectory's denoising steps merged into N segments, one forward each: [B, L].

    Each row's T steps are split into N contiguous segments of about T/N steps (`step_merge_segments`). Segment n,
    starting at step t_n, is scored at the canvas x_{t_n} of its first step: `rollout.sequences` with every
    completion token committed at or after t_n masked. Each token o^k committed inside segment n gets
        ℓ(o^k) = log softmax(f(x_{t_n}) / τ)_{P+k}[o^k]   (τ = 0: plain softmax),
    i.e. the tokens a segment commits are scored as if committed together, independently, at its first step.
    N ≥ T is the exact trajectory log-prob (`trajectory_logprobs`; the sampler's `step_logprobs`); N = 1 scores
    every completion token at the fully masked completion: d1's one-step surrogate with an unmasked prompt. Cost:
    N forwards whatever T (`segments_per_forward` of them stacked along the batch), against T for the trajectory.

    Where we differ from d2 (arXiv 2509.21474): we split each row's own distinct steps (under parallel decoding
    rows take different steps); a T that N does not divide gives segments of ⌊T/N⌋ and ⌈T/N⌉ steps; and we score
    softmax(f / τ), the distribution the sampler drew from (as the trajectory estimator does), so that N ≥ T is
    exactly the trajectory estimator and the sampler's record.

    With `compute_entropy`, also returns the entropy [B, L] of the distribution each token was scored under.
    """
    return sum_pieces(step_merge_pieces(model, rollout, mask_token_id, temperature, num_segments,
                                        segments_per_forward, chunk_size, compute_entropy, logits_fn), compute_entropy)


# ---------------------------------------------------------------------------------------------
# Sequence-level bounds: Monte-Carlo ELBO (LLaDA, coupled masks) and SPG's sandwich (ELBO / EUBO)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MaskDraw:
    """One draw of the forward (masking) process over the completion: `masked` [B, L] bool, the completion
    positions replaced by the mask token, and `rate` [B] float32, the mask rate t whose 1/t weighs the draw."""

    masked: Tensor
    rate: Tensor


def random_mask_draws(batch: int, gen_length: int, num_samples: int, generator: torch.Generator,
                      coupled: bool = False) -> list[MaskDraw]:
    """LLaDA's forward process, `num_samples` times: t = 1 − rand(B) ∈ (0, 1], then u = rand(B, L) and position k
    masked iff u_k < t, the position with the smallest u always (so at least one is).

    `coupled` (coupled-GRPO's complementary masks): each draw is followed by its complement, the positions it left
    clean, at rate 1 − t — every position is masked exactly once per pair, and the complement of a draw at rate t is
    itself (up to the forced position) a draw at rate 1 − t ~ U[0, 1): 2 · num_samples draws, antithetic in t.
    """
    draws = []
    for _ in range(num_samples):
        rate = 1.0 - torch.rand(batch, generator=generator)
        uniform = torch.rand((batch, gen_length), generator=generator)
        masked = (uniform < rate.unsqueeze(1)) | (uniform == uniform.min(dim=1, keepdim=True).values)
        draws.append(MaskDraw(masked, rate))
        if coupled:
            draws.append(MaskDraw(~masked, 1.0 - rate))
    return draws


def block_mask_draws(completion_mask: Tensor, block_length: int, num_samples: int,
                     generator: torch.Generator) -> list[MaskDraw]:
    """SPG's block-wise masking, `num_samples` times, on [B, L] completions split into blocks of `block_length`.

    Per draw and sequence: a block b uniformly among the blocks holding a valid token (`completion_mask`); the blocks
    before b stay clean, the blocks after b are masked whole; in b, k ~ U{1, …, v_b} of its v_b valid positions are
    masked (chosen uniformly) and so is its padding. The rate is SPG's empirical one, t̂ = (masked valid positions) /
    (valid positions), 1 for a sequence without valid tokens. Draws come from `generator`: rand(B) for b, rand(B)
    for k, rand(B, L) for the positions.
    """
    if not is_plain_int(block_length) or block_length < 1 or completion_mask.shape[1] % block_length:
        raise ValueError(f"block_length must be a positive int dividing the completion length "
                         f"{completion_mask.shape[1]} (the sampler's block_length); got {block_length!r}")
    valid = completion_mask.bool().cpu()
    batch, gen_length = valid.shape
    position_block = torch.arange(gen_length) // block_length  # [L]
    block_has_valid = valid.view(batch, -1, block_length).any(dim=2)  # [B, blocks]
    block_rank = block_has_valid.long().cumsum(dim=1) - 1  # [B, blocks]: rank among the blocks with a valid token
    num_valid = valid.sum(dim=1)
    draws = []
    for _ in range(num_samples):
        pick = (torch.rand(batch, generator=generator) * block_has_valid.sum(dim=1)).long()
        chosen = (block_has_valid & (block_rank == pick.unsqueeze(1))).long().argmax(dim=1, keepdim=True)  # [B, 1]
        in_block = position_block.unsqueeze(0) == chosen
        candidates = in_block & valid
        count = 1 + (torch.rand(batch, generator=generator) * candidates.sum(dim=1)).long()  # k ∈ {1, …, v_b}
        order = torch.rand((batch, gen_length), generator=generator).masked_fill(~candidates, 2.0)
        rank = order.argsort(dim=1).argsort(dim=1)  # candidates first, in random order
        masked = (position_block.unsqueeze(0) > chosen) | (in_block & ~valid) | (candidates & (rank < count[:, None]))
        rate = torch.where(num_valid > 0, (masked & valid).sum(dim=1) / num_valid.clamp(min=1), 1.0)
        draws.append(MaskDraw(masked, rate.float()))
    return draws


def _prompt_masks(attention_mask: Tensor, prompt_length: int, num_draws: int, p_mask_prompt: float,
                  generator: torch.Generator) -> list[Tensor | None]:
    """Per draw, the real prompt tokens to mask, each with probability p (d1's prompt masking): one
    rand(num_draws, B, P) after the completion draws; None each when p = 0 (nothing drawn)."""
    if not 0 <= p_mask_prompt <= 1:
        raise ValueError(f"p_mask_prompt must be a probability in [0, 1]; got {p_mask_prompt}")
    if p_mask_prompt == 0:
        return [None] * num_draws
    real = attention_mask[:, :prompt_length].bool().cpu()
    draws = torch.rand((num_draws, *real.shape), generator=generator)
    return list((draws < p_mask_prompt) & real)


def masked_completion_logprobs(
    model: nn.Module,
    sequences: Tensor,
    attention_mask: Tensor,
    prompt_length: int,
    mask_token_id: int,
    masked: Tensor,
    prompt_masked: Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_ROWS,
    compute_entropy: bool = False,
    logits_fn: LogitsFn = plain_logits,
) -> Tensor | tuple[Tensor, Tensor]:
    """ℓ_k = log softmax(f(x̃)_{P+k})[o^k] at the completion positions `masked` [B, L] puts under the mask token,
    0 elsewhere: [B, L] float32, one forward; x̃ = `sequences` with those positions (and the prompt positions
    `prompt_masked` [B, P], if given) replaced by the mask id. With `compute_entropy`, also the entropy there."""
    device = sequences.device
    completion = sequences[:, prompt_length:]
    prompt = sequences[:, :prompt_length]
    if prompt_masked is not None:
        prompt = prompt.masked_fill(prompt_masked.to(device), mask_token_id)
    masked = masked.to(device)
    noisy = torch.cat([prompt, completion.masked_fill(masked, mask_token_id)], dim=1)
    logits = logits_fn(model, noisy, attention_mask, completion.shape[1])
    scored = selective_log_softmax(logits[masked], completion[masked], chunk_size, compute_entropy=compute_entropy)
    if compute_entropy:
        return _scatter_to_positions(masked, scored[0]), _scatter_to_positions(masked, scored[1])
    return _scatter_to_positions(masked, scored)


def _scored_draws(model: nn.Module, sequences: Tensor, attention_mask: Tensor, prompt_length: int, mask_token_id: int,
                  draws: list[MaskDraw], generator: torch.Generator, p_mask_prompt: float, chunk_size: int,
                  compute_entropy: bool, logits_fn: LogitsFn) -> list:
    """`masked_completion_logprobs` of each draw (one forward each), the prompt masked as `_prompt_masks` draws it
    from `generator` after the completion draws."""
    prompt_masks = _prompt_masks(attention_mask, prompt_length, len(draws), p_mask_prompt, generator)
    return [masked_completion_logprobs(model, sequences, attention_mask, prompt_length, mask_token_id, draw.masked,
                                       prompt_masked, chunk_size, compute_entropy, logits_fn)
            for draw, prompt_masked in zip(draws, prompt_masks)]


def elbo_from_draws(draw_logprobs: list[Tensor], draws: list[MaskDraw], scored: Tensor | None = None) -> Tensor:
    """The Monte-Carlo ELBO [B] of n draws: (1/n) Σ_d (1/t_d) Σ_k s_k m_{d,k} ℓ_{d,k}, with ℓ_{d,k} the log-prob
    of token k under draw d's canvas (`masked_completion_logprobs`), m_d its mask, t_d its rate and s the positions
    scored (`scored` [B, L], all when None). A draw with t_d = 0 (an empty complement) adds 0."""
    total = torch.zeros_like(draw_logprobs[0][:, 0])
    for logprobs, draw in zip(draw_logprobs, draws):
        kept = draw.masked.to(logprobs.device) if scored is None else draw.masked.to(logprobs.device) & scored.bool()
        rate = draw.rate.to(logprobs.device)
        per_draw = torch.where(kept, logprobs, 0.0).sum(dim=1)
        total = total + torch.where(rate > 0, per_draw / rate.clamp(min=1e-30), 0.0)
    return total / len(draws)


def eubo_from_draws(draw_logprobs: list[Tensor], draws: list[MaskDraw], beta: float,
                    scored: Tensor | None = None) -> Tensor:
    """SPG's evidence upper bound [B] (without its θ-independent constant) from n draws, β ≥ 1:

        E_k = (1/n) Σ_d m_{d,k} π_{d,k}^β / t_d,    EUBO = (N / |S|) · (1/β) Σ_{k ∈ S} log E_k,

    over the scored positions (`scored` [B, L], all when None; N of them) and S ⊆ them, those some draw masked
    (E_k > 0); log E_k = logsumexp_d(β ℓ_{d,k} − log t_d) − log n over the draws masking k. When every scored
    position is masked by some draw (a coupled pair; a single position) N / |S| = 1 and this is the paper's
    (1/β) Σ_k log E_k; otherwise the mean over S stands for the unseen positions, as SPG's code averages over S.
    0 for a sequence with S empty."""
    if not beta >= 1:
        raise ValueError(f"the EUBO needs beta >= 1 (SPG: 1.0 to 2.0); got {beta}")
    terms = []
    for logprobs, draw in zip(draw_logprobs, draws):
        masked = draw.masked.to(logprobs.device)
        log_rate = draw.rate.to(logprobs.device).clamp(min=1e-30).log().unsqueeze(1)
        terms.append(torch.where(masked, beta * logprobs - log_rate, -math.inf))
    log_e = torch.stack(terms).logsumexp(dim=0) - math.log(len(draws))  # [B, L], −inf where no draw masks k
    seen = torch.isfinite(log_e) if scored is None else torch.isfinite(log_e) & scored.bool()
    num_scored = torch.full_like(log_e[:, 0], log_e.shape[1]) if scored is None else scored.sum(dim=1).float()
    mean_seen = torch.where(seen, log_e, 0.0).sum(dim=1) / seen.sum(dim=1).clamp(min=1)
    return num_scored * mean_seen / beta


def sandwiched_log_likelihood(elbo: Tensor, eubo: Tensor, advantages: Tensor, mix_weight: float) -> Tensor:
    """SPG's per-sequence log-likelihood surrogate [B]: the ELBO where A ≥ 0 (raising a lower bound raises the
    likelihood), ω · EUBO + (1 − ω) · ELBO where A < 0 (lowering an upper bound lowers it; ω = `mix_weight`,
    ω = 1 the pure EUBO, 0 the ELBO alone)."""
    if not 0 <= mix_weight <= 1:
        raise ValueError(f"mix_weight must lie in [0, 1]; got {mix_weight}")
    if advantages.shape != elbo.shape:
        raise ValueError(f"advantages must be one per sequence, {tuple(elbo.shape)}; got {tuple(advantages.shape)}")
    negative = mix_weight * eubo + (1.0 - mix_weight) * elbo
    return torch.where(advantages.to(elbo.device) < 0, negative, elbo)


def spread_over_tokens(sequence_values: Tensor, completion_mask: Tensor) -> Tensor:
    """A sequence-level value v [B] as per-token values [B, L]: v / |o| at each of the |o| valid tokens, 0 elsewhere —
    their sum is v, and a token-level log-ratio of two such values is the sequence's length-normalised log-ratio."""
    valid = completion_mask.bool()
    length = valid.sum(dim=1, keepdim=True).clamp(min=1)
    return torch.where(valid, sequence_values.unsqueeze(1) / length, 0.0)


def mc_elbo(
    model: nn.Module,
    sequences: Tensor,
    attention_mask: Tensor | None,
    prompt_length: int,
    mask_token_id: int,
    num_samples: int,
    seed: int,
    chunk_size: int = DEFAULT_CHUNK_ROWS,
    logits_fn: LogitsFn = plain_logits,
    coupled: bool = False,
    completion_mask: Tensor | None = None,
    p_mask_prompt: float = 0.0,
) -> Tensor:
    """LLaDA's Monte-Carlo lower bound on log p(completion | prompt): [B] float32, ≤ 0.

    Per draw and sequence: t ~ U(0, 1], each completion token masked independently with probability t
    (the token with the smallest draw always, so at least one is), then
        ELBO = (1 / t) · Σ_{k masked} log softmax(f(x̃)_{P+k})[o^k],
    averaged over `num_samples` draws (one forward each): `random_mask_draws` then `elbo_from_draws`. `coupled`
    pairs each draw with its complement at rate 1 − t (coupled-GRPO; 2 · num_samples forwards, every token scored
    once per pair). Every completion position counts (LLaDA learns its EOS padding as a target) unless
    `completion_mask` [B, L] names the scored ones (padding is still masked at rate t, as context); the prompt is
    never masked unless `p_mask_prompt` > 0 (d1's prompt masking, drawn after the completion draws). Draws come
    from `mask_generator(seed)`: per draw, t = 1 − rand(B), then rand(B, L).
    """
    _check_mask_token(model, mask_token_id)
    attention_mask = _check_canvas(sequences, attention_mask, prompt_length)
    if not is_plain_int(num_samples) or num_samples < 1:
        raise ValueError(f"num_samples must be a positive int (Monte-Carlo draws); got {num_samples!r}")
    generator = mask_generator(seed)
    batch, gen_length = sequences.shape[0], sequences.shape[1] - prompt_length
    draws = random_mask_draws(batch, gen_length, num_samples, generator, coupled)
    logprobs = _scored_draws(model, sequences, attention_mask, prompt_length, mask_token_id, draws, generator,
                             p_mask_prompt, chunk_size, False, logits_fn)
    return elbo_from_draws(logprobs, draws, completion_mask)


# ---------------------------------------------------------------------------------------------
# Causal LMs
# ---------------------------------------------------------------------------------------------
def causal_logprobs(
    model: nn.Module,
    sequences: Tensor,
    attention_mask: Tensor | None,
    prompt_length: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_ROWS,
    compute_entropy: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Teacher-forced completion log-probs under a causal LM's sampling distribution: [B, L] float32.

    ℓ(o^k) = log softmax(shape_logits(f(x)_{P+k−1}, τ, top_k, top_p))[o^k]: one forward with
    `logits_to_keep = L + 1`, shifted by one, position_ids = cumsum(attention_mask) − 1 (clamped at 0).
    The trainer-side twin of `AutoregressiveSampler`'s `step_logprobs` (same processing, same numbers
    up to kernel rounding). Tokens the top-k/top-p filters remove get −inf. With `compute_entropy`, also the
    per-token entropy [B, L] of that sampling distribution, from the same logits.
    """
    require_causal_lm(model, "causal_logprobs")
    check_sampling_parameters(temperature, top_k, top_p)
    attention_mask = _check_canvas(sequences, attention_mask, prompt_length)
    gen_length = sequences.shape[1] - prompt_length
    logits = model(
        input_ids=sequences,
        attention_mask=attention_mask,
        position_ids=causal_position_ids(attention_mask),
        use_cache=False,
        logits_to_keep=gen_length + 1,
    ).logits[:, :-1]
    process = partial(shape_logits, temperature=temperature, top_k=top_k, top_p=top_p)
    return selective_log_softmax(logits, sequences[:, prompt_length:], chunk_size, process_logits=process,
                                 compute_entropy=compute_entropy)


# ---------------------------------------------------------------------------------------------
# The diffusion estimators a config can name (`likelihood_estimator`, choices.ESTIMATORS)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BoundSettings:
    """The Monte-Carlo bound estimators' settings (`elbo`, `spg`): `num_samples` draws of the masking process per
    estimate (config `elbo_samples`, SPG's num_t), `coupled` complementary pairs (`elbo_coupled`), SPG's block-wise
    masking over blocks of `block_length` (`spg_block_masking`; the sampler's block length), its EUBO exponent β
    (`spg_eubo_beta`) and the EUBO's weight ω in the negative-advantage mixture (`spg_mix_weight`)."""

    num_samples: int = 2
    coupled: bool = False
    block_masking: bool = False
    block_length: int | None = None
    eubo_beta: float = 1.5
    mix_weight: float = 0.5


@dataclass(frozen=True)
class BlockSubset:
    """The trajectory-type estimators scoring a random share of the completion's blocks per estimate (config
    `likelihood_block_fraction`, `block_length`): k = max(1, round(fraction · n)) of the n = ⌈L / block_length⌉
    blocks, drawn uniformly without replacement from `mask_generator(seed)` among the blocks that hold a valid token
    of some row (topped up with empty ones when fewer do), the same blocks for every row.

    A block's tokens are committed by its own steps only (semi-autoregressive decoding), so scoring k blocks takes
    the forwards of their steps alone — about k/n of the trajectory's, and always k blocks' worth, so that every
    process runs as many forwards. Every valid token is scored with the same probability, so the loss over the scored
    tokens, normalised by their count, estimates the loss over all of them (a ratio estimate, as TRL's DDPO trains on
    a `train_timestep_fraction` of the denoising steps); drawing among the blocks that hold valid tokens spends no
    update on a block of end-of-text padding."""

    fraction: float
    block_length: int

    def __post_init__(self):
        if not (0 < self.fraction <= 1):
            raise ValueError(f"likelihood_block_fraction must be in (0, 1]; got {self.fraction!r}")
        if not is_plain_int(self.block_length) or self.block_length < 1:
            raise ValueError(f"block_length must be a positive int; got {self.block_length!r}")

    def positions(self, completion_mask: Tensor, seed: int) -> Tensor:
        """The completion positions [L] bool of the blocks drawn with `seed`, given the valid tokens [B, L]."""
        gen_length = completion_mask.shape[1]
        num_blocks = math.ceil(gen_length / self.block_length)
        padded = torch.zeros(num_blocks * self.block_length, dtype=torch.bool)
        padded[:gen_length] = completion_mask.bool().any(dim=0).cpu()
        holds_valid = padded.view(num_blocks, self.block_length).any(dim=1)
        order = torch.randperm(num_blocks, generator=mask_generator(seed))
        order = order[torch.argsort((~holds_valid[order]).int(), stable=True)]  # blocks with valid tokens first
        in_block = torch.zeros(num_blocks, dtype=torch.bool)
        in_block[order[:max(1, round(self.fraction * num_blocks))]] = True
        return in_block.repeat_interleave(self.block_length)[:gen_length]


@dataclass(frozen=True)
class EstimatorSettings:
    """What a diffusion estimator needs besides the model, the rollout and the seed: the mask id, the sampling
    temperature (the trajectory-type estimators score softmax(logits / τ)), d1's prompt-masking probability
    (one-step surrogate and the bounds), `logits_fn`, the sampler's canvas → logits stage (see `LogitsFn`), the
    bound estimators' `BoundSettings`, StepMerge's number of segments N, the decoder replay's `decoder_logits`, and
    the trajectory-type estimators' `BlockSubset` (None: every block)."""

    mask_token_id: int
    temperature: float
    p_mask_prompt: float = 0.15
    logits_fn: LogitsFn = plain_logits
    bounds: BoundSettings = field(default_factory=BoundSettings)
    likelihood_segments: int = 16
    decoder_logits: DecoderLogitsFn | None = None
    block_subset: BlockSubset | None = None


def _one_step_of_rollout(model: nn.Module, rollout: Rollout, settings: EstimatorSettings, seed: int,
                         compute_entropy: bool, advantages: Tensor | None = None):
    return one_step_logprobs(model, rollout.sequences, rollout.attention_mask, rollout.prompt_length,
                             settings.mask_token_id, seed, p_mask_prompt=settings.p_mask_prompt,
                             compute_entropy=compute_entropy, logits_fn=settings.logits_fn)


def _drawn_positions(settings: EstimatorSettings, rollout: Rollout, seed: int) -> Tensor | None:
    """Every position [B, L] of the blocks a trajectory-type estimate draws, padding included (so that every process
    runs the same forwards, whatever its completions' lengths); None when it scores every block."""
    if settings.block_subset is None:
        return None
    drawn = settings.block_subset.positions(rollout.completion_mask, seed).to(rollout.completion_ids.device)
    return drawn.expand_as(rollout.completion_ids)


def scored_positions(settings: EstimatorSettings, rollout: Rollout, seed: int) -> Tensor:
    """The completion tokens [B, L] bool an estimate with `seed` scores: the valid ones (`completion_mask`), those of
    the drawn blocks alone with a `BlockSubset`."""
    valid = rollout.completion_mask.bool()
    drawn = _drawn_positions(settings, rollout, seed)
    return valid if drawn is None else valid & drawn


def _trajectory_pieces_of_rollout(model: nn.Module, rollout: Rollout, settings: EstimatorSettings, seed: int,
                                  compute_entropy: bool, advantages: Tensor | None = None) -> Iterator[LogprobPiece]:
    positions = _drawn_positions(settings, rollout, seed)
    if settings.decoder_logits is not None:
        return decoder_trajectory_pieces(model, rollout, settings.decoder_logits, settings.temperature,
                                         compute_entropy=compute_entropy, positions=positions)
    return trajectory_pieces(model, rollout, settings.mask_token_id, settings.temperature,
                             compute_entropy=compute_entropy, logits_fn=settings.logits_fn, positions=positions)


def _step_merge_pieces_of_rollout(model: nn.Module, rollout: Rollout, settings: EstimatorSettings, seed: int,
                                  compute_entropy: bool, advantages: Tensor | None = None) -> Iterator[LogprobPiece]:
    return step_merge_pieces(model, rollout, settings.mask_token_id, settings.temperature,
                             settings.likelihood_segments, compute_entropy=compute_entropy,
                             logits_fn=settings.logits_fn, positions=_drawn_positions(settings, rollout, seed))


def _draws_blocks(settings: EstimatorSettings) -> bool:
    return settings.block_subset is not None


def _step_merge_is_the_trajectory(settings: EstimatorSettings, rollout: Rollout) -> bool:
    return merges_no_steps(rollout.commit_step, settings.likelihood_segments)


def _bound_draws(model: nn.Module, rollout: Rollout, settings: EstimatorSettings, seed: int, block_wise: bool,
                 compute_entropy: bool) -> tuple[list[MaskDraw], list[Tensor], Tensor | None]:
    """The draws of one bound estimate of `rollout` (block-wise or LLaDA's random masks, from `mask_generator(seed)`),
    the log-probs [B, L] of each, and with `compute_entropy` the mean entropy over every draw's masked valid tokens,
    one value per sequence spread to its valid tokens (the sequence-level estimate's entropy)."""
    _check_mask_token(model, settings.mask_token_id)
    attention_mask = _check_canvas(rollout.sequences, rollout.attention_mask, rollout.prompt_length)
    bounds = settings.bounds
    if not is_plain_int(bounds.num_samples) or bounds.num_samples < 1:
        raise ValueError(f"elbo_samples must be a positive int (Monte-Carlo draws); got {bounds.num_samples!r}")
    generator = mask_generator(seed)
    if block_wise:
        draws = block_mask_draws(rollout.completion_mask, bounds.block_length, bounds.num_samples, generator)
    else:
        draws = random_mask_draws(len(rollout.sequences), rollout.gen_length, bounds.num_samples, generator,
                                  bounds.coupled)
    scored = _scored_draws(model, rollout.sequences, attention_mask, rollout.prompt_length, settings.mask_token_id,
                           draws, generator, settings.p_mask_prompt, DEFAULT_CHUNK_ROWS, compute_entropy,
                           settings.logits_fn)
    if not compute_entropy:
        return draws, scored, None
    valid = rollout.completion_mask.bool()
    kept = torch.stack([draw.masked.to(valid.device) & valid for draw in draws])  # [n, B, L]
    entropies = torch.stack([entropy for _, entropy in scored])
    per_sequence = torch.where(kept, entropies, 0.0).sum(dim=(0, 2)) / kept.sum(dim=(0, 2)).clamp(min=1)
    return draws, [logprobs for logprobs, _ in scored], torch.where(valid, per_sequence.unsqueeze(1), 0.0)


def _per_token_result(sequence_values: Tensor, rollout: Rollout, entropy: Tensor | None):
    values = spread_over_tokens(sequence_values, rollout.completion_mask)
    return values if entropy is None else (values, entropy)


def _elbo_of_rollout(model: nn.Module, rollout: Rollout, settings: EstimatorSettings, seed: int,
                     compute_entropy: bool, advantages: Tensor | None = None):
    """`mc_elbo` of the valid completion tokens (random masks, coupled if set), as per-token values
    (`spread_over_tokens`)."""
    draws, logprobs, entropy = _bound_draws(model, rollout, settings, seed, False, compute_entropy)
    return _per_token_result(elbo_from_draws(logprobs, draws, rollout.completion_mask), rollout, entropy)


def _spg_of_rollout(model: nn.Module, rollout: Rollout, settings: EstimatorSettings, seed: int,
                    compute_entropy: bool, advantages: Tensor | None = None):
    """`sandwiched_log_likelihood` of the ELBO and EUBO from the same draws (block-wise if set), as per-token
    values (`spread_over_tokens`); needs each sequence's advantage."""
    if advantages is None:
        raise ValueError("likelihood_estimator=spg picks each sequence's bound by the sign of its advantage: "
                         "pass advantages (one per sequence)")
    bounds = settings.bounds
    draws, logprobs, entropy = _bound_draws(model, rollout, settings, seed, bounds.block_masking, compute_entropy)
    elbo = elbo_from_draws(logprobs, draws, rollout.completion_mask)
    eubo = eubo_from_draws(logprobs, draws, bounds.eubo_beta, rollout.completion_mask)
    return _per_token_result(sandwiched_log_likelihood(elbo, eubo, advantages, bounds.mix_weight), rollout, entropy)


@dataclass(frozen=True)
class DiffusionEstimator:
    """How a masked-diffusion policy scores a rollout.

    `logprobs(model, rollout, settings, seed, compute_entropy, advantages)` gives the per-token log-probs [B, L] (and
    entropies with `compute_entropy`), `settings` an `EstimatorSettings`, `advantages` [B] the sequences' advantages
    (None where unknown; only `spg` reads them); `recorded_by_sampler`: the rollout side is the sampler's recorded
    per-step log-prob, no engine forward — True, or a predicate of (settings, rollout) when that holds for some
    settings only; `fresh_masks_per_iteration`: the estimator is random and draws new masks for every inner
    iteration (one estimator seed each), True or a predicate of the settings (the trajectory-type estimators with a
    `BlockSubset`); `pieces` (same arguments): the log-probs forward by forward, an iterator of `LogprobPiece` whose
    sum is `logprobs` (see `piecewise`), None for a single-forward estimator. An estimate is read at the positions
    `scored_positions` names (the correction and the loss run over those); a block subset holds 0 outside its blocks.

    Sequence-level estimators (`elbo`, `spg`, choices.SEQUENCE_ESTIMATORS) estimate one number per completion, v,
    and return it spread over its |o| valid tokens, v / |o| each (`spread_over_tokens`): the per-token values sum to
    v, and every token-level stage downstream then works at the sequence level by itself — the token ratio
    exp(ℓ^θ_t − ℓ^old_t) is the same at every token of a sequence, GSPO's length-normalised sequence ratio
    exp((v^θ − v^old) / |o|), clipped at 1 ± ε once per sequence in effect; token-level (and geometric) IS weights
    are that ratio between trainer and engine, is_level=sequence the full exp(v^old − v^ro)."""

    logprobs: Callable
    recorded_by_sampler: bool | Callable[[EstimatorSettings, Rollout], bool] = False
    fresh_masks_per_iteration: bool | Callable[[EstimatorSettings], bool] = False
    pieces: Callable[..., Iterable[LogprobPiece]] | None = None

    @classmethod
    def piecewise(cls, pieces: Callable[..., Iterable[LogprobPiece]], **flags) -> "DiffusionEstimator":
        """The estimator whose log-probs are the sum of `pieces`."""
        def logprobs(model, rollout, settings, seed, compute_entropy, advantages=None):
            return sum_pieces(pieces(model, rollout, settings, seed, compute_entropy, advantages), compute_entropy)

        return cls(logprobs, pieces=pieces, **flags)

    def logprob_pieces(self, model: nn.Module, rollout: Rollout, settings: EstimatorSettings, seed: int,
                       compute_entropy: bool, advantages: Tensor | None = None) -> Iterable[LogprobPiece]:
        """The log-probs as pieces, one per forward: `pieces`, or a single piece over every position."""
        if self.pieces is None:
            return [whole_piece(self.logprobs(model, rollout, settings, seed, compute_entropy, advantages),
                                compute_entropy)]
        return self.pieces(model, rollout, settings, seed, compute_entropy, advantages)

    def records_rollout_side(self, settings: EstimatorSettings, rollout: Rollout) -> bool:
        """Whether the rollout side of `rollout` is the sampler's recorded `step_logprobs`."""
        recorded = self.recorded_by_sampler
        return recorded(settings, rollout) if callable(recorded) else recorded

    def draws_per_iteration(self, settings: EstimatorSettings) -> bool:
        """Whether each inner iteration draws its own estimate (masks, or blocks), one estimator seed each."""
        fresh = self.fresh_masks_per_iteration
        return fresh(settings) if callable(fresh) else fresh


DIFFUSION_ESTIMATORS = {
    "one_step": DiffusionEstimator(_one_step_of_rollout, fresh_masks_per_iteration=True),
    "trajectory": DiffusionEstimator.piecewise(_trajectory_pieces_of_rollout, recorded_by_sampler=True,
                                               fresh_masks_per_iteration=_draws_blocks),
    "step_merge": DiffusionEstimator.piecewise(_step_merge_pieces_of_rollout,
                                               recorded_by_sampler=_step_merge_is_the_trajectory,
                                               fresh_masks_per_iteration=_draws_blocks),
    "elbo": DiffusionEstimator(_elbo_of_rollout, fresh_masks_per_iteration=True),
    "spg": DiffusionEstimator(_spg_of_rollout, fresh_masks_per_iteration=True),
}
