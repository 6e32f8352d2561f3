"""Tests for dllm_ais.data and the task modules' data: the generated digits task, local-file loading of the hub formats,
column checks and the chat-template helper."""
import json
from pathlib import Path

import datasets
import pytest
from transformers import AutoTokenizer

import dllm_ais
from dllm_ais.data import apply_chat_template, load_task_dataset
from dllm_ais.tasks import gsm8k
from dllm_ais.tasks.countdown import countdown_reward
from dllm_ais.tasks.digits import OPERATIONS, digits_reward, digits_split_seed, make_digits_dataset
from dllm_ais.tasks.gsm8k import gsm8k_correctness_reward
from dllm_ais.tasks.sudoku import sudoku_reward

TINY_TOKENIZER_DIR = Path(dllm_ais.__file__).parent / "assets" / "tiny_llada"


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def user_text(example: dict) -> str:
    (message,) = example["prompt"]
    assert message["role"] == "user"
    return message["content"]


# --------------------------------------------------------------------------------- digits


def test_digits_dataset_is_deterministic_and_seed_dependent():
    first = make_digits_dataset(50, seed=7)
    assert first.to_list() == make_digits_dataset(50, seed=7).to_list()
    assert first.to_list() != make_digits_dataset(50, seed=8).to_list()


def test_digits_examples_are_correct():
    dataset = make_digits_dataset(200, seed=0, min_len=3, max_len=6)
    assert dataset.column_names == ["prompt", "answer"]
    operations_seen = set()
    for example in dataset:
        operation, *digits = user_text(example).split(" ")
        operations_seen.add(operation)
        assert 3 <= len(digits) <= 6 and all(len(d) == 1 and d.isdigit() for d in digits)
        expected = sorted(digits) if operation == "sort" else digits[::-1]
        assert example["answer"] == " ".join(expected)
        assert digits_reward([example["prompt"]], [example["answer"]], answer=[example["answer"]]) == [1.0]
    assert operations_seen == {"sort", "reverse"}


def test_digits_operations_match_the_documented_examples():
    digits = ["3", "9", "1", "4"]
    assert " ".join(OPERATIONS["sort"](digits)) == "1 3 4 9"
    assert " ".join(OPERATIONS["reverse"](digits)) == "4 1 9 3"


def test_digits_rejects_bad_lengths():
    with pytest.raises(ValueError, match="min_len"):
        make_digits_dataset(3, seed=0, min_len=5, max_len=4)


def test_digits_train_and_test_use_disjoint_seeds():
    train_seeds = {digits_split_seed(seed, "train") for seed in range(100)}
    test_seeds = {digits_split_seed(seed, "test") for seed in range(100)}
    assert not train_seeds & test_seeds
    train = load_task_dataset("digits", "train", size=64, seed=3)
    test = load_task_dataset("digits", "test", size=64, seed=3)
    assert train.to_list() != test.to_list()
    assert train.to_list() == load_task_dataset("digits", "train", size=64, seed=3).to_list()
    assert len(load_task_dataset("digits", "test")) == 500


def test_digits_validation_has_its_own_generator_seed():
    seeds = {split: {digits_split_seed(seed, split) for seed in range(100)} for split in ("train", "validation", "test")}
    assert not seeds["validation"] & (seeds["train"] | seeds["test"])
    validation = load_task_dataset("digits", "validation", size=64, seed=3)
    assert len(load_task_dataset("digits", "validation")) == 500
    assert validation.to_list() == load_task_dataset("digits", "validation", size=64, seed=3).to_list()
    for other in ("train", "test"):
        assert validation["prompt"] != load_task_dataset("digits", other, size=64, seed=3)["prompt"]


def test_digits_rejects_unknown_split_and_paths(tmp_path):
    with pytest.raises(ValueError, match="train"):
        load_task_dataset("digits", "dev")
    with pytest.raises(ValueError, match="reads no files"):
        load_task_dataset("digits", path=tmp_path)


# --------------------------------------------------------------------------------- local files


def test_gsm8k_from_a_local_directory_with_splits(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"question": "What is 2+3?", "answer": "2+3=5\n#### 5"}])
    write_jsonl(tmp_path / "test.jsonl", [{"question": "What is 1,000+1?", "answer": "#### 1,001"}] * 3)
    dataset = load_task_dataset("gsm8k", "test", path=tmp_path)
    assert len(dataset) == 3
    example = dataset[0]
    assert user_text(example) == gsm8k.INSTRUCTIONS + "\n\nWhat is 1,000+1?"
    assert "<reasoning>" in user_text(example) and "<answer>" in user_text(example)
    completion = "<reasoning>\nadd\n</reasoning>\n<answer>\n1001\n</answer>"
    assert gsm8k_correctness_reward([example["prompt"]], [completion], answer=[example["answer"]]) == [2.0]
    assert load_task_dataset("gsm8k", "train", path=tmp_path)[0]["answer"].endswith("#### 5")


def test_countdown_from_jsonl_keeps_every_row(tmp_path):
    rows = [{"nums": [25, 3, 2], "target": 44}, {"nums": [1, 3, 4, 6], "target": 24}]
    write_jsonl(tmp_path / "test.jsonl", rows)
    dataset = load_task_dataset("countdown", "test", path=tmp_path)
    assert dataset["nums"] == [[25, 3, 2], [1, 3, 4, 6]] and dataset["target"] == [44, 24]
    assert "[25, 3, 2]" in user_text(dataset[0]) and "44" in user_text(dataset[0])
    rewards = countdown_reward(dataset["prompt"], ["<answer>(25-3)*2</answer>", "<answer>6/(1-3/4)</answer>"],
                               nums=dataset["nums"], target=dataset["target"])
    assert rewards == [1.0, 1.0]


def test_countdown_from_csv_with_text_lists(tmp_path):
    (tmp_path / "test.csv").write_text('nums,target\n"[25, 3, 2]",44\n')
    dataset = load_task_dataset("countdown", "test", path=tmp_path)
    assert dataset[0]["nums"] == [25, 3, 2] and dataset[0]["target"] == 44


def test_sudoku_csv_keeps_leading_zeros(tmp_path):
    (tmp_path / "test.csv").write_text("Puzzle,Solution\n0030000221000300,1234341221434321\n"
                                       "1030000221000300,1234341221434321\n")
    dataset = load_task_dataset("sudoku", "test", path=tmp_path)
    assert dataset["puzzle"] == ["0030000221000300", "1030000221000300"]
    assert dataset["solution"] == ["1234341221434321"] * 2
    assert "0030000221000300" in user_text(dataset[0])
    answer = "<answer>\n1234\n3412\n2143\n4321\n</answer>"
    rewards = sudoku_reward(dataset["prompt"], [answer] * 2, puzzle=dataset["puzzle"], solution=dataset["solution"])
    assert rewards == [1.0, 1.0]


def test_math500_from_parquet(tmp_path):
    rows = {"problem": ["Compute 14/3."], "solution": [r"It is $\boxed{\frac{14}{3}}$."], "answer": [r"\frac{14}{3}"]}
    datasets.Dataset.from_dict(rows).to_parquet(str(tmp_path / "test.parquet"))
    dataset = load_task_dataset("math500", "test", path=tmp_path)
    assert user_text(dataset[0]).endswith("Compute 14/3.") and "\\boxed{}" in user_text(dataset[0])
    assert dataset[0]["answer"] == r"\frac{14}{3}"


def test_size_takes_a_seeded_subset(tmp_path):
    write_jsonl(tmp_path / "test.jsonl", [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(20)])
    subset = load_task_dataset("gsm8k", "test", path=tmp_path, size=5, seed=1)
    assert len(subset) == 5
    assert subset["answer"] == load_task_dataset("gsm8k", "test", path=tmp_path, size=5, seed=1)["answer"]
    assert len(load_task_dataset("gsm8k", "test", path=tmp_path, size=50)) == 20


# --------------------------------------------------------------------------------- splits


def gsm8k_rows(count: int, offset: int = 0) -> list[dict]:
    return [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(offset, offset + count)]


def answers(task: str, split: str, path, seed: int = 0) -> list[str]:
    return list(load_task_dataset(task, split, path=path, seed=seed)["answer"])


def test_a_directory_without_validation_gets_one_carved_from_train(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", gsm8k_rows(40))
    write_jsonl(tmp_path / "test.jsonl", gsm8k_rows(5, offset=100))
    train, validation, test = (answers("gsm8k", split, tmp_path) for split in ("train", "validation", "test"))
    assert len(validation) == 4 and len(train) == 36 and not set(train) & set(validation)
    assert sorted(train + validation) == sorted(row["answer"] for row in gsm8k_rows(40))
    assert test == [row["answer"] for row in gsm8k_rows(5, offset=100)]
    # the carve does not depend on the run's seed
    assert answers("gsm8k", "validation", tmp_path, seed=7) == validation
    assert answers("gsm8k", "train", tmp_path, seed=7) == train


def test_a_directorys_own_validation_split_is_used(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", gsm8k_rows(10))
    write_jsonl(tmp_path / "validation.jsonl", gsm8k_rows(3, offset=50))
    write_jsonl(tmp_path / "test.jsonl", gsm8k_rows(2, offset=100))
    assert answers("gsm8k", "validation", tmp_path) == [row["answer"] for row in gsm8k_rows(3, offset=50)]
    assert len(answers("gsm8k", "train", tmp_path)) == 10


def test_a_single_file_is_a_train_split_with_validation_and_test_carved_from_it(tmp_path):
    """None of the rows `dllm-ais eval` scores is ever trained on, even when train and eval get the same file."""
    path = write_jsonl(tmp_path / "g.jsonl", gsm8k_rows(40))
    train, validation, test = (answers("gsm8k", split, path) for split in ("train", "validation", "test"))
    assert len(test) == 4 and len(validation) == 4 and len(train) == 32
    assert not set(train) & set(test) and not set(train) & set(validation) and not set(validation) & set(test)
    assert sorted(train + validation + test) == sorted(row["answer"] for row in gsm8k_rows(40))


def test_hub_splits_come_from_each_tasks_sources(monkeypatch):
    """Which hub dataset and split each task reads (no download: datasets.load_dataset is replaced)."""
    calls = []

    def fake_load_dataset(name, config=None, split=None):
        calls.append((name, config, split))
        if name == "Jiayi-Pan/Countdown-Tasks-3to4":
            return datasets.Dataset.from_list([{"nums": [1, 2, 3][: 3 - i % 2], "target": i} for i in range(60)])
        if name == "openai/gsm8k":
            return datasets.Dataset.from_list(gsm8k_rows(30 if split == "train" else 7))
        return datasets.Dataset.from_list([{"problem": f"p{i}", "solution": f"\\boxed{{{i}}}"} for i in range(30)])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert len(load_task_dataset("gsm8k", "test")) == 7 and calls[-1] == ("openai/gsm8k", "main", "test")
    assert len(load_task_dataset("gsm8k", "validation")) == 3 and calls[-1] == ("openai/gsm8k", "main", "train")
    load_task_dataset("math500", "test")
    assert calls[-1] == ("HuggingFaceH4/MATH-500", None, "test")
    load_task_dataset("math500", "train")
    assert calls[-1] == ("ankner/math-500", None, "train")
    # Countdown has only a train split of which d1 uses the three-number rows: test and validation are carved
    splits = {split: list(load_task_dataset("countdown", split)["target"]) for split in ("train", "validation", "test")}
    assert all(len(nums) == 3 for nums in load_task_dataset("countdown", "train")["nums"])
    assert {len(targets) for targets in splits.values()} == {3, 24}  # 30 rows: 3 test, 3 validation, 24 train
    assert sorted(sum(splits.values(), [])) == list(range(0, 60, 2))


# --------------------------------------------------------------------------------- errors


def test_unknown_task_lists_the_tasks():
    with pytest.raises(ValueError, match="unknown task 'chess'.*countdown.*digits.*gsm8k"):
        load_task_dataset("chess")


def test_missing_columns_are_named(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"numbers": [1, 2, 3], "target": 6}])
    with pytest.raises(ValueError, match="lacks column.*nums.*expected columns: nums, target"):
        load_task_dataset("countdown", path=path)
    math_path = write_jsonl(tmp_path / "math.jsonl", [{"problem": "p"}])
    with pytest.raises(ValueError, match="answer or solution"):
        load_task_dataset("math500", path=math_path)


def test_sudoku_needs_a_path_and_files_must_exist(tmp_path):
    with pytest.raises(ValueError, match="pass path="):
        load_task_dataset("sudoku")
    with pytest.raises(FileNotFoundError):
        load_task_dataset("gsm8k", path=tmp_path / "missing.jsonl")
    (tmp_path / "data.txt").write_text("x")
    with pytest.raises(ValueError, match="jsonl"):
        load_task_dataset("gsm8k", path=tmp_path / "data.txt")


# --------------------------------------------------------------------------------- chat template


def test_apply_chat_template_renders_the_generation_prompt():
    tokenizer = AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR)
    prompt = make_digits_dataset(1, seed=0)[0]["prompt"]
    text = apply_chat_template(tokenizer, prompt)
    assert text == (
        f"<|startoftext|><|start_header_id|>user<|end_header_id|>\n\n{prompt[0]['content']}<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(tokenizer, prompt)


@pytest.mark.parametrize("content, problem", [
    (b'{"nums": [1, 2, 3], "target": 6}\n{"nums": [4, 5, 6], "target": "six"}\n',
     "row 2: invalid literal for int() with base 10: 'six'"),
    (b"PAR1" + bytes(range(256)) * 4 + b"PAR1", "cannot read it as parquet"),
], ids=["wrong-type", "garbage-parquet"])
def test_a_dataset_file_that_cannot_be_used_is_one_line_naming_the_file_and_row(tmp_path, capsys, content, problem):
    from dllm_ais.cli import main

    path = tmp_path / ("rows.parquet" if content.startswith(b"PAR1") else "rows.jsonl")
    path.write_bytes(content)
    assert main(["train", "--task=countdown", f"--dataset_path={path}", f"--output_dir={tmp_path / 'run'}",
                 "--eval_size=0"]) == 2
    stderr = capsys.readouterr().err  # besides the datasets library's progress bars
    error = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert "Traceback" not in stderr and len(error) == 1 and str(path) in error[0] and problem in error[0], stderr
    valid = tmp_path / "valid.jsonl"  # the legitimate file still loads
    valid.write_bytes(content.splitlines()[0] + b"\n" if path.suffix == ".jsonl" else b'{"nums": [1, 2, 3], "target": 6}\n')
    assert len(load_task_dataset("countdown", "train", path=valid)) == 1
