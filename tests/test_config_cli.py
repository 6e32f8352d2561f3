"""Config validation, recipes, overrides and the `dllm-ais` CLI end to end on the embedded model."""

import dataclasses
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path

import pytest

from dllm_ais.cli import main
from dllm_ais.config import EMBEDDED_RECIPE, ConfigError, GRPOConfig, load_config, parse_overrides

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml")) + [EMBEDDED_RECIPE]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_shipped_recipes_are_valid(recipe):
    assert isinstance(load_config(recipe), GRPOConfig)


def test_overrides_parse_yaml_values():
    assert parse_overrides(["--learning_rate=1.0e-5", "--report_to=[tensorboard]", "--is_clip_low", "null", "beta=0"]) == {
        "learning_rate": 1e-5, "report_to": ["tensorboard"], "is_clip_low": None, "beta": 0}


def test_exponent_without_a_dot_is_a_float():
    config = load_config(EMBEDDED_RECIPE, ["--learning_rate=1e-5", "--correction.ais_kl_scale=2e-3"])
    assert (config.learning_rate, config.correction.ais_kl_scale) == (1e-5, 2e-3)


@pytest.mark.parametrize("overrides, message", [
    (["--learnig_rate=1e-5"], "did you mean 'learning_rate'"),
    (["--num_generations=1"], "num_generations=1"),
    (["--num_generations=4", "--per_device_train_batch_size=6"], "divisible by num_generations"),
    (["--max_completion_length=100"], "multiple of rollout.block_length"),
    (["--beta=abc"], "beta='abc': expected float"),
    (["--correction=magic"], "choose one of none, tis, mis, acr, ais"),
    (["--report_to=[mlflow]"], "supported trackers"),
    (["--rollout.cache=full"], "rollout.cache='full': choose one of none, prefix, dual"),
    (["--rollout.threshold=1.5"], "rollout.threshold=1.5: must be in [0, 1]"),
    (["--eval_steps=2", "--eval_size=0"], "eval_steps=2 scores the validation split: set eval_size > 0"),
    (["--eval_steps=2", "--save_steps=3"], "save_steps=3 must be a multiple of eval_steps=2"),
    (["--num_completions_to_print=0"], "num_completions_to_print=0"),
    (["--drop_zero_std_groups=true", "--beta=0.04"], "drop_zero_std_groups leaves out groups whose KL term"),
    (["--correction.bypass_mode=true", "--correction=ais"],
     "correction.method=ais would see ratios of exactly 1: set correction.method=none"),
    (["--bypass_mode=true", "--correction=none", "--rollout_fidelity=adaptive"],
     "rollout_fidelity=adaptive reads the mismatch before the update"),
])
def test_bad_config_fails_before_any_model_is_loaded(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(EMBEDDED_RECIPE, overrides)


def test_missing_recipe_names_the_fix():
    with pytest.raises(ConfigError, match="not found"):
        load_config("recipes/nope.yaml")


def test_ci_runs_the_readme_test_command():
    readme_commands = re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())
    test_command = next(c for c in readme_commands[:2] if c.endswith("pytest"))
    assert test_command in (ROOT / ".ci" / "run").read_text().splitlines()


def test_train_help_teaches_the_fields_in_groups_one_line_each(capsys):
    from dllm_ais.config_reference import HELP_WIDTH, configuration_reference

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for field in ("--num_generations", "--rollout.precision", "--correction.method", "--correction.ais_kl_scale",
                  "--experimental.rollout_fidelity", "--dry_run"):
        assert field in out
    fields = out[out.index("\nmodel:\n"):]
    headings = [line for line in fields.splitlines() if line and not line.startswith("  ")]
    assert [heading.split(":")[0] for heading in headings] == [
        "model", "data and rewards", "sampling (TRL's names)", "loss", "optimisation", "output and run", "rollout",
        "likelihood", "correction", "experimental"]
    assert all(len(line) <= HELP_WIDTH for line in fields.splitlines())
    assert (ROOT / "docs" / "configuration.md").read_text() == configuration_reference() + "\n", (
        "docs/configuration.md is stale: python -c 'from dllm_ais.config_reference import configuration_reference as r; "
        "print(r())' > docs/configuration.md")


def test_flat_names_of_earlier_releases_load_into_their_groups_with_a_one_line_hint(tmp_path, caplog):
    recipe = tmp_path / "old.yaml"
    recipe.write_text("rollout_cache: dual\nis_clip: 1.5\ncorrection: tis\nlikelihood_order: rollout\n")
    with caplog.at_level("WARNING", logger="dllm_ais.config"):
        config = load_config(recipe, ["--diffusion_steps=16", "--correction.level=sequence"])
    assert (config.rollout.cache, config.rollout.steps, config.experimental.likelihood_order) == ("dual", 16, "rollout")
    assert (config.correction.method, config.correction.clip, config.correction.level) == ("tis", 1.5, "sequence")
    hints = [record.getMessage() for record in caplog.records]
    assert len(hints) == 2 and all("\n" not in hint for hint in hints)
    assert "rollout_cache -> rollout.cache" in hints[0] and "is_clip -> correction.clip" in hints[0]
    assert "diffusion_steps -> rollout.steps" in hints[1]


def test_cli_error_for_bad_override_is_clear(capsys):
    assert main(["train", "--max_stpes=3"]) == 2
    assert "did you mean 'max_steps'" in capsys.readouterr().err


@pytest.mark.parametrize("argv, positional, overrides", [
    (["train", "--max_steps", "2"], None, {"max_steps": 2}),
    (["train", "recipe.yaml", "--max_steps", "2", "--rollout.precision", "fp8"], "recipe.yaml",
     {"max_steps": 2, "rollout": {"precision": "fp8"}}),
    (["train", "--dry_run", "recipe.yaml", "--correction.clip_low", "-0.2"], "recipe.yaml",
     {"dry_run": True, "correction": {"clip_low": -0.2}}),
    (["train", "--dry_run", "false", "--resume_from_checkpoint", "--verbose"], None,
     {"dry_run": False, "resume_from_checkpoint": True}),
    (["train", "--resume_from_checkpoint", "out/checkpoint-3", "--rollout_cache", "dual"], None,
     {"resume_from_checkpoint": "out/checkpoint-3", "rollout_cache": "dual"}),
    (["eval", "--model", "DIR", "--max_completion_length", "8", "--temp", "0.5", "recipe.yaml"], "recipe.yaml",
     {"max_completion_length": 8}),
    (["generate", "--rollout.precision", "fp8", "--prompt", "sort 3 1"], None, {"rollout": {"precision": "fp8"}}),
    (["compare", "--max_steps", "2", "study.yaml", "--seeds", "2"], "study.yaml", {"max_steps": 2}),
], ids=["train", "recipe", "boolean-alone", "boolean-before-a-flag", "value-or-true", "eval", "generate", "compare"])
def test_every_command_takes_key_space_value_as_well_as_key_equals_value(argv, positional, overrides):
    """`--key value` as TRL's, transformers' and accelerate's parsers take it; a boolean field alone is true."""
    from dllm_ais.cli import build_parser, with_overrides_joined

    parser = build_parser()
    args, extras = parser.parse_known_args(with_overrides_joined(parser, argv))
    assert vars(args).get("recipe", vars(args).get("study")) == positional
    assert load_values(extras) == overrides


def load_values(extras):
    """The overrides `extras` as `load_config` sets them (groups nested)."""
    from dllm_ais.config import set_override

    values = {}
    for key, value in parse_overrides(extras).items():
        set_override(values, key, value)
    return values


def test_train_with_space_separated_values_reaches_the_config(capsys):
    """`dllm-ais train --max_steps 2` used to answer "Recipe '2' not found"."""
    assert main(["train", "--max_steps", "2", "--num_generations", "1"]) == 2
    error = capsys.readouterr().err
    assert "num_generations=1" in error and "Recipe" not in error


def test_a_value_flag_alone_is_one_line_naming_it(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--rollout.precision", "--max_steps=2"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == ("error: --rollout.precision has no value: write --rollout.precision VALUE or "
                                       "--rollout.precision=VALUE.\n")


def test_cli_train_eval_generate_export_on_the_embedded_model(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", f"--output_dir={out}", "--max_steps=2", "--eval_size=4", "--num_iterations=1"]) == 0
    text = capsys.readouterr()
    assert "held-out reward: before" in text.out + text.err
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["step"] == 1 and "ais/alpha" in records[0] and "eval/reward" in records[-1]
    assert "eval/accuracy" in records[-1] and "eval/accuracy_before" in records[-1]
    assert (out / "metrics.png").is_file() and (out / "final" / "adapter_config.json").is_file()

    assert main(["eval", "--model", str(out / "final"), "--limit=4", "--output", str(tmp_path / "eval.json")]) == 0
    assert "| gen length | accuracy (%) |" in capsys.readouterr().out
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["task"] == "digits" and len(report["model"]["base_model"]["content_sha256"]) == 64
    assert main(["generate", "--model", str(out / "final"), "--prompt", "sort 3 1 2", "--precision", "fp8"]) == 0
    assert "> sort 3 1 2" in capsys.readouterr().out
    assert main(["export", str(out / "final"), str(tmp_path / "merged")]) == 0
    assert (tmp_path / "merged" / "model.safetensors").is_file() and (tmp_path / "merged" / "README.md").is_file()
    merged_config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert merged_config["model_type"] == "llada"


@pytest.mark.parametrize("recipe, family", [("llada8b_gsm8k_lora_fp8_ais.yaml", "diffusion"),
                                            ("llada8b_gsm8k_ar_order.yaml", "diffusion"),
                                            ("dream7b_gsm8k_lora_fp8_ais.yaml", "diffusion"),
                                            ("sdar8b_gsm8k_lora_fp8_ais.yaml", "diffusion"),
                                            ("llada2_mini_gsm8k_lora_fp8_ais.yaml", "diffusion"),
                                            ("qwen3_8b_gsm8k_lora_fp8_ais.yaml", "autoregressive")])
def test_dry_run_of_the_gpu_recipes_runs_one_step_on_cpu(capsys, monkeypatch, tmp_path, recipe, family):
    """Offline, as CI runs (the Hub is not reached: without this each run waited ~20 s on it before falling back to
    the model's name)."""
    import dllm_ais.dry_run

    def offline(*args, **kwargs):
        raise OSError("offline: the Hub is not reachable")

    monkeypatch.setattr(dllm_ais.dry_run, "load_model_config", offline)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert main(["train", str(ROOT / "recipes" / recipe), "--dry_run=true"]) == 0
    out = capsys.readouterr().out
    assert "dry run OK" in out and f"policy={family}" in out
    assert list(tmp_path.iterdir()) == []  # the stand-in's scratch run is removed


def test_a_dream_recipe_gets_a_dream_stand_in():
    from dllm_ais.dry_run import recipe_model_type, stand_in_model
    from dllm_ais.loading import load_tokenizer

    config = load_config(ROOT / "recipes" / "dream7b_gsm8k_lora_fp8_ais.yaml")
    assert recipe_model_type(dataclasses.replace(config, model_name_or_path="/nonexistent/Dream-v0-Instruct-7B")) == "Dream"
    stand_in = stand_in_model(True, load_tokenizer("embedded"), "Dream")
    assert stand_in.config.model_type == "Dream" and stand_in.config.mask_token_id is not None


def test_an_sdar_recipe_gets_an_sdar_stand_in_in_the_models_blocks():
    from dllm_ais.dry_run import recipe_model_type, stand_in_model
    from dllm_ais.loading import load_tokenizer

    config = load_config(ROOT / "recipes" / "sdar8b_gsm8k_lora_fp8_ais.yaml")
    assert recipe_model_type(dataclasses.replace(config, model_name_or_path="/nonexistent/SDAR-8B-Chat")) == "sdar"
    tokenizer = load_tokenizer("embedded")
    stand_in = stand_in_model(True, tokenizer, "sdar", block_size=config.rollout.block_length)
    assert stand_in.config.model_type == "sdar" and stand_in.config.block_size == config.rollout.block_length == 4
    assert stand_in_model(True, tokenizer, "sdar", block_size=8).config.block_size == 8
    assert stand_in.config.mask_token_id == tokenizer.mask_token_id
    assert (config.rollout.cache, config.likelihood.estimator, config.rollout.steps) == ("dual", "trajectory", 256)


def test_a_llada2_recipe_gets_a_llada2_moe_stand_in_in_the_models_blocks():
    """LLaDA2.0-mini's name is taken for llada2_moe (not LLaDA) offline; the stand-in is a tiny LLaDA2 MoE in the
    recipe's blocks, with experts the FP8 engine quantizes and LoRA adapts (no dropout)."""
    from dllm_ais.dry_run import recipe_model_type, stand_in_model
    from dllm_ais.loading import load_tokenizer

    config = load_config(ROOT / "recipes" / "llada2_mini_gsm8k_lora_fp8_ais.yaml")
    offline = dataclasses.replace(config, model_name_or_path="/nonexistent/LLaDA2.0-mini")
    assert recipe_model_type(offline) == "llada2_moe"
    tokenizer = load_tokenizer("embedded")
    stand_in = stand_in_model(True, tokenizer, "llada2_moe", block_size=8)
    assert stand_in.config.model_type == "llada2_moe" and stand_in.config.block_size == 8
    assert stand_in.config.num_experts == 4 and stand_in.config.mask_token_id == tokenizer.mask_token_id
    assert (config.rollout.block_length, config.rollout.threshold, config.lora_dropout) == (32, 0.95, 0.0)


TINY_LLADA2 = ROOT / "recipes" / "tiny_llada2_digits.yaml"
EDITING = ["--rollout.editing_threshold=0.5", "--rollout.threshold=0.7"]


@pytest.mark.parametrize("overrides, message", [
    (["--rollout.editing_threshold=0.5"],
     "rollout.editing_threshold=0.5 edits while the threshold rule fills the masks: set rollout.threshold"),
    ([*EDITING, "--experimental.rollout_position_temperature=0.5"],
     "rollout.editing_threshold with experimental.rollout_position_temperature=0.5: a drawn commit choice is not "
     "defined for edits"),
    ([*EDITING, "--experimental.complete_ratio=true", "--likelihood.estimator=trajectory"],
     "rollout.editing_threshold with experimental.complete_ratio: the commit ratio has no term for edits"),
    ([*EDITING, "--likelihood.estimator=trajectory", "--experimental.likelihood_decoder=exact"],
     "likelihood.estimator=trajectory here replays the exact decoder, which cannot reproduce the edits"),
    ([*EDITING, "--likelihood.estimator=trajectory", "--experimental.likelihood_order=exact"],
     "likelihood.estimator=trajectory here replays the exact decoder"),
    ([*EDITING, "--likelihood.estimator=step_merge"], "likelihood.estimator=step_merge here replays the exact decoder"),
])
def test_token_editing_refusals_are_one_line_naming_the_setting_and_the_fix(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(TINY_LLADA2, overrides)
    lines = [line for line in str(error.value).splitlines() if message in line]
    assert len(lines) == 1 and "rollout.editing_threshold" in lines[0], str(error.value)


def test_token_editing_settings_reach_the_sampler_and_held_out_validation_decodes_without_them():
    """LLaDA2.1's editing decoder as run settings on the tiny LLaDA2 recipe: the rollouts' sampler edits, the trajectory
    estimator replays that decoder (even without a cache), held-out validation (d1's exact decoder) and the exact
    sampler do not edit, the greedy copy of the rollout sampler (eval/rollout_sampler/*) does; a family that is not
    block-causal is refused when the policy is built."""
    from transformers import AutoConfig

    from dllm_ais.config import EMBEDDED_MODELS
    from dllm_ais.loading import load_tokenizer
    from dllm_ais.policy import build_policy

    config = load_config(TINY_LLADA2, [*EDITING, "--rollout.max_post_steps=3"])
    assert (config.rollout.editing_threshold, config.rollout.max_post_steps) == (0.5, 3)
    tokenizer = load_tokenizer("embedded-llada2")
    model_config = AutoConfig.from_pretrained(EMBEDDED_MODELS["embedded-llada2"])
    sampler_config = build_policy(config, model_config, tokenizer).sampler_config
    assert (sampler_config.editing_threshold, sampler_config.max_post_steps, sampler_config.threshold) == (0.5, 3, 0.7)
    assert sampler_config.exact().editing_threshold is None
    assert build_policy(config.decoding(exact=True), model_config, tokenizer).sampler_config.editing_threshold is None
    assert build_policy(config.decoding(exact=False), model_config, tokenizer,
                        temperature=0.0).sampler_config.editing_threshold == 0.5
    uncached = load_config(TINY_LLADA2, [*EDITING, "--rollout.cache=none", "--likelihood.estimator=trajectory"])
    assert uncached.replays_decoder
    assert build_policy(uncached, model_config, tokenizer).replays_decoder
    from dllm_ais.policy import DiffusionPolicy
    with pytest.raises(ValueError, match="here replays the exact decoder"):  # the library's policy refuses it too
        DiffusionPolicy(sampler_config, likelihood=uncached.likelihood, likelihood_decoder="exact")
    llada = dataclasses.replace(config, model_name_or_path="embedded")
    with pytest.raises(ConfigError, match=r"rollout.editing_threshold needs a block-causal family \(LLaDA2.x\), and "
                                          "model_type 'llada' is not one"):
        build_policy(llada, AutoConfig.from_pretrained(EMBEDDED_MODELS["embedded"]), load_tokenizer("embedded"))


@pytest.mark.slow
def test_cli_trains_the_tiny_qwen3_through_the_shared_loop(tmp_path, capsys):
    out = tmp_path / "qwen3"
    assert main(["train", str(ROOT / "recipes" / "tiny_qwen3_digits_fp8_ais.yaml"), f"--output_dir={out}",
                 "--max_steps=2", "--eval_size=4", "--num_iterations=1"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["rollout_corr/k3_kl"] > 0 and 0 <= records[0]["ais/alpha"] <= 1
    assert "held-out reward: before" in capsys.readouterr().out


def test_ending_the_process_group_frees_the_ddp_model_a_reference_cycle_holds():
    """After a finished run the group's end frees the DDP wrapper that reference cycles keep alive (a trainer and its
    parts make them), so gloo's backend is torn down there and not during the interpreter's exit."""
    import torch
    import torch.distributed as dist

    from dllm_ais.launch import end_process_group

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs a fresh torch.distributed")
    gc.disable()  # no collection but the one under test
    try:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        run = {"model": torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))}
        run["run"] = run
        model = weakref.ref(run["model"])
        del run
        assert model() is not None
        end_process_group(finished=True)
        assert model() is None and not dist.is_initialized()
    finally:
        gc.enable()
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.slow  # two processes per run
@pytest.mark.parametrize("estimator", [
    (),  # the shipped one-step estimator
    ("--likelihood_estimator=trajectory", "--rollout_threshold=null"),  # a backward per denoising step, in step
    ("--likelihood_estimator=trajectory",),  # the cached decoder replayed: a backward per block, in step
    # the exact model replaying parallel decoding: one backward per micro-batch on every process
    ("--likelihood_estimator=trajectory", "--likelihood_decoder=exact"),
    # one model, the engine's numerics in the trainer: LoRA beside the quantized base, and full fine-tuning (QAT)
    ("--rollout.precision_flow=unified", "--rollout.precision=mxfp4"),
    ("--rollout.precision_flow=unified", "--use_peft=false", "--likelihood_estimator=trajectory"),
], ids=["one_step", "trajectory-per-step-backward", "trajectory-decoder-replay", "trajectory-parallel-decoding",
        "unified-lora", "unified-full-fine-tuning"])
def test_two_process_ddp_run_through_accelerate_launch(tmp_path, estimator):
    """The same loop under `accelerate launch` with 2 CPU processes (gloo): gathers, slicing, accumulation, saving;
    with the trajectory estimator, the backward per forward keeps both processes' all-reduces in step."""
    out = tmp_path / "ddp"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2", "--num_machines",
               "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "dllm_ais.cli", "train",
               "--max_steps=2", "--eval_size=0", "--num_iterations=1", "--per_device_train_batch_size=8",
               "--gradient_accumulation_steps=2", *estimator, f"--output_dir={out}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    # the failing rank's own traceback comes before the launchers' summaries at the end
    assert result.returncode == 0, result.stderr[:4000] + "\n[...]\n" + result.stderr[-2000:]
    # accelerate's --cpu launcher starts one process without mpirun; the CLI re-launches the command as two.
    assert "distributed run: 2 processes (MULTI_CPU)" in result.stderr, result.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]  # one writer
    assert (out / "final" / ("model.safetensors" if "--use_peft=false" in estimator
                             else "adapter_model.safetensors")).is_file()
    if "--rollout.precision_flow=unified" in estimator:  # the ratio of one flow, over both processes' completions
        assert all(r["rollout_corr/k3_kl"] == pytest.approx(0.0, abs=1e-6) for r in records)


RANKS_PREPARE = """\
import os, sys, time
from pathlib import Path

import dllm_ais.checkpoint_choice as checkpoint_choice
import dllm_ais.run_lock as run_lock
from dllm_ais.config import EMBEDDED_RECIPE, load_config
from dllm_ais.launch import end_process_group
from dllm_ais.trainer import GRPOTrainer

run, rank = Path(sys.argv[1]), int(os.environ["RANK"])
if rank == 0:  # the main process renames its lock record in late: the record's staging file stays a while
    rename = os.replace
    def late_rename(source, target):
        if Path(target).name == run_lock.LOCK_FILE:
            time.sleep(3)
        rename(source, target)
    os.replace = late_rename
else:  # the other process checks the directory once the main one has begun writing its lock record there
    resume_checkpoint = checkpoint_choice.resume_checkpoint
    def resume_checkpoint_once_recorded(*args, **kwargs):
        while not (run.is_dir() and any(run_lock.LOCK_FILE in p.name for p in run.iterdir())):
            time.sleep(0.01)
        return resume_checkpoint(*args, **kwargs)
    checkpoint_choice.resume_checkpoint = resume_checkpoint_once_recorded
GRPOTrainer(load_config(EMBEDDED_RECIPE, [f"--output_dir={run}", "--eval_size=0", "--per_device_train_batch_size=8"]))
print(f"process {rank}: prepared", flush=True)
end_process_group()
"""


@pytest.mark.slow  # two processes
def test_the_other_processes_check_the_output_dir_once_the_main_one_has_prepared_it(tmp_path):
    """The main process writes into a new output_dir while taking it (its lock record is staged beside the record,
    then renamed in): the other processes, started at the same time, must not meet its half-made entries and refuse
    an empty directory (a DDP run then failed on one rank, now and then)."""
    script = tmp_path / "ranks_prepare.py"
    script.write_text(RANKS_PREPARE)
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             str(script), str(tmp_path / "run")], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[:4000] + "\n[...]\n" + result.stderr[-2000:]
    assert sorted(re.findall(r"process \d: prepared", result.stdout)) == ["process 0: prepared", "process 1: prepared"]
