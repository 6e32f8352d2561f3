"""Benchmark one GRPO step: (1) the shares of the step spent in the rollout (sampling with the engine; with
`--rollout-cache` / `--rollout-threshold` the fast rollouts) and in the correction stage (target < 1 %);
(2) peak memory of the completion log-prob computation against a naive full float32 log-softmax (target ≤ 0.5×).

    dllm-ais bench step                 # both parts, CPU defaults finish in about a minute
    dllm-ais bench step --part memory --vocab 126464 --sequences 8 --dtype bfloat16

Every figure is a ratio measured in this run, printed beside the device, dtype and sizes. On CPU, peak memory is
the peak resident-set growth of a fresh subprocess per variant; on CUDA, `torch.cuda.max_memory_allocated`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from dllm_ais.bench.common import describe_device, peak_resident_bytes, random_llada, run_child
from dllm_ais.choices import CACHE_MODES, PRECISIONS


def tiny_llada(vocab: int, d_model: int, layers: int, max_len: int):
    """The benchmark's random LLaDA: 4 heads, an MLP twice the model width."""
    return random_llada(vocab, d_model, layers, 4, 2 * d_model, max_len)


# ------------------------------------------------------------------------------------------ correction share
def bench_correction_share(args) -> None:
    from dllm_ais.components import build_components, make_accelerator
    from dllm_ais.config import EMBEDDED_MODEL, load_config
    from dllm_ais.correction import RolloutCorrection
    from dllm_ais.grpo import grouped_prompts, make_generation_batch, optimisation_pass
    from dllm_ais.loading import load_tokenizer
    from dllm_ais.rewards import resolve_reward_functions
    from dllm_ais.tasks.digits import make_digits_dataset

    tokenizer = load_tokenizer(EMBEDDED_MODEL)
    config = load_config(None, {  # the recipe of the step measured, through the loader that knows every name
        "task": "digits", "eval_size": 0, "num_generations": 4, "per_device_train_batch_size": args.batch,
        "max_completion_length": args.gen_length, "num_iterations": args.num_iterations, "max_steps": 10_000,
        "lora_r": 8, "dtype": "float32", "max_prompt_length": 64, "output_dir": tempfile.mkdtemp(),
        "correction": {"method": "ais"},
        "rollout": {"block_length": args.block_length or args.gen_length, "steps": args.gen_length // 2,
                    "precision": args.precision, "cache": args.rollout_cache, "threshold": args.rollout_threshold}})
    model = tiny_llada(len(tokenizer), args.d_model, args.layers, 512)
    model.config.mask_token_id = tokenizer.mask_token_id
    parts = build_components(config, tokenizer, make_accelerator(config), model)
    correction = RolloutCorrection(config.correction, config.num_generations)
    reward_funcs = resolve_reward_functions(config.task)
    dataset = make_digits_dataset(256, seed=0)
    prompts_per_batch = config.generation_batch_size // config.num_generations
    shares, rollout_shares, corrections, steps = [], [], [], []
    for repeat in range(args.warmup + args.repeats):
        rows = dataset.select([(repeat * prompts_per_batch + i) % len(dataset) for i in range(prompts_per_batch)])
        start = time.perf_counter()
        batch = make_generation_batch(config, parts, tokenizer, reward_funcs,
                                      grouped_prompts(rows, config.num_generations), repeat, correction)
        for iteration in range(config.num_iterations):
            optimisation_pass(config, parts, batch, iteration, correction)
        step = time.perf_counter() - start
        if repeat >= args.warmup:
            corrections.append(batch.metrics["timing/correction_s"])
            steps.append(step)
            shares.append(batch.metrics["timing/correction_s"] / step)
            rollout_shares.append(batch.metrics["timing/sample_s"] / step)
    print(f"[step shares] device={describe_device(parts.accelerator.device)} torch={torch.__version__} dtype=float32 "
          f"model=LLaDA d_model={args.d_model} layers={args.layers} vocab={len(tokenizer)} "
          f"completions={args.batch} gen_length={args.gen_length} block_length={config.rollout.block_length} "
          f"num_iterations={config.num_iterations} "
          f"precision={args.precision} rollout.cache={args.rollout_cache} rollout.threshold={args.rollout_threshold} "
          f"repeats={args.repeats}")
    print(f"  rollout (sampling) time / step time: median {statistics.median(rollout_shares):.2%} "
          f"(min {min(rollout_shares):.2%}, max {max(rollout_shares):.2%})")
    print(f"  correction time / step time: median {statistics.median(shares):.4%} "
          f"(min {min(shares):.4%}, max {max(shares):.4%}; target < 1%)")


# ------------------------------------------------------------------------------------------ log-prob memory
def _logprob_worker(variant: str, args) -> dict:
    """Run one log-prob variant in this (fresh) process and report its peak memory growth in bytes."""
    from dllm_ais.likelihood import one_step_logprobs

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    model = tiny_llada(args.vocab, args.d_model, args.layers, 4096).to(device, dtype).eval()
    prompt, gen = args.prompt_length, args.completion_length
    sequences = torch.randint(0, args.vocab - 2, (args.sequences, prompt + gen), device=device)
    attention_mask = torch.ones_like(sequences)
    with torch.no_grad():
        model(sequences[:1, :8])  # warm up kernels and allocator before measuring
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            baseline = torch.cuda.memory_allocated()
        else:
            baseline = peak_resident_bytes()
        if variant == "naive":
            noisy = sequences.clone()
            noisy[:, prompt:] = args.vocab - 1
            logits = model(noisy, attention_mask=attention_mask).logits
            logp = torch.log_softmax(logits.float(), dim=-1)[:, prompt:].gather(-1, sequences[:, prompt:, None])[..., 0]
        else:
            logp = one_step_logprobs(model, sequences, attention_mask, prompt, args.vocab - 1, seed=0, p_mask_prompt=0.0)
        if device == "cuda":
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - baseline
        else:
            peak = peak_resident_bytes() - baseline
    return {"peak_bytes": peak, "checksum": float(logp.double().sum()),
            "device": describe_device(torch.device(device))}


def bench_logprob_memory(args) -> None:
    results = {}
    for variant in ("naive", "chunked"):
        results[variant] = run_child("dllm_ais.bench.step", [
            "--variant", variant, "--d-model", str(args.d_model), "--layers", str(args.layers), "--vocab",
            str(args.vocab), "--sequences", str(args.sequences), "--prompt-length", str(args.prompt_length),
            "--completion-length", str(args.completion_length), "--dtype", args.dtype])
    naive, ours = results["naive"], results["chunked"]
    print(f"[log-prob memory] device={naive['device']} torch={torch.__version__} dtype={args.dtype} "
          f"model=LLaDA d_model={args.d_model} layers={args.layers} vocab={args.vocab} sequences={args.sequences} "
          f"prompt={args.prompt_length} completion={args.completion_length}")
    print(f"  naive full float32 log_softmax peak: {naive['peak_bytes'] / 2**20:.0f} MiB | dllm_ais one-step "
          f"(logits_to_keep + chunked logsumexp): {ours['peak_bytes'] / 2**20:.0f} MiB")
    ratio = (f"{ours['peak_bytes'] / naive['peak_bytes']:.3f}" if naive["peak_bytes"] > 0
             else "n/a (no growth measured: raise the sizes)")
    print(f"  ratio ours/naive: {ratio} (target <= 0.5); "
          f"sum of log-probs naive {naive['checksum']:.3f} vs ours {ours['checksum']:.3f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="dllm-ais bench step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("all", "correction", "memory"), default="all")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=("naive", "chunked"), help=argparse.SUPPRESS)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16, help="correction part: completions per step")
    parser.add_argument("--gen-length", type=int, default=16)
    parser.add_argument("--num-iterations", type=int, default=2)
    parser.add_argument("--precision", default="fp8", choices=PRECISIONS)
    parser.add_argument("--block-length", type=int, default=None, help="correction part: default gen-length")
    parser.add_argument("--rollout-cache", default="none", choices=CACHE_MODES)
    parser.add_argument("--rollout-threshold", type=float, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=126464, help="memory part: LLaDA's vocabulary by default")
    parser.add_argument("--sequences", type=int, default=4, help="memory part: batch of sequences")
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--completion-length", type=int, default=256, help="memory part: d1's gen length")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_logprob_worker(args.variant, args)))
        return
    print(f"host: {describe_device(torch.device('cpu'))}")
    if args.part in ("all", "correction"):
        bench_correction_share(args)
    if args.part in ("all", "memory"):
        bench_logprob_memory(args)


if __name__ == "__main__":
    main()
