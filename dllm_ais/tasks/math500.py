"""MATH: competition problems with LaTeX answers checked for equivalence by math-verify.

As in d1: training rows from ``ankner/math-500`` (the MATH train split), test rows from
``HuggingFaceH4/MATH-500`` (all 500 problems). Columns: ``problem``; ``answer`` and/or ``solution``
(the reference is ``answer``, else the last ``\\boxed{}`` of ``solution``). Rewards: 2.0 for an
equivalent last ``\\boxed{}``, 0.5 for using ``\\boxed{`` at all; accuracy is the equivalence alone.
Every comparison runs under a hard deadline (:mod:`dllm_ais.tasks.math_verifier`).
"""

from __future__ import annotations

from typing import Any

from dllm_ais.tasks import REASONING_FORMAT, HubSplit, Messages, Task, accuracy_of, user_prompt
from dllm_ais.tasks.math_verifier import DEFAULT_DEADLINE_SECONDS, MathVerifier
from dllm_ais.tasks.parsing import (
    MAX_ANSWER_CHARS,
    completion_texts,
    dataset_column,
    extract_last_boxed,
    record_timeout,
)

INSTRUCTIONS = (REASONING_FORMAT + "\nYou are an expert mathematician. Write the final answer inside \\boxed{} "
                "in the answer block.")
CORRECT_ANSWER_REWARD = 2.0
FORMAT_REWARD = 0.5

VERIFIER = MathVerifier(deadline_seconds=DEFAULT_DEADLINE_SECONDS)


def prompt(problem: str) -> Messages:
    """Chat prompt for a MATH problem."""
    return user_prompt(INSTRUCTIONS, problem)


def to_example(row: dict[str, Any]) -> dict[str, Any]:
    """Prompt for a MATH row; ``answer``/``solution`` stay as they are."""
    return {"prompt": prompt(row["problem"])}


def math_answers_equivalent(predicted: str, reference: str) -> bool:
    """True when math-verify finds the two LaTeX answers equivalent within the verifier's deadline.
    Never raises on the answers: parse errors and answers over ``MAX_ANSWER_CHARS`` are "not
    equivalent"; a comparison that runs out of time is too, and counts one timeout."""
    if len(predicted) > MAX_ANSWER_CHARS or len(reference) > MAX_ANSWER_CHARS:
        return False
    result = VERIFIER.equivalent(predicted, reference)
    if result is None:
        record_timeout()
    return bool(result)


def reference_answer(answer: Any, solution: Any) -> str | None:
    """Return the reference answer of a MATH example: the ``answer`` value when present, else the
    last ``\\boxed{}`` of the ``solution`` text (None when neither gives one)."""
    if answer is not None and str(answer).strip():
        return str(answer)
    return extract_last_boxed(str(solution)) if solution is not None else None


def math_correctness_reward(prompts: list, completions: list, **kwargs) -> list[float]:
    """2.0 per completion whose last ``\\boxed{...}`` is equivalent (math-verify) to the reference
    answer from the ``answer`` column, or the last ``\\boxed{}`` of the ``solution`` column, else 0."""
    if "answer" not in kwargs and "solution" not in kwargs:
        dataset_column(kwargs, "answer", "math_correctness_reward (it reads 'answer', else 'solution')")
    texts = completion_texts(completions, "math_correctness_reward")
    answers = kwargs.get("answer") or [None] * len(texts)
    solutions = kwargs.get("solution") or [None] * len(texts)
    rewards = []
    for text, answer, solution in zip(texts, answers, solutions, strict=True):
        predicted = extract_last_boxed(text)
        reference = reference_answer(answer, solution)
        correct = predicted is not None and reference is not None and math_answers_equivalent(predicted, reference)
        rewards.append(CORRECT_ANSWER_REWARD if correct else 0.0)
    return rewards


def boxed_format_reward(prompts: list, completions: list, **kwargs) -> list[float]:
    """0.5 per completion that contains ``\\boxed{``, else 0."""
    return [FORMAT_REWARD if "\\boxed{" in text else 0.0 for text in completion_texts(completions, "boxed_format_reward")]


TASK = Task(
    name="math500",
    reward_funcs=(math_correctness_reward, boxed_format_reward),
    accuracy=accuracy_of(math_correctness_reward, CORRECT_ANSWER_REWARD, "math500_accuracy"),
    to_example=to_example,
    required_columns=(("problem",), ("answer", "solution")),
    hub_train=HubSplit("ankner/math-500", "train"),
    hub_test=HubSplit("HuggingFaceH4/MATH-500", "test"),
    sample_rows=({"problem": "What is $2 + 3$?", "answer": "5", "solution": "$2 + 3 = \\boxed{5}$"},),
)
