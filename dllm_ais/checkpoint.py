"""Run directories and checkpoints: atomic directory writes and their markers, saving, resuming and the best
record."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import re
import secrets
import shutil
import socket
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch
from accelerate.utils import gather_object, send_to_device
from peft import PeftModel

from dllm_ais.components import StepComponents
from dllm_ais.config import ConfigError, GRPOConfig, save_config
from dllm_ais.evaluation import EvalResult, per_prompt_values
from dllm_ais.loading import resolve_model_path
from dllm_ais.grpo import GenerationBatch, any_process
from dllm_ais.metrics import sync_logs_in
from dllm_ais.run_lock import LOCK_FILE, check_not_in_use, give_up_run_lock, hold_run_lock, holds_run_lock
from dllm_ais.validation import read_recipe, show

if TYPE_CHECKING:
    from dllm_ais.trainer import GRPOTrainer

# ------------------------------------------------------------------------------------------ safe directory writes
MARKER = ".dllm-ais.json"  # provenance file inside every directory dllm-ais writes; its proof of ownership
LEFTOVER_PREFIXES = (".tmp-", ".old-", ".trash-")
BOOKKEEPING = (MARKER, LOCK_FILE)  # files of dllm-ais' own in a directory, never counted as its contents
MIB = 1024 * 1024
TOKENED_LEFTOVER = re.compile(r"\.(tmp|trash)-.+-[0-9a-f]{8}")  # the names staging_directory / discard_directory give


class OutputExistsError(FileExistsError):
    """A destination is in the way (not empty, or not written by dllm-ais); the message names the way out."""


def dllm_ais_record(path: str | Path) -> dict[str, Any] | None:
    """The JSON object in the file at `path` when dllm-ais wrote it (its `written_by` says so); None otherwise."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("written_by") == "dllm-ais" else None


def provenance(directory: str | Path) -> dict[str, Any] | None:
    """The marker dllm-ais leaves in each directory it writes; None when absent or unreadable (not provably ours)."""
    return dllm_ais_record(Path(directory) / MARKER)


def is_leftover(entry: Path) -> bool:
    """A staging, displaced or half-deleted directory of an interrupted dllm-ais write: one carrying the marker, or
    an empty `.tmp-`/`.trash-<name>-<token>` one (a staging directory killed before its marker was written, or a
    deletion killed after its marker went: removing it loses nothing)."""
    if not (entry.name.startswith(LEFTOVER_PREFIXES) and entry.is_dir() and not entry.is_symlink()):
        return False
    return provenance(entry) is not None or (TOKENED_LEFTOVER.fullmatch(entry.name) is not None
                                             and not any(entry.iterdir()))


def describe_contents(directory: Path, limit: int = 4) -> str:
    names = sorted(e.name + ("/" if e.is_dir() else "") for e in directory.iterdir()
                   if not is_leftover(e) and e.name not in BOOKKEEPING)
    return ", ".join(names[:limit]) + (f", … ({len(names)} entries)" if len(names) > limit else "")


def check_destination(final: Path, overwrite: bool, flag: str = "--overwrite") -> None:
    """Raise OutputExistsError unless `final` may be written: absent, empty, or — with `overwrite` — a directory
    that dllm-ais wrote. Nothing else is ever replaced, so no command can delete what it did not create. A directory
    (or the parent of one) that a live run holds is refused whatever `overwrite` says."""
    check_not_in_use(final.parent)
    check_not_in_use(final)
    if not final.exists() or (final.is_dir() and not any(final.iterdir())):
        return
    if not final.is_dir():
        raise OutputExistsError(f"{final} is a file; choose a directory path that does not exist yet.")
    if not overwrite:
        raise OutputExistsError(f"{final} is not empty (holds {describe_contents(final)}); choose a new directory "
                                f"(e.g. {final / 'NAME'}) or pass {flag} to replace a directory that dllm-ais wrote.")
    marker = provenance(final)
    if marker is None:
        raise OutputExistsError(f"{final} holds files dllm-ais did not write ({describe_contents(final)}); {flag} only "
                                "replaces directories dllm-ais wrote. Choose a new directory or move this one away.")
    if marker.get("run_directory"):
        raise OutputExistsError(f"{final} is the output_dir of a training run (its checkpoints and metrics); {flag} "
                                "never replaces one. Choose a new directory.")


def fsync_directory(path: str | Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fsync_tree(root: Path) -> None:
    """Flush every file and directory under `root` to the disk (a rename is only durable after its content is)."""
    for directory, _, files in os.walk(root):
        for name in files:
            descriptor = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(descriptor)
            finally:
                os.close(descriptor)
        fsync_directory(directory)


def remove_directory(path: Path) -> None:
    """Delete a directory dllm-ais wrote, its marker last: a crash midway leaves a leftover still provably ours."""
    for child in path.iterdir():
        if child.name == MARKER:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()
    (path / MARKER).unlink(missing_ok=True)
    path.rmdir()


def discard_directory(path: Path, name: str | None = None) -> None:
    """Delete a directory dllm-ais wrote: first renamed to `.trash-<name>-*`, so it never stays half-deleted under
    a name that a resume or a leftover recovery would trust."""
    trash = path.with_name(f".trash-{name or path.name}-{secrets.token_hex(4)}")
    os.rename(path, trash)
    fsync_directory(path.parent)
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
    `.trash-*` is deleted. Only directories carrying dllm-ais' marker are touched, and empty ones (an interrupted
    deletion's last step)."""
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
        marker = provenance(entry)
        if marker is None:  # empty: see is_leftover
            entry.rmdir()
        elif prefix == "tmp" and _writer_is_running(marker):
            continue
        elif prefix == "old" and not (parent / target).exists():
            os.rename(entry, parent / target)
            fsync_directory(parent)
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
    (staging / MARKER).write_text(json.dumps(marker))
    return staging


def commit_staging(staging: Path, final: Path, overwrite: bool = False) -> None:
    """Make the finished `staging` directory `final` by renames only, after recording every file's size and hash in
    its marker (`verify_checkpoint` checks them) and flushing it — and the run's open JSONL logs — to disk.

    `final` may be absent or empty, or (with `overwrite`) a directory dllm-ais wrote: that one is first renamed to
    `.old-<name>` and deleted once the new copy is in place, so a complete copy always exists under one of the names.
    Nothing beside `final` is touched. On failure the staging directory is removed.
    """
    try:
        record_manifest(staging)
        fsync_tree(staging)
        sync_logs_in(final.parent)
        check_destination(final, overwrite)
        displaced = None
        if final.is_dir() and any(final.iterdir()):
            displaced = final.with_name(f".old-{final.name}")
            os.rename(final, displaced)
        elif final.is_dir():
            final.rmdir()
        os.rename(staging, final)
        fsync_directory(final.parent)
    except BaseException:
        if staging.exists():
            remove_directory(staging)
        raise
    if displaced is not None:
        discard_directory(displaced, final.name)


@contextmanager
def atomic_directory(final: str | Path, overwrite: bool = False, flag: str = "--overwrite") -> Iterator[Path]:
    """Yield a staging directory beside `final`; once the block has written everything, it becomes `final`.

    `final` must be absent or empty unless `overwrite` allows replacing a directory dllm-ais wrote (checked before
    the block runs, so a refused destination costs nothing); `flag` is how the user says "overwrite" in the error.
    A crash leaves `final` as it was plus a leftover that the next write to `final` cleans up; an exception removes
    the staging directory (a full disk is reported as `NoSpaceLeft`).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    clean_leftovers(final.parent, final.name)
    check_destination(final, overwrite, flag)
    with staged_directory(final, overwrite=overwrite) as staging:
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


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model")


def check_tokenizer_files(name_or_path: str) -> None:
    """Raise FileNotFoundError (one line, naming the directory and the fix) when `name_or_path` is a local model
    directory without tokenizer files — transformers would otherwise suggest installing sentencepiece or tiktoken."""
    path = Path(resolve_model_path(name_or_path))
    if not path.is_dir() or any((path / name).is_file() for name in TOKENIZER_FILES) or any(path.glob("*.tiktoken")):
        return
    raise FileNotFoundError(f"{path} holds no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...); copy its "
                            "base model's tokenizer there (tokenizer.save_pretrained(path)) or pass the base model.")


def file_digest(path: Path) -> str:
    """The sha256 of a file's bytes, in hex."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(4 * MIB):
            digest.update(chunk)
    return digest.hexdigest()


def record_manifest(directory: Path) -> None:
    """Add to `directory`'s marker the size and sha256 of every file in it (its `files`, by relative path)."""
    marker = json.loads((directory / MARKER).read_text())
    marker["files"] = {str(path.relative_to(directory)): {"size": path.stat().st_size, "sha256": file_digest(path)}
                       for path in sorted(directory.rglob("*")) if path.is_file() and path.name != MARKER}
    (directory / MARKER).write_text(json.dumps(marker))


def verify_checkpoint(directory: str | Path) -> str | None:
    """Why `directory` is damaged — a file its marker lists that is missing, of another size or with other bytes
    than when it was written — or None when every file verifies (or the marker predates manifests)."""
    directory = Path(directory)
    files = (provenance(directory) or {}).get("files")
    for name, expected in (files or {}).items():
        path = directory / name
        if not path.is_file():
            return f"{path} is missing"
        size = path.stat().st_size
        if size != expected["size"]:
            return f"{path} is damaged ({size} bytes, {expected['size']} when written)"
        if file_digest(path) != expected["sha256"]:
            return f"{path} is damaged (its bytes changed since it was written)"
    return None


def load_saved_weights(model: torch.nn.Module, directory: str | Path) -> None:
    """Load, in place, what `save_pretrained` wrote into `directory`: the adapter into a peft model, all weights
    (one file or shards) into a plain model. Every saved tensor must find its parameter; a parameter may only be
    missing from the files when it is tied to one that was loaded."""
    from safetensors.torch import load_file

    directory = Path(directory)
    if (directory / "adapter_config.json").is_file():
        from peft import set_peft_model_state_dict
        from peft.utils import load_peft_weights

        result = set_peft_model_state_dict(model, load_peft_weights(str(directory), device="cpu"))
        missing = []
    else:
        state: dict[str, torch.Tensor] = {}
        for file in sorted(directory.glob("model*.safetensors")):
            state.update(load_file(file))
        result = model.load_state_dict(state, strict=False)
        loaded = {p.data_ptr() for name, p in model.state_dict().items() if name in state}
        missing = [k for k in result.missing_keys if model.state_dict()[k].data_ptr() not in loaded]
    if result.unexpected_keys or missing:
        raise ValueError(f"{directory} does not match the model: unexpected {result.unexpected_keys[:5]}, "
                         f"missing {missing[:5]}.")


# ------------------------------------------------------------------------------------------ run directories
CHECKPOINT_NAME = re.compile(r"checkpoint-(\d+)")
RESUMABLE_CHANGES = frozenset({  # fields a resumed run may change: they do not alter the training trajectory
    "max_steps", "logging_steps", "save_steps", "save_total_limit", "output_dir", "overwrite_output_dir",
    "resume_from_checkpoint", "report_to", "run_name", "dry_run", "max_consecutive_skipped_batches", "eval_steps",
    "log_completions", "num_completions_to_print"})  # not eval_size: the held-out baseline is paired with the end
RUN_OUTPUTS = ("final",)  # directories a run writes besides its checkpoint-N
HELD_OUT_FILE = "held_out.json"  # the per-prompt held-out values of a finished run (`write_held_out`)
RUN_FILES = ("config.yaml", "metrics.jsonl", "metrics.png", "completions.jsonl", "best_checkpoint.json", HELD_OUT_FILE)


def run_checkpoints(output_dir: str | Path, run_id: str | None = None) -> list[tuple[int, Path]]:
    """The `checkpoint-N` directories dllm-ais wrote in `output_dir` (of run `run_id` if given), oldest step first."""
    output_dir = Path(output_dir)
    found = []
    for entry in output_dir.iterdir() if output_dir.is_dir() else ():
        match = CHECKPOINT_NAME.fullmatch(entry.name)
        marker = provenance(entry) if match and entry.is_dir() else None
        if marker is not None and (run_id is None or marker.get("run") == run_id):
            found.append((int(match.group(1)), entry))
    return sorted(found)


def prune_checkpoints(output_dir: str | Path, run_id: str, keep: int, protect: str | Path | None = None) -> None:
    """`save_total_limit`: delete the oldest checkpoint-N directories this run wrote beyond the newest `keep`, never
    `protect` (the best checkpoint by validation score)."""
    protected = Path(protect).resolve() if protect is not None else None
    for _, path in run_checkpoints(output_dir, run_id)[:-keep]:
        if path.resolve() != protected:
            discard_directory(path)


def resumable(directory: Path) -> bool:
    """A complete training checkpoint: written by dllm-ais, with the trainer state accelerate's save_state wrote."""
    return (provenance(directory) is not None and (directory / "custom_checkpoint_0.pkl").is_file()
            and (directory / "dllm_ais_config.yaml").is_file())


def newest_intact_checkpoint(output_dir: str | Path, before: int | None = None) -> tuple[Path | None, list[str]]:
    """The newest complete checkpoint-N in `output_dir` (with N < `before` if given) whose files verify, and why
    each newer one was skipped (one line each)."""
    skipped = []
    for step, path in reversed(run_checkpoints(output_dir)):
        if before is not None and step >= before:
            continue
        problem = "incomplete (no trainer state)" if not resumable(path) else verify_checkpoint(path)
        if problem is None:
            return path, skipped
        skipped.append(f"skipped {path}: {problem}")
    return None, skipped


def resume_checkpoint(config: GRPOConfig, report_skipped: bool = True) -> Path | None:
    """The checkpoint `resume_from_checkpoint` names (true = the newest checkpoint-N in output_dir that verifies;
    the damaged ones skipped are reported on stderr when `report_skipped`), checked to be a complete, intact
    dllm-ais checkpoint whose run the current config continues unchanged; None for a fresh run."""
    wanted = config.resume_from_checkpoint
    if wanted is None or wanted is False:
        return None
    if wanted is True:
        checkpoint, skipped = newest_intact_checkpoint(config.output_dir)
        if checkpoint is None:
            found = f" ({'; '.join(skipped)})" if skipped else ""
            raise ConfigError(f"resume_from_checkpoint=true: {config.output_dir} holds no intact checkpoint-N written "
                              f"by dllm-ais{found}. Pass a checkpoint directory, or start a fresh run without it.")
        for line in skipped if report_skipped else ():
            print(f"warning: resume_from_checkpoint=true {line}; resuming from {checkpoint}", file=sys.stderr)
    else:
        checkpoint = Path(wanted)
        if not resumable(checkpoint):
            raise ConfigError(f"resume_from_checkpoint={wanted}: not a complete dllm-ais training checkpoint (a "
                              "checkpoint-N directory written by `dllm-ais train`, with its trainer state).")
        if (problem := verify_checkpoint(checkpoint)) is not None:
            match = CHECKPOINT_NAME.fullmatch(checkpoint.name)
            previous = newest_intact_checkpoint(checkpoint.parent, int(match.group(1)))[0] if match else None
            fix = (f"resume from the previous intact checkpoint: --resume_from_checkpoint={previous}"
                   if previous is not None else "no earlier intact checkpoint exists; start a fresh run")
            raise ConfigError(f"resume_from_checkpoint={wanted}: {problem}; {fix}.")
    saved = read_recipe(checkpoint / "dllm_ais_config.yaml")
    defaults = GRPOConfig().to_dict()
    changed = [f"{name}: {show(saved.get(name, defaults[name]))} -> {show(value)}" for name, value in config.to_dict().items()
               if name not in RESUMABLE_CHANGES and saved.get(name, defaults[name]) != value]
    if changed:
        raise ConfigError(f"Cannot resume from {checkpoint}: these fields change the run (only "
                          f"{', '.join(sorted(RESUMABLE_CHANGES))} may change on resume):\n  - " + "\n  - ".join(changed)
                          + "\nResume with the run's own settings, or start a new run in another output_dir.")
    return checkpoint


def prepare_output_dir(config: GRPOConfig, is_main_process: bool = True) -> Path | None:
    """Take the run directory for this run and check, before anything loads, that it may write there; return the
    checkpoint to resume from (None for a fresh run).

    The main process first takes `output_dir`'s exclusive lock (`dllm_ais.run_lock`), held until the process ends:
    a second run, a resume or an export into a directory a live run holds is refused with the holder's pid and host.
    A refused run gives the lock up and leaves nothing it created behind.

    A resumed run continues in its own directory. A fresh run needs an empty `output_dir`, or
    `overwrite_output_dir=true`: then the `checkpoint-N/` and `final/` that dllm-ais wrote there are discarded (so a
    later `resume_from_checkpoint=true` can never pick up a stale one) and the run's files (`RUN_FILES`) are
    rewritten — only when the directory itself carries the marker of an earlier run; nothing else in the directory
    is touched. Every process checks; only the main process changes the directory (it first cleans the leftovers of
    interrupted writes, then marks the directory as a run's).
    """
    output_dir = Path(config.output_dir)
    if not is_main_process:
        return _check_output_dir(config, is_main_process)
    if holds_run_lock(output_dir):  # an earlier run of this process took it
        return _check_output_dir(config, is_main_process)
    existed = output_dir.is_dir()
    created_lock = hold_run_lock(output_dir)
    try:
        return _check_output_dir(config, is_main_process)
    except BaseException:
        give_up_run_lock(output_dir, created_lock)
        if not existed and output_dir.is_dir() and not any(output_dir.iterdir()):
            output_dir.rmdir()
        raise


def _check_output_dir(config: GRPOConfig, is_main_process: bool) -> Path | None:
    """`prepare_output_dir` once the main process holds the lock."""
    output_dir = Path(config.output_dir)
    checkpoint = resume_checkpoint(config, report_skipped=is_main_process)
    present = sorted(e for e in output_dir.iterdir() if not is_leftover(e) and e.name not in BOOKKEEPING) \
        if output_dir.is_dir() else []
    continues_here = checkpoint is not None and checkpoint.parent.resolve() == output_dir.resolve()
    if present and not continues_here and not config.overwrite_output_dir:
        replace = "--overwrite_output_dir=true to replace the outputs dllm-ais wrote there"
        ways = (f"--resume_from_checkpoint=true to continue its run, {replace}" if run_checkpoints(output_dir)
                else f"{replace} (it holds no checkpoint-N for --resume_from_checkpoint)")
        raise ConfigError(f"output_dir {output_dir} is not empty (holds {describe_contents(output_dir)}). Pass {ways}, "
                          "or choose another --output_dir.")
    ours = {path for _, path in run_checkpoints(output_dir)} | {output_dir / n for n in RUN_OUTPUTS}
    foreign = [e.name for e in present if (CHECKPOINT_NAME.fullmatch(e.name) or e.name in RUN_OUTPUTS)
               and provenance(e) is None]
    if provenance(output_dir) is None:
        foreign += [e.name for e in present if e.name in RUN_FILES]
    if foreign:
        raise ConfigError(f"output_dir {output_dir} holds {', '.join(foreign)} that dllm-ais did not write; the run "
                          "would replace them. Move them away or choose another --output_dir.")
    if is_main_process:
        clean_leftovers(output_dir)
        if not continues_here:
            for path in sorted(p for p in ours if p.is_dir()):
                discard_directory(path)
            (output_dir / HELD_OUT_FILE).unlink(missing_ok=True)  # the replaced run's mark of having finished
        output_dir.mkdir(parents=True, exist_ok=True)
        if provenance(output_dir) is None:
            (output_dir / MARKER).write_text(json.dumps({"written_by": "dllm-ais", "run_directory": True}))
            fsync_directory(output_dir)
    return checkpoint


# ------------------------------------------------------------------------------------------ saving and resuming a run
BEST_CHECKPOINT_FILE = "best_checkpoint.json"


class NonFiniteError(FloatingPointError):
    """Training stopped: `max_consecutive_skipped_batches` batches in a row were non-finite, or weights to be saved are."""


def atomic_write_text(path: Path, text: str) -> None:
    """Replace the file at `path` with `text` by one rename: readers see the old content or the new, never a part."""
    staging = path.with_name(f".tmp-{path.name}")
    staging.write_text(text)
    os.replace(staging, path)


def write_held_out(output_dir: str | Path, before: EvalResult | None, after: EvalResult) -> Path:
    """Write `held_out.json` into a finished run's `output_dir`: the per-prompt values (`per_prompt_values`) of its
    final held-out evaluation (`after`) and of its baseline (`before`; null for a resumed run that turned evaluation
    on). Written last, in one rename: its presence marks a finished run, and `dllm-ais compare` pairs runs prompt by
    prompt through it."""
    path = Path(output_dir) / HELD_OUT_FILE
    atomic_write_text(path, json.dumps({"after": per_prompt_values(after),
                                        "before": None if before is None else per_prompt_values(before)}) + "\n")
    return path


def read_held_out(output_dir: str | Path) -> dict | None:
    """The `held_out.json` of a finished run (see `write_held_out`); None when the run has not finished."""
    path = Path(output_dir) / HELD_OUT_FILE
    return json.loads(path.read_text()) if path.is_file() else None


class TrainingProgress:
    """What a checkpoint needs besides weights, optimizer, scheduler and the global RNGs (accelerate saves those):
    the trainer's counters (steps, generation batches, tokens seen), prompt order and cursor, the α EMA, the adaptive
    rollout fidelity's rung and calm-batch count, the held-out baseline, the best validation score so far (TRL's
    `best_metric`, `best_global_step`, `best_model_checkpoint`), the skip counters, the completion samples not yet
    logged and the generation batch in flight on every process (each holds its own prompts' rollouts). The samplers'
    and estimators' generators are seeded from `generation_index`.

    This is the object `accelerator.register_for_checkpointing` stores (state_dict / load_state_dict); it holds
    tensors and plain values only, so resuming can check the file loads with `torch.load(weights_only=True)`.
    accelerate writes it from the main process only, so `state_dict` (called on every process) gathers the batches.
    """

    FIELDS = ("run_id", "global_step", "generation_index", "previous_alpha", "rollout_fidelity_state", "prompt_order",
              "prompt_cursor", "batch_iteration", "skipped_batches", "consecutive_skipped_batches",
              "num_input_tokens_seen", "best_metric", "best_global_step", "best_model_checkpoint", "completion_samples")

    ADDED_LATER = {"rollout_fidelity_state": {"level": 0, "calm_batches": 0}}
    """Fields that checkpoints written before them lack, with the value that run had (so they still resume)."""

    def __init__(self, trainer: "GRPOTrainer"):
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        batch, eval_before = self.trainer.batch, self.trainer.eval_before
        batches = [None if batch is None else send_to_device(batch.state_dict(), "cpu")]
        if self.trainer.accelerator.num_processes > 1:
            batches = gather_object(batches)
        return {**{name: getattr(self.trainer, name) for name in self.FIELDS}, "batches": batches,
                "eval_before": None if eval_before is None else eval_before.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in self.FIELDS:
            setattr(self.trainer, name, state[name] if name in state else self.ADDED_LATER[name])
        batch, eval_before = state["batches"][self.trainer.accelerator.process_index], state["eval_before"]
        self.trainer.batch = None if batch is None else GenerationBatch.from_state_dict(batch, self.trainer.accelerator.device)
        self.trainer.eval_before = None if eval_before is None else EvalResult.from_state_dict(eval_before)


class Checkpointer:
    """Saving and resuming one training run in `config.output_dir`: the model directory (`save_model`), resumable
    `checkpoint-N` directories (`save_checkpoint`, `resume`) and the best-score record (`write_best_record`).

    It registers `TrainingProgress(trainer)` and the weight hooks with accelerate, so `save_state` / `load_state`
    carry the trainer's progress and leave the weights to save_pretrained's files."""

    def __init__(self, config: GRPOConfig, parts: StepComponents, tokenizer, trainer: "GRPOTrainer"):
        self.config, self.parts, self.tokenizer, self.trainer = config, parts, tokenizer, trainer
        self.output_dir = Path(config.output_dir)
        self.last_checkpoint: tuple[int, Path] | None = None
        parts.accelerator.register_save_state_pre_hook(self._leave_weights_to_save_pretrained)
        parts.accelerator.register_load_state_pre_hook(self._load_weights_from_save_pretrained)
        parts.accelerator.register_for_checkpointing(TrainingProgress(trainer))

    def write_best_record(self) -> None:
        """`output_dir/best_checkpoint.json`: the best validation score so far, its step, and the directory holding
        the weights of that step (a checkpoint-N, final/ when the last step scored best, or null when that step was
        not saved). Written atomically; without a score yet, a record an earlier run left there is removed."""
        path, run = self.output_dir / BEST_CHECKPOINT_FILE, self.trainer
        if run.best_global_step is None:
            if dllm_ais_record(path) is not None:
                path.unlink()
            return
        record = {"written_by": "dllm-ais", "run": run.run_id, "metric_for_best_model": self.config.best_metric_key,
                  "greater_is_better": self.config.greater_is_better, "best_metric": run.best_metric,
                  "best_global_step": run.best_global_step, "best_model_checkpoint": run.best_model_checkpoint}
        atomic_write_text(path, json.dumps(record, indent=2) + "\n")

    def checked_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict to save (a collective under FSDP / ZeRO-3: every process calls this); raises
        NonFiniteError when a trainable weight is NaN or inf, so nothing non-finite is ever written."""
        accelerator = self.parts.accelerator
        accelerator.wait_for_everyone()
        local = [p.to_local() if hasattr(p, "to_local") else p for p in self.parts.trainable_parameters]
        if any_process(accelerator, not all(torch.isfinite(p).all() for p in local))[0]:
            raise NonFiniteError(f"refusing to save non-finite weights at step {self.trainer.global_step}; the last "
                                 "checkpoint holds finite ones.")
        return accelerator.get_state_dict(self.parts.model)

    def write_model(self, directory: Path, state_dict: dict[str, torch.Tensor]) -> None:
        """The adapter (or full model) via save_pretrained, the tokenizer and the config: a directory that
        `dllm-ais eval --model`, `generate` and `export` load."""
        model = self.parts.unwrapped_model
        # The vocabulary is never resized here; peft's "auto" would look the base model up on the Hub to check.
        peft_only = {"save_embedding_layers": False} if isinstance(model, PeftModel) else {}
        model.save_pretrained(directory, state_dict=state_dict, safe_serialization=True, **peft_only)
        self.tokenizer.save_pretrained(directory)
        save_config(self.config, directory / "dllm_ais_config.yaml")

    def save_model(self, directory: Path) -> None:
        """Write the model directory (see `write_model`) atomically into `directory`."""
        state_dict = self.checked_state_dict()
        if self.parts.accelerator.is_main_process:
            with atomic_directory(directory, overwrite=True) as staging:
                self.write_model(staging, state_dict)

    def save_checkpoint(self, validation: dict[str, float] | None = None) -> Path:
        """Write `output_dir/checkpoint-<step>` atomically: the model directory plus accelerate's `save_state`
        (optimizer, scheduler, every process' RNGs and `TrainingProgress`), from which `resume` continues the run
        exactly; then keep only the newest `save_total_limit` checkpoints of this run (and the best one). The
        directory's marker records the step's `validation` scores when it was scored."""
        run, accelerator = self.trainer, self.parts.accelerator
        directory = self.output_dir / f"checkpoint-{run.global_step}"
        if self.last_checkpoint is not None and self.last_checkpoint[0] == run.global_step:
            return self.last_checkpoint[1]
        if run.best_global_step == run.global_step:
            run.best_model_checkpoint = str(directory)
        state_dict = self.checked_state_dict()
        with staged_directory(directory, run.run_id[:8], accelerator.is_main_process, overwrite=True,
                              run=run.run_id, step=run.global_step, validation=validation) as staging:
            if accelerator.is_main_process:
                self.write_model(staging, state_dict)
            accelerator.wait_for_everyone()
            accelerator.save_state(str(staging))
            accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            if self.config.save_total_limit:
                prune_checkpoints(self.output_dir, run.run_id, self.config.save_total_limit,
                                  protect=run.best_model_checkpoint)
            self.write_best_record()
        accelerator.wait_for_everyone()
        self.last_checkpoint = (run.global_step, directory)
        return directory

    def saved_now(self) -> bool:
        """Whether a checkpoint of the current step exists."""
        return self.last_checkpoint is not None and self.last_checkpoint[0] == self.trainer.global_step

    def resume(self, checkpoint: Path, num_prompts: int) -> None:
        """Restore what `save_checkpoint` wrote: weights, optimizer, scheduler, RNGs and the trainer's progress;
        the run must have `num_prompts` training prompts, as the checkpoint's did."""
        accelerator = self.parts.accelerator
        for file in sorted(checkpoint.glob("custom_checkpoint_*.pkl")):
            try:  # accelerate unpickles this file without restriction: first make sure it holds only data
                torch.load(file, weights_only=True)
            except pickle.UnpicklingError as error:
                raise ConfigError(f"{file} holds more than tensors and plain values; refusing to resume from it "
                                  f"({error}).") from error
        written_by = len(list(checkpoint.glob("random_states_*.pkl")))  # accelerate writes one per process
        if written_by != accelerator.num_processes:
            raise ConfigError(f"Cannot resume from {checkpoint}: it was written by {written_by} process(es), this run "
                              f"has {accelerator.num_processes}; launch it with --num_processes {written_by}.")
        accelerator.load_state(str(checkpoint))
        trained_on = len(self.trainer.prompt_order)
        if trained_on != num_prompts:
            raise ConfigError(f"Cannot resume from {checkpoint}: it was trained on {trained_on} prompts, "
                              f"the dataset now has {num_prompts}.")
        self.last_checkpoint = (self.trainer.global_step, checkpoint)

    def _leave_weights_to_save_pretrained(self, models, weights, output_dir) -> None:
        """accelerate's save_state hook: it would store the full state dict (a LoRA run's frozen base included); the
        checkpoint's save_pretrained files hold the weights instead. (Under FSDP and DeepSpeed accelerate writes
        and reads its own model files and passes no state dicts.)"""
        weights.clear()

    def _load_weights_from_save_pretrained(self, models, input_dir) -> None:
        """accelerate's load_state hook, the counterpart of `_leave_weights_to_save_pretrained`."""
        if models:
            load_saved_weights(self.parts.unwrapped_model, input_dir)
            models.clear()
