"""Benchmarks of the rollout path, each printing ratios measured in one run beside the device and settings.

Section 1 — sampler overhead: wall time of `MaskedDiffusionSampler.sample` against the same number of bare
forwards ``model(canvas, attention_mask=...)`` on a canvas of the same shape. Everything the sampler does beyond
the forwards (Gumbel noise, scores, top-k, bookkeeping) is in the ratio; the target is <= 1.05.

    python scripts/bench_sampler.py                      # tiny LLaDA, runs on a 2-core CPU in well under a minute
    python scripts/bench_sampler.py --d-model 1024 --n-layers 8 --vocab 126464 --batch 8 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from dllm_ais.models import LLaDAConfig, LLaDAModelLM
from dllm_ais.sampling.diffusion import DiffusionSamplerConfig, MaskedDiffusionSampler


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = parser.add_argument_group("tiny LLaDA built from config (random weights)")
    model.add_argument("--d-model", type=int, default=256)
    model.add_argument("--n-layers", type=int, default=4)
    model.add_argument("--n-heads", type=int, default=4)
    model.add_argument("--vocab", type=int, default=512, help="vocabulary size (LLaDA-8B: 126464)")
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--batch", type=int, default=4)
    sampling.add_argument("--prompt-len", type=int, default=64, help="prompt positions; half the rows are left-padded by a quarter")
    sampling.add_argument("--gen-length", type=int, default=64)
    sampling.add_argument("--block-length", type=int, default=32)
    sampling.add_argument("--steps", type=int, default=32)
    sampling.add_argument("--temperature", type=float, default=0.9)
    sampling.add_argument("--remasking", default="low_confidence")
    run = parser.add_argument_group("run")
    run.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    run.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cuda or cpu")
    run.add_argument(
        "--threads", type=int, default=1,
        help="CPU threads for torch; 1 keeps small-model timings stable on a busy machine, 0 = torch's default",
    )
    run.add_argument("--repeats", type=int, default=5, help="timed repetitions (median reported)")
    run.add_argument("--warmup", type=int, default=1, help="untimed repetitions first")
    return parser


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda was asked for but torch sees no CUDA device; use --device cpu.")
    return torch.device(name)


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (cuda)"
    return f"cpu ({torch.get_num_threads()} threads)"


def build_tiny_llada(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> LLaDAModelLM:
    """A randomly initialised LLaDA of the requested size; mask id = vocab − 1, EOS = pad = vocab − 2."""
    torch.manual_seed(0)
    config = LLaDAConfig(
        d_model=args.d_model, n_heads=args.n_heads, n_kv_heads=args.n_heads, n_layers=args.n_layers,
        mlp_hidden_size=4 * args.d_model, vocab_size=args.vocab, embedding_size=args.vocab,
        max_sequence_length=args.prompt_len + args.gen_length,
        mask_token_id=args.vocab - 1, eos_token_id=args.vocab - 2, pad_token_id=args.vocab - 2,
    )
    return LLaDAModelLM(config).to(device=device, dtype=dtype).eval()


def left_padded_prompts(args: argparse.Namespace, config: LLaDAConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[batch, prompt_len] random prompts and their attention mask; odd rows left-padded by prompt_len // 4."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, config.vocab_size - 2, (args.batch, args.prompt_len), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    padding = args.prompt_len // 4
    input_ids[1::2, :padding] = config.pad_token_id
    attention_mask[1::2, :padding] = 0
    return input_ids.to(device), attention_mask.to(device)


def seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Wall time of fn(), with the device queue drained before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def bench_sampler_vs_forwards(args: argparse.Namespace) -> dict[str, float]:
    """Median wall time of one `sample` call and of `steps` bare forwards, interleaved; returns both and the ratio."""
    device = resolve_device(args.device)
    dtype = getattr(torch, args.dtype)
    model = build_tiny_llada(args, device, dtype)
    input_ids, attention_mask = left_padded_prompts(args, model.config, device)
    sampler = MaskedDiffusionSampler(DiffusionSamplerConfig(
        gen_length=args.gen_length, block_length=args.block_length, steps=args.steps,
        temperature=args.temperature, remasking=args.remasking,
    ))
    generator = torch.Generator(device=device).manual_seed(0)
    mask_id = model.config.mask_token_id
    canvas = torch.cat([input_ids, input_ids.new_full((args.batch, args.gen_length), mask_id)], dim=1)
    canvas_attention = torch.cat([attention_mask, attention_mask.new_ones((args.batch, args.gen_length))], dim=1)

    def run_sampler() -> None:
        sampler.sample(model, input_ids, attention_mask, generator=generator)

    @torch.no_grad()
    def run_forwards() -> None:
        for _ in range(args.steps):
            model(canvas, attention_mask=canvas_attention)

    sampler_times, forward_times = [], []
    for repetition in range(args.warmup + args.repeats):
        pair = [(run_sampler, sampler_times), (run_forwards, forward_times)]
        for fn, times in pair if repetition % 2 == 0 else reversed(pair):
            elapsed = seconds(fn, device)
            if repetition >= args.warmup:
                times.append(elapsed)
    sampler_median, forwards_median = statistics.median(sampler_times), statistics.median(forward_times)
    ratio = sampler_median / forwards_median
    paired_ratios = [sampler / forwards for sampler, forwards in zip(sampler_times, forward_times)]

    print("== sampler vs bare forwards ==")
    print(f"device {describe_device(device)} | dtype {args.dtype} | torch {torch.__version__}")
    print(
        f"model d_model={args.d_model} n_layers={args.n_layers} n_heads={args.n_heads} vocab={args.vocab} | "
        f"batch={args.batch} prompt_len={args.prompt_len} gen_length={args.gen_length} block_length={args.block_length} "
        f"steps={args.steps} temperature={args.temperature} remasking={args.remasking} | "
        f"median of {args.repeats} interleaved repetitions after {args.warmup} warm-up"
    )
    print(
        f"sampler {sampler_median * 1e3:.1f} ms vs {args.steps} bare forwards {forwards_median * 1e3:.1f} ms "
        f"({forwards_median / args.steps * 1e3:.2f} ms each): ratio sampler/forwards = {ratio:.3f} (target <= 1.05; "
        f"per repetition {min(paired_ratios):.3f}-{max(paired_ratios):.3f})"
    )
    return {"sampler_s": sampler_median, "forwards_s": forwards_median, "ratio": ratio}


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    bench_sampler_vs_forwards(args)


if __name__ == "__main__":
    main()
