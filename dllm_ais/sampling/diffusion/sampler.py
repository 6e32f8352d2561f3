"""`MaskedDiffusionSampler`: the denoising loop over a canvas, its replays and its per-step stages (the package
docstring says what it decodes and records)."""

from __future__ import annotations

import copy
import dataclasses
from contextlib import nullcontext
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dllm_ais.rollout import Rollout, completion_mask_through_first_eos, padding_or_none
from dllm_ais.sampling.diffusion.cache import BLOCK_CAUSAL_CACHE, BlockCache, forward_logits
from dllm_ais.sampling.diffusion.canvas import (CanvasLayout, block_aligned_layout, check_sampling_inputs,
                                                completion_layout, completion_window, max_canvas_length)
from dllm_ais.sampling.diffusion.choice import COMMIT_CHOICE, ChoiceRecord, CommitChoiceReplay
from dllm_ais.sampling.diffusion.draw import gumbel_argmax, sampling_logprobs
from dllm_ais.sampling.diffusion.editing import EDITS, EditLog, ReplayedWrites, denoise_block_with_edits
from dllm_ais.sampling.diffusion.routing_record import ROUTING, RecordedRouting, RoutingLog, routing_log
from dllm_ais.sampling.diffusion.rules import checked_scores, resolve_remasking_rule
from dllm_ais.sampling.diffusion.sampler_config import DiffusionSamplerConfig, SpecialTokenIds, resolve_special_tokens
from dllm_ais.sampling.diffusion.schedule import scheduled_counts, scheduled_floor, transfer_schedule
from dllm_ais.sampling.diffusion.step import DecoderStep, DenoiseStep, denoise_step, top_ranked_positions
from dllm_ais.sampling.forwards import EagerForwards, bucketed_prompt_length

__all__ = ["MaskedDiffusionSampler"]


@dataclass
class _Denoising:
    """The state of one denoising call: the canvas and its records [B, T] (each committed position's step and
    log-prob), the rows' step counts, the global step index (the rows step in lockstep), the block cache, the
    commit-choice record (a stochastic commit rule's, else None), the edits (a token-editing decoder's, else None),
    the even schedule's counts for a whole block (`transfer_schedule`) and the routing log (`record_routing`, else
    None)."""

    forwards: EagerForwards
    layout: CanvasLayout
    token_ids: SpecialTokenIds
    generator: torch.Generator | None
    forced_canvas: torch.LongTensor | None
    step_logprobs: torch.Tensor
    commit_step: torch.LongTensor
    num_steps: torch.LongTensor
    cache: BlockCache | None
    choice: ChoiceRecord | None
    edits: EditLog | None
    block_schedule: list[int]
    routing: RoutingLog | None = None
    step: int = 0

    @property
    def canvas(self) -> torch.LongTensor:
        return self.layout.canvas


class MaskedDiffusionSampler:
    """The LLaDA masked-diffusion sampler, returning a `Rollout` with per-step unmasking log-probs.

    Usage::

        sampler = MaskedDiffusionSampler(DiffusionSamplerConfig(gen_length=256, block_length=32, steps=128,
                                                                temperature=0.9, mask_token_id=126336))
        rollout = sampler.sample(model, input_ids, attention_mask, generator=torch.Generator("cuda").manual_seed(0))

    To change one stage of a step, subclass and override `block_logits`, `propose_tokens` or `choose_positions`
    (see the module docstring for what the trainer requires of a subclass).
    """

    def __init__(self, config: DiffusionSamplerConfig):
        self.config = config
        self.remasking_rule = resolve_remasking_rule(config.remasking)

    def resolve_token_ids(self, model: Any) -> SpecialTokenIds:
        """The token ids and family facts of a call on `model` (`resolve_special_tokens`)."""
        return resolve_special_tokens(self.config, model)

    def check_inputs(self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                     generator: torch.Generator | None, token_ids: SpecialTokenIds) -> None:
        """Raise ValueError, before any forward pass, for prompts this sampler cannot complete
        (`check_sampling_inputs`)."""
        check_sampling_inputs(model, input_ids, attention_mask, generator, token_ids,
                              self.canvas_length(input_ids.shape[1], token_ids))

    @torch.no_grad()
    def sample(
        self,
        model: Any,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        forwards: EagerForwards | None = None,
    ) -> Rollout:
        """Complete left-padded prompts `input_ids` [B, P] by masked diffusion; all randomness from `generator`.

        `attention_mask` [B, P] marks real prompt tokens (1) against padding (0); it is extended with ones over the
        completion and given to every forward. Without it the model attends to every position, as LLaDA does.
        `forwards`: how the model's sampling forwards run (`dllm_ais.sampling.forwards`; the rollout engine hands
        its own); None = `EagerForwards` of `model`.
        """
        return self._denoise(forwards or EagerForwards(model), input_ids, attention_mask, generator)

    @torch.no_grad()
    def replay(self, model: Any, rollout: Rollout, generator: torch.Generator | None = None) -> Rollout:
        """The order in which this sampler would commit `rollout`'s completion tokens, teacher-forced.

        The denoising loop runs with this sampler's stages (logits, cache, remasking rule, schedule or parallel
        rule) but every candidate is the token the completion already holds, scored by `token_logprobs`. The result
        has the same sequences, with `commit_step`, `step_logprobs` and `num_steps` of this sampler's order: e.g. a
        fast-sampled completion replayed along the exact decoder's order (low confidence under `model`'s logits,
        ``steps`` commits on its fixed schedule), so a trajectory-type estimator trains at the canvas states that
        decoder visits.
        """
        if self.config.editing_threshold is not None:
            raise ValueError("replay teacher-forces one token per position, but a token-editing decoder "
                             "(editing_threshold) writes a position more than once: score its rollouts along "
                             "decoder_logits (the trajectory estimator's decoder replay)")
        attention_mask = rollout.attention_mask[:, :rollout.prompt_length]
        replayed = self._denoise(EagerForwards(model), rollout.prompt_ids, attention_mask, generator, rollout.completion_ids)
        return dataclasses.replace(replayed, completion_mask=rollout.completion_mask)

    def _denoise(
        self,
        forwards: EagerForwards,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None,
        generator: torch.Generator | None,
        forced_completion: torch.LongTensor | None = None,
    ) -> Rollout:
        """The denoising loop of `sample`; with `forced_completion` [B, L] its candidates are those tokens. Forwards at
        static shapes (the compiled engine's) get the prompts left-padded to a length bucket first, and the padding is
        cut off the rollout."""
        model = forwards.model
        token_ids = self.resolve_token_ids(model)
        self.check_inputs(model, input_ids, attention_mask, generator, token_ids)
        bucket_padding = 0
        if forwards.static_shapes:
            bucket_padding = bucketed_prompt_length(input_ids.shape[1]) - input_ids.shape[1]
            if self.canvas_length(input_ids.shape[1] + bucket_padding, token_ids) > max_canvas_length(model):
                bucket_padding = 0
            if bucket_padding:
                real = torch.ones_like(input_ids) if attention_mask is None else attention_mask
                attention_mask = F.pad(real, (bucket_padding, 0), value=0)
                input_ids = F.pad(input_ids, (bucket_padding, 0), value=token_ids.eos[0])
        rollout = self._denoise_canvas(forwards, input_ids, attention_mask, generator, token_ids, forced_completion)
        if not bucket_padding:
            return rollout
        return dataclasses.replace(
            rollout, sequences=rollout.sequences[:, bucket_padding:],
            attention_mask=rollout.attention_mask[:, bucket_padding:], prompt_length=rollout.prompt_length - bucket_padding)

    def canvas_length(self, prompt_length: int, token_ids: SpecialTokenIds) -> int:
        """The canvas length of `canvas_layout` for prompts `prompt_length` wide: prompt + completion, up to a block
        more for a block-causal model (`block_aligned_layout`)."""
        block = self.config.block_length
        if token_ids.block_causal:
            return (prompt_length // block + 1) * block + self.config.gen_length
        return prompt_length + self.config.gen_length

    def canvas_layout(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None,
                      token_ids: SpecialTokenIds) -> CanvasLayout:
        """The canvas a sampling or replay call of these prompts decodes (`attention_mask` None when no row is
        padded): `block_aligned_layout` for a block-causal model, `completion_layout` otherwise."""
        config = self.config
        if token_ids.block_causal:
            return block_aligned_layout(input_ids, attention_mask, config.gen_length, config.block_length,
                                        token_ids.mask, token_ids.eos[0])
        return completion_layout(input_ids, attention_mask, config.gen_length, config.block_length, token_ids.mask)

    def routing_replay(self, model: Any, rollout: Rollout) -> RecordedRouting | None:
        """What `decoder_logits` forces on `model`'s forwards: `rollout`'s routing record (`routing_record`), None
        when it holds none."""
        record = rollout.records.get(ROUTING)
        return None if record is None else RecordedRouting(model, record)

    def block_cache(self, token_ids: SpecialTokenIds, sampling: bool = True) -> BlockCache | None:
        """A fresh cache for one sampling call (`sampling`, in `config.cache_dtype`) or replay (in the model's dtype):
        a block-causal model's exact cache whatever the mode, none with ``cache="none"``."""
        if self.config.cache == "none":
            return None
        if token_ids.block_causal:
            return BlockCache(BLOCK_CAUSAL_CACHE)
        return BlockCache(self.config.cache, self.config.cache_dtype if sampling else "none")

    def _denoise_canvas(self, forwards: EagerForwards, input_ids: torch.LongTensor,
                        attention_mask: torch.Tensor | None, generator: torch.Generator | None,
                        token_ids: SpecialTokenIds, forced_completion: torch.LongTensor | None) -> Rollout:
        """The denoising loop over the canvas of `canvas_layout` (``[input_ids | MASK x gen_length]`` but for a
        block-causal model), block by block, its records mapped back to the rollout's ``[input_ids | completion]``.

        Host synchronisation: none per step with the fixed schedules (every row of a fresh block holds
        `block_length` masked positions, so the counts are known on the host), except ``origin``'s random counts;
        with parallel decoding, one per block, and one per step a block runs past its budget (the steps of the
        block before it: `_denoise_block_in_parallel`); one per call for a block-causal model (its rows' masked
        positions per block).

        Sharded forwards (`EagerForwards.shared`, FSDP2): each of those reads goes through `EagerForwards.agreed`, so
        that every process runs the same forwards (a block none of a process's rows needs, or steps past its rows'
        last commits, run there and commit nothing); of the fixed schedule, only ``origin``'s random counts then
        read, per step, the most any process commits (`_denoise_block_on_schedule`)."""
        config, device = self.config, input_ids.device
        prompt_attention = padding_or_none(attention_mask)
        layout = self.canvas_layout(input_ids, prompt_attention, token_ids)
        shape = layout.canvas.shape
        state = _Denoising(
            forwards, layout, token_ids, generator,
            None if forced_completion is None else layout.on_canvas(forced_completion, token_ids.mask),
            torch.zeros(shape, dtype=torch.float32, device=device), torch.full(shape, -1, dtype=torch.long,
                                                                                device=device),
            torch.zeros(shape[0], dtype=torch.long, device=device), self.block_cache(token_ids),
            ChoiceRecord.empty(shape, self, device) if config.position_temperature > 0 else None,
            None if config.editing_threshold is None else EditLog(),
            transfer_schedule(torch.tensor([config.block_length]), config.steps_per_block)[0].tolist(),
            routing_log(config, forwards, layout, token_ids))
        # Per block, per row, its masked positions (fewer than block_length in a block-causal model's first and last
        # blocks), and per block the most a row of any process holds: read once, before the loop, so that no block
        # waits on the device for them.
        if not token_ids.block_causal:
            masked_per_block = [[config.block_length] * shape[0]] * len(layout.blocks)
            busiest = [config.block_length] * len(layout.blocks)
        else:
            masked = torch.stack([layout.canvas[:, block] == token_ids.mask for block in layout.blocks],
                                 dim=1).sum(dim=2)  # [B, blocks]
            per_block = torch.cat([masked.T, forwards.agreed(masked.amax(dim=0))[:, None]], dim=1).tolist()
            masked_per_block, busiest = [row[:-1] for row in per_block], [row[-1] for row in per_block]
        budget = None  # parallel decoding's steps before a block's first read: the steps the block before needed

        for block, masked_left, most_masked in zip(layout.blocks, masked_per_block, busiest):
            if most_masked == 0:  # a block past every row's completion (on every process): no forward
                continue
            if config.editing_threshold is not None:
                denoise_block_with_edits(self, state, block)
            elif config.parallel_decoding:
                budget = self._denoise_block_in_parallel(state, block, budget)
            else:
                self._denoise_block_on_schedule(state, block, masked_left, most_masked)
            if config.stop_at_eos and self.completions_final(layout.completion(layout.canvas), token_ids, forwards):
                break
        completion = layout.completion(layout.canvas)
        sequences = torch.cat([input_ids, completion], dim=1)
        return Rollout(
            sequences=sequences,
            attention_mask=(torch.ones_like(sequences) if prompt_attention is None else
                            torch.cat([prompt_attention, prompt_attention.new_ones(completion.shape)], dim=1)),
            completion_mask=self.completion_mask(completion, token_ids),
            step_logprobs=layout.completion(state.step_logprobs),
            commit_step=layout.completion(state.commit_step),
            prompt_length=input_ids.shape[1],
            num_steps=state.num_steps,
            records={**({} if state.choice is None else {COMMIT_CHOICE: state.choice.record(layout)}),
                     **({} if state.edits is None else {EDITS: state.edits.record(layout.completion_index, shape[1])}),
                     **({} if state.routing is None else {ROUTING: state.routing.record(shape[0], device)})},
        )

    def completion_mask(self, completion: torch.LongTensor, token_ids: SpecialTokenIds) -> torch.Tensor:
        """[B, L] bool: each completion position up to its first stop token (inclusive) and before
        `config.completion_length`."""
        mask = completion_mask_through_first_eos(completion, token_ids.eos)
        if self.config.completion_length is not None:
            mask[:, self.config.completion_length:] = False
        return mask

    def completions_final(self, completion: torch.LongTensor, token_ids: SpecialTokenIds,
                          forwards: EagerForwards | None = None) -> bool:
        """Whether every row of `completion` [B, L] (the canvas so far) is final: no mask id in its completion mask
        (`stop_at_eos`); with sharded `forwards`, every row of every process (`EagerForwards.agreed`). One host
        read."""
        final = ~((completion == token_ids.mask) & self.completion_mask(completion, token_ids)).any().reshape(1)
        return bool((final if forwards is None else forwards.agreed(final, "min"))[0])

    def _denoise_block_on_schedule(self, state: _Denoising, block: slice, masked_left: list[int],
                                   most_masked: int) -> None:
        """Fill `block` in the fixed schedule's steps (`schedule.scheduled_counts`), the counts known on the host; a step at
        which no row commits runs no forward (the official loops run one that commits nothing). Sharded forwards
        (`EagerForwards.shared`): where another process's rows commit, the step runs its forward here too
        (`_idle_forward`), uncounted, so this process's steps, draws and records are those it makes alone."""
        config = self.config
        still_masked = state.canvas[:, block] == state.token_ids.mask
        forwards_in_block = 0
        # What any row of any process commits at a step: the count of a row holding `most_masked` (the block's most
        # masked positions on every process; a schedule's count grows with the positions left), on the host; only
        # origin's random counts ask every process, at each step, when sharded.
        busiest_left = most_masked
        for step_in_block in range(config.steps_per_block):
            counts = scheduled_counts(config, masked_left, state.block_schedule, step_in_block, state.generator)
            most = busiest = max(counts)
            if config.remasking == "origin":
                if state.forwards.shared:
                    busiest = int(state.forwards.agreed(torch.tensor([most], device=still_masked.device))[0])
            else:
                busiest = scheduled_counts(config, [busiest_left], state.block_schedule, step_in_block, None)[0]
                busiest_left -= busiest
            if most == 0:
                if busiest > 0:
                    self._idle_forward(state, block, forwards_in_block)
                continue
            step = self.write_step(state, block, still_masked, forwards_in_block, width=max([*masked_left, 1]),
                                   counts=counts)
            forwards_in_block += 1
            still_masked &= ~step.commit
            masked_left = [max(left - count, 0) for left, count in zip(masked_left, counts)]

    def _denoise_block_in_parallel(self, state: _Denoising, block: slice, budget: int | None) -> int:
        """Fill `block` by parallel decoding (threshold or factor: each step commits at least one position per row
        holding one) with its counts on the device, in runs of steps without a host read, each followed by one read
        of the masked positions left in the block's slowest row. With a `budget` (the steps the block before needed)
        the first run is that many steps and a second, when needed, as many as the positions left (each step commits
        at least one): two reads at most. Without one (the first block), one step, then half the positions left at a
        time (`_next_run`). A step past a row's last commit commits nothing, so the tokens are those of stepping until the block is
        filled. Returns the steps the block needed (the next block's budget)."""
        config = self.config
        still_masked = state.canvas[:, block] == state.token_ids.mask
        block_schedule = state.block_schedule
        steps_needed = torch.zeros((), dtype=torch.long, device=still_masked.device)
        forwards_in_block, run = 0, budget or 1
        while run > 0:
            for _ in range(run):
                floor = None
                if state.token_ids.block_causal:  # SDAR's low_confidence_dynamic: at least the schedule's count
                    scheduled = block_schedule[forwards_in_block] if forwards_in_block < len(block_schedule) else 0
                    floor = scheduled_floor(config, still_masked, scheduled, forwards_in_block)
                steps_needed = steps_needed + still_masked.any()
                step = self.write_step(state, block, still_masked, forwards_in_block, width=config.block_length,
                                       floor=floor)
                forwards_in_block += 1
                still_masked &= ~step.commit
            left, needed = state.forwards.agreed(  # the host read
                torch.stack([still_masked.sum(dim=1).max(), steps_needed])).tolist()
            run = self._next_run(left, budget)
        return needed

    def _idle_forward(self, state: _Denoising, block: slice, forwards_in_block: int) -> None:
        """The forward of `block` a step of sharded forwards runs where none of this process's rows commits (another
        process's do): the logits discarded, nothing committed, the step not counted. Its cache refresh (the step's
        own) reads the canvas the next counted step reads, so that step's cache is what it would be without it."""
        if state.cache is not None:
            state.cache.refresh = self.config.refreshes_cache(forwards_in_block)
        self.block_logits(state.forwards, state.canvas, state.layout.attention, state.layout.prompt_length, block,
                          state.token_ids, state.cache)

    @staticmethod
    def _next_run(left: int, budget: int | None) -> int:
        """The steps of a block's next run, `left` masked positions in its slowest row: all of them after a budget
        (the block before it says its pace), half of them (rounded up) in the first block. 0 once it is filled."""
        return left if budget else -(-left // 2)

    def write_step(self, state: _Denoising, block: slice, still_masked: torch.Tensor, forwards_in_block: int,
                   **commit_rule: Any) -> DenoiseStep:
        """One step of `block` of a sampling call (`state`; the block loops and the editing decoder call it): its
        forward (refreshing the cache where `refreshes_cache` says), `denoise_step`, and the commits written to the
        canvas and its records (`commit_rule`: denoise_step's width, counts, floor)."""
        config, canvas = self.config, state.canvas
        if state.cache is not None:
            state.cache.refresh = config.refreshes_cache(forwards_in_block)
        with nullcontext() if state.routing is None else state.routing.forward(state.step, block):
            logits = self.block_logits(state.forwards, canvas, state.layout.attention, state.layout.prompt_length,
                                       block, state.token_ids, state.cache)
        forced = None if state.forced_canvas is None else state.forced_canvas[:, block]
        step = denoise_step(self, logits, canvas[:, block], still_masked, state.generator, forced_tokens=forced,
                            row=(canvas.shape[1], block), rank=state.choice is not None, **commit_rule)
        if state.choice is not None:
            state.choice.add_step(block, forwards_in_block, step, still_masked)
        commit = step.commit
        canvas[:, block] = torch.where(commit, step.candidates, canvas[:, block])
        state.step_logprobs[:, block] = torch.where(commit, step.logprobs, state.step_logprobs[:, block])
        state.commit_step[:, block].masked_fill_(commit, state.step)
        state.num_steps += commit.any(dim=1)
        state.step += 1
        return step

    def rule_scores(self, logits: torch.Tensor, candidates: torch.Tensor,
                    generator: torch.Generator | None) -> torch.Tensor:
        """The remasking rule's scores [B, Lb] of a block from its logits [B, Lb, V] and candidates [B, Lb]
        (`rule_logits`)."""
        return checked_scores(self.remasking_rule(self.rule_logits(logits), candidates, generator), candidates)

    def rule_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits the remasking rule reads: logits / τ (τ > 0) for a rule marked `scores_sampling_distribution`,
        the logits themselves otherwise."""
        if getattr(self.remasking_rule, "scores_sampling_distribution", False) and self.config.temperature > 0:
            return logits / self.config.temperature
        return logits

    @torch.no_grad()
    def choice_logprobs(self, model: Any, rollout: Rollout) -> torch.Tensor:
        """float32 [B, L]: `model`'s log-probability of `rollout`'s recorded commit choices (and discarded
        candidates, when recorded) (`choice.CommitChoiceRecord`), per position as the sampler records it: each step replayed by `decoder_logits` (this sampler's cache, as sampled) and
        scored by `commit_choice_replay`. On the model that sampled, this is the recorded log-probs; with
        the trajectory estimator's token log-probs it completes the ratio of the two samplers."""
        replay = self.commit_choice_replay(rollout)
        result = torch.zeros(rollout.completion_ids.shape, dtype=torch.float32, device=rollout.completion_ids.device)
        for step in self.decoder_logits(model, rollout):
            result = result + replay(step.window, step.written, step.logits)
        return result

    def commit_choice_replay(self, rollout: Rollout) -> CommitChoiceReplay:
        """The scorer of `rollout`'s recorded commit choices, step by step along `decoder_logits`
        (`dllm_ais.sampling.diffusion.choice.CommitChoiceReplay`)."""
        return CommitChoiceReplay(self, rollout)

    def decoder_logits(self, model: Any, rollout: Rollout, positions: torch.Tensor | None = None
                       ) -> Iterator[DecoderStep]:
        """The logits each completion token of `rollout` was drawn from, recomputed as this sampler computed them
        while sampling: step by step along `rollout.commit_step`, by `block_logits` with this sampler's block cache
        rebuilt at the steps where sampling rebuilt it (`DiffusionSamplerConfig.refreshes_cache`), so a cached
        step attends to the keys/values of the canvas at its block's last refresh. Under grad when grad is enabled.

        Yields, for each step that writes a token or refreshes the cache, a `DecoderStep` ``(window, written, logits,
        tokens)``: `window` the completion positions of the current block (a slice; for a block-causal model whose
        rows' completions start at different offsets in their blocks, [B, Lb] indices with −1 where a row's block
        position is no completion position: `CanvasLayout.completion_window`, read with `completion_window`),
        `written` [B, Lb] the block positions committed (or, with token editing, edited) at that step, `logits`
        [B, Lb, V] of the block, `tokens` [B, Lb] the block after the step. With token editing the canvas of a step
        holds each position's first commit and its edits before the step (`ReplayedWrites`). The steps of a block come in
        order, and a block's steps share its cache (a caller that backpropagates block by block keeps one block's
        graph at a time). Lazy: a forward runs when its step is asked for.

        A row's steps are counted from its block's first step (every row commits at least one token then), so
        rollouts sampled in separate calls, whose global step indices differ, replay together. Without a cache this
        is the trajectory replay, one full forward per step. With `positions` [B, L] bool, a block holding none of
        them is skipped (no forward): a block's replay needs its own steps and cache only.

        A block-causal model's exact cache of finished blocks is written along as sampling wrote it, forward for
        forward; under grad it is rebuilt at each block's first step instead (a forward of the canvas up to the
        block: the same logits to rounding), so that each block's graph holds its own cache and a caller that
        backpropagates block by block never reaches into a freed one.

        A rollout holding a routing record (`record_routing`) has every forward here route each token to the experts
        sampling used for it (`routing_replay`, `dllm_ais.sampling.diffusion.routing_record`): a block position at its
        step, an earlier position at the forward that wrote its final keys/values, so the rebuild under grad routes
        as sampling's forwards did.

        The replay keeps its cache in the model's dtype whatever `cache_dtype` says: FP8 storage is an approximation
        of the rollout engine, which the importance ratio (the sampler's recorded log-probs against this replay)
        sees like the engine's weight precision; the trainer's ℓ_old and ℓ_θ are the same replay.

        A model sharded by FSDP2 (`EagerForwards.shared`) replays on every process the same forwards: a block's steps
        the most any process's rows need, a step wherever a row of any process writes (or the cache refreshes), a
        block wherever any process holds one of `positions`; a step writing nothing on this process yields
        `written` all False.
        """
        token_ids = self.resolve_token_ids(model)
        if rollout.gen_length != self.config.gen_length:
            raise ValueError(f"decoder_logits got completions of {rollout.gen_length} positions; this sampler decodes "
                             f"gen_length={self.config.gen_length}")
        prompt_attention = padding_or_none(rollout.attention_mask[:, :rollout.prompt_length])
        layout = self.canvas_layout(rollout.prompt_ids, prompt_attention, token_ids)
        writes = ReplayedWrites(layout, rollout)
        in_completion = layout.on_canvas(torch.ones_like(rollout.commit_step, dtype=torch.bool), False)
        cache = self.block_cache(token_ids, sampling=False)
        forwards = EagerForwards(model)
        routing = self.routing_replay(model, rollout)
        for block_index, block in enumerate(layout.blocks):
            window = layout.completion_window(block)
            if positions is not None and not bool(forwards.agreed(
                    (completion_window(positions, window) & in_completion[:, block]).any().reshape(1))[0]):
                continue
            if cache is not None and token_ids.block_causal and torch.is_grad_enabled():
                cache = self.block_cache(token_ids, sampling=False)  # rebuilt by this block: its own graph
            writes.start_block(block)
            steps_in_block, writes_anywhere = writes.steps_in_block, None
            if forwards.shared:  # every process replays the same steps: the most any needs, each one any writes at
                steps_in_block = int(forwards.agreed(torch.tensor([steps_in_block], device=layout.canvas.device))[0])
                writes_anywhere = forwards.agreed(torch.stack(
                    [writes.written_at(step).any() for step in range(steps_in_block)]
                    or [torch.zeros((), dtype=torch.bool, device=layout.canvas.device)])).tolist()
            for step in range(steps_in_block):
                written = writes.written_at(step)
                refresh = cache is not None and self.config.refreshes_cache(step)
                if not (refresh or (bool(written.any()) if writes_anywhere is None else writes_anywhere[step])):
                    continue
                if cache is not None:
                    cache.refresh = refresh
                with (nullcontext() if routing is None
                      else routing.forward(block_index, block, step, writes.first, writes.started)):
                    logits = self.block_logits(forwards, writes.canvas_before(step, token_ids.mask), layout.attention,
                                               layout.prompt_length, block, token_ids, cache)
                yield DecoderStep(window, written, logits, writes.canvas_before(step + 1, token_ids.mask)[:, block])

    def block_logits(
        self,
        forwards: EagerForwards,
        canvas: torch.LongTensor,
        attention_mask: torch.Tensor | None,
        prompt_length: int,
        block: slice | torch.Tensor,
        token_ids: SpecialTokenIds,
        cache: BlockCache | None = None,
    ) -> torch.Tensor:
        """Logits [B, K, V] at the positions `block` of `canvas` [B, T], run through `forwards`
        (`dllm_ais.sampling.forwards`): while sampling, the current block (a slice; one forward over the whole
        canvas, or with a `cache` (``config.cache`` = prefix | dual) its
        `BlockCache.block_forward`); while scoring (`scoring_logits`), a 1-D tensor of canvas positions, no cache.

        With cfg_scale s > 0 the canvas and a copy with every prompt position (padding included) set to the mask id
        run as one [2B] forward (the cache then holds both halves), and ``logits = u + (s + 1)(c − u)``. For a
        shifted family (``token_ids.logits_shifted``) the logits predicting position i are the forward's at i − 1.

        An override (another guidance, a logit bias, ...) must handle both kinds of `block` (``logits[:, block]``
        and ``canvas[:, block]`` do) and is scored exactly as it samples: the likelihood estimators call it through
        `scoring_logits`.
        """
        scale = self.config.cfg_scale
        inputs, inputs_attention = canvas, attention_mask
        if scale > 0:
            prompt_masked = canvas.clone()
            prompt_masked[:, :prompt_length] = token_ids.mask
            inputs = torch.cat([canvas, prompt_masked])
            inputs_attention = None if attention_mask is None else attention_mask.repeat(2, 1)
        if cache is None:
            logits = forward_logits(forwards, inputs, inputs_attention, block, token_ids.logits_shifted)
        else:
            logits = cache.block_forward(forwards, inputs, inputs_attention, block, token_ids.logits_shifted)
        if scale > 0:
            conditional, unconditional = logits.chunk(2)
            logits = unconditional + (scale + 1) * (conditional - unconditional)
        return logits

    def scoring_logits(
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        logits_to_keep: torch.Tensor | int,
    ) -> torch.Tensor:
        """The likelihood estimators' ``logits_fn`` (`dllm_ais.likelihood.LogitsFn`): logits [B, K, V] at the kept
        positions of canvases `input_ids` [B, P + gen_length], computed by `block_logits` as sampling computes them
        (guidance and any subclass's logit processing included), without a cache: the trainer side scores the exact
        policy, and a cache's approximation stays visible in the ratio.

        `logits_to_keep` is the number of last positions (the one-step surrogate: the whole completion) or a 1-D
        tensor of canvas positions (the trajectory replay: the positions committed at the replayed steps). The prompt
        (what guidance masks for its unconditional half) is everything before the last ``config.gen_length``
        positions.
        """
        total_length = input_ids.shape[1]
        prompt_length = total_length - self.config.gen_length
        if prompt_length < 1:
            raise ValueError(
                f"scoring_logits got canvases of {total_length} positions, but this sampler completes "
                f"gen_length={self.config.gen_length} positions after a prompt: score rollouts of this sampler."
            )
        positions = logits_to_keep
        if not isinstance(positions, torch.Tensor):
            first = total_length - positions if positions else 0
            positions = torch.arange(first, total_length, device=input_ids.device)
        return self.block_logits(EagerForwards(model), input_ids, attention_mask, prompt_length, positions,
                                 self.resolve_token_ids(model))

    def with_config(self, config: DiffusionSamplerConfig) -> "MaskedDiffusionSampler":
        """This sampler (its class and stages) with other settings, e.g. greedy for evaluation or without cache and
        parallel decoding for an exact-order replay: a shallow copy holding `config`. A subclass whose ``__init__``
        derives state from its config overrides this."""
        copied = copy.copy(self)
        copied.config = config
        copied.remasking_rule = resolve_remasking_rule(config.remasking)
        return copied

    def propose_tokens(self, logits: torch.Tensor, generator: torch.Generator | None) -> tuple[torch.LongTensor, torch.Tensor]:
        """Candidate x̂ [B, M] drawn from softmax(logits / τ) (argmax at τ = 0) and its float32 log-prob [B, M].

        `logits` [B, M, V] are those of the block's still-masked positions (rows with fewer than M masked positions
        are completed with committed ones, whose candidates are ignored).
        """
        candidates = gumbel_argmax(logits, self.config.temperature, generator)
        return candidates, self.token_logprobs(logits, candidates)

    def token_logprobs(self, logits: torch.Tensor, tokens: torch.LongTensor) -> torch.Tensor:
        """float32 log-prob [B, M] of `tokens` under the distribution `propose_tokens` draws from: softmax(logits / τ)
        (a subclass that changes the draw, e.g. to top-p, changes this with it; `replay` scores with it)."""
        return sampling_logprobs(logits, tokens, self.config.temperature)

    def choose_positions(self, scores: torch.Tensor, counts: list[int] | torch.Tensor) -> torch.Tensor:
        """[B, T] bool: per row b, the `counts[b]` top-scored positions of the full canvas row.

        `scores` [B, T] is −∞ everywhere but the current block's masked positions. With the fixed schedule's counts
        (a host list) the selection is ``torch.topk(scores[b], counts[b])`` over the full row, as in the official
        implementation, so ties are broken identically; rows sharing a count go through one batched topk (each row is
        an independent slice). With parallel decoding the counts
        [B] come from `parallel_commit_counts` and stay on the device (`top_ranked_positions`: the top-`counts[b]`
        positions, those above the threshold or the factor rule's n).
        An override must choose at least `counts[b]` positions per row (while that many are masked): the schedule
        fills each block in its steps on that assumption.
        """
        if isinstance(counts, torch.Tensor):
            return top_ranked_positions(scores, counts)
        chosen = torch.zeros_like(scores, dtype=torch.bool)
        distinct_counts = set(counts)
        for count in distinct_counts - {0}:
            if len(distinct_counts) == 1:
                chosen.scatter_(1, scores.topk(count, dim=1).indices, True)
            else:
                rows = torch.tensor([b for b, c in enumerate(counts) if c == count], device=scores.device)
                top = scores.index_select(0, rows).topk(count, dim=1).indices
                chosen[rows] = chosen[rows].scatter(1, top, True)
        return chosen
