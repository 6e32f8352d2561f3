"""Benchmarks of the rollout path, each printing ratios measured in one run beside the device and settings.

Section 1 — sampler overhead: wall time of `MaskedDiffusionSampler.sample` against the same number of bare
forwards ``model(canvas, attention_mask=...)`` on a canvas of the same shape. Everything the sampler does beyond
the forwards (Gumbel noise, scores, top-k, bookkeeping) is in the ratio; the target is <= 1.05.

    dllm-ais bench sampler                      # tiny LLaDA, runs on a 2-core CPU in well under a minute
    dllm-ais bench sampler --d-model 1024 --n-layers 8 --vocab 126464 --batch 8 --dtype bfloat16

The sampler's own per-step work grows with batch x block x vocabulary (float64 Gumbel noise for the still-masked
positions), the forward's with batch x canvas x model size. On a CPU float64 noise is costly next to a tiny model's
matmuls, so a large vocabulary on a tiny CPU model exceeds the target; the defaults keep LLaDA's regime, where the
forward dominates.

Section 2 — engine sync: `RolloutEngine.sync_from` (merge the LoRA, requantize, copy in place) over one forward.

Section 3 — one model against two (`rollout.precision_flow`): per precision, the bytes the trainer and its engine
hold together (parameters, buffers and the quantized weights, each storage counted once) and the sync's seconds, for
the split flow (a LoRA trainer in high precision beside a quantized, merged copy) and the unified one (one model: the
quantized base with the adapter beside it, nothing to sync).

Section 4 — host reads of threshold decoding: on the embedded LLaDA and its digits prompts (`rollout.threshold`
0.9, greedy), the tensor values a `sample` call reads on the host (each a wait for the device on a GPU) against its
blocks, and its forwards against those of a decoder that stops each block as soon as it is filled (reading the device
every step, as the sampler did before its counts stayed on the device).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from dllm_ais.bench.common import describe_device, host_reads, random_llada, resolve_device, wall_and_cpu_seconds
from dllm_ais.choices import PRECISIONS
from dllm_ais.models import LLaDAConfig, LLaDAModelLM
from dllm_ais.sampling.diffusion import DiffusionSamplerConfig, MaskedDiffusionSampler


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dllm-ais bench sampler", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    model = parser.add_argument_group("tiny LLaDA built from config (random weights)")
    model.add_argument("--d-model", type=int, default=256)
    model.add_argument("--n-layers", type=int, default=4)
    model.add_argument("--n-heads", type=int, default=4)
    model.add_argument("--vocab", type=int, default=512, help="vocabulary size (LLaDA-8B: 126464)")
    model.add_argument("--lora-r", type=int, default=16, help="engine-sync section: LoRA rank of the trainer")
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


def build_tiny_llada(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> LLaDAModelLM:
    """A randomly initialised LLaDA of the requested size (`random_llada`) on `device` in `dtype`."""
    return random_llada(args.vocab, args.d_model, args.n_layers, args.n_heads, 4 * args.d_model,
                        args.prompt_len + args.gen_length).to(device=device, dtype=dtype).eval()


def left_padded_prompts(args: argparse.Namespace, config: LLaDAConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[batch, prompt_len] random prompts and their attention mask; odd rows left-padded by prompt_len // 4."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, config.vocab_size - 2, (args.batch, args.prompt_len), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    padding = args.prompt_len // 4
    input_ids[1::2, :padding] = config.pad_token_id
    attention_mask[1::2, :padding] = 0
    return input_ids.to(device), attention_mask.to(device)


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

    timings: dict[str, list[tuple[float, float]]] = {"sampler": [], "forwards": []}
    for repetition in range(args.warmup + args.repeats):
        order = [("sampler", run_sampler), ("forwards", run_forwards)]
        for name, fn in order if repetition % 2 == 0 else reversed(order):
            measured = wall_and_cpu_seconds(fn, device)
            if repetition >= args.warmup:
                timings[name].append(measured)
    sampler_wall, forwards_wall = (statistics.median(wall for wall, _ in timings[name]) for name in ("sampler", "forwards"))
    ratio = sampler_wall / forwards_wall
    paired_ratios = [s[0] / f[0] for s, f in zip(timings["sampler"], timings["forwards"])]

    print("== sampler vs bare forwards ==")
    print(f"device {describe_device(device)} | dtype {args.dtype} | torch {torch.__version__}")
    print(
        f"model d_model={args.d_model} n_layers={args.n_layers} n_heads={args.n_heads} vocab={args.vocab} | "
        f"batch={args.batch} prompt_len={args.prompt_len} gen_length={args.gen_length} block_length={args.block_length} "
        f"steps={args.steps} temperature={args.temperature} remasking={args.remasking} | "
        f"median of {args.repeats} interleaved repetitions after {args.warmup} warm-up"
    )
    print(
        f"sampler {sampler_wall * 1e3:.1f} ms vs {args.steps} bare forwards {forwards_wall * 1e3:.1f} ms "
        f"({forwards_wall / args.steps * 1e3:.2f} ms each): ratio sampler/forwards = {ratio:.3f} (target <= 1.05; "
        f"per repetition {min(paired_ratios):.3f}-{max(paired_ratios):.3f})"
    )
    if device.type == "cpu":
        sampler_cpu, forwards_cpu = (statistics.median(cpu for _, cpu in timings[name]) for name in ("sampler", "forwards"))
        print(f"process CPU-time ratio sampler/forwards = {sampler_cpu / forwards_cpu:.3f} (less sensitive to other load)")
    return {"sampler_s": sampler_wall, "forwards_s": forwards_wall, "ratio": ratio}


def lora_trainer(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The tiny LLaDA with a LoRA adapter on every block linear, its adapter perturbed so a merge does real work."""
    from peft import LoraConfig, get_peft_model

    from dllm_ais.policy import lora_target_modules

    trainer = get_peft_model(build_tiny_llada(args, device, dtype),
                             LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules=lora_target_modules("llada")))
    with torch.no_grad():
        for name, param in trainer.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.01)
    return trainer


def held_bytes(*models: torch.nn.Module) -> int:
    """Bytes of every tensor `models` hold — parameters, buffers and the unified flow's quantized weights (a
    quantized tensor by its inner data and scales) — each storage counted once."""
    from torchao.utils import TorchAOBaseTensor

    from dllm_ais.quantization import StraightThroughQuantizedLinear

    seen, total = set(), 0

    def add(tensor: torch.Tensor) -> None:
        nonlocal total
        if isinstance(tensor, TorchAOBaseTensor):
            for name in tensor.__tensor_flatten__()[0]:
                add(getattr(tensor, name))
        elif tensor.untyped_storage().data_ptr() not in seen:
            seen.add(tensor.untyped_storage().data_ptr())
            total += tensor.untyped_storage().nbytes()

    for model in models:
        for tensor in [*model.parameters(), *model.buffers()]:
            add(tensor)
        for module in model.modules():
            if isinstance(module, StraightThroughQuantizedLinear):
                add(module.quantized)
    return total


def bench_one_model(args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    """Per precision: (bytes held unified / split, median sync seconds split) — see the module's Section 3."""
    from dllm_ais.engine import RolloutEngine

    device = resolve_device(args.device)
    dtype = getattr(torch, args.dtype)
    print("== one model (unified) against two (split): trainer + engine bytes, sync seconds ==")
    results = {}
    for precision in PRECISIONS:
        held, syncs = {}, {}
        for flow in ("split", "unified"):
            trainer = lora_trainer(args, device, dtype)
            engine = RolloutEngine(trainer, precision=precision, precision_flow=flow)
            held[flow] = held_bytes(trainer) + (0 if engine.shares_trainer_model else held_bytes(engine.model))
            syncs[flow] = statistics.median(engine.sync_from(trainer) for _ in range(args.warmup + args.repeats))
        results[precision] = (held["unified"] / held["split"], syncs["split"])
        print(f"flows at precision={precision:<17} device {describe_device(device)} | trainer dtype {args.dtype} | LoRA "
              f"r={args.lora_r} | bytes split {held['split'] / 2**20:.2f} MiB, unified {held['unified'] / 2**20:.2f} "
              f"MiB (unified / split = {results[precision][0]:.2f}) | sync split {syncs['split'] * 1e3:.2f} ms, "
              f"unified {syncs['unified'] * 1e3:.3f} ms")
    return results


def bench_engine_sync(args: argparse.Namespace) -> dict[str, float]:
    """Median time of `RolloutEngine.sync_from` (LoRA merge + requantize + in-place copy) over one bare forward.

    The trainer is `lora_trainer`; one forward is the engine's forward on the sampler's canvas.
    """
    from dllm_ais.engine import RolloutEngine

    device = resolve_device(args.device)
    dtype = getattr(torch, args.dtype)
    trainer = lora_trainer(args, device, dtype)
    input_ids, attention_mask = left_padded_prompts(args, trainer.config, device)
    canvas = torch.cat([input_ids, input_ids.new_full((args.batch, args.gen_length), trainer.config.mask_token_id)], 1)
    canvas_attention = torch.cat([attention_mask, attention_mask.new_ones((args.batch, args.gen_length))], dim=1)
    print("== engine sync vs one forward ==")
    results = {}
    for precision in PRECISIONS:
        engine = RolloutEngine(trainer, precision=precision)

        @torch.no_grad()
        def forward() -> None:
            engine.model(canvas, attention_mask=canvas_attention)

        syncs, forwards = [], []
        for repetition in range(args.warmup + args.repeats):
            sync = engine.sync_from(trainer)
            wall, _ = wall_and_cpu_seconds(forward, device)
            if repetition >= args.warmup:
                syncs.append(sync)
                forwards.append(wall)
        ratio = statistics.median(syncs) / statistics.median(forwards)
        results[precision] = ratio
        print(f"precision={precision:<15} device {describe_device(device)} | trainer dtype {args.dtype} | LoRA r={args.lora_r} "
              f"on {len(engine.quantized_modules) or 'no'} quantized linears | canvas {args.batch}x"
              f"{args.prompt_len + args.gen_length}: sync / one forward = {ratio:.2f}")
    return results


def steps_to_fill(commit_step: torch.Tensor, block_length: int) -> int:
    """The forwards a decoder that stops each block of `block_length` completion positions as soon as every row filled
    it runs: per block, the most distinct commit steps a row has there, summed over the blocks."""
    blocks = commit_step.reshape(commit_step.shape[0], -1, block_length)
    return sum(max(len(row.unique()) for row in blocks[:, block]) for block in range(blocks.shape[1]))


def bench_threshold_reads(args: argparse.Namespace) -> dict[tuple[int, str], tuple[int, int, int]]:
    """Section 4: per (gen length, cache), (host reads, forwards, forwards of a decoder stopping each block when
    filled) of one greedy `sample` call with threshold 0.9 on the embedded LLaDA's digits prompts."""
    from dllm_ais.bench.mismatch import validation_prompts
    from dllm_ais.config import EMBEDDED_RECIPE, load_config
    from dllm_ais.loading import load_model, load_tokenizer

    config = load_config(EMBEDDED_RECIPE, ["--output_dir=unused"])
    model = load_model(config.model_name_or_path, torch.float32).eval()
    prompts = validation_prompts(config, load_tokenizer(config.model_name_or_path), args.batch * 2, seed=0)
    forwards = []
    hook = model.register_forward_pre_hook(lambda module, inputs: forwards.append(1))
    print("== host reads of threshold decoding (embedded LLaDA, digits prompts, threshold 0.9, greedy) ==")
    results = {}
    for gen_length in (16, 64):
        for cache in ("none", "dual"):
            sampler = MaskedDiffusionSampler(DiffusionSamplerConfig(gen_length=gen_length, block_length=16,
                                                                    steps=gen_length, cache=cache, threshold=0.9))
            forwards.clear()
            with host_reads() as counter:
                rollout = sampler.sample(model, *prompts)
            results[gen_length, cache] = counter["reads"], len(forwards), steps_to_fill(rollout.commit_step, 16)
            reads, ran, needed = results[gen_length, cache]
            print(f"gen {gen_length:>3} ({gen_length // 16} blocks of 16), cache {cache:<4} | batch {args.batch * 2}: "
                  f"host reads {reads} | forwards {ran}, a decoder stopping each block when filled {needed} | "
                  f"{describe_device(torch.device('cpu'))}")
    hook.remove()
    return results


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    bench_sampler_vs_forwards(args)
    bench_engine_sync(args)
    bench_one_model(args)
    bench_threshold_reads(args)


if __name__ == "__main__":
    main()
