"""Small attacks on a run, each answered by one line that names what to fix (issue 47, item 7; issue 62, item 4): a
reward beyond float32 (or whose held-out mean overflows it), a reward that calls sys.exit or raises KeyboardInterrupt,
Ctrl-C while a resumed run loads (a branch's later steps moved aside: named), a metrics line dllm-ais did not write,
and kill -9 before the first checkpoint followed by the command the refusal advises."""

import hashlib
import json
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

from dllm_ais.cli import build_parser, main
from dllm_ais.commands import interrupted_before_training
from dllm_ais.config import EMBEDDED_RECIPE, load_config
from dllm_ais.metrics import MetricsLog
from dllm_ais.run_dir import verify_checkpoint
from dllm_ais.run_lock import LOCK_FILE, release_run_lock
from dllm_ais.trainer import GRPOTrainer

SMALL = ["--eval_size=0", "--per_device_train_batch_size=8", "--num_iterations=1"]


def reward_module(tmp_path, monkeypatch, name, body):
    """A reward function `name` defined by `body` (its statements), importable as 'attack_<name>:<name>'."""
    source = f"import sys\ncalls = 0\n\ndef {name}(prompts, completions, **kwargs):\n" \
             f"    global calls\n    calls += 1\n{textwrap.indent(textwrap.dedent(body), '    ')}"
    (tmp_path / f"attack_{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, f"attack_{name}", raising=False)  # an earlier test's, with its own count
    return f"--reward_funcs=[attack_{name}:{name}]"


def error_line(stderr):
    """The one `error: ...` line a failed command printed (progress bars may come before it)."""
    [line] = [line for line in stderr.splitlines() if line.startswith("error:")]
    return line


def contents(directory):
    """Every file under run directory `directory` (its path relative to it) with the sha256 of its bytes; the lock's
    holder record aside."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name != LOCK_FILE}


@pytest.mark.parametrize("returned", ["1e308", "3e38"], ids=["beyond-float32", "overflowing-the-group-mean"])
def test_a_reward_float32_cannot_hold_stops_the_run_in_one_line_naming_the_function_and_value(tmp_path, monkeypatch,
                                                                                              capsys, returned):
    """1e308 is a finite Python float but inf in float32; 3e38 fits float32, but a group's sum of it does not."""
    reward = reward_module(tmp_path, monkeypatch, "huge", f"return [{returned}] * len(completions)")
    code = main(["train", f"--output_dir={tmp_path / 'run'}", *SMALL, "--max_steps=2", reward,
                 "--max_consecutive_skipped_batches=1"])
    release_run_lock(tmp_path / "run")
    error = error_line(capsys.readouterr().err)
    assert code == 1 and "reward function 'huge' returned" in error and f"{float(returned):g}" in error, error


@pytest.mark.parametrize("failure", ["sys.exit(3)", "raise ValueError('bad')"], ids=["sys.exit", "ValueError"])
def test_a_reward_calling_sys_exit_fails_as_any_reward_error_does(tmp_path, monkeypatch, capsys, failure):
    """The second generation batch's reward fails: one line naming the function, exit status 2, checkpoint-1 intact
    and no staging directory left — the same for sys.exit as for an exception."""
    reward = reward_module(tmp_path, monkeypatch, "fails", f"""\
        if calls > 1:
            {failure}
        return [0.5] * len(completions)""")
    run = tmp_path / "run"
    code = main(["train", f"--output_dir={run}", *SMALL, "--max_steps=3", "--save_steps=1", reward])
    release_run_lock(run)
    error = error_line(capsys.readouterr().err)
    assert code == 2 and error.startswith("error: reward function 'fails' raised "), error
    assert sorted(p.name for p in run.iterdir()) == [".dllm-ais.json", ".dllm-ais.lock", "checkpoint-1", "config.yaml",
                                                    "metrics.jsonl"]
    assert verify_checkpoint(run / "checkpoint-1") is None


def test_a_reward_of_3e38_is_refused_before_the_held_out_baseline_prints_inf(tmp_path, monkeypatch, capsys):
    """Each value fits float32, the mean over the held-out prompts does not: one line naming the function, before
    "held-out reward before training: inf" could be printed."""
    reward = reward_module(tmp_path, monkeypatch, "huge", "return [3e38] * len(completions)")
    code = main(["train", f"--output_dir={tmp_path / 'run'}", *SMALL, "--eval_size=2", "--max_steps=1", reward])
    release_run_lock(tmp_path / "run")
    captured = capsys.readouterr()
    error = error_line(captured.err)
    assert code == 2 and error.startswith("error: reward function 'huge' returned 3e+38, and the float32 arithmetic")
    assert "held-out reward" not in captured.out + captured.err and "Traceback" not in captured.err


def test_a_reward_raising_keyboard_interrupt_is_its_error_not_a_users_ctrl_c(tmp_path, monkeypatch, capsys):
    reward = reward_module(tmp_path, monkeypatch, "interrupts", "raise KeyboardInterrupt")
    code = main(["train", f"--output_dir={tmp_path / 'run'}", *SMALL, "--max_steps=1", reward])
    release_run_lock(tmp_path / "run")
    assert code == 2 and error_line(capsys.readouterr().err) == ("error: reward function 'interrupts' raised "
                                                                 "KeyboardInterrupt")


def test_ctrl_c_while_a_reward_runs_is_still_the_users():
    """A real SIGINT during a reward call keeps its meaning (Python's handler raises KeyboardInterrupt). Python's
    handler is installed for the test: a run started in the background (nohup, `&`) inherits SIGINT ignored."""
    import os

    from dllm_ais.rewards import score_completions

    def slow_reward(prompts, completions, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        return [0.0] * len(completions)

    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            score_completions([slow_reward], ["p"], ["c"], {})
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, inherited)


def test_a_metrics_line_with_nan_is_not_a_runs_line_and_never_kept_on_resume(tmp_path, capsys):
    """dllm-ais writes NaN and inf as null: a line holding one was written by someone else. Kept, it would log its
    step twice after the resume."""
    lines = [json.dumps({"step": step, "loss": 0.1, "reward": 0.5}) + "\n" for step in range(1, 7)]
    lines.insert(5, '{"step": 5, "loss": NaN, "reward": 0.5}\n')  # a foreign line, after the run's own step 5
    lines.append('{"step": 6, "loss": 1e999}\n')  # a number that parses to inf
    (tmp_path / "metrics.jsonl").write_text("".join(lines))
    log = MetricsLog(tmp_path, resume_step=6)
    log.write({"step": 7, "loss": float("nan")})
    log.close()
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6, 7]
    assert "line(s) 6, 8 damaged" in capsys.readouterr().err
    assert [path.read_text() for path in tmp_path.glob("metrics.jsonl.damaged-*")] == ["".join(lines)]


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """A finished run of 2 steps with checkpoint-1 and checkpoint-2 (trained in this process)."""
    run = tmp_path_factory.mktemp("finished") / "run"
    GRPOTrainer(load_config(EMBEDDED_RECIPE, [f"--output_dir={run}", *SMALL, "--max_steps=2",
                                              "--save_steps=1"])).train()
    return run


STALLED_LOAD = """\
import sys, time, pathlib
import dllm_ais.checkpoint as checkpoint
from dllm_ais.cli import build_parser, main
from dllm_ais.commands import interrupted_before_training
load_data = checkpoint.load_data

def stalled_load_data(*args, **kwargs):  # the test sends SIGINT here, halfway through loading the checkpoint
    pathlib.Path(sys.argv[1]).touch()
    time.sleep(300)
    return load_data(*args, **kwargs)

checkpoint.load_data = stalled_load_data
sys.exit(main(sys.argv[2:]))
"""


def interrupted_while_loading(tmp_path, argv: list[str]) -> str:
    """Run `dllm-ais <argv>` stalled while it loads a checkpoint (STALLED_LOAD), send it Ctrl-C there, check it
    exits 130 with no traceback, and return its one `interrupted` line (import notes aside)."""
    loading, script = tmp_path / "loading", tmp_path / "stalled_load.py"
    script.write_text(STALLED_LOAD)
    process = subprocess.Popen([sys.executable, str(script), str(loading), *argv], stderr=subprocess.PIPE, text=True)
    try:
        while not loading.exists():
            assert process.poll() is None, process.stderr.read()
            subprocess.run(["sleep", "0.05"])
        process.send_signal(signal.SIGINT)
        error = process.communicate(timeout=120)[1]
    finally:
        process.kill()
    [line] = [line for line in error.splitlines() if line.startswith("interrupted")]
    assert process.returncode == 130 and "Traceback" not in error, error
    return line


@pytest.mark.slow  # a training process interrupted while it loads
def test_ctrl_c_while_a_resumed_run_loads_names_the_checkpoint_and_the_resume_that_works(two_checkpoints, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(two_checkpoints, run)
    before = contents(run)
    argv = ["train", f"--output_dir={run}", *SMALL, "--max_steps=3", "--save_steps=1", "--resume_from_checkpoint=true"]
    line = interrupted_while_loading(tmp_path, argv)
    message, command = line.split(": resume with: ")
    assert message == f"interrupted while loading {run / 'checkpoint-2'}; the checkpoints are intact"
    assert contents(run) == before
    command = shlex.split(command)
    assert command[:2] == ["dllm-ais", "train"] and main(command[1:]) == 0
    release_run_lock(run)
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


@pytest.mark.slow  # a training process interrupted while it loads
def test_ctrl_c_while_a_branch_resume_loads_names_where_the_later_steps_were_moved(two_checkpoints, tmp_path):
    """Resuming from checkpoint-1 moves checkpoint-2 (and final/) aside before loading: a Ctrl-C then says where
    they are, not that the checkpoints are intact."""
    run = tmp_path / "run"
    shutil.copytree(two_checkpoints, run)
    argv = ["train", f"--output_dir={run}", *SMALL, "--max_steps=3", "--save_steps=1",
            f"--resume_from_checkpoint={run / 'checkpoint-1'}"]
    line = interrupted_while_loading(tmp_path, argv)
    [aside] = run.glob("abandoned-after-step-1-*")
    assert line.startswith(f"interrupted while loading {run / 'checkpoint-1'}; the checkpoints of the later steps "
                           f"this resume leaves are in {aside}, the others are intact: resume with: dllm-ais train ")
    assert (aside / "checkpoint-2").is_dir() and not (run / "checkpoint-2").exists()


def test_ctrl_c_before_a_resumed_run_reaches_its_checkpoint_says_how_to_resume_again():
    """Ctrl-C while a resumed run loads its model, before it loads the checkpoint: still not 'nothing to resume'."""
    argv = ["train", "--output_dir=out", "--resume_from_checkpoint=true"]
    args, overrides = build_parser().parse_known_args(argv)
    line = interrupted_before_training(args, overrides, load_config(EMBEDDED_RECIPE, overrides), KeyboardInterrupt())
    assert line == ("interrupted while the resumed run loaded, before its first step; the checkpoints are intact: "
                    "resume with: dllm-ais train --output_dir=out --resume_from_checkpoint=true")
    fresh = load_config(EMBEDDED_RECIPE, ["--output_dir=out"])
    assert interrupted_before_training(args, [], fresh, KeyboardInterrupt()).endswith("nothing to resume")


@pytest.mark.slow  # a training process killed
def test_kill_9_before_the_first_checkpoint_advises_a_fresh_start_that_is_accepted(tmp_path, capsys):
    run = tmp_path / "run"
    argv = ["train", f"--output_dir={run}", *SMALL, "--max_steps=50", "--save_steps=50"]
    process = subprocess.Popen([sys.executable, "-m", "dllm_ais.cli", *argv], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        while not (run / "metrics.jsonl").is_file() or not (run / "metrics.jsonl").read_text():  # step 1 logged
            assert process.poll() is None, "the run ended before the test could kill it"
            subprocess.run(["sleep", "0.05"])
    finally:
        process.kill()
    assert process.wait() == -signal.SIGKILL and not list(run.glob("checkpoint-*"))

    assert main([*argv, "--resume_from_checkpoint=true"]) == 2
    advice = capsys.readouterr().err.strip()
    assert "\n" not in advice and "drop --resume_from_checkpoint and pass --overwrite_output_dir=true" in advice, advice
    assert main(argv) == 2  # the fresh run the advice warns against: refused, naming the same flag
    assert "--overwrite_output_dir=true" in capsys.readouterr().err
    assert main([*argv, "--max_steps=1", "--overwrite_output_dir=true"]) == 0  # the advised command
    release_run_lock(run)
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1]
