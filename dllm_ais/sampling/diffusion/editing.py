"""LLaDA2.1's token editing: a decoder that may overwrite a block's committed tokens (token-to-token, T2T) while it
fills the block's masks (mask-to-token, M2T), and what the rollout records of it so the trainer replays every write.

The rule (``DiffusionSamplerConfig.editing_threshold`` τ_e, ``max_post_steps``), per iteration of a block, on the
logits of the iteration's forward: every filled completion position of the block (committed at an earlier iteration)
draws a token v from the distribution masked positions draw from (softmax(filtered logits / τ); the argmax at τ = 0)
and is overwritten by it when v differs from its token and q(v) > τ_e; the masked positions commit by the threshold
rule as without editing. A row's block ends on an iteration that began with no mask and edited nothing, or when
``max_post_steps`` iterations without a mask have run (LLaDA2.1's ``generate``, per row:
`dllm_ais.decoding_protocols.llada21_generate_settings`). Finished blocks never change, so a block-causal model's
exact cache of them stays exact.

What the ratio sees (docs/algorithms.md, "Token editing"): a rollout's trajectory is its sequence of writes — each
position's first commit and each of its edits, every one a token drawn from the logits of its iteration's canvas.
`Rollout.step_logprobs` holds per position the sum of its writes' log-probs log q(v | canvas), and the decoder replay
(`MaskedDiffusionSampler.decoder_logits`) rebuilds each iteration's canvas from the first commits and the edits
before it and yields the tokens each iteration wrote, so the trajectory estimator scores the same writes. The
decisions themselves — that a filled position kept its token (probability q(current) + Σ_{v ≠ current, q(v) ≤ τ_e}
q(v)), that a drawn token was below τ_e — are not in the ratio, as the threshold rule's commit decisions are not:
the ratio is that of the written tokens given the decoder's choices (tests/test_llada21_editing.py enumerates every
trajectory of a tiny model to check both parts).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from dllm_ais.rollout import Rollout
from dllm_ais.sampling.diffusion.canvas import CanvasLayout
from dllm_ais.sampling.diffusion.sampler_config import DiffusionSamplerConfig
from dllm_ais.sampling.diffusion.schedule import scheduled_floor

__all__ = ["EDITS", "EditLog", "EditRecord", "ReplayedWrites", "canvas_before_step", "denoise_block_with_edits",
           "editing_step_limit",
           "first_commit_tokens",
           "recorded_edits", "token_edits"]

EDITS = "edits"
"""The name of the edit record in `Rollout.records`."""


@dataclass
class EditRecord:
    """The edits of a sampling call with token editing, held in `Rollout.records` under `EDITS`: per row, its edits
    in the order they were made, padded to the row with the most (E).

    position [B, E]: the completion position edited (−1: padding); step [B, E]: the global step (the numbering of
    `Rollout.commit_step`) that edited it; previous_token [B, E]: the token it replaced; token [B, E]: the token
    written; logprob [B, E] float32: log q(token) under the distribution it was drawn from (also summed into the
    position's `Rollout.step_logprobs`). A position's first commit is the `previous_token` of its first edit; its
    final token is the completion's.
    """

    position: torch.LongTensor
    step: torch.LongTensor
    previous_token: torch.LongTensor
    token: torch.LongTensor
    logprob: torch.Tensor

    def counts(self, completion_mask: torch.Tensor) -> torch.LongTensor:
        """[B] each row's edits at the positions of `completion_mask` [B, L] (its completion through its first EOS)."""
        inside = completion_mask.gather(1, self.position.clamp_min(0)) & (self.position >= 0)
        return inside.sum(dim=1)

    @staticmethod
    def joined(parts: list["EditRecord"]) -> "EditRecord":
        """The parts' records as one (rows in order), each padded to the most edits of any row."""
        width = max(part.position.shape[1] for part in parts)
        padding = {"position": -1, "step": -1, "previous_token": -1, "token": -1, "logprob": 0.0}
        return EditRecord(**{f.name: torch.cat([torch.nn.functional.pad(getattr(part, f.name),
                                                                          (0, width - part.position.shape[1]),
                                                                          value=padding[f.name]) for part in parts])
                             for f in fields(EditRecord)})


def recorded_edits(rollout: Rollout) -> EditRecord | None:
    """`rollout`'s edit record, None when its sampler does not edit."""
    return rollout.records.get(EDITS)


def denoise_block_with_edits(sampler: Any, state: Any, block: slice) -> None:
    """Decode `block` of a sampling call (`state`: `MaskedDiffusionSampler`'s denoising state) by `sampler` with token
    editing, each step through `sampler.write_step`: each step fills masks by the threshold rule (at least the
    schedule's floor) and edits the filled completion positions, each row until its block ends (a step that began
    with no mask and edited nothing, or `max_post_steps` steps without a mask, or `editing_step_limit` steps); a
    finished row's steps write nothing. A position holding the mask id is masked, as in LLaDA2.1's code: an edit (or
    a commit) that writes the mask id leaves it to be committed again, that write recorded with the edits. One host
    read per run of steps (agreed across the processes of a sharded engine): as many as the slowest row's masks
    left, then one step at a time while rows only edit."""
    config, mask = sampler.config, state.token_ids.mask
    editable = state.layout.on_canvas(torch.ones_like(state.layout.completion_index, dtype=torch.bool),
                                      False)[:, block]
    post_steps = torch.zeros(state.canvas.shape[0], dtype=torch.long, device=state.canvas.device)
    done = torch.zeros_like(post_steps, dtype=torch.bool)
    forwards_in_block, run = 0, 1
    while run > 0:
        for _ in range(run):
            before = state.canvas[:, block].clone()
            still_masked = before == mask
            had_mask = still_masked.any(dim=1)
            post_steps += ~had_mask & ~done
            done |= post_steps > config.max_post_steps
            rewritten = still_masked & (state.commit_step[:, block] >= 0)  # committed before, masked again
            commit_step, logprobs = state.commit_step[:, block].clone(), state.step_logprobs[:, block].clone()
            scheduled = (state.block_schedule[forwards_in_block] if forwards_in_block < len(state.block_schedule)
                         else 0)
            step = sampler.write_step(state, block, still_masked & ~done[:, None], forwards_in_block,
                                      width=config.block_length,
                                      floor=scheduled_floor(config, still_masked, scheduled, forwards_in_block))
            forwards_in_block += 1
            rewrite = step.commit & rewritten
            state.commit_step[:, block] = torch.where(rewrite, commit_step, state.commit_step[:, block])
            state.step_logprobs[:, block] = torch.where(rewrite, logprobs + step.logprobs,
                                                        state.step_logprobs[:, block])
            drawn, drawn_logprobs = sampler.propose_tokens(step.logits, state.generator)
            edit = token_edits(before, drawn, drawn_logprobs, editable & ~still_masked & ~done[:, None],
                               config.editing_threshold)
            state.canvas[:, block] = torch.where(edit, drawn, state.canvas[:, block])
            state.step_logprobs[:, block] += torch.where(edit, drawn_logprobs, 0.0)
            state.num_steps += edit.any(dim=1) & ~step.commit.any(dim=1)
            state.edits.add(state.step - 1, block, edit | rewrite, before, torch.where(edit, drawn, step.candidates),
                            torch.where(edit, drawn_logprobs, step.logprobs))
            done |= (~had_mask & ~edit.any(dim=1)) | (forwards_in_block >= editing_step_limit(config))
        masked = state.canvas[:, block] == mask
        ends_next = done | (~masked.any(dim=1) & (post_steps + 1 > config.max_post_steps))
        left, finished = state.forwards.agreed(  # the host read
            torch.stack([masked.sum(dim=1).max(), ends_next.all()]), ("max", "min")).tolist()
        run = 0 if finished else max(left, 1)


def editing_step_limit(config: DiffusionSamplerConfig) -> int:
    """The most steps a block runs with token editing: LLaDA2.1's loop runs on while edits keep writing the mask id;
    the sampler ends a block after 4 × (block_length + max_post_steps + 1) steps whatever is left."""
    return 4 * (config.block_length + config.max_post_steps + 1)


def token_edits(block_tokens: torch.LongTensor, drawn: torch.LongTensor, drawn_logprobs: torch.Tensor,
                editable: torch.Tensor, editing_threshold: float) -> torch.Tensor:
    """[B, Lb] bool: the positions an iteration edits: `editable` (filled completion positions of a row still
    decoding the block) whose `drawn` token differs from `block_tokens` and whose probability exp(`drawn_logprobs`)
    exceeds `editing_threshold`."""
    return editable & (drawn != block_tokens) & (drawn_logprobs.exp() > editing_threshold)


class EditLog:
    """The edits of one sampling call as they happen (on the device: no host read until `record`)."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, slice, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def add(self, step: int, block: slice, edit: torch.Tensor, previous: torch.Tensor, tokens: torch.Tensor,
            logprobs: torch.Tensor) -> None:
        """The edits [B, Lb] of global step `step` in the canvas slice `block`: the tokens replaced and written, and
        the written tokens' log-probs."""
        self.steps.append((step, block, edit, previous, tokens, logprobs))

    def record(self, completion_index: torch.LongTensor, canvas_length: int) -> EditRecord:
        """The `EditRecord` of the call (E = 0 when it made no edit), its canvas positions mapped to the completion
        positions `completion_index` [B, L] gives. One host read (the most edits of a row)."""
        batch, length = completion_index.shape
        device = completion_index.device
        if not self.steps:
            empty = torch.empty((batch, 0), dtype=torch.long, device=device)
            return EditRecord(empty, empty, empty, empty, empty.float())
        to_completion = torch.full((batch, canvas_length), -1, dtype=torch.long, device=device).scatter(
            1, completion_index, torch.arange(length, device=device).expand(batch, -1))
        edit = torch.cat([entry[2] for entry in self.steps], dim=1)
        position = torch.cat([to_completion[:, block] for _, block, *_ in self.steps], dim=1)
        step = torch.cat([torch.full_like(entry[2], entry[0], dtype=torch.long) for entry in self.steps], dim=1)
        previous, tokens, logprobs = (torch.cat([entry[index] for entry in self.steps], dim=1) for index in (3, 4, 5))
        count = int(edit.sum(dim=1).max())
        order = (~edit).to(torch.uint8).sort(dim=1, stable=True).indices[:, :count]  # each row's edits, in step order
        kept = edit.gather(1, order)

        def pick(values: torch.Tensor, fill: int | float) -> torch.Tensor:
            return values.gather(1, order).masked_fill(~kept, fill)

        return EditRecord(pick(position, -1), pick(step, -1), pick(previous, -1), pick(tokens, -1),
                          pick(logprobs.float(), 0.0))


def canvas_before_step(first_tokens: torch.LongTensor, edits: EditRecord, edit_step: torch.LongTensor,
                       step: int) -> torch.LongTensor:
    """[B, L] the completion's filled tokens as they stood before relative step `step`: each position's first
    commit (`first_tokens` [B, L]) overwritten by its latest edit made before `step` (`edit_step` [B, E] the edits'
    steps in the caller's numbering, −1 padding aside)."""
    valid = (edits.position >= 0) & (edit_step < step)
    if not bool(valid.any()):
        return first_tokens
    position = edits.position.clamp_min(0)
    none = torch.iinfo(torch.long).min  # below any step (the steps before the caller's block are negative)
    latest = torch.full_like(first_tokens, none).scatter_reduce(1, position, torch.where(valid, edit_step, none),
                                                                "amax")
    chosen = valid & (edit_step == latest.gather(1, position))
    written = first_tokens.clone()
    rows = torch.arange(first_tokens.shape[0], device=first_tokens.device)[:, None].expand_as(position)
    written[rows[chosen], position[chosen]] = edits.token[chosen]
    return written


def first_commit_tokens(completion: torch.LongTensor, edits: EditRecord) -> torch.LongTensor:
    """[B, L] each completion position's first committed token: the completion's where it was never edited, else the
    token its first edit replaced."""
    valid = edits.position >= 0
    position = edits.position.clamp_min(0)
    order = torch.arange(edits.position.shape[1], device=completion.device).expand_as(position)
    first = torch.full_like(completion, edits.position.shape[1]).scatter_reduce(
        1, position, torch.where(valid, order, edits.position.shape[1]), "amin")
    chosen = valid & (order == first.gather(1, position))
    tokens = completion.clone()
    rows = torch.arange(completion.shape[0], device=completion.device)[:, None].expand_as(position)
    tokens[rows[chosen], position[chosen]] = edits.previous_token[chosen]
    return tokens


class ReplayedWrites:
    """A rollout's writes as the decoder replay (`MaskedDiffusionSampler.decoder_logits`) rebuilds them, block by
    block: the steps of the current block counted from its first, the positions each step wrote (commits, and edits
    when the rollout holds an `EditRecord`) and the canvas before each step (each position's first commit, overwritten
    by its edits made before the step; the mask id where it is not yet committed)."""

    def __init__(self, layout: CanvasLayout, rollout: Rollout):
        self.layout = layout
        self.edits = recorded_edits(rollout)
        if self.edits is not None and self.edits.position.shape[1] == 0:
            self.edits = None
        completion = rollout.completion_ids
        self.first_tokens = completion if self.edits is None else first_commit_tokens(completion, self.edits)
        self.commit_step = layout.on_canvas(rollout.commit_step, -1)  # -1 off the completion
        self.in_completion = layout.on_canvas(torch.ones_like(rollout.commit_step, dtype=torch.bool), False)
        self.not_in_block = self.commit_step.max() + 1  # a row with no completion position in a block: steps from here
        if self.edits is not None:
            self.edit_position = layout.completion_index.gather(1, self.edits.position.clamp_min(0))  # on the canvas
        self.block = slice(0, 0)
        self.steps_in_block = 0

    def start_block(self, block: slice) -> None:
        """Count the steps of `block` from its first (every row holding a completion position in it commits one
        there), so that rollouts sampled in separate calls replay together."""
        block_steps = self.commit_step[:, block]
        first = torch.where(block_steps >= 0, block_steps, self.not_in_block).amin(dim=1, keepdim=True)
        self.first, self.started = first[:, 0], first[:, 0] < self.not_in_block  # a row's first commit in the block
        self.block, self.step_in_block = block, self.commit_step - first  # [B, T]: < 0 before the block
        steps = int(self.step_in_block[:, block].max()) + 1
        if self.edits is not None:
            self.edit_step = self.edits.step - first
            self.edit_in_block = ((self.edits.position >= 0) & (self.edit_position >= block.start)
                                  & (self.edit_position < block.stop))
            if bool(self.edit_in_block.any()):
                steps = max(steps, int(self.edit_step[self.edit_in_block].max()) + 1)
        self.steps_in_block = steps

    def written_at(self, step: int) -> torch.Tensor:
        """[B, Lb] bool: the positions of the current block committed or edited at its `step`."""
        written = self.step_in_block[:, self.block] == step
        if self.edits is None:
            return written
        edited = self.edit_in_block & (self.edit_step == step)
        marks = torch.zeros_like(self.commit_step).scatter_add_(1, self.edit_position, edited.long())
        return written | (marks[:, self.block] > 0)

    def canvas_before(self, step: int, mask_id: int) -> torch.LongTensor:
        """[B, T] the canvas the current block's `step` read."""
        tokens = (self.first_tokens if self.edits is None
                  else canvas_before_step(self.first_tokens, self.edits, self.edit_step, step))
        canvas = self.layout.canvas.scatter(1, self.layout.completion_index, tokens)
        return torch.where((self.step_in_block >= step) & self.in_completion, mask_id, canvas)
