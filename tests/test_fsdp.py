"""FSDP2 through the shipped `recipes/accelerate/fsdp.yaml`, on 2 CPU processes (gloo), launched as a user would:
`accelerate launch --config_file recipes/accelerate/fsdp.yaml --cpu --num_processes 2 ...`.

Only what a CPU needs is overridden: `--cpu` and `--num_processes 2`. accelerate's `--cpu` launcher starts one
process and drops the config's FSDP settings; dllm-ais re-launches the command as 2 gloo processes with them, and
switches accelerate (which keeps CPU processes unsharded, MULTI_CPU) to FSDP. The config's `mixed_precision: bf16`
stays as shipped: the trainer never autocasts, it computes in its weights' dtype (`dtype: auto` = float32 on CPU).

What these CPU runs do not show: GPU memory savings and speed, NCCL, CPU offload (`fsdp_offload_params`), and native
FP8 kernels (FP8 rollouts are emulated on CPU). The runs use float32 weights and `rollout.precision=bf16` (the
trainer's own dtype) so that the rollout engine can be compared with the saved model bit for bit; bfloat16 weights
and the FP8 engine also run sharded on CPU, but are not compared here.
"""

import math
import re
import shlex
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from test_resume import comparable, metrics, output_of, start, wait_until

pytestmark = pytest.mark.slow  # two-process FSDP trainings

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
          str(ROOT / "recipes" / "accelerate" / "fsdp.yaml"), "--cpu", "--num_processes", "2"]
RUN = ["--eval_size=0", "--per_device_train_batch_size=4", "--num_iterations=2", "--rollout.precision=bf16",
       "--correction.ais_alpha_ema=0.5"]  # 1 prompt × 4 completions per process; checkpoints can fall inside a generation batch


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory):
    """tests/fsdp_worker.py under the FSDP launch: a LoRA run of 4 steps (checkpoint-2, final/) and a step with a NaN
    gradient on one process, a fully fine-tuned run resumed from inside a generation batch; each run followed by the
    engine check."""
    root = tmp_path_factory.mktemp("fsdp")
    process = start([*LAUNCH, str(ROOT / "tests" / "fsdp_worker.py"), str(root), *RUN, "--max_steps=4", "--save_steps=2"],
                    root)
    assert process.wait(timeout=600) == 0, output_of(process)[-5000:]
    return root, output_of(process)


def test_sharded_training_syncs_the_engine_from_dtensors_skips_non_finite_saves_and_resumes_exactly(sharded_runs):
    root, output = sharded_runs
    for run in ("lora", "full", "full-resumed"):
        for process in (0, 1):
            assert f"process {process}: engine synced from DTensors == {run}/final" in output, output[-5000:]
    for process in (0, 1):
        assert f"process {process}: NaN gradient skipped, weights and optimizer untouched" in output
    assert "full fine-tuning resumed exactly" in output
    assert [r["step"] for r in metrics(root / "lora")] == [1, 2, 3, 4]  # one writer
    checkpoint = root / "lora" / "checkpoint-2"
    assert (checkpoint / "pytorch_model_fsdp.bin").is_file() and (checkpoint / "optimizer.bin").is_file()
    assert (checkpoint / "adapter_model.safetensors").is_file() and (root / "lora" / "final" / "adapter_config.json").is_file()


def signal_pending(pid: int, signum: int) -> bool:
    """Whether `signum` waits to be delivered to process `pid` (its bit in /proc/PID/status's pending sets)."""
    status = Path(f"/proc/{pid}/status").read_text()
    pending = [int(line.split()[1], 16) for line in status.splitlines() if line.startswith(("SigPnd:", "ShdPnd:"))]
    return any(mask >> (signum - 1) & 1 for mask in pending)


def test_sigterm_to_the_launcher_checkpoints_and_the_resumed_run_matches_the_uninterrupted_one(sharded_runs, tmp_path):
    """SIGTERM to `accelerate launch` alone (what `kill` or a scheduler sends): accelerate dies without relaying it;
    its exit reaches the processes as SIGTERM, they end the step, checkpoint and print one resume line.

    The signal takes its time down the launchers (the re-launch notices accelerate's exit, torch.distributed.run
    relays it), while the steps are short: the training processes are suspended once step 1 is logged and resumed
    when the SIGTERM is pending on both, so they stop within the 4 steps the resumed run is compared over, however
    loaded the machine."""
    root, _ = sharded_runs
    output_dir = tmp_path / "run"
    launcher = start([*LAUNCH, "-m", "dllm_ais.cli", "train", f"--output_dir={output_dir}", *RUN, "--max_steps=20"],
                     tmp_path)
    wait_until(lambda: len(metrics(output_dir)) >= 1, launcher)
    processes = psutil.Process(launcher.pid).children(recursive=True)
    [agent] = [process for process in processes if "torch.distributed.run" in process.cmdline()]
    workers = agent.children()
    for worker in workers:  # held in their step until the signal has come down the launchers to them
        worker.suspend()
    try:
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=60) == -signal.SIGTERM
        deadline = time.monotonic() + 120
        while not all(signal_pending(worker.pid, signal.SIGTERM) for worker in workers):
            assert time.monotonic() < deadline, "SIGTERM never reached the training processes"
            time.sleep(0.05)
    finally:
        for worker in workers:
            worker.resume()
    _, alive = psutil.wait_procs(processes, timeout=300)
    assert not alive
    output = output_of(launcher)
    assert "distributed run: 2 processes (FSDP) on cpu" in output
    lines = [line for line in output.splitlines() if line.startswith("interrupted at step")]
    assert len(lines) == 1, output[-5000:]
    step, command = re.fullmatch(r"interrupted at step (\d+); resume with: dllm-ais (train .*) "
                                 r"\(launched as this run was, 2 processes\)", lines[0]).groups()
    assert 1 <= int(step) < 4, "the run went past the reference's 4 steps before it saw the signal"
    assert (output_dir / f"checkpoint-{step}" / "pytorch_model_fsdp.bin").is_file()

    resumed = start([*LAUNCH, "-m", "dllm_ais.cli", *shlex.split(command), "--max_steps=4"], tmp_path)
    assert resumed.wait(timeout=600) == 0, output_of(resumed)[-5000:]
    assert comparable(metrics(output_dir)) == comparable(metrics(root / "lora"))


def two_sharded_steps(tmp_path, *arguments: str) -> tuple[list[dict], Path]:
    """`dllm-ais train --max_steps=2 ... ARGUMENTS` (MXFP4 rollouts, 8 completions a process, temperature 3 so that
    rewards differ within groups) launched as 2 FSDP processes: its two optimisation steps' records and its
    directory."""
    output_dir = tmp_path / "run"
    process = start([*LAUNCH, "-m", "dllm_ais.cli", "train", "--max_steps=2", "--num_iterations=1",
                     "--per_device_train_batch_size=8", "--rollout.precision=mxfp4", "--temperature=3.0", *arguments,
                     f"--output_dir={output_dir}"], tmp_path)
    assert process.wait(timeout=600) == 0, output_of(process)[-5000:]
    assert "distributed run: 2 processes (FSDP) on cpu" in output_of(process)
    steps = [record for record in metrics(output_dir) if "loss" in record]
    assert [record["step"] for record in steps] == [1, 2]
    return steps, output_dir


@pytest.mark.parametrize("training", [(), ("--use_peft=false",)], ids=["lora", "full-fine-tuning"])
def test_the_unified_flow_samples_with_the_sharded_trainer_and_scores_the_high_precision_base(tmp_path, training):
    """rollout.precision_flow=unified under FSDP2 (MXFP4): the engine is the sharded trainer itself, each sampling
    forward gathering its weights on both processes, in step on the fixed schedule (rollout.threshold=null); the ratio
    is exactly 1, gradients flow (temperature 3 so that rewards differ within groups), and the trained weights reach
    the high-precision base's evaluation gathered from their shards."""
    steps, output_dir = two_sharded_steps(tmp_path, "--eval_size=4", "--rollout.precision_flow=unified",
                                          "--rollout.threshold=null", *training)
    assert all(record["rollout_corr/k3_kl"] == 0.0 and record["grad_norm"] > 0 for record in steps)
    assert "eval/high_precision_base/accuracy" in metrics(output_dir)[-1]


@pytest.mark.parametrize("recipe", [
    [],  # the embedded recipe: dual cache, threshold 0.9, the one-step estimator
    [str(ROOT / "recipes" / "tiny_sdar_digits.yaml")],
    ["--likelihood.estimator=trajectory"],  # the dual cache's decoder replay
    ["--likelihood.estimator=trajectory", "--rollout.cache=none"],  # the exact replay of each commit step
], ids=["llada-parallel-decoding", "sdar-block-causal", "llada-decoder-replay", "llada-exact-replay"])
def test_the_unified_flow_under_fsdp_samples_in_step_whatever_each_process_needs(tmp_path, recipe):
    """rollout.precision_flow=unified under FSDP2 with a sampler whose forwards depend on each process's prompts:
    parallel decoding (the embedded recipe's threshold: each process's blocks need the steps their confidences allow)
    and SDAR's blocks (its rows' masked positions
    per block differ with their prompts' lengths), scored by the one-step estimator or by the trajectory replays of
    those commit steps. The processes agree on every host read that decides how many forwards run
    (`EagerForwards.agreed`) and on the replays' forwards, so the sharded forwards stay in step, forward and backward,
    and the run completes; the ratio is exactly 1."""
    steps, _ = two_sharded_steps(tmp_path, *recipe, "--eval_size=0", "--rollout.precision_flow=unified")
    assert all(record["rollout_corr/k3_kl"] == 0.0 and math.isfinite(record["grad_norm"]) for record in steps)


def test_the_split_flows_sharded_trainer_replays_each_processs_commit_steps_in_step(tmp_path):
    """The split flow under FSDP2 with threshold decoding and the exact trajectory replay: each process's rollouts
    commit at their own steps, so alone the processes' replays would take different numbers of forwards; the
    sharded trainer runs as many on each (the extra ones scoring nothing, backpropagated too) and the run completes."""
    steps, _ = two_sharded_steps(tmp_path, "--eval_size=0", "--likelihood.estimator=trajectory", "--rollout.cache=none")
    assert all(math.isfinite(record["grad_norm"]) and record["rollout_corr/k3_kl"] > 0 for record in steps)
