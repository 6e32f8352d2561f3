"""One writer per run directory, self-verifying checkpoints, metrics that keep every valid line on resume, full
disks, and one-line errors naming the file for bad inputs (issue 14)."""

import dataclasses
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from dllm_ais.checkpoint_choice import prepare_output_dir, resume_checkpoint
from dllm_ais.run_dir import (NoSpaceLeft, begin_staging, check_destination, clean_leftovers, commit_staging,
                              staged_directory, verify_checkpoint)
from dllm_ais.cli import main
from dllm_ais.config import ConfigError, GRPOConfig
from dllm_ais.console import printable
from dllm_ais.metrics import MetricsLog
from dllm_ais.run_lock import LOCK_FILE, RunDirectoryInUse, hold_run_lock, release_run_lock

ERROR_LINES = 2  # what a refused command may print on stderr at most


@pytest.fixture
def live_holder(tmp_path):
    """Another process holding the lock of `tmp_path / "run"` (as a live `dllm-ais train` does); killed after."""
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from dllm_ais.run_lock import hold_run_lock; "
                               f"hold_run_lock({str(run)!r}); print('held', flush=True); time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    yield run, holder
    holder.kill()
    holder.wait()


def test_a_live_runs_directory_is_refused_to_every_writer_and_free_once_it_dies(live_holder, capsys):
    run, holder = live_holder
    where = f"pid {holder.pid} on host {socket.gethostname()}"
    for overrides in ([], ["--resume_from_checkpoint=true"], ["--overwrite_output_dir=true"]):
        assert main(["train", f"--output_dir={run}", *overrides]) == 2
        error = capsys.readouterr().err.strip()
        assert len(error.splitlines()) == 1 and "in use by a live dllm-ais run" in error and where in error, error
    for destination in (run, run / "final"):  # export --overwrite / sft into the run, or into its final/
        with pytest.raises(RunDirectoryInUse, match=f"pid {holder.pid}"):
            check_destination(destination, overwrite=True)
    holder.send_signal(signal.SIGKILL)  # kill -9: the kernel drops the lock, nothing stale remains
    holder.wait()
    config = GRPOConfig(output_dir=str(run))
    assert prepare_output_dir(config) is None
    release_run_lock(run)


def test_a_refused_run_leaves_nothing_behind(tmp_path):
    config = GRPOConfig(output_dir=str(tmp_path / "new"), resume_from_checkpoint=True)
    with pytest.raises(ConfigError, match="no intact checkpoint"):
        prepare_output_dir(config)
    assert not (tmp_path / "new").exists()


def recorded_holder(run) -> int | None:
    """The pid in `run`'s lock record (written by the run holding its lock), None before there is one."""
    try:
        return json.loads((run / LOCK_FILE).read_text())["pid"]
    except (OSError, ValueError):
        return None


@pytest.mark.slow  # two training processes at once
def test_two_trains_started_together_one_refuses_and_the_metrics_are_one_runs(tmp_path):
    """Both start at once and race for the lock. On a loaded machine one may lag the other by a whole (short) run,
    and then meets a finished run's directory instead of a live one: the first to hold the lock is suspended until
    the other has ended, so the other always meets the live run."""
    run = tmp_path / "run"
    command = [sys.executable, "-m", "dllm_ais.cli", "train", f"--output_dir={run}", "--max_steps=2", "--eval_size=4",
               "--per_device_train_batch_size=8"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = [subprocess.Popen([*command, f"--seed={seed}"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                             text=True, env=env) for seed in (1, 2)]
    holder = None
    while holder is None and any(process.poll() is None for process in runs):
        holder = next((process for process in runs if process.pid == recorded_holder(run)), None)
        time.sleep(0.05)
    if holder is not None and holder.poll() is None:
        psutil.Process(holder.pid).suspend()
        try:
            next(process for process in runs if process is not holder).wait(timeout=600)
        finally:
            psutil.Process(holder.pid).resume()
    errors = [process.communicate(timeout=600)[1] for process in runs]
    results = [(process.returncode, error) for process, error in zip(runs, errors)]
    assert sorted(code for code, _ in results) == [0, 2], results
    refused = next(err for code, err in results if code == 2)
    assert "in use by a live dllm-ais run" in refused and len(refused.strip().splitlines()) <= ERROR_LINES, refused
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2], records


RAW_LOCK_HOLDER = ("import fcntl, os, sys, time; descriptor = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY); "
                   "fcntl.flock(descriptor, fcntl.LOCK_EX); print(os.fstat(descriptor).st_ino, flush=True); "
                   "time.sleep(600)")  # a run that has taken the lock and written nothing yet


def test_a_run_refused_by_a_lock_taken_meanwhile_never_removes_the_directory_the_other_run_holds(tmp_path,
                                                                                                 monkeypatch):
    """Two runs creating one new directory together: the other takes the lock between this run's mkdir and its own
    flock. This run is refused and must leave the (still empty) directory to the other: removed, the other run's
    writes would go to a new directory nobody holds."""
    run, holders = tmp_path / "run", []
    exclusive_lock = fcntl.flock

    def the_other_run_locks_first(descriptor, operation):
        if operation & fcntl.LOCK_EX and not holders:
            holders.append(subprocess.Popen([sys.executable, "-c", RAW_LOCK_HOLDER, str(run)], stdout=subprocess.PIPE,
                                            text=True))
            holders.append(int(holders[0].stdout.readline()))
        return exclusive_lock(descriptor, operation)

    monkeypatch.setattr(fcntl, "flock", the_other_run_locks_first)
    try:
        with pytest.raises(RunDirectoryInUse, match="in use by a live dllm-ais run"):
            hold_run_lock(run)
        assert run.is_dir() and os.stat(run).st_ino == holders[1]
    finally:
        holders[0].kill()
        holders[0].wait()


def test_a_lock_taken_on_a_directory_removed_meanwhile_is_taken_again_on_the_one_now_there(tmp_path, monkeypatch):
    """The directory is removed and made again (a refused run cleaning up, another run starting) between this run's
    mkdir and its flock: the lock must end on the directory the path names, or a second run gets in beside it."""
    run, swapped = tmp_path / "run", []
    exclusive_lock = fcntl.flock

    def directory_swapped_before_the_lock(descriptor, operation):
        if operation & fcntl.LOCK_EX and not swapped:
            swapped.append(os.stat(run).st_ino)
            run.rmdir()
            run.mkdir()
        return exclusive_lock(descriptor, operation)

    monkeypatch.setattr(fcntl, "flock", directory_swapped_before_the_lock)
    hold_run_lock(run)
    monkeypatch.undo()
    try:
        second = subprocess.run([sys.executable, "-c", "import fcntl, os, sys; fcntl.flock(os.open(sys.argv[1], "
                                 "os.O_RDONLY | os.O_DIRECTORY), fcntl.LOCK_EX | fcntl.LOCK_NB)", str(run)],
                                capture_output=True, text=True, timeout=60)
        assert "BlockingIOError" in second.stderr, "a second run took the lock of the directory this run holds"
    finally:
        release_run_lock(run)


def checkpoint(output_dir, step, files):
    """A complete checkpoint-`step` as the trainer commits it (its marker lists every file's size and hash)."""
    staging = begin_staging(output_dir / f"checkpoint-{step}", run="run")
    for name, content in {"custom_checkpoint_0.pkl": b"state", "dllm_ais_config.yaml": b"{}\n", **files}.items():
        (staging / name).write_bytes(content)
    commit_staging(staging, output_dir / f"checkpoint-{step}")
    return output_dir / f"checkpoint-{step}"


def test_resume_skips_a_damaged_newest_checkpoint_and_refuses_a_damaged_named_one(tmp_path, capsys):
    intact = checkpoint(tmp_path, 2, {"optimizer.bin": b"x" * 100})
    damaged = checkpoint(tmp_path, 4, {"optimizer.bin": b"y" * 100})
    assert verify_checkpoint(damaged) is None
    os.truncate(damaged / "optimizer.bin", 37)  # a torn write, or a disk error since
    config = GRPOConfig(output_dir=str(tmp_path), resume_from_checkpoint=True)
    assert resume_checkpoint(config) == intact
    warning = capsys.readouterr().err
    assert f"skipped {damaged}: {damaged / 'optimizer.bin'} is damaged (37 bytes, 100 when written)" in warning
    with pytest.raises(ConfigError) as refused:
        resume_checkpoint(dataclasses.replace(config, resume_from_checkpoint=str(damaged)))
    message = str(refused.value)
    assert "\n" not in message and str(damaged / "optimizer.bin") in message
    assert f"--resume_from_checkpoint={intact}" in message
    (damaged / "optimizer.bin").write_bytes(b"z" * 100)  # the same size, other bytes: the hash tells
    assert "bytes changed" in verify_checkpoint(damaged)


def test_resume_keeps_every_valid_metrics_line_and_the_damaged_file(tmp_path, capsys):
    lines = [json.dumps({"step": step, "loss": 0.1}) + "\n" for step in range(1, 15)]
    lines[2] = lines[2][:len(lines[2]) // 2] + "\n"  # line 3 cut in half
    lines.append(json.dumps({"step": 14, "eval/reward": 0.5}) + "\n")  # the finished run's closing line
    (tmp_path / "metrics.jsonl").write_text("".join(lines) + "\0\0\0")
    log = MetricsLog(tmp_path, resume_step=14)
    log.write({"step": 15, "loss": 0.2})
    log.close()
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, *range(4, 16)]
    warning = capsys.readouterr().err
    assert "line(s) 3, 16 damaged" in warning and "kept its 13 valid line(s) up to step 14" in warning
    [aside] = tmp_path.glob("metrics.jsonl.damaged-*")
    assert aside.read_text() == "".join(lines) + "\0\0\0" and str(aside) in warning


def test_a_full_disk_leaves_no_staging_directory_and_says_so(tmp_path):
    final = tmp_path / "checkpoint-2"
    with pytest.raises(NoSpaceLeft, match=f"no space left on {tmp_path}"):
        with staged_directory(final) as staging:
            (staging / "optimizer.bin").write_bytes(b"partial")
            raise OSError(28, "No space left on device")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError, match="a bug"):  # any other failure: the staging directory goes too
        with staged_directory(final):
            raise RuntimeError("a bug")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.fixture
def small_disk(tmp_path):
    """A 1.5 MB tmpfs (needs root): the tiny run's first checkpoint (about 2 MB) does not fit."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1500k", "tmpfs", str(disk)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root")
    yield disk
    release_run_lock(disk / "run")  # this process ran the training: its lock keeps the mount busy
    subprocess.run(["umount", "--lazy", str(disk)], check=True)  # detached once the last file closes


def test_a_checkpoint_on_a_full_disk_is_one_line_and_leaves_nothing(small_disk, capsys):
    run = small_disk / "run"
    assert main(["train", f"--output_dir={run}", "--max_steps=2", "--save_steps=2", "--eval_size=4",
                 "--per_device_train_batch_size=8"]) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith(f"error: no space left on {run} (a checkpoint needs more than"), error
    assert "start the run again (no checkpoint was written)" in error
    assert not [entry.name for entry in run.iterdir() if entry.name.startswith((".tmp-", ".trash-", ".old-"))]


def test_empty_leftovers_of_interrupted_deletions_are_recovered(tmp_path):
    for name in (".trash-checkpoint-2-0a1b2c3d", ".tmp-final-0a1b2c3d"):
        (tmp_path / name).mkdir()  # killed after the marker went / before it was written
    (tmp_path / ".trash-mine").mkdir()  # not a name dllm-ais gives: the user's
    clean_leftovers(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".trash-mine"]


def test_printable_escapes_terminal_control_sequences():
    assert printable("\x1b[2Jhello\r\n\tworld\x07\x9b") == "\\x1b[2Jhello\\r\n\tworld\\x07\\x9b"


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory):
    """Files a user may pass, each with something wrong (name -> (path, what the error must name))."""
    root = tmp_path_factory.mktemp("bad")
    row = {"question": "1 + 1?", "answer": "#### 2"}
    files = {
        "broken JSON line": ("broken.jsonl", f'{json.dumps(row)}\n{{"question": \n{json.dumps(row)}\n'.encode(), ":2:"),
        "not UTF-8": ("latin1.jsonl", json.dumps(row).encode() + b"\n" + b'{"question": "caf\xe9"}\n', ":2:"),
        "empty file": ("empty.jsonl", b"", "empty"),
        "missing column": ("no_answer_column.jsonl", (json.dumps({"question": "q"}) + "\n").encode(), "answer"),
        "missing answer": ("missing_answer.jsonl", (json.dumps(row) + "\n" + json.dumps({"question": "q"}) + "\n")
                           .encode(), "row 2"),
        "null question": ("null_question.jsonl", (json.dumps({**row, "question": None}) + "\n").encode(), "row 1"),
    }
    cases = {}
    for case, (name, content, detail) in files.items():
        (root / name).write_bytes(content)
        cases[case] = (root / name, detail)
    return cases


def run_cli(argv_list, cwd):
    """Run `dllm-ais ARGV` for each ARGV at once, in fresh processes as a user runs them (the libraries' progress
    bars are silenced only before they are imported): [(exit code, stderr)]."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    processes = [subprocess.Popen([sys.executable, "-m", "dllm_ais.cli", *argv], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True, env=env, cwd=cwd) for argv in argv_list]
    results = []
    for process in processes:
        error = process.communicate(timeout=600)[1]
        results.append((process.returncode, error.strip()))
    return results


@pytest.mark.slow  # a fresh CLI process per bad file, all at once
def test_each_bad_dataset_file_is_one_line_naming_it(bad_inputs, tmp_path):
    argv_list = [["train", "--task=gsm8k", f"--dataset_path={path}", f"--output_dir={tmp_path / path.stem}"]
                 for path, _ in bad_inputs.values()]
    argv_list.append(["eval", "--task=gsm8k", f"--dataset_path={bad_inputs['broken JSON line'][0]}"])
    cases = [*bad_inputs.values(), bad_inputs["broken JSON line"]]
    for (code, error), (path, detail), argv in zip(run_cli(argv_list, tmp_path), cases, argv_list):
        assert code == 2 and len(error.splitlines()) <= ERROR_LINES, (argv, error)
        assert str(path) in error and detail in error, (argv, error)


@pytest.mark.slow  # a fresh CLI process per case, all at once
def test_inference_input_errors_are_one_line_naming_the_fix(tmp_path):
    model_dir = tmp_path / "model-without-tokenizer"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    cases = [
        (["generate", "--model", str(model_dir), "--prompt", "hi"], f"{model_dir} holds no tokenizer files"),
        (["generate", "--prompt", "what is <|mdm_mask|>?"], "mask token"),
        (["generate", "--prompt", "1" * 2000], "--max_prompt_length=N"),
        (["generate", "--prompt", "hi", "--max_completion_length=4096", "--block_length=4096"], "max_sequence_length"),
        (["eval", "--gen_lengths", "1", "--limit", "2", f"--output={tmp_path / 'report.json'}"], "must be even"),
    ]
    for (code, error), (argv, expected) in zip(run_cli([argv for argv, _ in cases], tmp_path), cases):
        assert code == 2, (argv, error)
        assert len(error.splitlines()) <= ERROR_LINES and expected in error, (argv, error)


def hold_in_another_process(directory):
    """A process holding the run lock of `directory`, as a live `dllm-ais train` there does (kill it after)."""
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from dllm_ais.run_lock import hold_run_lock; "
                               f"hold_run_lock({str(directory)!r}); print('held', flush=True); time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def stop(holder):
    holder.kill()
    holder.wait()


def test_a_run_inside_a_live_run_or_around_one_is_refused(tmp_path, capsys):
    outer, inner = tmp_path / "run", tmp_path / "run" / "final"
    holder = hold_in_another_process(outer)
    try:  # the attack: train into P/final while P trains (P would then fail at its final save)
        assert main(["train", f"--output_dir={inner}"]) == 2
        error = capsys.readouterr().err.strip()
        assert len(error.splitlines()) == 1 and f"pid {holder.pid}" in error and "lies inside it" in error, error
        assert not inner.exists()  # nothing created inside the live run
        with pytest.raises(RunDirectoryInUse):
            check_destination(outer / "exported", overwrite=True)
    finally:
        stop(holder)
    holder = hold_in_another_process(inner)
    try:  # the attack: --overwrite_output_dir on P while a run lives in P/final would delete the live run
        assert main(["train", f"--output_dir={outer}", "--overwrite_output_dir=true"]) == 2
        error = capsys.readouterr().err.strip()
        assert len(error.splitlines()) == 1 and f"{inner} is in use" in error and f"pid {holder.pid}" in error, error
        assert inner.is_dir() and (inner / LOCK_FILE).is_file()
    finally:
        stop(holder)
    assert prepare_output_dir(GRPOConfig(output_dir=str(inner))) is None  # both free once the holders are gone
    release_run_lock(inner)


def test_deleting_or_replacing_the_lock_file_admits_no_second_writer(tmp_path, capsys):
    run = tmp_path / "run"
    holder = hold_in_another_process(run)
    try:
        (run / LOCK_FILE).unlink()  # the attack: rm P/.dllm-ais.lock (the lock is on the directory, not the name)
        assert main(["train", f"--output_dir={run}", "--resume_from_checkpoint=false"]) == 2
        assert "in use by a live dllm-ais run" in capsys.readouterr().err
        (run / LOCK_FILE).mkdir()  # a lock path that is a directory: still one line, still refused
        assert main(["train", f"--output_dir={run}"]) == 2
        error = capsys.readouterr().err.strip()
        assert len(error.splitlines()) == 1 and "in use by a live dllm-ais run" in error, error
    finally:
        stop(holder)


def test_a_planted_lock_symlink_is_replaced_not_followed(tmp_path):
    run, victim = tmp_path / "run", tmp_path / "victim.txt"
    run.mkdir()
    victim.write_text("precious")
    (run / LOCK_FILE).symlink_to(victim)  # the attack: the holder record would be written into the link's target
    assert prepare_output_dir(GRPOConfig(output_dir=str(run))) is None
    assert victim.read_text() == "precious" and not (run / LOCK_FILE).is_symlink()
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()
    release_run_lock(run)
    other = tmp_path / "other"
    other.mkdir()
    (other / LOCK_FILE).mkdir()  # a lock path that is a directory: the run still takes the lock, no traceback
    assert prepare_output_dir(GRPOConfig(output_dir=str(other))) is None
    release_run_lock(other)


def test_a_damaged_marker_is_damage_of_its_checkpoint_only(tmp_path, capsys):
    """One flipped byte in the newest checkpoint's marker: that checkpoint is refused when named, skipped and named
    by `true`, then set aside (kept) so that the resumed run can write its step; the earlier one resumes, by `true`
    or named explicitly (the output_dir is not mistaken for someone else's)."""
    intact = checkpoint(tmp_path, 2, {"optimizer.bin": b"x" * 100})
    flipped = checkpoint(tmp_path, 4, {"optimizer.bin": b"y" * 100})
    marker = bytearray((flipped / ".dllm-ais.json").read_bytes())
    marker[1] ^= 0x20  # the attack (or a disk error): one byte
    (flipped / ".dllm-ais.json").write_bytes(bytes(marker))
    config = GRPOConfig(output_dir=str(tmp_path), resume_from_checkpoint=True)
    with pytest.raises(ConfigError) as refused:
        resume_checkpoint(dataclasses.replace(config, resume_from_checkpoint=str(flipped)))
    assert "\n" not in str(refused.value) and f"--resume_from_checkpoint={intact}" in str(refused.value)
    assert prepare_output_dir(config) == intact
    warning = capsys.readouterr().err
    assert f"skipped {flipped}: its marker {flipped / '.dllm-ais.json'} is missing or damaged" in warning
    [aside] = tmp_path.glob("abandoned-after-step-2-*")
    assert (aside / "checkpoint-4" / ".dllm-ais.json").read_bytes() == bytes(marker) and not flipped.exists()
    assert f"checkpoint-4 and the run's logs are kept in {aside}" in warning
    assert prepare_output_dir(dataclasses.replace(config, resume_from_checkpoint=str(intact))) == intact
    release_run_lock(tmp_path)


@pytest.mark.parametrize("field", ["files", "run"])
def test_a_marker_lacking_a_field_never_switches_verification_off(tmp_path, capsys, field):
    """A marker without its manifest used to read as "predates manifests": the damaged optimizer resumed."""
    intact = checkpoint(tmp_path, 2, {"optimizer.bin": b"x" * 100})
    stripped = checkpoint(tmp_path, 4, {"optimizer.bin": b"y" * 100})
    marker = json.loads((stripped / ".dllm-ais.json").read_text())
    del marker[field]
    (stripped / ".dllm-ais.json").write_text(json.dumps(marker))
    (stripped / "optimizer.bin").write_bytes(b"z" * 100)  # damaged, and nothing left to tell
    assert f"lacks a valid {field!r} field" in verify_checkpoint(stripped)
    assert resume_checkpoint(GRPOConfig(output_dir=str(tmp_path), resume_from_checkpoint=True)) == intact
    assert f"skipped {stripped}: its marker" in capsys.readouterr().err


def test_a_run_directory_replaced_under_a_live_run_gets_no_more_writes(tmp_path):
    """Moving the live run's directory away and putting another in its place: the lock stays with the moved one,
    and the live run refuses to write into the stranger (the second writer cannot share a directory with it)."""
    run = tmp_path / "run"
    assert prepare_output_dir(GRPOConfig(output_dir=str(run))) is None
    with staged_directory(run / "checkpoint-1", kind="checkpoint") as staging:  # the legitimate write
        (staging / "file.bin").write_bytes(b"x")
    os.rename(run, tmp_path / "moved")
    run.mkdir()
    with pytest.raises(RunDirectoryInUse, match="was moved or replaced while this run held it"):
        with staged_directory(run / "checkpoint-2", kind="checkpoint") as staging:
            (staging / "file.bin").write_bytes(b"y")
    assert not (run / "checkpoint-2").exists() and (tmp_path / "moved" / "checkpoint-1" / "file.bin").is_file()
    release_run_lock(run)
