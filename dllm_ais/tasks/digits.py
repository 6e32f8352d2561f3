"""The embedded "digits" task: sort or reverse 3-6 random digits, generated from a seed (no files).

A prompt is one user turn such as ``"sort 3 9 1 4"``; ``answer`` is ``"1 3 4 9"`` (``"4 1 9 3"`` for
``reverse``). Reward: positional partial credit in [0, 1]; accuracy: 1.0 for the exact digit
sequence. Its eval protocol is the embedded run's own: 16 tokens in one block of 16, 8 steps.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

from dllm_ais.tasks import Task, accuracy_of
from dllm_ais.tasks.parsing import completion_texts, dataset_column

if TYPE_CHECKING:
    import datasets

OPERATIONS: dict[str, Callable[[list[str]], list[str]]] = {
    "sort": sorted,
    "reverse": lambda digits: digits[::-1],
}
DEFAULT_SIZES = {"train": 10_000, "validation": 500, "test": 500}


def make_digits_dataset(size: int, seed: int | str, min_len: int = 3, max_len: int = 6) -> "datasets.Dataset":
    """Generate ``size`` examples of the digits task, deterministically from ``seed``.

    Each example draws an operation (``sort`` ascending or ``reverse``) and ``min_len`` to
    ``max_len`` random digits. ``prompt`` is one user turn such as ``"sort 3 9 1 4"``; ``answer``
    is the result, e.g. ``"1 3 4 9"`` (``"4 1 9 3"`` for ``reverse``).
    """
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
    import datasets  # here, not at the top: the task registry is read by `--help` and config validation

    rng = random.Random(seed)
    prompts, answers = [], []
    for _ in range(size):
        operation = rng.choice(sorted(OPERATIONS))
        digits = [str(rng.randrange(10)) for _ in range(rng.randint(min_len, max_len))]
        prompts.append([{"role": "user", "content": f"{operation} {' '.join(digits)}"}])
        answers.append(" ".join(OPERATIONS[operation](digits)))
    return datasets.Dataset.from_dict({"prompt": prompts, "answer": answers})


def digits_split_seed(seed: int, split: str) -> int | str:
    """Return the generator seed of a digits split. Train and test take 2·seed and 2·seed + 1; validation
    takes a string seed, which ``random.Random`` hashes to a number far above any integer seed's: no split of
    any run shares its generator with another split."""
    if split not in DEFAULT_SIZES:
        raise ValueError(f"the digits task has splits {sorted(DEFAULT_SIZES)}, got {split!r}")
    return f"digits-validation-{seed}" if split == "validation" else 2 * seed + (split == "test")


def generate(split: str, size: int | None, seed: int) -> "datasets.Dataset":
    """The ``split`` of the digits task for run seed ``seed`` (``size`` defaults to 10,000 train / 500 validation
    and test rows)."""
    seed_of_split = digits_split_seed(seed, split)
    return make_digits_dataset(DEFAULT_SIZES[split] if size is None else size, seed_of_split)


def digits_score(text: str, target: str) -> float:
    """Fraction of positions where the digits of ``text`` (in order) match the digits of
    ``target``, over max(len(target), len(parsed)) so extra or missing digits count as wrong."""
    target_digits = re.findall(r"\d", target)
    parsed_digits = re.findall(r"\d", text)
    positions = max(len(target_digits), len(parsed_digits))
    if positions == 0:
        return 1.0
    return sum(1 for expected, got in zip(target_digits, parsed_digits, strict=False) if expected == got) / positions


def digits_reward(prompts: list, completions: list, **kwargs) -> list[float]:
    """Per completion, :func:`digits_score` against the ``answer`` column (in [0, 1])."""
    targets = dataset_column(kwargs, "answer", "digits_reward")
    return [digits_score(text, str(target))
            for text, target in zip(completion_texts(completions, "digits_reward"), targets, strict=True)]


TASK = Task(
    name="digits",
    reward_funcs=(digits_reward,),
    accuracy=accuracy_of(digits_reward, 1.0, "digits_accuracy"),
    generate=generate,
    sample_rows=({"prompt": [{"role": "user", "content": "sort 3 9 1 4"}], "answer": "1 3 4 9"},),
    eval_gen_lengths=(16,),
    eval_block_length=16,
)
