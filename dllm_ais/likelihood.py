"""Likelihood stage: per-token log-probs of sampled completions under a policy.

Formulas: docs/algorithms.md, section "Likelihood estimators".

Every estimator is a pure function of the model and tensors; the model is an argument and nothing
here switches grad on or off, so the same call gives ℓ_rollout / ℓ_old / ℓ_ref under `torch.no_grad()`
and ℓ_θ under grad. Canvases are `[left-padded prompt (P) | completion (L)]`, as in `Rollout`.

Masked-diffusion policies (LLaDA):
- `one_step_logprobs`   the diffu-GRPO one-step surrogate (default estimator, one forward).
- `trajectory_logprobs` the exact log-prob of the recorded denoising trajectory (one forward per step).
- `mc_elbo`             LLaDA's Monte-Carlo bound on log p(completion | prompt), for evaluation.
Causal LMs:
- `causal_logprobs`     teacher-forced log-probs under the sampling distribution the AR sampler used.

Random masks come from a dedicated CPU `torch.Generator` seeded by the caller, never the global RNG,
so one seed gives the same masks on every device and for every model: this is what makes ℓ_rollout,
ℓ_old, ℓ_ref and ℓ_θ of one inner iteration differ by the policies alone.

Memory: no function here holds a float32 log-softmax (or a float32 copy of the logits) over the whole
vocabulary for every position at once; `selective_log_softmax` works on `chunk_size` rows at a time.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers import TopKLogitsWarper, TopPLogitsWarper

if TYPE_CHECKING:  # a runtime import would cycle: the samplers import this module
    from dllm_ais.sampling.rollout import Rollout

__all__ = [
    "DEFAULT_CHUNK_ROWS",
    "DIFFUSION_ESTIMATORS",
    "DiffusionEstimator",
    "EstimatorSettings",
    "LogitsFn",
    "causal_logprobs",
    "causal_position_ids",
    "check_sampling_parameters",
    "is_plain_int",
    "mask_generator",
    "mc_elbo",
    "one_step_logprobs",
    "one_step_masked_input",
    "plain_logits",
    "require_causal_lm",
    "selective_log_softmax",
    "shape_logits",
    "trajectory_logprobs",
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
    autoregressive order), not over the whole completion.

    With `compute_entropy`, also returns the entropy [B, L] of the distribution each token was scored under (at the
    step that committed it), from the same logits.
    """
    _check_mask_token(model, mask_token_id)
    check_sampling_parameters(temperature, top_k=0, top_p=1.0)
    if not is_plain_int(steps_per_forward) or steps_per_forward < 1:
        raise ValueError(f"steps_per_forward must be a positive int; got {steps_per_forward!r}")
    commit_step = rollout.commit_step
    completion = rollout.completion_ids
    if commit_step.shape != completion.shape:
        raise ValueError(
            f"rollout.commit_step must be [B, L] = {tuple(completion.shape)}; got {tuple(commit_step.shape)}"
        )
    if bool((commit_step < 0).any()):
        raise ValueError(
            "rollout.commit_step has negative entries (positions never committed); the trajectory estimator "
            "needs the step of every completion token — use a rollout from a sampler that records it."
        )
    attention_mask = _check_canvas(rollout.sequences, rollout.attention_mask, rollout.prompt_length)
    scale = partial(shape_logits, temperature=temperature)
    batch, gen_length = completion.shape

    logprobs = torch.zeros(batch, gen_length, dtype=torch.float32, device=completion.device)
    entropy = torch.zeros_like(logprobs)
    for steps in torch.unique(commit_step).split(steps_per_forward):
        step_index = steps.view(-1, 1, 1)  # [S, 1, 1]
        hidden = commit_step.unsqueeze(0) >= step_index  # [S, B, L]: still masked before step t
        committed = commit_step.unsqueeze(0) == step_index  # [S, B, L]: committed at step t
        columns = committed.any(dim=1).any(dim=0).nonzero().flatten()  # [C] the positions these steps commit
        canvases = torch.cat(
            [rollout.prompt_ids.expand(len(steps), -1, -1), torch.where(hidden, mask_token_id, completion)], dim=2
        )
        logits = logits_fn(model, canvases.flatten(0, 1), attention_mask.repeat(len(steps), 1),
                           columns + rollout.prompt_length).unflatten(0, (len(steps), batch))  # [S, B, C, V]
        kept = committed[..., columns]
        targets = completion[:, columns].expand(len(steps), -1, -1)
        scored = selective_log_softmax(logits[kept], targets[kept], chunk_size, process_logits=scale,
                                       compute_entropy=compute_entropy)
        values = scored[0] if compute_entropy else scored
        logprobs = logprobs + _scatter_to_positions(committed, values).sum(dim=0)
        if compute_entropy:
            entropy = entropy + _scatter_to_positions(committed, scored[1]).sum(dim=0)
    return (logprobs, entropy) if compute_entropy else logprobs


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
) -> Tensor:
    """LLaDA's Monte-Carlo lower bound on log p(completion | prompt): [B] float32, ≤ 0.

    Per draw and sequence: t ~ U(0, 1], each completion token masked independently with probability t
    (the token with the smallest draw always, so at least one is), then
        ELBO = (1 / t) · Σ_{k masked} log softmax(f(x̃)_{P+k})[o^k],
    averaged over `num_samples` draws (one forward each). Every completion position counts (LLaDA learns
    its EOS padding as a target); the prompt is never masked. Draws come from `mask_generator(seed)`:
    per draw, t = 1 − rand(B), then rand(B, L).
    """
    _check_mask_token(model, mask_token_id)
    attention_mask = _check_canvas(sequences, attention_mask, prompt_length)
    if not is_plain_int(num_samples) or num_samples < 1:
        raise ValueError(f"num_samples must be a positive int (Monte-Carlo draws); got {num_samples!r}")
    generator = mask_generator(seed)
    completion = sequences[:, prompt_length:]
    batch, gen_length = completion.shape

    total = torch.zeros(batch, dtype=torch.float32, device=sequences.device)
    for _ in range(num_samples):
        mask_rate = (1.0 - torch.rand(batch, generator=generator)).to(sequences.device)
        draws = torch.rand((batch, gen_length), generator=generator).to(sequences.device)
        masked = (draws < mask_rate.unsqueeze(1)) | (draws == draws.min(dim=1, keepdim=True).values)
        noisy = torch.cat([sequences[:, :prompt_length], completion.masked_fill(masked, mask_token_id)], dim=1)
        logits = logits_fn(model, noisy, attention_mask, gen_length)
        values = selective_log_softmax(logits[masked], completion[masked], chunk_size)
        total = total + _scatter_to_positions(masked, values).sum(dim=1) / mask_rate
    return total / num_samples


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
class EstimatorSettings:
    """What a diffusion estimator needs besides the model, the rollout and the seed: the mask id, the sampling
    temperature (the trajectory-type estimators score softmax(logits / τ)), d1's prompt-masking probability
    (one-step surrogate) and `logits_fn`, the sampler's canvas → logits stage (see `LogitsFn`)."""

    mask_token_id: int
    temperature: float
    p_mask_prompt: float = 0.15
    logits_fn: LogitsFn = plain_logits


def _one_step_of_rollout(model: nn.Module, rollout: Rollout, settings: EstimatorSettings, seed: int,
                         compute_entropy: bool):
    return one_step_logprobs(model, rollout.sequences, rollout.attention_mask, rollout.prompt_length,
                             settings.mask_token_id, seed, p_mask_prompt=settings.p_mask_prompt,
                             compute_entropy=compute_entropy, logits_fn=settings.logits_fn)


def _trajectory_of_rollout(model: nn.Module, rollout: Rollout, settings: EstimatorSettings, seed: int,
                           compute_entropy: bool):
    return trajectory_logprobs(model, rollout, settings.mask_token_id, settings.temperature,
                               compute_entropy=compute_entropy, logits_fn=settings.logits_fn)


@dataclass(frozen=True)
class DiffusionEstimator:
    """How a masked-diffusion policy scores a rollout.

    `logprobs(model, rollout, settings, seed, compute_entropy)` gives the per-token log-probs [B, L] (and
    entropies with `compute_entropy`), `settings` an `EstimatorSettings`; `recorded_by_sampler`: the rollout side is
    the sampler's recorded per-step log-prob, no engine forward; `fresh_masks_per_iteration`: the estimator is
    random and draws new masks for every inner iteration (one estimator seed each)."""

    logprobs: Callable
    recorded_by_sampler: bool = False
    fresh_masks_per_iteration: bool = False


DIFFUSION_ESTIMATORS = {
    "one_step": DiffusionEstimator(_one_step_of_rollout, fresh_masks_per_iteration=True),
    "trajectory": DiffusionEstimator(_trajectory_of_rollout, recorded_by_sampler=True),
}
