"""Soak (slow tier): a hundred steps of the default recipe with checkpoints written and pruned along the way; the
resident memory must stay flat and only the newest checkpoints stay on disk."""

import statistics
from pathlib import Path

import pytest

from dllm_ais.config import EMBEDDED_RECIPE, load_config
from dllm_ais.trainer import GRPOTrainer

STEPS, INTERVAL, WARMUP = 100, 10, 30
MAX_SLOPE_MB_PER_100_STEPS = 20.0  # a leak of a batch's tensors per step is far above; the allocator's noise below


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
    return 100 * covariance / sum((s - mean_step) ** 2 for s in steps)


def test_slope_of_a_known_line():
    assert slope_per_100_steps([(0, 1.0), (10, 2.0), (20, 3.0)]) == pytest.approx(10.0)


@pytest.mark.slow
def test_a_long_run_with_checkpoints_keeps_its_memory_flat(tmp_path):
    config = load_config(EMBEDDED_RECIPE, [f"--max_steps={STEPS}", f"--save_steps={INTERVAL}", "--save_total_limit=2",
                                           "--eval_size=8", "--per_device_train_batch_size=16",
                                           f"--output_dir={tmp_path / 'run'}"])
    samples: list[tuple[int, float]] = []

    class SoakTrainer(GRPOTrainer):
        """The trainer, sampling resident memory every INTERVAL steps."""

        def training_step(self):
            metrics = super().training_step()
            if self.global_step % INTERVAL == 0:
                samples.append((self.global_step, resident_mb()))
            return metrics

    SoakTrainer(config).train()
    warm = [(step, mb) for step, mb in samples if step > WARMUP]
    assert len(warm) == (STEPS - WARMUP) // INTERVAL
    slope = slope_per_100_steps(warm)
    assert slope < MAX_SLOPE_MB_PER_100_STEPS, f"resident memory grows {slope:+.1f} MB per 100 steps: {samples}"
    kept = {path.name for path in (tmp_path / "run").glob("checkpoint-*")}
    assert kept == {f"checkpoint-{STEPS - INTERVAL}", f"checkpoint-{STEPS}"}
