"""DeepSpeed ZeRO-2 through the shipped `recipes/accelerate/deepspeed_zero2.yaml`, on 2 CPU processes (gloo),
launched as a user would: `accelerate launch --config_file recipes/accelerate/deepspeed_zero2.yaml --num_processes 2
-m dllm_ais.cli train ...`.

Only `--num_processes 2` is overridden (and the port: a free one). Without `--cpu` (which turns DeepSpeed off) accelerate starts the processes
itself; DeepSpeed finds no GPU and runs on its CPU accelerator, and dllm-ais gives accelerate the gloo process group
(`launch.join_deepspeed_processes_on_cpu`). The config's `mixed_precision: bf16` stays as shipped: the trainer never
autocasts, so DeepSpeed trains in the weights' dtype (`dtype: auto` = float32 on CPU).

What these CPU runs do not show: GPU memory savings and speed, NCCL, bf16 or fp16 engines (their optimizer files
are named and hold a loss scaler differently) and optimizer offload.
"""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from test_resume import comparable, metrics, output_of, start

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install deepspeed)")
pytestmark = pytest.mark.slow  # two-process DeepSpeed trainings

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
          str(ROOT / "recipes" / "accelerate" / "deepspeed_zero2.yaml"), "--num_processes", "2",
          "--main_process_port", "0", "-m", "dllm_ais.cli", "train"]  # port 0: a free one, never a taken 29500
# 2 prompts x 4 completions per process; step 3 falls inside a generation batch, after steps that moved AdamW
RUN = ["--eval_size=0", "--per_device_train_batch_size=8", "--num_iterations=2", "--rollout.precision=bf16",
       "--correction.ais_alpha_ema=0.5", "--temperature=1.5", "--max_steps=4"]
ENGINE_FILES = ["pytorch_model/mp_rank_00_model_states.pt", "pytorch_model/zero_pp_rank_0_mp_rank_00_optim_states.pt",
                "pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt"]


def train(output_dir, *overrides):
    """`dllm-ais train` under the ZeRO-2 launch, to its end; its output."""
    process = start([*LAUNCH, f"--output_dir={output_dir}", *RUN, *overrides], output_dir.parent)
    assert process.wait(timeout=600) == 0, output_of(process)[-5000:]
    return output_of(process)


@pytest.fixture(scope="module")
def zero2_runs(tmp_path_factory):
    """An uninterrupted ZeRO-2 run of 4 steps that checkpoints at step 3, and a run resumed from that checkpoint."""
    root = tmp_path_factory.mktemp("deepspeed")
    output = train(root / "reference", "--save_steps=3")
    assert "distributed run: 2 processes (DEEPSPEED) on cpu" in output
    train(root / "resumed", f"--resume_from_checkpoint={root / 'reference' / 'checkpoint-3'}")
    return root


def test_a_zero2_run_resumed_from_its_checkpoint_matches_the_uninterrupted_run(zero2_runs):
    from safetensors.torch import load_file

    reference, resumed = zero2_runs / "reference", zero2_runs / "resumed"
    assert all((reference / "checkpoint-3" / name).is_file() for name in ENGINE_FILES)
    records = metrics(reference)
    assert [r["step"] for r in records] == [1, 2, 3, 4] and records[2]["grad_norm"] > 0  # AdamW moments at the checkpoint
    assert comparable(metrics(resumed)) == comparable(records)
    final, at_checkpoint = (load_file(reference / name / "adapter_model.safetensors") for name in ("final", "checkpoint-3"))
    continued = load_file(resumed / "final" / "adapter_model.safetensors")
    assert all(not torch.equal(final[name], at_checkpoint[name]) for name in final)  # step 4 moved every weight
    assert all(torch.equal(final[name], continued[name]) for name in final)


class Payload:
    """Unpickling this creates a file: the stand-in for code a tampered checkpoint would run."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def test_an_engine_file_holding_code_is_refused_in_one_line_naming_it(zero2_runs, tmp_path):
    """The tamperer puts a payload beside the DeepSpeed classes of process 0's optimizer partition and rewrites the
    manifest (the hashes then verify): the weights-only load, allowing only those classes, refuses it, in the same
    line on both processes (process 1 never reads that partition)."""
    from dllm_ais.run_dir import record_manifest

    checkpoint = tmp_path / "checkpoint-3"
    shutil.copytree(zero2_runs / "reference" / "checkpoint-3", checkpoint)
    partition = checkpoint / ENGINE_FILES[1]
    state = torch.load(partition, weights_only=False)
    state["optimizer_state_dict"]["loss_scaler"].payload = Payload(tmp_path / "pwned")
    torch.save(state, partition)
    record_manifest(checkpoint)
    process = start([*LAUNCH, f"--output_dir={tmp_path / 'run'}", *RUN, f"--resume_from_checkpoint={checkpoint}"],
                    tmp_path)
    assert process.wait(timeout=600) != 0
    output = output_of(process)
    refusals = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(refusals) == 2 and len(set(refusals)) == 1 and str(partition) in refusals[0], output[-5000:]
    assert "[rank1]: Traceback" not in output  # process 1, whose own partition is clean, refuses the same way
    assert not (tmp_path / "pwned").exists()


STALLED_SAVE = """\
import os, pathlib, sys, time
import torch
from dllm_ais.cli import main
save = torch.save

def stalled_save(obj, file, *args, **kwargs):  # the test kills every process here, halfway through checkpoint-3
    if "optim_states" in str(file) and ".tmp-checkpoint-3-" in str(file):
        pathlib.Path(os.environ["STALLED_MARKER"]).touch()
        time.sleep(300)
    return save(obj, file, *args, **kwargs)

torch.save = stalled_save
sys.exit(main())
"""


def kill_9_all(process):
    """SIGKILL to `process` and every process it started (torchrun's workers run in sessions of their own)."""
    import psutil

    launcher = psutil.Process(process.pid)
    for each in [*launcher.children(recursive=True), launcher]:
        try:
            each.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:  # ended on its own meanwhile
            pass
    process.wait()


def test_kill_9_during_a_zero2_checkpoint_write_then_resume_gives_the_uninterrupted_run(zero2_runs, tmp_path):
    """Every process killed (SIGKILL: the launcher and all its workers) while DeepSpeed writes its optimizer
    partitions into checkpoint-3's staging directory: `--resume_from_checkpoint=true` continues from checkpoint-2
    and ends where the uninterrupted run ended."""
    from safetensors.torch import load_file

    output_dir, marker, script = tmp_path / "run", tmp_path / "stalled", tmp_path / "stalled_save.py"
    script.write_text(STALLED_SAVE)
    launch = [*LAUNCH[:LAUNCH.index("dllm_ais.cli") - 1], str(script), "train"]  # the script instead of -m
    with open(tmp_path / "killed.log", "w+") as log:
        process = subprocess.Popen([*launch, f"--output_dir={output_dir}", *RUN, "--save_steps=1"], stdout=log,
                                   stderr=subprocess.STDOUT,
                                   env={**os.environ, "OMP_NUM_THREADS": "1", "STALLED_MARKER": str(marker)})
        try:
            deadline = time.monotonic() + 600
            while not marker.exists():
                if process.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    pytest.fail(f"the run ended (or ran out of time) before checkpoint-3:\n{log.read()[-5000:]}")
                time.sleep(0.1)
        finally:
            kill_9_all(process)
    assert sorted(path.name for path in output_dir.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]

    output = train(output_dir, "--save_steps=1", "--resume_from_checkpoint=true")
    assert "Traceback" not in output
    reference = zero2_runs / "reference"
    assert comparable(metrics(output_dir)) == comparable(metrics(reference))
    final, resumed = (load_file(run / "final" / "adapter_model.safetensors") for run in (reference, output_dir))
    assert all(torch.equal(final[name], resumed[name]) for name in final)
    assert not [path.name for path in output_dir.iterdir() if path.name.startswith(".tmp-")]  # the half write is gone


def test_a_cpu_launch_of_the_deepspeed_config_is_refused_not_run_without_deepspeed(tmp_path):
    """`--cpu` makes accelerate drop DeepSpeed: the run would train unsharded under the ZeRO-2 config's name."""
    launch = [*LAUNCH]
    launch.insert(launch.index("--num_processes"), "--cpu")
    process = start([*launch, f"--output_dir={tmp_path / 'run'}", *RUN], tmp_path)
    assert process.wait(timeout=600) != 0
    refusal = [line for line in output_of(process).splitlines() if line.startswith("error:")]
    assert refusal == [f"error: accelerate launch --cpu turns DeepSpeed off: the processes of {LAUNCH[4]} would train "
                       "without it. Launch without --cpu; DeepSpeed runs on the CPU by itself."], output_of(process)
    assert not (tmp_path / "run").exists()

