"""Where a sampling call's prompts and completions sit on its canvas, and the blocks it decodes in turn.

LLaDA and Dream decode `completion_layout` (the left-padded prompts, then the completion); a block-causal model
decodes `block_aligned_layout` (each prompt moved right by whole blocks, so that every row's blocks start at the same
canvas positions: the package docstring, "Block-causal models")."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from dllm_ais.rollout import PromptError, padding_or_none
from dllm_ais.sampling.diffusion.sampler_config import SpecialTokenIds

__all__ = ["CanvasLayout", "block_aligned_layout", "check_sampling_inputs", "completion_layout", "completion_window",
           "max_canvas_length"]


def max_canvas_length(model: Any) -> float:
    """The longest canvas the model takes (its config's max_sequence_length or max_position_embeddings; inf when it
    names neither)."""
    model_config = getattr(model, "config", None)
    return (getattr(model_config, "max_sequence_length", None) or getattr(model_config, "max_position_embeddings", None)
            or math.inf)


def check_sampling_inputs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                          generator: torch.Generator | None, token_ids: SpecialTokenIds, canvas_length: int) -> None:
    """Raise ValueError (`PromptError` for the prompts' content), before any forward pass, for prompts a sampling call
    on a canvas of `canvas_length` positions cannot complete."""
    if input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
        raise ValueError(f"input_ids must be a [batch, prompt_length] integer tensor, got {tuple(input_ids.shape)} "
                         f"{input_ids.dtype}.")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has {tuple(input_ids.shape)}: "
            "pass the mask the tokenizer returned with the left-padded prompts."
        )
    max_length = max_canvas_length(model)
    if canvas_length > max_length:
        raise PromptError(
            f"prompt length {input_ids.shape[1]} + its completion (a canvas of {canvas_length} positions) exceeds "
            f"the model's max_sequence_length={max_length}: truncate the prompts or lower gen_length."
        )
    if token_ids.block_causal and attention_mask is not None and bool((attention_mask.diff(dim=1) < 0).any()):
        raise ValueError("A block-causal model's prompts must be left-padded (attention_mask 0…0 1…1 per row): "
                         "tokenize them with padding_side='left'.")
    rows_with_mask = (input_ids == token_ids.mask).any(dim=1).nonzero().flatten().tolist()
    if rows_with_mask:
        raise PromptError(
            f"Prompts {rows_with_mask} contain the mask token id {token_ids.mask}, which the sampler would overwrite: "
            "remove it from the prompt text or check that mask_token_id is the model's mask token."
        )
    if generator is not None and generator.device.type != input_ids.device.type:
        raise ValueError(
            f"The generator is on {generator.device} but the prompts are on {input_ids.device}: create it with "
            f"torch.Generator(device={input_ids.device.type!r})."
        )


@dataclass(frozen=True)
class CanvasLayout:
    """Where one sampling call's prompts and completions sit on its canvas.

    canvas [B, T]: the prompt tokens, the mask id at every completion position, padding elsewhere; attention [B, T]
    (1 = a real token) or None when no row is padded; completion_index [B, L]: the canvas position of each completion
    position; blocks: the canvas slices decoded in turn; prompt_length: the canvas positions before the first block
    (classifier-free guidance masks them).

    LLaDA and Dream decode `completion_layout` (the left-padded prompts, then the completion); a block-causal model
    decodes `block_aligned_layout`.
    """

    canvas: torch.Tensor
    attention: torch.Tensor | None
    completion_index: torch.LongTensor
    blocks: list[slice]
    prompt_length: int

    def completion(self, values: torch.Tensor) -> torch.Tensor:
        """`values` [B, T, ...] laid out on the canvas, read at the completion positions: [B, L, ...]."""
        index = self.completion_index.view(*self.completion_index.shape, *[1] * (values.dim() - 2))
        return values.gather(1, index.expand(-1, -1, *values.shape[2:]))

    def on_canvas(self, values: torch.Tensor, fill: int | float | bool) -> torch.Tensor:
        """`values` [B, L] of the completion positions laid out on the canvas [B, T], `fill` elsewhere."""
        return values.new_full(self.canvas.shape, fill).scatter(1, self.completion_index, values)

    def completion_window(self, block: slice) -> slice | torch.LongTensor:
        """The completion positions of the canvas slice `block`: a slice when every row's completion starts at the same
        canvas position, else [B, Lb] indices, −1 where a row's position in the block is not a completion position
        (its prompt's tail, or past its completion)."""
        starts = self.completion_index[:, 0]
        if bool((starts == self.prompt_length).all()):
            return slice(block.start - self.prompt_length, block.stop - self.prompt_length)
        index = torch.arange(block.start, block.stop, device=starts.device) - starts[:, None]
        return index.masked_fill((index < 0) | (index >= self.completion_index.shape[1]), -1)


def completion_window(values: torch.Tensor, window: slice | torch.LongTensor) -> torch.Tensor:
    """`values` [B, L, ...] at a block's completion positions (`CanvasLayout.completion_window`): ``values[:, window]``
    for a slice; gathered at the [B, Lb] indices otherwise, position 0's value where the index is −1."""
    if isinstance(window, slice):
        return values[:, window]
    index = window.clamp_min(0).view(*window.shape, *[1] * (values.dim() - 2))
    return values.gather(1, index.expand(-1, -1, *values.shape[2:]))


def completion_layout(input_ids: torch.LongTensor, attention_mask: torch.Tensor | None, gen_length: int,
                      block_length: int, mask_id: int) -> CanvasLayout:
    """The canvas ``[left-padded prompts | MASK × gen_length]``, decoded in blocks of `block_length` from the
    prompts' end; `attention_mask` is the prompts' mask, None when no row is padded (`padding_or_none`)."""
    batch, prompt_length = input_ids.shape
    canvas = torch.cat([input_ids, input_ids.new_full((batch, gen_length), mask_id)], dim=1)
    attention = attention_mask
    if attention is not None:
        attention = torch.cat([attention, attention.new_ones((batch, gen_length))], dim=1)
    completion_index = prompt_length + torch.arange(gen_length, device=input_ids.device).expand(batch, -1)
    blocks = [slice(start, start + block_length) for start in range(prompt_length, prompt_length + gen_length,
                                                                    block_length)]
    return CanvasLayout(canvas, attention, completion_index, blocks, prompt_length)


def block_aligned_layout(input_ids: torch.LongTensor, attention_mask: torch.Tensor | None, gen_length: int,
                         block_length: int, mask_id: int, padding_id: int) -> CanvasLayout:
    """A block-causal model's canvas: each left-padded prompt moved so that its real tokens start at a multiple of
    `block_length`, hence every row's blocks (counted from its first real token) at the same canvas slices.

    With P the prompts' padded width, n_b ≤ P real prompt tokens in row b and J = ⌊P / block_length⌋, row b's
    completion starts at s_b = J·block_length + (n_b mod block_length), inside the first decoded block J, and its
    prompt at s_b − n_b (a multiple of `block_length`); the canvas holds (J + 1)·block_length + `gen_length`
    positions (one shape per prompt width, as the compiled engine's graphs want), `padding_id` (attention 0) before
    each prompt and after each completion. The blocks are the slices of `block_length` from J·block_length on; a
    block past every row's completion is left without a forward.
    """
    batch, width = input_ids.shape
    device = input_ids.device
    lengths = (attention_mask.long().sum(dim=1) if attention_mask is not None
               else torch.full((batch,), width, device=device))
    first_block = width // block_length
    completion_start = first_block * block_length + lengths % block_length
    total = (first_block + 1) * block_length + gen_length
    positions = torch.arange(total, device=device).expand(batch, -1)
    in_prompt = (positions >= (completion_start - lengths)[:, None]) & (positions < completion_start[:, None])
    in_completion = (positions >= completion_start[:, None]) & (positions < (completion_start + gen_length)[:, None])
    source = (positions + (width - completion_start)[:, None]).clamp(0, width - 1)
    canvas = torch.where(in_prompt, input_ids.gather(1, source), padding_id).masked_fill(in_completion, mask_id)
    attention = (in_prompt | in_completion).to(attention_mask.dtype if attention_mask is not None else torch.long)
    completion_index = completion_start[:, None] + torch.arange(gen_length, device=device)
    blocks = [slice(start, start + block_length) for start in range(first_block * block_length, total, block_length)]
    return CanvasLayout(canvas, padding_or_none(attention), completion_index, blocks, first_block * block_length)


