"""Graceful interruption: Ctrl-C or SIGTERM (what a scheduler sends) ends a run after its current optimisation step,
with a checkpoint to resume from; a second signal exits at once. Ctrl-C while a resumed run loads its checkpoint
says so (`loading_checkpoint`): loading changes nothing on disk, and a branch's later steps moved aside before it
are named (`checkpoints_left`)."""

from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingInterrupted(Exception):
    """A run stopped on a signal after saving its state: `checkpoint` is None when no step had been taken yet."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None):
        self.signal, self.step, self.checkpoint = signum, step, checkpoint
        where = f"; checkpoint: {checkpoint}" if checkpoint else "; no step taken, nothing saved"
        super().__init__(f"interrupted by {signal.Signals(signum).name} at step {step}{where}")

    @property
    def exit_code(self) -> int:
        """The shell's convention for death by a signal: 128 + its number (130 for SIGINT, 143 for SIGTERM)."""
        return 128 + self.signal


SET_ASIDE: dict[Path, Path] = {}  # run directory -> where this process moved the later steps a resume left


def note_set_aside(output_dir: Path, directory: Path) -> None:
    """Record that this process moves the checkpoints of the later steps a resume in `output_dir` leaves into
    `directory` (`dllm_ais.checkpoint_choice.set_abandoned_steps_aside`), so that a Ctrl-C before the first step names it."""
    SET_ASIDE[Path(output_dir).resolve()] = directory


def checkpoints_left(output_dir: Path) -> str:
    """What a Ctrl-C before the first step of a run resumed in `output_dir` leaves: every checkpoint as it was
    (loading only reads), or, once this process moved the later steps of a branch aside, where they are."""
    directory = SET_ASIDE.get(Path(output_dir).resolve())
    if directory is None:
        return "the checkpoints are intact"
    return f"the checkpoints of the later steps this resume leaves are in {directory}, the others are intact"


class InterruptedWhileLoading(KeyboardInterrupt):
    """Ctrl-C while a resumed run loaded `checkpoint`, before its first step: the checkpoints are as they were (or
    where `checkpoints_left` says) and the same resume starts again."""

    def __init__(self, checkpoint: Path):
        self.checkpoint = checkpoint
        super().__init__(f"interrupted while loading {checkpoint}; {checkpoints_left(checkpoint.parent)}")


@contextmanager
def loading_checkpoint(checkpoint: Path):
    """Turn a KeyboardInterrupt (Ctrl-C) inside the block, which loads `checkpoint`, into InterruptedWhileLoading."""
    try:
        yield
    except InterruptedWhileLoading:
        raise
    except KeyboardInterrupt:
        raise InterruptedWhileLoading(checkpoint) from None


@contextmanager
def noting_ctrl_c():
    """Within the block, note each SIGINT (Ctrl-C) in the list it yields, then pass it on to the handler in place
    (Python's raises KeyboardInterrupt, training's `StopSignals` records a stop); so a KeyboardInterrupt leaving the
    block with the list empty was raised by the code inside, not by the user. Nothing is installed outside the main
    thread (signals are delivered there only) or where SIGINT has no Python handler (ignored, or the default)."""
    received: list[int] = []
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(previous):
        yield received
        return

    def note(signum: int, frame) -> None:
        received.append(signum)
        previous(signum, frame)

    signal.signal(signal.SIGINT, note)
    try:
        yield received
    finally:
        signal.signal(signal.SIGINT, previous)


class StopSignals:
    """Context manager: while active, the first SIGINT/SIGTERM is only recorded in `received` (the training loop
    finishes its step, checkpoints and stops); a second one exits the process at once with 128 + its number.

    Handlers are installed only from the main thread (Python delivers signals there) and restored on exit.
    """

    def __init__(self):
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            self._previous = {signum: signal.signal(signum, self._handle) for signum in STOP_SIGNALS}
        return self

    def __exit__(self, *exc_info) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            print(f"\n{name} again: exiting now, without a checkpoint", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(128 + signum)
        self.received = signum
        print(f"\n{name}: finishing the current optimisation step, then writing a checkpoint "
              "(send it again to exit at once)", file=sys.stderr, flush=True)
