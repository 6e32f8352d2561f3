"""The precision ladder on one CUDA GPU at LLaDA-8B's (or Dream-7B's, or LLaDA2.0-mini's) shape: rollout throughput
per notch and engine (eager or compiled), engine sync, a whole GRPO step timed part by part, step memory.

    dllm-ais bench precision                   # CUDA: LLaDA-8B shape, random weights, gen 256; no CUDA: --tiny
    dllm-ais bench precision --precisions bf16,fp8 --batch 8,64 --parts rollouts,step
    dllm-ais bench precision --tiny            # the same code at a tiny shape (CPU or GPU): a code-path check
    dllm-ais bench precision --shape dream-7b --steps 128   # Dream-7B's shape, 128 denoising steps
    dllm-ais bench precision --shape llada2-mini --precisions bf16,fp8 --batch 8,64 --parts rollouts
                                               # LLaDA2.0-mini's (MoE, blocks of --block-length; FP8 experts too)

The model is `LLaDAModelLM` with LLaDA-8B's config (d_model 4096, 32 layers, 32 heads, MLP 12288, vocabulary 126464;
`LLaDAConfig`'s defaults; `--shape dream-7b`: `DreamModel` with `DreamConfig`'s, Qwen2.5-7B's; `--shape llada2-mini`:
`LLaDA2MoeModelLM` with `LLaDA2MoeConfig`'s, LLaDA2.0-mini's, its attention blocks of --block-length) and random
weights in bfloat16 (nothing is downloaded), wrapped as the trainer is: LoRA (rank --lora-r) on every block linear
(and, for LLaDA2, every routed expert; the unified flow, which does not quantize experts, is left out of its step).
Figures, each printed beside the device, torch and torchao versions, the engine (eager, or compiled:
`RolloutEngine(compile=True)`, `dllm_ais.sampling.forwards`) and the kernel path
that ran it (`RolloutEngine.kernel_path`):

  rollout tokens/s   completion tokens per second of `MaskedDiffusionSampler.sample` (gen --gen-length, block
                     --block-length, --steps steps) per notch, engine (--engines), batch (--batch) and block KV
                     cache (off, up to --max-uncached-batch, and dual; the eager bf16 engine also dual with FP8
                     storage), with its ratio to bf16 on the same engine, batch and cache and, compiled, to the eager
                     engine; then the compiled engine's greedy one-block rollout against the eager one's (tokens
                     equal, largest log-prob gap). Only the notches whose kernels are not emulated on this device run
                     (an emulated notch is skipped with a line saying so: its figure would measure the emulation; a
                     notch that fails here, a kernel missing or memory short, prints one "failed" line and the others
                     still run);
  sync               seconds of `RolloutEngine.sync_from` (merge LoRA, requantize in place) per optimizer step;
  whole step         one GRPO step of --step-batch completions per notch:engine pair of --step-engines: sync,
                     rollout (dual cache), ℓ_rollout and ℓ_old (one-step estimator), training forward/backward in
                     micro-batches of --micro-batch with the AdamW step, each timed, the total against the first
                     pair's, the one-step k3 between the engine's and the trainer's log-probs and the GiB the models
                     hold (CUDA); engine "unified" is the unified precision flow (`rollout.precision_flow`) on a copy of
                     the trainer: one model, no ℓ_old pass, its training forwards through the engine's quantized linears;
  step peak memory   torch.cuda.max_memory_allocated over one LoRA training step (ℓ_θ scoring, GRPO loss, backward
                     piece by piece, AdamW step) for the one_step and trajectory estimators (CUDA only; on CPU
                     `dllm-ais bench memory` measures peaks in fresh processes).
"""
from __future__ import annotations

import argparse
import copy
import gc
import importlib.metadata
import statistics
import time

import torch

from dllm_ais.bench.common import (describe_device, random_dream, random_llada, random_llada2, resolve_device,
                                   synchronize)
from dllm_ais.choices import PRECISIONS

TINY = {"d_model": 64, "n_layers": 2, "n_heads": 4, "mlp_hidden_size": 128, "vocab": 128}
SHAPES = ("llada-8b", "dream-7b", "llada2-mini")
ESTIMATORS = ("one_step", "trajectory")
CACHES = (("none", "none"), ("dual", "none"), ("dual", "fp8"))  # (cache, cache_dtype); the FP8 KV cache with bf16 only


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dllm-ais bench precision", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=SHAPES, default="llada-8b",
                        help="the model's shape: LLaDA-8B (LLaDAConfig's defaults), Dream-7B (DreamConfig's) or "
                             "LLaDA2.0-mini (LLaDA2MoeConfig's)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model of --shape's family (automatic "
                                                            "without CUDA)")
    parser.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cuda or cpu")
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help="comma-separated notches (bf16 first)")
    parser.add_argument("--batch", default="8", help="comma-separated rollout batch sizes (e.g. 8,64)")
    parser.add_argument("--engines", default=None, help="comma-separated: eager, compiled (default: both with CUDA, "
                                                        "eager without)")
    parser.add_argument("--max-uncached-batch", type=int, default=8, help="rollouts without a cache only up to this "
                                                                          "batch (they are the slowest)")
    parser.add_argument("--parts", default="memory,rollouts,step", help="comma-separated: memory (step peak memory), "
                                                                        "rollouts, step (a whole GRPO step, timed)")
    parser.add_argument("--profile", action="store_true", help="print the device kernels of one compiled rollout "
                                                                "per batch and cache (torch.profiler; CUDA)")
    parser.add_argument("--step-batch", type=int, default=64, help="completions per whole step")
    parser.add_argument("--micro-batch", type=int, default=8, help="training micro-batch of the whole step")
    parser.add_argument("--step-engines", default=None,
                        help="comma-separated notch:engine pairs of the whole step, the first the reference (default: "
                             "bf16:eager,bf16:compiled,fp8:eager,fp8:compiled,fp8:unified with CUDA, bf16:eager,fp8:eager,"
                             "fp8:unified without)")
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--gen-length", type=int, default=256)
    parser.add_argument("--block-length", type=int, default=32)
    parser.add_argument("--steps", type=int, default=64, help="denoising steps (a multiple of gen/block)")
    parser.add_argument("--threshold", type=float, default=None, help="parallel decoding: commit every position "
                        "above this confidence (Fast-dLLM's 0.9), its counts on the device; steps then no longer apply")
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1, help="timed repetitions after one warm-up (median)")
    return parser


def versions() -> str:
    """torch and torchao versions (torchao read from its package metadata: only dllm_ais.quantization imports it)."""
    return f"torch {torch.__version__}, torchao {importlib.metadata.version('torchao')}"


def device_line(device: torch.device) -> str:
    """The device (with its CUDA compute capability) and versions printed beside every figure."""
    capability = "sm%d%d, " % torch.cuda.get_device_capability(device) if device.type == "cuda" else ""
    return f"{describe_device(device)}, {capability}{versions()}"


def build_trainer(args: argparse.Namespace, device: torch.device):
    """The LoRA-wrapped random model of --shape (LLaDA-8B's, Dream-7B's or LLaDA2.0-mini's; a tiny one of its family
    with --tiny) in bfloat16 on `device`, built there, with the family's LoRA preset."""
    from peft import LoraConfig, get_peft_model

    from dllm_ais.models import LLaDAConfig
    from dllm_ais.policy import lora_target_modules, lora_target_parameters

    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            if args.shape == "dream-7b":
                model = random_dream(args.prompt_length + args.gen_length, tiny=args.tiny)
            elif args.shape == "llada2-mini":
                model = random_llada2(args.block_length, tiny=args.tiny)
            else:
                shape = TINY if args.tiny else {
                    "d_model": LLaDAConfig.d_model, "n_layers": LLaDAConfig.n_layers, "n_heads": LLaDAConfig.n_heads,
                    "mlp_hidden_size": LLaDAConfig.mlp_hidden_size, "vocab": LLaDAConfig.vocab_size}
                model = random_llada(shape["vocab"], shape["d_model"], shape["n_layers"], shape["n_heads"],
                                     shape["mlp_hidden_size"], args.prompt_length + args.gen_length)
    finally:
        torch.set_default_dtype(default_dtype)
    config = model.config
    print(f"model: {type(model).__name__} hidden={config.hidden_size} layers={config.num_hidden_layers} "
          f"heads={config.num_attention_heads} vocab={config.vocab_size}, random weights, bfloat16, LoRA r={args.lora_r}")
    return get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r,
                                            target_modules=lora_target_modules(config.model_type),
                                            target_parameters=lora_target_parameters(config.model_type) or None))


def sampler_config(args: argparse.Namespace, model_config, cache: str, cache_dtype: str = "none",
                   gen_length: int | None = None):
    """The benchmark's sampler settings (temperature 1) with block KV cache `cache` stored in `cache_dtype`;
    `gen_length` shorter than --gen-length keeps the steps per block."""
    from dllm_ais.sampling.diffusion import DiffusionSamplerConfig

    gen_length = gen_length or args.gen_length
    return DiffusionSamplerConfig(gen_length=gen_length, block_length=args.block_length,
                                  steps=max(1, args.steps * gen_length // args.gen_length),
                                  temperature=1.0, cache=cache, cache_dtype=cache_dtype, threshold=args.threshold,
                                  mask_token_id=model_config.mask_token_id,
                                  eos_token_ids=(model_config.eos_token_id,), pad_token_id=model_config.pad_token_id)


def timed(fn, device: torch.device, repeats: int, warm_up=None) -> float:
    """Median wall seconds of fn() over `repeats` runs after one warm-up call of `warm_up` (default: fn), the device
    queue drained around each."""
    (warm_up or fn)()
    seconds = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def build_engine(trainer, precision: str, engine: str):
    """The rollout engine of `precision`: eager or compiled (`RolloutEngine(compile=...)`), or unified (the
    unified precision flow, which quantizes `trainer` in place: pass it a copy)."""
    from dllm_ais.engine import RolloutEngine

    if engine == "unified":
        return RolloutEngine(trainer, precision=precision, precision_flow="unified")
    return RolloutEngine(trainer, precision=precision, compile=engine == "compiled")


def random_prompts(trainer, batch: int, length: int, device: torch.device) -> torch.Tensor:
    """[batch, length] random token ids below the mask, pad and EOS ids (seed 0)."""
    config = trainer.config
    below = min(config.vocab_size, config.mask_token_id, config.pad_token_id, config.eos_token_id)
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, below, (batch, length), generator=generator).to(device)


def bench_rollouts(args: argparse.Namespace, trainer, device: torch.device) -> None:
    """Rollout tokens/s per notch, engine (eager, compiled), batch and cache, each against bf16 on the same engine,
    batch and cache, and the compiled engine against the eager one; the engine's sync seconds; how far a compiled
    engine's greedy rollout is from the eager one's (tokens equal, largest log-prob gap). One line each."""
    from dllm_ais.models.families import is_block_causal
    from dllm_ais.quantization import kernel_path
    from dllm_ais.sampling.diffusion import MaskedDiffusionSampler

    tokens_per_second: dict[tuple, float] = {}
    fp8_cache = not is_block_causal(trainer)  # a block-causal model keeps its cache in its own dtype
    for precision in args.precisions.split(","):
        path = kernel_path(precision, device)
        if device.type == "cuda" and path.startswith("emulated"):
            print(f"{precision:<18} skipped: {path} on {device_line(device)}")
            continue
        greedy: dict[str, object] = {}
        for engine_kind in args.engines.split(","):
            engine = None
            try:
                engine = build_engine(trainer, precision, engine_kind)
                sync = timed(lambda: engine.sync_from(trainer), device, args.repeats)
                for batch in batch_sizes(args):
                    prompts = random_prompts(trainer, batch, args.prompt_length, device)
                    for cache, cache_dtype in CACHES[:3 if precision == "bf16" and engine_kind == "eager" and fp8_cache
                                                     else 2]:
                        if cache == "none" and batch > args.max_uncached_batch:
                            continue
                        sampler = MaskedDiffusionSampler(sampler_config(args, trainer.config, cache, cache_dtype))
                        one_block = MaskedDiffusionSampler(sampler_config(args, trainer.config, cache, cache_dtype,
                                                                          gen_length=args.block_length))

                        def rollout(sampler=sampler, prompts=prompts):
                            return sampler.sample(engine.model, prompts, torch.ones_like(prompts),
                                                  torch.Generator(device=device).manual_seed(0), engine.forwards)

                        # A compiled engine warms up on the timed shapes: its first call compiles and captures them.
                        warm_up = rollout if engine_kind == "compiled" else lambda: rollout(one_block)
                        seconds = timed(rollout, device, args.repeats, warm_up=warm_up)
                        if args.profile and engine_kind == "compiled":
                            print_profile(f"{precision} {engine_kind} batch {batch} cache {cache}", rollout)
                        cache_name = cache if cache_dtype == "none" else f"{cache}+{cache_dtype}"
                        speed = tokens_per_second[precision, engine_kind, batch, cache_name] = (
                            batch * args.gen_length / seconds)
                        against = [f"× bf16 {speed / tokens_per_second[key]:.2f}" for key in
                                   [("bf16", engine_kind, batch, cache_name)]
                                   if precision != "bf16" and key in tokens_per_second]
                        against += [f"× eager {speed / tokens_per_second[key]:.2f}" for key in
                                    [(precision, "eager", batch, cache_name)]
                                    if engine_kind != "eager" and key in tokens_per_second]
                        print(f"{precision:<18} {engine_kind:<8} batch {batch:<4} cache {cache_name:<8} rollout "
                              f"{speed:10.1f} tokens/s ({', '.join(against) or 'reference'}) | sync {sync:.3f} s/step"
                              f" | {engine.execution_path.split(':')[0]}, kernels: {engine.kernel_path} | "
                              f"{device_line(device)}", flush=True)
                greedy[engine_kind] = greedy_rollout(args, trainer, engine, device)
            except Exception as error:  # one notch's missing kernel or memory must not hide the others' figures
                print(f"{precision:<18} {engine_kind:<8} failed: {type(error).__name__}: "
                      f"{str(error).splitlines()[0] if str(error) else ''} | {device_line(device)}", flush=True)
            del engine
            release_memory(device)
        if {"eager", "compiled"} <= greedy.keys():
            eager, compiled = greedy["eager"], greedy["compiled"]
            same = (eager.sequences == compiled.sequences).float().mean().item()
            gap = (eager.step_logprobs - compiled.step_logprobs).abs().max().item()
            print(f"{precision:<18} compiled against eager, greedy, batch {eager.sequences.shape[0]}, cache dual: tokens "
                  f"equal {same:.4f}, largest |Δ step log-prob| {gap:.2e}", flush=True)


def print_profile(title: str, fn) -> None:
    """Where one call of fn() spends its time: the device kernels by total time (torch.profiler), and the wall time
    against the kernels' sum (the rest is host work the device waited for)."""
    from torch.profiler import ProfilerActivity, profile

    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        fn()
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    events = profiler.key_averages()
    device_seconds = sum(event.self_device_time_total for event in events) / 1e6
    print(f"profile {title}: wall {wall:.3f} s (profiled), device kernels {device_seconds:.3f} s", flush=True)
    print(events.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=70), flush=True)


def batch_sizes(args: argparse.Namespace) -> list[int]:
    return [int(size) for size in str(args.batch).split(",")]


def greedy_rollout(args: argparse.Namespace, trainer, engine, device: torch.device):
    """A greedy (temperature 0) rollout with the dual cache on `engine`, at the first batch size (shapes the timed
    rollouts compiled and captured already): the compiled and eager engines' are compared token for token."""
    import dataclasses

    from dllm_ais.sampling.diffusion import MaskedDiffusionSampler

    prompts = random_prompts(trainer, batch_sizes(args)[0], args.prompt_length, device)
    config = dataclasses.replace(sampler_config(args, trainer.config, "dual"), temperature=0.0)
    return MaskedDiffusionSampler(config).sample(engine.model, prompts, torch.ones_like(prompts),
                                                 forwards=engine.forwards)


def bench_whole_step(args: argparse.Namespace, trainer, device: torch.device) -> None:
    """One GRPO step, each part timed, per (notch, engine) of `--step-engines`: the engine's sync, the rollout of
    `--step-batch` completions (dual cache), ℓ_rollout on the engine and ℓ_old on the trainer (one-step estimator,
    no gradient), the training forward/backward over micro-batches of `--micro-batch` and the AdamW step; the
    engine/trainer k3 of the step's log-probs; the whole step against the first pair's. Median of --repeats after
    one warm-up step."""
    from dllm_ais.bench.mismatch import ratio_statistics
    from dllm_ais.grpo import backward_by_pieces
    from dllm_ais.loss import TokenLoss
    from dllm_ais.policy import DiffusionPolicy

    policy = DiffusionPolicy(sampler_config(args, trainer.config, "dual"))
    prompts = random_prompts(trainer, args.step_batch, args.prompt_length, device)
    reference_seconds = None
    shared = trainer
    for pair in args.step_engines.split(","):
        precision, engine_kind = pair.split(":")
        try:
            trainer = copy.deepcopy(shared) if engine_kind == "unified" else shared
            optimizer = torch.optim.AdamW([param for param in trainer.parameters() if param.requires_grad], lr=1e-5)
            engine = build_engine(trainer, precision, engine_kind)
            held = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
            parts: dict[str, list[float]] = {}

            def part(name: str, fn):
                synchronize(device)
                start = time.perf_counter()
                value = fn()
                synchronize(device)
                parts.setdefault(name, []).append(time.perf_counter() - start)
                return value

            for repeat in range(1 + args.repeats):
                part("sync", lambda: engine.sync_from(trainer))
                trainer.eval()
                with torch.no_grad():
                    rollout = part("rollout", lambda: policy.sample(
                        engine.model, prompts, torch.ones_like(prompts),
                        torch.Generator(device=device).manual_seed(repeat), engine.forwards))
                    logp_rollout = part("logp_rollout", lambda: torch.cat([
                        policy.rollout_logprobs(engine.model, rollout.select(rows), seed=1)
                        for rows in micro_batch_slices(args)]))
                    logp_old = logp_rollout if engine.shares_trainer_model else part("logp_old", lambda: torch.cat([
                        policy.logprobs(trainer, rollout.select(rows), seed=1) for rows in micro_batch_slices(args)]))
                trainer.train()

                def train():
                    for rows in micro_batch_slices(args):
                        micro = rollout.select(rows)
                        objective = TokenLoss(logp_old[rows], torch.randn(micro.sequences.shape[0], device=device),
                                              micro.completion_mask, loss_type="dapo")
                        backward_by_pieces(policy.logprob_pieces(trainer, micro, seed=1), objective,
                                           micro.completion_mask, lambda loss: loss.backward(), compute_entropy=False)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)

                part("train", train)
            medians = {name: statistics.median(values[1:]) for name, values in parts.items()}
            total = sum(medians.values())
            reference_seconds = reference_seconds or total
            k3 = ratio_statistics(logp_old - logp_rollout, rollout.completion_mask)["k3"]
            print(f"step {precision:<10} {engine_kind:<8} batch {args.step_batch} (micro {args.micro_batch}) | "
                  + " | ".join(f"{name} {seconds:.3f} s" for name, seconds in medians.items())
                  + f" | total {total:.3f} s (× first {reference_seconds / total:.2f}) | one-step k3 {k3:.2e} | "
                  f"models held {held:.1f} GiB | {device_line(device)}", flush=True)
        except Exception as error:
            print(f"step {precision:<10} {engine_kind:<8} failed: {type(error).__name__}: "
                  f"{str(error).splitlines()[0] if str(error) else ''} | {device_line(device)}", flush=True)
        engine = trainer = optimizer = None
        release_memory(device)


def release_memory(device: torch.device) -> None:
    """Free a dropped engine now: its model and static forwards refer to each other, which only a collection ends."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def micro_batch_slices(args: argparse.Namespace) -> list[slice]:
    from dllm_ais.grpo import micro_batches

    return micro_batches(args.step_batch, args.micro_batch)


def bench_step_memory(args: argparse.Namespace, trainer, prompts: torch.Tensor, device: torch.device) -> None:
    """Peak memory of one LoRA training step per estimator (CUDA), one line each."""
    from dllm_ais.grpo import backward_by_pieces
    from dllm_ais.loss import TokenLoss
    from dllm_ais.policy import DiffusionPolicy
    from dllm_ais.settings import LikelihoodSettings

    optimizer = torch.optim.AdamW([param for param in trainer.parameters() if param.requires_grad], lr=1e-5)
    for estimator in ESTIMATORS:
        policy = DiffusionPolicy(sampler_config(args, trainer.config, "none"),
                                 likelihood=LikelihoodSettings(estimator=estimator))
        generator = torch.Generator(device=device).manual_seed(0)
        trainer.eval()
        with torch.no_grad():
            rollout = policy.sample(trainer, prompts, torch.ones_like(prompts), generator)
            logp_old = policy.logprobs(trainer, rollout, seed=1)
        trainer.train()
        objective = TokenLoss(logp_old, torch.randn(prompts.shape[0], device=device), rollout.completion_mask,
                              loss_type="dapo")
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        done = backward_by_pieces(policy.logprob_pieces(trainer, rollout, seed=1), objective, rollout.completion_mask,
                                  lambda loss: loss.backward(), compute_entropy=False)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if not (bool(done.finite_logprobs) and bool(done.finite_loss)):
            raise SystemExit(f"the {estimator} training step gave non-finite log-probs or loss")
        peak = (f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB" if device.type == "cuda"
                else "n/a on cpu (dllm-ais bench memory)")
        print(f"train step {estimator:<10} LoRA r={args.lora_r} batch {prompts.shape[0]} gen {args.gen_length} "
              f"steps {args.steps}: peak memory {peak} | {device_line(device)}", flush=True)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    device = resolve_device(args.device)
    if device.type != "cuda" and not args.tiny:
        print(f"no CUDA device: {args.shape}'s shape needs one; running --tiny on cpu (a code-path check, not a "
              "measurement)")
        args.tiny = True
    args.engines = args.engines or ("eager,compiled" if device.type == "cuda" else "eager")
    args.step_engines = args.step_engines or ",".join([f"{precision}:{engine}" for precision in ("bf16", "fp8")
                                                       for engine in args.engines.split(",")]
                                                      + ([] if args.shape == "llada2-mini" else ["fp8:unified"]))
    trainer = build_trainer(args, device)
    print(f"batch {args.batch}, prompt {args.prompt_length}, gen {args.gen_length}, block {args.block_length}, "
          f"steps {args.steps}" + ("" if args.threshold is None else f" (unused: threshold {args.threshold})")
          + f", temperature 1; median of {args.repeats} after one warm-up (rollouts: of one block)")
    parts = args.parts.split(",")
    if "memory" in parts:
        bench_step_memory(args, trainer, random_prompts(trainer, batch_sizes(args)[0], args.prompt_length, device),
                          device)
    if "rollouts" in parts:
        bench_rollouts(args, trainer, device)
    if "step" in parts:
        bench_whole_step(args, trainer, device)


if __name__ == "__main__":
    main()
