"""Benchmark of fast diffusion rollouts: block KV cache, parallel decoding and autoregressive order, side by side.

Every variant is the one `MaskedDiffusionSampler`, configured by its own `DiffusionSamplerConfig`, greedy
(temperature 0), on the test prompts of a recipe's task and model (`--recipe`; default the embedded tiny LLaDA and
its digits task):

    official            the LLaDA algorithm: one full forward per step, `--tokens-per-step` tokens per step
    prefix / dual       + block KV cache (the sampler's `cache`)
    dual+refresh/N      + the dual cache also refreshed every N steps inside a block, one row per N of
                        `--refresh-interval` (cache_refresh_interval; 1 = every step, the official logits)
    threshold           + confidence-threshold parallel decoding (threshold, default 0.9)
    prefix+threshold, dual+threshold
    AR-order+prefix     remasking=left_to_right, one token per step, prefix cache refreshed every block

Per variant and gen_length: the wall-time speed-up over the official algorithm (same prompts, same batches, measured
in this run), the model token-positions computed per generated token (every forward's batch x positions, summed,
over batch x gen_length), the share of the official greedy tokens it reproduces (over the positions of the official
completions, through their first EOS), mean denoising steps per row, the mean reward and (where the task has one)
the accuracy, each with its standard error over the prompts and its difference from the official algorithm's, paired
per prompt, with that difference's standard error (`--num-prompts` large enough for a paired SE <= 0.01; the script
says when it is not).

    dllm-ais bench rollout                                  # gen 64 and 256, block 32, 1024 prompts
    dllm-ais bench rollout --gen-lengths 64 --num-prompts 64 --batch 32    # a quick check
    dllm-ais bench rollout --recipe recipes/tiny_llada_chain_sum.yaml --gen-lengths 128 256 --tokens-per-step 2
                                                                     # the long-completion model, d1's steps = gen/2
    dllm-ais bench rollout ... --variants dual,dual+threshold   # the official algorithm and these only
    dllm-ais bench rollout ... --variants dual+refresh --refresh-interval 5 6   # refreshed every 5, every 6 steps

The embedded model is trained on 16-token completions; longer canvases are EOS-padded, which is where parallel
decoding and the cache save most. Timings depend on the machine and its load: compare ratios from one run only.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path

import torch

from dllm_ais.bench.common import describe_device, synchronize
from dllm_ais.config import EMBEDDED_RECIPE, load_config
from dllm_ais.data import load_task_dataset, tokenize_prompts
from dllm_ais.loading import load_model, load_tokenizer, special_tokens
from dllm_ais.policy import DiffusionPolicy
from dllm_ais.rewards import resolve_reward_functions, score_rollout_table
from dllm_ais.sampling.diffusion import DiffusionSamplerConfig
from dllm_ais.statistics import mean, paired_difference, standard_error
from dllm_ais.tasks import get_task

def variants(threshold: float, steps: int, gen_length: int, refresh_intervals: list[int]) -> dict[str, dict]:
    """Variant name -> `DiffusionSamplerConfig` fields of its sampler; `dual+refresh/N` for each N of
    `refresh_intervals`."""
    variant_fields = {
        "official": {},
        "prefix": dict(cache="prefix"),
        "dual": dict(cache="dual"),
        **{f"dual+refresh/{interval}": dict(cache="dual", cache_refresh_interval=interval)
           for interval in refresh_intervals},
        f"threshold {threshold}": dict(threshold=threshold),
        "prefix+threshold": dict(cache="prefix", threshold=threshold),
        "dual+threshold": dict(cache="dual", threshold=threshold),
        "AR-order+prefix": dict(steps=gen_length, remasking="left_to_right", cache="prefix"),
    }
    return {name: {"steps": steps, **fields} for name, fields in variant_fields.items()}

def family(variant: str) -> str:
    """The name `--variants` selects a variant by: `dual+refresh/4` -> `dual+refresh`."""
    return variant.partition("/")[0]


@contextlib.contextmanager
def counted_positions(model):
    """Yield a one-element list accumulating batch x positions of every forward of `model`."""
    total = [0]

    def count(module, args, kwargs):
        ids = args[0] if args else kwargs["input_ids"]
        total[0] += ids.shape[0] * ids.shape[1]

    handle = model.register_forward_pre_hook(count, with_kwargs=True)
    try:
        yield total
    finally:
        handle.remove()


def run_variant(policy, model, tokenizer, batches, scorers, device) -> dict:
    """Sample every batch greedily (after an untimed warm-up batch); return wall seconds, positions computed,
    completions, completion masks, steps per row, rewards (the sum of the reward functions) and accuracy (`scorers` =
    the reward functions, then the task's accuracy function or None)."""
    first_ids, first_mask, _ = batches[0]
    policy.sample(model, first_ids[:2], first_mask[:2], None)
    completions, masks, scores, steps = [], [], [], []
    elapsed = 0.0
    with counted_positions(model) as positions:
        for input_ids, attention_mask, columns in batches:
            synchronize(device)
            start = time.perf_counter()
            rollout = policy.sample(model, input_ids, attention_mask, None)
            synchronize(device)
            elapsed += time.perf_counter() - start
            completions.append(rollout.completion_ids.cpu())
            masks.append(rollout.completion_mask.cpu())
            steps.append(rollout.num_steps.cpu())
            scores.append(score_rollout_table(tokenizer, [f for f in scorers if f], columns, rollout).values.cpu())
    values = torch.cat(scores).double()
    rewards, accuracy = (values[:, :-1], values[:, -1]) if scorers[-1] else (values, None)
    return {"seconds": elapsed, "positions": positions[0], "completions": torch.cat(completions),
            "masks": torch.cat(masks), "rewards": rewards.nansum(1), "accuracy": accuracy,
            "steps": torch.cat(steps).double()}


def paired(values: torch.Tensor | None, official: torch.Tensor | None, width: int) -> str:
    """'mean ± SE   Δ ± SE' of `values` and of its per-prompt difference from the official algorithm's."""
    if values is None:
        return "—"
    difference = paired_difference(official, values)
    return (f"{mean(values):>9.4f} ± {standard_error(values):.4f} "
            f"{difference.mean:>+{width}.4f} ± {difference.standard_error:.4f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="dllm-ais bench rollout", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", type=Path, default=EMBEDDED_RECIPE, help="its model, task and task_args")
    parser.add_argument("--gen-lengths", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--block-length", type=int, default=32)
    parser.add_argument("--tokens-per-step", type=int, default=1,
                        help="official algorithm and fixed-schedule variants: steps = gen_length / this")
    parser.add_argument("--threshold", type=float, default=0.9)
    parser.add_argument("--refresh-interval", type=int, nargs="+", default=[4],
                        help="dual+refresh: steps between cache refreshes inside a block (one row per value)")
    parser.add_argument("--num-prompts", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--device", default="cpu", help="cpu (the issue's setting) or cuda")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads for torch; 0 = torch's default")
    parser.add_argument("--seed", type=int, default=0, help="held-out prompt draw")
    parser.add_argument("--variants", help="comma-separated variants to run beside the official algorithm, e.g. "
                        "'dual,dual+threshold' (default: all)")
    args = parser.parse_args(argv)
    chosen = None if args.variants is None else {"official", *(name.strip() for name in args.variants.split(","))}
    known = list(dict.fromkeys(family(name) for name in variants(args.threshold, 1, 1, [1])))
    if chosen is not None and not chosen <= set(known):
        parser.error(f"--variants: unknown {sorted(chosen - set(known))}; choose from {', '.join(known)}")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    recipe = load_config(args.recipe)
    tokenizer = load_tokenizer(recipe.model_name_or_path)
    model = load_model(recipe.model_name_or_path, torch.float32).to(device).eval()
    dataset = load_task_dataset(recipe.task, split="test", size=args.num_prompts, seed=args.seed,
                                task_args=recipe.task_args)
    scorers = [*resolve_reward_functions(recipe.reward_funcs or recipe.task), get_task(recipe.task).accuracy]
    batches = []
    for start in range(0, len(dataset), args.batch):
        rows = dataset.select(range(start, min(start + args.batch, len(dataset))))
        columns = {c: list(rows[c]) for c in rows.column_names}
        input_ids, attention_mask = tokenize_prompts(tokenizer, columns["prompt"], None, device)
        batches.append((input_ids, attention_mask, columns))

    where = describe_device(device)
    tokens = special_tokens(tokenizer, model.config, diffusion=True)
    cfg = model.config
    task = recipe.task + (f" {recipe.task_args}" if recipe.task_args else "")
    print(f"device: {where} | torch {torch.__version__} | float32 | model: {recipe.model_name_or_path} "
          f"hidden={cfg.hidden_size} layers={cfg.num_hidden_layers} vocab={cfg.vocab_size} | task: {task} "
          f"(test split, seed {args.seed}), {len(dataset)} prompts in batches of {args.batch} | greedy (temperature 0), "
          f"block_length={args.block_length}")
    for gen_length in args.gen_lengths:
        steps = gen_length // args.tokens_per_step
        settings = (f"gen_length={gen_length} block_length={args.block_length} official steps={steps} "
                    f"threshold={args.threshold} | {where}")
        print(f"\n== {settings} ==")
        print(f"{'variant':<18} {'speed-up':>9} {'positions/token':>16} {'agreement':>10} {'steps/row':>10} "
              f"{'reward ± SE':>16} {'Δ vs official ± SE (paired)':>28} {'accuracy ± SE':>16} {'Δ ± SE (paired)':>18}")
        results = {}
        for name, fields in variants(args.threshold, steps, gen_length, args.refresh_interval).items():
            if chosen is not None and family(name) not in chosen:
                continue
            policy = DiffusionPolicy(DiffusionSamplerConfig(
                gen_length=gen_length, block_length=args.block_length, temperature=0.0,
                mask_token_id=tokens.mask_token_id, eos_token_ids=tokens.eos_token_ids, pad_token_id=tokens.pad_token_id,
                **fields))
            results[name] = result = run_variant(policy, model, tokenizer, batches, scorers, device)
            official = results["official"]
            scored = official["masks"]
            agreement = (result["completions"] == official["completions"])[scored].double().mean().item()
            per_token = result["positions"] / (len(dataset) * gen_length)
            print(f"{name:<18} {official['seconds'] / result['seconds']:>8.2f}x {per_token:>16.2f} {agreement:>10.4f} "
                  f"{result['steps'].mean().item():>10.1f} {paired(result['rewards'], official['rewards'], 19)} "
                  f"{paired(result['accuracy'], official['accuracy'], 9)}   [{settings}]")
        errors = [paired_difference(results["official"][key], r[key]).standard_error for r in results.values()
                  for key in ("rewards", "accuracy") if r[key] is not None]
        if max(errors) > 0.01:
            print(f"note: a paired standard error is {max(errors):.4f} > 0.01; raise --num-prompts for the target "
                  f"precision.")


if __name__ == "__main__":
    main()
