"""Soak test: a few hundred steps of the default recipe with checkpoints; resident memory and step time over time.

    python scripts/soak.py                       # 300 steps, a checkpoint every 25 (about 15 min on 2 CPU cores)
    python scripts/soak.py --steps 100 --interval 10 --json soak.json

Runs the embedded default recipe (tiny LLaDA, digits, FP8 rollouts, AIS, LoRA) in this process, with
`save_steps=--save-steps` and `save_total_limit=2`, so checkpoint writing and pruning are part of the loop. Every
`--interval` steps it prints the step, the resident set size (VmRSS) and the mean step time since the last line.
At the end: the least-squares slope of resident memory against the step after `--warmup` steps, in MB per 100
steps (flat memory: a slope near 0, within the noise of the allocator).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


def resident_mb() -> float:
    """This process' resident set size (VmRSS) in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status (the soak needs Linux)")


def slope_per_100_steps(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of (step, MB) points, in MB per 100 steps."""
    steps, values = [p[0] for p in points], [p[1] for p in points]
    mean_step, mean_value = statistics.fmean(steps), statistics.fmean(values)
    covariance = sum((s - mean_step) * (v - mean_value) for s, v in points)
    variance = sum((s - mean_step) ** 2 for s in steps)
    return 100 * covariance / variance


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--save-steps", type=int, default=25)
    parser.add_argument("--interval", type=int, default=25, help="print a line every this many steps")
    parser.add_argument("--warmup", type=int, default=50, help="steps left out of the slope")
    parser.add_argument("--output_dir", help="run directory (default: a new temporary one)")
    parser.add_argument("--json", help="also write the samples and the slope to this file")
    args = parser.parse_args()

    from dllm_ais.config import EMBEDDED_RECIPE, load_config
    from dllm_ais.console import configure_console
    from dllm_ais.trainer import GRPOTrainer

    configure_console()
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="dllm-ais-soak-")
    config = load_config(EMBEDDED_RECIPE, [f"--max_steps={args.steps}", f"--save_steps={args.save_steps}",
                                           "--save_total_limit=2", "--eval_size=8", f"--output_dir={output_dir}"])
    samples: list[dict[str, float]] = []

    class SoakTrainer(GRPOTrainer):
        """The trainer, sampling resident memory and step time every `--interval` steps."""

        interval_start = time.perf_counter()

        def training_step(self):
            metrics = super().training_step()
            if self.global_step % args.interval == 0:
                now = time.perf_counter()
                sample = {"step": self.global_step, "rss_mb": resident_mb(),
                          "step_s": (now - self.interval_start) / args.interval}
                self.interval_start = now
                samples.append(sample)
                print(f"soak step {sample['step']:4d} | RSS {sample['rss_mb']:7.1f} MB | "
                      f"{sample['step_s']:.2f} s/step", file=sys.stderr, flush=True)
            return metrics

    start = time.perf_counter()
    SoakTrainer(config).train()
    warm = [(s["step"], s["rss_mb"]) for s in samples if s["step"] > args.warmup]
    slope = slope_per_100_steps(warm) if len(warm) >= 2 else float("nan")
    result = {"steps": args.steps, "save_steps": args.save_steps, "warmup": args.warmup, "samples": samples,
              "rss_slope_mb_per_100_steps": slope, "wall_s": time.perf_counter() - start}
    print(f"soak: {args.steps} steps in {result['wall_s']:.0f} s; RSS after step {args.warmup}: "
          f"{min(v for _, v in warm):.1f}-{max(v for _, v in warm):.1f} MB, slope {slope:+.2f} MB per 100 steps")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
