"""Rewards as untrusted input: every built-in reward survives a few thousand adversarial completions (code payloads
included, which must never run) in bounded time, rejects non-text with one error naming itself, and a math-verify
comparison that runs out of time (in any thread) scores 0, is counted, and never blocks the next one."""
import os
import random
import re
import signal
import tempfile
import threading
from pathlib import Path

import pytest
from test_rewards import weighted_rewards

from dllm_ais.tasks import get_task, math500, task_names
from dllm_ais.tasks import reasoning_gym as gym_task
from dllm_ais.tasks.fuzzing import (EXPONENT_TOWERS, adversarial_completions, example_rows, fuzz_reward,
                                    non_string_completions)
from dllm_ais.tasks.gsm8k import has_soft_layout, has_strict_layout

FUZZ_COUNT = 2_000
# Seconds: far above what any input needs (the point is "returns", not speed); a math call may include starting
# the worker process.
PER_CALL_BOUND = {"math500": 60.0, "reasoning_gym": 60.0}
DEFAULT_PER_CALL_BOUND = 10.0
MARKER = Path(tempfile.mkdtemp(prefix="dllm-ais-fuzz-")) / "code-ran"  # created only if a payload is evaluated
CORPUS = adversarial_completions(FUZZ_COUNT, seed=0, max_chars=80_000, max_fraction_depth=10,
                                 towers=("9^{9^{9}}", "(10^{10})!", "2^{2^{2^{2^{2}}}}"), code_marker=str(MARKER))
BUILT_IN = [(task, function) for task in task_names()
            for function in (*get_task(task).reward_funcs, get_task(task).accuracy)]


@pytest.fixture
def short_math_deadline(monkeypatch):
    monkeypatch.setattr(math500.VERIFIER, "deadline_seconds", 1.0)
    monkeypatch.setattr(gym_task.SCORER, "deadline_seconds", 1.0)


def test_the_corpus_holds_every_adversarial_family():
    texts = [c if isinstance(c, str) else c[0]["content"] for c in CORPUS]
    assert len(CORPUS) >= 2_000 and sum(isinstance(c, list) for c in CORPUS) > 100  # chat-form completions too
    assert any(len(t) >= 40_000 for t in texts) and any("\\frac{\\frac{\\frac{" in t for t in texts)
    assert any("9^{9^{9}}" in t for t in texts) and any(any(0xD800 <= ord(ch) <= 0xDFFF for ch in t) for t in texts)
    assert any(t.count("{") != t.count("}") for t in texts)
    assert sum(f"touch {MARKER}" in t for t in texts) > 100 and any("9**9**9**9" in t for t in texts)


@pytest.mark.parametrize("task, function", BUILT_IN, ids=[f.__name__ for _, f in BUILT_IN])
def test_reward_survives_the_fuzz_corpus(task, function, short_math_deadline):
    report = fuzz_reward(function, CORPUS, example_rows(get_task(task)))
    assert report.count == FUZZ_COUNT
    assert report.exceptions == []
    assert report.max_seconds < PER_CALL_BOUND.get(task, DEFAULT_PER_CALL_BOUND)
    assert not MARKER.exists(), "a reward evaluated a code payload"


@pytest.fixture(scope="module")
def long_corpus():
    """The slow tier's corpus: ten times the default one, fractions nested twice as deep, every exponent tower."""
    return adversarial_completions(10 * FUZZ_COUNT, seed=1, max_chars=80_000, max_fraction_depth=20,
                                   towers=EXPONENT_TOWERS, code_marker=str(MARKER))


@pytest.mark.slow
@pytest.mark.parametrize("task, function", BUILT_IN, ids=[f.__name__ for _, f in BUILT_IN])
def test_reward_survives_the_long_fuzz_corpus_at_its_own_deadline(task, function, long_corpus):
    """What the default test checks, on the long corpus with the verifiers' shipped deadlines."""
    report = fuzz_reward(function, long_corpus, example_rows(get_task(task)))
    assert report.count == len(long_corpus) and report.exceptions == []
    assert report.max_seconds < PER_CALL_BOUND.get(task, DEFAULT_PER_CALL_BOUND)
    assert not MARKER.exists(), "a reward evaluated a code payload"


@pytest.mark.parametrize("task, function", BUILT_IN, ids=[f.__name__ for _, f in BUILT_IN])
def test_non_text_completions_get_one_error_naming_the_reward(task, function):
    columns = {name: [value] for name, value in example_rows(get_task(task))[0].items() if name != "prompt"}
    for completion in non_string_completions():
        with pytest.raises(TypeError, match=rf"^{function.__name__} scores text: completion 0 is "
                                            rf"{type(completion).__name__}"):
            function([None], [completion], **columns)


SOFT_PATTERN = re.compile(r"\s*<reasoning>.*?</reasoning>\s*<answer>.*?</answer>", re.DOTALL)
STRICT_PATTERN = re.compile(r"<reasoning>\n.*?\n</reasoning>\n<answer>\n.*?\n</answer>\s*", re.DOTALL)


def test_linear_layout_checks_agree_with_d1s_regular_expressions():
    rng = random.Random(0)
    pieces = ["<reasoning>", "</reasoning>", "<answer>", "</answer>", "\n", " ", "\t", "\u2003", "x", "<", ">"]
    texts = ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 14))) for _ in range(20_000)]
    texts += ["<reasoning>\n\n</reasoning>\n<answer>\n\n</answer>", "<reasoning>\n</reasoning>\n<answer>\n</answer>",
              " <reasoning></reasoning><answer></answer> tail", "<reasoning>\nr\n</reasoning>\n<answer>\n1\n</answer>\n "]
    soft_matches = strict_matches = 0
    for text in texts:
        assert has_soft_layout(text) == bool(SOFT_PATTERN.match(text)), repr(text)
        assert has_strict_layout(text) == bool(STRICT_PATTERN.fullmatch(text)), repr(text)
        soft_matches += has_soft_layout(text)
        strict_matches += has_strict_layout(text)
    assert soft_matches > 20 and strict_matches >= 2  # both outcomes are exercised


def run_in_thread(function, *args, **kwargs):
    results = []
    worker = threading.Thread(target=lambda: results.append(function(*args, **kwargs)))
    worker.start()
    worker.join(timeout=120)
    assert not worker.is_alive(), "the reward did not return"
    return results[0]


def test_math_timeout_off_the_main_thread_scores_zero_and_is_counted(short_math_deadline):
    completions = [r"\boxed{9^{9^{9}}}", r"\boxed{\frac{1}{2}}"]
    rewards, metrics = run_in_thread(weighted_rewards, [math500.math_correctness_reward], ["p"] * 2, completions,
                                     {"answer": ["7", "0.5"]})
    assert rewards.tolist() == [0.0, 2.0]
    assert metrics["rewards/math_correctness_reward/timeouts"] == 1.0


def test_a_stuck_math_worker_is_killed_and_replaced(short_math_deadline):
    verifier = math500.VERIFIER
    assert verifier.equivalent("2", "2") is True
    stuck = verifier._process
    os.kill(stuck.pid, signal.SIGSTOP)  # a worker that never answers, whatever it was computing
    assert verifier.equivalent("3", "3") is None  # past the hard deadline: counted as a timeout
    assert stuck.wait(timeout=30) is not None  # killed
    assert verifier.equivalent("4", "4") is True and verifier._process.pid != stuck.pid
