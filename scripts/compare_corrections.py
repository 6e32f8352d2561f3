"""The AIS paper's comparison in miniature: BF16 rollouts vs low-precision rollouts uncorrected, + TIS, + MIS, + AIS.

    python scripts/compare_corrections.py --quick      # both tiny models, 3 seeds each: 18 minutes on 2 idle cores
    python scripts/compare_corrections.py              # the full setting (60 steps, 256 held-out prompts): 41 minutes
    python scripts/compare_corrections.py --families qwen3 --precision fp8 --seeds 5 --jobs 2
    python scripts/compare_corrections.py --task chain_sum --quick   # the long-completion models and recipes

Every arm trains the shipped tiny recipe of `--task` (digits — LLaDA: `dllm-ais train`; Qwen3:
recipes/tiny_qwen3_digits_fp8_ais.yaml; chain_sum — recipes/tiny_qwen3_chain_sum.yaml and
recipes/tiny_llada_chain_sum.yaml) through the CLI from the same seeds, changing only `rollout_precision` and
`correction` (with `bypass_mode` off: a correction needs the trainer's ℓ_old):

  bf16 (reference)   rollout_precision=bf16, correction=none — on-policy
  <p> uncorrected    rollout_precision=<p>,  correction=none
  <p> + TIS / MIS / AIS

and scores the greedy validation reward every `eval_steps`. Output (in --output-dir/[chain_sum/]<quick|full>/
<overrides>/):
`comparison.md` — per family and arm, the final held-out reward (mean over seeds ± 95 % confidence interval, t
distribution), its change from the start, its difference from the bf16 run of the same seed, mean ESS, mean α
(AIS), mean k3 KL, and the rollout share of the wall time — and `comparison.png` (held-out and training reward over
steps with seed bands; α, ESS, k3 over steps). Runs already finished in that directory are reused, so an
interrupted comparison continues where it stopped.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
RECIPES = {  # task -> family -> the recipe its arms train (None: the embedded one)
    "digits": {"llada": None, "qwen3": REPOSITORY / "recipes" / "tiny_qwen3_digits_fp8_ais.yaml"},
    "chain_sum": {"llada": REPOSITORY / "recipes" / "tiny_llada_chain_sum.yaml",
                  "qwen3": REPOSITORY / "recipes" / "tiny_qwen3_chain_sum.yaml"},
}
REFERENCE_ARM = "bf16 (reference)"
SETTINGS = {  # task -> setting -> overrides: steps, held-out prompts, eval every (none: the recipe's own)
    "digits": {"quick": {"max_steps": 24, "eval_size": 128, "eval_steps": 8},
               "full": {"max_steps": 60, "eval_size": 256, "eval_steps": 10}},
    "chain_sum": {"quick": {"max_steps": 60, "eval_size": 256, "eval_steps": 20}, "full": {}},
}
FAMILY_SETTINGS = {  # (task, setting, family) -> overrides of that family's recipe only
    # 60 steps at 3e-5, where the Qwen3 recipe's 150 steps at 1e-5 have learned what they learn by step 120 (its
    # curve: 25 % -> 96 % by step 40 at 3e-5); the LLaDA recipe keeps its own rate
    ("chain_sum", "quick", "qwen3"): {"learning_rate": 3e-5},
}
T_QUANTILE_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
                  10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101,
                  19: 2.093, 20: 2.086, 25: 2.060, 30: 2.042}  # Student t, two-sided 95 %, by degrees of freedom


@dataclass(frozen=True)
class Run:
    family: str
    arm: str
    seed: int
    overrides: tuple[str, ...]
    output_dir: Path
    recipe: Path | None = None  # None: the embedded recipe

    def command(self) -> list[str]:
        """The run's `dllm-ais train`; its arm sets the correction, so a recipe's `bypass_mode` (ℓ_old taken from
        the rollout, no correction) is switched off."""
        recipe = [str(self.recipe)] if self.recipe else []
        return [sys.executable, "-m", "dllm_ais.cli", "train", *recipe, "--bypass_mode=false", *self.overrides,
                f"--seed={self.seed}", f"--output_dir={self.output_dir}", "--overwrite_output_dir=true",
                "--save_steps=0"]

    @property
    def finished(self) -> bool:
        return any("eval/reward_before" in record for record in read_metrics(self.output_dir))


def arms(precision: str) -> dict[str, tuple[str, ...]]:
    return {
        REFERENCE_ARM: ("--rollout_precision=bf16", "--correction=none"),
        f"{precision} uncorrected": (f"--rollout_precision={precision}", "--correction=none"),
        f"{precision} + TIS": (f"--rollout_precision={precision}", "--correction=tis"),
        f"{precision} + MIS": (f"--rollout_precision={precision}", "--correction=mis"),
        f"{precision} + AIS": (f"--rollout_precision={precision}", "--correction=ais"),
    }


def read_metrics(output_dir: Path) -> list[dict]:
    path = output_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def run_all(runs: list[Run], jobs: int) -> str:
    """Run the unfinished `runs`, `jobs` at a time, printing progress; returns what the study's header says of its
    wall time: the seconds this call took and how many runs were reused from earlier calls (their time not counted)."""
    reused = sum(run.finished for run in runs)
    start = time.perf_counter()
    with ThreadPoolExecutor(jobs) as pool:
        for index, _ in enumerate(pool.map(execute, runs), 1):
            print(f"\r{index}/{len(runs)} runs done ({time.perf_counter() - start:.0f} s)", end="", flush=True)
    print()
    seconds = f"{time.perf_counter() - start:.0f} s wall with {jobs} parallel jobs of one thread"
    return f"{seconds} ({reused} of the runs reused from an earlier call)" if reused else seconds


def execute(run: Run) -> None:
    if run.finished:
        return
    run.output_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with (run.output_dir / "train.log").open("w") as log:
        code = subprocess.call(run.command(), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPOSITORY)
    if code != 0:
        raise RuntimeError(f"{run.family} / {run.arm} / seed {run.seed} failed (exit {code}); see "
                           f"{run.output_dir / 'train.log'}")


def slug(arm: str) -> str:
    """A directory name for an arm: `int4 + AIS` -> `int4-ais`."""
    return "-".join("".join(ch if ch.isalnum() else " " for ch in arm.lower()).split())


def mean_ci(values: list[float]) -> tuple[float, float]:
    """Mean and half-width of its 95 % confidence interval (t distribution; 0 for one value)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    quantile = T_QUANTILE_975[max(df for df in T_QUANTILE_975 if df <= n - 1)]  # the nearest tabulated, conservative
    return mean, quantile * sd / math.sqrt(n)


def series(records: list[dict], key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in records if "loss" in r and r.get(key) is not None]


def summarise(runs: list[Run], num_iterations: dict[str, int]) -> dict:
    """Per (family, arm), one value per seed: the final held-out reward and accuracy (exact decoding) and the same
    decoded by the run's own sampler, the reward's paired change, sampling and training seconds, and the run means
    of ESS, α, k3, distinct completions per group, frac_reward_zero_std, entropy and denoising steps per row."""
    table: dict = {}
    for run in runs:
        records = read_metrics(run.output_dir)
        closing = next(r for r in records if "eval/reward_before" in r)
        steps = [r for r in records if "loss" in r]

        def run_mean(key: str) -> float:
            values = [r[key] for r in steps if r.get(key) is not None]
            return sum(values) / len(values) if values else math.nan

        mu = num_iterations[run.family]
        sampling = sum(r["timing/sample_s"] for r in steps) / mu
        wall = sum(r["timing/generation_batch_s"] for r in steps) / mu + sum(r["timing/optimisation_pass_s"]
                                                                             for r in steps)
        values = {
            "final": closing["eval/reward"], "delta": closing["eval/reward_delta"],
            "accuracy": closing.get("eval/accuracy", math.nan),
            "own_reward": closing.get("eval/rollout_sampler/reward", closing["eval/reward"]),
            "own_accuracy": closing.get("eval/rollout_sampler/accuracy", closing.get("eval/accuracy", math.nan)),
            "ess": run_mean("rollout_corr/rollout_is_eff_sample_size"), "alpha": run_mean("ais/alpha"),
            "k3": run_mean("rollout_corr/k3_kl"), "sampling_s": sampling, "wall_s": wall,
            "rollout_share": sampling / wall, "distinct": run_mean("completions/distinct_per_group"),
            "zero_std": run_mean("frac_reward_zero_std"), "entropy": run_mean("entropy"),
            "steps_per_row": run_mean("completions/mean_steps"),
            "fidelity_level": run_mean("rollout/fidelity_level"),
        }
        entry = table.setdefault((run.family, run.arm), {"records": [], **{key: [] for key in values}})
        for key, value in values.items():
            entry[key].append(value)
        entry["records"].append(records)
    return table


def markdown(table: dict, header: str) -> str:
    """One row per (family, arm). The 95 % intervals are over seeds (t distribution); "vs bf16" pairs each seed's
    final held-out reward with the bf16 reference run of the same seed (same prompts, same initial model)."""
    lines = [header, "", "| model | arm | held-out reward (95 % CI) | Δ from start (95 % CI) | vs bf16, paired by seed "
             "(95 % CI) | ESS | α | k3 KL | rollout share of wall time |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (family, arm), entry in table.items():
        final, ci = mean_ci(entry["final"])
        delta, delta_ci = mean_ci(entry["delta"])
        reference = next(values for (f, a), values in table.items() if f == family and a == REFERENCE_ARM)
        if arm == REFERENCE_ARM:
            versus = "—"
        else:
            difference, difference_ci = mean_ci([x - r for x, r in zip(entry["final"], reference["final"])])
            versus = f"{difference:+.4f} ± {difference_ci:.4f}"
        alpha = sum(entry["alpha"]) / len(entry["alpha"])
        lines.append(f"| {family} | {arm} | {final:.4f} ± {ci:.4f} | {delta:+.4f} ± {delta_ci:.4f} | {versus} | "
                     f"{sum(entry['ess']) / len(entry['ess']):.3f} | {'—' if math.isnan(alpha) else f'{alpha:.3f}'} | "
                     f"{sum(entry['k3']) / len(entry['k3']):.2e} | {sum(entry['rollout_share']) / len(entry['rollout_share']):.2f} |")
    return "\n".join(lines) + "\n"


def plot(table: dict, families: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("held-out reward (greedy)", "eval/reward"), ("training reward", "reward"), ("AIS α", "ais/alpha"),
              ("ESS", "rollout_corr/rollout_is_eff_sample_size"), ("k3 KL(μ ‖ π_old)", "rollout_corr/k3_kl")]
    figure, axes = plt.subplots(len(families), len(panels), figsize=(4.0 * len(panels), 3.2 * len(families)),
                                squeeze=False)
    arm_names = list(dict.fromkeys(arm for _, arm in table))
    colors = {arm: plt.get_cmap("tab10")(index) for index, arm in enumerate(arm_names)}  # one color per arm
    for row, family in enumerate(families):
        for column, (title, key) in enumerate(panels):
            ax = axes[row][column]
            for (entry_family, arm), entry in table.items():
                if entry_family != family:
                    continue
                curves = [held_out_curve(records) if key == "eval/reward" else series(records, key)
                          for records in entry["records"]]
                curves = [c for c in curves if c]
                if not curves:
                    continue
                steps = [step for step, _ in curves[0]]
                values = [[dict(c).get(step, math.nan) for step in steps] for c in curves]
                mean = [sum(v[i] for v in values) / len(values) for i in range(len(steps))]
                low = [min(v[i] for v in values) for i in range(len(steps))]
                high = [max(v[i] for v in values) for i in range(len(steps))]
                ax.plot(steps, mean, label=arm, linewidth=1.2, color=colors[arm])
                ax.fill_between(steps, low, high, color=colors[arm], alpha=0.15, linewidth=0)
            ax.set_title(f"{family}: {title}", fontsize=9)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            if key == "rollout_corr/k3_kl":
                ax.set_yscale("log")
        axes[row][0].legend(fontsize=7)
    figure.suptitle("band: min–max over seeds", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def held_out_curve(records: list[dict]) -> list[tuple[int, float]]:
    """(step, held-out reward): the baseline at step 0, every `eval_steps` evaluation, and the final one."""
    closing = next(r for r in records if "eval/reward_before" in r)
    during = [(r["step"], r["eval/reward"]) for r in records if "loss" in r and "eval/reward" in r]
    return sorted({0: closing["eval/reward_before"], **dict(during), closing["step"]: closing["eval/reward"]}.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="the short setting: 24 steps, 128 held-out prompts (18 minutes on 2 idle cores)")
    parser.add_argument("--task", choices=tuple(RECIPES), default="digits", help="whose tiny models and recipes")
    parser.add_argument("--families", default="llada,qwen3")
    parser.add_argument("--precision", default="int4", help="low-precision rollout mode compared against bf16")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (one CPU thread each)")
    parser.add_argument("--output-dir", type=Path, default=REPOSITORY / "outputs" / "compare-corrections")
    args, extra = parser.parse_known_args()
    setting_name = "quick" if args.quick else "full"
    families = args.families.split(",")
    family_overrides = {family: as_overrides({**SETTINGS[args.task][setting_name],
                                              **FAMILY_SETTINGS.get((args.task, setting_name, family), {})})
                        + tuple(extra) for family in families}
    overrides = "; ".join(f"{family}: {', '.join(family_overrides[family])}" for family in families)
    setting_dir = study_directory(args.output_dir, args.task, args.quick, extra)
    runs = [Run(family, arm, seed, (*arm_overrides, *family_overrides[family]),
                setting_dir / family / slug(arm) / f"seed{seed}", RECIPES[args.task][family])
            for family in families for arm, arm_overrides in arms(args.precision).items()
            for seed in range(args.seeds)]
    wall = run_all(runs, args.jobs)
    num_iterations = {family: num_iterations_of(runs, family) for family in families}
    table = summarise(runs, num_iterations)
    header = (f"{args.task}, {setting_name} setting ({overrides}), {args.seeds} seeds, "
              f"{args.precision} rollouts, {len(runs)} runs, {wall}; "
              f"command: python scripts/compare_corrections.py {' '.join(sys.argv[1:])}")
    report = markdown(table, header)
    (setting_dir / "comparison.md").write_text(report)
    plot(table, families, setting_dir / "comparison.png")
    print(report)
    print(f"table: {setting_dir / 'comparison.md'} | plot: {setting_dir / 'comparison.png'}")


def as_overrides(settings: dict) -> tuple[str, ...]:
    """Config fields as the CLI's `--field=value` overrides."""
    return tuple(f"--{key}={value}" for key, value in settings.items())


def study_directory(output_dir: Path, task: str, quick: bool, extra: list[str]) -> Path:
    """Where a study's runs go: runs are reused only from a directory of the same task, setting and extra
    overrides (the digits studies keep the layout without a task level)."""
    return (output_dir if task == "digits" else output_dir / task) / ("quick" if quick else "full") / (
        hashlib.sha1(" ".join(extra).encode()).hexdigest()[:8] if extra else "recipe")


def num_iterations_of(runs: list[Run], family: str) -> int:
    """μ of a family's runs, from the config one of them saved."""
    from dllm_ais.validation import read_recipe

    run = next(r for r in runs if r.family == family)
    return int(read_recipe(run.output_dir / "config.yaml")["num_iterations"])


if __name__ == "__main__":
    main()
