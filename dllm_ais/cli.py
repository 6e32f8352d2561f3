"""`dllm-ais`: train, evaluate, generate, export and warm-start (SFT) from the command line: the parser, one small
function per command, and the dispatch (the commands themselves: `dllm_ais.commands`, `dllm_ais.inference_commands`).
"""

from __future__ import annotations

import argparse
import sys

from dllm_ais.choices import EVAL_PROTOCOLS, PRECISION_FLOWS, PRECISIONS, SFT_MASKINGS
from dllm_ais.commands import run_bench, run_compare, run_export, run_lm_eval, run_sft, run_train
from dllm_ais.inference_commands import comma_separated_ints, run_eval, run_generate


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


BENCHMARKS = {  # `dllm-ais bench NAME` -> what it measures; the module dllm_ais.bench.NAME runs it
    "rollout": "fast diffusion decoders (KV cache, parallel decoding, AR order) against the official algorithm",
    "sampler": "the diffusion sampler's overhead over bare forwards, and the rollout engine's weight sync",
    "mismatch": "token and sequence KL / ESS between the trainer and the rollout engine, per precision",
    "routing": "MoE routing disagreement between engine and trainer per precision: split, replayed, unified",
    "memory": "peak memory of likelihood scoring + backward per diffusion estimator and step count",
    "step": "one GRPO step: rollout and correction shares, and the log-prob pass's peak memory",
    "precision": "the precision ladder on one CUDA GPU at LLaDA-8B's shape: rollout tokens/s, sync, step memory",
}


def build_parser() -> argparse.ArgumentParser:
    """The `dllm-ais` parser: one sub-parser per command, each added by its own function below."""
    parser = argparse.ArgumentParser(prog="dllm-ais", description=MAIN_HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parser.commands = commands  # for `with_overrides_joined`
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--verbose", action="store_true", help="also show the libraries' warnings and progress bars")
    inference = inference_options(common)
    add_train_command(commands, common)
    add_eval_command(commands, inference)
    add_generate_command(commands, inference)
    add_export_command(commands, common)
    add_sft_command(commands, common)
    add_lm_eval_command(commands)
    add_compare_command(commands, common)
    add_bench_command(commands, common)
    return parser


def add_train_command(commands, common: argparse.ArgumentParser) -> None:
    """`dllm-ais train [RECIPE] [--field=value ...]`: the config's fields as options, listed in the help."""
    from dllm_ais.config_reference import describe_fields

    train = commands.add_parser("train", parents=[common],
                                help="GRPO training with FP8 rollouts and AIS (default: tiny embedded run)",
                                description="Train a policy with GRPO. With no recipe: the embedded tiny LLaDA on the "
                                            "digits task, FP8 rollouts, AIS, LoRA — a few minutes on a CPU.",
                                epilog=TRAIN_EPILOG + describe_fields(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("recipe", nargs="?", help="YAML recipe (see recipes/); fields override the defaults")
    train.set_defaults(handler=run_train)


def inference_options(common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options eval and generate share: a recipe, the model, its rollout precision and precision flow, and the
    temperature."""
    inference = argparse.ArgumentParser(add_help=False, parents=[common])
    inference.add_argument("recipe", nargs="?", help="optional YAML recipe for task/sampler settings")
    inference.add_argument("--model", help="hub id, model dir or adapter dir (default: the recipe's or 'embedded')")
    inference.add_argument("--precision", default="bf16", choices=PRECISIONS,
                           help="run the model through the rollout engine at this precision")
    inference.add_argument("--precision_flow", default="split", choices=PRECISION_FLOWS,
                           help="split: an adapter merged in, the whole model quantized (a split run's engine); "
                                "unified: the base quantized, an adapter beside it in high precision (as a unified run "
                                "samples and evaluates)")
    inference.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the d1 eval protocol)")
    return inference


def add_eval_command(commands, inference: argparse.ArgumentParser) -> None:
    """`dllm-ais eval`: a model's accuracy on a task's split, with a decoding protocol."""
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
                               "default for an SDAR model), or llada2: LLaDA2's own (the same at threshold 0.95; the "
                               "default for a LLaDA2 model)")
    evaluate.add_argument("--gen_lengths", type=comma_separated_ints,
                          help="comma-separated completion lengths (default: the task's, 128,256,512)")
    evaluate.add_argument("--block_length", type=int, help="diffusion block length (default: the task's, 32)")
    evaluate.add_argument("--batch_size", type=int,
                          help="prompts per batch (default: per_device_eval_batch_size, else per_device_train_batch_size)")
    evaluate.add_argument("--limit", type=int, help="score only this many prompts (seeded subset; not the protocol)")
    evaluate.add_argument("--output", help="JSON report path (default: eval_results/<task>-<model>-<time>.json)")
    evaluate.set_defaults(handler=run_eval)


def add_generate_command(commands, inference: argparse.ArgumentParser) -> None:
    """`dllm-ais generate`: print completions of prompts."""
    generate = commands.add_parser("generate", parents=[inference], help="sample completions and print them",
                                   description="Print completions for --prompt texts (or task prompts).")
    generate.add_argument("--prompt", action="append", help="a user message (repeatable)")
    generate.add_argument("--num_prompts", type=int, default=4, help="task prompts to use when no --prompt is given")
    generate.set_defaults(handler=run_generate)


def add_export_command(commands, common: argparse.ArgumentParser) -> None:
    """`dllm-ais export SOURCE OUTPUT`: merge an adapter and write (and upload) a Hub-layout model."""
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
    export.set_defaults(handler=run_export)


def add_sft_command(commands, common: argparse.ArgumentParser) -> None:
    """`dllm-ais sft`: the supervised warm start."""
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
    sft.set_defaults(handler=run_sft)


def add_lm_eval_command(commands) -> None:
    """`dllm-ais lm-eval ...`: the lm-evaluation-harness CLI with this library's model; every argument is the
    harness's."""
    lm_eval = commands.add_parser(
        "lm-eval", add_help=False, help="lm-evaluation-harness on any task, with this library's model (needs [lm-eval])",
        description="Forwards every argument to the lm_eval CLI with --model dllm_ais (registered; the default), "
                    "e.g. dllm-ais lm-eval --model_args pretrained=outputs/dllm-ais/final --tasks arc_easy. "
                    "See docs/lm-eval.md; `dllm-ais lm-eval --help` prints the harness's options.")
    lm_eval.set_defaults(handler=run_lm_eval, verbose=False)


def add_compare_command(commands, common: argparse.ArgumentParser) -> None:
    """`dllm-ais compare STUDY`: a study's arms x seeds, paired against its baseline."""
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
    compare.set_defaults(handler=run_compare)


def add_bench_command(commands, common: argparse.ArgumentParser) -> None:
    """`dllm-ais bench NAME`: each benchmark parses (and documents) its own options."""
    bench = commands.add_parser("bench", parents=[common], help="benchmarks: ratios measured in one run, printed "
                                "beside the device and settings", description="Run a benchmark; `dllm-ais bench NAME "
                                "--help` lists its options.")
    benchmarks = bench.add_subparsers(dest="benchmark", required=True, metavar="NAME")
    for name, summary in BENCHMARKS.items():  # each benchmark parses (and documents) its own options
        benchmarks.add_parser(name, add_help=False, help=summary).set_defaults(handler=run_bench)


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
