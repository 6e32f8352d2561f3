"""What `dllm-ais train`, `export`, `sft`, `lm-eval`, `compare` and `bench` run (`dllm_ais.cli` parses their
arguments; eval and generate are in `dllm_ais.inference_commands`). Each command imports what it needs when it runs, so
that `dllm-ais --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys


def run_train(args: argparse.Namespace, overrides: list[str]) -> int:
    from dllm_ais.config import EMBEDDED_RECIPE, load_config

    config = load_config(args.recipe or EMBEDDED_RECIPE, overrides)
    from dllm_ais.launch import end_process_group, relaunch_as_cpu_processes, requested_cpu_launch

    if launch := requested_cpu_launch():
        return relaunch_as_cpu_processes(launch)
    if config.dry_run:
        from dllm_ais.dry_run import run_dry_run

        run_dry_run(config)
        return 0
    from dllm_ais.loading import check_tokenizer_files
    from dllm_ais.interruption import TrainingInterrupted
    from dllm_ais.trainer import GRPOTrainer, NonFiniteError

    check_tokenizer_files(config.model_name_or_path)
    finished = False
    try:
        GRPOTrainer(config).train()
        finished = True
    except TrainingInterrupted as stop:
        from accelerate import PartialState

        state = PartialState()
        if state.is_main_process:  # one line per run, however many processes
            launched = f" (launched as this run was, {state.num_processes} processes)" if state.num_processes > 1 else ""
            print(f"interrupted at step {stop.step}; " + (
                f"resume with: {resume_command(args, overrides, stop.checkpoint)}{launched}"
                if stop.checkpoint else "no step taken, nothing to resume"), file=sys.stderr)
        return stop.exit_code
    except NonFiniteError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as interrupt:  # Ctrl-C while loading, before training installs its handler
        print(interrupted_before_training(args, overrides, config, interrupt), file=sys.stderr)
        return 130
    except Exception as error:
        return train_failed(args, overrides, config, error)
    finally:
        end_process_group(finished)
    return 0


def interrupted_before_training(args: argparse.Namespace, overrides: list[str], config,
                                interrupt: KeyboardInterrupt) -> str:
    """The line for Ctrl-C before the first step: a resumed run's checkpoints are untouched (loading only reads; the
    later steps of a branch it leaves are named where they were moved, `checkpoints_left`), so it names the
    checkpoint being loaded and the command that resumes again; a fresh run has nothing to resume."""
    from dllm_ais.interruption import InterruptedWhileLoading, checkpoints_left

    if isinstance(interrupt, InterruptedWhileLoading):
        return f"{interrupt}: resume with: {resume_command(args, overrides, interrupt.checkpoint)}"
    resume = config.resume_from_checkpoint
    if resume is None or resume is False:
        return "interrupted before the first step; nothing to resume"
    checkpoint = "true" if resume is True else resume
    return (f"interrupted while the resumed run loaded, before its first step; "
            f"{checkpoints_left(config.output_dir)}: resume with: {resume_command(args, overrides, checkpoint)}")


def train_failed(args: argparse.Namespace, overrides: list[str], config, error: Exception) -> int:
    """After a run of this process failed: remove the staging directories it left in its output_dir (only while it
    holds the run's lock); a full disk is one line with the resume command from the newest intact checkpoint, any
    other error is raised on."""
    from pathlib import Path

    from dllm_ais.checkpoint_choice import newest_intact_checkpoint
    from dllm_ais.run_dir import clean_leftovers, no_space_error
    from dllm_ais.run_lock import holds_run_lock

    if not holds_run_lock(config.output_dir):
        raise error
    no_space = no_space_error(error, Path(config.output_dir) / "checkpoint")
    clean_leftovers(config.output_dir)
    if no_space is None or args.verbose:
        raise error
    checkpoint = newest_intact_checkpoint(config.output_dir)[0]
    print(f"error: {no_space}. Free some space, then " + (
        f"resume with: {resume_command(args, overrides, checkpoint)}" if checkpoint is not None
        else "start the run again (no checkpoint was written)"), file=sys.stderr)
    return 1


def resume_command(args: argparse.Namespace, overrides: list[str], checkpoint) -> str:
    """The command that continues an interrupted run: its recipe and overrides (`--key=value` words, see
    `with_overrides_joined`), resuming from `checkpoint`."""
    import shlex

    replaced = ("resume_from_checkpoint", "overwrite_output_dir")
    kept = [arg for arg in overrides if arg.removeprefix("--").partition("=")[0].replace("-", "_") not in replaced]
    recipe = [args.recipe] if args.recipe else []
    return shlex.join(["dllm-ais", "train", *recipe, *kept, f"--resume_from_checkpoint={checkpoint}"])


def run_export(args: argparse.Namespace, overrides: list[str]) -> int:
    import torch

    from dllm_ais.export import PushToHubError, export_merged_model

    if overrides:
        raise SystemExit(f"export takes no config overrides (got {overrides}).")
    try:
        path = export_merged_model(args.source, args.output, getattr(torch, args.dtype), args.push_to_hub,
                                   args.overwrite, private=args.private, eval_report=args.eval_report)
    except PushToHubError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"merged model written to {path}" + (f" and pushed to {args.push_to_hub}" if args.push_to_hub else ""))
    return 0


def run_sft(args: argparse.Namespace, overrides: list[str]) -> int:
    from pathlib import Path

    import yaml

    from dllm_ais.loading import check_tokenizer_files
    from dllm_ais.run_dir import atomic_directory, check_destination, check_not_source
    from dllm_ais.config import ConfigError
    from dllm_ais.data import load_task_dataset
    from dllm_ais.loading import load_model, load_tokenizer, resolve_dtype
    from dllm_ais.policy import is_diffusion
    from dllm_ais.sft import SFTConfig, block_diffusion_from_causal, run_sft
    from dllm_ais.tasks import get_task

    if overrides:
        raise SystemExit(f"Unknown sft arguments {overrides}; see `dllm-ais sft --help`.")
    try:
        task_args = yaml.safe_load(args.task_args) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"--task_args: not a YAML mapping ({str(error).splitlines()[0]})") from error
    problems = ["--task_args: a mapping, e.g. '{dataset: chain_sum}'"] if not isinstance(task_args, dict) else (
        get_task(args.task).task_args_problems(task_args))
    if problems:
        raise ConfigError("; ".join(problems))
    check_not_source(Path(args.output_dir), args.model)
    check_destination(Path(args.output_dir), args.overwrite)
    check_tokenizer_files(args.model)
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, resolve_dtype(args.dtype))
    if args.as_block_diffusion is not None:
        if args.as_block_diffusion < 1:
            raise ConfigError(f"--as_block_diffusion={args.as_block_diffusion}: a block size of 1 or more (SDAR: 4)")
        try:
            model = block_diffusion_from_causal(model, tokenizer, args.as_block_diffusion)
        except ValueError as error:
            raise ConfigError(f"--as_block_diffusion: {error}") from error
    mask_id = model.config.mask_token_id if is_diffusion("auto", model.config.model_type) else None
    dataset = load_task_dataset(args.task, split="train", size=args.dataset_size, seed=args.seed, task_args=task_args)
    config = SFTConfig(steps=args.steps, batch_size=args.batch_size, learning_rate=args.learning_rate,
                       gen_length=args.gen_length, max_gen_length=args.max_gen_length, seed=args.seed,
                       masking=args.masking)
    losses = run_sft(model, tokenizer, dataset, config, mask_token_id=mask_id)
    with atomic_directory(args.output_dir, args.overwrite) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
    print(f"SFT loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps; model written to {args.output_dir}")
    return 0


def run_lm_eval(args: argparse.Namespace, overrides: list[str]) -> int:
    """Run the lm-evaluation-harness CLI on the arguments after `lm-eval`, with the `dllm_ais` model registered (and
    chosen when no --model is given)."""
    try:
        from dllm_ais.lm_eval_model import MODEL_NAME
    except ImportError as error:
        raise SystemExit(f"error: `dllm-ais lm-eval` needs lm-evaluation-harness ({error}); install it with "
                         "pip install 'dllm-ais[lm-eval]'") from None
    from lm_eval.__main__ import cli_evaluate

    harness_args = args.argv[args.argv.index("lm-eval") + 1:]
    if not any(arg == "--model" or arg.startswith("--model=") for arg in harness_args):
        harness_args = ["--model", MODEL_NAME, *harness_args]
    saved, sys.argv = sys.argv, ["lm_eval", *harness_args]
    try:
        cli_evaluate()
    finally:
        sys.argv = saved
    return 0


def run_compare(args: argparse.Namespace, overrides: list[str]) -> int:
    import shlex
    from pathlib import Path

    from dllm_ais.compare import StudyError, run_study

    try:
        table, report = run_study(Path(args.study), args.seeds, overrides, args.output_dir and Path(args.output_dir),
                                  args.jobs, args.arms and [arm.strip() for arm in args.arms.split(",")],
                                  shlex.join(["dllm-ais", *args.argv]), args.baseline, args.report)
    except StudyError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(table + f"\ntable: {report}.md | numbers: {report}.json | plot: {report}.png")
    return 0


def run_bench(args: argparse.Namespace, arguments: list[str]) -> int:
    import importlib

    importlib.import_module(f"dllm_ais.bench.{args.benchmark}").main(arguments)
    return 0
