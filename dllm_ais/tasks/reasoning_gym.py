"""reasoning-gym as a task source: any of its procedural datasets, scored by the dataset's own verifier behind guards.

`reasoning-gym <https://github.com/open-thought/reasoning-gym>`_ generates problems in code (Countdown, mini-Sudoku,
arithmetic, chain sums, GSM-symbolic, ~100 more) and checks answers with a verifier per dataset; nothing is
downloaded. Install it with ``pip install "dllm-ais[gym]"``. A recipe picks the dataset and its settings::

    task: reasoning_gym
    task_args: {dataset: countdown, min_numbers: 3, max_numbers: 3}

or on the command line ``--task=reasoning_gym --task_args.dataset=countdown --task_args.min_numbers=3``. Every key
of ``task_args`` but ``dataset`` is a field of that dataset's config class (``CountdownConfig`` ...); ``seed`` and
``size`` come from the run. The config is checked before anything loads: an unknown dataset gets a did-you-mean, an
unknown setting or a value the dataset rejects one line naming the key.

Rows: ``prompt`` is the answer-tag format (``REASONING_FORMAT``) followed by the entry's question; the columns
``question``, ``answer`` (the reference as text, empty for datasets whose entries carry none, which a note names),
``gym_answer`` and ``metadata`` (the reference and the metadata as JSON that keeps their Python types: tuples, sets,
non-string keys), ``gym_dataset`` and ``gym_settings`` (JSON) carry what the verifier needs: the entry it scores
against equals the original, so every dataset's own reference answers get full credit. Settings under which one
problem takes more than ``GENERATION_SECONDS`` to generate are refused when the config is checked. Rewards: :func:`gym_correctness_reward`, the dataset's ``score_answer`` on the ``<answer>`` text
(in [0, 1]), and gsm8k's ``soft_format_reward`` (0.5); accuracy: 1.0 where the verifier gives full credit.

Splits come from disjoint ranges of generator seeds (reasoning-gym seeds entry ``i`` with ``seed + i``): test rows
from seeds ``[0, SPLIT_STRIDE)``, validation rows from ``[SPLIT_STRIDE, 2 SPLIT_STRIDE)``, both the same for every
run, and training rows from a block of ``SPLIT_STRIDE`` seeds above those, chosen by the run's seed. Different seeds
may still draw the same problem, so validation rows leave out the questions of the first ``HELD_OUT_ROWS`` test rows,
and training rows those of the first ``HELD_OUT_ROWS`` validation and test rows. Sizes: ``dataset_size`` training
rows (default 10,000), ``eval_size`` validation rows, and ``dllm-ais eval --limit`` test rows (default 500).

Model output is untrusted, and some verifiers evaluate it: Countdown and Puzzle24 run sympy's ``parse_expr``, which
executes Python; spiral_matrix, binary_matrix, string_insertion and n_queens call ``eval`` on answers that miss the
exact form (found by reading reasoning-gym 0.1.19's source and confirmed by spying on ``eval``/``parse_expr`` with
every dataset's verifier). So:

- every verifier runs in a :class:`~dllm_ais.tasks.bounded_worker.BoundedWorker` (a worker process with a hard
  deadline and a memory cap): a hang or a huge computation scores 0 and counts one timeout;
- answers longer than ``MAX_GYM_ANSWER_CHARS`` score 0 unseen;
- for the datasets that evaluate answers, a whitelist parse runs first (``ANSWER_GUARDS``) and an answer it rejects
  scores 0 without reaching the verifier: Countdown and Puzzle24 take only numbers, ``+ - * /``, parentheses and
  unary minus (:func:`dllm_ais.tasks.countdown.parse_arithmetic`); the matrix datasets digits, whitespace, minus,
  commas and brackets; string_insertion letters; n_queens ``_``, ``Q`` and whitespace;
- not exposed (``UNEXPOSED_DATASETS``): the three sympy algebra datasets, whose verifiers ``parse_expr`` free-form
  symbolic answers (a whitelist would have to admit names and calls), and ``composite``, a mixture whose verifier
  dispatches to other datasets' (pick one dataset instead).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import re
import sys
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dllm_ais.safe_json import loads_bounded
from dllm_ais.tasks import REASONING_FORMAT, Messages, Task, accuracy_of, user_prompt
from dllm_ais.tasks.bounded_worker import BoundedWorker
from dllm_ais.tasks.countdown import UnsafeExpressionError, parse_arithmetic
from dllm_ais.tasks.gsm8k import soft_format_reward
from dllm_ais.tasks.parsing import completion_texts, dataset_column, extract_xml_answer, record_timeout

if TYPE_CHECKING:
    import datasets

INSTALL_HINT = 'pip install "dllm-ais[gym]"'
INSTRUCTIONS = REASONING_FORMAT + "\nThe answer block holds only the final answer, in the form the question asks for."
FULL_CREDIT = 1.0
DEADLINE_SECONDS = 5.0
MAX_GYM_ANSWER_CHARS = 16_384
SPLIT_STRIDE = 10_000_000  # seeds per split: room for the config's largest dataset_size
SEED_SPACE = 2**32  # numpy seeds (pool_matrix) must stay below it
HELD_OUT_ROWS = 500
DEFAULT_SIZES = {"train": 10_000, "validation": 500, "test": 500}
SPLIT_OFFSETS = {"test": 0, "validation": 1}
RUN_SETTINGS = ("seed", "size")

UNEXPOSED_DATASETS = {
    **dict.fromkeys(("polynomial_multiplication", "simple_integration", "intermediate_integration"),
                    "its verifier evaluates free-form symbolic answers as Python code (sympy's expression parser)"),
    "composite": "it mixes datasets under one verifier; choose one dataset",
}


def _is_arithmetic(answer: str) -> bool:
    try:
        parse_arithmetic(answer)
    except UnsafeExpressionError:
        return False
    return True


def _only(characters: str) -> Callable[[str], bool]:
    pattern = re.compile(f"[{characters}]*")
    return lambda answer: pattern.fullmatch(answer) is not None


MATRIX_CHARACTERS = r"0-9\s,\[\]\-"
ANSWER_GUARDS: dict[str, Callable[[str], bool]] = {
    "countdown": _is_arithmetic,
    "puzzle24": _is_arithmetic,
    "spiral_matrix": _only(MATRIX_CHARACTERS),
    "binary_matrix": _only(MATRIX_CHARACTERS),
    "string_insertion": _only("A-Za-z"),
    "n_queens": _only(r"_Q\s"),
}

SCORER = BoundedWorker(f"{__name__}:gym_score_handler", DEADLINE_SECONDS, install_hint=INSTALL_HINT)
GENERATION_SECONDS = 10.0  # the most one problem may take to generate: settings that take longer are refused
SAMPLER = BoundedWorker(f"{__name__}:gym_sample_handler", GENERATION_SECONDS, install_hint=INSTALL_HINT)


# ------------------------------------------------------------------------------------------------ settings


class GymMissingError(ImportError):
    """reasoning-gym is not installed."""


def import_reasoning_gym():
    """The ``reasoning_gym`` package; GymMissingError naming the install command when it is absent."""
    try:
        import reasoning_gym
    except ImportError:
        raise GymMissingError(f"task=reasoning_gym needs the reasoning-gym package: {INSTALL_HINT}") from None
    return reasoning_gym


def exposed_datasets() -> list[str]:
    """The reasoning-gym datasets this task offers: every registered one but ``UNEXPOSED_DATASETS``."""
    import_reasoning_gym()
    from reasoning_gym.factory import DATASETS

    return sorted(set(DATASETS) - set(UNEXPOSED_DATASETS))


def _setting_type_problem(name: str, key: str, value: Any, annotation: Any) -> str | None:
    expected = {int: (int,), float: (int, float), bool: (bool,), str: (str,)}.get(annotation)
    if expected is None or (isinstance(value, expected) and not (isinstance(value, bool) and annotation is not bool)):
        return None
    return f"task_args.{key}={value!r:.60}: {name} expects {annotation.__name__}"


def check_task_args(task_args: dict[str, Any]) -> list[str]:
    """The problems of ``task_args`` (one line each, naming the key): reasoning-gym missing, no or an unknown
    ``dataset`` (with a did-you-mean), an unknown setting, a value of the wrong type or one the dataset rejects."""
    try:
        import_reasoning_gym()
    except GymMissingError as error:
        return [str(error)]
    name = task_args.get("dataset")
    if not isinstance(name, str):
        return ["task_args.dataset: name the reasoning-gym dataset, e.g. task_args: {dataset: countdown}"]
    if name in UNEXPOSED_DATASETS:
        return [f"task_args.dataset={name!r:.60} is not offered: {UNEXPOSED_DATASETS[name]}"]
    available = exposed_datasets()
    if name not in available:
        close = difflib.get_close_matches(name, available, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"pick one of its {len(available)} datasets (countdown, ...)"
        return [f"task_args.dataset={name!r:.60}: no such reasoning-gym dataset; {hint}"]
    settings = {key: value for key, value in task_args.items() if key != "dataset"}
    from reasoning_gym.factory import DATASETS

    config_class = DATASETS[name][1]
    try:
        fields = typing.get_type_hints(config_class)
    except Exception:  # noqa: BLE001 - annotations that do not resolve: check names only
        fields = {field.name: None for field in dataclasses.fields(config_class)}
    problems = []
    for key, value in settings.items():
        if key in RUN_SETTINGS:
            problems.append(f"task_args.{key}: set by the run (seed, dataset_size, eval_size); remove it")
        elif key not in fields:
            close = difflib.get_close_matches(key, [f for f in fields if f not in RUN_SETTINGS], n=1)
            problems.append(f"task_args.{key}: {name} has no such setting"
                            + (f"; did you mean {close[0]!r}?" if close else f" (its settings: {', '.join(fields)})"))
        elif (problem := _setting_type_problem(name, key, value, fields[key])) is not None:
            problems.append(problem)
    if problems:
        return problems
    try:
        json.dumps(settings)
    except (TypeError, ValueError):
        return ["task_args: plain values only (numbers, strings, lists, mappings)"]
    rejected = SAMPLER.call(name, json.dumps(settings))
    if rejected is None:
        return [f"task_args: {name} takes more than {GENERATION_SECONDS:.0f} s (the limit) to generate one problem "
                "with these settings; choose smaller ones"]
    return [f"task_args: {name} rejects these settings: {rejected}"] if rejected else []


def gym_sample_handler() -> Callable[[str, str], str]:
    """The settings check's worker: ``sample(dataset, settings)`` builds the dataset with those settings and
    generates its first problem; it returns "" when that works, else the first line of the dataset's error."""
    import reasoning_gym

    def sample(name: str, settings: str) -> str:
        try:
            reasoning_gym.create_dataset(name, seed=0, size=1, **json.loads(settings))[0]
        except Exception as error:  # noqa: BLE001 - the dataset's own check, reported in one line
            return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        return ""

    return sample


def _split_settings(task_args: dict[str, Any]) -> tuple[str, str]:
    """(dataset name, its settings as canonical JSON) from ``task_args``."""
    problems = check_task_args(task_args)
    if problems:
        raise ValueError("; ".join(problems))
    settings = {key: value for key, value in task_args.items() if key != "dataset"}
    return task_args["dataset"], json.dumps(settings, sort_keys=True)


# ------------------------------------------------------------------------------------------------ data


def split_seed(split: str, seed: int) -> int:
    """The generator seed of row 0 of ``split``: test and validation have fixed blocks of ``SPLIT_STRIDE`` seeds
    (the same for every run), training the run's block above them (``seed`` picks it, modulo the seed space)."""
    if split in SPLIT_OFFSETS:
        return SPLIT_OFFSETS[split] * SPLIT_STRIDE
    if split != "train":
        raise ValueError(f"the reasoning_gym task has splits {sorted(DEFAULT_SIZES)}, got {split!r}")
    training_blocks = SEED_SPACE // SPLIT_STRIDE - len(SPLIT_OFFSETS)
    return (len(SPLIT_OFFSETS) + seed % training_blocks) * SPLIT_STRIDE


TYPE_TAG = "__dllm_ais_type__"  # marks a value JSON has no form for (a tuple, a set, a dict with other keys)
MAX_ENTRY_BYTES, MAX_ENTRY_DEPTH = 16 << 20, 64


def encode_value(value: Any) -> Any:
    """A JSON-ready form of an entry's answer or metadata that `decode_value` turns back into an equal value of the
    same types: tuples, sets and dicts whose keys are not all strings are tagged; numpy values become lists and
    numbers; anything else json cannot write, its text."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, list):
        return [encode_value(item) for item in value]
    if isinstance(value, tuple):
        return {TYPE_TAG: "tuple", "items": [encode_value(item) for item in value]}
    if isinstance(value, (set, frozenset)):
        return {TYPE_TAG: type(value).__name__, "items": [encode_value(item) for item in sorted(value, key=repr)]}
    if isinstance(value, dict):
        if all(isinstance(key, str) for key in value) and TYPE_TAG not in value:
            return {key: encode_value(item) for key, item in value.items()}
        return {TYPE_TAG: "dict", "items": [[encode_value(key), encode_value(item)] for key, item in value.items()]}
    if hasattr(value, "tolist"):
        return encode_value(value.tolist())
    return str(value)


def decode_value(value: Any) -> Any:
    """The value `encode_value` wrote (plain JSON decodes as itself); it only builds tuples, sets and dicts."""
    if isinstance(value, list):
        return [decode_value(item) for item in value]
    if not isinstance(value, dict):
        return value
    kind = value.get(TYPE_TAG)
    if kind is None:
        return {key: decode_value(item) for key, item in value.items()}
    items = [decode_value(item) for item in value["items"]]
    builders = {"tuple": tuple, "set": set, "frozenset": frozenset, "dict": lambda pairs: dict(map(tuple, pairs))}
    return builders[kind](items)


def dumps_entry_value(value: Any) -> str:
    """`value` (an entry's answer or metadata) as JSON text that keeps its types (`encode_value`)."""
    return json.dumps(encode_value(value))


def loads_entry_value(text: str) -> Any:
    """The value `dumps_entry_value` wrote, parsed within size and depth bounds (rows may come from a file)."""
    return decode_value(loads_bounded(text, MAX_ENTRY_BYTES, MAX_ENTRY_DEPTH))


@functools.lru_cache(maxsize=32)
def split_entries(name: str, settings: str, split: str, size: int, seed: int) -> tuple[dict[str, Any], ...]:
    """Up to ``size`` entries (question, answer, metadata as JSON) of ``split``, generated from its seed block in
    order, leaving out the questions held out from it (see the module docstring); fewer when ``2 size + 100`` draws
    beyond the held-out questions do not give ``size`` others (settings that allow few distinct problems)."""
    held_out: set[str] = set()
    for other in {"train": ("validation", "test"), "validation": ("test",), "test": ()}[split]:
        held_out.update(entry["question"] for entry in split_entries(name, settings, other, HELD_OUT_ROWS, seed))
    budget = 2 * size + len(held_out) + 100
    generator = import_reasoning_gym().create_dataset(name, seed=split_seed(split, seed), size=budget,
                                                      **json.loads(settings))
    entries: list[dict[str, Any]] = []
    for index in range(budget):
        if len(entries) == size:
            break
        entry = generator[index]
        if entry["question"] not in held_out:
            entries.append(entry_columns(entry))
    return tuple(entries)


def entry_columns(entry: dict[str, Any]) -> dict[str, str]:
    """A reasoning-gym entry as the row's text columns: ``question``; ``answer``, the reference as text (empty for
    an entry without one); ``gym_answer`` and ``metadata``, the reference and the metadata with their types
    (``dumps_entry_value``), from which the scorer rebuilds an entry equal to the original."""
    return {"question": entry["question"], "answer": "" if entry["answer"] is None else str(entry["answer"]),
            "gym_answer": dumps_entry_value(entry["answer"]), "metadata": dumps_entry_value(entry["metadata"])}


def prompt(question: str) -> Messages:
    """Chat prompt: the answer-tag format, then the reasoning-gym question."""
    return user_prompt(INSTRUCTIONS, question)


def generate(split: str, size: int | None, seed: int, **task_args: Any) -> "datasets.Dataset":
    """The ``split`` of the reasoning-gym dataset named by ``task_args`` for run seed ``seed`` (``size`` rows,
    default ``DEFAULT_SIZES``)."""
    import datasets

    name, settings = _split_settings(task_args)
    if split not in DEFAULT_SIZES:
        raise ValueError(f"the reasoning_gym task has splits {sorted(DEFAULT_SIZES)}, got {split!r}")
    size = DEFAULT_SIZES[split] if size is None else size
    entries = split_entries(name, settings, split, size, seed)
    if any(entry["gym_answer"] == "null" for entry in entries):
        print(f"note: reasoning-gym's {name} entries carry no reference answer (the 'answer' column is empty): "
              "rewards and accuracy come from its verifier checking each answer, and there are no targets to "
              "fine-tune on.", file=sys.stderr)
    if len(entries) < size:
        raise ValueError(f"task_args {name} {settings}: only {len(entries)} of the {size} {split} rows asked for "
                         "differ from the held-out questions; these settings allow too few distinct problems (widen "
                         "them, or ask for fewer rows)")
    return datasets.Dataset.from_dict({
        "prompt": [prompt(entry["question"]) for entry in entries],
        "question": [entry["question"] for entry in entries],
        "answer": [entry["answer"] for entry in entries],
        "metadata": [entry["metadata"] for entry in entries],
        "gym_answer": [entry["gym_answer"] for entry in entries],
        "gym_dataset": [name] * len(entries),
        "gym_settings": [settings] * len(entries),
    })


# ------------------------------------------------------------------------------------------------ scoring


def gym_score_handler() -> Callable[[str, str, str | None, str, str, str, str | None], float]:
    """The worker's scorer: ``score(dataset, settings, answer, question, reference, metadata, typed_reference)`` is
    the dataset's ``score_answer`` (its instance built once per settings) on the entry rebuilt from the columns with
    its types (``loads_entry_value``; the reference from ``gym_answer`` when the row has it, else the ``answer``
    text); a verifier that raises, or returns anything but a number in [0, 1], scores 0."""
    import reasoning_gym

    @functools.lru_cache(maxsize=64)
    def verifier(name: str, settings: str):
        return reasoning_gym.create_dataset(name, **json.loads(settings))

    def score(name: str, settings: str, answer: str | None, question: str, reference: str, metadata: str,
              typed_reference: str | None) -> float:
        try:
            entry = {"question": question, "metadata": loads_entry_value(metadata),
                     "answer": reference if typed_reference is None else loads_entry_value(typed_reference)}
            value = float(verifier(name, settings).score_answer(answer, entry))
        except Exception:  # noqa: BLE001 - any failure of the verifier on untrusted text means "wrong"
            return 0.0
        return value if math.isfinite(value) and 0.0 <= value <= 1.0 else 0.0

    return score


def gym_score(answer: str | None, name: str, settings: str, question: str, reference: str, metadata: str,
              typed_reference: str | None = None) -> float:
    """The verifier's score of one extracted answer, behind the guards: 0 for no answer, one longer than
    ``MAX_GYM_ANSWER_CHARS`` or one the dataset's whitelist rejects; otherwise the bounded worker's score (0 and one
    timeout when it runs out of time)."""
    if name in UNEXPOSED_DATASETS:
        raise ValueError(f"gym_dataset={name!r}: not offered ({UNEXPOSED_DATASETS[name]})")
    if answer is None or len(answer) > MAX_GYM_ANSWER_CHARS:
        return 0.0
    guard = ANSWER_GUARDS.get(name)
    if guard is not None and not guard(answer):
        return 0.0
    result = SCORER.call(name, settings, answer, question, reference, metadata, typed_reference)
    if result is None:
        record_timeout()
        return 0.0
    return float(result)


def gym_correctness_reward(prompts: list, completions: list, **kwargs) -> list[float]:
    """Per completion, the reasoning-gym verifier's score (in [0, 1]) of its ``<answer>`` text (:func:`gym_score`),
    read against the ``gym_dataset``, ``gym_settings``, ``question``, ``answer`` and ``metadata`` columns (and
    ``gym_answer``, the typed reference, where the rows carry it)."""
    texts = completion_texts(completions, "gym_correctness_reward")
    columns = [dataset_column(kwargs, column, "gym_correctness_reward")
               for column in ("gym_dataset", "gym_settings", "question", "answer", "metadata")]
    typed = kwargs.get("gym_answer") or [None] * len(texts)
    return [gym_score(extract_xml_answer(text), *row) for text, *row in zip(texts, *columns, typed, strict=True)]


def _sample_row(name: str, settings: dict[str, Any], question: str, answer: str, metadata: dict[str, Any]) -> dict:
    return {"prompt": prompt(question), "question": question, "answer": answer, "metadata": json.dumps(metadata),
            "gym_dataset": name, "gym_settings": json.dumps(settings, sort_keys=True)}


TASK = Task(
    name="reasoning_gym",
    reward_funcs=(gym_correctness_reward, soft_format_reward),
    accuracy=accuracy_of(gym_correctness_reward, FULL_CREDIT, "gym_accuracy"),
    generate=generate,
    check_task_args=check_task_args,
    sample_rows=(
        _sample_row("countdown", {"max_numbers": 3, "min_numbers": 3},
                    "Using all the numbers 9, 81, 75, create an expression that equals 147.", "81 + 75 - 9",
                    {"numbers": [9, 81, 75], "target": 147, "expression": "81 + 75 - 9"}),
        _sample_row("basic_arithmetic", {}, "Calculate ( -9 / 9 ).", "-1", {"expression": "( -9 / 9 )"}),
        _sample_row("chain_sum", {}, "State the final answer to the following arithmetic problem: 5 - 9 =", "-4",
                    {"expression": "5 - 9"}),
        _sample_row("mini_sudoku", {}, "Solve this 4x4 Mini Sudoku puzzle:\n_ _ 1 _\n_ _ 4 2\n4 _ _ _\n_ 3 2 4",
                    "2 4 1 3\n3 1 4 2\n4 2 3 1\n1 3 2 4",
                    {"puzzle": [[0, 0, 1, 0], [0, 0, 4, 2], [4, 0, 0, 0], [0, 3, 2, 4]],
                     "solution": [[2, 4, 1, 3], [3, 1, 4, 2], [4, 2, 3, 1], [1, 3, 2, 4]]}),
        _sample_row("spiral_matrix", {}, "What is the list of elements in spiral order?\n8 9\n2 5", "8 9 5 2", {}),
    ),
)
