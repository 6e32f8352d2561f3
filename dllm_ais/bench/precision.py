"""The precision ladder on one CUDA GPU at LLaDA-8B's shape: rollout throughput per notch, engine sync, step memory.

    dllm-ais bench precision                   # CUDA: LLaDA-8B shape, random weights, gen 256; no CUDA: --tiny
    dllm-ais bench precision --precisions bf16,fp8,int8 --batch 16
    dllm-ais bench precision --tiny            # the same code at a tiny shape (CPU or GPU): a code-path check

The model is `LLaDAModelLM` with LLaDA-8B's config (d_model 4096, 32 layers, 32 heads, MLP 12288, vocabulary 126464;
`LLaDAConfig`'s defaults) and random weights in bfloat16 (nothing is downloaded), wrapped as the trainer is: LoRA
(rank --lora-r) on every block linear. Figures, each printed beside the device, torch and torchao versions and the
kernel path that ran it (`RolloutEngine.kernel_path`):

  rollout tokens/s   completion tokens per second of `MaskedDiffusionSampler.sample` (gen --gen-length, block
                     --block-length, --steps steps) on the engine of each notch, block KV cache off and dual (bf16:
                     also dual with FP8 storage, `cache_dtype=fp8`); only the notches whose kernels are not emulated
                     on this device run (an emulated notch is skipped with a line saying so: its figure would
                     measure the emulation; a notch that fails here, a kernel missing or memory short, prints
                     one "failed" line and the others still run);
  sync               seconds of `RolloutEngine.sync_from` (merge LoRA, requantize in place) per optimizer step;
  step peak memory   torch.cuda.max_memory_allocated over one LoRA training step (ℓ_θ scoring, GRPO loss, backward
                     piece by piece, AdamW step) for the one_step and trajectory estimators (CUDA only; on CPU
                     `dllm-ais bench memory` measures peaks in fresh processes).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import statistics
import time

import torch

from dllm_ais.bench.common import describe_device, random_llada, resolve_device, synchronize
from dllm_ais.choices import PRECISIONS

TINY = {"d_model": 64, "n_layers": 2, "n_heads": 4, "mlp_hidden_size": 128, "vocab": 128}
ESTIMATORS = ("one_step", "trajectory")
CACHES = (("none", "none"), ("dual", "none"), ("dual", "fp8"))  # (cache, cache_dtype); the FP8 KV cache with bf16 only


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dllm-ais bench precision", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny LLaDA instead of LLaDA-8B's shape (automatic "
                                                            "without CUDA)")
    parser.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cuda or cpu")
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help="comma-separated notches (bf16 first)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--gen-length", type=int, default=256)
    parser.add_argument("--block-length", type=int, default=32)
    parser.add_argument("--steps", type=int, default=64, help="denoising steps (a multiple of gen/block)")
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
    """The LoRA-wrapped random LLaDA (LLaDA-8B's shape, or TINY with --tiny) in bfloat16 on `device`, built there."""
    from peft import LoraConfig, get_peft_model

    from dllm_ais.models import LLaDAConfig
    from dllm_ais.policy import lora_target_modules

    shape = TINY if args.tiny else {"d_model": LLaDAConfig.d_model, "n_layers": LLaDAConfig.n_layers,
                                    "n_heads": LLaDAConfig.n_heads, "mlp_hidden_size": LLaDAConfig.mlp_hidden_size,
                                    "vocab": LLaDAConfig.vocab_size}
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = random_llada(shape["vocab"], shape["d_model"], shape["n_layers"], shape["n_heads"],
                                 shape["mlp_hidden_size"], args.prompt_length + args.gen_length)
    finally:
        torch.set_default_dtype(default_dtype)
    print(f"model: LLaDA d_model={shape['d_model']} layers={shape['n_layers']} heads={shape['n_heads']} "
          f"mlp={shape['mlp_hidden_size']} vocab={shape['vocab']}, random weights, bfloat16, LoRA r={args.lora_r}")
    return get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r,
                                            target_modules=lora_target_modules("llada")))


def sampler_config(args: argparse.Namespace, model_config, cache: str, cache_dtype: str = "none",
                   gen_length: int | None = None):
    """The benchmark's sampler settings (temperature 1) with block KV cache `cache` stored in `cache_dtype`;
    `gen_length` shorter than --gen-length keeps the steps per block."""
    from dllm_ais.sampling.diffusion import DiffusionSamplerConfig

    gen_length = gen_length or args.gen_length
    return DiffusionSamplerConfig(gen_length=gen_length, block_length=args.block_length,
                                  steps=max(1, args.steps * gen_length // args.gen_length),
                                  temperature=1.0, cache=cache, cache_dtype=cache_dtype,
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


def bench_rollouts(args: argparse.Namespace, trainer, prompts: torch.Tensor, device: torch.device) -> None:
    """Rollout tokens/s per notch, cache off and dual, and the engine's sync seconds, one line each."""
    from dllm_ais.engine import RolloutEngine
    from dllm_ais.quantization import kernel_path
    from dllm_ais.sampling.diffusion import MaskedDiffusionSampler

    for precision in args.precisions.split(","):
        path = kernel_path(precision, device)
        if device.type == "cuda" and path.startswith("emulated"):
            print(f"{precision:<18} skipped: {path} on {device_line(device)}")
            continue
        engine = None
        try:
            engine = RolloutEngine(trainer, precision=precision)
            sync = timed(lambda: engine.sync_from(trainer), device, args.repeats)
            for cache, cache_dtype in CACHES[:3 if precision == "bf16" else 2]:
                sampler = MaskedDiffusionSampler(sampler_config(args, trainer.config, cache, cache_dtype))
                one_block = MaskedDiffusionSampler(sampler_config(args, trainer.config, cache, cache_dtype,
                                                                  gen_length=args.block_length))

                def rollout(sampler=sampler):
                    return sampler.sample(engine.model, prompts, torch.ones_like(prompts),
                                          torch.Generator(device=device).manual_seed(0))

                seconds = timed(rollout, device, args.repeats, warm_up=lambda: rollout(one_block))
                cache = cache if cache_dtype == "none" else f"{cache}+{cache_dtype}"
                print(f"{precision:<18} cache {cache:<8} rollout {prompts.shape[0] * args.gen_length / seconds:10.1f} "
                      f"tokens/s | sync {sync:.3f} s/step | kernels: {engine.kernel_path} | {device_line(device)}",
                      flush=True)
        except Exception as error:  # one notch's missing kernel or memory must not hide the others' figures
            print(f"{precision:<18} failed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
                  f" | {device_line(device)}", flush=True)
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()


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
        print("no CUDA device: LLaDA-8B's shape needs one; running --tiny on cpu (a code-path check, not a measurement)")
        args.tiny = True
    trainer = build_trainer(args, device)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, trainer.config.vocab_size - 2, (args.batch, args.prompt_length),
                            generator=generator).to(device)
    print(f"batch {args.batch}, prompt {args.prompt_length}, gen {args.gen_length}, block {args.block_length}, "
          f"steps {args.steps}, temperature 1; median of {args.repeats} after one warm-up (rollouts: of one block)")
    bench_step_memory(args, trainer, prompts, device)
    bench_rollouts(args, trainer, prompts, device)


if __name__ == "__main__":
    main()
