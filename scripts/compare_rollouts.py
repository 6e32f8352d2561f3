"""Fast rollouts against exact ones: what approximate diffusion decoding costs in learning, per estimator and correction.

    python scripts/compare_rollouts.py --quick       # 5 arms x 3 seeds, 20 steps: 18 min on 2 quiet cores
    python scripts/compare_rollouts.py               # the full grid, 30 steps: fast settings x corrections x estimators
    python scripts/compare_rollouts.py --arms "trajectory dual+t0.9/adaptive AIS" --seeds 3   # chosen arms, 30 steps

Every arm trains the shipped tiny LLaDA recipe (`dllm-ais train`: digits, FP8 rollouts, LoRA; with `--task chain_sum`
recipes/tiny_llada_chain_sum.yaml, BF16 rollouts) through the CLI from the same seeds, changing only
the rollout decoder (`rollout_cache`, `rollout_threshold`), the likelihood estimator (with `likelihood_order` and
`likelihood_decoder` for the trajectory one: `trajectory` is the exact model's replay of the
rollout's trajectory, `trajectory@decoder` the replay of the rollout decoder itself, cache included,
`trajectory@exact-order` the completion replayed along the exact decoder's order) and the correction. Each run's
held-out score is measured twice on the same validation prompts, greedy: decoded exactly (d1's protocol: no cache, no
parallel commits — `eval/*`), and decoded by the run's own rollout sampler (`eval/rollout_sampler/*`, what a user
deploying the fast decoder gets).

Each fast arm is paired, seed by seed, with the exact-rollout arm of its estimator, and each other estimator's
exact-rollout arm with the one-step estimator's (same seed: same prompts, same initial model). Output in --output-dir/<quick|full>/: `comparison.md` — per arm, held-out accuracy and reward under
both decoders (mean over seeds ± 95 % CI, t distribution), the accuracy difference from its reference paired by seed,
sampling seconds per run and their ratio to the reference's, whole-run training seconds, ESS, k3, α, distinct
completions per group, frac_reward_zero_std, entropy and denoising steps per row — and `front.png` (held-out accuracy
under exact decoding against sampling seconds, one point per run: the front a user picks from) with `curves.png`
(curves over steps). Runs already finished in that directory are reused.

Autoregressive models have no approximate decoder here: for Qwen3 only precision differs between rollout and
trainer, which `scripts/compare_corrections.py` compares.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from dllm_ais.config import EMBEDDED_RECIPE, load_config

from compare_corrections import (RECIPES, REPOSITORY, Run, as_overrides, mean_ci, num_iterations_of, plot, run_all,
                                 slug, study_directory, summarise)

SETTINGS = {  # task -> setting -> overrides: steps, held-out prompts (>= 256: paired comparisons), eval every
    # 20 steps: the 30-step runs' step-20 evaluations already show both claims (trajectory: 88.7 % exact rollouts
    # against 59.6 % fast, 3 seeds), at two thirds of the time
    "digits": {"quick": {"max_steps": 20, "eval_size": 256, "eval_steps": 10},
               "full": {"max_steps": 30, "eval_size": 256, "eval_steps": 10}},
    "chain_sum": {"quick": {"max_steps": 40, "eval_size": 256, "eval_steps": 20}, "full": {}},  # full: the recipe's
}
DECODERS = {  # name -> overrides; "exact" is LLaDA's algorithm (no cache, the recipe's fixed 2-token schedule)
    "exact": ("--rollout_cache=none", "--rollout_threshold=null"),
    "dual+t0.9": ("--rollout_cache=dual", "--rollout_threshold=0.9"),
    "dual": ("--rollout_cache=dual", "--rollout_threshold=null"),
    "t0.9": ("--rollout_cache=none", "--rollout_threshold=0.9"),
    "prefix+t0.9": ("--rollout_cache=prefix", "--rollout_threshold=0.9"),
    # the fast decoder with its fidelity driven by the mismatch diagnostics, or with half the groups decoded exactly
    "dual+t0.9/adaptive": ("--rollout_cache=dual", "--rollout_threshold=0.9", "--rollout_fidelity=adaptive"),
    "dual+t0.9/exact-half": ("--rollout_cache=dual", "--rollout_threshold=0.9", "--rollout_exact_fraction=0.5"),
}
ESTIMATORS = {  # name -> overrides
    "one_step": ("--likelihood_estimator=one_step", "--likelihood_order=rollout"),
    # the exact model replays the fast decoder's trajectory: the ratio sees the cache's logit error
    "trajectory": ("--likelihood_estimator=trajectory", "--likelihood_order=rollout", "--likelihood_decoder=exact"),
    "trajectory@exact-order": ("--likelihood_estimator=trajectory", "--likelihood_order=exact"),
    # the trainer replays the rollout decoder itself (its cache included): the fast decoder is the policy trained
    "trajectory@decoder": ("--likelihood_estimator=trajectory", "--likelihood_order=rollout",
                           "--likelihood_decoder=rollout"),
    # the recipe's 8 steps in 4 segments (d2's N = 16 is for 128+ steps; N >= 8 would be the trajectory itself)
    "step_merge": ("--likelihood_estimator=step_merge", "--likelihood_segments=4", "--likelihood_order=rollout"),
    "elbo": ("--likelihood_estimator=elbo", "--likelihood_order=rollout"),
    "spg": ("--likelihood_estimator=spg", "--likelihood_order=rollout"),
}
CORRECTIONS = {"AIS": ("--correction=ais",), "none": ("--correction=none",), "TIS": ("--correction=tis",),
               "MIS": ("--correction=mis",), "seq-IS": ("--correction=tis", "--is_level=sequence")}
# the claims: the fast decoder is free for the one-step estimator; for the trajectory one it costs what the exact
# model's replay of the fast trajectory teaches, and nothing measurable when the trainer replays the decoder itself
QUICK_ARMS = ["one_step exact AIS", "one_step dual+t0.9 AIS", "trajectory exact AIS", "trajectory dual+t0.9 AIS",
              "trajectory@decoder dual+t0.9 AIS"]


def all_arms() -> list[str]:
    """The full grid: every estimator with exact rollouts (its reference) and with every fast decoder under every
    correction (the exact-order replay with AIS only: its ratio sees precision alone, as the one-step one does)."""
    names = [f"{estimator} exact AIS" for estimator in ESTIMATORS if "@" not in estimator]
    for decoder in (d for d in DECODERS if d != "exact" and "/" not in d):
        names += [f"{estimator} {decoder} {correction}" for estimator in ("one_step", "trajectory")
                  for correction in CORRECTIONS]
        names.append(f"trajectory@exact-order {decoder} AIS")
    names += [f"trajectory {decoder} AIS" for decoder in DECODERS if "/" in decoder]  # fidelity: the ratio must see it
    return names


def arm_overrides(arm: str) -> tuple[str, ...]:
    estimator, decoder, correction = arm.split()
    return (*ESTIMATORS[estimator], *DECODERS[decoder], *CORRECTIONS[correction])


def reference_arm(arm: str) -> str:
    """The arm `arm` is paired with: a fast-rollout arm with its estimator family's exact-rollout AIS arm; an
    exact-rollout arm of another estimator with the one-step estimator's (which estimator learns more)."""
    estimator, decoder = arm.split()[0].split("@")[0], arm.split()[1]
    return "one_step exact AIS" if decoder == "exact" else f"{estimator} exact AIS"


def markdown(table: dict, header: str) -> str:
    def cell(values: list[float], digits: int = 3, scale: float = 1.0) -> str:
        mean, ci = mean_ci([v * scale for v in values])
        return "—" if math.isnan(mean) else f"{mean:.{digits}f} ± {ci:.{digits}f}"

    def average(values: list[float], form: str) -> str:
        finite = [v for v in values if not math.isnan(v)]
        return format(sum(finite) / len(finite), form) if finite else "—"

    lines = [header, "",
             "| arm (estimator · rollouts · correction) | accuracy, exact decoding (%) | vs reference (its "
             "estimator's exact rollouts; exact arms: one_step's), paired by seed (points) | accuracy, own sampler (%) | reward, exact decoding | sampling s / run | × reference | "
             "training s / run | ESS | k3 | α | distinct / group | zero-std | entropy | steps / row | fidelity rung |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (_, arm), entry in table.items():
        reference = table.get(("llada", reference_arm(arm)))
        versus = ratio = "—"
        if reference is not None and reference is not entry:
            pairs = list(zip(entry["accuracy"], reference["accuracy"]))
            versus = cell([a - r for a, r in pairs], digits=1, scale=100)
            ratio = f"{sum(entry['sampling_s']) / sum(reference['sampling_s'][:len(entry['sampling_s'])]):.2f}"
        lines.append(
            f"| {arm} | {cell(entry['accuracy'], 1, 100)} | {versus} | {cell(entry['own_accuracy'], 1, 100)} | "
            f"{cell(entry['final'], 4)} | {average(entry['sampling_s'], '.0f')} | {ratio} | "
            f"{average(entry['wall_s'], '.0f')} | {average(entry['ess'], '.3f')} | {average(entry['k3'], '.2e')} | "
            f"{average(entry['alpha'], '.2f')} | {average(entry['distinct'], '.2f')} | "
            f"{average(entry['zero_std'], '.2f')} | {average(entry['entropy'], '.3f')} | "
            f"{average(entry['steps_per_row'], '.1f')} | {average(entry['fidelity_level'], '.2f')} |")
    return "\n".join(lines) + "\n"


def plot_front(table: dict, path: Path) -> None:
    """Held-out accuracy (exact decoding) against sampling seconds, one point per run, one color per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, ax = plt.subplots(figsize=(7.5, 4.8))
    for index, ((_, arm), entry) in enumerate(table.items()):
        ax.scatter(entry["sampling_s"], [100 * a for a in entry["accuracy"]], label=arm, s=22,
                   color=plt.get_cmap("tab20")(index % 20), marker="o" if "exact " in arm else "^")
    ax.set_xlabel("sampling seconds per run (rollouts, incl. any order replay)")
    ax.set_ylabel("held-out accuracy, exact decoding (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help=f"{SETTINGS['digits']['quick']['max_steps']} steps (digits) and only the arms {', '.join(QUICK_ARMS)}")
    parser.add_argument("--task", choices=tuple(RECIPES), default="digits",
                        help="digits: the embedded LLaDA recipe; chain_sum: recipes/tiny_llada_chain_sum.yaml")
    parser.add_argument("--arms", default=None, help="comma-separated arm names (estimator decoder correction)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (one CPU thread each)")
    parser.add_argument("--output-dir", type=Path, default=REPOSITORY / "outputs" / "compare-rollouts")
    args, extra = parser.parse_known_args()
    setting = SETTINGS[args.task]["quick" if args.quick else "full"]
    names = args.arms.split(",") if args.arms else QUICK_ARMS if args.quick else all_arms()
    names = list(dict.fromkeys([*(reference_arm(name) for name in names), *names]))  # references first
    overrides = as_overrides(setting) + tuple(extra)
    setting_dir = study_directory(args.output_dir, args.task, args.quick, extra)
    runs = [Run("llada", name, seed, (*arm_overrides(name), *overrides), setting_dir / slug(name) / f"seed{seed}",
                RECIPES[args.task]["llada"])
            for name in names for seed in range(args.seeds)]
    wall = run_all(runs, args.jobs)
    table = summarise(runs, {"llada": num_iterations_of(runs, "llada")})
    recipe = RECIPES[args.task]["llada"]
    header = (f"{'quick' if args.quick else 'full'} setting ({', '.join(overrides)}), {args.seeds} seeds, "
              f"{recipe.relative_to(REPOSITORY) if recipe else 'embedded LLaDA digits recipe'} "
              f"({load_config(recipe or EMBEDDED_RECIPE).rollout_precision} rollouts), "
              f"{len(runs)} runs, {wall}; command: python scripts/compare_rollouts.py {' '.join(sys.argv[1:])}")
    report = markdown(table, header)
    (setting_dir / "comparison.md").write_text(report)
    plot_front(table, setting_dir / "front.png")
    plot(table, ["llada"], setting_dir / "curves.png")
    print(report)
    print(f"table: {setting_dir / 'comparison.md'} | front: {setting_dir / 'front.png'} | curves: "
          f"{setting_dir / 'curves.png'}")


if __name__ == "__main__":
    main()
