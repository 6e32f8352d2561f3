"""Generic task data: rows from the hub or local files, deterministic splits, chat templating.

What is task-specific (sources, columns, prompts) lives in the task's module (:mod:`dllm_ais.tasks`).
Every dataset returned by :func:`load_task_dataset` has a ``prompt`` column (chat messages) and
the columns the task's reward functions read; the source's other columns are kept.

Splits: ``train``, ``validation`` (scored by the trainer) and ``test`` (touched only by
``dllm-ais eval``). A split the source lacks is carved from its train rows with a fixed seed that
does not depend on the run, so the carved rows never appear in the training split of any run.
"""
from __future__ import annotations

import functools
import json
import logging
import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import datasets

from dllm_ais.config import ConfigError
from dllm_ais.sampling.rollout import PromptError
from dllm_ais.tasks import Task, get_task

logger = logging.getLogger(__name__)

Messages = list[dict[str, str]]
SPLITS = ("train", "validation", "test")
CARVE_SEED = 0
CARVE_FRACTION = 0.1
MAX_CARVED_ROWS = 500
LOCAL_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}

SplitLoaders = dict[str, Callable[[], datasets.Dataset]]


class DatasetFileError(ConfigError):
    """A dataset file that cannot be used as it is; the message names the file (and line or row) and the fix."""


def carve(dataset: datasets.Dataset) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Split ``dataset`` into (rest, carved): ceil(10%) of the rows, at most 500, none when it has fewer than two
    rows; chosen with ``CARVE_SEED``; both parts keep the original row order."""
    count = 0 if len(dataset) < 2 else min(MAX_CARVED_ROWS, math.ceil(CARVE_FRACTION * len(dataset)))
    carved = set(random.Random(CARVE_SEED).sample(range(len(dataset)), count))
    rest = [index for index in range(len(dataset)) if index not in carved]
    return dataset.select(rest), dataset.select(sorted(carved))


def resolve_split(split: str, loaders: SplitLoaders) -> datasets.Dataset:
    """The rows of ``split`` given the splits a source has (``loaders``). A missing test split is carved from
    train first, then a missing validation split from what remains; train is what is left."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {list(SPLITS)}")
    if split in ("test", "validation") and split in loaders:
        return loaders[split]()
    if "train" not in loaders:
        raise ValueError(f"the data has splits {sorted(loaders)}: no {split!r} split and no train split to carve it "
                         "from")
    pool = loaders["train"]()
    if "test" not in loaders:
        pool, test = carve(pool)
        if split == "test":
            return test
    if "validation" not in loaders:
        pool, validation = carve(pool)
        if split == "validation":
            return validation
    return pool


def local_split_loaders(path: Path) -> SplitLoaders:
    """Splits of a local source: a directory laid out as a dataset repository has its own splits (files named
    ``train.jsonl``, ``test.csv``, ...); a single file (json, jsonl, parquet or csv) is a source with only a train
    split, so validation and test are carved from it and none of its test rows is ever trained on. To evaluate on a
    whole file, put it in a directory as ``test.<ext>``."""
    if path.is_dir():
        try:
            dataset_dict = datasets.load_dataset(str(path))
        except Exception as error:
            files = sorted(f for f in path.iterdir() if f.suffix.lower() in LOCAL_FILE_BUILDERS)
            problems = [problem for file in files if (problem := file_problem(file)) is not None]
            raise DatasetFileError(problems[0] if problems else f"{path}: cannot read it as a dataset directory "
                                   f"({first_line(error)}); put train/validation/test files of one format in it") \
                from error
        return {name: (lambda name=name: dataset_dict[name]) for name in dataset_dict}
    if not path.is_file():
        raise FileNotFoundError(f"dataset path {path} does not exist")
    builder = LOCAL_FILE_BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise DatasetFileError(f"cannot read {path}: use one of {sorted(LOCAL_FILE_BUILDERS)} or a directory")

    def load() -> datasets.Dataset:
        if (problem := file_problem(path)) is not None:  # the library's errors name neither the file nor the line
            raise DatasetFileError(problem)
        try:
            return datasets.load_dataset(builder, data_files=str(path), split="train")
        except Exception as error:
            raise DatasetFileError(f"{path}: cannot read it as {builder} ({first_line(error)}); check that it is a "
                                   f"valid {path.suffix} file") from error

    return {"train": load}


def first_line(error: BaseException) -> str:
    """The first line of an exception's message (its type when it has none), at most 200 characters."""
    text = str(error).strip().splitlines()
    return (text[0] if text else type(error).__name__)[:200]


def file_problem(path: Path) -> str | None:
    """What makes a local dataset file unreadable, naming the file and line: empty, not UTF-8 (json, jsonl, csv),
    or a line that is not a JSON object (jsonl, and json files that are not one JSON document); None when none of
    these is found."""
    data = path.read_bytes()
    if not data.strip():
        return f"{path}: the file is empty; put the rows in it (one JSON object per line for .jsonl)"
    if path.suffix.lower() == ".parquet":
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[:error.start].count(b"\n") + 1
        return f"{path}:{line}: not UTF-8 text (byte {error.start}); save the file as UTF-8"
    if path.suffix.lower() == ".csv":
        return None
    if path.suffix.lower() == ".json":
        try:
            json.loads(text)
            return None
        except ValueError:
            pass  # not one document: JSON lines
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as error:
            return f"{path}:{number}: not valid JSON ({error}); fix or remove this line"
        if not isinstance(row, dict):
            return f"{path}:{number}: a {type(row).__name__}, not a JSON object of column: value; fix or remove it"
    return None


def hub_split_loaders(task: Task) -> SplitLoaders:
    """Splits of a task's hub dataset(s), with the task's row filter applied."""
    def loader(source) -> Callable[[], datasets.Dataset]:
        def load() -> datasets.Dataset:
            dataset = datasets.load_dataset(source.dataset, source.config, split=source.split)
            return dataset.filter(task.hub_row_filter) if task.hub_row_filter is not None else dataset
        return load

    sources = {"train": task.hub_train, "validation": task.hub_validation, "test": task.hub_test}
    return {split: loader(source) for split, source in sources.items() if source is not None}


def with_required_columns(dataset: datasets.Dataset, task: Task, source: str = "") -> datasets.Dataset:
    """Rename case variants of the required columns (``Puzzle`` -> ``puzzle``) and raise a
    DatasetFileError naming the `source` and the expected columns when a required group has none present, or
    when rows have no value (null or blank) in a required group: those are never trained on silently."""
    by_lower_name = {name.lower(): name for name in dataset.column_names}
    renames = {}
    for group in task.required_columns:
        for column in group:
            original = by_lower_name.get(column)
            if original is not None and original != column and column not in dataset.column_names:
                renames[original] = column
    dataset = dataset.rename_columns(renames) if renames else dataset
    missing = [group for group in task.required_columns if not any(c in dataset.column_names for c in group)]
    if missing:
        expected = ", ".join(" or ".join(group) for group in task.required_columns)
        raise DatasetFileError(
            f"{source or f'the {task.name} data'} lacks column(s) {[' or '.join(group) for group in missing]}; "
            f"expected columns: {expected}; found: {dataset.column_names}"
        )
    for group in task.required_columns:
        present = [column for column in group if column in dataset.column_names]
        empty = [index for index, values in enumerate(zip(*(dataset[column] for column in present)))
                 if all(value is None or (isinstance(value, str) and not value.strip()) for value in values)]
        if empty:
            raise DatasetFileError(
                f"{source or f'the {task.name} data'}: {len(empty)} row(s) have no {' or '.join(group)} (first: row "
                f"{empty[0] + 1}); fill the value in or remove those rows")
    return dataset


def check_examples(dataset: datasets.Dataset, task: Task, source: str) -> datasets.Dataset:
    """`dataset` when ``task.to_example`` takes every row; otherwise a DatasetFileError naming the `source`, the
    first row it rejects (a value of the wrong type, such as ``target: "six"``) and the problem, in one line."""
    for index, row in enumerate(dataset):
        try:
            task.to_example(dict(row))
        except Exception as error:  # noqa: BLE001 - any rejection of a file's row is reported with the row
            raise DatasetFileError(f"{source}: row {index + 1}: {first_line(error)}; fix the value or remove the "
                                   "row") from None
    return dataset


def examples_from_rows(dataset: datasets.Dataset, task: Task) -> datasets.Dataset:
    """Map every row through ``task.to_example``, keeping the other columns. The retyped
    columns are moved aside under a temporary name first, because ``datasets`` would otherwise
    cast the new values back to the old column type (and lose a Sudoku grid's leading zeros)."""
    moved = {column: f"__source_{column}" for column in task.retyped_columns if column in dataset.column_names}
    dataset = dataset.rename_columns(moved) if moved else dataset

    def to_example(row: dict[str, Any]) -> dict[str, Any]:
        return task.to_example({**row, **{column: row[temporary] for column, temporary in moved.items()}})

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
    task_args: dict[str, Any] | None = None,
) -> datasets.Dataset:
    """Load a task's split (``train``, ``validation`` or ``test``) with a chat ``prompt`` column and the task's
    reward columns.

    ``path`` replaces the task's hub dataset with a local file or directory of the same schema (required for
    sudoku); see :func:`local_split_loaders` for its splits. Hub datasets use their validation split when they
    have one, else one carved from train (:func:`resolve_split`). ``size`` keeps a random subset seeded by
    ``seed``. Generated tasks (digits, reasoning_gym) make each split from its own seed derived from ``seed``;
    ``task_args`` are the settings of a task that takes them (the config field of that name).
    """
    spec = get_task(task)
    problems = spec.task_args_problems(task_args or {})
    if problems:
        raise ConfigError("; ".join(problems))
    if spec.generate is not None:
        if path is not None:
            raise ValueError(f"the {task} task is generated and reads no files; leave path unset")
        return spec.generate(split, size, seed, **(task_args or {}))
    if path is not None:
        loaders, source = local_split_loaders(Path(path)), str(path)
    elif spec.hub_train is None and spec.hub_test is None:
        expected = ", ".join(" or ".join(group) for group in spec.required_columns)
        raise ValueError(f"the {task} task has no default dataset; pass path= a local file with columns {expected}")
    else:
        loaders, source = hub_split_loaders(spec), f"the {task} hub data"
    def checked_split(name: str, load: Callable[[], datasets.Dataset]) -> datasets.Dataset:
        where = f"{source} ({name} split)"
        dataset = with_required_columns(load(), spec, where)
        return dataset if path is None else check_examples(dataset, spec, where)  # a local file's values

    checked = {name: functools.partial(checked_split, name, load)
               for name, load in loaders.items()}  # checked whole, before carving: row numbers are the source's
    dataset = resolve_split(split, checked)
    return examples_from_rows(subsample(dataset, size, seed), spec)


def apply_chat_template(tokenizer: Any, messages: Messages, add_generation_prompt: bool = True) -> str:
    """Render ``messages`` with the tokenizer's own chat template, ending with the assistant
    generation prompt (unless not `add_generation_prompt`), as text (not token ids). A template that does not
    render (Jinja's sandbox refuses it, its syntax, a variable it lacks) is one ConfigError naming its file."""
    import jinja2

    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} has no chat template; use an instruct/chat tokenizer "
            "or set tokenizer.chat_template"
        )
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except jinja2.TemplateError as error:
        refused = "the sandbox refuses it" if isinstance(error, jinja2.exceptions.SecurityError) else "it fails"
        raise ConfigError(f"{chat_template_file(tokenizer)}: the chat template does not render, {refused} "
                          f"({type(error).__name__}: {str(error).splitlines()[0]:.120}); replace it with the base "
                          "model's template") from None


def chat_template_file(tokenizer: Any) -> str:
    """The file the chat template of `tokenizer` was read from: its directory's chat_template.jinja, else its
    tokenizer_config.json (a Hub id: the repository's)."""
    directory = Path(tokenizer.name_or_path)
    jinja = directory / "chat_template.jinja"
    return str(jinja if jinja.is_file() or not directory.is_dir() else directory / "tokenizer_config.json")


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
        raise PromptError(f"A prompt has {encoded.input_ids.shape[1]} tokens > max_prompt_length={max_prompt_length}; "
                         "raise max_prompt_length or filter long prompts from the dataset.")
    return encoded.input_ids.to(device), encoded.attention_mask.to(device)
