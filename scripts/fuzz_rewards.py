"""Fuzz every registered reward function with adversarial completions and print what happened.

    python scripts/fuzz_rewards.py                      # 20,000 completions per reward, every task
    python scripts/fuzz_rewards.py --count 100000 --task math500 --max-fraction-depth 30

Per reward: calls, exceptions on text completions, completions scored 0 by a timeout, the slowest call in ms, and
whether every non-text completion was rejected with a TypeError naming the reward. The corpus carries code payloads
that create a marker file if anything evaluates them. Exits 1 if any reward raised on text, let non-text through or
ran a payload. The suite runs the same harness on 2,000 completions (tests/test_reward_fuzz.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from dllm_ais.tasks import get_task, math500, task_names  # noqa: E402
from dllm_ais.tasks import reasoning_gym as gym_task  # noqa: E402
from dllm_ais.tasks.fuzzing import (  # noqa: E402
    EXPONENT_TOWERS,
    adversarial_completions,
    example_rows,
    fuzz_reward,
    non_string_completions,
)


def rejects_non_text(function, rows) -> bool:
    columns = {name: [value] for name, value in rows[0].items() if name != "prompt"}
    for completion in non_string_completions():
        try:
            function([None], [completion], **columns)
        except TypeError as error:
            if not str(error).startswith(function.__name__):
                return False
        else:
            return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=20_000, help="completions per reward function")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-chars", type=int, default=80_000, help="length of the longest completions")
    parser.add_argument("--max-fraction-depth", type=int, default=20, help="deepest nested \\frac")
    parser.add_argument("--deadline", type=float, default=math500.VERIFIER.deadline_seconds,
                        help="math-verify and reasoning-gym deadline per call, seconds")
    parser.add_argument("--task", action="append", choices=task_names(), help="tasks to fuzz (default: all)")
    args = parser.parse_args()

    math500.VERIFIER.deadline_seconds = gym_task.SCORER.deadline_seconds = args.deadline
    marker = Path(tempfile.mkdtemp(prefix="dllm-ais-fuzz-")) / "code-ran"
    completions = adversarial_completions(args.count, args.seed, args.max_chars, args.max_fraction_depth,
                                          EXPONENT_TOWERS, code_marker=str(marker))
    print(f"{len(completions)} completions per reward (seed {args.seed}, up to {args.max_chars} characters, "
          f"\\frac depth {args.max_fraction_depth}, math-verify deadline {args.deadline} s)")
    print(f"{'reward':<28} {'count':>7} {'exceptions':>10} {'timeouts':>8} {'max ms':>9}  non-text rejected")
    failed = False
    for name in args.task or task_names():
        task = get_task(name)
        rows = example_rows(task)
        for function in (*task.reward_funcs, *([task.accuracy] if task.accuracy else [])):
            report = fuzz_reward(function, completions, rows)
            rejected = rejects_non_text(function, rows)
            failed |= bool(report.exceptions) or not rejected
            print(f"{report.name:<28} {report.count:>7} {len(report.exceptions):>10} {report.timeouts:>8} "
                  f"{1000 * report.max_seconds:>9.1f}  {'yes' if rejected else 'NO'}", flush=True)
            for line in report.exceptions[:5]:
                print(f"    {line}")
            if marker.exists():
                print(f"    {report.name} RAN A CODE PAYLOAD (it created {marker})")
                failed = True
                marker.unlink()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
