"""One writer per run directory: an exclusive advisory lock (`fcntl.flock`) on `<directory>/.dllm-ais.lock`.

The kernel releases a flock when the process holding it exits, however it exits (kill -9 included), so a lock is
never stale. The lock file itself records the holder (pid, host, start time) for the refusal message; the file is
only deleted by the process that created it, while holding the lock, when it gives the directory up unused.
Locks taken here are held until `release_run_lock` or the end of the process; taking a lock this process already
holds is a no-op, so one process may construct several trainers on one directory in turn.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from dllm_ais.config import ConfigError

LOCK_FILE = ".dllm-ais.lock"
_held: dict[Path, int] = {}  # resolved directory -> descriptor of its locked lock file


class RunDirectoryInUse(ConfigError):
    """Another live process holds the run directory's lock; the message names it."""


def _holder(lock_path: Path) -> str:
    """`pid N on host H since T`, as the holder recorded it (or `an unknown process` when unreadable)."""
    try:
        record = json.loads(lock_path.read_text())
        return f"pid {record['pid']} on host {record['host']} (since {record['since']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "an unknown process"


def _in_use_error(directory: Path) -> RunDirectoryInUse:
    return RunDirectoryInUse(f"{directory} is in use by a live dllm-ais run: {_holder(directory / LOCK_FILE)}. One "
                             "writer per run directory: wait for that run to end (or stop it), or choose another "
                             "directory.")


def holds_run_lock(directory: str | Path) -> bool:
    """Whether this process holds `directory`'s lock."""
    return Path(directory).resolve() in _held


def hold_run_lock(directory: str | Path) -> bool:
    """Take the exclusive lock of run directory `directory` (created if missing) for this process, or raise
    RunDirectoryInUse naming the live holder. Returns whether this call created the lock file (see
    `give_up_run_lock`)."""
    directory = Path(directory)
    key = directory.resolve()
    if key in _held:
        return False
    directory.mkdir(parents=True, exist_ok=True)
    lock_path = directory / LOCK_FILE
    while True:
        created = not lock_path.exists()
        descriptor = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(descriptor)
            raise _in_use_error(directory) from None
        try:  # the file may have been deleted (by a holder giving it up) between our open and our lock: retry
            same_file = os.stat(lock_path).st_ino == os.fstat(descriptor).st_ino
        except FileNotFoundError:
            same_file = False
        if same_file:
            break
        os.close(descriptor)
    record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                         "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}).encode()
    os.ftruncate(descriptor, 0)
    os.pwrite(descriptor, record, 0)
    _held[key] = descriptor
    return created


def release_run_lock(directory: str | Path) -> None:
    """Release this process' lock of `directory` (the file stays: deleting it could let two writers in)."""
    descriptor = _held.pop(Path(directory).resolve(), None)
    if descriptor is not None:
        os.close(descriptor)  # closing the last descriptor of the open file releases the flock


def give_up_run_lock(directory: str | Path, created: bool) -> None:
    """Release the lock after refusing to run in `directory`; a lock file this process `created` is deleted first
    (still locked, so no one can be holding it), so a refused run leaves nothing behind."""
    if created and holds_run_lock(directory):
        (Path(directory) / LOCK_FILE).unlink(missing_ok=True)
    release_run_lock(directory)


def check_not_in_use(directory: str | Path) -> None:
    """Raise RunDirectoryInUse when another live process holds `directory`'s lock (without taking it)."""
    directory = Path(directory)
    if holds_run_lock(directory):
        return
    try:
        descriptor = os.open(directory / LOCK_FILE, os.O_RDONLY)
    except OSError:  # no lock file (or not a directory): no run ever held it
        return
    try:
        fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _in_use_error(directory) from None
    finally:
        os.close(descriptor)
