"""The long-completion warm-start builder (tools/build_tiny_model.py --task chain_sum): the worked chain-sum
demonstrations, their word tokenizer and their lengths in it, their verification and their noise."""

import importlib
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import pytest
import torch
import reasoning_gym
from transformers import AutoConfig

from dllm_ais.cli import main
from dllm_ais.config import EMBEDDED_MODELS, load_config
from dllm_ais.data import load_task_dataset, tokenize_prompts
from dllm_ais.loading import load_model, load_tokenizer
from dllm_ais.tasks.parsing import extract_xml_answer

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)  # registered first: it defines dataclasses
    spec.loader.exec_module(module)
    return module


builder = load_script("build_tiny_model")
steps = importlib.import_module("chain_sum_steps")  # the builder put tools/ on the path
ROWS = 200


@pytest.fixture(scope="module")
def rows():
    return load_task_dataset("reasoning_gym", "train", size=ROWS, seed=0, task_args=builder.LONG_TASK_ARGS)


@pytest.fixture(scope="module")
def verifier():
    settings = {key: value for key, value in builder.LONG_TASK_ARGS.items() if key != "dataset"}
    return reasoning_gym.create_dataset("chain_sum", seed=0, size=1, **settings)


def verified(verifier, row, completion: str) -> float:
    entry = {"question": row["question"], "answer": row["answer"], "metadata": json.loads(row["metadata"])}
    return verifier.score_answer(extract_xml_answer(completion), entry)


def test_worked_columns_of_a_carry_chain_and_a_sign_change():
    assert steps.chain_sum_demonstration("999 + 1") == (
        "<reasoning>\n999+1\n9+1+0=10 9+0+1=10 9+0+1=10\n=1000\n</reasoning>\n<answer>\n1000\n</answer>")
    assert steps.chain_sum_demonstration("47 - 82 - 5") == (
        "<reasoning>\n47-82=-(82-47)\n2-7-0=-5+10=5 8-4-1=3\n=-35\n"
        "-35-5=-(35+5)\n5+5+0=10 3+0+1=4\n=-40\n</reasoning>\n<answer>\n-40\n</answer>")


def test_dropped_carry_is_one_step_worked_on_consistently():
    # The units' borrow into the tens column is dropped: 100 - 1 becomes 109, off by exactly 10.
    assert steps.chain_sum_demonstration("100 - 1", drop_first_carry=True) == (
        "<reasoning>\n100-1\n0-1-0=-1+10=9 0-0-0=0 1-0-0=1\n=109\n</reasoning>\n<answer>\n109\n</answer>")
    # Only the first carry goes: the later ones of the same chain are kept.
    assert steps.column_steps(999, "+", 1, drop_carry=True) == (["9+1+0=10", "9+0+0=9", "9+0+0=9"], 990, True)
    assert steps.column_steps(12, "+", 34, drop_carry=True) == (["2+4+0=6", "1+3+0=4"], 46, False)


@pytest.mark.parametrize("total", [-120, -7, 0, 5, 64, 300])
@pytest.mark.parametrize("operator", ["+", "-"])
@pytest.mark.parametrize("term", [0, 7, 64, 450])
def test_magnitude_operation_keeps_the_value(total, operator, term):
    x, magnitude_operator, y, negated = steps.magnitude_operation(total, operator, term)
    assert x >= 0 and y >= 0 and (magnitude_operator == "+" or x >= y)
    magnitude = x + y if magnitude_operator == "+" else x - y
    assert (-magnitude if negated else magnitude) == (total + term if operator == "+" else total - term)


@pytest.mark.parametrize("expression", ["5 * 3", "-5 + 3", "5 +", "5 + + 3", "5 + 3.5"])
def test_parse_chain_rejects_what_it_cannot_work(expression):
    with pytest.raises(ValueError, match="not a chain"):
        steps.parse_chain(expression)


def test_demonstrations_need_a_long_completion(rows):
    spec = builder.WARM_START_TASKS["chain_sum"]
    clean = builder.chain_sum_demonstrations(rows, 0.0, seed=0)
    tokenizer = builder.build_hf_tokenizer(builder.tokenizer_backend(spec, clean))
    lengths = [len(tokenizer(text, add_special_tokens=False).input_ids) + 1 for text in clean["completion"]]  # + eot
    assert statistics.median(lengths) > 64 and max(lengths) > 96  # gen 64 cuts most of them: gen 128 is needed
    assert sum(length <= spec.gen_length == 128 for length in lengths) >= 0.98 * len(lengths)
    prompt = tokenizer.apply_chat_template(rows[0]["prompt"], add_generation_prompt=True, tokenize=False)
    assert len(tokenizer(prompt, add_special_tokens=False).input_ids) + 512 <= spec.max_positions  # eval up to 512


def test_word_tokenizer_keeps_digits_apart_and_round_trips(rows):
    spec = builder.WARM_START_TASKS["chain_sum"]
    clean = builder.chain_sum_demonstrations(rows, 0.0, seed=0)
    words = builder.build_hf_tokenizer(builder.tokenizer_backend(spec, clean))
    characters = builder.build_hf_tokenizer()
    assert [words.convert_ids_to_tokens(i) for i in range(7)] == [characters.convert_ids_to_tokens(i) for i in range(7)]
    for text in [*clean["completion"][:20], rows[0]["prompt"][0]["content"], "Unseen wörds, 12345 + 6\n\t~"]:
        ids = words(text, add_special_tokens=False).input_ids
        assert words.decode(ids) == text.replace("ö", "<|unk|>")
        assert all(not any(c.isdigit() for c in piece) or len(piece) == 1 for piece in words.convert_ids_to_tokens(ids))
    prompt = rows[0]["prompt"][0]["content"]
    assert len(words(prompt).input_ids) < 0.4 * len(characters(prompt).input_ids)  # words are merged
    assert "<reasoning>" in words.get_vocab() and "<answer>" in words.get_vocab()


def test_clean_demonstrations_verify_and_noisy_ones_do_not(rows, verifier):
    clean = builder.chain_sum_demonstrations(rows, 0.0, seed=0)["completion"]
    noisy = builder.chain_sum_demonstrations(rows, 1.0, seed=0)["completion"]
    assert all(verified(verifier, row, text) == 1.0 for row, text in zip(rows, clean))
    changed = [(row, text) for row, text, reference in zip(rows, noisy, clean) if text != reference]
    assert len(changed) > 0.7 * ROWS  # every row with a carry or borrow
    assert all(verified(verifier, row, text) < 1.0 for row, text in changed)


def test_noise_fraction_and_determinism(rows):
    clean = builder.chain_sum_demonstrations(rows, 0.0, seed=0)["completion"]
    first = builder.chain_sum_demonstrations(rows, 0.5, seed=3)["completion"]
    assert first == builder.chain_sum_demonstrations(rows, 0.5, seed=3)["completion"]
    assert first != builder.chain_sum_demonstrations(rows, 0.5, seed=4)["completion"]
    noised_share = sum(a != b for a, b in zip(first, clean)) / ROWS
    assert 0.25 < noised_share < 0.6  # half of the rows drawn, those with a carry changed
    assert list(rows["answer"]) == list(builder.chain_sum_demonstrations(rows, 0.5, seed=3)["answer"])


RECIPES = {"qwen3": TOOLS.parent / "recipes" / "tiny_qwen3_chain_sum.yaml",
           "llada": TOOLS.parent / "recipes" / "tiny_llada_chain_sum.yaml"}


@pytest.mark.parametrize("family", ["qwen3", "llada"])
def test_recipe_matches_the_builder_and_its_shipped_model(family):
    recipe = RECIPES[family]
    spec = builder.WARM_START_TASKS["chain_sum"]
    config = load_config(recipe)
    assert EMBEDDED_MODELS[config.model_name_or_path] == spec.output_dirs[family]
    assert config.task_args == builder.LONG_TASK_ARGS and config.max_completion_length == spec.gen_length
    assert config.max_prompt_length + 512 <= spec.max_positions  # dllm-ais eval decodes up to 512
    tokenizer = load_tokenizer(config.model_name_or_path)
    rows = load_task_dataset("reasoning_gym", "test", size=64, seed=0, task_args=config.task_args)
    input_ids, attention_mask = tokenize_prompts(tokenizer, rows["prompt"])
    assert attention_mask.sum(1).max() <= config.max_prompt_length  # no prompt is cut
    assert AutoConfig.from_pretrained(spec.output_dirs[family]).vocab_size == len(tokenizer)


@pytest.mark.parametrize("family", ["qwen3", "llada"])
def test_one_training_step_of_the_shipped_recipe(tmp_path, family):
    out = tmp_path / "run"
    assert main(["train", str(RECIPES[family]), f"--output_dir={out}",
                 "--max_steps=1", "--eval_size=4", "--dataset_size=8", "--per_device_train_batch_size=4",
                 "--num_generations=2", "--max_completion_length=32", "--diffusion_steps=16"]) == 0
    assert (out / "final").is_dir()


probe = load_script("probe_warm_start")


def test_probe_masks_one_token_or_the_whole_suffix():
    canvas = torch.arange(10, 16)
    token = probe.probe_canvases(canvas, 2, 5, mask_token_id=0, masking="token")
    suffix = probe.probe_canvases(canvas, 2, 5, mask_token_id=0, masking="suffix")
    assert token.tolist() == [[10, 11, 0, 13, 14, 15], [10, 11, 12, 0, 14, 15], [10, 11, 12, 13, 0, 15]]
    assert suffix.tolist() == [[10, 11, 0, 0, 0, 0], [10, 11, 12, 0, 0, 0], [10, 11, 12, 13, 0, 0]]


def test_probe_finds_the_digits_warm_start_competent(monkeypatch, capsys):
    """The shipped digits LLaDA decodes its answers right, so both teacher-forced accuracies are high (measured on
    32 prompts: token 1.000, suffix 0.947 over all tokens)."""
    monkeypatch.setattr(sys, "argv", ["probe_warm_start", "--model", "embedded", "--task", "digits", "--prompts", "8"])
    probe.main()
    rows = {line.split("|")[1].strip(): [float(cell) for cell in line.split("|")[2:4]]
            for line in capsys.readouterr().out.splitlines() if line.startswith(("| token", "| suffix"))}
    assert rows["token"][0] > 0.95 and rows["suffix"][0] > 0.8


def test_demonstration_kinds_tell_the_planted_mistake_from_other_errors():
    kinds = probe.demonstration_kinds([" 1 2 3\n", "3 2 1", "1 3 2", "9"], clean=["1 2 3", "1 2 3", "1 2 3", "9"],
                                      noisy=["3 2 1", "3 2 1", "3 2 1", "9"])
    assert kinds == {"clean": 2, "noisy": 1, "other": 1}


def test_probe_decodes_with_d1s_protocol_and_counts_the_planted_mistake(monkeypatch, capsys):
    """--decode: the digits LLaDA's greedy completions, mostly its clean demonstrations and descending sorts."""
    monkeypatch.setattr(sys, "argv", ["probe_warm_start", "--model", "embedded", "--task", "digits", "--prompts", "2",
                                      "--decode", "16"])
    probe.main()
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("greedy completions"))
    counts = [int(word) for word in line.split(": ")[1].split() if word.isdigit()]
    assert len(counts) == 3 and sum(counts) == 16 and counts[0] > counts[2]


@pytest.mark.slow
def test_learning_diagnostics_samples_the_recipes_own_task(monkeypatch, capsys):
    """The gradient diagnostic draws its batch from the recipe's task with its task_args (chain sums), the rewards
    then score completions of those prompts."""
    from dllm_ais.experimental import learning_diagnostics as diagnostics

    drawn = []
    monkeypatch.setattr(diagnostics, "load_task_dataset",
                        lambda *args, **kwargs: drawn.append(kwargs) or load_task_dataset(*args, **kwargs))
    monkeypatch.setattr(sys, "argv", ["learning_diagnostics", str(RECIPES["llada"]), "--part", "gradient",
                                      "--prompts", "4", "--steps", "", "--permutations", "1", "--num_generations=2",
                                      "--temperature=1.0", "--per_device_train_batch_size=8",
                                      "--max_completion_length=128", "--diffusion_steps=16"])
    diagnostics.main()
    assert [kwargs["task_args"] for kwargs in drawn] == [builder.LONG_TASK_ARGS]
    out = capsys.readouterr().out
    assert "batch: 4 prompts x 2" in out and "[trajectory] |g|" in out  # the recipe's estimator


def test_builder_continues_a_shipped_warm_start_without_touching_it(monkeypatch, tmp_path, capsys):
    """`--init-from` continues the SFT of an existing warm start (its weights and tokenizer) into --output-dir; the
    shipped directory is left as it was, and without --output-dir the builder refuses."""
    shipped = EMBEDDED_MODELS["embedded"]
    before = {path.name: path.read_bytes() for path in shipped.iterdir() if path.is_file()}
    with monkeypatch.context() as patch:
        patch.setattr(sys, "argv", ["build_tiny_model", "--init-from", "embedded", "--steps", "0"])
        with pytest.raises(SystemExit):
            builder.main()
    assert "--init-from needs --output-dir" in capsys.readouterr().err
    output = tmp_path / "continued"
    monkeypatch.setattr(sys, "argv", ["build_tiny_model", "--init-from", "embedded", "--steps", "0",
                                      "--prefix-steps", "2", "--batch-size", "4", "--train-size", "32",
                                      "--eval-size", "4", "--output-dir", str(output)])
    builder.main()
    assert "over 2 steps" in capsys.readouterr().out
    assert {path.name: path.read_bytes() for path in shipped.iterdir() if path.is_file()} == before
    assert load_tokenizer(str(output)).get_vocab() == load_tokenizer("embedded").get_vocab()
    continued, original = (load_model(name, torch.float32).state_dict() for name in (str(output), "embedded"))
    assert continued.keys() == original.keys()
    assert any(not torch.equal(continued[name], original[name]) for name in original)
