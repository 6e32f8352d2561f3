"""Tests for the task rewards (dllm_ais.tasks.*), the safe Countdown arithmetic, the registry and
the combination of reward functions (`score_completions`, `RewardTable.weighted_sum`) and its error reporting."""
import functools
import math
import threading

import pytest
import torch

from dllm_ais.rewards import (
    REWARD_FUNCTIONS,
    TASK_REWARDS,
    RewardFunctionError,
    score_completions,
    resolve_reward_functions,
)
from dllm_ais.tasks import math500
from dllm_ais.tasks.countdown import UnsafeExpressionError, countdown_reward, evaluate_arithmetic, parse_arithmetic
from dllm_ais.tasks.digits import digits_reward
from dllm_ais.tasks.gsm8k import (
    gsm8k_correctness_reward,
    int_answer_reward,
    soft_format_reward,
    strict_format_reward,
    xmlcount_reward,
)
from dllm_ais.tasks.math500 import boxed_format_reward, math_correctness_reward
from dllm_ais.tasks.parsing import extract_last_boxed, extract_xml_answer, message_text
from dllm_ais.tasks.sudoku import sudoku_reward

WELL_FORMED = "<reasoning>\nShe has 3 boxes of 411 pens.\nSo 1,233 pens.\n</reasoning>\n<answer>\n1,233\n</answer>\n"


def as_chat(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


def call(reward, completions, **columns):
    return reward([None] * len(completions), completions, **columns)


# --------------------------------------------------------------------------------- helpers


def test_message_text_accepts_strings_messages_and_message_lists():
    assert message_text("abc") == "abc"
    assert message_text({"role": "assistant", "content": "abc"}) == "abc"
    assert message_text([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]) == "ab"
    with pytest.raises(TypeError, match="chat messages"):
        message_text(42)


def test_extract_xml_answer_takes_last_block_and_tolerates_missing_close_tag():
    assert extract_xml_answer("<answer>1</answer> <answer>\n 2 \n</answer>") == "2"
    assert extract_xml_answer("<answer>\n7") == "7"
    assert extract_xml_answer("no tags") is None


def test_extract_last_boxed_matches_nested_braces():
    assert extract_last_boxed(r"\boxed{1} then \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert extract_last_boxed(r"\boxed{\frac{1}{2}") is None
    assert extract_last_boxed("nothing") is None


# --------------------------------------------------------------------------------- GSM8K


@pytest.mark.parametrize("completion", [WELL_FORMED, as_chat(WELL_FORMED)], ids=["string", "chat"])
def test_gsm8k_well_formed_correct_completion_gets_every_term(completion):
    answer = ["She buys 3 * 411 = 1233 pens.\n#### 1233"]
    assert call(xmlcount_reward, [completion]) == [0.5]
    assert call(soft_format_reward, [completion]) == [0.5]
    assert call(strict_format_reward, [completion]) == [0.5]
    assert call(int_answer_reward, [completion]) == [0.5]
    assert call(gsm8k_correctness_reward, [completion], answer=answer) == [2.0]


def test_gsm8k_correctness_normalises_and_rejects_wrong_or_missing_answers():
    completions = ["<answer> 18.0 </answer>", "<answer>$18</answer>", "<answer>19</answer>", "18"]
    assert call(gsm8k_correctness_reward, completions, answer=["#### 18"] * 4) == [2.0, 2.0, 0.0, 0.0]
    assert call(gsm8k_correctness_reward, ["<answer>\n1,000\n</answer>"], answer=["1000"]) == [2.0]


def test_gsm8k_format_terms_on_malformed_completions():
    loose = "<reasoning>r</reasoning> <answer>5</answer>"
    assert call(soft_format_reward, [loose]) == [0.5]
    assert call(strict_format_reward, [loose]) == [0.0]
    assert call(soft_format_reward, ["The answer is 5"]) == [0.0]
    assert call(xmlcount_reward, ["The answer is 5"]) == [0.0]
    # four tags (0.5) minus 0.001 per trailing character
    assert call(xmlcount_reward, [WELL_FORMED.rstrip() + "\nextra"]) == [pytest.approx(0.5 - 0.005)]
    assert call(int_answer_reward, ["<answer>2.5</answer>", "<answer>-3</answer>", "3"]) == [0.0, 0.5, 0.0]


def test_gsm8k_correctness_names_missing_column():
    with pytest.raises(ValueError, match="'answer'"):
        call(gsm8k_correctness_reward, [WELL_FORMED], question=["q"])


# --------------------------------------------------------------------------------- MATH


def test_math_correctness_uses_last_boxed_and_equivalence():
    completions = [
        r"so the result is \boxed{\frac{14}{3}}",
        r"first \boxed{5} then \boxed{14/3}",
        r"\boxed{14/3} but finally \boxed{5}",
        "no boxed answer: 14/3",
        r"\boxed{\frac{14}{3}",
        as_chat(r"\boxed{\dfrac{14}{3}}"),
    ]
    assert call(math_correctness_reward, completions, answer=[r"\frac{14}{3}"] * 6) == [2.0, 2.0, 0.0, 0.0, 0.0, 2.0]


def test_math_correctness_falls_back_to_solution_column():
    solution = r"Adding gives $\boxed{\left( 3, \frac{\pi}{2} \right)}$."
    assert call(math_correctness_reward, [r"\boxed{(3,\frac{\pi}{2})}"], solution=[solution]) == [2.0]


def test_math_correctness_never_raises_on_garbage(monkeypatch):
    monkeypatch.setattr(math500.VERIFIER, "deadline_seconds", 1.0)  # the last one may time out
    garbage = [r"\boxed{\frac{{{}}}", r"\boxed{)(*&^%$#}", r"\boxed{" + "x^" * 200 + "}"]
    assert call(math_correctness_reward, garbage, answer=["2"] * 3) == [0.0, 0.0, 0.0]


def test_math_correctness_runs_outside_the_main_thread():
    results = []
    worker = threading.Thread(
        target=lambda: results.append(call(math_correctness_reward, [r"\boxed{0.5}"], answer=[r"\frac{1}{2}"]))
    )
    worker.start()
    worker.join()
    assert results == [[2.0]]


def test_boxed_format_reward_checks_for_boxed_not_backspace():
    assert call(boxed_format_reward, [r"\boxed{3}", "\boxed{3}", "3", as_chat(r"x \boxed{y}")]) == [0.5, 0.0, 0.0, 0.5]


# --------------------------------------------------------------------------------- Countdown


def test_countdown_scores_correct_wrong_and_missing_answers():
    completions = [
        "<reasoning>...</reasoning><answer>(25 - 3) * 2</answer>",  # hits 44 with 25, 3, 2
        "<answer>25 - 3 * 2</answer>",  # right numbers, wrong value
        "<answer>(25 - 3) * 2 * 1</answer>",  # extra number
        "<answer>25 + 19</answer>",  # wrong numbers
        "<answer>25 / (3 - 3)</answer>",  # division by zero: well-formed, wrong
        "(25 - 3) * 2",  # no <answer>
        "<answer>(25 - 3) * 2 = 44</answer>",  # not an expression
    ]
    rewards = call(countdown_reward, completions, nums=[[25, 3, 2]] * 7, target=[44] * 7)
    assert rewards == [1.0, 0.1, 0.1, 0.1, 0.1, 0.0, 0.0]


def test_countdown_is_exact_with_fractions_and_accepts_text_columns():
    # 6 / (1 - 3/4) = 24 exactly; nums and target given as text (as read from a CSV)
    completion = as_chat("<answer>6/(1-3/4)</answer>")
    assert call(countdown_reward, [completion], nums=["[1, 3, 4, 6]"], target=["24"]) == [1.0]


@pytest.mark.parametrize(
    "expression",
    [
        "__import__('os').system('echo hi')",
        "2**99999999",
        "9**9**9**9",
        "x + 1",
        "(1).__class__",
        "abs(-3)",
        "[1, 2]",
        "1 if 1 else 2",
        "0x10 + 1",
        "7 // 2",
        "1e400",
        "+" * 300 + "1",
        "(" * 200 + "1" + ")" * 200,
    ],
)
def test_countdown_rejects_unsafe_or_non_arithmetic_expressions(expression):
    assert call(countdown_reward, [f"<answer>{expression}</answer>"], nums=[[1, 2]], target=[3]) == [0.0]
    with pytest.raises(UnsafeExpressionError):
        parse_arithmetic(expression)


def test_safe_arithmetic_evaluates_allowed_syntax():
    assert evaluate_arithmetic(parse_arithmetic("-(3 - 10) * 2 / 4 + 0.5")) == 4
    with pytest.raises(ZeroDivisionError):
        evaluate_arithmetic(parse_arithmetic("1 / (2 - 2)"))


# --------------------------------------------------------------------------------- Sudoku


def test_sudoku_reward_counts_originally_empty_cells():
    puzzle = "1030000221000300"  # 10 empty cells
    solution = "1234341221434321"
    completions = [
        "<reasoning>...</reasoning>\n<answer>\n1234\n3412\n2143\n4321\n</answer>",
        "1 2 3 4 | 3 4 1 2 | 2 1 4 3 | 4 3 2 1",  # no <answer>: whole text
        "<answer>1030000221000300</answer>",  # the puzzle copied back unchanged
        "<answer>1234</answer>",  # first row only: cells 1 and 3 of 10
        as_chat("<answer>1234341221434322</answer>"),  # last cell wrong
    ]
    rewards = call(sudoku_reward, completions, puzzle=[puzzle] * 5, solution=[solution] * 5)
    assert rewards == [1.0, 1.0, 0.0, pytest.approx(0.2), pytest.approx(0.9)]


def test_sudoku_reward_restores_leading_zeros_of_integer_grids():
    completion = "<answer>1234341221434321</answer>"
    rewards = call(sudoku_reward, [completion], puzzle=[34341221434321], solution=[1234341221434321])
    assert rewards == [1.0]
    with pytest.raises(ValueError, match="16 digits"):
        call(sudoku_reward, ["1234"], puzzle=["123"], solution=["1234341221434321"])


# --------------------------------------------------------------------------------- digits


def test_digits_reward_gives_positional_partial_credit():
    completions = ["1 3 4 9", "1 3 4", "1 3 4 9 9", "9 4 3 1", "no digits", as_chat("1 3 4 9")]
    rewards = call(digits_reward, completions, answer=["1 3 4 9"] * 6)
    assert rewards == [1.0, 0.75, 0.8, 0.0, 0.0, 1.0]
    assert all(0.0 <= reward <= 1.0 for reward in rewards)


# --------------------------------------------------------------------------------- registry


def test_registry_and_task_presets():
    assert set(REWARD_FUNCTIONS) >= {"xmlcount_reward", "countdown_reward", "digits_reward", "math_correctness_reward"}
    assert set(TASK_REWARDS) == {"gsm8k", "math500", "countdown", "sudoku", "digits", "reasoning_gym"}
    for functions in TASK_REWARDS.values():
        assert all(function in REWARD_FUNCTIONS.values() for function in functions)


def test_resolve_reward_functions_accepts_names_tasks_imports_and_callables():
    def custom(prompts, completions, **kwargs):
        return [0.0] * len(completions)

    resolved = resolve_reward_functions(["digits_reward", "countdown", "dllm_ais.rewards:sudoku_reward", custom])
    assert resolved == [digits_reward, countdown_reward, sudoku_reward, custom]
    assert resolve_reward_functions("gsm8k") == TASK_REWARDS["gsm8k"]


def test_resolve_reward_functions_rejects_unknown_names_with_the_list():
    with pytest.raises(ValueError, match="digits_reward"):
        resolve_reward_functions(["no_such_reward"])
    with pytest.raises(ValueError, match="cannot import"):
        resolve_reward_functions(["dllm_ais.rewards:no_such_function"])


# --------------------------------------------------------------------------------- combining rewards
def weighted_rewards(reward_funcs, prompts, completions, columns, reward_weights=None):
    """The rewards [N] and reward metrics the GRPO step takes from `score_completions`."""
    table = score_completions(reward_funcs, prompts, completions, columns)
    return table.weighted_sum(reward_weights), table.metrics()


def constant_reward(value):
    def reward(prompts, completions, **kwargs):
        return [value] * len(completions)

    return reward


def test_weighted_rewards_weighted_sum_and_metrics():
    completions = ["1 3 4 9", "1 3 4", "9"]
    columns = {"answer": ["1 3 4 9"] * 3}
    rewards, metrics = weighted_rewards(
        [digits_reward, boxed_format_reward], ["p"] * 3, completions, columns, reward_weights=[2.0, 1.0]
    )
    assert rewards.dtype == torch.float32 and rewards.shape == (3,)
    assert rewards.tolist() == pytest.approx([2.0, 1.5, 0.0])
    assert metrics["rewards/digits_reward/mean"] == pytest.approx(1.75 / 3)
    expected_std = torch.tensor([1.0, 0.75, 0.0]).std(correction=0).item()
    assert metrics["rewards/digits_reward/std"] == pytest.approx(expected_std)
    assert metrics["rewards/boxed_format_reward/mean"] == 0.0


def test_weighted_rewards_passes_columns_and_completion_ids():
    seen = {}

    def spy(prompts, completions, **kwargs):
        seen.update(kwargs)
        return [1.0] * len(completions)

    weighted_rewards([spy], ["p"], ["c"], {"answer": ["a"], "completion_ids": [[1, 2]]})
    assert seen == {"answer": ["a"], "completion_ids": [[1, 2]]}


def test_weighted_rewards_excludes_none_entries():
    def only_first(prompts, completions, **kwargs):
        return [3.0] + [None] * (len(completions) - 1)

    rewards, metrics = weighted_rewards([only_first, constant_reward(1.0)], ["p"] * 3, ["a", "b", "c"], {})
    assert rewards.tolist() == [4.0, 1.0, 1.0]
    assert metrics["rewards/only_first/mean"] == 3.0
    assert metrics["rewards/only_first/std"] == 0.0


def test_weighted_rewards_sample_without_any_reward_gets_zero_and_a_warning():
    def never(prompts, completions, **kwargs):
        return [None] * len(completions)

    with pytest.warns(UserWarning, match="returned None"):
        rewards, metrics = weighted_rewards([never], ["p"] * 2, ["a", "b"], {})
    assert rewards.tolist() == [0.0, 0.0]
    assert math.isnan(metrics["rewards/never/mean"])


def test_weighted_rewards_names_a_raising_function():
    def exploding_reward(prompts, completions, **kwargs):
        raise KeyError("solution")

    with pytest.raises(RewardFunctionError, match="exploding_reward.*KeyError.*solution") as error:
        weighted_rewards([constant_reward(1.0), exploding_reward], ["p"], ["c"], {})
    assert isinstance(error.value, RuntimeError)
    assert isinstance(error.value.__cause__, KeyError)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ([math.nan, 1.0], "nan at index 0.*finite"),
        ([1.0, math.inf], "inf at index 1"),
        ([1.0], "1 values for 2 completions"),
        ([1.0, "1.0"], "'1.0' \\(str\\) at index 1"),
        (1.0, "float"),
    ],
)
def test_weighted_rewards_rejects_bad_outputs_naming_the_function(values, message):
    def bad_reward(prompts, completions, **kwargs):
        return values

    with pytest.raises(RewardFunctionError, match=f"'bad_reward' returned {message}"):
        weighted_rewards([bad_reward], ["p", "q"], ["a", "b"], {})


def test_weighted_rewards_accepts_tensors_and_names_partials_and_duplicates():
    def tensor_reward(prompts, completions, scale, **kwargs):
        return torch.full((len(completions),), scale)

    funcs = [functools.partial(tensor_reward, scale=1.0), functools.partial(tensor_reward, scale=2.0)]
    rewards, metrics = weighted_rewards(funcs, ["p"], ["c"], {})
    assert rewards.tolist() == [3.0]
    assert metrics["rewards/tensor_reward/mean"] == 1.0 and metrics["rewards/tensor_reward_2/mean"] == 2.0


def test_weighted_rewards_checks_argument_lengths():
    with pytest.raises(ValueError, match="2 reward weights for 1"):
        weighted_rewards([constant_reward(1.0)], ["p"], ["c"], {}, reward_weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="one entry per completion"):
        weighted_rewards([constant_reward(1.0)], ["p"], ["c"], {"answer": ["a", "b"]})
    with pytest.raises(ValueError, match="2 prompts for 1"):
        weighted_rewards([constant_reward(1.0)], ["p", "q"], ["c"], {})
