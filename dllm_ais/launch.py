"""How a run starts: one writer per run, and the checks made before the model loads beyond the config's own.

`GRPOConfig.problems` checks what the config says; here is what needs the machine (trackers installed, every
launched process seen by accelerate), user code (reward functions that must import) or the data (the longest prompt
fits `max_prompt_length`). Each failure is a ConfigError naming the field or the fix.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
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


def check_processes(accelerator: Any) -> None:
    """ConfigError unless accelerate runs every launched process; a run over several says so once."""
    problems = process_problems(accelerator.num_processes)
    if problems:
        raise ConfigError(problem_list("Cannot start the run:", problems))
    if accelerator.num_processes > 1 and accelerator.is_main_process:
        logger.info("distributed run: %d processes (%s) on %s", accelerator.num_processes,
                    accelerator.distributed_type.value, accelerator.device.type)


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


def requested_cpu_processes() -> int:
    """N when this process was started by `accelerate launch --cpu --num_processes N` (N > 1) without mpirun, else 1.

    accelerate starts several CPU processes only through mpirun (`--mpirun_hostfile`); otherwise its simple launcher
    starts this one process, with ACCELERATE_USE_CPU set and no WORLD_SIZE, and the run would silently use one.
    N is read from the parent `accelerate launch` command line with accelerate's own parser.
    """
    from accelerate.utils import parse_flag_from_env

    if launched_processes() > 1 or "LOCAL_RANK" in os.environ or not parse_flag_from_env("ACCELERATE_USE_CPU"):
        return 1
    import psutil
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    try:
        argv = psutil.Process().parent().cmdline()
    except (psutil.Error, AttributeError):
        return 1
    starts = [i + 1 for i, token in enumerate(argv) if token == "accelerate.commands.launch"
              or (token == "launch" and i > 0 and os.path.basename(argv[i - 1]).startswith("accelerate"))]
    if not starts:
        return 1
    try:
        args = launch_command_parser().parse_args(argv[starts[0]:])
        processes = args.num_processes
        if processes is None and args.config_file:
            processes = load_config_from_file(args.config_file).num_processes
    except (SystemExit, Exception):  # not a command line accelerate itself would accept
        return 1
    return processes if isinstance(processes, int) and processes > 1 else 1


def relaunch_as_cpu_processes(processes: int) -> int:
    """Run this command again as `processes` CPU processes (gloo) under torch.distributed.run; its exit code."""
    logger.info("accelerate launch --cpu starts a single process without mpirun; starting %d CPU processes with "
                "torch.distributed.run", processes)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
               "-m", "dllm_ais.cli", *sys.argv[1:]]
    return subprocess.run(command, env={**os.environ, "ACCELERATE_USE_CPU": "true"}).returncode
