"""One writer per run directory, and no run inside another: an exclusive advisory lock (`fcntl.flock`) on the run
directory itself.

The lock is taken on the directory's own inode, opened without following a symlink, so no file in it — deleted,
replaced, planted as a symlink or as a directory — can admit a second writer or redirect a write. The kernel
releases a flock when the process holding it exits, however it exits (kill -9 included), so a lock is never stale.
Of two runs starting together in one directory, one takes the lock and the other is refused; a refused run never
removes a directory another holds, and a lock only counts once the path still names the directory locked (one
removed or replaced meanwhile is opened and locked again).
A run directory may neither lie inside a live run's directory nor contain one: taking a lock checks the directory's
ancestors and descendants for live locks after taking its own (two runs starting together both see each other and
both refuse rather than both proceed). `<directory>/.dllm-ais.lock` only records the holder (pid, host, start time)
for the refusal message; it is replaced by a rename, never written through a link, and a refused run deletes the
one it wrote. Locks taken here are held until `release_run_lock` or the end of the process; taking a lock this
process already holds is a no-op, so one process may construct several trainers on one directory in turn.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from contextlib import suppress
from pathlib import Path

from dllm_ais.config import ConfigError
from dllm_ais.safe_files import write_file

LOCK_FILE = ".dllm-ais.lock"
MAX_RECORD_BYTES = 4096
MAX_DIRECTORIES_SEARCHED = 10_000  # for live runs inside a directory (a run's own tree holds a few dozen)
LOCK_ATTEMPTS = 5  # a directory removed or replaced under the lock being taken: open it again
_held: dict[Path, int] = {}  # resolved directory -> descriptor of the locked directory


class RunDirectoryInUse(ConfigError):
    """Another live process holds the run directory's lock, or one inside or around it; the message names it."""


def _holder(directory: Path) -> str:
    """`pid N on host H (since T)`, as the holder of `directory` recorded it (or `an unknown process`)."""
    try:
        descriptor = os.open(directory / LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            record = json.loads(os.read(descriptor, MAX_RECORD_BYTES))
        finally:
            os.close(descriptor)
        return f"pid {int(record['pid'])} on host {str(record['host'])[:80]} (since {str(record['since'])[:40]})"
    except (OSError, ValueError, KeyError, TypeError):
        return "an unknown process"


def _in_use_error(directory: Path, wanted: Path) -> RunDirectoryInUse:
    relation = ("" if directory == wanted else f", and {wanted} lies inside it" if directory in wanted.parents
                else f", inside {wanted}")
    return RunDirectoryInUse(f"{directory} is in use by a live dllm-ais run{relation}: {_holder(directory)}. One "
                             "writer per run directory, and no run inside another: wait for that run to end (or stop "
                             "it), or choose another directory.")


def _open_directory(directory: Path) -> int | None:
    """A read-only descriptor of `directory` itself (never through a symlink); None when it is not a directory."""
    try:
        return os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None


def _locked_by_another(directory: Path) -> bool:
    """Whether another live process holds `directory`'s lock (this process' own locks excepted)."""
    if directory in _held:
        return False
    descriptor = _open_directory(directory)
    if descriptor is None:
        return False
    try:
        fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(descriptor)  # also drops the shared lock just taken
    return False


def _live_run_around(directory: Path) -> Path | None:
    """The live run directory (another process') that `directory` (resolved) is, lies in, or contains (among its
    first `MAX_DIRECTORIES_SEARCHED` subdirectories); None."""
    for ancestor in (directory, *directory.parents):
        if _locked_by_another(ancestor):
            return ancestor
    if not directory.is_dir() or directory.is_symlink():
        return None
    subdirectories = (Path(root) / name for root, names, _ in os.walk(directory) for name in names)  # no symlinks
    for _, subdirectory in zip(range(MAX_DIRECTORIES_SEARCHED), subdirectories):
        if _locked_by_another(subdirectory):
            return subdirectory
    return None


def _record_holder(directory: Path) -> None:
    """Replace `directory`'s `LOCK_FILE` by a record of this process (a link planted there is removed, its target
    untouched; the record is staged and renamed in: `safe_files.write_file`). Best effort: it only feeds the refusal
    message, so a lock path that is a directory is kept."""
    record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                         "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")})
    with suppress(OSError):
        if (directory / LOCK_FILE).is_symlink():
            (directory / LOCK_FILE).unlink()
        write_file(directory / LOCK_FILE, record)


def holds_run_lock(directory: str | Path) -> bool:
    """Whether this process holds `directory`'s lock."""
    return Path(directory).resolve() in _held


def hold_run_lock(directory: str | Path) -> bool:
    """Take the exclusive lock of run directory `directory` (created if missing) for this process, or raise
    RunDirectoryInUse naming the live holder of it, or of a run directory it lies in or contains. Returns whether
    this call created the holder record (see `give_up_run_lock`)."""
    key = Path(directory).resolve()
    if key in _held:
        return False
    if (live := _live_run_around(key)) is not None:  # before creating anything inside a live run
        raise _in_use_error(live, key)
    existed, descriptor = key.is_dir(), None
    for _ in range(LOCK_ATTEMPTS):
        key.mkdir(parents=True, exist_ok=True)
        descriptor = _open_directory(key)
        if descriptor is None:
            raise RunDirectoryInUse(f"{directory} is not a directory (a symlink was put in its place?); choose "
                                    "another directory.")
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(descriptor)  # the directory is another run's now: never removed by this refused one
            raise _in_use_error(key, key) from None
        if _names_directory(key, descriptor):
            break
        os.close(descriptor)  # removed (by a run that refused) or replaced between mkdir and the lock: again
        descriptor = None
    if descriptor is None:
        raise RunDirectoryInUse(f"{directory} was removed or replaced each time this run took its lock; stop what "
                                "replaces it, or choose another directory.")
    _held[key] = descriptor
    try:
        if (live := _live_run_around(key)) is not None:  # checked again once held: a run starting meanwhile
            raise _in_use_error(live, key)
    except BaseException:
        if not existed and not any(key.iterdir()):
            key.rmdir()  # while still locked: a run that opened it meanwhile sees it gone once it gets the lock
        release_run_lock(key)
        raise
    created = not (key / LOCK_FILE).exists()
    _record_holder(key)
    return created


def _names_directory(directory: Path, descriptor: int) -> bool:
    """Whether the path `directory` still names the directory open as `descriptor` (not removed, moved or
    replaced since it was opened)."""
    try:
        named, held = os.stat(directory, follow_symlinks=False), os.fstat(descriptor)
    except OSError:
        return False
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino) and held.st_nlink > 0


def check_still_held(directory: str | Path) -> None:
    """Before writing into `directory`: when it lies in (or is) a run directory this process holds, raise
    RunDirectoryInUse if that path no longer names the locked directory (moved away and replaced meanwhile: the
    writes would land in a directory nobody locked)."""
    key = Path(directory).resolve()
    for held, descriptor in _held.items():
        if held == key or held in key.parents:
            if not _names_directory(held, descriptor):
                raise RunDirectoryInUse(f"{held} was moved or replaced while this run held it; nothing more is "
                                        "written there. Find the run's directory where it was moved to.")


def release_run_lock(directory: str | Path) -> None:
    """Release this process' lock of `directory` (its holder record stays, naming the last holder)."""
    descriptor = _held.pop(Path(directory).resolve(), None)
    if descriptor is not None:
        os.close(descriptor)  # closing the last descriptor of the open directory releases the flock


def give_up_run_lock(directory: str | Path, created: bool) -> None:
    """Release the lock after refusing to run in `directory`; a holder record this process `created` is deleted
    first, so a refused run leaves nothing behind."""
    if created and holds_run_lock(directory):
        record = Path(directory) / LOCK_FILE
        if record.is_file() and not record.is_symlink():
            record.unlink()
    release_run_lock(directory)


def check_not_in_use(directory: str | Path) -> None:
    """Raise RunDirectoryInUse when `directory` is, lies in or contains the directory of a live run of another
    process (without taking any lock)."""
    key = Path(directory).resolve()
    if (live := _live_run_around(key)) is not None:
        raise _in_use_error(live, key)
