"""Calls on untrusted input in a worker process, with a hard deadline that holds in any thread.

A checker handed model output (math-verify, a reasoning-gym verifier) may hang or compute without end: a
pathological answer such as ``\\boxed{9^{9^{9}}}`` keeps sympy busy for minutes, in C code that ignores Python's
signals, and ``signal.alarm`` works only in the main thread. :class:`BoundedWorker` runs every call in a worker
process (started on first use, reused across calls):

- the worker interrupts a call after ``deadline_seconds`` (a timer signal in its own main thread) and answers
  "timeout";
- if it has not answered ``GRACE_SECONDS`` later, the caller kills it and starts a fresh one on the next call; a
  CPU-time limit also ends a worker stuck in C code whose parent has gone, and an address-space limit
  (``memory_headroom_bytes`` above its size once the handler is loaded) turns a huge allocation into a MemoryError;
- either way :meth:`BoundedWorker.call` returns None, which the caller scores as a failure and counts as one
  timeout (:func:`dllm_ais.tasks.parsing.record_timeout`).

The work itself is a *handler*: ``"package.module:factory"``, where ``factory()`` imports what the work needs and
returns ``handle(*args) -> JSON value``. The handler must catch its own exceptions on bad input (an exception that
escapes it is a bug and is raised to the caller); the deadline is a BaseException, which ``except Exception`` lets
through. Results are cached per argument list, so the G identical completions of a group cost one call.

The worker imports only this module and the handler's module, from the directory holding the ``dllm_ais`` package:
never the caller's working directory (possibly a downloaded checkpoint), nor torch.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

GRACE_SECONDS = 1.0
STARTUP_SECONDS = 120.0
CACHE_SIZE = 4096
MEMORY_HEADROOM_BYTES = 2 << 30
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])

_WORKER_BOOT = ("import sys; sys.path[:] = [sys.argv[1]] + [p for p in sys.path if p]; "
                "from dllm_ais.tasks.bounded_worker import serve; serve(sys.argv[2], float(sys.argv[3]))")


class WorkerStartError(RuntimeError):
    """The worker could not load its handler (typically a missing optional package)."""


class BoundedWorker:
    """``call(*args)`` runs ``handler``'s function on JSON arguments in a reusable worker process and returns its
    JSON result, or None when the call ran past ``deadline_seconds`` (the worker is then replaced).

    ``install_hint`` ends the error raised when the worker cannot load the handler. Thread-safe; a forked child
    starts its own worker.
    """

    def __init__(self, handler: str, deadline_seconds: float, install_hint: str = "",
                 cache_size: int = CACHE_SIZE, memory_headroom_bytes: int = MEMORY_HEADROOM_BYTES):
        self.handler = handler
        self.deadline_seconds = deadline_seconds
        self.install_hint = install_hint
        self.cache_size = cache_size
        self.memory_headroom_bytes = memory_headroom_bytes
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._forget_worker()
        os.register_at_fork(after_in_child=self._forget_worker)
        atexit.register(self.close)

    def call(self, *args: Any) -> Any:
        key = json.dumps(args)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            result = self._run(key)
            self._cache[key] = result
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return result

    def close(self) -> None:
        """Stop the worker (it is started again on the next call)."""
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
    def _run(self, arguments: str) -> Any:
        request = f'{{"seconds": {json.dumps(self.deadline_seconds)}, "args": {arguments}}}\n'.encode()
        for attempt in range(2):  # a worker that died between calls is replaced once
            process = self._worker()
            try:
                process.stdin.write(request)
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
            message = json.loads(reply)
            if "error" in message:
                raise RuntimeError(f"{self.handler} raised on its input: {message['error']}")
            return message.get("result")
        return None

    def _worker(self) -> subprocess.Popen:
        if self._process is not None and self._process.poll() is None:
            return self._process
        # Its own session: a Ctrl-C or a scheduler's SIGTERM to the trainer's process group must not kill a call of
        # the step the trainer is finishing (it would score 0 and break exact resume); the worker ends with its stdin
        # when the trainer exits.
        self._process = subprocess.Popen(
            [sys.executable, "-c", _WORKER_BOOT, PACKAGE_ROOT, self.handler, str(self.memory_headroom_bytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True,
            start_new_session=True)
        self._buffer = b""
        ready = self._read_line(time.monotonic() + STARTUP_SECONDS)
        message = json.loads(ready) if ready else {"error": "the worker did not start"}
        if "error" in message:
            self.close()
            hint = f" ({self.install_hint})" if self.install_hint else ""
            raise WorkerStartError(f"the {self.handler} worker failed: {message['error']}{hint}")
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
    """Raised by the worker's timer; a BaseException so that a handler's `except Exception` lets it through."""


def _raise_deadline(signum, frame):
    raise _Deadline


def _limit_address_space(headroom_bytes: float) -> None:
    """Cap this process's address space at its current size plus ``headroom_bytes`` (Linux; elsewhere no cap)."""
    import resource

    try:
        current = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        hard_limit = resource.getrlimit(resource.RLIMIT_AS)[1]
        limit = current + int(headroom_bytes)
        resource.setrlimit(resource.RLIMIT_AS, (limit if hard_limit == resource.RLIM_INFINITY
                                                else min(limit, hard_limit), hard_limit))
    except (OSError, ValueError):
        pass


def _limit_cpu_time(seconds: float) -> None:
    """Let this process use at most 4 × ``seconds`` + 10 more CPU seconds (SIGXCPU ends it past that)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    hard_limit = resource.getrlimit(resource.RLIMIT_CPU)[1]
    cpu_limit = int(usage.ru_utime + usage.ru_stime + 4 * seconds + 10)
    if hard_limit != resource.RLIM_INFINITY:
        cpu_limit = min(cpu_limit, hard_limit)
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_limit, hard_limit))


def serve(handler: str, memory_headroom_bytes: float) -> None:
    """Worker loop: load ``handler`` ("module:factory"), then one JSON request ``{"seconds", "args"}`` per stdin line
    -> one ``{"result": value}`` line (``{"result": null, "timeout": true}`` past the deadline)."""
    import signal

    channel = os.fdopen(os.dup(sys.stdout.fileno()), "w")  # replies only: what the handler prints goes to stderr
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.stdout = sys.stderr

    def reply(message: dict) -> None:
        channel.write(json.dumps(message) + "\n")
        channel.flush()

    module, _, factory = handler.partition(":")
    try:
        handle = getattr(importlib.import_module(module), factory)()
    except ImportError as error:
        reply({"error": f"cannot import {error.name or module}: {error}"})
        return
    _limit_address_space(memory_headroom_bytes)
    signal.signal(signal.SIGALRM, _raise_deadline)
    reply({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        _limit_cpu_time(request["seconds"])
        signal.setitimer(signal.ITIMER_REAL, request["seconds"])
        try:
            message = {"result": handle(*request["args"])}
        except _Deadline:
            message = {"result": None, "timeout": True}
        except Exception as error:  # noqa: BLE001 - reported to the caller, which raises it
            message = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        reply(message)
