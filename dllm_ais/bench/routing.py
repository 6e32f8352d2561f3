"""Routing disagreement between the rollout engine and the trainer of a mixture-of-experts model, per precision
notch, and what it does to the log-ratio: split routing against replayed routing and the unified flow.

    dllm-ais bench routing                                  # a tiny random LLaDA2 (below), every precision
    dllm-ais bench routing --precisions fp8,mxfp4 --prompts 32
    dllm-ais bench routing --models recipes/tiny_llada2_digits.yaml   # a trained MoE recipe, where one exists

For each notch, completions of validation prompts are sampled (temperature 1, no block cache) by the rollout engine,
and three arms of the trainer (float32) are compared with it, each on two kinds of canvas:

  split     the trainer routes every token by its own router (today's training);
  replayed  the trainer routes every token to the experts the engine chose on that forward (`EngineRouting`,
            `experimental.routing_replay`), the weights from its own router scores;
  unified   the trainer is the engine's model (`rollout.precision_flow: unified`): one set of numerics, sampled anew.

  one-step canvas   the one-step estimator's canvas (completion fully masked; the [x_t | x_0] forward of a
                    block-causal family): every completion position is a token;
  trajectory        the trajectory estimator's replay of the decoder's canvases: each completion position of a block
                    at a step that denoised it is a (position, step) token.

Figures: the share of (token, MoE layer) pairs whose selected expert SET differs between the engine and the experts
the trainer used, the share of tokens with such a layer; k3 (mean of ρ − log ρ − 1) and max |log ρ| over the sampled
tokens, log ρ = log π_trainer − log π_engine (the trajectory's π_engine: the sampler's record). The engine against
itself, which a replay by recomputation relies on: `engine replay Δ`, max |Δ log p| between the engine scoring the
trajectory again and its sampling record, and the share of (position, step, layer) whose experts differ between the
engine's sampling forward of a step and its replay of that step's canvas (the sampler's block-aligned canvas mapped
to the rollout's columns; one forward per step, so no parallel decoding).

The tiny random LLaDA2 (`--models random-llada2`): `RANDOM_LLADA2` below (3 layers, the first dense; 16 experts in 4
groups, 4 chosen among the best 2 groups; one shared expert; hidden 64; init std 0.1, router kaiming-uniform),
seeded by --seed, with the tokenizer, task and decoder of recipes/tiny_sdar_digits.yaml (block 4, 2 steps a block).
The routed experts are not quantized by the engine here (only the Linears: attention, dense and shared MLPs), so the
disagreement comes from the hidden states the router sees.
"""

from __future__ import annotations

import argparse
import copy
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from dllm_ais.bench.common import describe_device
from dllm_ais.bench.mismatch import ratio_statistics, validation_prompts, with_trajectory_estimator
from dllm_ais.config import load_config
from dllm_ais.engine import RolloutEngine
from dllm_ais.likelihood import one_step_masked_input
from dllm_ais.likelihood.logits import noisy_canvas_logits
from dllm_ais.loading import load_model, load_tokenizer
from dllm_ais.models import LLaDA2MoeConfig, LLaDA2MoeModelLM
from dllm_ais.likelihood.trajectory import trajectory_stages
from dllm_ais.models.routing import EngineRouting, RoutingTape, routed_layers, routing_tape, selection_differs
from dllm_ais.models.sdar import canvas_blocks
from dllm_ais.policy import build_policy
from dllm_ais.quantization import PRECISIONS

RANDOM_MODEL = "random-llada2"
RANDOM_MODEL_RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny_sdar_digits.yaml"
RANDOM_LLADA2 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, num_experts=16, num_shared_experts=1, num_experts_per_tok=4,
                     n_group=4, topk_group=2, moe_intermediate_size=32, first_k_dense_replace=1, block_size=4,
                     max_position_embeddings=512, rope_theta=10000.0, initializer_range=0.1)
ARMS = ("split", "replayed", "unified")
NO_CACHE = ["--rollout.cache=none", "--experimental.likelihood_decoder=exact"]


def random_llada2(tokenizer, seed: int) -> LLaDA2MoeModelLM:
    """The tiny random LLaDA2 (`RANDOM_LLADA2`) over `tokenizer`'s vocabulary and special tokens, float32, eval."""
    torch.manual_seed(seed)
    config = LLaDA2MoeConfig(vocab_size=len(tokenizer), mask_token_id=tokenizer.mask_token_id,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, **RANDOM_LLADA2)
    return LLaDA2MoeModelLM(config).eval()


@dataclass(frozen=True)
class RoutingFigures:
    """One arm on one kind of canvas: the disagreement shares and `ratio_statistics` of the sampled tokens."""

    pair_share: float
    token_share: float
    ratio: dict[str, float]


def denoised_tokens(input_ids: torch.Tensor, position_ids: torch.Tensor, prompt_length: int, block_size: int,
                    mask_token_id: int) -> torch.Tensor:
    """[B, T] bool over the noisy half of a block-diffusion forward's inputs [B, 2T] ([x_t | x_0]): the completion
    positions (index ≥ `prompt_length`) of the blocks (position id // `block_size`) still holding a mask token, i.e.
    the positions the decoder's forward of that step computed for the block it denoised."""
    length = input_ids.shape[1] // 2
    noisy, blocks = input_ids[:, :length], position_ids[:, :length] // block_size
    completion = torch.arange(length, device=input_ids.device) >= prompt_length
    masked = ((noisy == mask_token_id) & completion).long()
    has_mask = torch.zeros(len(noisy), int(blocks.max()) + 1, dtype=torch.long, device=noisy.device)
    has_mask = has_mask.scatter_reduce(1, blocks, masked, "amax")
    return completion & has_mask.gather(1, blocks).bool()


def disagreement(routing: EngineRouting, prompt_length: int, block_size: int, mask_token_id: int
                 ) -> tuple[float, float]:
    """(share of (token, layer) pairs, share of tokens with any layer) whose experts used by the trainer differ from
    the engine's, over the `denoised_tokens` of every forward `routing` saw."""
    pairs = []
    for forward in routing.forwards:
        length = forward.input_ids.shape[1] // 2
        counted = denoised_tokens(forward.input_ids, forward.position_ids, prompt_length, block_size, mask_token_id)
        pairs.append(forward.used_differs[:, :length][counted])
    pairs = torch.cat(pairs).float()
    return pairs.mean().item(), pairs.amax(dim=-1).mean().item()


def one_step_log_probs(model, rollout, mask_token_id: int, p_mask_prompt: float) -> torch.Tensor:
    """log π [B, L] of the sampled tokens on the one-step canvas (seed 0), as the one-step estimator scores them."""
    canvas = one_step_masked_input(rollout.sequences, rollout.attention_mask, rollout.prompt_length, mask_token_id,
                                   seed=0, p_mask_prompt=p_mask_prompt)
    columns = torch.arange(rollout.prompt_length, rollout.sequences.shape[1])
    logits = noisy_canvas_logits(model, canvas, rollout.completion_ids, rollout.attention_mask, columns)
    return logits.float().log_softmax(-1).gather(-1, rollout.completion_ids.unsqueeze(-1)).squeeze(-1)


def measure_arm(config, policy, trainer, engine, rollout, replay: bool) -> dict[str, RoutingFigures]:
    """The arm whose trainer is `trainer` (routing by `engine`'s selection with `replay`) on the one-step canvas and
    the trajectory replay of `rollout`, which `engine` sampled."""
    model_config = trainer.config
    shape = (rollout.prompt_length, model_config.block_size, model_config.mask_token_id)
    mask = rollout.completion_mask
    with torch.no_grad():
        engine_one_step = one_step_log_probs(engine, rollout, model_config.mask_token_id,
                                             config.likelihood.p_mask_prompt)
    figures = {}
    with torch.enable_grad(), EngineRouting(trainer, engine, replay) as routing:  # the trainer as ℓ_θ computes it
        trainer_one_step = one_step_log_probs(trainer, rollout, model_config.mask_token_id,
                                              config.likelihood.p_mask_prompt).detach()
    figures["one-step canvas"] = RoutingFigures(*disagreement(routing, *shape),
                                                ratio_statistics(trainer_one_step - engine_one_step, mask))
    with torch.enable_grad(), EngineRouting(trainer, engine, replay) as routing:
        trainer_trajectory = policy.logprobs(trainer, rollout, seed=0).detach()
    figures["trajectory"] = RoutingFigures(*disagreement(routing, *shape), ratio_statistics(
        trainer_trajectory - policy.rollout_logprobs(None, rollout, seed=0), mask))
    return figures


def sampler_completion_columns(prompt_mask: torch.Tensor, length: int, block_size: int
                               ) -> tuple[int, torch.Tensor]:
    """(canvas width, the columns [B, length] of each row's completion) of the block-causal sampler's block-aligned
    canvas (`dllm_ais.sampling.diffusion.block_aligned_layout`: the completion of a row with n real prompt tokens
    starts at ⌊P / block⌋·block + n mod block, the canvas is (⌊P / block⌋ + 1)·block + length wide)."""
    first_block = prompt_mask.shape[1] // block_size
    start = first_block * block_size + prompt_mask.long().sum(dim=1) % block_size
    return (first_block + 1) * block_size + length, start[:, None] + torch.arange(length)


def step_routing(tape: RoutingTape, rollout, stages: torch.Tensor, blocks: torch.Tensor, layers: int,
                 replayed: bool, block_size: int) -> torch.Tensor:
    """The experts [B, L, S, layers, top_k] (−1 where none) `tape` recorded for each completion position of a block
    at its round s (the block's s-th step, `trajectory_stages`): from the sampler's forwards (one per step, the
    whole canvas: the block of the tokens the step committed) or, `replayed`, from the trajectory replay's (one per
    round: the noisy half's blocks holding a token of that round)."""
    (batch, length), prompt = rollout.commit_step.shape, rollout.prompt_length
    calls = [torch.stack(tape.used[start:start + layers], dim=1) for start in range(0, len(tape.used), layers)]
    top_k = calls[0].shape[-1]
    routing = torch.full((batch, length, int(stages.max()) + 1, layers, top_k), -1, dtype=torch.long)
    rounds = torch.unique(stages).tolist() if replayed else list(range(len(calls)))
    if replayed:  # the replay's [x_t | x_0]: the completion at the rollout's own columns
        canvas_length, columns = 2 * rollout.sequences.shape[1], torch.arange(prompt, prompt + length).expand(batch, -1)
    else:
        canvas_length, columns = sampler_completion_columns(rollout.attention_mask[:, :prompt], length, block_size)
    if len(calls) != len(rounds) or any(call.shape[0] != batch * canvas_length for call in calls):
        raise ValueError("bench routing compares one forward per step (sampler) or round (replay), each one canvas "
                         "per row: sample without parallel decoding and replay one step per forward")
    for call, step in zip(calls, rounds):
        canvas = call.view(batch, canvas_length, layers, top_k)
        selected = canvas.gather(1, columns[..., None, None].expand(-1, -1, layers, top_k))
        for row in range(batch):
            scored = stages[row] == step if replayed else rollout.commit_step[row] == step
            if scored.any():
                denoised = torch.isin(blocks[row], blocks[row][scored])
                routing[row, denoised, int(stages[row][scored][0])] = selected[row, denoised]
    return routing


def sampled_routing_share(sampled: RoutingTape, replayed: RoutingTape, rollout, model) -> float:
    """The share of (position, step, layer) whose experts differ between the engine's sampling forward and its own
    trajectory replay of the same canvas."""
    layers = len(routed_layers(model))
    stages = trajectory_stages(model, rollout)
    blocks = canvas_blocks(rollout.attention_mask, rollout.sequences.shape[1], model.config.block_size)[
        :, rollout.prompt_length:]
    at_sampling, at_replay = (step_routing(tape, rollout, stages, blocks, layers, tape is replayed,
                                           model.config.block_size)
                              for tape in (sampled, replayed))
    both = (at_sampling[..., 0] >= 0) & (at_replay[..., 0] >= 0)
    return selection_differs(at_sampling[both], at_replay[both]).float().mean().item()


@dataclass(frozen=True)
class EngineSelfCheck:
    """How the engine's trajectory replay matches its own sampling: max |Δ log p| of the sampled tokens and the
    share of (position, step, layer) routed to other experts (module docstring)."""

    max_abs_log_prob: float
    routing_share: float


def measure_routing(config, model, policy, precision: str, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    seed: int) -> tuple[dict[str, dict[str, RoutingFigures]], EngineSelfCheck]:
    """({arm: {canvas: RoutingFigures}}, the engine's replay against its sampling) at `precision` (module
    docstring; no "unified" arm where the unified flow refuses the notch for this model); `policy` scores with the
    trajectory estimator, without a block cache."""
    arms = {}
    engine = RolloutEngine(model, precision=precision).model
    with routing_tape(engine, RoutingTape()) as sampled:
        rollout = policy.sample(engine, input_ids, attention_mask, torch.Generator().manual_seed(seed))
    with torch.no_grad(), routing_tape(engine, RoutingTape()) as replayed:
        engine_replay = (policy.logprobs(engine, rollout, seed=0) - policy.rollout_logprobs(None, rollout, seed=0))
    self_check = EngineSelfCheck(engine_replay[rollout.completion_mask].abs().max().item(),
                                 sampled_routing_share(sampled, replayed, rollout, engine))
    for arm in ("split", "replayed"):
        arms[arm] = measure_arm(config, policy, model, engine, rollout, replay=arm == "replayed")
    unified = copy.deepcopy(model)
    try:
        RolloutEngine(unified, precision=precision, precision_flow="unified")
    except NotImplementedError:  # a notch the unified flow does not compute for this model: no unified row
        return arms, self_check
    rollout = policy.sample(unified, input_ids, attention_mask, torch.Generator().manual_seed(seed))
    arms["unified"] = measure_arm(config, policy, unified, unified, rollout, replay=False)
    return arms, self_check


def figure_cells(figures: RoutingFigures) -> list[str]:
    return [f"{figures.pair_share:.4f}", f"{figures.token_share:.4f}", f"{figures.ratio['k3']:.2e}",
            f"{figures.ratio['max_abs_log_ratio']:.3f}"]


def load_bench_model(name: str, seed: int):
    """(config, tokenizer, model) of `name`: the tiny random LLaDA2, or a recipe's model."""
    recipe = RANDOM_MODEL_RECIPE if name == RANDOM_MODEL else name
    config = load_config(recipe, ["--output_dir=/tmp/unused", *NO_CACHE])
    tokenizer = load_tokenizer(config.model_name_or_path)
    model = (random_llada2(tokenizer, seed) if name == RANDOM_MODEL
             else load_model(config.model_name_or_path, torch.float32).eval())
    return config, tokenizer, model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="dllm-ais bench routing", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=RANDOM_MODEL,
                        help=f"comma-separated: {RANDOM_MODEL} (module docstring) or recipe paths of MoE models")
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"device: {describe_device(torch.device('cpu'))}, torch {torch.__version__}, float32 trainer; "
          f"{args.prompts} validation prompts per model, completions sampled by the engine at temperature 1, no "
          "block cache; shares: expert set used by the trainer ≠ the engine's")
    print("| model | precision | arm | one-step: (token, layer) differ | token differs | k3 | max abs log ρ "
          "| trajectory: (position, step, layer) differ | (position, step) differs | k3 | max abs log ρ "
          "| engine replay Δ | engine replay: (position, step, layer) differ |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.models.split(","):
        config, tokenizer, model = load_bench_model(name, args.seed)
        input_ids, attention_mask = validation_prompts(config, tokenizer, args.prompts, args.seed)
        policy = with_trajectory_estimator(build_policy(config, model.config, tokenizer, temperature=1.0))
        for precision in args.precisions.split(","):
            arms, self_check = measure_routing(config, model, policy, precision, input_ids, attention_mask, args.seed)
            for arm in ARMS:
                cells = (["—"] * 8 if arm not in arms  # the unified flow refused the notch
                         else figure_cells(arms[arm]["one-step canvas"]) + figure_cells(arms[arm]["trajectory"]))
                print(f"| {name} | {precision} | {arm} | " + " | ".join(cells)
                      + f" | {self_check.max_abs_log_prob:.2e} | {self_check.routing_share:.4f} |")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
