"""Which checkpoint a run resumes from and whether it may write its output directory: `prepare_output_dir` takes the
run directory (its lock, the checks on what it holds) and returns the checkpoint to resume from (`resume_checkpoint`:
complete, intact and of a run the config continues unchanged); a resume from an earlier step sets the later ones
aside (`set_abandoned_steps_aside`). A finished run's `held_out.json` (`write_held_out`, `read_held_out`) marks it
finished. The files a run writes are named here; `dllm_ais.checkpoint` writes and loads the checkpoints themselves.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any

from dllm_ais.config import ConfigError, GRPOConfig, changed_settings
from dllm_ais.evaluation import EvalResult, held_out_record, result_identity
from dllm_ais.interruption import note_set_aside
from dllm_ais.run_dir import (BOOKKEEPING, CHECKPOINT_NAME, MARKER, RUN_OUTPUTS, carries_marker, checkpoint_manifest,
                              clean_leftovers, describe_contents, directory_kind, discard_directory, fsync_tree,
                              is_leftover, link_refusal, provenance, run_checkpoints, verify_checkpoint)
from dllm_ais.run_lock import give_up_run_lock, hold_run_lock, holds_run_lock
from dllm_ais.safe_files import copy_regular_file, read_regular_file, sync_directory, write_file
from dllm_ais.safe_json import loads_bounded

RESUMABLE_CHANGES = frozenset({  # fields a resumed run may change: they do not alter the training trajectory
    "max_steps", "logging_steps", "save_steps", "save_total_limit", "output_dir", "overwrite_output_dir",
    "resume_from_checkpoint", "report_to", "run_name", "dry_run", "max_consecutive_skipped_batches", "eval_steps",
    "log_completions", "num_completions_to_print"})  # not eval_size: the held-out baseline is paired with the end
HELD_OUT_FILE = "held_out.json"  # the per-prompt held-out values of a finished run (`write_held_out`)
MAX_HELD_OUT_BYTES, MAX_HELD_OUT_DEPTH = 1 << 30, 4  # it holds a few numbers per held-out prompt
RUN_FILES = ("config.yaml", "metrics.jsonl", "metrics.png", "completions.jsonl", "best_checkpoint.json", HELD_OUT_FILE)
BEST_CHECKPOINT_FILE = "best_checkpoint.json"
RUN_STATE_FILE = "custom_checkpoint_0.pkl"  # the name accelerate's register_for_checkpointing gave it
CONFIG_FILE = "dllm_ais_config.yaml"
RESUME_FILES = (RUN_STATE_FILE, CONFIG_FILE)


def checkpoint_problem(directory: Path) -> str | None:
    """Why `directory` cannot be resumed — its marker or a file damaged (`verify_checkpoint`), or the manifest
    missing the trainer state or the config — or None."""
    if (problem := verify_checkpoint(directory)) is not None:
        return problem
    missing = [name for name in RESUME_FILES if name not in checkpoint_manifest(directory)]
    return f"incomplete (no {', '.join(missing)})" if missing else None


def newest_intact_checkpoint(output_dir: str | Path, before: int | None = None) -> tuple[Path | None, list[str]]:
    """The newest complete checkpoint-N in `output_dir` (with N < `before` if given) whose marker and files verify,
    and why each newer one was skipped (one line each)."""
    skipped = []
    for step, path in reversed(run_checkpoints(output_dir)):
        if before is not None and step >= before:
            continue
        problem = checkpoint_problem(path)
        if problem is None:
            return path, skipped
        skipped.append(f"skipped {path}: {problem}")
    return None, skipped


START_AFRESH = ("start afresh: drop --resume_from_checkpoint and pass --overwrite_output_dir=true (replaces what "
                "dllm-ais wrote in output_dir), or choose another --output_dir")  # what `_check_output_dir` accepts


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
                              f"by dllm-ais{found}. Pass a checkpoint directory, or {START_AFRESH}.")
        for line in skipped if report_skipped else ():
            print(f"warning: resume_from_checkpoint=true {line}; resuming from {checkpoint}", file=sys.stderr)
    else:
        checkpoint = Path(wanted)
        if not carries_marker(checkpoint):
            raise ConfigError(f"resume_from_checkpoint={wanted}: not a dllm-ais training checkpoint (a "
                              "checkpoint-N directory written by `dllm-ais train`, with its trainer state).")
        if (problem := checkpoint_problem(checkpoint)) is not None:
            match = CHECKPOINT_NAME.fullmatch(checkpoint.name)
            previous = newest_intact_checkpoint(checkpoint.parent, int(match.group(1)))[0] if match else None
            fix = (f"resume from the previous intact checkpoint: --resume_from_checkpoint={previous}"
                   if previous is not None else f"no earlier intact checkpoint exists; {START_AFRESH}")
            raise ConfigError(f"resume_from_checkpoint={wanted}: {problem}; {fix}.")
    changed = changed_settings(checkpoint / CONFIG_FILE, config, RESUMABLE_CHANGES)
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

    A resumed run continues in its own directory; the later steps of a branch of its history that it leaves are set
    aside, kept (`set_abandoned_steps_aside`). A fresh run needs an empty `output_dir`, or
    `overwrite_output_dir=true`: then the `checkpoint-N/` and `final/` that dllm-ais wrote there are discarded (so a
    later `resume_from_checkpoint=true` can never pick up a stale one) and the run's files (`RUN_FILES`) are
    rewritten — only when the directory itself carries the marker of an earlier run; nothing else in the directory
    is touched. Every process checks; only the main process changes the directory (it first cleans the leftovers of
    interrupted writes, then marks the directory as a run's).

    An `output_dir` that is itself a symbolic link (a run folder kept on another disk) is followed once, here: the
    run writes to its target, named in one line (`follow_output_dir_link`). Links inside the run are refused.
    """
    output_dir = follow_output_dir_link(config, report=is_main_process)
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


def follow_output_dir_link(config: GRPOConfig, report: bool = True) -> Path:
    """`config.output_dir`, resolved once when it is a symbolic link — the run then writes to the link's target,
    and `config.output_dir` names that target from here on (one line on stderr says so when `report`); as given
    otherwise. ConfigError when the link does not resolve (a loop)."""
    named = Path(config.output_dir)
    if not named.is_symlink():
        return named
    try:
        target = named.resolve(strict=False)
    except (OSError, RuntimeError) as error:
        raise ConfigError(f"output_dir {named} is a link that does not resolve ({error}); point it at a directory, "
                          "or choose another --output_dir.") from None
    if report:
        print(f"output_dir {named} is a link: writing to its target {target}", file=sys.stderr)
    config.output_dir = str(target)
    return target


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
    linked = [e for e in present if e.is_symlink() and (CHECKPOINT_NAME.fullmatch(e.name) or e.name in RUN_OUTPUTS)]
    if linked:
        raise ConfigError(link_refusal(linked[0]))
    foreign = [e.name for e in present if (CHECKPOINT_NAME.fullmatch(e.name) and (
                   not carries_marker(e) or directory_kind(e) not in (None, "checkpoint")))
               or (e.name in RUN_OUTPUTS and directory_kind(e) != "final")]
    if provenance(output_dir) is None:
        foreign += [e.name for e in present if e.name in RUN_FILES]
    odd = [e.name for e in present if e.name in RUN_FILES and (e.is_symlink() or not e.is_file())]
    if odd:
        raise ConfigError(f"output_dir {output_dir} holds {', '.join(odd)} that is not a regular file (a directory or "
                          "a link) where the run writes that file. Move it away or choose another --output_dir.")
    if foreign:
        raise ConfigError(f"output_dir {output_dir} holds {', '.join(foreign)} that dllm-ais did not write; the run "
                          "would replace them. Move them away or choose another --output_dir.")
    if is_main_process:
        clean_leftovers(output_dir)
        if not continues_here:
            for path in sorted(p for p in ours if p.is_dir()):
                discard_directory(path)
            (output_dir / HELD_OUT_FILE).unlink(missing_ok=True)  # the replaced run's mark of having finished
        else:
            set_abandoned_steps_aside(output_dir, checkpoint)
        output_dir.mkdir(parents=True, exist_ok=True)
        if provenance(output_dir) is None:
            write_file(output_dir / MARKER, json.dumps({"written_by": "dllm-ais", "run_directory": True}))
    return checkpoint


def checkpoint_step(checkpoint: Path) -> int | None:
    """The step of a checkpoint directory: N of its `checkpoint-N` name, else the step its marker records."""
    match = CHECKPOINT_NAME.fullmatch(checkpoint.name)
    step = int(match.group(1)) if match else (provenance(checkpoint) or {}).get("step")
    return step if isinstance(step, int) else None


def set_abandoned_steps_aside(output_dir: Path, checkpoint: Path) -> Path | None:
    """Before a run continues in `output_dir` from `checkpoint` (step N): when checkpoints of later steps are there
    (resumed from an earlier checkpoint, or newer ones skipped as damaged), those steps are a branch of the run's
    history that this resume leaves: it is kept, never deleted and never resumed from here. Its checkpoint-M
    (M > N), its final/ (when written after step N) and held_out.json are moved, and the run's other files
    (metrics.jsonl, completions.jsonl, ...) copied as they are, into `abandoned-after-step-N-<time>/`, named in one
    line on stderr; the run's logs then continue from step N. Returns that directory (None when nothing is later:
    a resume from the newest checkpoint only redoes the steps after it that no checkpoint saved)."""
    step = checkpoint_step(checkpoint)
    moved = [path for number, path in run_checkpoints(output_dir) if step is not None and number > step]
    if not moved:
        return None
    for name in RUN_OUTPUTS:
        written_at = (provenance(output_dir / name) or {}).get("step")  # none recorded: written by an older version
        if (output_dir / name).is_dir() and (not isinstance(written_at, int) or written_at > step):
            moved.append(output_dir / name)
    if (output_dir / HELD_OUT_FILE).is_file():
        moved.append(output_dir / HELD_OUT_FILE)  # the mark of the finished branch
    aside = output_dir / f"abandoned-after-step-{step}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    aside.mkdir()
    note_set_aside(output_dir, aside)
    for name in RUN_FILES:
        path = output_dir / name
        if name != HELD_OUT_FILE and path.is_file() and not path.is_symlink():
            copy_regular_file(path, aside / name)
    for path in moved:
        os.rename(path, aside / path.name)
    fsync_tree(aside)
    sync_directory(output_dir)
    print(f"warning: resuming from {checkpoint} leaves the later steps of this run behind: "
          f"{', '.join(path.name for path in moved)} and the run's logs are kept in {aside} (never resumed from "
          "here; resume from one of them into another --output_dir to go on with that branch)", file=sys.stderr)
    return aside


def write_held_out(config: GRPOConfig, held_out, before: EvalResult | None, after: EvalResult) -> Path:
    """Write `held_out.json` into a finished run's `output_dir`: `held_out_record` — what made the result (`config`
    and the `held_out` prompts, `result_identity`) and the per-prompt values of its final held-out evaluation
    (`after`) and baseline (`before`). Written last, in one rename: its presence marks a finished run, and `dllm-ais
    compare` reuses the run when its identity is the planned one, pairing runs prompt by prompt through it."""
    path = Path(config.output_dir) / HELD_OUT_FILE
    write_file(path, json.dumps(held_out_record(result_identity(config, held_out), before, after)) + "\n")
    return path


def read_held_out(output_dir: str | Path) -> Any:
    """The parsed `held_out.json` of a finished run (see `write_held_out`), read through no link and bounded in size
    and nesting; None when the run has not finished. OSError when it is not a regular file (FileTooLarge when over
    `MAX_HELD_OUT_BYTES`), ValueError when it is not JSON."""
    path = Path(output_dir) / HELD_OUT_FILE
    if not os.path.lexists(path):
        return None
    return loads_bounded(read_regular_file(path, MAX_HELD_OUT_BYTES), MAX_HELD_OUT_BYTES, MAX_HELD_OUT_DEPTH)
