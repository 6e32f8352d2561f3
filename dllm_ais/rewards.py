"""Task reward functions and the code that combines them into one reward per completion.

Every reward function has TRL's signature::

    fn(prompts: list, completions: list, **kwargs) -> list[float | None]

``kwargs`` carries the dataset columns (lists aligned with ``completions``) and
``completion_ids``. ``prompts`` and ``completions`` are either plain strings or chat-message lists
(``[{"role": "assistant", "content": "..."}]``). ``None`` marks a sample for which a reward does
not apply; it is left out of that reward's sum and statistics.

Model output is untrusted: nothing here evaluates it as code. Countdown expressions go through
a small arithmetic interpreter over Python's ``ast`` that accepts numbers, ``+ - * /``,
parentheses and unary minus only.
"""
from __future__ import annotations

import ast
import importlib
import math
import numbers
import re
import threading
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any

import torch

RewardFunction = Callable[..., list]

# ---------------------------------------------------------------------------------------------
# Text helpers
# ---------------------------------------------------------------------------------------------


def message_text(item: Any) -> str:
    """Return the text of a prompt or completion given as a string, one chat message, or a
    list of chat messages (the contents joined in order)."""
    if isinstance(item, str):
        return item
    if isinstance(item, Mapping):
        content = item.get("content")
        if not isinstance(content, str):
            raise TypeError(f"chat message content must be a string, got {type(content).__name__}: {item!r}")
        return content
    if isinstance(item, Sequence):
        return "".join(message_text(message) for message in item)
    raise TypeError(
        f"expected a string or a list of chat messages ({{'role': ..., 'content': ...}}), got {type(item).__name__}"
    )


def extract_xml_answer(text: str) -> str | None:
    """Return the stripped text inside the last ``<answer>`` block (up to ``</answer>`` or the end
    of the text when the closing tag is missing), or None when there is no ``<answer>`` tag."""
    if "<answer>" not in text:
        return None
    return text.rsplit("<answer>", 1)[1].split("</answer>", 1)[0].strip()


def extract_last_boxed(text: str) -> str | None:
    """Return the content of the last ``\\boxed{...}`` in ``text`` (matching nested braces), or
    None when there is none or its braces never close."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    content_start = start + len("\\boxed{")
    depth = 1
    for position in range(content_start, len(text)):
        if text[position] == "{":
            depth += 1
        elif text[position] == "}":
            depth -= 1
            if depth == 0:
                return text[content_start:position]
    return None


def _column(kwargs: Mapping[str, Any], name: str, reward_name: str) -> list:
    """Return dataset column ``name`` from a reward function's kwargs, or raise a ValueError that
    says which column the reward needs and which ones it was given."""
    if name not in kwargs:
        available = sorted(key for key in kwargs if key != "completion_ids")
        raise ValueError(
            f"{reward_name} needs the dataset column '{name}' but got columns {available}; "
            f"load the data with dllm_ais.data.load_task_dataset or add a '{name}' column"
        )
    return kwargs[name]


# ---------------------------------------------------------------------------------------------
# GSM8K (d1's terms: tag counts, soft and strict layout, integer answer, exact answer)
# ---------------------------------------------------------------------------------------------

XML_TAGS = ("<reasoning>\n", "\n</reasoning>\n", "\n<answer>\n", "\n</answer>")
XML_TAG_REWARD = 0.125
TRAILING_CHARACTER_PENALTY = 0.001
FORMAT_REWARD = 0.5
CORRECT_ANSWER_REWARD = 2.0

SOFT_FORMAT_PATTERN = re.compile(r"\s*<reasoning>.*?</reasoning>\s*<answer>.*?</answer>", re.DOTALL)
STRICT_FORMAT_PATTERN = re.compile(r"<reasoning>\n.*?\n</reasoning>\n<answer>\n.*?\n</answer>\s*", re.DOTALL)


def xml_tag_score(text: str) -> float:
    """Score the reasoning/answer tags of one completion: 0.125 for each of the four tags that
    occurs exactly once, minus 0.001 per non-blank character after the last ``</answer>``."""
    score = sum(XML_TAG_REWARD for tag in XML_TAGS if text.count(tag) == 1)
    if "</answer>" in text:
        trailing_text = text.rsplit("</answer>", 1)[1].strip()
        score -= TRAILING_CHARACTER_PENALTY * len(trailing_text)
    return score


def xmlcount_reward(prompts: list, completions: list, **kwargs) -> list[float]:
    """Per completion, the tag-count score of :func:`xml_tag_score` (at most 0.5)."""
    return [xml_tag_score(message_text(completion)) for completion in completions]


def soft_format_reward(prompts: list, completions: list, **kwargs) -> list[float]:
    """0.5 per completion that starts with a ``<reasoning>...</reasoning>`` block followed by an
    ``<answer>...</answer>`` block (any whitespace between), else 0."""
    return [
        FORMAT_REWARD if SOFT_FORMAT_PATTERN.match(message_text(completion)) else 0.0
        for completion in completions
    ]


def strict_format_reward(prompts: list, completions: list, **kwargs) -> list[float]:
    """0.5 per completion that is exactly ``<reasoning>\\n...\\n</reasoning>\\n<answer>\\n...\\n</answer>``
    (trailing whitespace allowed), else 0."""
    return [
        FORMAT_REWARD if STRICT_FORMAT_PATTERN.fullmatch(message_text(completion)) else 0.0
        for completion in completions
    ]


def normalize_number_text(text: str) -> str:
    """Drop whitespace, thousands separators, a leading ``$`` and a trailing period from a
    numeric answer (``" $1,234. "`` becomes ``"1234"``)."""
    return re.sub(r"[\s,]", "", text).removeprefix("$").removesuffix(".")


def int_answer_reward(prompts: list, completions: list, **kwargs) -> list[float]:
    """0.5 per completion whose ``<answer>`` content is an integer (commas allowed), else 0."""
    rewards = []
    for completion in completions:
        answer = extract_xml_answer(message_text(completion))
        is_integer = answer is not None and re.fullmatch(r"-?\d+", normalize_number_text(answer)) is not None
        rewards.append(FORMAT_REWARD if is_integer else 0.0)
    return rewards


def gsm8k_final_answer(solution: str) -> str:
    """Return the final answer of a GSM8K solution: the text after the last ``####`` (the whole
    text when there is no ``####``), normalised with :func:`normalize_number_text`."""
    return normalize_number_text(str(solution).rsplit("####", 1)[-1])


def numeric_answers_match(predicted: str, reference: str) -> bool:
    """True when two normalised answers are equal as decimal numbers, or as strings when either
    is not a number."""
    try:
        return Decimal(predicted) == Decimal(reference)
    except InvalidOperation:
        return predicted == reference


def gsm8k_correctness_reward(prompts: list, completions: list, **kwargs) -> list[float]:
    """2.0 per completion whose ``<answer>`` content equals the final number of the ``answer``
    column (after ``####``; commas, whitespace, ``$`` ignored; ``18.0`` equals ``18``), else 0."""
    references = _column(kwargs, "answer", "gsm8k_correctness_reward")
    rewards = []
    for completion, reference in zip(completions, references, strict=True):
        answer = extract_xml_answer(message_text(completion))
        correct = answer is not None and numeric_answers_match(
            normalize_number_text(answer), gsm8k_final_answer(reference)
        )
        rewards.append(CORRECT_ANSWER_REWARD if correct else 0.0)
    return rewards


# ---------------------------------------------------------------------------------------------
# MATH
# ---------------------------------------------------------------------------------------------

MATH_VERIFY_TIMEOUT_SECONDS = 5


def math_answers_equivalent(predicted: str, reference: str) -> bool:
    """True when math_verify finds the two LaTeX answers equivalent. Never raises: parse errors,
    timeouts and any other failure count as "not equivalent". math_verify's timeout uses
    ``signal.alarm``, which works only in the main thread; elsewhere it runs without one."""
    from math_verify import parse, verify  # imported here: it pulls in sympy, which is slow to import

    timeout = MATH_VERIFY_TIMEOUT_SECONDS if threading.current_thread() is threading.main_thread() else None
    try:
        parsed_reference = parse(f"\\boxed{{{reference}}}", parsing_timeout=timeout)
        parsed_prediction = parse(f"\\boxed{{{predicted}}}", parsing_timeout=timeout)
        if not parsed_reference or not parsed_prediction:
            return False
        return bool(verify(parsed_reference, parsed_prediction, timeout_seconds=timeout))
    except Exception:  # noqa: BLE001 - any failure of the checker on untrusted text means "wrong"
        return False


def math_reference_answer(answer: Any, solution: Any) -> str | None:
    """Return the reference answer of a MATH example: the ``answer`` value when present, else the
    last ``\\boxed{}`` of the ``solution`` text (None when neither gives one)."""
    if answer is not None and str(answer).strip():
        return str(answer)
    return extract_last_boxed(str(solution)) if solution is not None else None


def math_correctness_reward(prompts: list, completions: list, **kwargs) -> list[float]:
    """2.0 per completion whose last ``\\boxed{...}`` is equivalent (math_verify) to the reference
    answer from the ``answer`` column, or the last ``\\boxed{}`` of the ``solution`` column, else 0."""
    if "answer" not in kwargs and "solution" not in kwargs:
        _column(kwargs, "answer", "math_correctness_reward (it reads 'answer', else 'solution')")
    answers = kwargs.get("answer") or [None] * len(completions)
    solutions = kwargs.get("solution") or [None] * len(completions)
    rewards = []
    for completion, answer, solution in zip(completions, answers, solutions, strict=True):
        predicted = extract_last_boxed(message_text(completion))
        reference = math_reference_answer(answer, solution)
        correct = predicted is not None and reference is not None and math_answers_equivalent(predicted, reference)
        rewards.append(CORRECT_ANSWER_REWARD if correct else 0.0)
    return rewards


def boxed_format_reward(prompts: list, completions: list, **kwargs) -> list[float]:
    """0.5 per completion that contains ``\\boxed{``, else 0."""
    return [FORMAT_REWARD if "\\boxed{" in message_text(completion) else 0.0 for completion in completions]


# ---------------------------------------------------------------------------------------------
# Countdown: safe arithmetic
# ---------------------------------------------------------------------------------------------

COUNTDOWN_CORRECT_REWARD = 1.0
COUNTDOWN_FORMAT_REWARD = 0.1
MAX_EXPRESSION_LENGTH = 256
ALLOWED_EXPRESSION_CHARACTERS = re.compile(r"[0-9+\-*/().\s]*")
BINARY_OPERATORS: dict[type, Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: lambda left, right: left + right,
    ast.Sub: lambda left, right: left - right,
    ast.Mult: lambda left, right: left * right,
    ast.Div: lambda left, right: left / right,
}


class UnsafeExpressionError(ValueError):
    """An expression uses something other than numbers, + - * /, parentheses and unary minus."""


def parse_arithmetic(expression: str) -> ast.expr:
    """Parse ``expression`` into an ast made only of number literals, ``+ - * /``, parentheses
    and unary minus; raise UnsafeExpressionError for anything else (names, calls, attributes,
    powers, strings, overly long input)."""
    if len(expression) > MAX_EXPRESSION_LENGTH:
        raise UnsafeExpressionError(f"expression longer than {MAX_EXPRESSION_LENGTH} characters")
    if not ALLOWED_EXPRESSION_CHARACTERS.fullmatch(expression):
        raise UnsafeExpressionError("expression contains characters other than digits, + - * / . ( ) and spaces")
    try:
        tree = ast.parse(" ".join(expression.split()), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as error:
        raise UnsafeExpressionError(f"not an arithmetic expression: {error}") from error
    for node in ast.walk(tree.body):
        allowed = (
            (isinstance(node, ast.BinOp) and type(node.op) in BINARY_OPERATORS)
            or (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub))
            or (isinstance(node, ast.Constant) and type(node.value) in (int, float))
            or isinstance(node, (ast.operator, ast.unaryop))
        )
        if not allowed:
            raise UnsafeExpressionError(f"disallowed syntax: {type(node).__name__}")
    return tree.body


def evaluate_arithmetic(node: ast.expr) -> Fraction:
    """Evaluate an ast accepted by :func:`parse_arithmetic` exactly, with fractions
    (raises ZeroDivisionError on division by zero)."""
    if isinstance(node, ast.Constant):
        return Fraction(str(node.value))
    if isinstance(node, ast.UnaryOp):
        return -evaluate_arithmetic(node.operand)
    return BINARY_OPERATORS[type(node.op)](evaluate_arithmetic(node.left), evaluate_arithmetic(node.right))


def expression_numbers(node: ast.expr) -> list[Fraction]:
    """Return the number literals of a parsed expression (signs not included)."""
    return [Fraction(str(child.value)) for child in ast.walk(node) if isinstance(child, ast.Constant)]


def parse_number_list(value: Any) -> list[Fraction]:
    """Return the numbers of a ``nums`` cell given as a list of numbers or as text like ``"[3, 7, 25]"``."""
    if isinstance(value, str):
        return [Fraction(number) for number in re.findall(r"-?\d+(?:\.\d+)?", value)]
    return [Fraction(str(number)) for number in value]


def countdown_score(text: str, numbers: Sequence[Fraction], target: Fraction) -> float:
    """Score one Countdown completion: 1.0 when its ``<answer>`` expression uses exactly
    ``numbers`` (as a multiset) and equals ``target``; 0.1 when the answer is a valid arithmetic
    expression that misses; 0 without an ``<answer>`` or when the answer is not arithmetic."""
    answer = extract_xml_answer(text)
    if answer is None:
        return 0.0
    try:
        tree = parse_arithmetic(answer)
    except UnsafeExpressionError:
        return 0.0
    if Counter(expression_numbers(tree)) != Counter(numbers):
        return COUNTDOWN_FORMAT_REWARD
    try:
        hits_target = evaluate_arithmetic(tree) == target
    except ZeroDivisionError:
        hits_target = False
    return COUNTDOWN_CORRECT_REWARD if hits_target else COUNTDOWN_FORMAT_REWARD


def countdown_reward(prompts: list, completions: list, **kwargs) -> list[float]:
    """Per completion, :func:`countdown_score` against the ``nums`` and ``target`` columns."""
    numbers_column = _column(kwargs, "nums", "countdown_reward")
    targets = _column(kwargs, "target", "countdown_reward")
    return [
        countdown_score(message_text(completion), parse_number_list(numbers), Fraction(str(target).strip()))
        for completion, numbers, target in zip(completions, numbers_column, targets, strict=True)
    ]


# ---------------------------------------------------------------------------------------------
# Sudoku 4x4
# ---------------------------------------------------------------------------------------------

SUDOKU_CELLS = 16


def sudoku_grid(value: Any) -> str:
    """Return a 4x4 Sudoku grid as a 16-digit string ('0' = empty); integers read from a CSV get
    their leading zeros back. Raises ValueError for anything that is not 16 digits."""
    grid = str(value).zfill(SUDOKU_CELLS) if isinstance(value, numbers.Integral) else str(value).strip()
    if not re.fullmatch(rf"\d{{{SUDOKU_CELLS}}}", grid):
        raise ValueError(f"a 4x4 Sudoku grid must be {SUDOKU_CELLS} digits ('0' = empty), got {value!r}")
    return grid


def sudoku_score(text: str, puzzle: str, solution: str) -> float:
    """Fraction of the puzzle's empty cells (all cells if it has none) that the completion fills
    correctly, reading the first 16 digits of its ``<answer>`` block (of the whole text when it
    has none); cells it leaves out count as wrong."""
    answer = extract_xml_answer(text)
    filled = re.findall(r"\d", text if answer is None else answer)[:SUDOKU_CELLS]
    graded_cells = [cell for cell in range(SUDOKU_CELLS) if puzzle[cell] == "0"] or list(range(SUDOKU_CELLS))
    correct = sum(1 for cell in graded_cells if cell < len(filled) and filled[cell] == solution[cell])
    return correct / len(graded_cells)


def sudoku_reward(prompts: list, completions: list, **kwargs) -> list[float]:
    """Per completion, :func:`sudoku_score` against the ``puzzle`` and ``solution`` columns."""
    puzzles = _column(kwargs, "puzzle", "sudoku_reward")
    solutions = _column(kwargs, "solution", "sudoku_reward")
    return [
        sudoku_score(message_text(completion), sudoku_grid(puzzle), sudoku_grid(solution))
        for completion, puzzle, solution in zip(completions, puzzles, solutions, strict=True)
    ]


# ---------------------------------------------------------------------------------------------
# Embedded "digits" task
# ---------------------------------------------------------------------------------------------


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
    targets = _column(kwargs, "answer", "digits_reward")
    return [
        digits_score(message_text(completion), str(target))
        for completion, target in zip(completions, targets, strict=True)
    ]


# ---------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------

REWARD_FUNCTIONS: dict[str, RewardFunction] = {
    fn.__name__: fn
    for fn in (
        xmlcount_reward,
        soft_format_reward,
        strict_format_reward,
        int_answer_reward,
        gsm8k_correctness_reward,
        math_correctness_reward,
        boxed_format_reward,
        countdown_reward,
        sudoku_reward,
        digits_reward,
    )
}

TASK_REWARDS: dict[str, list[RewardFunction]] = {
    "gsm8k": [xmlcount_reward, soft_format_reward, strict_format_reward, int_answer_reward, gsm8k_correctness_reward],
    "math500": [math_correctness_reward, boxed_format_reward],
    "countdown": [countdown_reward],
    "sudoku": [sudoku_reward],
    "digits": [digits_reward],
}


def import_reward_function(reference: str) -> RewardFunction:
    """Import ``"package.module:function"`` and return the function; ValueError if it is missing
    or not callable."""
    module_name, _, attribute = reference.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"cannot import reward function '{reference}': {error}") from error
    if not callable(function):
        raise ValueError(f"'{reference}' is not callable")
    return function


def resolve_reward_functions(
    names_or_callables: str | RewardFunction | Sequence[str | RewardFunction],
) -> list[RewardFunction]:
    """Turn reward specs into functions. Each spec is a callable (kept), a registered name (see
    REWARD_FUNCTIONS), a task name (expands to its TASK_REWARDS list) or ``"module.path:function"``.
    Unknown names raise ValueError listing what is available."""
    single_spec = isinstance(names_or_callables, str) or callable(names_or_callables)
    specs = [names_or_callables] if single_spec else names_or_callables
    functions: list[RewardFunction] = []
    for spec in specs:
        if callable(spec):
            functions.append(spec)
        elif isinstance(spec, str) and ":" in spec:
            functions.append(import_reward_function(spec))
        elif spec in REWARD_FUNCTIONS:
            functions.append(REWARD_FUNCTIONS[spec])
        elif spec in TASK_REWARDS:
            functions.extend(TASK_REWARDS[spec])
        else:
            raise ValueError(
                f"unknown reward function {spec!r}; available: {sorted(REWARD_FUNCTIONS)}, "
                f"task presets: {sorted(TASK_REWARDS)}, or 'package.module:function'"
            )
    return functions


# ---------------------------------------------------------------------------------------------
# Combining rewards
# ---------------------------------------------------------------------------------------------


class RewardFunctionError(RuntimeError):
    """A reward function raised or returned something unusable."""


class NonFiniteRewardError(RewardFunctionError):
    """A reward function returned NaN or inf: the trainer skips that generation batch (the weights stay untouched)."""


def reward_function_names(reward_funcs: Sequence[RewardFunction]) -> list[str]:
    """Return a metric name per reward function (its ``__name__``; a ``functools.partial`` gives
    its wrapped function's name), with ``_2``, ``_3``, ... appended to repeated names."""
    names = []
    for function in reward_funcs:
        target = getattr(function, "func", function)
        names.append(getattr(target, "__name__", type(target).__name__))
    totals = Counter(names)
    seen: Counter = Counter()
    unique_names = []
    for name in names:
        seen[name] += 1
        unique_names.append(f"{name}_{seen[name]}" if totals[name] > 1 and seen[name] > 1 else name)
    return unique_names


def validated_rewards(values: Any, name: str, expected_length: int) -> list[float]:
    """Check one reward function's output and return it as floats with NaN for None; raise
    RewardFunctionError naming ``name`` and the fix for a wrong length, a non-number, NaN or inf."""
    if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):  # torch tensor, numpy array
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise RewardFunctionError(
            f"reward function '{name}' returned {type(values).__name__}; "
            "return a list with one float (or None) per completion"
        )
    if len(values) != expected_length:
        raise RewardFunctionError(
            f"reward function '{name}' returned {len(values)} values for {expected_length} completions; "
            "return one float (or None for 'not applicable') per completion"
        )
    floats = []
    for index, value in enumerate(values):
        if value is None:
            floats.append(math.nan)
            continue
        if not isinstance(value, numbers.Real):
            raise RewardFunctionError(
                f"reward function '{name}' returned {value!r} ({type(value).__name__}) at index {index}; "
                "return a float, or None for 'not applicable'"
            )
        if not math.isfinite(value):
            raise NonFiniteRewardError(
                f"reward function '{name}' returned {value} at index {index}; return a finite float, "
                "or None to exclude the sample"
            )
        floats.append(float(value))
    return floats


def compute_rewards(
    reward_funcs: Sequence[RewardFunction],
    prompts: list,
    completions: list,
    columns: Mapping[str, list],
    reward_weights: Sequence[float] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Call every reward function and combine them.

    Returns ``(rewards, metrics)``: ``rewards`` is a float32 tensor [N] with, per completion, the
    weighted sum of the rewards that apply to it (None entries are skipped; a completion to which
    no reward applies gets 0 and a warning). ``metrics`` has ``rewards/<name>/mean`` and
    ``rewards/<name>/std`` (population std) of each function's unweighted values over the
    completions it applies to (NaN when it applies to none). ``columns`` are passed as keyword
    arguments (dataset columns and ``completion_ids``), each a list aligned with ``completions``.
    """
    count = len(completions)
    if not reward_funcs:
        raise ValueError("no reward functions given; pass at least one (see dllm_ais.rewards.TASK_REWARDS)")
    if len(prompts) != count:
        raise ValueError(f"got {len(prompts)} prompts for {count} completions; pass one prompt per completion")
    misaligned = {name: len(values) for name, values in columns.items() if len(values) != count}
    if misaligned:
        raise ValueError(f"columns {misaligned} do not have one entry per completion ({count})")
    weights = [1.0] * len(reward_funcs) if reward_weights is None else [float(weight) for weight in reward_weights]
    if len(weights) != len(reward_funcs):
        raise ValueError(f"got {len(weights)} reward weights for {len(reward_funcs)} reward functions")

    names = reward_function_names(reward_funcs)
    per_function = torch.full((count, len(reward_funcs)), math.nan, dtype=torch.float32)
    for index, (function, name) in enumerate(zip(reward_funcs, names, strict=True)):
        try:
            values = function(prompts, completions, **columns)
        except Exception as error:
            raise RewardFunctionError(f"reward function '{name}' raised {type(error).__name__}: {error}") from error
        per_function[:, index] = torch.tensor(validated_rewards(values, name, count), dtype=torch.float32)

    not_applicable = per_function.isnan()
    if count and not_applicable.all(dim=1).any():
        samples = not_applicable.all(dim=1).nonzero().flatten().tolist()
        warnings.warn(
            f"all reward functions returned None for completions {samples}; their reward is 0",
            stacklevel=2,
        )
    rewards = (per_function * torch.tensor(weights, dtype=torch.float32)).nansum(dim=1)

    metrics: dict[str, float] = {}
    for index, name in enumerate(names):
        applicable = per_function[:, index][~not_applicable[:, index]]
        metrics[f"rewards/{name}/mean"] = applicable.mean().item() if applicable.numel() else math.nan
        metrics[f"rewards/{name}/std"] = applicable.std(correction=0).item() if applicable.numel() else math.nan
    return rewards, metrics
