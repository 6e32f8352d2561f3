"""Exact resume and graceful interruption of `dllm-ais train`, in subprocesses: kill -9, SIGINT, SIGTERM."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

from dllm_ais.cli import main
from dllm_ais.config import EMBEDDED_RECIPE, load_config
from dllm_ais.trainer import GRPOTrainer

RUN = ["--max_steps=8", "--per_device_train_batch_size=8", "--num_iterations=2", "--eval_size=4",
       "--ais_alpha_ema=0.5",  # a checkpoint can fall inside a generation batch; the α EMA carries over batches
       "--eval_steps=2", "--log_completions=true", "--num_completions_to_print=2"]  # the best score carries over too


def comparable(records):
    """Every field of every metrics line except wall-clock timings."""
    return [{k: v for k, v in r.items() if not k.startswith("timing/")} for r in records]


def metrics(output_dir, name="metrics.jsonl"):
    path = output_dir / name
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The reference: the same run without interruption or checkpoints (in this process: it saves a start-up)."""
    output_dir = tmp_path_factory.mktemp("reference") / "run"
    GRPOTrainer(load_config(EMBEDDED_RECIPE, [f"--output_dir={output_dir}", *RUN])).train()
    return output_dir


@pytest.fixture(scope="module")
def uninterrupted(reference):
    return comparable(metrics(reference))


def start(argv, log_dir):
    """Start `argv` on one intra-op thread, its output in a file in `log_dir` (read it with `output_of`)."""
    log = open(log_dir / f"log-{time.monotonic_ns()}.txt", "w+")
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                               text=True)
    process.log = log
    return process


def train(output_dir, *overrides, command=None):
    """Start `python -m dllm_ais.cli train` (or the given `dllm-ais train ...` command) with its output in files."""
    command = command or ["dllm-ais", "train", f"--output_dir={output_dir}", *RUN, *overrides]
    return start([sys.executable, "-m", "dllm_ais.cli", *command[1:]], output_dir.parent)


def output_of(process):
    process.log.seek(0)
    return process.log.read()


def wait_until(condition, process, timeout=300):
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"the run ended before the test could interrupt it:\n{output_of(process)}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.slow  # training processes killed and resumed beside an uninterrupted one
def test_kill_9_after_a_checkpoint_then_resume_gives_the_uninterrupted_metrics(tmp_path, reference, uninterrupted,
                                                                                 capsys):
    output_dir = tmp_path / "run"
    process = train(output_dir, "--save_steps=2", "--save_total_limit=2")
    wait_until(lambda: (output_dir / "checkpoint-2").is_dir(), process)
    process.kill()
    assert process.wait() == -signal.SIGKILL

    changed = [f"--output_dir={output_dir}", *RUN, "--save_steps=2", "--resume_from_checkpoint=true"]
    assert main(["train", *changed, "--learning_rate=0.5", "--max_completion_length=32"]) == 2
    error = capsys.readouterr().err
    assert "Cannot resume" in error and "learning_rate: 0.0005 -> 0.5" in error and "max_completion_length" in error

    resumed = train(output_dir, "--save_steps=2", "--save_total_limit=2", "--resume_from_checkpoint=true")
    assert resumed.wait() == 0, output_of(resumed)
    assert comparable(metrics(output_dir)) == uninterrupted
    assert metrics(output_dir, "completions.jsonl") == metrics(reference, "completions.jsonl")
    best = json.loads((output_dir / "best_checkpoint.json").read_text())
    reference_best = json.loads((reference / "best_checkpoint.json").read_text())
    assert (best["best_metric"], best["best_global_step"]) == (reference_best["best_metric"],
                                                               reference_best["best_global_step"])
    assert best["best_model_checkpoint"] == str(output_dir / f"checkpoint-{best['best_global_step']}")
    kept = {"checkpoint-6", "checkpoint-8", f"checkpoint-{best['best_global_step']}"}  # the newest two and the best
    assert sorted(p.name for p in output_dir.iterdir()) == sorted([  # no leftovers
        *kept, ".dllm-ais.json", ".dllm-ais.lock", "best_checkpoint.json", "completions.jsonl", "config.yaml", "final",
        "held_out.json", "metrics.jsonl", "metrics.png"])


@pytest.mark.slow  # a training process signalled, then resumed
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_ends_the_step_with_a_checkpoint_and_one_line_to_resume(tmp_path, uninterrupted, stop):
    output_dir = tmp_path / "run"
    process = train(output_dir)  # save_steps=0: only the interruption writes a checkpoint
    wait_until(lambda: len(metrics(output_dir)) >= 1, process)
    process.send_signal(stop)
    assert process.wait(timeout=300) == 128 + stop
    output = output_of(process)
    assert "Traceback" not in output
    (line,) = [line for line in output.splitlines() if line.startswith("interrupted at step")]
    step, command = re.fullmatch(r"interrupted at step (\d+); resume with: (dllm-ais train .*)", line).groups()
    assert 1 <= int(step) < 8 and len(metrics(output_dir)) == int(step)
    command = shlex.split(command)
    assert command[-1] == f"--resume_from_checkpoint={output_dir / f'checkpoint-{step}'}"
    if stop == signal.SIGINT:  # the printed command continues the run exactly
        resumed = train(output_dir, command=command)
        assert resumed.wait() == 0, output_of(resumed)
        assert comparable(metrics(output_dir)) == uninterrupted


def test_a_second_signal_exits_at_once():
    import dllm_ais.interruption

    code = ("import importlib.util, os, signal, time\n"  # the module alone: stdlib only, starts in a blink
            f"spec = importlib.util.spec_from_file_location('interruption', {dllm_ais.interruption.__file__!r})\n"
            "module = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(module)\n"
            "with module.StopSignals():\n    os.kill(os.getpid(), signal.SIGINT)\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n    time.sleep(60)\nprint('not reached')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 130 and "exiting now" in result.stderr and "not reached" not in result.stdout


def test_a_fully_fine_tuned_run_resumes_exactly_into_another_output_dir(tokenizer, tmp_path):
    """No adapter: the checkpoint's save_pretrained weights are loaded back (the reference model stays the initial
    one); resuming elsewhere starts that directory's metrics.jsonl with the checkpoint's earlier lines."""
    from conftest import tiny_qwen3
    from test_trainer import make_trainer

    settings = dict(model_fn=tiny_qwen3, use_peft=False, beta=0.04, max_steps=3, num_iterations=2, save_steps=2)
    uninterrupted = comparable(make_trainer(tokenizer, tmp_path / "a", **settings).train().history)
    assert (tmp_path / "a" / "checkpoint-2" / "model.safetensors").is_file()
    resumed = make_trainer(tokenizer, tmp_path / "b", **settings,
                           resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2")).train().history
    assert comparable(resumed) == comparable(metrics(tmp_path / "b")) == uninterrupted


class Payload:
    """Unpickling this creates a file: the stand-in for code a tampered checkpoint would run."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def test_a_checkpoint_whose_trainer_state_holds_code_is_refused_before_accelerate_unpickles_it(tokenizer, tmp_path):
    import shutil

    import torch

    from dllm_ais.run_dir import record_manifest
    from dllm_ais.config import ConfigError
    from test_trainer import make_trainer

    make_trainer(tokenizer, tmp_path / "run", max_steps=1, save_steps=1).train()
    tampered = tmp_path / "tampered" / "checkpoint-1"
    shutil.copytree(tmp_path / "run" / "checkpoint-1", tampered)
    torch.save({"run_id": Payload(tmp_path / "pwned")}, tampered / "custom_checkpoint_0.pkl")
    with pytest.raises(ConfigError, match="custom_checkpoint_0.pkl is damaged"):  # its manifest tells at once
        make_trainer(tokenizer, tmp_path / "resumed", max_steps=2, resume_from_checkpoint=str(tampered))
    record_manifest(tampered)  # a tamperer who rewrites the manifest too meets the weights-only check
    with pytest.raises(ConfigError, match="refusing to resume"):
        make_trainer(tokenizer, tmp_path / "resumed", max_steps=2, resume_from_checkpoint=str(tampered))
    assert not (tmp_path / "pwned").exists()


def test_a_checkpoint_written_by_another_number_of_processes_is_refused(tokenizer, tmp_path):
    """Each process holds its own prompts' generation batch and RNG streams: a resume needs as many processes."""
    import shutil

    from dllm_ais.config import ConfigError
    from dllm_ais.run_dir import record_manifest
    from test_trainer import make_trainer

    make_trainer(tokenizer, tmp_path / "run", max_steps=1, save_steps=1).train()
    two_processes = tmp_path / "two" / "checkpoint-1"
    shutil.copytree(tmp_path / "run" / "checkpoint-1", two_processes)
    shutil.copy(two_processes / "random_states_0.pkl", two_processes / "random_states_1.pkl")
    record_manifest(two_processes)  # as a two-process run writes it: its manifest lists both (unlisted files are never read)
    with pytest.raises(ConfigError, match=r"written by 2 process\(es\), this run has 1; launch it with --num_processes 2"):
        make_trainer(tokenizer, tmp_path / "resumed", max_steps=2, resume_from_checkpoint=str(two_processes))
