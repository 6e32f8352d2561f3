"""Tasks: one module per task, each holding its data source, prompt, reward functions and eval metric.

Built in: ``gsm8k``, ``math500``, ``countdown``, ``sudoku`` (4x4), ``digits`` (generated, no
files) and ``reasoning_gym`` (any reasoning-gym dataset, chosen and set up by the config's ``task_args``).
Shared text helpers live in :mod:`dllm_ais.tasks.parsing`; checks on untrusted output that may hang run in
:mod:`dllm_ais.tasks.bounded_worker` (math-verify in :mod:`dllm_ais.tasks.math_verifier`); loading files,
carving splits and chat templating are generic (:mod:`dllm_ais.data`), and combining rewards is the rewards
stage (:mod:`dllm_ais.rewards`).

Adding a task takes one file. Write reward functions with TRL's signature
``fn(prompts, completions, **dataset_columns) -> list[float | None]`` (see ``gsm8k.py``), then::

    # my_task.py
    from dllm_ais.tasks import HubSplit, Task, accuracy_of, register_task
    from dllm_ais.tasks.parsing import completion_texts, dataset_column, extract_xml_answer

    def my_reward(prompts, completions, **kwargs):
        targets = dataset_column(kwargs, "target", "my_reward")
        texts = completion_texts(completions, "my_reward")
        return [1.0 if extract_xml_answer(t) == str(y) else 0.0 for t, y in zip(texts, targets)]

    TASK = register_task(Task(
        name="my_task",
        reward_funcs=(my_reward,),
        accuracy=accuracy_of(my_reward, full_credit=1.0, name="my_task_accuracy"),
        to_example=lambda row: {"prompt": [{"role": "user", "content": row["question"]}]},
        required_columns=(("question",), ("target",)),
        hub_train=HubSplit("me/my-dataset", "train"),     # optional: or always pass dataset_path
        hub_test=HubSplit("me/my-dataset", "test"),
        sample_rows=({"question": "1+1?", "target": 2},),  # used by --dry_run and the reward fuzzer
    ))

Import it before building the config (``task: my_task`` then validates), or drop the file into this
package: every module here that defines ``TASK`` is registered on import.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from dllm_ais.tasks.parsing import completion_texts

RewardFunction = Callable[..., list]
Messages = list[dict[str, str]]

# Following d1's data code, the format instructions open the single user turn (there is no system message),
# so accuracy compares with d1's numbers.
REASONING_FORMAT = (
    "Think the problem through step by step, then reply in exactly this format:\n"
    "<reasoning>\n...\n</reasoning>\n<answer>\n...\n</answer>"
)


def user_prompt(instructions: str, text: str) -> Messages:
    """One user turn: the task's ``instructions``, a blank line, then ``text``."""
    return [{"role": "user", "content": f"{instructions}\n\n{text}"}]


@dataclass(frozen=True)
class HubSplit:
    """One split of a Hugging Face Hub dataset: ``datasets.load_dataset(dataset, config, split=split)``."""

    dataset: str
    split: str
    config: str | None = None


@dataclass(frozen=True)
class Task:
    """Everything task-specific: data, prompt, rewards, metric and eval protocol.

    Data comes either from rows (the hub splits, or a local file of the same schema) or from
    ``generate(split, size, seed)`` for tasks made in code. ``required_columns`` lists groups of
    alternatives: each group needs one of its columns (matched case-insensitively, renamed to
    lower case). ``to_example(row)`` returns the ``prompt`` (chat messages) and any column it
    rewrites; ``retyped_columns`` are those it rewrites with a new type (e.g. Sudoku grids read from
    a CSV as integers become strings). A split the hub lacks is carved deterministically from the
    train split (see :func:`dllm_ais.data.load_task_dataset`). ``hub_row_filter`` applies to hub
    rows only, never to a local file.

    A task with settings (the config's ``task_args`` mapping) gives ``check_task_args(task_args)``, which returns
    one line per problem before anything loads, and receives them as keyword arguments of ``generate``; a task
    without it takes no ``task_args``.

    ``reward_funcs`` is the training preset. ``accuracy`` returns 1.0 or 0.0 per completion (d1's
    metric: the correctness reward alone). ``eval_gen_lengths`` and ``eval_block_length`` set the
    ``dllm-ais eval`` protocol (steps = gen_length / 2, greedy).
    """

    name: str
    reward_funcs: tuple[RewardFunction, ...]
    accuracy: RewardFunction | None = None
    to_example: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    required_columns: tuple[tuple[str, ...], ...] = ()
    retyped_columns: tuple[str, ...] = ()
    hub_train: HubSplit | None = None
    hub_test: HubSplit | None = None
    hub_validation: HubSplit | None = None
    hub_row_filter: Callable[[dict[str, Any]], bool] | None = None
    generate: Callable[..., Any] | None = None
    check_task_args: Callable[[dict[str, Any]], list[str]] | None = None
    sample_rows: tuple[dict[str, Any], ...] = ()
    eval_gen_lengths: tuple[int, ...] = (128, 256, 512)
    eval_block_length: int = 32

    def __post_init__(self):
        if (self.generate is None) == (self.to_example is None):
            raise ValueError(f"task {self.name!r}: give exactly one of generate= (data made in code) or to_example=")
        if self.check_task_args is not None and self.generate is None:
            raise ValueError(f"task {self.name!r}: task_args reach the data through generate=; give it")

    def task_args_problems(self, task_args: dict[str, Any]) -> list[str]:
        """The problems of ``task_args`` for this task, one line each naming the key; [] when they are valid."""
        if self.check_task_args is None:
            return [f"task_args: the {self.name} task takes no task_args; remove them"] if task_args else []
        keys = [key for key in task_args if not isinstance(key, str)]
        if keys:
            return [f"task_args: keys are setting names (strings), got {keys[0]!r}"]
        return self.check_task_args(task_args)


_TASKS: dict[str, Task] = {}


def register_task(task: Task) -> Task:
    """Add ``task`` to the registry (replacing a task of the same name) and return it."""
    _TASKS[task.name] = task
    return task


def get_task(name: str) -> Task:
    """The registered task called ``name``; ValueError listing the tasks otherwise."""
    if name not in _TASKS:
        raise ValueError(f"unknown task {name!r}; available tasks: {task_names()}")
    return _TASKS[name]


def task_names() -> list[str]:
    return sorted(_TASKS)


class TaskNames:
    """A live, sorted view of the registered task names (usable as a config field's choices)."""

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in _TASKS

    def __iter__(self) -> Iterator[str]:
        return iter(task_names())

    def __len__(self) -> int:
        return len(_TASKS)

    def __repr__(self) -> str:
        return repr(task_names())


def reward_functions() -> dict[str, RewardFunction]:
    """Every registered task's reward and accuracy functions by ``__name__``."""
    return {fn.__name__: fn for task in _TASKS.values()
            for fn in (*task.reward_funcs, *([task.accuracy] if task.accuracy else []))}


def accuracy_of(reward: RewardFunction, full_credit: float, name: str) -> RewardFunction:
    """An accuracy function: 1.0 where ``reward`` gives ``full_credit`` (a fully correct answer), else 0.0."""

    def accuracy(prompts: list, completions: list, **kwargs) -> list[float]:
        texts = completion_texts(completions, name)
        return [1.0 if value == full_credit else 0.0 for value in reward(prompts, texts, **kwargs)]

    accuracy.__name__ = accuracy.__qualname__ = name
    accuracy.__doc__ = f"1.0 per completion that {reward.__name__} scores {full_credit} (fully correct), else 0.0."
    return accuracy


def _register_task_modules() -> None:
    for module in pkgutil.iter_modules(__path__):
        task = getattr(importlib.import_module(f"{__name__}.{module.name}"), "TASK", None)
        if isinstance(task, Task):
            register_task(task)


_register_task_modules()
