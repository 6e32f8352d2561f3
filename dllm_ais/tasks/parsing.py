"""Text helpers shared by every task's reward functions, written for untrusted model output.

Each helper runs in time linear in its input (no backtracking regular expressions over the whole
completion) and never evaluates the text. Completions reach a reward function as plain strings or
as chat-message lists (TRL's convention); :func:`completion_texts` turns them into strings once,
with one clear error for anything else.
"""

from __future__ import annotations

import re
import reprlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from decimal import Decimal, InvalidOperation
from typing import Any

MAX_ANSWER_CHARS = 1_000  # longer extracted answers are scored as wrong without being parsed


def message_text(item: Any) -> str:
    """Return the text of a prompt or completion given as a string, one chat message
    (``{"role": ..., "content": str}``) or a flat list of chat messages (contents joined in order).
    Raises TypeError for anything else (nested lists included: no recursion)."""
    if isinstance(item, str):
        return item
    if isinstance(item, Mapping):
        content = item.get("content")
        if not isinstance(content, str):
            raise TypeError(f"a chat message's content must be a string, got {type(content).__name__}")
        return content
    if isinstance(item, Sequence) and not isinstance(item, (bytes, bytearray)):
        for message in item:
            if not isinstance(message, Mapping):
                raise TypeError(f"a list of chat messages holds a {type(message).__name__}, not a message dict")
        return "".join(message_text(message) for message in item)
    raise TypeError(f"expected a string or a list of chat messages, got {type(item).__name__}")


def completion_texts(completions: Sequence[Any], reward_name: str) -> list[str]:
    """The text of each completion (see :func:`message_text`); a completion of any other type raises
    one TypeError naming ``reward_name``, the index and the type."""
    texts = []
    for index, completion in enumerate(completions):
        try:
            texts.append(message_text(completion))
        except TypeError as error:
            raise TypeError(
                f"{reward_name} scores text: completion {index} is {type(completion).__name__} "
                f"{reprlib.repr(completion)} ({error}); pass strings or chat-message lists "
                "[{'role': 'assistant', 'content': '...'}]"
            ) from None
    return texts


def dataset_column(kwargs: Mapping[str, Any], name: str, reward_name: str) -> list:
    """Return dataset column ``name`` from a reward function's kwargs, or raise a ValueError that
    says which column the reward needs and which ones it was given."""
    if name not in kwargs:
        available = sorted(key for key in kwargs if key != "completion_ids")
        raise ValueError(
            f"{reward_name} needs the dataset column '{name}' but got columns {available}; "
            f"load the data with dllm_ais.data.load_task_dataset or add a '{name}' column"
        )
    return kwargs[name]


def extract_xml_answer(text: str) -> str | None:
    """Return the stripped text inside the last ``<answer>`` block (up to ``</answer>`` or the end
    of the text when the closing tag is missing), or None when there is no ``<answer>`` tag."""
    start = text.rfind("<answer>")
    if start < 0:
        return None
    return text[start + len("<answer>"):].split("</answer>", 1)[0].strip()


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


def normalize_number_text(text: str) -> str:
    """Drop whitespace, thousands separators, a leading ``$`` and a trailing period from a
    numeric answer (``" $1,234. "`` becomes ``"1234"``)."""
    return re.sub(r"[\s,]", "", text).removeprefix("$").removesuffix(".")


def numeric_answers_match(predicted: str, reference: str) -> bool:
    """True when two normalised answers are equal as decimal numbers, or as strings when either
    is not a number; answers longer than ``MAX_ANSWER_CHARS`` never match."""
    if len(predicted) > MAX_ANSWER_CHARS or len(reference) > MAX_ANSWER_CHARS:
        return False
    try:
        return Decimal(predicted) == Decimal(reference)
    except InvalidOperation:
        return predicted == reference


# ---------------------------------------------------------------------------------------------
# Timeouts: a reward that gives up on a completion scores it 0 and says so here; the reward
# table reports the count as ``rewards/<fn>/timeouts``.
# ---------------------------------------------------------------------------------------------

_timeout_count: ContextVar[list[int] | None] = ContextVar("reward_timeouts", default=None)


def record_timeout() -> None:
    """Count one completion scored 0 because its check ran out of time (inside :func:`counting_timeouts`)."""
    counter = _timeout_count.get()
    if counter is not None:
        counter[0] += 1


@contextmanager
def counting_timeouts() -> Iterator[list[int]]:
    """Yield a one-element list holding the number of :func:`record_timeout` calls made inside the block."""
    counter = [0]
    token = _timeout_count.set(counter)
    try:
        yield counter
    finally:
        _timeout_count.reset(token)
