"""JSON from files dllm-ais does not fully trust (markers, metrics lines): bounded in size and nesting before the
parser sees it, so a hostile file costs a damaged-record report, never a RecursionError or a huge allocation."""

from __future__ import annotations

import json
import re
from typing import Any

_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


class JSONLimitError(ValueError):
    """JSON text larger or deeper than its reader allows."""


def nesting_depth(data: bytes) -> int:
    """The deepest nesting of arrays and objects in the JSON text `data` (brackets inside strings do not count)."""
    depth = deepest = 0
    for bracket in _STRING.sub(b'""', data).translate(None, _NOT_BRACKETS):
        depth += 1 if bracket in b"[{" else -1
        deepest = max(deepest, depth)
    return deepest


def loads_bounded(data: bytes | str, max_bytes: int, max_depth: int) -> Any:
    """`json.loads(data)` after checking that `data` has at most `max_bytes` bytes and `max_depth` levels of
    nesting; JSONLimitError (a ValueError) otherwise, as for any text that is not JSON."""
    raw = data.encode() if isinstance(data, str) else data
    if len(raw) > max_bytes:
        raise JSONLimitError(f"{len(raw)} bytes, more than {max_bytes}")
    if (depth := nesting_depth(raw)) > max_depth:
        raise JSONLimitError(f"nested {depth} deep, more than {max_depth}")
    return json.loads(raw)
