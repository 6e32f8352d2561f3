"""Config validation before anything loads: declared ranges, a fuzz of every field, safe YAML, unknown-key hints,
paths, trackers, run-start checks, and a light, quiet CLI."""

import dataclasses
import json
import math
import operator
import os
import re
import subprocess
import sys
import typing
from types import SimpleNamespace

import pytest
from accelerate.utils import DistributedType

from dllm_ais import trackers
from dllm_ais.config import EMBEDDED_RECIPE, SETTINGS_GROUPS, ConfigError, GRPOConfig, load_config
from dllm_ais.console import LIBRARY_SWITCHES
from dllm_ais.launch import (check_processes, check_prompt_lengths, check_run_environment, process_problems,
                             sharding_problems)
from dllm_ais.validation import FOREIGN_KEYS, MAX_PROBLEM_LENGTH, Interval, accepts_float, numeric_fields_without_range

# Every field a recipe can set: the top level, and each settings group's as `group.field`
DECLARED = [("", f, typing.get_type_hints(GRPOConfig)[f.name]) for f in dataclasses.fields(GRPOConfig)] + [
    (f"{name}.", f, typing.get_type_hints(group)[f.name])
    for name, group in SETTINGS_GROUPS.items() for f in dataclasses.fields(group)]
FIELDS = [prefix + f.name for prefix, f, _ in DECLARED]
HINTS = {prefix + f.name: hint for prefix, f, hint in DECLARED}
FUZZ_VALUES = [None, True, False, 0, 1, -1, 2, 3, 10**18, -(10**18), 10**400, 0.5, -0.5, 1e-300, 1e300, -1e300,
               math.nan, math.inf, -math.inf, "", "   ", "abc", "1e-5", "nan", "x" * 100_000, "./no/such/dir", [], [1],
               [-1.0], ["x"], [math.nan], [""], [0] * 10_000, {"a": 1}]


def problems_of(overrides) -> str:
    with pytest.raises(ConfigError) as error:
        load_config(EMBEDDED_RECIPE, overrides)
    return str(error.value)


def test_every_numeric_field_declares_a_range():
    for cls in (GRPOConfig, *SETTINGS_GROUPS.values()):
        assert numeric_fields_without_range(cls) == [], cls.__name__
    for _, f, _ in DECLARED:
        if "range" in f.metadata:
            Interval.parse(f.metadata["range"])


def test_intervals():
    unit = Interval.parse("(0, 1]")
    assert 1 in unit and 0.5 in unit and 0 not in unit and math.nan not in unit
    positive = Interval.parse("[1, inf)")
    assert 10**30 in positive and math.inf not in positive and positive.describe() == "must be >= 1"
    assert Interval.parse("(-inf, inf)").describe() == "must be a finite number"
    with pytest.raises(ValueError):
        Interval.parse("[0, inf]")


@pytest.mark.parametrize("name", FIELDS)
def test_fuzz_every_field_is_accepted_valid_or_rejected_naming_it(name):
    """Wrong types, NaN, inf, negatives, zeros, huge and empty values: load_config accepts a valid config or raises
    ConfigError naming the field, with a short message; nothing else escapes, nothing is loaded."""
    for value in FUZZ_VALUES:
        try:
            config = load_config(EMBEDDED_RECIPE, {name: value})
        except ConfigError as error:
            message = str(error)
            assert name in message, (value, message)
            assert len(message) < 3 * MAX_PROBLEM_LENGTH
            continue
        accepted = operator.attrgetter(name)(config)
        items = accepted if isinstance(accepted, list) else [accepted]
        assert config.problems() == []
        assert not any(isinstance(item, float) and not math.isfinite(item) for item in items), (name, value)
        assert not any(isinstance(item, str) and not item.strip() for item in items), (name, value)


@pytest.mark.parametrize("name", [prefix + f.name for prefix, f, _ in DECLARED if "range" in f.metadata])
def test_values_outside_the_declared_range_are_rejected(name):
    interval = Interval.parse(next(f for prefix, f, _ in DECLARED if prefix + f.name == name).metadata["range"])
    is_float = accepts_float(HINTS[name])
    step = 1e-3 if is_float else 1
    outside = [interval.low - step if interval.low_closed else interval.low]
    if not math.isinf(interval.high):
        outside.append(interval.high + step if interval.high_closed else interval.high)
    if is_float:
        outside += [math.nan, math.inf, -math.inf]
    for value in outside:
        assert f"{name}=" in problems_of({name: [value] if "list" in str(HINTS[name]) else value}), value


@pytest.mark.parametrize("overrides, message", [
    # the audit's accepted-but-invalid values, each now rejected naming its field
    ({"max_grad_norm": -1}, "max_grad_norm=-1: must be > 0"),
    ({"max_grad_norm": math.nan}, "max_grad_norm=nan"),
    ({"learning_rate": math.inf}, "learning_rate=inf"),
    ({"logging_steps": 0}, "logging_steps=0: must be >= 1"),
    ({"lora_r": 0}, "lora_r=0"),
    ({"lora_alpha": 0}, "lora_alpha=0: must be in (0, 65536]"),
    ({"rollout.steps": 0}, "rollout.steps=0"),
    ({"save_steps": -1}, "save_steps=-1"),
    ({"output_dir": ""}, "output_dir='': must not be blank"),
    ({"reward_weights": [math.nan], "reward_funcs": ["digits_reward"]}, "reward_weights=[nan]"),
    ({"temperature": math.inf}, "temperature=inf"),
    ({"reward_funcs": ["digits_rewrad"]}, "reward_funcs: 'digits_rewrad': unknown reward function"),
    ({"reward_funcs": ["module_without_function:"]}, "reward_funcs: 'module_without_function:'"),
    ({"remasking": "lowest_confidence"}, "remasking='lowest_confidence'"),
    ({"task": "sudoku"}, "task=sudoku has no default dataset"),
    ({"rollout.steps": 32}, "rollout.steps=32 must be <= max_completion_length=16"),
    ({"likelihood_order": "exact"}, "likelihood_order=exact orders the trajectory estimator's replay"),
    ({"experimental.likelihood_block_fraction": 0.5}, "experimental.likelihood_block_fraction=0.5 scores a random "
     "share of the denoising trajectory's blocks, which likelihood.estimator=one_step does not replay"),
    ({"likelihood_block_fraction": 0}, "likelihood_block_fraction=0: must be in (0, 1]"),
    ({"likelihood_estimator": "trajectory", "likelihood_block_fraction": 0.5, "ratio_type": "ctpo"},
     "ratio_type=ctpo's prefix needs every token"),
    ({"likelihood_estimator": "trajectory", "rollout_cache": "dual", "rollout_exact_fraction": 0.5},
     "likelihood_decoder=rollout replays every completion with the configured (cached) decoder"),
])
def test_invalid_values_fail_in_load_config_naming_the_field(overrides, message):
    assert message in problems_of(overrides)


def test_block_length_zero_is_blamed_on_itself_and_all_problems_come_at_once():
    message = problems_of(["--rollout.block_length=0", "--lora_r=0", "--reward_funcs=[nope]", "--num_train_epochs=3"])
    assert "rollout.block_length=0: must be >= 1" in message and "rollout.steps" not in message
    assert "lora_r=0" in message and "'nope'" in message and "num_train_epochs" in message


def test_huge_values_are_never_printed_whole():
    message = problems_of({"remasking": "x" * 1_000_000, "reward_funcs": ["y" * 1_000_000], "task": "z" * 1_000_000})
    assert len(message) < 4 * MAX_PROBLEM_LENGTH


def test_unknown_keys_get_hints_never_a_field_of_different_meaning():
    message = problems_of(["--num_train_epochs=3", "--total_training_steps=2", "--epsilon_low=0.2",
                           "--learnig_rate=1e-5"])
    assert "num_iterations" not in message and "there are no epochs" in message
    assert "unknown key 'total_training_steps': use max_steps" in message
    assert "did you mean 'epsilon_high'" not in message and "the lower clip is epsilon" in message
    assert "did you mean 'learning_rate'" in message
    assert not set(FOREIGN_KEYS) & set(FIELDS), "a foreign name became a field: drop its hint"


def test_local_model_paths_that_do_not_exist_are_reported_at_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs").mkdir()
    (tmp_path / "empty").mkdir()
    for name in ("./model", "../model", "/no/such/model", "~/no-such-model-dir", "outputs/typo", "a/b/c"):
        assert "no such directory" in problems_of({"model_name_or_path": name}), name
    assert "no config.json" in problems_of({"model_name_or_path": "empty"})
    assert "valid Hub id" in problems_of({"model_name_or_path": "not a hub id"})
    assert load_config(EMBEDDED_RECIPE, {"model_name_or_path": "GSAI-ML/LLaDA-8B-Instruct"})  # no network needed
    assert problems_of({"dataset_path": "missing.jsonl", "task": "gsm8k"}).count("dataset_path='missing.jsonl'") == 1


def test_tilde_paths_are_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert load_config(EMBEDDED_RECIPE, {"output_dir": "~/runs/a"}).output_dir == str(tmp_path / "runs" / "a")


def test_yaml_errors_are_one_line_with_file_line_and_column(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_steps: 3\n  oops: [1\n")
    with pytest.raises(ConfigError, match=r"^.*bad\.yaml:2:7: [^\n]+$"):
        load_config(bad)
    duplicate = tmp_path / "dup.yaml"
    duplicate.write_text("max_steps: 3\nmax_steps: 4\n")
    with pytest.raises(ConfigError, match=r"dup\.yaml:2:1: key 'max_steps' appears twice"):
        load_config(duplicate)


def test_python_tags_are_refused_and_never_run(tmp_path):
    marker = tmp_path / "ran"
    recipe = tmp_path / "evil.yaml"
    recipe.write_text(f'learning_rate: !!python/object/apply:os.system ["touch {marker}"]\n')
    with pytest.raises(ConfigError, match=r"evil\.yaml:1:16: Python tags \(!!python/\.\.\.\) are not allowed"):
        load_config(recipe)
    with pytest.raises(ConfigError, match="Python tags"):
        load_config(EMBEDDED_RECIPE, [f'--beta=!!python/object/apply:os.system ["touch {marker}"]'])
    assert not marker.exists()


def test_billion_laughs_is_refused_without_expanding(tmp_path):
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]  # 9^10 strings if expanded
    recipe = tmp_path / "bomb.yaml"
    recipe.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=r"bomb\.yaml:2:\d+: YAML aliases \(\*name\) are not allowed"):
        load_config(recipe)


def test_oversized_recipe_is_refused(tmp_path):
    recipe = tmp_path / "big.yaml"
    recipe.write_text("# " + "x" * (2 << 20) + "\n")
    with pytest.raises(ConfigError, match="a recipe is a small YAML mapping"):
        load_config(recipe)


# ------------------------------------------------------------------------------------------------- trackers
@pytest.mark.parametrize("value, expected", [
    ("tensorboard", ["tensorboard"]), (["wandb", "tensorboard"], ["wandb", "tensorboard"]), ("none", []),
    (["none"], []), (None, []), ("all", ["tensorboard"]),
])
def test_report_to_takes_trls_forms(monkeypatch, value, expected):
    monkeypatch.setattr(trackers, "tracker_installed", lambda name: name == "tensorboard")
    assert load_config(EMBEDDED_RECIPE, {"report_to": value}).report_to == expected


def test_a_missing_tracker_stops_the_run_before_the_model_loads(monkeypatch, tmp_path):
    import dllm_ais.components as components
    import dllm_ais.trainer as trainer_module

    monkeypatch.setattr(trackers, "tracker_installed", lambda name: False)
    monkeypatch.setattr(components, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    config = load_config(EMBEDDED_RECIPE, {"report_to": "tensorboard", "output_dir": str(tmp_path)})
    with pytest.raises(ConfigError, match=r'tensorboard is not installed; pip install "dllm-ais\[trackers\]"'):
        trainer_module.GRPOTrainer(config)


def test_run_name_names_the_tracker_run():
    assert trackers.tracker_init_kwargs(None, "outputs/my-run")["wandb"] == {"name": "my-run"}
    assert trackers.tracker_init_kwargs("ablation-3", "outputs/my-run")["trackio"] == {"name": "ablation-3"}


# ------------------------------------------------------------------------------------------------- run start
def test_a_launch_accelerate_did_not_initialise_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    (problem,) = process_problems(num_processes=1)
    assert "ACCELERATE_USE_CPU=true" in problem and "accelerate launch --cpu --num_processes 2" in problem
    assert process_problems(num_processes=2) == []
    with pytest.raises(ConfigError, match="WORLD_SIZE=2"):
        check_processes(SimpleNamespace(num_processes=1, is_main_process=True, distributed_type=DistributedType.NO,
                                        state=SimpleNamespace()))


def test_an_fsdp_launch_of_version_1_is_refused_with_the_setting_that_fixes_it():
    def launch(version):
        return SimpleNamespace(num_processes=1, is_main_process=True, distributed_type=DistributedType.FSDP,
                               state=SimpleNamespace(fsdp_plugin=SimpleNamespace(fsdp_version=version)))

    (problem,) = sharding_problems(launch(1))
    assert "FSDP version 1" in problem and "fsdp_version: 2" in problem
    with pytest.raises(ConfigError, match="recipes/accelerate/fsdp.yaml"):
        check_processes(launch(1))
    check_processes(launch(2))


def test_reward_functions_that_do_not_import_are_reported_with_the_field():
    config = GRPOConfig(reward_funcs=["no_such_module_xyz:reward"])
    with pytest.raises(ConfigError, match="reward_funcs: 'no_such_module_xyz:reward': cannot import"):
        check_run_environment(config)


def test_too_small_max_prompt_length_fails_before_the_model_loads(monkeypatch, tmp_path):
    import dllm_ais.components as components
    import dllm_ais.trainer as trainer_module
    from dllm_ais.loading import load_tokenizer
    from dllm_ais.tasks.digits import make_digits_dataset

    tokenizer = load_tokenizer("embedded")
    dataset = make_digits_dataset(8, seed=0)
    with pytest.raises(ConfigError, match=r"max_prompt_length=4: the longest train prompt has \d+ tokens"):
        check_prompt_lengths(tokenizer, {"train": dataset, "eval": None}, 4)
    monkeypatch.setattr(components, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    config = load_config(EMBEDDED_RECIPE, {"max_prompt_length": 4, "output_dir": str(tmp_path), "eval_size": 0})
    with pytest.raises(ConfigError, match="max_prompt_length=4"):
        trainer_module.GRPOTrainer(config, tokenizer=tokenizer, train_dataset=dataset)


# ------------------------------------------------------------------------------------------------- CLI
@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["eval", "--help"]])
def test_help_does_not_import_torch(argv):
    code = ("import json, sys\nfrom dllm_ais.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print(json.dumps(sorted(m for m in ('torch', 'transformers', 'datasets', 'accelerate') if m in sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    *help_text, loaded = result.stdout.strip().splitlines()
    assert json.loads(loaded) == [] and help_text


def test_help_shows_ranges(capsys):
    from dllm_ais.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "--max_grad_norm=0.2" in out and "> 0" in out and "--run_name" in out and "--verbose" in out


@pytest.mark.parametrize("verbose", [False, True])
@pytest.mark.slow
def test_library_noise_only_with_verbose(tmp_path, verbose):
    command = [sys.executable, "-m", "dllm_ais.cli", "train", "--max_steps=1", "--eval_size=0", "--num_iterations=1",
               "--dataset_size=8", "--per_device_train_batch_size=8", f"--output_dir={tmp_path}",
               *(["--verbose"] if verbose else [])]
    env = {k: v for k, v in os.environ.items() if k not in LIBRARY_SWITCHES}  # as set by in-process main() calls
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    noise = ("Skipping import of cpp extensions", "_pytree", "Loading weights", "FutureWarning")
    shown = [text for text in noise if text in result.stderr + result.stdout]
    assert "step 1/1" in result.stdout + result.stderr  # our own lines stay
    assert shown == (list(noise) if verbose else []), shown


def test_the_start_note_says_what_the_ratio_sees_of_fast_rollouts_per_estimator():
    fast = dict(rollout={"cache": "dual", "threshold": 0.9})
    assert GRPOConfig().unseen_approximation is None  # exact rollouts: nothing to say
    decoder_replay = GRPOConfig(**fast, likelihood={"estimator": "trajectory"})
    assert "replays the fast decoder itself" in decoder_replay.unseen_approximation and decoder_replay.replays_decoder
    exact_model = GRPOConfig(**fast, likelihood={"estimator": "trajectory"},
                             experimental={"likelihood_decoder": "exact"})
    assert exact_model.ratio_sees_decoder and "visited canvas states" in exact_model.unseen_approximation
    # measured costs live in the docs, not in runtime messages
    assert all("BENCHMARKS.md" in config.unseen_approximation
               and not re.search(r"\d+ (points|seeds)", config.unseen_approximation)
               for config in (decoder_replay, exact_model))
    assert "not seen by the importance ratio" in GRPOConfig(**fast).unseen_approximation  # one_step
    no_cache = GRPOConfig(likelihood={"estimator": "trajectory"}, rollout={"threshold": 0.9})
    assert not no_cache.replays_decoder and no_cache.ratio_sees_decoder  # no cache: the decoder's logits are exact
