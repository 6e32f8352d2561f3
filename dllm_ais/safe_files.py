"""Files in folders that other processes or users may change while dllm-ais works (a run folder, a study folder):
never read, written or appended through a symbolic link.

Every file a command writes is staged under a fresh name of its own (`.tmp-<name>-<token>`, created exclusively and
without following a link), flushed, and renamed over its destination (`replacing_file`, `write_file`); an existing
destination must be a regular file, else the write is refused in one line (`NotARegularFile`). A log is appended to
through a descriptor opened without following a link (`open_appending`), and a file is read only when it is a
regular file (`open_regular_file`, `read_regular_file`). A staged file an interrupted write left is recognised by
its name (`is_staged_file`) and removed by the run folder's leftover cleanup.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
import stat
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import BinaryIO, Iterator

STAGED_FILE = re.compile(r"\.tmp-.+-[0-9a-f]{16}")  # the names `replacing_file` stages under


class NotARegularFile(FileExistsError):
    """A path dllm-ais reads, replaces or appends to is a link, a directory or a device; the message names the fix."""


class FileTooLarge(ValueError):
    """A file holds more bytes than its reader takes; `size` says how many."""

    def __init__(self, message: str, size: int):
        super().__init__(message)
        self.size = size


def link_refusal(path: Path) -> str:
    """The one line refusing to write, replace or remove `path` because it is a symbolic link."""
    return (f"{path} is a symbolic link (to {os.readlink(path)}); dllm-ais never writes, replaces or deletes "
            "through a link. Remove the link (its target is kept) or choose another path.")


def not_regular_refusal(path: Path) -> NotARegularFile:
    """The one-line refusal of `path` that is not a regular file: a link (`link_refusal`), or a directory or device."""
    if path.is_symlink():
        return NotARegularFile(link_refusal(path))
    return NotARegularFile(f"{path} is not a regular file (a directory or a device) where dllm-ais writes that "
                           "file; move it away, then run again.")


def check_regular_or_absent(path: Path) -> None:
    """Raise NotARegularFile unless `path` is absent or a regular file (looked at without following a link)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise not_regular_refusal(path)


def is_staged_file(entry: Path) -> bool:
    """Whether `entry` is a regular file (not a link) that `replacing_file` staged and an interrupted write left."""
    return STAGED_FILE.fullmatch(entry.name) is not None and stat.S_ISREG(os.lstat(entry).st_mode)


@contextmanager
def replacing_file(path: str | Path) -> Iterator[BinaryIO]:
    """Yield a binary file staged beside `path` under a fresh name (`.tmp-<name>-<token>`, created exclusively, never
    through a link); once the block has written it, it is flushed to disk and renamed over `path` (the rename
    flushed too), so readers see the old content or the new, never a part. `path` must be absent or a regular file
    (NotARegularFile otherwise, checked before and after writing); the rename replaces whatever is there then
    without following it. On any error the staged file is removed and `path` is left as it was."""
    path = Path(path)
    check_regular_or_absent(path)
    staging = path.with_name(f".tmp-{path.name}-{secrets.token_hex(8)}")
    descriptor = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(descriptor, "wb") as file:
            yield file
            file.flush()
            os.fsync(file.fileno())
        check_regular_or_absent(path)
        os.replace(staging, path)
    except BaseException:
        with suppress(FileNotFoundError):
            os.unlink(staging)
        raise
    sync_directory(path.parent)


def sync_directory(directory: Path) -> None:
    """Flush `directory`'s entries to disk (a rename into it is durable once this returns)."""
    descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_file(path: str | Path, content: bytes | str) -> Path:
    """Make `path` hold `content` (text is UTF-8 encoded) by one rename (`replacing_file`); returns `path`."""
    with replacing_file(path) as file:
        file.write(content.encode() if isinstance(content, str) else content)
    return Path(path)


def save_figure(figure, path: str | Path, dpi: int = 110) -> Path:
    """Write the matplotlib `figure` to `path` as a PNG (`replacing_file`), then close it; returns `path`."""
    import matplotlib.pyplot as plt

    try:
        with replacing_file(path) as file:
            figure.savefig(file, format="png", dpi=dpi)
    finally:
        plt.close(figure)
    return Path(path)


def open_regular_file(path: str | Path) -> BinaryIO:
    """`path` opened for reading through no link; NotARegularFile when it is a link, directory or device (OSError
    when missing)."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise not_regular_refusal(Path(path)) from None
        raise
    file = os.fdopen(descriptor, "rb")
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        file.close()
        raise not_regular_refusal(Path(path))
    return file


def read_regular_file(path: str | Path, limit: int) -> bytes:
    """The bytes of the regular file at `path`, opened through no link and read once; OSError when it is not a
    regular file (missing, a directory, a link, a FIFO) and FileTooLarge when it holds more than `limit` bytes."""
    with open_regular_file(path) as file:
        size = os.fstat(file.fileno()).st_size
        if size > limit:
            raise FileTooLarge(f"{path} holds {size} bytes, more than {limit}", size)
        return file.read(limit)


def copy_regular_file(source: str | Path, destination: str | Path) -> Path:
    """Copy the regular file `source` (read through no link) to `destination` (written by `replacing_file`)."""
    with open_regular_file(source) as reader, replacing_file(destination) as writer:
        shutil.copyfileobj(reader, writer)
    return Path(destination)


def open_appending(path: str | Path) -> int:
    """A write descriptor appending to the regular file at `path` (created when missing), opened through no link:
    NotARegularFile when `path` is a link, a directory or a device. Writes through it land in that file, whatever
    is put at `path` later."""
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.EISDIR):
            raise not_regular_refusal(Path(path)) from None
        raise
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise not_regular_refusal(Path(path))
    return descriptor
