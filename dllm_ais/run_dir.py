"""The run folder on disk: directories written atomically (staged, then renamed) and marked as dllm-ais' with
their kind (a run's checkpoint or final model, an export), the one removal (`remove_directory`, never through a
symbolic link), the leftovers of interrupted writes, each checkpoint's manifest (every file's size and sha256) and
its verification, free space, and the listing and pruning of `checkpoint-N` directories. What a checkpoint holds is
`dllm_ais.checkpoint`; who may write into a run folder, `dllm_ais.run_lock`."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import stat
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Iterator

from dllm_ais.metrics import sync_logs_in
from dllm_ais.run_lock import LOCK_FILE, check_not_in_use, check_still_held
from dllm_ais.safe_files import (FileTooLarge, is_staged_file, link_refusal, open_regular_file,
                                 read_regular_file, sync_directory, write_file)
from dllm_ais.safe_json import loads_bounded

# ------------------------------------------------------------------------------------------ safe directory writes
MARKER = ".dllm-ais.json"  # provenance file inside every directory dllm-ais writes; its proof of ownership
LEFTOVER_PREFIXES = (".tmp-", ".old-", ".trash-")
RUN_OUTPUTS = ("final",)  # directories a run writes besides its checkpoint-N
BOOKKEEPING = (MARKER, LOCK_FILE)  # files of dllm-ais' own in a directory, never counted as its contents
MIB = 1024 * 1024
MAX_MARKER_BYTES, MAX_MARKER_DEPTH = 16 * MIB, 8  # a marker lists a checkpoint's files: a few KB, 4 levels deep
TOKENED_LEFTOVER = re.compile(r"\.(tmp|trash)-.+-[0-9a-f]{8}")  # the names staging_directory / discard_directory give


class OutputExistsError(FileExistsError):
    """A destination is in the way (not empty, or not written by dllm-ais); the message names the way out."""


def dllm_ais_record(path: str | Path) -> dict[str, Any] | None:
    """The JSON object in the file at `path` when dllm-ais wrote it (its `written_by` says so); None otherwise (also
    for a symlink, a file over `MAX_MARKER_BYTES` or JSON nested deeper than `MAX_MARKER_DEPTH`)."""
    try:
        record = loads_bounded(read_regular_file(path, MAX_MARKER_BYTES), MAX_MARKER_BYTES, MAX_MARKER_DEPTH)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("written_by") == "dllm-ais" else None


def provenance(directory: str | Path) -> dict[str, Any] | None:
    """The marker dllm-ais leaves in each directory it writes; None when absent or unreadable (not provably ours)."""
    return dllm_ais_record(Path(directory) / MARKER)


def is_leftover(entry: Path) -> bool:
    """What an interrupted dllm-ais write left: a staged file (`safe_files.is_staged_file`), or a staging, displaced
    or half-deleted directory — one carrying the marker, or an empty `.tmp-`/`.trash-<name>-<token>` one (a staging
    directory killed before its marker was written, or a deletion killed after its marker went: removing it loses
    nothing). A link is never one."""
    if not entry.name.startswith(LEFTOVER_PREFIXES) or entry.is_symlink():
        return False
    if not entry.is_dir():
        return is_staged_file(entry)
    return provenance(entry) is not None or (TOKENED_LEFTOVER.fullmatch(entry.name) is not None
                                             and not any(entry.iterdir()))


def describe_contents(directory: Path, limit: int = 4) -> str:
    names = sorted(e.name + ("/" if e.is_dir() else "") for e in directory.iterdir()
                   if not is_leftover(e) and e.name not in BOOKKEEPING)
    return ", ".join(names[:limit]) + (f", … ({len(names)} entries)" if len(names) > limit else "")


# What dllm-ais wrote a directory as (its marker's `kind`), and how a refusal names it.
KINDS = {"run directory": "the output_dir of a training run (its checkpoints and metrics)",
         "checkpoint": "a training run's checkpoint-N", "final": "a training run's final model (its final/)",
         "model": "a model directory that `dllm-ais export` or `dllm-ais sft` wrote"}


def directory_kind(directory: Path) -> str | None:
    """What dllm-ais wrote `directory` as (a `KINDS` key), or None when it did not write it (no readable marker).
    A marker written before kinds were recorded: a run directory says so, a checkpoint names its run, a run's final
    model is its `final/`, anything else is a model directory."""
    marker = provenance(directory)
    if marker is None:
        return None
    if marker.get("kind") in KINDS:
        return marker["kind"]
    if marker.get("run_directory"):
        return "run directory"
    if "run" in marker:
        return "checkpoint"
    in_a_run = (provenance(directory.parent) or {}).get("run_directory")
    return "final" if directory.name in RUN_OUTPUTS and in_a_run else "model"


def check_destination(final: Path, overwrite: bool, flag: str = "--overwrite", kind: str = "model") -> None:
    """Raise OutputExistsError unless `final` may be written as a directory of `kind` (see `KINDS`): absent, empty,
    or — with `overwrite` — a directory that dllm-ais wrote as the same kind. Nothing else is ever replaced, so no
    command can delete what it did not create: an export or an SFT model never replaces a run's checkpoint or
    final model, and a symbolic link is never written or replaced through. A directory that is, lies in or contains
    a live run's directory is refused whatever `overwrite` says, and so is a model directory inside a run's
    folder, checkpoint or final model (`check_outside_runs`)."""
    check_not_in_use(final)
    if final.is_symlink():
        raise OutputExistsError(link_refusal(final))
    if final.exists() and not (final.is_dir() and not any(final.iterdir())):
        check_replaceable(final, overwrite, flag, kind)
    if kind == "model":
        check_outside_runs(final)


def check_replaceable(final: Path, overwrite: bool, flag: str, kind: str) -> None:
    """`check_destination` of a `final` that holds something: only a directory dllm-ais wrote as `kind`, and only
    with `overwrite`."""
    if not final.is_dir():
        raise OutputExistsError(f"{final} is a file; choose a directory path that does not exist yet.")
    if not overwrite:
        raise OutputExistsError(f"{final} is not empty (holds {describe_contents(final)}); choose a new directory "
                                f"(e.g. {final / 'NAME'}) or pass {flag} to replace a directory that dllm-ais wrote.")
    found = directory_kind(final)
    if found is None:
        raise OutputExistsError(f"{final} holds files dllm-ais did not write ({describe_contents(final)}); {flag} only "
                                "replaces directories dllm-ais wrote. Choose a new directory or move this one away.")
    if found != kind:
        raise OutputExistsError(f"{final} is {KINDS[found]}; {flag} only replaces {KINDS[kind]}, never this. "
                                "Choose a new directory.")


RUN_KINDS = ("run directory", "checkpoint", "final")  # what only `dllm-ais train` writes into


def check_outside_runs(destination: Path) -> None:
    """Raise OutputExistsError when `destination` lies inside a directory a training run wrote (its output_dir, a
    checkpoint-N or its final/): what an export or SFT writes never goes into a run's own folders."""
    for ancestor in destination.resolve().parents:
        if (kind := directory_kind(ancestor)) in RUN_KINDS:
            raise OutputExistsError(f"{destination} lies inside {ancestor}, {KINDS[kind]}; nothing but its run writes "
                                    "there. Choose a directory outside it.")


def check_not_source(destination: Path, source: str | Path) -> None:
    """Raise OutputExistsError when `destination` is, holds or lies inside the local directory `source` a command
    reads (an export's adapter, SFT's starting model): a command never replaces or writes into its own input."""
    source = Path(source)
    if not source.exists():
        return
    destination_path, source_path = destination.resolve(), source.resolve()
    if destination_path == source_path or destination_path in source_path.parents:
        raise OutputExistsError(f"{destination} is, or holds, the command's source {source}; it is never replaced. "
                                "Choose a new output directory.")
    if source_path in destination_path.parents:
        raise OutputExistsError(f"{destination} lies inside the command's source {source}; nothing is written into "
                                "it. Choose a directory outside it.")


def fsync_tree(root: Path) -> None:
    """Flush every file and directory under `root` to the disk (a rename is only durable after its content is)."""
    for directory, _, files in os.walk(root):
        for name in files:
            descriptor = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(descriptor)
            finally:
                os.close(descriptor)
        sync_directory(directory)


def remove_directory(path: Path) -> None:
    """Delete a directory dllm-ais wrote, its marker last (a crash midway leaves a leftover still provably ours) —
    the one way anything is removed. Never through a symbolic link: `path` itself being one is refused
    (OutputExistsError, nothing removed), and a link anywhere inside is unlinked, its target untouched (the
    directory is opened without following a link, and its subdirectories are removed relative to it)."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        if path.is_symlink():
            raise OutputExistsError(link_refusal(path)) from None
        raise
    try:
        for name in os.listdir(descriptor):
            if name == MARKER:
                continue
            if stat.S_ISDIR(os.stat(name, dir_fd=descriptor, follow_symlinks=False).st_mode):
                shutil.rmtree(name, dir_fd=descriptor)  # fd-based: a link inside is unlinked, never followed
            else:
                os.unlink(name, dir_fd=descriptor)
        with suppress(FileNotFoundError):
            os.unlink(MARKER, dir_fd=descriptor)
    finally:
        os.close(descriptor)
    os.rmdir(path)  # a link swapped in meanwhile fails here (ENOTDIR), never followed


def discard_directory(path: Path, name: str | None = None) -> None:
    """Delete a directory dllm-ais wrote (`remove_directory`): first renamed to `.trash-<name>-*`, so it never stays
    half-deleted under a name that a resume or a leftover recovery would trust. A symbolic link is refused."""
    if path.is_symlink():
        raise OutputExistsError(link_refusal(path))
    trash = path.with_name(f".trash-{name or path.name}-{secrets.token_hex(4)}")
    os.rename(path, trash)
    sync_directory(path.parent)
    remove_directory(trash)


def _writer_is_running(marker: dict[str, Any]) -> bool:
    pid = marker.get("pid")
    if marker.get("host") != socket.gethostname() or not isinstance(pid, int) or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_leftovers(parent: str | Path, name: str | None = None) -> None:
    """Finish what interrupted atomic writes left in `parent` (for directory `name`, or for all): a `.tmp-<name>-*`
    staging directory is deleted unless its writer still runs; `.old-<name>` (a complete previous copy moved aside)
    is renamed back when `<name>` is missing — the crash fell between the two renames — and deleted otherwise;
    `.trash-*` is deleted, and so is a file an interrupted write staged (`.tmp-<name>-<token>`, a regular file,
    never a link). Only directories carrying dllm-ais' marker are touched, and empty ones (an interrupted deletion's
    last step)."""
    parent = Path(parent)
    if not parent.is_dir():
        return
    for entry in sorted(parent.iterdir()):
        if not is_leftover(entry):
            continue
        prefix, _, rest = entry.name[1:].partition("-")
        target = rest if prefix == "old" else rest.rpartition("-")[0]
        if name is not None and target != name:
            continue
        if not entry.is_dir():  # a staged file: unlinked, never followed
            entry.unlink()
            continue
        marker = provenance(entry)
        if marker is None:  # empty: see is_leftover
            entry.rmdir()
        elif prefix == "tmp" and _writer_is_running(marker):
            continue
        elif prefix == "old" and not (parent / target).exists():
            os.rename(entry, parent / target)
            sync_directory(parent)
        elif prefix == "trash":
            remove_directory(entry)
        else:
            discard_directory(entry, target)


def staging_directory(final: Path, token: str) -> Path:
    """Where `final` is staged: `.tmp-<name>-<token>` beside it (processes writing one checkpoint share `token`)."""
    return final.parent / f".tmp-{final.name}-{token}"


def begin_staging(final: Path, token: str | None = None, **fields: Any) -> Path:
    """Create the staging directory of `final`, marked as dllm-ais' (with `fields`), after checking that the disk
    has room for it (see `check_free_space`)."""
    check_free_space(final)
    staging = staging_directory(final, token or secrets.token_hex(4))
    staging.mkdir(parents=True)
    marker = {"written_by": "dllm-ais", "pid": os.getpid(), "host": socket.gethostname(), **fields}
    write_file(staging / MARKER, json.dumps(marker))
    return staging


def commit_staging(staging: Path, final: Path, overwrite: bool = False) -> None:
    """Make the finished `staging` directory `final` by renames only, after recording every file's size and hash in
    its marker (`verify_checkpoint` checks them) and flushing it — and the run's open JSONL logs — to disk.

    `final` may be absent or empty, or (with `overwrite`) a directory dllm-ais wrote as the same kind as `staging`
    (`check_destination`): that one is first renamed to `.old-<name>` and deleted once the new copy is in place, so
    a complete copy always exists under one of the names. Nothing beside `final` is touched. On failure the staging
    directory is removed.
    """
    try:
        record_manifest(staging)
        fsync_tree(staging)
        sync_logs_in(final.parent)
        check_still_held(final.parent)
        check_destination(final, overwrite, kind=directory_kind(staging))
        displaced = None
        if final.is_dir() and any(final.iterdir()):
            displaced = final.with_name(f".old-{final.name}")
            os.rename(final, displaced)
        elif final.is_dir():
            final.rmdir()
        os.rename(staging, final)
        sync_directory(final.parent)
    except BaseException:
        if staging.exists():
            remove_directory(staging)
        raise
    if displaced is not None:
        discard_directory(displaced, final.name)


@contextmanager
def atomic_directory(final: str | Path, overwrite: bool = False, flag: str = "--overwrite", kind: str = "model",
                     **fields: Any) -> Iterator[Path]:
    """Yield a staging directory beside `final`, marked as a directory of `kind` (see `KINDS`; `fields` also go
    into its marker); once the block has written everything, it becomes `final`.

    `final` must be absent or empty unless `overwrite` allows replacing a directory dllm-ais wrote as the same kind
    (checked before the block runs, so a refused destination costs nothing); `flag` is how the user says
    "overwrite" in the error.
    A crash leaves `final` as it was plus a leftover that the next write to `final` cleans up; an exception removes
    the staging directory (a full disk is reported as `NoSpaceLeft`).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    clean_leftovers(final.parent, final.name)
    check_destination(final, overwrite, flag, kind)
    with staged_directory(final, overwrite=overwrite, kind=kind, **fields) as staging:
        yield staging


@contextmanager
def staged_directory(final: str | Path, token: str | None = None, is_main_process: bool = True,
                     overwrite: bool = True, **fields: Any) -> Iterator[Path]:
    """Yield the staging directory of `final` (see `begin_staging`; `fields` go into its marker); once the block
    has written everything, it becomes `final` (`commit_staging`). The trainer's checkpoints use this with the run's
    `token`, so that every process writes into one staging directory; only the main process creates and commits it.

    Any exception removes the staging directory (it never stays, holding the space); a full disk — ENOSPC, or a
    library's write error while the disk has no room left — is raised as `NoSpaceLeft`, saying how much a
    checkpoint needs.
    """
    final = Path(final)
    staging = begin_staging(final, token, **fields) if is_main_process else staging_directory(final, token)
    try:
        yield staging
    except BaseException as error:
        no_space = no_space_error(error, final)
        if is_main_process and staging.exists():
            remove_directory(staging)
        if no_space is not None:
            raise no_space from error
        raise
    if is_main_process:
        commit_staging(staging, final, overwrite)


# ------------------------------------------------------------------------------------------ integrity and space
class NoSpaceLeft(OSError):
    """The disk has no room for what is being written; the message says where and how much is needed."""

    def __str__(self) -> str:
        return self.strerror


def directory_size(directory: Path) -> int:
    """Bytes of the files under `directory` (0 when it does not exist)."""
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, files in os.walk(directory) for name in files)


def checkpoint_size_estimate(parent: Path) -> int:
    """Bytes the next checkpoint in `parent` needs: the size of the newest checkpoint-N there (0 when none)."""
    newest = run_checkpoints(parent)
    return directory_size(newest[-1][1]) if newest else 0


def no_space_message(where: Path, needed: int, free: int | None = None, at_least: bool = False) -> str:
    free_text = f"{free / MIB:.1f} MB free; " if free is not None else ""
    amount = f"more than {needed / MIB:.1f}" if at_least else f"~{needed / MIB:.1f}"
    return f"no space left on {where} ({free_text}a checkpoint needs {amount} MB)"


def check_free_space(final: Path) -> None:
    """Raise NoSpaceLeft before writing `final` when its disk has less room than the newest checkpoint beside it
    took (plus 10 %): better a clear refusal than a library's error halfway through the write."""
    needed = int(1.1 * checkpoint_size_estimate(final.parent))
    free = shutil.disk_usage(final.parent).free if final.parent.is_dir() else None
    if needed and free is not None and free < needed:
        raise NoSpaceLeft(errno.ENOSPC, no_space_message(final.parent, needed, free))


def no_space_error(error: BaseException, final: Path) -> NoSpaceLeft | None:
    """`error` as NoSpaceLeft when it came from a full disk — ENOSPC or EDQUOT anywhere in its chain, or any write
    error while less than 1 MB is left on `final`'s disk (torch reports a full disk as `RuntimeError: ... unexpected
    pos`) — else None. The size needed is the newest checkpoint's; without one, more than the staging directories
    beside `final` held when the write failed."""
    if isinstance(error, NoSpaceLeft):
        return error
    cause: BaseException | None = error
    full = False
    while cause is not None and not full:
        full = isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT)
        cause = cause.__cause__ or cause.__context__
    parent = final.parent
    if not full and isinstance(error, (OSError, RuntimeError)) and parent.is_dir():
        full = shutil.disk_usage(parent).free < MIB
    if not full:
        return None
    needed = checkpoint_size_estimate(parent)
    if needed:
        return NoSpaceLeft(errno.ENOSPC, no_space_message(parent, needed))
    written = sum(directory_size(entry) for entry in parent.glob(".tmp-*") if entry.is_dir())
    return NoSpaceLeft(errno.ENOSPC, no_space_message(parent, written, at_least=True))




def file_digest(path: Path) -> str:
    """The sha256 of a file's bytes, in hex."""
    digest = hashlib.sha256()
    with open_regular_file(path) as file:
        while chunk := file.read(4 * MIB):
            digest.update(chunk)
    return digest.hexdigest()


def record_manifest(directory: Path) -> None:
    """Add to `directory`'s marker the size and sha256 of every file in it (its `files`, by relative path)."""
    marker = json.loads(read_regular_file(directory / MARKER, MAX_MARKER_BYTES))
    marker["files"] = {str(path.relative_to(directory)): {"size": path.stat().st_size, "sha256": file_digest(path)}
                       for path in sorted(directory.rglob("*")) if path.is_file() and path.name != MARKER}
    write_file(directory / MARKER, json.dumps(marker))


class DamagedCheckpoint(ValueError):
    """A checkpoint whose marker or files are not what dllm-ais wrote; the message names the file and the damage."""


SHA256 = re.compile(r"[0-9a-f]{64}")


def checkpoint_manifest(directory: Path, kind: str = "checkpoint") -> dict[str, tuple[int, str]]:
    """The files `directory`'s marker lists: relative name -> (size, sha256). The marker itself is checked first:
    DamagedCheckpoint when it is missing or unreadable, lacks its `files` (and, for a checkpoint — `kind` — its
    `run`), records another step than the directory's `checkpoint-N` name, or lists a malformed entry or a name
    outside the directory. What the marker lacks never switches verification off."""
    path = directory / MARKER
    marker = dllm_ais_record(path)
    if marker is None:
        raise DamagedCheckpoint(f"its marker {path} is missing or damaged (not a JSON record written by dllm-ais)")
    required = (("run", str), ("files", dict)) if kind == "checkpoint" else (("files", dict),)
    for field, field_type in required:
        if not isinstance(marker.get(field), field_type):
            raise DamagedCheckpoint(f"its marker {path} lacks a valid {field!r} field")
    match = CHECKPOINT_NAME.fullmatch(directory.name)
    if match and "step" in marker and marker["step"] != int(match.group(1)):
        raise DamagedCheckpoint(f"its marker {path} records step {marker['step']!r:.20}, not {match.group(1)}")
    manifest = {}
    for name, entry in marker["files"].items():
        size, digest = (entry.get("size"), entry.get("sha256")) if isinstance(entry, dict) else (None, None)
        if (Path(name).is_absolute() or ".." in Path(name).parts or name in BOOKKEEPING or type(size) is not int
                or size < 0 or not isinstance(digest, str) or not SHA256.fullmatch(digest)):
            raise DamagedCheckpoint(f"its marker {path} lists a malformed entry {name!r:.80}")
        manifest[name] = (size, digest)
    return manifest


def verified_bytes(path: Path, size: int, digest: str) -> bytes:
    """The bytes of the file at `path`, read once, when they have the `size` and sha256 `digest` its manifest
    records; DamagedCheckpoint naming the file otherwise."""
    try:
        data = read_regular_file(path, size)
    except FileNotFoundError:
        raise DamagedCheckpoint(f"{path} is missing") from None
    except FileTooLarge as error:
        raise DamagedCheckpoint(f"{path} is damaged ({error.size} bytes, {size} when written)") from None
    except OSError as error:
        raise DamagedCheckpoint(f"{path} is damaged (not a regular file: {error.strerror})") from None
    if len(data) != size:
        raise DamagedCheckpoint(f"{path} is damaged ({len(data)} bytes, {size} when written)")
    if hashlib.sha256(data).hexdigest() != digest:
        raise DamagedCheckpoint(f"{path} is damaged (its bytes changed since it was written)")
    return data


def read_verified(directory: str | Path) -> dict[str, bytes]:
    """Every file `directory`'s manifest lists, read once into memory and verified (`verified_bytes`): what a
    resume loads from, so that nothing is read again from disk after its check. DamagedCheckpoint otherwise."""
    directory = Path(directory)
    return {name: verified_bytes(directory / name, size, digest)
            for name, (size, digest) in checkpoint_manifest(directory).items()}


def verify_checkpoint(directory: str | Path, kind: str = "checkpoint") -> str | None:
    """Why `directory` (a checkpoint, or a run's final model with `kind` "final") is damaged — its marker (see
    `checkpoint_manifest`) or a file it lists that is missing, of another size or with other bytes than when it was
    written — or None when everything verifies. Files are checked one at a time (`verified_bytes`), so memory holds
    one file."""
    directory = Path(directory)
    try:
        for name, (size, digest) in checkpoint_manifest(directory, kind).items():
            verified_bytes(directory / name, size, digest)
    except DamagedCheckpoint as damage:
        return str(damage)
    return None


# ------------------------------------------------------------------------------------------ checkpoint-N directories
CHECKPOINT_NAME = re.compile(r"checkpoint-(\d+)")


def carries_marker(directory: Path) -> bool:
    """Whether `directory` (not a symlink) holds a marker file, readable or not: dllm-ais wrote it, perhaps since
    damaged (`checkpoint_manifest` tells)."""
    return directory.is_dir() and not directory.is_symlink() and (directory / MARKER).is_file()


def run_checkpoints(output_dir: str | Path, run_id: str | None = None) -> list[tuple[int, Path]]:
    """The `checkpoint-N` directories dllm-ais wrote in `output_dir`, oldest step first: those carrying a marker
    (`carries_marker`; a damaged one included, for resume to skip and name), or with `run_id` those whose readable
    marker names that run."""
    output_dir = Path(output_dir)
    found = []
    for entry in output_dir.iterdir() if output_dir.is_dir() else ():
        match = CHECKPOINT_NAME.fullmatch(entry.name)
        if match and carries_marker(entry) and (run_id is None or (provenance(entry) or {}).get("run") == run_id):
            found.append((int(match.group(1)), entry))
    return sorted(found)


def prune_checkpoints(output_dir: str | Path, run_id: str, keep: int, protect: str | Path | None = None) -> None:
    """`save_total_limit`: delete the oldest checkpoint-N directories this run wrote beyond the newest `keep`, never
    `protect` (the best checkpoint by validation score)."""
    protected = Path(protect).resolve() if protect is not None else None
    for _, path in run_checkpoints(output_dir, run_id)[:-keep]:
        if path.resolve() != protected:
            discard_directory(path)
