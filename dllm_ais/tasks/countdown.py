"""Countdown (``Jiayi-Pan/Countdown-Tasks-3to4``, three-number rows as in d1): reach ``target`` with
``nums``, each used once, and ``+ - * /``.

Columns: ``nums`` (a list, or text like ``"[3, 7, 25]"``), ``target``. Reward: 1.0 for a correct
expression, 0.1 for a well-formed wrong one, 0 otherwise; accuracy: 1.0 for a correct expression.
The hub dataset has only a train split: test and validation rows are carved from it.

Model output is untrusted: expressions go through a small interpreter over Python's ``ast`` that
accepts numbers, ``+ - * /``, parentheses and unary minus only, and computes exactly with fractions.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

from dllm_ais.tasks import REASONING_FORMAT, HubSplit, Messages, Task, accuracy_of, user_prompt
from dllm_ais.tasks.parsing import completion_texts, dataset_column, extract_xml_answer

INSTRUCTIONS = (REASONING_FORMAT + "\nThe answer block holds only the arithmetic expression: no '=' sign and no "
                "target number. For example, with the numbers [2, 3, 4] and the target 5, a valid answer is\n"
                "<answer>\n2*4-3\n</answer>")
CORRECT_REWARD = 1.0
FORMAT_REWARD = 0.1
MAX_EXPRESSION_LENGTH = 256
ALLOWED_EXPRESSION_CHARACTERS = re.compile(r"[0-9+\-*/().\s]*")
BINARY_OPERATORS: dict[type, Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: lambda left, right: left + right,
    ast.Sub: lambda left, right: left - right,
    ast.Mult: lambda left, right: left * right,
    ast.Div: lambda left, right: left / right,
}


def prompt(numbers: list[int], target: int) -> Messages:
    """Chat prompt asking for an expression that uses each of ``numbers`` once and equals ``target``."""
    return user_prompt(
        INSTRUCTIONS,
        f"Using the numbers {numbers}, write an arithmetic expression that equals {target}. Use every number "
        "exactly once; you may use +, -, *, / and parentheses.",
    )


def parse_number_list(value: Any) -> list[Fraction]:
    """Return the numbers of a ``nums`` cell given as a list of numbers or as text like ``"[3, 7, 25]"``."""
    if isinstance(value, str):
        return [Fraction(number) for number in re.findall(r"-?\d+(?:\.\d+)?", value)]
    return [Fraction(str(number)) for number in value]


def to_example(row: dict[str, Any]) -> dict[str, Any]:
    """Prompt for a Countdown row, with ``nums`` as a list of ints and ``target`` as an int."""
    numbers = [int(number) for number in parse_number_list(row["nums"])]
    target = int(str(row["target"]).strip())
    return {"prompt": prompt(numbers, target), "nums": numbers, "target": target}


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
        return FORMAT_REWARD
    try:
        hits_target = evaluate_arithmetic(tree) == target
    except ZeroDivisionError:
        hits_target = False
    return CORRECT_REWARD if hits_target else FORMAT_REWARD


def countdown_reward(prompts: list, completions: list, **kwargs) -> list[float]:
    """Per completion, :func:`countdown_score` against the ``nums`` and ``target`` columns."""
    numbers_column = dataset_column(kwargs, "nums", "countdown_reward")
    targets = dataset_column(kwargs, "target", "countdown_reward")
    return [
        countdown_score(text, parse_number_list(numbers), Fraction(str(target).strip()))
        for text, numbers, target in zip(completion_texts(completions, "countdown_reward"), numbers_column, targets,
                                         strict=True)
    ]


TASK = Task(
    name="countdown",
    reward_funcs=(countdown_reward,),
    accuracy=accuracy_of(countdown_reward, CORRECT_REWARD, "countdown_accuracy"),
    to_example=to_example,
    required_columns=(("nums",), ("target",)),
    retyped_columns=("nums", "target"),
    hub_train=HubSplit("Jiayi-Pan/Countdown-Tasks-3to4", "train"),
    hub_row_filter=lambda row: len(row["nums"]) == 3,
    sample_rows=({"nums": [2, 3, 4], "target": 5},),
)
