"""Task datasets: prompts in chat form plus the columns the task's reward functions read.

Every dataset returned here has a ``prompt`` column (a list of chat messages) and the task's
reward columns:

- gsm8k: ``openai/gsm8k`` (config ``main``); ``answer`` (the full solution ending ``#### n``)
- math500: ``HuggingFaceH4/MATH-500``; ``answer`` and/or ``solution``
- countdown: ``Jiayi-Pan/Countdown-Tasks-3to4`` (three-number rows); ``nums``, ``target``
- sudoku: a local 4x4 CSV with ``Puzzle``, ``Solution``; ``puzzle``, ``solution`` (16 digits)
- digits: generated here from a seed, no files; ``answer``

Following d1's data code, the format instructions open the single user turn (there is no
system message), so accuracy compares with d1's numbers; the source's other columns are kept.
"""
from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets

from dllm_ais.choices import TASKS
from dllm_ais.rewards import parse_number_list, sudoku_grid

logger = logging.getLogger(__name__)

Messages = list[dict[str, str]]

REASONING_FORMAT = (
    "Think the problem through step by step, then reply in exactly this format:\n"
    "<reasoning>\n...\n</reasoning>\n<answer>\n...\n</answer>"
)

SYSTEM_PROMPTS: dict[str, str] = {
    "gsm8k": REASONING_FORMAT + "\nThe answer block holds only the final number.",
    "math500": REASONING_FORMAT + "\nYou are an expert mathematician. Write the final answer inside \\boxed{} "
    "in the answer block.",
    "countdown": REASONING_FORMAT + "\nThe answer block holds only the arithmetic expression: no '=' sign and no "
    "target number. For example, with the numbers [2, 3, 4] and the target 5, a valid answer is\n"
    "<answer>\n2*4-3\n</answer>",
    "sudoku": REASONING_FORMAT + "\nYou solve 4x4 Sudoku puzzles. Every row, every column and each of the four 2x2 "
    "boxes must contain the digits 1, 2, 3 and 4 exactly once. The puzzle is given as 16 digits, row by "
    "row, where 0 marks an empty cell. The answer block holds the completed grid as 16 digits, row by row.",
}


def user_prompt(task: str, text: str) -> Messages:
    """Return the chat prompt for one example of ``task``: one user turn with the task's format
    instructions, a blank line, then ``text``."""
    return [{"role": "user", "content": f"{SYSTEM_PROMPTS[task]}\n\n{text}"}]


def gsm8k_prompt(question: str) -> Messages:
    """Chat prompt for a GSM8K word problem."""
    return user_prompt("gsm8k", question)


def math500_prompt(problem: str) -> Messages:
    """Chat prompt for a MATH problem."""
    return user_prompt("math500", problem)


def countdown_prompt(numbers: list[int], target: int) -> Messages:
    """Chat prompt asking for an expression that uses each of ``numbers`` once and equals ``target``."""
    return user_prompt(
        "countdown",
        f"Using the numbers {numbers}, write an arithmetic expression that equals {target}. Use every number "
        "exactly once; you may use +, -, *, / and parentheses.",
    )


def sudoku_prompt(puzzle: str) -> Messages:
    """Chat prompt for a 4x4 Sudoku puzzle given as 16 digits ('0' = empty)."""
    return user_prompt("sudoku", f"Solve this 4x4 Sudoku puzzle: {puzzle}")


# ---------------------------------------------------------------------------------------------
# Embedded "digits" task
# ---------------------------------------------------------------------------------------------

DIGITS_OPERATIONS: dict[str, Callable[[list[str]], list[str]]] = {
    "sort": sorted,
    "reverse": lambda digits: digits[::-1],
}
DIGITS_DEFAULT_SIZES = {"train": 10_000, "test": 500}
DIGITS_SPLIT_INDEX = {"train": 0, "test": 1}


def make_digits_dataset(size: int, seed: int, min_len: int = 3, max_len: int = 6) -> datasets.Dataset:
    """Generate ``size`` examples of the digits task, deterministically from ``seed``.

    Each example draws an operation (``sort`` ascending or ``reverse``) and ``min_len`` to
    ``max_len`` random digits. ``prompt`` is one user turn such as ``"sort 3 9 1 4"``; ``answer``
    is the result, e.g. ``"1 3 4 9"`` (``"4 1 9 3"`` for ``reverse``).
    """
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
    rng = random.Random(seed)
    prompts, answers = [], []
    for _ in range(size):
        operation = rng.choice(sorted(DIGITS_OPERATIONS))
        digits = [str(rng.randrange(10)) for _ in range(rng.randint(min_len, max_len))]
        prompts.append([{"role": "user", "content": f"{operation} {' '.join(digits)}"}])
        answers.append(" ".join(DIGITS_OPERATIONS[operation](digits)))
    return datasets.Dataset.from_dict({"prompt": prompts, "answer": answers})


def digits_split_seed(seed: int, split: str) -> int:
    """Return the generator seed of a digits split; train and test never share a seed."""
    if split not in DIGITS_SPLIT_INDEX:
        raise ValueError(f"the digits task has splits {sorted(DIGITS_SPLIT_INDEX)}, got {split!r}")
    return len(DIGITS_SPLIT_INDEX) * seed + DIGITS_SPLIT_INDEX[split]


# ---------------------------------------------------------------------------------------------
# File and hub tasks
# ---------------------------------------------------------------------------------------------


def gsm8k_example(row: dict[str, Any]) -> dict[str, Any]:
    """Prompt for a GSM8K row; ``answer`` stays the full solution ending in ``#### n``."""
    return {"prompt": gsm8k_prompt(row["question"])}


def math500_example(row: dict[str, Any]) -> dict[str, Any]:
    """Prompt for a MATH row; ``answer``/``solution`` stay as they are."""
    return {"prompt": math500_prompt(row["problem"])}


def countdown_example(row: dict[str, Any]) -> dict[str, Any]:
    """Prompt for a Countdown row, with ``nums`` as a list of ints and ``target`` as an int."""
    numbers = [int(number) for number in parse_number_list(row["nums"])]
    target = int(str(row["target"]).strip())
    return {"prompt": countdown_prompt(numbers, target), "nums": numbers, "target": target}


def sudoku_example(row: dict[str, Any]) -> dict[str, Any]:
    """Prompt for a Sudoku row, with ``puzzle`` and ``solution`` as 16-digit strings."""
    puzzle = sudoku_grid(row["puzzle"])
    return {"prompt": sudoku_prompt(puzzle), "puzzle": puzzle, "solution": sudoku_grid(row["solution"])}


@dataclass(frozen=True)
class TaskSource:
    """Where a task's data comes from and how a row becomes an example.

    ``required_columns`` lists groups of alternatives: each group needs at least one of its
    columns (matched case-insensitively, renamed to the lower-case name). ``retyped_columns``
    are the source columns that ``to_example`` rewrites with a new type (e.g. Sudoku grids read
    from a CSV as integers become strings); see :func:`examples_from_rows`.
    ``hub_row_filter`` applies to the default hub dataset only, never to a local file.
    """

    hub_id: str | None
    hub_config: str | None
    required_columns: tuple[tuple[str, ...], ...]
    to_example: Callable[[dict[str, Any]], dict[str, Any]]
    retyped_columns: tuple[str, ...] = ()
    hub_row_filter: Callable[[dict[str, Any]], bool] | None = None
    hub_single_split: str | None = None  # the hub dataset's only split: train/test are carved from it


HELD_OUT_FRACTION = 0.1


TASK_SOURCES: dict[str, TaskSource] = {
    "gsm8k": TaskSource("openai/gsm8k", "main", (("question",), ("answer",)), gsm8k_example),
    "math500": TaskSource("HuggingFaceH4/MATH-500", None, (("problem",), ("answer", "solution")), math500_example,
                          hub_single_split="test"),
    "countdown": TaskSource(
        "Jiayi-Pan/Countdown-Tasks-3to4", None, (("nums",), ("target",)), countdown_example, ("nums", "target"),
        # d1 trains and evaluates on the three-number subset.
        hub_row_filter=lambda row: len(row["nums"]) == 3, hub_single_split="train",
    ),
    "sudoku": TaskSource(None, None, (("puzzle",), ("solution",)), sudoku_example, ("puzzle", "solution")),
}

LOCAL_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def load_local_dataset(path: Path, split: str) -> datasets.Dataset:
    """Load a local file (json, jsonl, parquet or csv; the file is the split whatever ``split``
    says) or a directory laid out as a dataset repository (``split`` selects the split)."""
    if path.is_dir():
        return datasets.load_dataset(str(path), split=split)
    if not path.is_file():
        raise FileNotFoundError(f"dataset path {path} does not exist")
    builder = LOCAL_FILE_BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise ValueError(f"cannot read {path}: use one of {sorted(LOCAL_FILE_BUILDERS)} or a directory")
    return datasets.load_dataset(builder, data_files=str(path), split="train")


def with_required_columns(dataset: datasets.Dataset, task: str, source: TaskSource) -> datasets.Dataset:
    """Rename case variants of the required columns (``Puzzle`` -> ``puzzle``) and raise a
    ValueError naming the expected columns when a required group has none present."""
    by_lower_name = {name.lower(): name for name in dataset.column_names}
    renames = {}
    for group in source.required_columns:
        for column in group:
            original = by_lower_name.get(column)
            if original is not None and original != column and column not in dataset.column_names:
                renames[original] = column
    dataset = dataset.rename_columns(renames) if renames else dataset
    missing = [group for group in source.required_columns if not any(c in dataset.column_names for c in group)]
    if missing:
        expected = ", ".join(" or ".join(group) for group in source.required_columns)
        raise ValueError(
            f"the {task} data lacks column(s) {[' or '.join(group) for group in missing]}; "
            f"expected columns: {expected}; found: {dataset.column_names}"
        )
    return dataset


def examples_from_rows(dataset: datasets.Dataset, source: TaskSource) -> datasets.Dataset:
    """Map every row through ``source.to_example``, keeping the other columns. The retyped
    columns are moved aside under a temporary name first, because ``datasets`` would otherwise
    cast the new values back to the old column type (and lose a Sudoku grid's leading zeros)."""
    moved = {column: f"__source_{column}" for column in source.retyped_columns if column in dataset.column_names}
    dataset = dataset.rename_columns(moved) if moved else dataset

    def to_example(row: dict[str, Any]) -> dict[str, Any]:
        return source.to_example({**row, **{column: row[temporary] for column, temporary in moved.items()}})

    return dataset.map(to_example, remove_columns=list(moved.values()))


def subsample(dataset: datasets.Dataset, size: int | None, seed: int) -> datasets.Dataset:
    """Return ``size`` rows drawn at random (seeded) from ``dataset``, or all rows in their
    order when ``size`` is None; asks for more rows than exist get all rows and a warning."""
    if size is None:
        return dataset
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    if size > len(dataset):
        logger.warning("asked for %d examples but the dataset has %d; using all of them", size, len(dataset))
        size = len(dataset)
    return dataset.shuffle(seed=seed).select(range(size))


def load_task_dataset(
    task: str,
    split: str = "train",
    path: str | Path | None = None,
    size: int | None = None,
    seed: int = 0,
) -> datasets.Dataset:
    """Load a task's split with a chat ``prompt`` column and the task's reward columns.

    ``path`` replaces the default hub dataset with a local file or directory of the same
    format (required for sudoku). ``size`` keeps a seeded random subset. For ``digits`` the
    data is generated: ``size`` defaults to 10000 (train) / 500 (test) and the train and test
    splits come from different seeds derived from ``seed``.
    """
    if task == "digits":
        if path is not None:
            raise ValueError("the digits task is generated and reads no files; leave path unset")
        split_seed = digits_split_seed(seed, split)
        return make_digits_dataset(DIGITS_DEFAULT_SIZES[split] if size is None else size, split_seed)
    source = TASK_SOURCES.get(task)
    if source is None:
        raise ValueError(f"unknown task {task!r}; available tasks: {TASKS}")
    if path is not None:
        dataset = load_local_dataset(Path(path), split)
    elif source.hub_id is None:
        expected = ", ".join(" or ".join(group) for group in source.required_columns)
        raise ValueError(f"the {task} task has no default dataset; pass path= a local file with columns {expected}")
    else:
        dataset = datasets.load_dataset(source.hub_id, source.hub_config, split=source.hub_single_split or split)
        if source.hub_row_filter is not None:
            dataset = dataset.filter(source.hub_row_filter)
        if source.hub_single_split is not None:
            # A fixed seed (not the run's) keeps the held-out slice the same, and disjoint, across runs.
            parts = dataset.train_test_split(test_size=HELD_OUT_FRACTION, seed=0)
            dataset = parts["train" if split == "train" else "test"]
    dataset = with_required_columns(dataset, task, source)
    return examples_from_rows(subsample(dataset, size, seed), source)


def apply_chat_template(tokenizer: Any, messages: Messages) -> str:
    """Render ``messages`` with the tokenizer's own chat template, ending with the assistant
    generation prompt, as text (not token ids)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} has no chat template; use an instruct/chat tokenizer "
            "or set tokenizer.chat_template"
        )
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def prompt_texts(tokenizer: Any, prompts: list) -> list[str]:
    """The text each prompt is encoded from: chat-message prompts through the chat template, strings as they are."""
    return [apply_chat_template(tokenizer, p) if isinstance(p, list) else p for p in prompts]


def prompt_token_counts(tokenizer: Any, prompts: list) -> list[int]:
    """The number of tokens of each prompt as `tokenize_prompts` encodes it."""
    return [len(ids) for ids in tokenizer(prompt_texts(tokenizer, prompts), add_special_tokens=False)["input_ids"]]


def tokenize_prompts(tokenizer: Any, prompts: list, max_prompt_length: int | None = None,
                     device: Any = "cpu") -> tuple[Any, Any]:
    """Chat-template (chat-message prompts) and left-pad a batch of prompts -> (input_ids, attention_mask).

    A prompt longer than `max_prompt_length` is an error, never silently cut. The tokenizer must pad on the left.
    """
    encoded = tokenizer(prompt_texts(tokenizer, prompts), return_tensors="pt", padding=True, add_special_tokens=False)
    if max_prompt_length is not None and encoded.input_ids.shape[1] > max_prompt_length:
        raise ValueError(f"A prompt has {encoded.input_ids.shape[1]} tokens > max_prompt_length={max_prompt_length}; "
                         "raise max_prompt_length or filter long prompts from the dataset.")
    return encoded.input_ids.to(device), encoded.attention_mask.to(device)
