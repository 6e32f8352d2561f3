"""The reasoning_gym task: built from task_args, answer-tag prompts, disjoint splits, the datasets' own verifiers
behind guards (code in an answer never runs, a stuck verifier is bounded), config errors in one line, and a training
run end to end."""
import json
import os
import signal
import sys

import pytest

from dllm_ais.cli import main
from dllm_ais.config import ConfigError, load_config
from dllm_ais.data import load_task_dataset
from dllm_ais.tasks import REASONING_FORMAT, get_task
from dllm_ais.tasks import reasoning_gym as gym_task
from dllm_ais.tasks.fuzzing import PYTHON_TOWERS, code_payloads, fuzz_reward
from dllm_ais.tasks.parsing import counting_timeouts

COUNTDOWN = {"dataset": "countdown", "min_numbers": 3, "max_numbers": 3}
GUARDED = ["countdown", "puzzle24", "spiral_matrix", "binary_matrix", "string_insertion", "n_queens"]
UNGUARDED = ["basic_arithmetic", "chain_sum", "mini_sudoku"]


def rows(dataset: str, size: int = 1, split: str = "test", **settings) -> list[dict]:
    return load_task_dataset("reasoning_gym", split, size=size, task_args={"dataset": dataset, **settings}).to_list()


def score(row: dict, answer_text: str, function=gym_task.gym_correctness_reward) -> float:
    columns = {name: [value] for name, value in row.items() if name != "prompt"}
    return function([row["prompt"]], [f"<reasoning>\nr\n</reasoning>\n<answer>\n{answer_text}\n</answer>"],
                    **columns)[0]


def test_the_task_builds_from_a_recipe_and_from_dotted_or_json_overrides(tmp_path):
    recipe = tmp_path / "gym.yaml"
    recipe.write_text("task: reasoning_gym\ntask_args: {dataset: countdown, min_numbers: 3, max_numbers: 4}\n")
    assert load_config(recipe, ["--task_args.max_numbers=3"]).task_args == COUNTDOWN
    dotted = ["--task=reasoning_gym", "--task_args.dataset=countdown", "--task_args.min_numbers=3",
              "--task_args.max_numbers=3"]
    assert load_config(None, dotted).task_args == COUNTDOWN
    assert load_config(None, ["--task=reasoning_gym", f"--task_args={json.dumps(COUNTDOWN)}"]).task_args == COUNTDOWN


@pytest.mark.parametrize("overrides, message", [
    (["--task_args.dataset=countdwn"], "task_args.dataset='countdwn': no such reasoning-gym dataset; did you mean "
                                       "'countdown'?"),
    (["--task_args.dataset=countdown", "--task_args.min_numbers=5", "--task_args.max_numbers=3"],
     "task_args: countdown rejects these settings: max_numbers must be >= min_numbers"),
    (["--task_args.dataset=countdown", "--task_args.min_number=3"],
     "task_args.min_number: countdown has no such setting; did you mean 'min_numbers'?"),
    (["--task_args.dataset=countdown", "--task_args.min_numbers=three"],
     "task_args.min_numbers='three': countdown expects int"),
    (["--task_args.dataset=countdown", "--task_args.seed=3"], "task_args.seed: set by the run"),
    (["--task_args.dataset=simple_integration"], "task_args.dataset='simple_integration' is not offered"),
    ([], "task_args.dataset: name the reasoning-gym dataset"),
])
def test_bad_task_args_fail_before_anything_loads_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, ["--task=reasoning_gym", *overrides])
    problems = str(error.value).splitlines()[1:]
    assert len(problems) == 1 and problems[0].startswith(f"  - {message}")


def test_a_task_without_settings_refuses_task_args():
    with pytest.raises(ConfigError, match="task_args: the digits task takes no task_args; remove them"):
        load_config(None, ["--task=digits", "--task_args.dataset=countdown"])


def test_without_reasoning_gym_the_task_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym now raises ImportError
    with pytest.raises(ConfigError, match=r'needs the reasoning-gym package: pip install "dllm-ais\[gym\]"$'):
        load_config(None, ["--task=reasoning_gym", "--task_args.dataset=countdown"])


def test_prompts_carry_the_answer_tag_format_and_the_entry_columns():
    row = rows("countdown", **{k: v for k, v in COUNTDOWN.items() if k != "dataset"})[0]
    content = row["prompt"][0]["content"]
    assert row["prompt"][0]["role"] == "user" and content.startswith(REASONING_FORMAT)
    assert content.endswith(row["question"]) and "<answer>" in content
    metadata = json.loads(row["metadata"])
    assert sorted(metadata["numbers"]) == sorted(int(n) for n in row["answer"].replace("+", " ").replace("-", " ")
                                                 .replace("*", " ").replace("/", " ").split())
    assert row["gym_dataset"] == "countdown" and json.loads(row["gym_settings"]) == {"min_numbers": 3, "max_numbers": 3}


def test_splits_come_from_disjoint_seeds_and_share_no_question():
    train_seeds = {gym_task.split_seed("train", seed) for seed in range(400)}
    assert len(train_seeds) == 400 and max(train_seeds) + gym_task.SPLIT_STRIDE <= gym_task.SEED_SPACE
    assert min(train_seeds) >= gym_task.split_seed("validation", 0) + gym_task.SPLIT_STRIDE
    # chain_sum with one-digit terms repeats problems across seeds: the held-out questions are left out of training
    settings = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}
    splits = {split: [row["question"] for row in rows("chain_sum", size, split, **settings)]
              for split, size in (("train", 200), ("validation", 50), ("test", 50))}
    assert not set(splits["train"]) & set(splits["validation"] + splits["test"])
    assert not set(splits["validation"]) & set(splits["test"])
    assert len(splits["train"]) == 200
    tiny = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}  # ~200 problems, all held out
    with pytest.raises(ValueError, match="these settings allow too few distinct problems"):
        rows("chain_sum", 10, "train", **tiny)
    assert splits["test"] == [row["question"] for row in rows("chain_sum", 50, "test", **settings)]  # deterministic


@pytest.mark.parametrize("dataset", ["countdown", "basic_arithmetic", "chain_sum", "mini_sudoku", "spiral_matrix"])
def test_a_correct_answer_scores_one_and_a_wrong_one_zero(dataset):
    row = rows(dataset)[0]
    assert score(row, row["answer"]) == 1.0 and score(row, row["answer"], gym_task.TASK.accuracy) == 1.0
    assert score(row, "no idea") == 0.0 and score(row, "no idea", gym_task.TASK.accuracy) == 0.0
    no_tags = gym_task.gym_correctness_reward([None], [row["answer"]], **{k: [v] for k, v in row.items()})
    assert no_tags == [0.0]


def test_the_payload_is_live_against_reasoning_gyms_own_countdown_verifier(tmp_path):
    """Why the guards exist: unguarded, the Countdown verifier runs the answer as Python."""
    import reasoning_gym

    marker = tmp_path / "code-ran"
    row = rows("countdown")[0]
    entry = {"question": row["question"], "answer": row["answer"], "metadata": json.loads(row["metadata"])}
    reasoning_gym.create_dataset("countdown").score_answer(code_payloads(str(marker))[0], entry)
    assert marker.exists()


@pytest.mark.parametrize("dataset", GUARDED + UNGUARDED)
def test_code_payloads_never_run_and_every_call_returns(dataset, tmp_path, monkeypatch):
    monkeypatch.setattr(gym_task.SCORER, "deadline_seconds", 1.0)
    marker = tmp_path / "code-ran"
    attacks = [*code_payloads(str(marker)), *(f"<answer>{tower}</answer>" for tower in PYTHON_TOWERS),
               "<answer>" + "9" * 100_000 + "</answer>"]
    for function in gym_task.TASK.reward_funcs + (gym_task.TASK.accuracy,):
        report = fuzz_reward(function, attacks, rows(dataset))
        assert report.exceptions == [] and report.max_seconds < 60
    assert not marker.exists()


def test_a_stuck_verifier_scores_zero_is_counted_and_is_replaced(monkeypatch):
    monkeypatch.setattr(gym_task.SCORER, "deadline_seconds", 1.0)
    row = rows("chain_sum")[0]
    assert score(row, row["answer"]) == 1.0
    stuck = gym_task.SCORER._process
    os.kill(stuck.pid, signal.SIGSTOP)  # a verifier that never answers, whatever it was computing
    with counting_timeouts() as timeouts:
        assert score(row, f"{row['answer']},0") == 0.0  # not cached: it reaches the stuck worker
    assert timeouts == [1] and stuck.wait(timeout=30) is not None  # killed
    assert score(row, f"{row['answer']}.0") == 1.0 and gym_task.SCORER._process.pid != stuck.pid


def test_reward_preset_is_the_verifier_and_the_format_reward():
    names = [function.__name__ for function in get_task("reasoning_gym").reward_funcs]
    assert names == ["gym_correctness_reward", "soft_format_reward"]


@pytest.mark.slow
def test_two_training_steps_on_the_embedded_model(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--task=reasoning_gym", "--task_args.dataset=chain_sum", "--task_args.max_digits=2",
                 f"--output_dir={out}", "--max_steps=2", "--eval_size=8", "--dataset_size=16", "--num_iterations=1",
                 "--per_device_train_batch_size=8", "--max_prompt_length=320"]) == 0
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("rewards/gym_correctness_reward/mean" in record for record in logged)


def test_sft_takes_task_args_and_names_a_bad_one(tmp_path, capsys):
    assert main(["sft", "--task=reasoning_gym", "--task_args={dataset: chain_sm}", "--steps=1"]) == 2
    assert "did you mean 'chain_sum'" in capsys.readouterr().err
    out = tmp_path / "model"
    assert main(["sft", "--task=reasoning_gym", "--task_args={dataset: chain_sum, max_digits: 2}", "--steps=1",
                 "--gen_length=32", "--dataset_size=8", "--batch_size=4", "--masking=prefix",
                 f"--output_dir={out}"]) == 0
    assert (out / "model.safetensors").is_file()


def test_eval_provenance_names_the_generator_settings():
    from dllm_ais.evaluation import dataset_provenance

    settings = {"dataset": "chain_sum", "max_digits": 2}
    source = dataset_provenance(get_task("reasoning_gym"), "test", None, rows("chain_sum", 4, "test", max_digits=2),
                                settings)
    assert source["generated"] == "reasoning_gym" and source["task_args"] == settings and source["num_rows"] == 4


WRONG_BUT_WELL_FORMED = {"countdown": "1 + 1", "puzzle24": "1 + 1", "spiral_matrix": "0 0", "binary_matrix": "0 0",
                         "string_insertion": "ABC", "n_queens": "_ Q"}


def own_score(dataset, answer: str, entry: dict) -> float:
    """reasoning-gym's own score of `answer` on `entry`; a verifier that raises on it means 0 (as in our reward)."""
    try:
        return float(dataset.score_answer(answer, entry))
    except Exception:  # noqa: BLE001
        return 0.0


@pytest.mark.slow
def test_every_offered_dataset_scores_its_own_entries_as_reasoning_gym_does(capsys):
    """Our reward (rows rebuilt from an entry's columns, scored in the bounded worker) equals the dataset's own
    `score_answer` on the original entry, for the reference answer and for a wrong one, on every offered dataset.
    Before, arc_agi's and rearc's reference answers scored 0.05 (their tuple grids came back from JSON as lists)."""
    import reasoning_gym

    mismatches, without_reference = [], []
    for name in gym_task.exposed_datasets():
        dataset = reasoning_gym.create_dataset(name, seed=gym_task.split_seed("test", 0), size=3)
        for index in range(3):
            entry = dataset[index]
            row = {**gym_task.entry_columns(entry), "prompt": gym_task.prompt(entry["question"]),
                   "gym_dataset": name, "gym_settings": "{}"}
            wrong = WRONG_BUT_WELL_FORMED.get(name, "no idea")  # the guards score a malformed answer 0 unseen
            for answer in ([] if entry["answer"] is None else [str(entry["answer"])]) + [wrong]:
                ours, theirs = score(row, answer), own_score(dataset, answer, entry)
                if ours != theirs:
                    mismatches.append((name, index, answer[:30], ours, theirs))
            if entry["answer"] is None:
                without_reference.append(name)
                assert row["answer"] == ""  # not the text "None"
    assert not mismatches
    assert set(without_reference) == {"boxnet", "graph_color", "propositional_logic", "rubiks_cube", "rush_hour"}
    rows("rush_hour")  # a dataset without references says so when its rows are built
    assert "rush_hour entries carry no reference answer" in capsys.readouterr().err


def test_typed_entry_values_survive_the_dataset_columns():
    value = {"grid": ((1, 2), (3, 4)), "cells": {(0, 1): "x"}, "seen": {3, 1}, "tag": {gym_task.TYPE_TAG: 1},
             "plain": [1, "a", None]}
    assert gym_task.loads_entry_value(gym_task.dumps_entry_value(value)) == value
    assert type(gym_task.loads_entry_value(gym_task.dumps_entry_value(value))["grid"][0]) is tuple
    with pytest.raises(ValueError):  # rows from a file: parsed within bounds
        gym_task.loads_entry_value("[" * 100_000 + "]" * 100_000)


def test_settings_that_make_generation_take_too_long_are_refused_up_front_with_the_limit(monkeypatch):
    """--task_args.max_numbers=100000000 stalled for minutes with no message; one problem now has a time limit."""
    monkeypatch.setattr(gym_task.SAMPLER, "deadline_seconds", 2.0)
    monkeypatch.setattr(gym_task, "GENERATION_SECONDS", 2.0)
    with pytest.raises(ConfigError) as refused:
        load_config(None, ["--task=reasoning_gym", "--task_args.dataset=countdown",
                           "--task_args.max_numbers=100000000"])
    problems = str(refused.value).splitlines()[1:]
    assert problems == ["  - task_args: countdown takes more than 2 s (the limit) to generate one problem with these "
                        "settings; choose smaller ones"]
    assert load_config(None, ["--task=reasoning_gym", "--task_args.dataset=countdown"]).task_args  # still fine
