"""math-verify with a hard deadline that holds in any thread.

math-verify bounds its own time with ``signal.alarm``, which works only in the main thread; off it (a data-loader
or evaluation thread) a pathological answer such as ``\\boxed{9^{9^{9}}}`` never returns, and even on the main
thread sympy's C-level arithmetic ignores the alarm for seconds. Every comparison therefore runs in a
:class:`~dllm_ais.tasks.bounded_worker.BoundedWorker` (a worker process with a hard deadline); a comparison that
runs out of time counts as "not equivalent" and one timeout (:func:`dllm_ais.tasks.parsing.record_timeout`).
Callers bound the length of what they pass (``parsing.MAX_ANSWER_CHARS``).

This module imports only the standard library at the top: the worker imports it to build its handler.
"""

from __future__ import annotations

from collections.abc import Callable

from dllm_ais.tasks.bounded_worker import BoundedWorker

DEFAULT_DEADLINE_SECONDS = 5.0


class MathVerifier(BoundedWorker):
    """Equivalence of LaTeX answers by math-verify in a bounded worker: ``equivalent(predicted, reference)`` returns
    True/False, or None when the comparison ran out of time."""

    def __init__(self, deadline_seconds: float = DEFAULT_DEADLINE_SECONDS, **worker_options):
        super().__init__(f"{__name__}:math_verify_handler", deadline_seconds,
                         install_hint="install it with `pip install math-verify`", **worker_options)

    def equivalent(self, predicted: str, reference: str) -> bool | None:
        return self.call(predicted, reference)


def math_verify_handler() -> Callable[[str, str], bool]:
    """The worker's comparison: math-verify's ``verify`` of the two answers, each parsed as ``\\boxed{...}``; any
    failure of the checker on untrusted text means "not equivalent"."""
    import logging

    from math_verify import parse, verify

    logging.disable(logging.CRITICAL)  # math-verify warns about its disabled alarm; the worker's timer replaces it

    def equivalent(predicted: str, reference: str) -> bool:
        try:
            gold = parse(f"\\boxed{{{reference}}}", parsing_timeout=None)
            answer = parse(f"\\boxed{{{predicted}}}", parsing_timeout=None)
            return bool(gold and answer and verify(gold, answer, timeout_seconds=None))
        except Exception:  # noqa: BLE001 - any failure of the checker on untrusted text means "not equivalent"
            return False

    return equivalent
