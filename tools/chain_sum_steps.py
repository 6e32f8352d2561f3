"""Step-by-step demonstrations for reasoning-gym's ``chain_sum`` task (``a ± b ± c ...``), written out column by
column, for the long-completion warm starts that ``build_tiny_model.py --task chain_sum`` builds.

A demonstration folds the expression left to right. Each step turns the running total ``r`` and the next term into
one operation on two non-negative numbers (``x + y`` or ``x - y`` with ``x >= y``) and a sign, then works it in
columns from the units up, every column showing its digits and the carry (or borrow) coming in::

    <reasoning>
    328-478=-(478-328)
    8-8-0=0 7-2-0=5 4-3-0=1
    =-150
    -150+104=-(150-104)
    0-4-0=-4+10=6 5-0-1=4 1-1-0=0
    =-46
    </reasoning>
    <answer>
    -46
    </answer>

An addition column reads ``x_k+y_k+carry_in=sum`` (the carry out is ``sum // 10``); a subtraction column
``x_k-y_k-borrow_in=d`` and, when ``d < 0``, ``+10=d+10`` (a borrow out of 1). The last addition column writes its
whole sum, so a final carry becomes the leading digits.

The noisy demonstrations (``drop_first_carry``) make one specific mistake: the first carry or borrow of the chain
comes into its column as 0. Every later column and step is worked correctly from there, so the demonstration stays
self-consistent and its answer is off by exactly ``10^k`` in that step's result (the verifier rejects it).
"""

from __future__ import annotations

import re

OPERATORS = ("+", "-")
TERM = re.compile(r"\d+")


def parse_chain(expression: str) -> tuple[int, list[tuple[str, int]]]:
    """``"328 - 478 + 104"`` -> ``(328, [("-", 478), ("+", 104)])``; non-negative integer terms joined by + and -
    (reasoning-gym's ``allow_negation=False``), anything else raises ValueError."""
    parts = expression.split()
    if len(parts) % 2 == 0 or not all(TERM.fullmatch(term) for term in parts[::2]) \
            or not all(operator in OPERATORS for operator in parts[1::2]):
        raise ValueError(f"not a chain of non-negative integers joined by + and -: {expression!r}")
    return int(parts[0]), [(operator, int(term)) for operator, term in zip(parts[1::2], parts[2::2])]


def magnitude_operation(total: int, operator: str, term: int) -> tuple[int, str, int, bool]:
    """``total operator term`` as ``(x, op, y, negated)``: ``±(x op y)`` with ``x, y >= 0`` and ``x >= y`` for
    a subtraction, so ``total operator term == (-1 if negated else 1) * (x op y)``."""
    signed_term = term if operator == "+" else -term
    if total >= 0 and signed_term >= 0:
        return total, "+", signed_term, False
    if total < 0 and signed_term < 0:
        return -total, "+", -signed_term, True
    positive, negative = max(total, signed_term), -min(total, signed_term)
    if positive >= negative:
        return positive, "-", negative, False
    return negative, "-", positive, True


def column_steps(x: int, operator: str, y: int, drop_carry: bool) -> tuple[list[str], int, bool]:
    """The columns of ``x operator y`` (units first) as text, the result, and whether a carry was dropped: with
    ``drop_carry`` the first carry (borrow) into a column is written, and used, as 0."""
    x_digits, y_digits = str(x)[::-1], str(y)[::-1]
    width = max(len(x_digits), len(y_digits))
    columns, result, carry, dropped = [], 0, 0, False
    for k in range(width):
        if carry and drop_carry and not dropped:
            carry, dropped = 0, True
        a = int(x_digits[k]) if k < len(x_digits) else 0
        b = int(y_digits[k]) if k < len(y_digits) else 0
        if operator == "+":
            value = a + b + carry
            columns.append(f"{a}+{b}+{carry}={value}")
            digit, carry = (value, 0) if k == width - 1 else (value % 10, value // 10)
        else:
            value = a - b - carry
            columns.append(f"{a}-{b}-{carry}={value}" + (f"+10={value + 10}" if value < 0 else ""))
            digit, carry = (value + 10, 1) if value < 0 else (value, 0)
        result += digit * 10**k
    return columns, result, dropped


def chain_sum_demonstration(expression: str, drop_first_carry: bool = False) -> str:
    """The worked completion of a chain sum (module docstring): one header, column and result line per operation,
    then the final total in the answer block. ``drop_first_carry`` makes the first carry or borrow 0."""
    total, operations = parse_chain(expression)
    lines, dropping = [], drop_first_carry
    for operator, term in operations:
        x, magnitude_operator, y, negated = magnitude_operation(total, operator, term)
        header = f"{total}{operator}{term}"
        rewritten = f"{x}{magnitude_operator}{y}"
        if negated:
            header += f"=-({rewritten})"
        elif rewritten != header:
            header += f"={rewritten}"
        columns, magnitude, dropped = column_steps(x, magnitude_operator, y, dropping)
        dropping = dropping and not dropped
        total = -magnitude if negated else magnitude
        lines += [header, " ".join(columns), f"={total}"]
    reasoning = "\n".join(lines)
    return f"<reasoning>\n{reasoning}\n</reasoning>\n<answer>\n{total}\n</answer>"
