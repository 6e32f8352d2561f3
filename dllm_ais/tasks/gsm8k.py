"""GSM8K (``openai/gsm8k``, config ``main``): grade-school word problems with integer answers.

Columns: ``question``; ``answer`` (the full solution ending ``#### n``). Rewards are d1's five
terms (tag counts, soft and strict layout, integer answer, exact answer: at most 4.0); accuracy is
the exact answer alone. The layout checks scan the text once (no backtracking regex).
"""

from __future__ import annotations

from typing import Any

from dllm_ais.tasks import REASONING_FORMAT, HubSplit, Messages, Task, accuracy_of, user_prompt
from dllm_ais.tasks.parsing import (
    completion_texts,
    dataset_column,
    extract_xml_answer,
    normalize_number_text,
    numeric_answers_match,
)

INSTRUCTIONS = REASONING_FORMAT + "\nThe answer block holds only the final number."

XML_TAGS = ("<reasoning>\n", "\n</reasoning>\n", "\n<answer>\n", "\n</answer>")
XML_TAG_REWARD = 0.125
TRAILING_CHARACTER_PENALTY = 0.001
FORMAT_REWARD = 0.5
CORRECT_ANSWER_REWARD = 2.0


def prompt(question: str) -> Messages:
    """Chat prompt for a GSM8K word problem."""
    return user_prompt(INSTRUCTIONS, question)


def to_example(row: dict[str, Any]) -> dict[str, Any]:
    """Prompt for a GSM8K row; ``answer`` stays the full solution ending in ``#### n``."""
    return {"prompt": prompt(row["question"])}


# ------------------------------------------------------------------------------------------- layout


def xml_tag_score(text: str) -> float:
    """Score the reasoning/answer tags of one completion: 0.125 for each of the four tags that
    occurs exactly once, minus 0.001 per non-blank character after the last ``</answer>``."""
    score = sum(XML_TAG_REWARD for tag in XML_TAGS if text.count(tag) == 1)
    end = text.rfind("</answer>")
    if end >= 0:
        score -= TRAILING_CHARACTER_PENALTY * len(text[end + len("</answer>"):].strip())
    return score


def has_soft_layout(text: str) -> bool:
    """True when ``text`` starts (after whitespace) with ``<reasoning>``, and some later
    ``</reasoning>``, optional whitespace, ``<answer>`` is followed somewhere by ``</answer>``.

    Equals ``re.match(r"\\s*<reasoning>.*?</reasoning>\\s*<answer>.*?</answer>", text, re.DOTALL)``
    in one pass: the earliest ``</reasoning>\\s*<answer>`` leaves the most room for ``</answer>``.
    Whitespace runs after distinct ``</reasoning>`` tags are disjoint, so the scan is linear.
    """
    body = text.lstrip()
    if not body.startswith("<reasoning>"):
        return False
    position = body.find("</reasoning>", len("<reasoning>"))
    while position >= 0:
        after = position + len("</reasoning>")
        answer = after
        while answer < len(body) and body[answer].isspace():
            answer += 1
        if body.startswith("<answer>", answer):
            return body.find("</answer>", answer + len("<answer>")) >= 0
        position = body.find("</reasoning>", after)
    return False


def has_strict_layout(text: str) -> bool:
    """True when ``text`` is exactly ``<reasoning>\\n…\\n</reasoning>\\n<answer>\\n…\\n</answer>``
    followed only by whitespace (d1's strict pattern, checked in one pass)."""
    head, separator, tail = "<reasoning>\n", "\n</reasoning>\n<answer>\n", "\n</answer>"
    body = text.rstrip()
    if not (body.startswith(head) and body.endswith(tail) and len(body) >= len(head) + len(tail)):
        return False
    return separator in body[len(head):len(body) - len(tail)]


def xmlcount_reward(prompts: list, completions: list, **kwargs) -> list[float]:
    """Per completion, the tag-count score of :func:`xml_tag_score` (at most 0.5)."""
    return [xml_tag_score(text) for text in completion_texts(completions, "xmlcount_reward")]


def soft_format_reward(prompts: list, completions: list, **kwargs) -> list[float]:
    """0.5 per completion that starts with a ``<reasoning>...</reasoning>`` block followed by an
    ``<answer>...</answer>`` block (any whitespace between), else 0."""
    return [FORMAT_REWARD if has_soft_layout(text) else 0.0 for text in completion_texts(completions, "soft_format_reward")]


def strict_format_reward(prompts: list, completions: list, **kwargs) -> list[float]:
    """0.5 per completion that is exactly ``<reasoning>\\n...\\n</reasoning>\\n<answer>\\n...\\n</answer>``
    (trailing whitespace allowed), else 0."""
    return [FORMAT_REWARD if has_strict_layout(text) else 0.0
            for text in completion_texts(completions, "strict_format_reward")]


def is_integer_text(text: str) -> bool:
    r"""True for an optional minus sign followed by decimal digits only (``re.fullmatch(r"-?\d+", text)``)."""
    return text.removeprefix("-").isdecimal()


def int_answer_reward(prompts: list, completions: list, **kwargs) -> list[float]:
    """0.5 per completion whose ``<answer>`` content is an integer (commas allowed), else 0."""
    rewards = []
    for text in completion_texts(completions, "int_answer_reward"):
        answer = extract_xml_answer(text)
        rewards.append(FORMAT_REWARD if answer is not None and is_integer_text(normalize_number_text(answer)) else 0.0)
    return rewards


# ------------------------------------------------------------------------------------------- answer


def final_answer(solution: str) -> str:
    """Return the final answer of a GSM8K solution: the text after the last ``####`` (the whole
    text when there is no ``####``), normalised with :func:`normalize_number_text`."""
    return normalize_number_text(str(solution).rsplit("####", 1)[-1])


def gsm8k_correctness_reward(prompts: list, completions: list, **kwargs) -> list[float]:
    """2.0 per completion whose ``<answer>`` content equals the final number of the ``answer``
    column (after ``####``; commas, whitespace, ``$`` ignored; ``18.0`` equals ``18``), else 0."""
    references = dataset_column(kwargs, "answer", "gsm8k_correctness_reward")
    rewards = []
    for text, reference in zip(completion_texts(completions, "gsm8k_correctness_reward"), references, strict=True):
        answer = extract_xml_answer(text)
        correct = answer is not None and numeric_answers_match(normalize_number_text(answer), final_answer(reference))
        rewards.append(CORRECT_ANSWER_REWARD if correct else 0.0)
    return rewards


TASK = Task(
    name="gsm8k",
    reward_funcs=(xmlcount_reward, soft_format_reward, strict_format_reward, int_answer_reward,
                  gsm8k_correctness_reward),
    accuracy=accuracy_of(gsm8k_correctness_reward, CORRECT_ANSWER_REWARD, "gsm8k_accuracy"),
    to_example=to_example,
    required_columns=(("question",), ("answer",)),
    hub_train=HubSplit("openai/gsm8k", "train", "main"),
    hub_test=HubSplit("openai/gsm8k", "test", "main"),
    sample_rows=(
        {"question": "Tom has 3 apples and buys 4 more. How many apples does he have?",
         "answer": "He has 3 + 4 = 7 apples.\n#### 7"},
    ),
)
