"""`dllm-ais`: train, evaluate, generate, export and warm-start (SFT) from the command line."""

from __future__ import annotations

import argparse
import logging
import sys
from contextlib import contextmanager

from dllm_ais.choices import EVAL_PROTOCOLS, PRECISIONS, SFT_MASKINGS

MAIN_HELP = """\
RL fine-tuning of masked-diffusion (LLaDA) and autoregressive (Qwen3) LMs with FP8 rollouts and
adaptive importance-sampling correction (AIS).

Quick start (CPU, a few minutes, nothing downloaded):
  dllm-ais train                                    # tiny embedded LLaDA on the digits task: FP8 rollouts + AIS + LoRA
  dllm-ais train --correction=none --output_dir=outputs/no-correction   # the same without correction
  dllm-ais train --resume_from_checkpoint=true      # after Ctrl-C: continue that run exactly from its checkpoint
  dllm-ais train recipes/llada8b_gsm8k_lora_fp8_ais.yaml --dry_run=true    # check a GPU recipe on CPU
  accelerate launch --config_file recipes/accelerate/ddp.yaml -m dllm_ais.cli train recipes/llada8b_gsm8k_lora_fp8_ais.yaml
"""

TRAIN_EPILOG = """\
Every field below can be set in the YAML recipe or overridden as --field=value or --field value; a
settings group's field as --group.field=value (--rollout.cache=dual, --correction.method tis; in YAML,
nested: rollout: {cache: dual}); a boolean field alone means true (--dry_run). Values are YAML
(--report_to=[tensorboard], --correction.clip_low=null).
Unknown fields and bad values are reported before any model is loaded; flat names of earlier releases
(rollout_cache, is_clip, ...) still load, with a one-line hint. Full descriptions: docs/configuration.md.
Output: <output_dir>/metrics.jsonl, metrics.png, config.yaml, final/ (adapter + tokenizer), checkpoint-N/
every save_steps. A non-empty output_dir is refused: continue its run with --resume_from_checkpoint=true,
or start afresh with --overwrite_output_dir=true. Without a recipe the embedded run's recipe is used
(dllm_ais/assets/tiny_llada/recipe.yaml); the defaults below apply to fields a recipe leaves out.

"""


def _train(args: argparse.Namespace, overrides: list[str]) -> int:
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
        return _train_failed(args, overrides, config, error)
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


def _train_failed(args: argparse.Namespace, overrides: list[str], config, error: Exception) -> int:
    """After a run of this process failed: remove the staging directories it left in its output_dir (only while it
    holds the run's lock); a full disk is one line with the resume command from the newest intact checkpoint, any
    other error is raised on."""
    from pathlib import Path

    from dllm_ais.checkpoint import newest_intact_checkpoint
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


def checkpoint_settings(path) -> dict:
    """The settings saved beside a trained model (`dllm_ais_config.yaml`) that inference may take from it: task,
    data, sampler and reward names. A checkpoint may come from anyone, so what would run code is dropped (with a
    warning): `trust_remote_code`, and `reward_funcs` naming an importable 'module:function' (with their weights).
    Those come only from the command line."""
    from dllm_ais.validation import read_recipe

    values = dict(read_recipe(path))
    dropped = []
    if values.pop("trust_remote_code", False) is not False:
        dropped.append("trust_remote_code")
    reward_funcs = values.get("reward_funcs") or []
    reward_funcs = [reward_funcs] if isinstance(reward_funcs, str) else reward_funcs
    imported = [name for name in reward_funcs if not isinstance(name, str) or ":" in name]
    if imported:
        values.pop("reward_funcs")
        values.pop("reward_weights", None)
        dropped.append(f"reward_funcs {imported} (the task preset is used instead)")
    if dropped:
        logging.getLogger(__name__).warning(
            "ignoring %s from %s: a checkpoint never decides to run code. If you trust it, pass them on the command "
            "line (--trust_remote_code=true, --reward_funcs=[...]).", " and ".join(dropped), path)
    return values


def saved_settings(args: argparse.Namespace) -> "Path | None":
    """The training config saved beside the --model of eval/generate (`dllm_ais_config.yaml`), when no recipe is
    passed and the model has one."""
    from pathlib import Path

    saved = Path(args.model or "") / "dllm_ais_config.yaml"
    return saved if args.recipe is None and args.model and saved.is_file() else None


def inference_config(args: argparse.Namespace, overrides: list[str], family_decoding: bool = False):
    """The config giving eval/generate their task, data, sampler and reward settings: the recipe passed, else the
    training config saved beside a trained model (`saved_settings`, without its code-loading settings, see
    `checkpoint_settings`), else the embedded run's recipe — with `family_decoding` (generate; eval decodes with its
    protocol), for a block-diffusion --model (an SDAR export) with its family's decoding (`block_diffusion_decoding`),
    since that recipe is the tiny LLaDA's; command-line overrides win."""
    from dllm_ais.config import EMBEDDED_RECIPE
    from dllm_ais.config import load_config, parse_overrides

    values = {**({"model_name_or_path": args.model} if args.model else {}), **parse_overrides(overrides)}
    if saved := saved_settings(args):
        return load_config(None, {**checkpoint_settings(saved), **values})
    if (family_decoding and args.recipe is None and args.model
            and (blocks := block_diffusion_family(args.model)) is not None):
        values = {**block_diffusion_decoding(*blocks, values), **values}
    return load_config(args.recipe or EMBEDDED_RECIPE, values)


def block_diffusion_family(name_or_path: str) -> tuple[int, str] | None:
    """(block size, its family's eval protocol: `config.block_protocol_of`) from the config.json of the model
    `name_or_path` (an adapter's: its base's) when it is a block-diffusion model (SDAR, LLaDA2); None otherwise. Read
    from the file: no model code runs."""
    from dllm_ais.config import block_protocol_of
    from dllm_ais.loading import model_file, model_sources, read_json_object
    from dllm_ais.models.families import is_block_causal

    file = model_file(model_sources(name_or_path)[-1], "config.json")
    settings = read_json_object(file) if file else {}
    model_type = settings.get("model_type")
    return (settings.get("block_size"), block_protocol_of(model_type)) if is_block_causal(model_type) else None


def block_diffusion_decoding(block_size: int, protocol: str, values: dict) -> dict:
    """The family's own decoding (`with_sdar_protocol` of `protocol`, what `eval` decodes a block-diffusion model
    with) as rollout settings: the model's blocks of `block_size`, a step per completion position (the `values`'
    max_completion_length, else the embedded recipe's)."""
    from dllm_ais.config import BLOCK_PROTOCOL_ROLLOUTS, EMBEDDED_RECIPE, recipe_setting
    from dllm_ais.validation import read_recipe

    length = values.get("max_completion_length", recipe_setting(read_recipe(EMBEDDED_RECIPE), "max_completion_length"))
    return {f"rollout.{name}": value for name, value in {**BLOCK_PROTOCOL_ROLLOUTS[protocol],
                                                           "block_length": block_size, "steps": length}.items()}


def _load_for_inference(args: argparse.Namespace, config):
    """Model (through the rollout engine at --precision) and tokenizer of `config` for eval/generate."""
    import torch

    from dllm_ais.loading import check_tokenizer_files
    from dllm_ais.engine import RolloutEngine
    from dllm_ais.loading import keep_freed_host_memory, load_model, load_tokenizer, resolve_dtype

    device = "cuda" if torch.cuda.is_available() else "cpu"
    keep_freed_host_memory(device)
    check_tokenizer_files(config.model_name_or_path)
    tokenizer = load_tokenizer(config.model_name_or_path, config.trust_remote_code)
    model = load_model(config.model_name_or_path, resolve_dtype(config.dtype), config.trust_remote_code)
    model = model.to(device).eval()
    if args.precision != "bf16":
        model = RolloutEngine(model, precision=args.precision).model
    return model, tokenizer


def eval_output_path(args: argparse.Namespace, task: str) -> "Path":
    """--output, or eval_results/<task>-<model>-<time>.json; never a file that exists."""
    import re
    import time
    from pathlib import Path

    if args.output:
        path = Path(args.output)
        if path.exists() or path.with_suffix(".md").exists():
            raise SystemExit(f"error: {path} (or its .md table) already exists; pass another --output.")
        return path
    model = "-".join(Path(args.model or "embedded").parts[-2:])
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", f"{task}-{model}-{time.strftime('%Y%m%d-%H%M%S')}")
    path, number = Path("eval_results") / f"{stem}.json", 1
    while path.exists() or path.with_suffix(".md").exists():
        path, number = Path("eval_results") / f"{stem}-{number}.json", number + 1
    return path


def comma_separated_ints(text: str) -> tuple[int, ...]:
    """`128,256,512` -> (128, 256, 512); every value must be a positive integer."""
    values = tuple(int(value) for value in text.split(","))
    if any(value < 1 for value in values):
        raise ValueError(text)
    return values


def _eval(args: argparse.Namespace, overrides: list[str]) -> int:
    import shlex
    import time

    from dllm_ais.config import BLOCK_PROTOCOL_ROLLOUTS, ConfigError, block_protocol_of
    from dllm_ais.data import load_task_dataset
    from dllm_ais.evaluation import (EvalProtocol, dataset_provenance, device_name, evaluate_policy, library_versions,
                                     markdown_table, model_provenance, report_entry, write_report)
    from dllm_ais.loading import resolve_dtype
    from dllm_ais.models.families import is_block_causal
    from dllm_ais.policy import build_policy, is_diffusion
    from dllm_ais.rewards import resolve_reward_functions
    from dllm_ais.tasks import get_task

    config = inference_config(args, overrides)
    task = get_task(config.task)
    output = eval_output_path(args, config.task)
    reward_funcs = resolve_reward_functions(config.reward_funcs or list(task.reward_funcs))
    model, tokenizer = _load_for_inference(args, config)
    block_size = model.config.block_size if is_block_causal(model) else None
    name = args.protocol or (block_protocol_of(model.config.model_type) if block_size else "d1")
    protocol = EvalProtocol.for_task(task, args.gen_lengths, args.block_length, args.temperature, name, block_size)
    odd = [length for length in protocol.gen_lengths if length % 2]
    if odd and protocol.name == "d1" and is_diffusion(config.policy, model.config.model_type):
        raise ConfigError(f"--gen_lengths {','.join(map(str, odd))}: the protocol denoises in gen_length / 2 steps, "
                          "so every gen length must be even (e.g. 16,32).")
    misfit = [length for length in protocol.gen_lengths
              if protocol.name in BLOCK_PROTOCOL_ROLLOUTS and length % block_size]
    if misfit:
        fitting = ",".join(str(-(-length // block_size) * block_size) for length in protocol.gen_lengths)
        raise ConfigError(f"the {protocol.name} protocol decodes in this model's blocks of block_size={block_size}: gen length "
                          f"{','.join(map(str, misfit))} is not a multiple of it; pass --gen_lengths {fitting}")
    try:  # every gen length's sampler is checked before the first one runs
        policies = {gen_length: build_policy(protocol.decoding(config, gen_length),
                                             model.config, tokenizer, temperature=protocol.temperature)
                    for gen_length in protocol.gen_lengths}
    except ValueError as error:
        raise ConfigError(f"the {protocol.name} protocol (gen lengths {','.join(map(str, protocol.gen_lengths))}, "
                          f"block length {protocol.block_length}) does not fit this model's sampler: {error} (set "
                          "--gen_lengths and --block_length)") from None
    dataset = load_task_dataset(config.task, split=args.split, path=config.dataset_path, size=args.limit,
                                seed=config.seed, task_args=config.task_args)
    batch_size = args.batch_size or config.eval_batch_size
    results = []
    for gen_length, policy in policies.items():
        start = time.perf_counter()
        with prompt_errors_named(f"--gen_lengths {gen_length}", "lower --gen_lengths or use shorter prompts"):
            result = evaluate_policy(model, tokenizer, policy, dataset, reward_funcs, config.reward_weights,
                                     batch_size, max_prompt_length=None, accuracy=task.accuracy, seed=config.seed)
        results.append(report_entry(gen_length, result, time.perf_counter() - start))
    report = {
        "task": config.task, "split": args.split, "full_split": args.limit is None,
        "dataset": dataset_provenance(task, args.split, config.dataset_path, dataset, config.task_args),
        "protocol": {**protocol.to_dict(),
                     "name": (protocol.name if protocol == EvalProtocol.for_task(task, name=protocol.name,
                                                                                 block_size=block_size) else "custom"),
                     "batch_size": batch_size},
        "seed": config.seed, "model": model_provenance(config.model_name_or_path, model),
        "dtype": str(resolve_dtype(config.dtype)).removeprefix("torch."), "rollout_precision": args.precision,
        "device": device_name(next(model.parameters()).device), "versions": library_versions(),
        "command": shlex.join(["dllm-ais", *args.argv]), "results": results,
    }
    json_path, table_path = write_report(report, output)
    print(markdown_table(report) + f"\nresults: {json_path} (table: {table_path})")
    return 0


def _generate(args: argparse.Namespace, overrides: list[str]) -> int:
    import torch

    from dllm_ais.config import ConfigError
    from dllm_ais.console import printable
    from dllm_ais.data import load_task_dataset
    from dllm_ais.policy import build_policy, sample_prompts
    from dllm_ais.rewards import completion_texts

    config = inference_config(args, overrides, family_decoding=True)
    model, tokenizer = _load_for_inference(args, config)
    try:
        policy = build_policy(config, model.config, tokenizer, temperature=args.temperature)
    except ValueError as error:
        raise ConfigError(f"generate: the rollout settings do not fit this model's sampler: {error}") from None
    if args.prompt:
        prompts = [[{"role": "user", "content": p}] for p in args.prompt]
    else:
        prompts = list(load_task_dataset(config.task, split="validation", path=config.dataset_path,
                                         size=args.num_prompts, seed=config.seed,
                                         task_args=config.task_args)["prompt"])
    device = next(model.parameters()).device
    generator = torch.Generator(device).manual_seed(config.seed)
    with prompt_errors_named("generate", "shorten the prompt, or pass --max_prompt_length=N / "
                                         "--max_completion_length=N within the model's context"):
        rollout = sample_prompts(policy, model, tokenizer, prompts, config.max_prompt_length, device, generator)
    for prompt, completion in zip(prompts, completion_texts(tokenizer, rollout)):
        print(f"> {printable(prompt[-1]['content'])}\n{printable(completion)}\n")
    return 0


@contextmanager
def prompt_errors_named(command: str, fix: str):
    """Turn a sampler's PromptError (a prompt too long, holding the mask token) into one ConfigError line that
    names the `command` and the `fix` its flags offer."""
    from dllm_ais.config import ConfigError
    from dllm_ais.sampling.rollout import PromptError

    try:
        yield
    except PromptError as error:
        raise ConfigError(f"{command}: {error} ({fix})") from error


def _export(args: argparse.Namespace, overrides: list[str]) -> int:
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


def _sft(args: argparse.Namespace, overrides: list[str]) -> int:
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


def _lm_eval(args: argparse.Namespace, overrides: list[str]) -> int:
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


def _compare(args: argparse.Namespace, overrides: list[str]) -> int:
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


BENCHMARKS = {  # `dllm-ais bench NAME` -> what it measures; the module dllm_ais.bench.NAME runs it
    "rollout": "fast diffusion decoders (KV cache, parallel decoding, AR order) against the official algorithm",
    "sampler": "the diffusion sampler's overhead over bare forwards, and the rollout engine's weight sync",
    "mismatch": "token and sequence KL / ESS between the trainer and the rollout engine, per precision",
    "memory": "peak memory of likelihood scoring + backward per diffusion estimator and step count",
    "step": "one GRPO step: rollout and correction shares, and the log-prob pass's peak memory",
    "precision": "the precision ladder on one CUDA GPU at LLaDA-8B's shape: rollout tokens/s, sync, step memory",
}


def _bench(args: argparse.Namespace, arguments: list[str]) -> int:
    import importlib

    importlib.import_module(f"dllm_ais.bench.{args.benchmark}").main(arguments)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from dllm_ais.config import describe_fields

    parser = argparse.ArgumentParser(prog="dllm-ais", description=MAIN_HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parser.commands = commands  # for `with_overrides_joined`
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--verbose", action="store_true", help="also show the libraries' warnings and progress bars")

    train = commands.add_parser("train", parents=[common],
                                help="GRPO training with FP8 rollouts and AIS (default: tiny embedded run)",
                                description="Train a policy with GRPO. With no recipe: the embedded tiny LLaDA on the "
                                            "digits task, FP8 rollouts, AIS, LoRA — a few minutes on a CPU.",
                                epilog=TRAIN_EPILOG + describe_fields(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("recipe", nargs="?", help="YAML recipe (see recipes/); fields override the defaults")
    train.set_defaults(handler=_train)

    inference = argparse.ArgumentParser(add_help=False, parents=[common])
    inference.add_argument("recipe", nargs="?", help="optional YAML recipe for task/sampler settings")
    inference.add_argument("--model", help="hub id, model dir or adapter dir (default: the recipe's or 'embedded')")
    inference.add_argument("--precision", default="bf16", choices=PRECISIONS,
                           help="run the model through the rollout engine at this precision")
    inference.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the d1 eval protocol)")

    evaluate = commands.add_parser(
        "eval", parents=[inference], help="accuracy of a model on a task's test split (d1 protocol)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Evaluate a model (or trained adapter) with d1's protocol: greedy, block 32, steps = gen_length/2, "
                    "gen lengths 128/256/512 (the digits task: its own 16/16/8), accuracy (the correctness check "
                    "alone) on the full test split, with its standard error and every reward's mean. Writes a JSON "
                    "report (protocol, seed, model revision or content hash, dtype, precision, device, versions, "
                    "command, per-prompt values) and a markdown table beside it.\n\n"
                    "Task, data and sampler settings come from the recipe, else the model's saved config, else the "
                    "embedded recipe, and can be overridden as --field=value (or --field value). A saved config never turns on "
                    "trust_remote_code or imports 'module:function' rewards: pass --trust_remote_code=true or "
                    "--reward_funcs=[...] yourself.")
    evaluate.add_argument("--split", default="test", choices=("test", "validation", "train"))
    evaluate.add_argument("--protocol", choices=EVAL_PROTOCOLS,
                          help="d1 (any diffusion model; the default), dream: Dream's own greedy decoding (one block, "
                               "a step per token, entropy rule, time-linear schedule), sdar: SDAR's own (the model's "
                               "blocks, a step per block position, low_confidence_dynamic at 0.9, exact cache; the "
                               "default for an SDAR model), or llada2: LLaDA2's own (the same at 0.95; the default for "
                               "a LLaDA2 model)")
    evaluate.add_argument("--gen_lengths", type=comma_separated_ints,
                          help="comma-separated completion lengths (default: the task's, 128,256,512)")
    evaluate.add_argument("--block_length", type=int, help="diffusion block length (default: the task's, 32)")
    evaluate.add_argument("--batch_size", type=int,
                          help="prompts per batch (default: per_device_eval_batch_size, else per_device_train_batch_size)")
    evaluate.add_argument("--limit", type=int, help="score only this many prompts (seeded subset; not the protocol)")
    evaluate.add_argument("--output", help="JSON report path (default: eval_results/<task>-<model>-<time>.json)")
    evaluate.set_defaults(handler=_eval)

    generate = commands.add_parser("generate", parents=[inference], help="sample completions and print them",
                                   description="Print completions for --prompt texts (or task prompts).")
    generate.add_argument("--prompt", action="append", help="a user message (repeatable)")
    generate.add_argument("--num_prompts", type=int, default=4, help="task prompts to use when no --prompt is given")
    generate.set_defaults(handler=_generate)

    export = commands.add_parser("export", parents=[common], help="merge a LoRA adapter into its base and write a Hub-layout model",
                                 description="Merge an adapter directory (e.g. outputs/dllm-ais/final) into its base "
                                             "model; write safetensors, tokenizer and a model card (base model, "
                                             "training recipe, evaluation table, how to load it); an exported LLaDA, "
                                             "Dream or SDAR also ships its modeling files, so transformers alone "
                                             "loads it with trust_remote_code=True. Optionally upload it in one commit.")
    export.add_argument("source", help="adapter directory (or full model directory)")
    export.add_argument("output", help="output directory")
    export.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    export.add_argument("--eval_report", metavar="JSON",
                        help="a `dllm-ais eval` report for the card (default: the newest one of this source in "
                             "eval_results/ of the current directory, the source or its parent)")
    export.add_argument("--push_to_hub", "--push-to-hub", metavar="REPO_ID",
                        help="also upload to this Hub repository (one commit)")
    export.add_argument("--private", action="store_true", help="with --push_to_hub: create the repository private")
    export.add_argument("--overwrite", action="store_true",
                        help="replace OUTPUT if it holds an earlier export (a non-empty directory is refused otherwise)")
    export.set_defaults(handler=_export)

    sft = commands.add_parser("sft", parents=[common], help="SFT warm start (masked- or block-diffusion loss, or next-token for causal LMs)",
                              description="Supervised fine-tuning on a task's reference answers: the LLaDA "
                                          "masked-diffusion loss for LLaDA and Dream models, SDAR's block-diffusion "
                                          "loss for SDAR models (--as_block_diffusion makes one from a Qwen3), "
                                          "next-token cross-entropy for causal LMs (used to build the embedded tiny "
                                          "models).")
    sft.add_argument("--model", default="embedded")
    sft.add_argument("--task", default="digits")
    sft.add_argument("--task_args", default="{}", help="the task's settings as a YAML mapping, e.g. "
                                                      "'{dataset: chain_sum, max_terms: 3}' (task: reasoning_gym)")
    sft.add_argument("--output_dir", default="outputs/sft", help="a new or empty directory")
    sft.add_argument("--overwrite", action="store_true", help="replace --output_dir if an earlier `sft` wrote it")
    sft.add_argument("--steps", type=int, default=500)
    sft.add_argument("--batch_size", type=int, default=64)
    sft.add_argument("--learning_rate", type=float, default=1e-3)
    sft.add_argument("--gen_length", type=int, default=16)
    sft.add_argument("--max_gen_length", type=int, default=None,
                     help="pad each step's answers to a length drawn from gen_length..this in steps of 32")
    sft.add_argument("--masking", choices=SFT_MASKINGS, default="random",
                     help="LLaDA models: i.i.d. masks (LLaDA's SFT), or prefix masks — everything from a random cut in "
                          "the answer masked, so worked answers cannot be learnt by copying their later lines")
    sft.add_argument("--as_block_diffusion", type=int, default=None, metavar="BLOCK_SIZE",
                     help="make a causal Qwen3 --model an SDAR block-diffusion model of this block size first (the "
                          "same weights, a mask token added if the tokenizer has none), then train it with SDAR's "
                          "block-diffusion loss")
    sft.add_argument("--dataset_size", type=int, default=None)
    sft.add_argument("--dtype", default="auto")
    sft.add_argument("--seed", type=int, default=0)
    sft.set_defaults(handler=_sft)

    lm_eval = commands.add_parser(
        "lm-eval", add_help=False, help="lm-evaluation-harness on any task, with this library's model (needs [lm-eval])",
        description="Forwards every argument to the lm_eval CLI with --model dllm_ais (registered; the default), "
                    "e.g. dllm-ais lm-eval --model_args pretrained=outputs/dllm-ais/final --tasks arc_easy. "
                    "See docs/lm-eval.md; `dllm-ais lm-eval --help` prints the harness's options.")
    lm_eval.set_defaults(handler=_lm_eval, verbose=False)

    from dllm_ais.compare import __doc__ as compare_description

    compare = commands.add_parser("compare", parents=[common], help="arms x seeds of a recipe, paired against a "
                                  "baseline arm: table, JSON and plot", description=compare_description,
                                  formatter_class=argparse.RawDescriptionHelpFormatter,
                                  epilog="Any --field=value (or --field value) overrides every run (and names its "
                                         "runs apart). Studies: recipes/studies/.")
    compare.add_argument("study", help="study YAML: base, overrides, baseline, arms")
    compare.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per arm")
    compare.add_argument("--arms", help="comma-separated arms to run (the baseline always runs); default: all")
    compare.add_argument("--baseline", help="the arm to pair every other arm against (default: the study's "
                         "baseline); its report is comparison-vs-<arm>.md/.json/.png")
    compare.add_argument("--report", help="the report's file name in the study folder, without a suffix (default: "
                         "comparison, or comparison-vs-<arm> with --baseline)")
    compare.add_argument("--jobs", type=int, default=1, help="runs at a time (CPU threads are shared among them)")
    compare.add_argument("--output_dir", help="the study folder (default: outputs/studies/<study name>)")
    compare.set_defaults(handler=_compare)

    bench = commands.add_parser("bench", parents=[common], help="benchmarks: ratios measured in one run, printed "
                                "beside the device and settings", description="Run a benchmark; `dllm-ais bench NAME "
                                "--help` lists its options.")
    benchmarks = bench.add_subparsers(dest="benchmark", required=True, metavar="NAME")
    for name, summary in BENCHMARKS.items():  # each benchmark parses (and documents) its own options
        benchmarks.add_parser(name, add_help=False, help=summary).set_defaults(handler=_bench)
    return parser


def _is_user_error(error: Exception) -> bool:
    """Errors whose message names what to fix (bad config, path, dataset file or prompt, a full disk, a misbehaving
    reward function): one line, no traceback."""
    import errno

    from dllm_ais.config import ConfigError
    from dllm_ais.sampling.rollout import PromptError

    rewards = sys.modules.get("dllm_ais.rewards")  # imported whenever a reward function ran
    full_disk = isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)
    return full_disk or isinstance(error, (ConfigError, PromptError, FileNotFoundError, FileExistsError)) or (
        rewards is not None and isinstance(error, rewards.RewardFunctionError))


OVERRIDE_COMMANDS = ("train", "eval", "generate", "compare")  # the commands taking config fields as options


def with_overrides_joined(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`argv` with the config overrides of a command that takes them written `--key=value` (`joined_overrides`:
    `--max_steps 2`, a boolean `--dry_run` alone), so that argparse never takes an override's value for the
    command's positional recipe; the command's own options (`--model DIR`, or an abbreviation argparse accepts) are
    left to argparse."""
    from dllm_ais.config import joined_overrides

    if not argv or argv[0] not in OVERRIDE_COMMANDS:
        return argv
    own = parser.commands.choices[argv[0]]._option_string_actions  # argparse's table of the command's options
    return [argv[0], *joined_overrides(argv[1:], lambda arg: any(option.startswith(arg) for option in own))]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return run_command(argv)
    except KeyboardInterrupt:  # Ctrl-C that no command handled: while the libraries import, before a run starts
        print(interrupted_while_starting(argv[0] if argv else "dllm-ais"), file=sys.stderr)
        return 130


def interrupted_while_starting(command: str) -> str:
    """The line for a Ctrl-C that `command` did not handle itself: `train` handles it from the moment its run
    starts, so before that nothing of the run was touched (a resume: its checkpoints); another command stopped."""
    if command == "train":
        return ("interrupted while dllm-ais train started, before the run began (its output_dir and checkpoints are "
                "untouched): run the same command again")
    return f"interrupted: dllm-ais {command} stopped"


def run_command(argv: list[str]) -> int:
    """Parse `argv` and run its command; a user error is one line on stderr (exit status 2)."""
    from dllm_ais.config import ConfigError
    from dllm_ais.console import configure_console

    parser = build_parser()
    try:
        args, overrides = parser.parse_known_args(with_overrides_joined(parser, argv))
    except ConfigError as error:
        parser.exit(2, f"error: {error}\n")
    args.argv = argv
    configure_console(verbose=args.verbose)  # before anything imports the libraries
    try:
        return args.handler(args, overrides)
    except Exception as error:
        if args.verbose or not _is_user_error(error):
            raise
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
