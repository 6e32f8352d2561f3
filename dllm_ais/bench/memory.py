"""Peak memory of ℓ_θ scoring + backward per diffusion estimator and number of denoising steps.

    dllm-ais bench memory                      # embedded LLaDA, gen 64, batch 32, 8/32/64 steps
    dllm-ais bench memory --compare-all-at-once --steps 8   # and the single-backward pass

Each setting runs in a fresh subprocess on one CPU thread: it loads the embedded LLaDA (`dllm_ais/assets/tiny_llada`),
samples a batch of completions of random prompts (no grad), computes ℓ_old (no grad), records its resident set size,
then runs what `optimisation_pass` runs for one micro-batch — the estimator's pieces, `TokenLoss`, and a backward per
piece (`grpo.backward_by_pieces`) — and reports the growth of its peak resident set (`ru_maxrss`) over that size;
glibc's mmap threshold is fixed (MALLOC_MMAP_THRESHOLD_) so that the resident set follows live memory, not the allocator's retained free blocks.
With --compare-all-at-once, a second column gives the same pass with the pieces summed before one backward (every
forward of the trajectory held in one autograd graph: the memory the per-piece backward removes; about 10 GB for the
trajectory at 64 steps). Settings: one_step (d1), trajectory,
step_merge (N = --segments) at each step count, and the AR-order trajectory (remasking=left_to_right, steps = gen
length). Ratios are to one_step's per-piece peak at the same step count.
"""

from __future__ import annotations

import argparse
import json
import os
import platform

from dllm_ais.bench.common import peak_resident_bytes, run_child

SETTINGS = ("one_step", "trajectory", "step_merge")


def rss_bytes() -> int:
    """The current resident set size of this process."""
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def measure(args) -> dict:
    """One setting in this process: the peak resident growth (bytes) of scoring + backward."""
    import torch

    torch.set_num_threads(1)
    from dllm_ais.config import EMBEDDED_MODEL
    from dllm_ais.grpo import backward_by_pieces
    from dllm_ais.loading import load_model
    from dllm_ais.loss import TokenLoss
    from dllm_ais.policy import DiffusionPolicy
    from dllm_ais.sampling.diffusion import DiffusionSamplerConfig
    from dllm_ais.settings import LikelihoodSettings

    model = load_model(EMBEDDED_MODEL, torch.float32)
    config = model.config
    sampler = DiffusionSamplerConfig(gen_length=args.gen_length, block_length=args.block_length, steps=args.steps,
                                     temperature=0.9, remasking=args.remasking, mask_token_id=config.mask_token_id,
                                     eos_token_ids=(config.eos_token_id,), pad_token_id=config.pad_token_id)
    policy = DiffusionPolicy(sampler, LikelihoodSettings(args.estimator, segments=args.segments))
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, config.vocab_size - 10, (args.batch, args.prompt_length), generator=generator)
    model.eval()
    with torch.no_grad():
        rollout = policy.sample(model, prompts, torch.ones_like(prompts), generator)
        logp_old = policy.logprobs(model, rollout, seed=1)
    model.train()
    objective = TokenLoss(logp_old, torch.randn(args.batch, generator=generator), rollout.completion_mask,
                          loss_type="dapo")
    before = rss_bytes()
    done = backward_by_pieces(policy.logprob_pieces(model, rollout, seed=1), objective, rollout.completion_mask,
                              lambda loss: loss.backward(), compute_entropy=False, piecewise=not args.all_at_once)
    peak = peak_resident_bytes()
    assert bool(done.finite_logprobs) and bool(done.finite_loss)
    return {"peak_growth": peak - before}


def run_setting(args, estimator: str, steps: int, remasking: str, all_at_once: bool) -> dict:
    """`measure` of one setting in a fresh process on one thread."""
    arguments = ["--estimator", estimator, "--steps", str(steps), "--remasking", remasking, "--gen-length",
                 str(args.gen_length), "--batch", str(args.batch), "--block-length", str(args.block_length),
                 "--segments", str(args.segments), "--prompt-length", str(args.prompt_length)]
    # A fixed mmap threshold returns every large freed buffer to the OS at once: without it glibc raises the threshold
    # as buffers are freed and keeps them in its heap, so the resident size also counts freed, fragmented memory.
    return run_child("dllm_ais.bench.memory", arguments + (["--all-at-once"] if all_at_once else []),
                     {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="dllm-ais bench memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gen-length", type=int, default=64)
    parser.add_argument("--block-length", type=int, default=32)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--steps", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--segments", type=int, default=16, help="step_merge's N (likelihood_segments)")
    parser.add_argument("--compare-all-at-once", action="store_true",
                        help="also measure the pass with one backward over all pieces (the memory grows with steps)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--estimator", default="one_step", help=argparse.SUPPRESS)
    parser.add_argument("--remasking", default="low_confidence", help=argparse.SUPPRESS)
    parser.add_argument("--all-at-once", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        args.steps = args.steps[0]
        print(json.dumps(measure(args)))
        return

    print(f"device: CPU ({platform.processor() or platform.machine()}), 1 thread, MALLOC_MMAP_THRESHOLD_=65536; "
          f"embedded LLaDA, float32, full fine-tune; gen {args.gen_length}, block {args.block_length}, batch {args.batch}, prompt "
          f"{args.prompt_length}, step_merge N = {args.segments}; loss dapo")
    print("peak resident growth of scoring + backward (MB), fresh process per cell; ratio = per-piece / one_step's")
    header = (f"{'setting':<38}{'steps':>6}{'forwards':>9}{'per piece MB':>14}{'ratio':>7}"
              + (f"{'all at once MB':>16}" if args.compare_all_at_once else ""))
    print(header)
    print("-" * len(header))
    rows = [(estimator, steps, "low_confidence") for steps in args.steps for estimator in SETTINGS]
    rows.append(("trajectory", args.gen_length, "left_to_right"))
    one_step_peak = {}
    for estimator, steps, remasking in rows:
        piecewise = run_setting(args, estimator, steps, remasking, all_at_once=False)
        if estimator == "one_step":
            one_step_peak[steps] = piecewise["peak_growth"]
        forwards = {"one_step": 1, "trajectory": steps, "step_merge": min(args.segments, steps)}[estimator]
        name = estimator + (" (AR order, left_to_right)" if remasking == "left_to_right" else "")
        ratio = piecewise["peak_growth"] / one_step_peak.get(steps, one_step_peak[max(one_step_peak)])
        at_once = ""
        if args.compare_all_at_once:
            at_once_peak = run_setting(args, estimator, steps, remasking, all_at_once=True)["peak_growth"]
            at_once = f"{at_once_peak / 2**20:>16.1f}"
        print(f"{name:<38}{steps:>6}{forwards:>9}{piecewise['peak_growth'] / 2**20:>14.1f}{ratio:>7.2f}{at_once}",
              flush=True)


if __name__ == "__main__":
    main()
