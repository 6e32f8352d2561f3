"""math-verify with a hard deadline that holds in any thread.

math-verify bounds its own time with ``signal.alarm``, which works only in the main thread; off it
(a data-loader or evaluation thread) a pathological answer such as ``\\boxed{9^{9^{9}}}`` never
returns, and even on the main thread sympy's C-level arithmetic ignores the alarm for seconds.
Here every comparison runs in a worker process (started on first use, reused across calls):

- the worker interrupts a comparison after ``deadline_seconds`` (a timer signal in its own main
  thread) and answers "timeout";
- if it has not answered ``GRACE_SECONDS`` later, the caller kills it and starts a fresh one on the
  next call; a CPU-time limit also ends a worker stuck in C code whose parent has gone;
- either way the comparison counts as "not equivalent" and one timeout
  (:func:`dllm_ais.tasks.parsing.record_timeout`).

Results are cached per (answer, reference), so the G identical completions of a group cost one
comparison. Callers bound the length of what they pass (``parsing.MAX_ANSWER_CHARS``).

This file imports only the standard library at the top: the worker runs it as a script
(``python -c ... math_verifier.py``), without importing dllm_ais, torch or the caller's working
directory.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict

DEFAULT_DEADLINE_SECONDS = 5.0
GRACE_SECONDS = 1.0
STARTUP_SECONDS = 120.0
CACHE_SIZE = 4096

# Runs this file as __main__ without putting the working directory (possibly a downloaded checkpoint) on sys.path.
_WORKER_BOOT = "import runpy, sys; sys.path[:] = [p for p in sys.path if p]; runpy.run_path(sys.argv[1], run_name='__main__')"


class MathVerifier:
    """Equivalence of LaTeX answers by math-verify, in a reusable worker process with a hard deadline.

    ``equivalent(predicted, reference)`` returns True/False, or None when the comparison ran out of
    time (the worker is then replaced). Thread-safe; a forked child starts its own worker.
    """

    def __init__(self, deadline_seconds: float = DEFAULT_DEADLINE_SECONDS, cache_size: int = CACHE_SIZE):
        self.deadline_seconds = deadline_seconds
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], bool | None] = OrderedDict()
        self._forget_worker()
        os.register_at_fork(after_in_child=self._forget_worker)
        atexit.register(self.close)

    def equivalent(self, predicted: str, reference: str) -> bool | None:
        key = (predicted, reference)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            result = self._compare(predicted, reference)
            self._cache[key] = result
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return result

    def close(self) -> None:
        """Stop the worker (it is started again on the next comparison)."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

    def _forget_worker(self) -> None:
        """Fresh state (also in a forked child, which must neither talk to nor wait for its parent's worker)."""
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._buffer = b""

    # ------------------------------------------------------------------------------------ internals
    def _compare(self, predicted: str, reference: str) -> bool | None:
        request = json.dumps({"predicted": predicted, "reference": reference, "seconds": self.deadline_seconds})
        for attempt in range(2):  # a worker that died between calls is replaced once
            process = self._worker()
            try:
                process.stdin.write(request.encode() + b"\n")
                process.stdin.flush()
            except (BrokenPipeError, OSError):
                self.close()
                if attempt:
                    raise
                continue
            reply = self._read_line(time.monotonic() + self.deadline_seconds + GRACE_SECONDS)
            if reply is None:  # past the hard deadline, or the worker died (e.g. its CPU-time limit)
                self.close()
                return None
            return json.loads(reply)["equivalent"]
        return None

    def _worker(self) -> subprocess.Popen:
        if self._process is not None and self._process.poll() is None:
            return self._process
        # Its own session: a Ctrl-C or a scheduler's SIGTERM to the trainer's process group must not kill a
        # comparison of the step the trainer is finishing (it would score 0 and break exact resume); the worker
        # ends with its stdin when the trainer exits.
        self._process = subprocess.Popen(
            [sys.executable, "-c", _WORKER_BOOT, os.path.abspath(__file__)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True,
            start_new_session=True)
        self._buffer = b""
        ready = self._read_line(time.monotonic() + STARTUP_SECONDS)
        message = json.loads(ready) if ready else {"error": "the worker did not start"}
        if "error" in message:
            self.close()
            raise RuntimeError(f"math-verify worker failed: {message['error']} (install it with `pip install math-verify`)")
        return self._process

    def _read_line(self, deadline: float) -> str | None:
        """The worker's next output line, or None at ``deadline`` or end of output."""
        descriptor = self._process.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([descriptor], [], [], remaining)[0]:
                return None
            chunk = os.read(descriptor, 65536)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()


# ---------------------------------------------------------------------------------------------- the worker


class _Deadline(BaseException):
    """Raised by the worker's timer; a BaseException so that math-verify's `except Exception` lets it through."""


def _raise_deadline(signum, frame):
    raise _Deadline


def _compare_in_worker(parse, verify, predicted: str, reference: str, seconds: float) -> bool | None:
    import signal

    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        gold = parse(f"\\boxed{{{reference}}}", parsing_timeout=None)
        answer = parse(f"\\boxed{{{predicted}}}", parsing_timeout=None)
        return bool(gold and answer and verify(gold, answer, timeout_seconds=None))
    except _Deadline:
        return None
    except Exception:  # noqa: BLE001 - any failure of the checker on untrusted text means "not equivalent"
        return False
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def serve() -> None:
    """Worker loop: one JSON request per stdin line -> one ``{"equivalent": true|false|null}`` line."""
    import logging
    import resource
    import signal

    def reply(message: dict) -> None:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()

    try:
        from math_verify import parse, verify
    except ImportError as error:
        reply({"error": f"cannot import math_verify: {error}"})
        return
    logging.disable(logging.CRITICAL)  # math-verify warns about its disabled alarm; the timer below replaces it
    signal.signal(signal.SIGALRM, _raise_deadline)
    reply({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        hard_limit = resource.getrlimit(resource.RLIMIT_CPU)[1]
        cpu_limit = int(usage.ru_utime + usage.ru_stime + 4 * request["seconds"] + 10)
        if hard_limit != resource.RLIM_INFINITY:
            cpu_limit = min(cpu_limit, hard_limit)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_limit, hard_limit))
        reply({"equivalent": _compare_in_worker(parse, verify, request["predicted"], request["reference"],
                                                request["seconds"])})


if __name__ == "__main__":
    serve()
