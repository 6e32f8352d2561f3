"""The rewards stage: turn a rollout's completions into one reward per completion.

Reward functions live with their task (:mod:`dllm_ais.tasks`) and have TRL's signature::

    fn(prompts: list, completions: list, **kwargs) -> list[float | None]

``kwargs`` carries the dataset columns (lists aligned with ``completions``) and
``completion_ids``. ``prompts`` and ``completions`` are either plain strings or chat-message lists
(``[{"role": "assistant", "content": "..."}]``). ``None`` marks a sample for which a reward does
not apply; it is left out of that reward's sum and statistics.

Model output is untrusted: the built-in rewards never evaluate it as code, run in time linear in
its length, and bound their expensive checks (math-verify) with a hard deadline; a completion scored
0 for running out of time is counted in ``rewards/<fn>/timeouts``.
"""
from __future__ import annotations

import importlib
import math
import numbers
import random
import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dllm_ais.interruption import noting_ctrl_c
from dllm_ais.sampling.rollout import Rollout
from dllm_ais.tasks import RewardFunction, get_task, reward_functions, task_names
from dllm_ais.tasks.parsing import counting_timeouts


def __getattr__(name: str) -> Any:
    """``REWARD_FUNCTIONS`` (name -> function) and ``TASK_REWARDS`` (task -> preset) as live views of the task
    registry, and every registered reward function by name (``dllm_ais.rewards:sudoku_reward`` keeps working)."""
    if name == "REWARD_FUNCTIONS":
        return reward_functions()
    if name == "TASK_REWARDS":
        return {task: list(get_task(task).reward_funcs) for task in task_names()}
    functions = reward_functions()
    if name in functions:
        return functions[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------------------------------------
# Resolving reward specs
# ---------------------------------------------------------------------------------------------


def import_reward_function(reference: str) -> RewardFunction:
    """Import ``"package.module:function"`` and return the function; ValueError if it is missing
    or not callable."""
    module_name, _, attribute = reference.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"cannot import reward function '{reference}': {error}") from error
    if not callable(function):
        raise ValueError(f"'{reference}' is not callable")
    return function


def resolve_reward_functions(
    names_or_callables: str | RewardFunction | Sequence[str | RewardFunction],
) -> list[RewardFunction]:
    """Turn reward specs into functions. Each spec is a callable (kept), a registered name (see
    REWARD_FUNCTIONS), a task name (expands to its preset) or ``"module.path:function"`` (imported: pass such
    names only from a source you trust, never from a downloaded checkpoint).
    Unknown names raise ValueError listing what is available."""
    single_spec = isinstance(names_or_callables, str) or callable(names_or_callables)
    specs = [names_or_callables] if single_spec else names_or_callables
    registered = reward_functions()
    functions: list[RewardFunction] = []
    for spec in specs:
        if callable(spec):
            functions.append(spec)
        elif isinstance(spec, str) and ":" in spec:
            functions.append(import_reward_function(spec))
        elif spec in registered:
            functions.append(registered[spec])
        elif spec in task_names():
            functions.extend(get_task(spec).reward_funcs)
        else:
            raise ValueError(
                f"unknown reward function {spec!r}; available: {sorted(registered)}, "
                f"task presets: {task_names()}, or 'package.module:function'"
            )
    return functions


def permuted_reward(reward: RewardFunction, seed: int = 0) -> RewardFunction:
    """A signal-free control of ``reward``: each call scores the completions with ``reward``, then shuffles the
    scores across the batch (a ``random.Random(seed)`` stream). The rewards keep their distribution but no longer
    say which completion earned them, so a run trained on this control shows what the updates do without a
    learning signal (the random-reward control); compare its held-out change with the real run's."""
    rng = random.Random(seed)

    def permuted(prompts: list, completions: list, **kwargs) -> list:
        scores = list(reward(prompts, completions, **kwargs))
        rng.shuffle(scores)
        return scores

    permuted.__name__ = permuted.__qualname__ = f"permuted_{getattr(reward, '__name__', 'reward')}"
    return permuted


# ---------------------------------------------------------------------------------------------
# Combining rewards
# ---------------------------------------------------------------------------------------------


class RewardFunctionError(RuntimeError):
    """A reward function raised or returned something unusable."""


class NonFiniteRewardError(RewardFunctionError):
    """A reward function returned NaN, inf or a value beyond float32's range (where rewards are computed): the
    trainer skips that generation batch (the weights stay untouched)."""


FLOAT32_MAX = torch.finfo(torch.float32).max


def reward_function_names(reward_funcs: Sequence[RewardFunction]) -> list[str]:
    """Return a metric name per reward function (its ``__name__``; a ``functools.partial`` gives
    its wrapped function's name), with ``_2``, ``_3``, ... appended to repeated names."""
    names = []
    for function in reward_funcs:
        target = getattr(function, "func", function)
        names.append(getattr(target, "__name__", type(target).__name__))
    totals = Counter(names)
    seen: Counter = Counter()
    unique_names = []
    for name in names:
        seen[name] += 1
        unique_names.append(f"{name}_{seen[name]}" if totals[name] > 1 and seen[name] > 1 else name)
    return unique_names


def validated_rewards(values: Any, name: str, expected_length: int) -> list[float]:
    """Check one reward function's output and return it as floats with NaN for None; raise
    RewardFunctionError naming ``name`` and the fix for a wrong length, a non-number, NaN, inf or a number float32
    cannot hold."""
    if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):  # torch tensor, numpy array
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise RewardFunctionError(
            f"reward function '{name}' returned {type(values).__name__}; "
            "return a list with one float (or None) per completion"
        )
    if len(values) != expected_length:
        raise RewardFunctionError(
            f"reward function '{name}' returned {len(values)} values for {expected_length} completions; "
            "return one float (or None for 'not applicable') per completion"
        )
    floats = []
    for index, value in enumerate(values):
        if value is None:
            floats.append(math.nan)
            continue
        if not isinstance(value, numbers.Real):
            raise RewardFunctionError(
                f"reward function '{name}' returned {value!r} ({type(value).__name__}) at index {index}; "
                "return a float, or None for 'not applicable'"
            )
        if (problem := float32_problem(value, index)) is not None:
            raise NonFiniteRewardError(
                f"reward function '{name}' returned {problem}; return a finite float, or None to exclude the sample"
            )
        floats.append(float(value))
    return floats


def float32_problem(value: numbers.Real, index: int) -> str | None:
    """None when float32, the dtype rewards are computed in, holds the number `value` (the reward of completion
    `index`); else what it is: NaN, inf, or a finite number beyond float32's range (which would turn into inf)."""
    beyond = f"beyond the float32 range (±{FLOAT32_MAX:.4g}) rewards are computed in"
    try:
        number = float(value)
    except OverflowError:  # an integer beyond even a Python float
        return f"an integer of {value.bit_length()} bits at index {index}, {beyond}"
    if not math.isfinite(number):
        return f"{number} at index {index}"
    if abs(number) > FLOAT32_MAX:
        return f"{number:g} at index {index}, {beyond}"
    return None


@dataclass
class RewardTable:
    """Every reward function's values on a batch of completions, before weighting.

    ``values`` [N, F] float32 holds NaN where a function returned None (not applicable); ``timeouts[f]`` counts
    the completions function f scored 0 because a check ran out of time.
    """

    names: list[str]
    values: torch.Tensor
    timeouts: list[int]

    def weighted_sum(self, reward_weights: Sequence[float] | None = None) -> torch.Tensor:
        """Per completion, Σ_f w_f · r_f over the functions that apply to it (float32 [N]); a completion to which
        no function applies gets 0 and a warning."""
        count, functions = self.values.shape
        weights = [1.0] * functions if reward_weights is None else [float(weight) for weight in reward_weights]
        if len(weights) != functions:
            raise ValueError(f"got {len(weights)} reward weights for {functions} reward functions")
        not_applicable = self.values.isnan().all(dim=1)
        if count and not_applicable.any():
            warnings.warn(f"all reward functions returned None for completions {not_applicable.nonzero().flatten().tolist()}; "
                          "their reward is 0", stacklevel=3)
        return (self.values * torch.tensor(weights, dtype=torch.float32)).nansum(dim=1)

    def finite_weighted_sum(self, reward_weights: Sequence[float] | None = None) -> torch.Tensor:
        """`weighted_sum`, checked to have finite float32 statistics — its sum and spread over the completions, and
        each function's — where every value is finite (`validated_rewards`) but their arithmetic may overflow;
        NonFiniteRewardError naming the value of largest magnitude and its function otherwise."""
        weighted = self.weighted_sum(reward_weights)
        columns = [column[~column.isnan()] for column in (weighted, *self.values.unbind(dim=1))]
        statistics = [value for column in columns if column.numel()
                      for value in (column.sum(), column.std(correction=0))]
        if not statistics or torch.isfinite(torch.stack(statistics)).all():
            return weighted
        name, value = self.largest()
        raise NonFiniteRewardError(f"reward function '{name}' returned {value:g}, and the float32 arithmetic on the "
                                   "rewards (weighted sum, mean, spread) overflows; return rewards of a smaller "
                                   "magnitude")

    def largest(self) -> tuple[str, float] | None:
        """(function name, value) of the value of largest magnitude in the table; None when no function applies."""
        magnitudes = self.values.abs().nan_to_num(nan=-1.0)
        if not self.values.numel() or magnitudes.max() < 0:
            return None
        row, column = divmod(int(magnitudes.argmax()), self.values.shape[1])
        return self.names[column], self.values[row, column].item()

    def metrics(self) -> dict[str, float]:
        """``rewards/<name>/mean`` and ``/std`` (population std) of each function's unweighted values over the
        completions it applies to (NaN when none), and ``rewards/<name>/timeouts``."""
        metrics: dict[str, float] = {}
        for index, name in enumerate(self.names):
            column = self.values[:, index]
            applicable = column[~column.isnan()]
            metrics[f"rewards/{name}/mean"] = applicable.mean().item() if applicable.numel() else math.nan
            metrics[f"rewards/{name}/std"] = applicable.std(correction=0).item() if applicable.numel() else math.nan
            metrics[f"rewards/{name}/timeouts"] = float(self.timeouts[index])
        return metrics


def score_completions(
    reward_funcs: Sequence[RewardFunction],
    prompts: list,
    completions: list,
    columns: Mapping[str, list],
) -> RewardTable:
    """Call every reward function on the batch and check what it returns (see :func:`validated_rewards`).
    ``columns`` are passed as keyword arguments (dataset columns and ``completion_ids``), each a list aligned
    with ``completions``. A function that raises (or calls ``sys.exit``, or raises KeyboardInterrupt itself: not a
    Ctrl-C, see `noting_ctrl_c`) becomes a RewardFunctionError naming it."""
    count = len(completions)
    if not reward_funcs:
        raise ValueError("no reward functions given; pass at least one (see dllm_ais.rewards.TASK_REWARDS)")
    if len(prompts) != count:
        raise ValueError(f"got {len(prompts)} prompts for {count} completions; pass one prompt per completion")
    misaligned = {name: len(values) for name, values in columns.items() if len(values) != count}
    if misaligned:
        raise ValueError(f"columns {misaligned} do not have one entry per completion ({count})")
    names = reward_function_names(reward_funcs)
    values = torch.full((count, len(reward_funcs)), math.nan, dtype=torch.float32)
    timeouts = []
    for index, (function, name) in enumerate(zip(reward_funcs, names, strict=True)):
        with counting_timeouts() as counter, noting_ctrl_c() as ctrl_c:
            try:
                returned = function(prompts, completions, **columns)
            except (Exception, SystemExit, KeyboardInterrupt) as error:  # sys.exit() in a reward is its failure
                if isinstance(error, KeyboardInterrupt) and ctrl_c:  # the user's Ctrl-C, not the reward's own raise
                    raise
                detail = f": {error}" if str(error) else ""
                raise RewardFunctionError(f"reward function '{name}' raised {type(error).__name__}{detail}") from error
        values[:, index] = torch.tensor(validated_rewards(returned, name, count), dtype=torch.float32)
        timeouts.append(counter[0])
    return RewardTable(names, values, timeouts)


# ---------------------------------------------------------------------------------------------
# From a rollout
# ---------------------------------------------------------------------------------------------


def completion_texts(tokenizer, rollout: Rollout) -> list[str]:
    """Decoded completions, cut at the completion mask (first EOS), special tokens dropped."""
    ids = rollout.completion_ids.masked_fill(~rollout.completion_mask, tokenizer.pad_token_id)
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


def as_trl_completions(prompts: list, texts: list[str]) -> list:
    """TRL convention: conversational prompts get completions as assistant-message lists, plain prompts get strings."""
    return [[{"role": "assistant", "content": t}] if isinstance(p, list) else t for p, t in zip(prompts, texts)]


def score_rollout_table(tokenizer, reward_funcs, columns: dict[str, list], rollout: Rollout) -> RewardTable:
    """Every reward function's values on a rollout's completions; ``columns`` holds the prompts' dataset rows
    (``prompt`` and the reward columns); the functions also get ``completion_ids``."""
    prompts = columns["prompt"]
    extra = {k: v for k, v in columns.items() if k != "prompt"}
    extra["completion_ids"] = [ids[mask].tolist() for ids, mask in zip(rollout.completion_ids, rollout.completion_mask)]
    return score_completions(reward_funcs, prompts, as_trl_completions(prompts, completion_texts(tokenizer, rollout)),
                             extra)


def score_rollout(tokenizer, reward_funcs, columns: dict[str, list], rollout: Rollout,
                  reward_weights: list[float] | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Rewards [B] (float32) of a rollout's completions (the weighted sum, see `RewardTable.weighted_sum`) and
    the reward metrics (`RewardTable.metrics`)."""
    table = score_rollout_table(tokenizer, reward_funcs, columns, rollout)
    return table.weighted_sum(reward_weights), table.metrics()
