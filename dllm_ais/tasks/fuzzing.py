"""Adversarial completions for reward functions, and a harness that scores them one call at a time.

Model output is untrusted input: a reward must return a number for any text, in bounded time, and must never run
it. The families below are the ones that broke or stalled reward code before: nested ``\\frac``, exponent towers
(LaTeX and Python), 80 KB strings of repeated tags, unbalanced tags and braces, arbitrary unicode (lone surrogates
included), chat-message completions, well-formed answers, and code payloads (:func:`code_payloads`: Python that
creates a marker file if anything evaluates it — reasoning-gym's Countdown verifier would, through sympy).
``NON_STRING_COMPLETIONS`` are not text at all; a reward must reject them with one TypeError naming itself.

Used by the test suite: a few thousand inputs by default, twenty thousand in the slow tier.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dllm_ais.tasks import Task
from dllm_ais.tasks.parsing import counting_timeouts

TAGS = ("<reasoning>", "</reasoning>", "<answer>", "</answer>", "\\boxed{", "{", "}", "\n", " ")
EXPONENT_TOWERS = ("9^{9^{9}}", "10^{10^{10^{10}}}", "(10^{10})!", "9!!!!!", "2^{2^{2^{2^{2}}}}", "10^{100000}")
PYTHON_TOWERS = ("9**9**9**9", "2**2**2**2**2**2", "(9**9)**(9**9)", "10**10**10", "-(9**9**9)", "[0]*10**10",
                 "1" + "*9**9" * 50, "(" * 5_000 + "1" + ")" * 5_000, "[" * 100_000, "1+" * 40_000 + "1")
LONG_UNITS = ("</reasoning>\n", "<reasoning>", "<answer>", "</answer>", "\\boxed{", "{", "(", "9", "1,", "x" * 7,
              "\\frac{1}{", "<reasoning>\n</reasoning>\n<answer>\n")
NON_STRING_COMPLETIONS: tuple[Any, ...] = (
    None, 42, 3.5, b"<answer>1</answer>", object(), {"role": "assistant"}, {"role": "assistant", "content": 7},
    [[{"role": "assistant", "content": "x"}]], ["<answer>1</answer>"], [{"content": None}],
)


def code_payloads(marker: str) -> list[str]:
    """Python expressions that create the file ``marker`` when evaluated (``eval``, sympy's ``parse_expr``): calls
    through ``__import__``, ``eval``/``exec``, ``open``, lambdas, dunder walks to ``os`` and ``subprocess``, payloads
    hidden in arithmetic, lists and sympy names; each also inside ``<answer>`` tags and after a reasoning block."""
    touch = f"touch {marker}"
    expressions = [
        f"__import__('os').system('{touch}')",
        f'__import__("os").system("{touch}")',
        f"1+__import__('os').system('{touch}')*0",
        f"(lambda: __import__('os').system('{touch}'))()",
        f"(lambda f: f('{touch}'))(__import__('os').system)",
        f"eval(\"__import__('os').system('{touch}')\")",
        f"exec('import os; os.system(\"{touch}\")')",
        f"open('{marker}', 'w').close()",
        f"getattr(__builtins__, 'open')('{marker}', 'w')",
        f"[__import__('os').system('{touch}')]",
        f"[[__import__('os').system('{touch}')]]",
        f"Symbol('x').__class__.__init__.__globals__['__builtins__']['__import__']('os').system('{touch}')",
        f"().__class__.__base__.__subclasses__() and __import__('os').system('{touch}')",
        f"[c for c in ().__class__.__base__.__subclasses__() if c.__name__ == 'Popen'][0](['touch', '{marker}'])",
        f"__import__('subprocess').run(['touch', '{marker}'])",
        f"__import__('pathlib').Path('{marker}').touch()",
        f"eval(''.join(map(chr, {[ord(c) for c in f'open({marker!r}, chr(119))']})))",
    ]
    wrapped = [f"<answer>\n{expression}\n</answer>" for expression in expressions]
    reasoned = [f"<reasoning>\nsee\n</reasoning>\n<answer>{expression}</answer>" for expression in expressions]
    return expressions + wrapped + reasoned


def _nested(depth: int) -> list:
    nested: list = [{"role": "assistant", "content": "1"}]
    for _ in range(depth):
        nested = [nested]
    return nested


def non_string_completions() -> list[Any]:
    """Completions that are not text (numbers, bytes, malformed messages, a list nested 10,000 deep)."""
    return [*NON_STRING_COMPLETIONS, _nested(10_000)]


def _well_formed(rng: random.Random) -> str:
    answer = rng.choice([str(rng.randint(-10**6, 10**6)), f"{rng.randint(1, 99)}*{rng.randint(1, 9)}-{rng.randint(1, 9)}",
                         "".join(rng.choice("1234") for _ in range(16)), f"\\boxed{{\\frac{{{rng.randint(1, 9)}}}{{2}}}}"])
    return f"<reasoning>\n{rng.choice(['', 'think', 'a' * rng.randint(1, 200)])}\n</reasoning>\n<answer>\n{answer}\n</answer>"


def _tag_soup(rng: random.Random) -> str:
    return "".join(rng.choice(TAGS + tuple("0123456789+-*/()^\\")) for _ in range(rng.randint(0, 300)))


def _nested_fraction(rng: random.Random, max_depth: int) -> str:
    depth = rng.randint(1, max_depth)
    return "<answer>\\boxed{" + "\\frac{" * depth + "1}{2}" * depth + "}</answer>"


def _long(rng: random.Random, max_chars: int) -> str:
    unit = rng.choice(LONG_UNITS)
    return unit * max(1, rng.randint(max_chars // 2, max_chars) // len(unit))


def _unbalanced(rng: random.Random) -> str:
    pieces = ["<answer>", "</answer>", "<reasoning>", "</reasoning>", "\\boxed{", "{", "}", "\\frac{1}{", "(", ")"]
    return "".join(rng.choice(pieces) + str(rng.randint(0, 9)) for _ in range(rng.randint(1, 40)))


def _unicode(rng: random.Random) -> str:
    ranges = [(0x20, 0x7E), (0x300, 0x36F), (0x600, 0x6FF), (0x200B, 0x200F), (0xD800, 0xDFFF), (0x1F600, 0x1F64F),
              (0x660, 0x669), (0xFF10, 0xFF19), (0x0, 0x1F)]
    text = "".join(chr(rng.randint(*rng.choice(ranges))) for _ in range(rng.randint(0, 200)))
    return rng.choice(["", "<answer>", "<answer>\\boxed{"]) + text + rng.choice(["", "}</answer>"])


def adversarial_completions(count: int, seed: int = 0, max_chars: int = 80_000, max_fraction_depth: int = 12,
                            towers: tuple[str, ...] = EXPONENT_TOWERS, code_marker: str | None = None) -> list[Any]:
    """``count`` completions drawn from every family in turn (deterministic for ``seed``); one in ten is wrapped
    as a chat-message list. ``max_chars`` bounds the long strings, ``max_fraction_depth`` the nested fractions;
    ``towers`` are the LaTeX exponent towers used (each is slow for a symbolic checker), beside the Python ones.
    With ``code_marker``, the code payloads that would create that file are a family too."""
    rng = random.Random(seed)
    families: list[Callable[[], str]] = [
        lambda: "".join(chr(rng.randint(32, 126)) for _ in range(rng.randint(0, 200))),
        lambda: _tag_soup(rng),
        lambda: _well_formed(rng),
        lambda: _nested_fraction(rng, max_fraction_depth),
        lambda: "<answer>\\boxed{" + rng.choice(towers) + "}</answer>" if towers else _tag_soup(rng),
        lambda: "<answer>" + rng.choice(PYTHON_TOWERS) + "</answer>",
        lambda: _long(rng, max_chars),
        lambda: _unbalanced(rng),
        lambda: _unicode(rng),
    ]
    if code_marker is not None:
        payloads = code_payloads(code_marker)
        families.append(lambda: rng.choice(payloads))
    completions: list[Any] = []
    for index in range(count):
        text = families[index % len(families)]()
        completions.append([{"role": "assistant", "content": text}] if rng.random() < 0.1 else text)
    return completions


def example_rows(task: Task) -> list[dict[str, Any]]:
    """The task's sample rows as examples (prompt plus reward columns), as its reward functions receive them."""
    if task.to_example is None:
        return [dict(row) for row in task.sample_rows]
    return [{**row, **task.to_example(row)} for row in task.sample_rows]


@dataclass
class FuzzReport:
    """What one reward function did on a fuzz corpus: calls, exceptions (``repr`` of each, with the input's
    index), the slowest call in seconds and the completions scored 0 by a timeout."""

    name: str
    count: int = 0
    exceptions: list[str] = field(default_factory=list)
    max_seconds: float = 0.0
    timeouts: int = 0


def fuzz_reward(function: Callable[..., list], completions: list[Any], rows: list[dict[str, Any]]) -> FuzzReport:
    """Call ``function`` once per completion (TRL's signature, batch of one), with the dataset columns of
    ``rows[i % len(rows)]``; record exceptions, the slowest call and timeouts; check each result is one number."""
    report = FuzzReport(getattr(function, "__name__", repr(function)))
    for index, completion in enumerate(completions):
        row = rows[index % len(rows)]
        columns = {name: [value] for name, value in row.items() if name != "prompt"}
        start = time.perf_counter()
        try:
            with counting_timeouts() as counter:
                values = function([row.get("prompt", "")], [completion], **columns)
            if len(values) != 1 or not isinstance(values[0], (int, float)):
                raise TypeError(f"returned {values!r}, not one number")
            report.timeouts += counter[0]
        except Exception as error:  # noqa: BLE001 - collected and reported
            report.exceptions.append(f"input {index}: {type(error).__name__}: {str(error)[:200]}")
        report.max_seconds = max(report.max_seconds, time.perf_counter() - start)
        report.count += 1
    return report
