"""`dllm-ais`: train, evaluate, generate, export and warm-start (SFT) from the command line."""

from __future__ import annotations

import argparse
import logging
import sys

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
Every field below can be set in the YAML recipe or overridden as --field=value (values are YAML:
--report_to=[tensorboard], --is_clip_low=null). Unknown fields and bad values are reported before any
model is loaded. Output: <output_dir>/metrics.jsonl, metrics.png, config.yaml, final/ (adapter + tokenizer),
checkpoint-N/ every save_steps. A non-empty output_dir is refused: continue its run exactly with
--resume_from_checkpoint=true (latest checkpoint-N), or start afresh with --overwrite_output_dir=true.
Ctrl-C or SIGTERM finishes the current step, writes a checkpoint and prints the command that resumes it.
Without a recipe the embedded run's recipe is used (dllm_ais/assets/tiny_llada/recipe.yaml); the defaults
below (d1's published LLaDA settings) apply to fields a recipe leaves out.

Fields:
"""


def _train(args: argparse.Namespace, overrides: list[str]) -> int:
    from dllm_ais.checkpoint import EMBEDDED_RECIPE
    from dllm_ais.config import load_config

    config = load_config(args.recipe or EMBEDDED_RECIPE, overrides)
    if config.dry_run:
        from dllm_ais.dry_run import run_dry_run

        run_dry_run(config)
        return 0
    from dllm_ais.interruption import TrainingInterrupted
    from dllm_ais.trainer import GRPOTrainer, NonFiniteError

    try:
        GRPOTrainer(config).train()
    except TrainingInterrupted as stop:
        print(f"interrupted at step {stop.step}; " + (f"resume with: {resume_command(args, overrides, stop.checkpoint)}"
                                                      if stop.checkpoint else "no step taken, nothing to resume"),
              file=sys.stderr)
        return stop.exit_code
    except NonFiniteError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C while loading, before training installs its handler
        print("interrupted before the first step; nothing to resume", file=sys.stderr)
        return 130
    return 0


def resume_command(args: argparse.Namespace, overrides: list[str], checkpoint) -> str:
    """The command that continues an interrupted run: its recipe and overrides, resuming from `checkpoint`."""
    import shlex

    replaced = ("resume_from_checkpoint", "overwrite_output_dir")
    kept, dropping_value = [], False
    for arg in overrides:
        if dropping_value:
            dropping_value = False
            continue
        key, has_value, _ = arg.removeprefix("--").partition("=")
        if key.replace("-", "_") in replaced:
            dropping_value = not has_value  # `--key value`: the value is the next argument
            continue
        kept.append(arg)
    recipe = [args.recipe] if args.recipe else []
    return shlex.join(["dllm-ais", "train", *recipe, *kept, f"--resume_from_checkpoint={checkpoint}"])


def inference_recipe(args: argparse.Namespace):
    """The recipe giving eval/generate their task and sampler settings: the one passed, else the training config
    saved beside a trained model (`dllm_ais_config.yaml`), else the embedded run's recipe."""
    from pathlib import Path

    from dllm_ais.checkpoint import EMBEDDED_RECIPE

    saved = Path(args.model or "") / "dllm_ais_config.yaml"
    return args.recipe or (saved if args.model and saved.is_file() else EMBEDDED_RECIPE)


def _load_for_inference(args: argparse.Namespace, overrides: list[str]):
    """Config (with overrides), model, tokenizer and greedy-or-sampling policy for eval/generate."""
    import torch

    from dllm_ais.checkpoint import load_model, load_tokenizer, resolve_dtype
    from dllm_ais.config import load_config
    from dllm_ais.engine import RolloutEngine
    from dllm_ais.trainer import build_policy

    config = load_config(inference_recipe(args), [f"--model_name_or_path={args.model}", *overrides] if args.model else overrides)
    tokenizer = load_tokenizer(config.model_name_or_path)
    model = load_model(config.model_name_or_path, resolve_dtype(config.dtype), config.trust_remote_code)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = model.to(device).eval()
    if args.precision != "bf16":
        model = RolloutEngine(model, precision=args.precision).model
    policy = build_policy(config, model.config, tokenizer, temperature=args.temperature)
    return config, model, tokenizer, policy


def _eval(args: argparse.Namespace, overrides: list[str]) -> int:
    from dllm_ais.data import load_task_dataset
    from dllm_ais.rewards import TASK_REWARDS, resolve_reward_functions
    from dllm_ais.trainer import evaluate_policy

    config, model, tokenizer, policy = _load_for_inference(args, overrides)
    dataset = load_task_dataset(config.task, split=args.split, path=config.dataset_path, size=config.eval_size,
                                seed=config.seed)
    funcs = resolve_reward_functions(config.reward_funcs or TASK_REWARDS[config.task])
    result = evaluate_policy(model, tokenizer, policy, dataset, funcs, config.reward_weights,
                             config.per_device_train_batch_size, config.max_prompt_length)
    print(f"task={config.task} split={args.split} model={config.model_name_or_path} precision={args.precision} "
          f"temperature={args.temperature}: mean reward {result['eval/reward']:.4f} ± {result['eval/reward_std']:.4f} "
          f"over {int(result['eval/num_prompts'])} prompts")
    return 0


def _generate(args: argparse.Namespace, overrides: list[str]) -> int:
    import torch

    from dllm_ais.data import load_task_dataset, tokenize_prompts
    from dllm_ais.trainer import completion_texts

    config, model, tokenizer, policy = _load_for_inference(args, overrides)
    if args.prompt:
        prompts = [[{"role": "user", "content": p}] for p in args.prompt]
    else:
        prompts = list(load_task_dataset(config.task, split="test", path=config.dataset_path, size=args.num_prompts,
                                         seed=config.seed)["prompt"])
    device = next(model.parameters()).device
    input_ids, attention_mask = tokenize_prompts(tokenizer, prompts, config.max_prompt_length, device)
    generator = torch.Generator(device).manual_seed(config.seed)
    rollout = policy.sample(model, input_ids, attention_mask, generator)
    for prompt, completion in zip(prompts, completion_texts(tokenizer, rollout)):
        print(f"> {prompt[-1]['content']}\n{completion}\n")
    return 0


def _export(args: argparse.Namespace, overrides: list[str]) -> int:
    import torch

    from dllm_ais.checkpoint import export_merged_model

    if overrides:
        raise SystemExit(f"export takes no config overrides (got {overrides}).")
    path = export_merged_model(args.source, args.output, getattr(torch, args.dtype), args.push_to_hub, args.overwrite)
    print(f"merged model written to {path}" + (f" and pushed to {args.push_to_hub}" if args.push_to_hub else ""))
    return 0


def _sft(args: argparse.Namespace, overrides: list[str]) -> int:
    from pathlib import Path

    from dllm_ais.checkpoint import atomic_directory, check_destination, load_model, load_tokenizer, resolve_dtype
    from dllm_ais.data import load_task_dataset
    from dllm_ais.sft import SFTConfig, run_sft

    if overrides:
        raise SystemExit(f"Unknown sft arguments {overrides}; see `dllm-ais sft --help`.")
    check_destination(Path(args.output_dir), args.overwrite)
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, resolve_dtype(args.dtype))
    mask_id = model.config.mask_token_id if model.config.model_type == "llada" else None
    dataset = load_task_dataset(args.task, split="train", size=args.dataset_size, seed=args.seed)
    config = SFTConfig(steps=args.steps, batch_size=args.batch_size, learning_rate=args.learning_rate,
                       gen_length=args.gen_length, seed=args.seed)
    losses = run_sft(model, tokenizer, dataset, config, mask_token_id=mask_id)
    with atomic_directory(args.output_dir, args.overwrite) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
    print(f"SFT loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps; model written to {args.output_dir}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from dllm_ais.config import describe_fields

    parser = argparse.ArgumentParser(prog="dllm-ais", description=MAIN_HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = commands.add_parser("train", help="GRPO training with FP8 rollouts and AIS (default: tiny embedded run)",
                                description="Train a policy with GRPO. With no recipe: the embedded tiny LLaDA on the "
                                            "digits task, FP8 rollouts, AIS, LoRA — a few minutes on a CPU.",
                                epilog=TRAIN_EPILOG + describe_fields(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("recipe", nargs="?", help="YAML recipe (see recipes/); fields override the defaults")
    train.set_defaults(handler=_train)

    inference = argparse.ArgumentParser(add_help=False)
    inference.add_argument("recipe", nargs="?", help="optional YAML recipe for task/sampler settings")
    inference.add_argument("--model", help="hub id, model dir or adapter dir (default: the recipe's or 'embedded')")
    inference.add_argument("--precision", default="bf16", choices=("bf16", "fp8", "fp8_weight_only"),
                           help="run the model through the rollout engine at this precision")
    inference.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the d1 eval protocol)")

    evaluate = commands.add_parser("eval", parents=[inference], help="mean task reward of a model on held-out prompts",
                                   description="Score a model (or trained adapter) on a task's held-out split. "
                                               "Config fields (task, eval_size, max_completion_length, ...) can be "
                                               "given as --field=value.")
    evaluate.add_argument("--split", default="test")
    evaluate.set_defaults(handler=_eval)

    generate = commands.add_parser("generate", parents=[inference], help="sample completions and print them",
                                   description="Print completions for --prompt texts (or task prompts).")
    generate.add_argument("--prompt", action="append", help="a user message (repeatable)")
    generate.add_argument("--num_prompts", type=int, default=4, help="task prompts to use when no --prompt is given")
    generate.set_defaults(handler=_generate)

    export = commands.add_parser("export", help="merge a LoRA adapter into its base and write a Hub-layout model",
                                 description="Merge an adapter directory (e.g. outputs/dllm-ais/final) into its base "
                                             "model; write safetensors, tokenizer and a model card; optionally push.")
    export.add_argument("source", help="adapter directory (or full model directory)")
    export.add_argument("output", help="output directory")
    export.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    export.add_argument("--push-to-hub", metavar="REPO_ID", help="also upload to this Hub repository")
    export.add_argument("--overwrite", action="store_true",
                        help="replace OUTPUT if it holds an earlier export (a non-empty directory is refused otherwise)")
    export.set_defaults(handler=_export)

    sft = commands.add_parser("sft", help="SFT warm start (LLaDA masked-diffusion loss, or next-token for causal LMs)",
                              description="Supervised fine-tuning on a task's reference answers: the LLaDA "
                                          "masked-diffusion loss for LLaDA models, next-token cross-entropy for "
                                          "causal LMs (used to build the embedded tiny models).")
    sft.add_argument("--model", default="embedded")
    sft.add_argument("--task", default="digits")
    sft.add_argument("--output_dir", default="outputs/sft", help="a new or empty directory")
    sft.add_argument("--overwrite", action="store_true", help="replace --output_dir if an earlier `sft` wrote it")
    sft.add_argument("--steps", type=int, default=500)
    sft.add_argument("--batch_size", type=int, default=64)
    sft.add_argument("--learning_rate", type=float, default=1e-3)
    sft.add_argument("--gen_length", type=int, default=16)
    sft.add_argument("--dataset_size", type=int, default=None)
    sft.add_argument("--dtype", default="auto")
    sft.add_argument("--seed", type=int, default=0)
    sft.set_defaults(handler=_sft)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "urllib3", "datasets", "transformers", "torchao", "torch", "accelerate"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    parser = build_parser()
    args, overrides = parser.parse_known_args(argv)
    from dllm_ais.checkpoint import OutputExistsError
    from dllm_ais.config import ConfigError
    from dllm_ais.rewards import RewardFunctionError

    try:
        return args.handler(args, overrides)
    except (ConfigError, RewardFunctionError, FileNotFoundError, OutputExistsError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
