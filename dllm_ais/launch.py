"""How a run starts: one writer per run, and the checks made before the model loads beyond the config's own.

`GRPOConfig.problems` checks what the config says; here is what needs the machine (trackers installed, every
launched process seen by accelerate), user code (reward functions that must import) or the data (the longest prompt
fits `max_prompt_length`). Each failure is a ConfigError naming the field or the fix.

On CPU, where accelerate alone starts one process and never shards, a multi-process (and FSDP) launch is completed
here: `relaunch_as_cpu_processes` and `use_fsdp_on_cpu`; a DeepSpeed launch, which accelerate starts as several
processes, gets its gloo process group from `join_deepspeed_processes_on_cpu`.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from dllm_ais.config import ConfigError, GRPOConfig
from dllm_ais.trackers import missing_tracker_problems
from dllm_ais.validation import problem_list, show

logger = logging.getLogger("dllm_ais")

WORLD_SIZE_VARIABLES = ["WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"]  # as accelerate reads


def launched_processes() -> int:
    from accelerate.utils import get_int_from_env

    return get_int_from_env(WORLD_SIZE_VARIABLES, 1)


def process_problems(num_processes: int) -> list[str]:
    """A multi-process launch that accelerate did not initialise (e.g. `torchrun` on CPU without
    ACCELERATE_USE_CPU=true) would run N independent trainings writing the same files: refuse it."""
    launched = launched_processes()
    if launched <= 1 or num_processes == launched:
        return []
    return [f"{launched} processes were launched (WORLD_SIZE={launched}) but accelerate sees {num_processes}: each "
            "would train alone and write the same files. On CPU set ACCELERATE_USE_CPU=true (e.g. "
            f"`ACCELERATE_USE_CPU=true torchrun --nproc_per_node {launched} -m dllm_ais.cli train ...`), or launch "
            f"with `accelerate launch --cpu --num_processes {launched} -m dllm_ais.cli train ...`"]


def reward_import_problems(reward_funcs: list[str] | None) -> list[str]:
    """The `package.module:function` rewards that do not import (registered names were checked with the config)."""
    from dllm_ais.rewards import resolve_reward_functions

    problems = []
    for name in reward_funcs or []:
        if ":" in name:
            try:
                resolve_reward_functions([name])
            except ValueError as error:
                problems.append(f"reward_funcs: {show(name)}: {error}")
    return problems


def check_run_environment(config: GRPOConfig) -> None:
    """ConfigError unless the trackers in `report_to` are installed and the reward functions import."""
    problems = missing_tracker_problems(config.report_to) + reward_import_problems(config.reward_funcs)
    if problems:
        raise ConfigError(problem_list("Cannot start the run:", problems))


def sharding_problems(accelerator: Any) -> list[str]:
    """An FSDP launch of version 1: the trainer, its engine sync, checkpoints and the sharded estimators' agreed
    forwards are written for FSDP2 (torch's `fully_shard`), and accelerate's FSDP plugin defaults to version 1."""
    from accelerate.utils import DistributedType

    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if accelerator.distributed_type != DistributedType.FSDP or getattr(plugin, "fsdp_version", 2) == 2:
        return []
    return [f"the accelerate config asks for FSDP version {plugin.fsdp_version}; dllm-ais shards with FSDP2: set "
            "fsdp_version: 2 under fsdp_config (as recipes/accelerate/fsdp.yaml does)"]


def check_processes(accelerator: Any) -> None:
    """ConfigError unless accelerate runs every launched process, with FSDP2 where it shards; a run over several says
    so once."""
    problems = process_problems(accelerator.num_processes) + sharding_problems(accelerator)
    if problems:
        raise ConfigError(problem_list("Cannot start the run:", problems))
    if accelerator.num_processes > 1 and accelerator.is_main_process:
        logger.info("distributed run: %d processes (%s) on %s", accelerator.num_processes,
                    accelerator.distributed_type.value, accelerator.device.type)


def prepare_output_dir_in_turn(config: GRPOConfig, accelerator: Any) -> Path | None:
    """`checkpoint_choice.prepare_output_dir` on every process, the main one first; the checkpoint to resume from.

    The main process alone changes the directory (its lock and the lock's record, written beside it and renamed in,
    the run's marker, leftovers removed): another process checking at the same time could meet a half-made entry and
    refuse a directory that is empty. So the others check once it is done, and a refusal of the main process is
    raised on every process."""
    from accelerate.utils import broadcast_object_list

    from dllm_ais.checkpoint_choice import prepare_output_dir

    if accelerator.num_processes == 1:
        return prepare_output_dir(config)
    if accelerator.is_main_process:
        try:
            checkpoint = prepare_output_dir(config)
        except Exception as error:
            broadcast_object_list([str(error)])
            raise
        broadcast_object_list([None])
        return checkpoint
    [refusal] = broadcast_object_list([None])
    if refusal is not None:
        raise ConfigError(refusal)
    return prepare_output_dir(config, is_main_process=False)


def check_prompt_lengths(tokenizer: Any, datasets: dict[str, Any], max_prompt_length: int) -> None:
    """ConfigError naming `max_prompt_length` when a prompt of a dataset (split name -> Dataset or None) is longer,
    found before the model loads rather than at the batch that holds the prompt."""
    from dllm_ais.data import prompt_token_counts

    problems = []
    for split, dataset in datasets.items():
        if dataset is None or len(dataset) == 0:
            continue
        longest = max(prompt_token_counts(tokenizer, list(dataset["prompt"])))
        if longest > max_prompt_length:
            problems.append(f"max_prompt_length={max_prompt_length}: the longest {split} prompt has {longest} tokens; "
                            f"set max_prompt_length >= {longest}")
    if problems:
        raise ConfigError(problem_list("Invalid configuration:", problems))


def check_metric_for_best_model(config: GRPOConfig, eval_reward_names: list[str]) -> None:
    """With eval_steps, `metric_for_best_model` must name a validation score this run produces: the reward, the
    task's accuracy or one of the evaluation's reward functions (`eval_reward_names`); ConfigError otherwise."""
    from dllm_ais.tasks import get_task

    if not config.eval_steps:
        return
    known = ["eval/reward", *(["eval/accuracy"] if get_task(config.task).accuracy is not None else []),
             *(f"eval/rewards/{name}/mean" for name in eval_reward_names)]
    if config.best_metric_key not in known:
        raise ConfigError(f"metric_for_best_model={config.metric_for_best_model!r} is not a validation score of this "
                          f"run; choose one of {', '.join(key.removeprefix('eval/') for key in known)}.")


def note_unseen_approximation(config: GRPOConfig) -> None:
    """Say once at start what the importance ratio cannot see of this run's fast rollouts (if anything)."""
    if config.unseen_approximation:
        print(f"note: rollout.cache={config.rollout.cache}, rollout.threshold={config.rollout.threshold}, "
              f"experimental.rollout_factor={config.experimental.rollout_factor}: {config.unseen_approximation}. "
              "Exact rollouts: --rollout.cache=none --rollout.threshold=null.")


def note_too_few_groups(config: GRPOConfig, rule, num_processes: int) -> None:
    """Tell the user when the adaptive / oracle AIS `rule` falls back to the k3 gate: a generation batch over all
    processes holds fewer GRPO groups than it needs to measure the batch's gradient noise."""
    from dllm_ais.correction import MIN_GROUPS_FOR_NOISE

    groups = config.generation_batch_size * num_processes // config.num_generations
    if config.correction.method == "ais" and rule in ("adaptive", "oracle") and groups < MIN_GROUPS_FOR_NOISE:
        print(f"note: a generation batch holds {groups} GRPO group(s) over all processes; correction.ais_rule={rule} "
              f"needs {MIN_GROUPS_FOR_NOISE} to measure the batch's gradient noise, so alpha follows the k3 gate "
              f"(correction.ais_kl_scale={config.correction.ais_kl_scale:g}). Raise per_device_train_batch_size * "
              f"gradient_accumulation_steps * processes / num_generations to {MIN_GROUPS_FOR_NOISE} to use it.")


def requested_cpu_launch() -> argparse.Namespace | None:
    """accelerate's launch arguments (its config file's settings filled in) when this process was started by
    `accelerate launch --cpu --num_processes N` (N > 1) without mpirun, else None.

    accelerate starts several CPU processes only through mpirun (`--mpirun_hostfile`); otherwise its simple launcher
    starts this one process, with ACCELERATE_USE_CPU set and no WORLD_SIZE, and drops the config's FSDP settings:
    the run would silently use one unsharded process. The parent `accelerate launch` command line is read with
    accelerate's own parser and validation.
    """
    from accelerate.utils import parse_flag_from_env

    if launched_processes() > 1 or "LOCAL_RANK" in os.environ or not parse_flag_from_env("ACCELERATE_USE_CPU"):
        return None
    import psutil
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    try:
        argv = psutil.Process().parent().cmdline()
    except (psutil.Error, AttributeError):
        return None
    starts = [i + 1 for i, token in enumerate(argv) if token == "accelerate.commands.launch"
              or (token == "launch" and i > 0 and os.path.basename(argv[i - 1]).startswith("accelerate"))]
    if not starts:
        return None
    try:
        args, _, _ = _validate_launch_command(launch_command_parser().parse_args(argv[starts[0]:]))
    except (SystemExit, Exception):  # not a command line accelerate itself would accept
        return None
    if args.mpirun_hostfile or not isinstance(args.num_processes, int) or args.num_processes < 2:
        return None
    return args


def relaunch_as_cpu_processes(args: argparse.Namespace) -> int:
    """Run the launched command as `args.num_processes` CPU processes (gloo) under torch.distributed.run, with the
    environment accelerate's multi-process launcher gives them (the config's FSDP settings included); its exit code.
    A DeepSpeed config is refused: `--cpu` drops it (accelerate launches DeepSpeed on CPUs itself, without `--cpu`).

    SIGINT/SIGTERM reaching this process are relayed to torch.distributed.run, which relays them to the processes
    (they end their step with a checkpoint). `accelerate launch` relays nothing when it is killed itself (e.g. a
    SIGTERM sent to it alone), so its exit is relayed as SIGTERM, unless a signal was relayed already: a second
    one would make the processes exit at once, without a checkpoint.
    """
    from accelerate.utils import prepare_multi_gpu_env

    if args.use_deepspeed:
        raise ConfigError(f"accelerate launch --cpu turns DeepSpeed off: the processes of {args.config_file} would "
                          "train without it. Launch without --cpu; DeepSpeed runs on the CPU by itself.")
    logger.info("accelerate launch --cpu starts a single process without mpirun; starting %d CPU processes%s with "
                "torch.distributed.run", args.num_processes, " (FSDP)" if args.use_fsdp else "")
    args.main_process_port = args.main_process_port or 0  # 0: a free port, never a warning about a taken one
    env = {**prepare_multi_gpu_env(args), "ACCELERATE_USE_CPU": "true"}
    script = ["-m"] if args.module else ["--no-python"] if args.no_python else []
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               str(args.num_processes), *script, args.training_script, *args.training_script_args]
    parent = os.getppid()
    launcher = subprocess.Popen(command, env=env, start_new_session=True)  # signals reach it only through here
    relayed: list[int] = []

    def relay(signum: int, frame=None) -> None:
        relayed.append(signum)
        launcher.send_signal(signum)

    previous = {signum: signal.signal(signum, relay) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        while launcher.poll() is None:
            try:
                launcher.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                if os.getppid() != parent and not relayed:
                    relay(signal.SIGTERM)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if relayed and launcher.returncode:  # the processes stopped on the signal (torch.distributed.run exits 1)
        return 128 + relayed[0]
    return launcher.returncode


def end_process_group(finished: bool = True) -> None:
    """Leave torch.distributed's process group, if this process is in one.

    After a finished run every process first waits for the others (a barrier: no process tears its connections down
    while a peer still writes), then a garbage collection frees the run's objects that still hold the group through
    reference cycles (DDP's reducer), so that the gloo backend and its worker threads end here, while the interpreter
    is whole. Left to the interpreter's exit, that teardown sometimes aborted a CPU process after its run had finished
    ("terminate called without an active exception") and with it the launch. After a failed run there is no barrier:
    a peer may be gone.
    """
    import gc

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if finished:
            dist.barrier()
        gc.collect()
        dist.destroy_process_group()


def join_deepspeed_processes_on_cpu() -> None:
    """In a process of `accelerate launch` with a DeepSpeed config on a machine where DeepSpeed runs on the CPU:
    start accelerate's state on the gloo backend, before the Accelerator.

    accelerate picks a backend only for accelerator devices or `--cpu`, and `--cpu` turns DeepSpeed off; without a
    backend its state counts one process while DeepSpeed's process group holds them all, and each process would
    train alone. Elsewhere (GPUs, or not a DeepSpeed launch) this does nothing.
    """
    from accelerate.utils import parse_flag_from_env

    if not parse_flag_from_env("ACCELERATE_USE_DEEPSPEED") or "LOCAL_RANK" not in os.environ:
        return
    from accelerate import PartialState
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        PartialState(backend="gloo")


def use_fsdp_on_cpu(accelerator: Any) -> None:
    """Shard with FSDP in CPU processes when the launch asked for FSDP (ACCELERATE_USE_FSDP, set from the config).

    accelerate applies an FSDP config only to accelerator devices: CPU processes stay MULTI_CPU (replicated, like
    DDP) and ignore it. torch's FSDP2 runs on CPU over gloo, so this sets accelerate's state to FSDP with the plugin
    it would have built from the same environment, before anything is prepared.
    """
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, parse_flag_from_env

    if accelerator.distributed_type != DistributedType.MULTI_CPU or not parse_flag_from_env("ACCELERATE_USE_FSDP"):
        return
    plugin = FullyShardedDataParallelPlugin()
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # AcceleratorState() copies it back
    AcceleratorState._shared_state.update(distributed_type=DistributedType.FSDP, fsdp_plugin=plugin)
