"""What `dllm-ais eval` and `dllm-ais generate` run: the config they take (a recipe, the training config saved beside
a trained model, or the embedded recipe), the model they load, and the evaluation report's path. Each command
imports what it needs when it runs, so that `dllm-ais --help` stays fast.
"""

from __future__ import annotations

import argparse
import logging
from contextlib import contextmanager


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
    if family_decoding and args.recipe is None and args.model and (blocks := block_diffusion_blocks(args.model)):
        values = {**block_diffusion_decoding(*blocks, values), **values}
    return load_config(args.recipe or EMBEDDED_RECIPE, values)


def block_diffusion_blocks(name_or_path: str) -> tuple[str, int] | None:
    """The model_type and block size in the config.json of the model `name_or_path` (an adapter's: its base's) when
    it is a block-diffusion model (SDAR) that names its block size; None otherwise. Read from the file: no model code
    runs."""
    from dllm_ais.loading import model_file, model_sources, read_json_object
    from dllm_ais.models.families import is_block_causal

    file = model_file(model_sources(name_or_path)[-1], "config.json")
    settings = read_json_object(file) if file else {}
    model_type, block_size = settings.get("model_type"), settings.get("block_size")
    return (model_type, block_size) if is_block_causal(model_type) and block_size is not None else None


def block_diffusion_decoding(model_type: str, block_size: int, values: dict) -> dict:
    """The decoding `eval` gives a block-diffusion model of `model_type` (its family record's `eval_protocol`: SDAR's
    own for SDAR, LLaDA2's for LLaDA2.x) as rollout settings: the model's blocks of `block_size`, a step per completion position
    (the `values`' max_completion_length, else the embedded recipe's)."""
    from dllm_ais.config import EMBEDDED_RECIPE, recipe_setting
    from dllm_ais.decoding_protocols import protocol_family, protocol_rollout
    from dllm_ais.models.families import family_of
    from dllm_ais.validation import read_recipe

    rollout = protocol_rollout(protocol_family(family_of(model_type).eval_protocol))
    length = values.get("max_completion_length", recipe_setting(read_recipe(EMBEDDED_RECIPE), "max_completion_length"))
    return {f"rollout.{name}": value for name, value in {**rollout, "block_length": block_size,
                                                           "steps": length}.items()}


def load_for_inference(args: argparse.Namespace, config):
    """Model (through the rollout engine at --precision, in --precision_flow) and tokenizer of `config` for
    eval/generate."""
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
        model = RolloutEngine(model, precision=args.precision, precision_flow=args.precision_flow).model
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


def run_eval(args: argparse.Namespace, overrides: list[str]) -> int:
    import shlex
    import time

    from dllm_ais.config import ConfigError
    from dllm_ais.data import load_task_dataset
    from dllm_ais.evaluation import (EvalProtocol, dataset_provenance, device_name, evaluate_policy, library_versions,
                                     markdown_table, model_provenance, report_entry, write_report)
    from dllm_ais.loading import resolve_dtype
    from dllm_ais.decoding_protocols import protocol_family
    from dllm_ais.models.families import find_family, is_block_causal
    from dllm_ais.policy import build_policy, is_diffusion
    from dllm_ais.rewards import resolve_reward_functions
    from dllm_ais.tasks import get_task

    config = inference_config(args, overrides)
    task = get_task(config.task)
    output = eval_output_path(args, config.task)
    reward_funcs = resolve_reward_functions(config.reward_funcs or list(task.reward_funcs))
    model, tokenizer = load_for_inference(args, config)
    block_size = model.config.block_size if is_block_causal(model) else None
    name = args.protocol or (family.eval_protocol if (family := find_family(model)) else "d1")
    protocol = EvalProtocol.for_task(task, args.gen_lengths, args.block_length, args.temperature, name, block_size)
    odd = [length for length in protocol.gen_lengths if length % 2]
    if odd and protocol.name == "d1" and is_diffusion(config.policy, model.config.model_type):
        raise ConfigError(f"--gen_lengths {','.join(map(str, odd))}: the protocol denoises in gen_length / 2 steps, "
                          "so every gen length must be even (e.g. 16,32).")
    in_model_blocks = protocol.name != "d1" and protocol_family(protocol.name).protocol_blocks == "block_size"
    misfit = [length for length in protocol.gen_lengths if in_model_blocks and length % block_size]
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
        "precision_flow": args.precision_flow,
        "device": device_name(next(model.parameters()).device), "versions": library_versions(),
        "command": shlex.join(["dllm-ais", *args.argv]), "results": results,
    }
    json_path, table_path = write_report(report, output)
    print(markdown_table(report) + f"\nresults: {json_path} (table: {table_path})")
    return 0


def run_generate(args: argparse.Namespace, overrides: list[str]) -> int:
    import torch

    from dllm_ais.config import ConfigError
    from dllm_ais.console import printable
    from dllm_ais.data import load_task_dataset
    from dllm_ais.policy import build_policy, sample_prompts
    from dllm_ais.rewards import completion_texts

    config = inference_config(args, overrides, family_decoding=True)
    model, tokenizer = load_for_inference(args, config)
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
