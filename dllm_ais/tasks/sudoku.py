"""4x4 Sudoku from a local CSV (no default hub dataset; pass ``dataset_path``).

Columns: ``Puzzle``/``puzzle`` and ``Solution``/``solution``, 16 digits row by row ('0' = empty;
grids read as integers get their leading zeros back). Reward: the fraction of the puzzle's empty
cells filled correctly; accuracy: 1.0 when every empty cell is correct.
"""

from __future__ import annotations

import numbers
import re
from typing import Any

from dllm_ais.tasks import REASONING_FORMAT, Messages, Task, accuracy_of, user_prompt
from dllm_ais.tasks.parsing import completion_texts, dataset_column, extract_xml_answer

INSTRUCTIONS = (REASONING_FORMAT + "\nYou solve 4x4 Sudoku puzzles. Every row, every column and each of the four "
                "2x2 boxes must contain the digits 1, 2, 3 and 4 exactly once. The puzzle is given as 16 digits, row "
                "by row, where 0 marks an empty cell. The answer block holds the completed grid as 16 digits, row by "
                "row.")
CELLS = 16


def prompt(puzzle: str) -> Messages:
    """Chat prompt for a 4x4 Sudoku puzzle given as 16 digits ('0' = empty)."""
    return user_prompt(INSTRUCTIONS, f"Solve this 4x4 Sudoku puzzle: {puzzle}")


def sudoku_grid(value: Any) -> str:
    """Return a 4x4 Sudoku grid as a 16-digit string ('0' = empty); integers read from a CSV get
    their leading zeros back. Raises ValueError for anything that is not 16 digits."""
    grid = str(value).zfill(CELLS) if isinstance(value, numbers.Integral) else str(value).strip()
    if not re.fullmatch(rf"\d{{{CELLS}}}", grid):
        raise ValueError(f"a 4x4 Sudoku grid must be {CELLS} digits ('0' = empty), got {value!r}")
    return grid


def to_example(row: dict[str, Any]) -> dict[str, Any]:
    """Prompt for a Sudoku row, with ``puzzle`` and ``solution`` as 16-digit strings."""
    puzzle = sudoku_grid(row["puzzle"])
    return {"prompt": prompt(puzzle), "puzzle": puzzle, "solution": sudoku_grid(row["solution"])}


def sudoku_score(text: str, puzzle: str, solution: str) -> float:
    """Fraction of the puzzle's empty cells (all cells if it has none) that the completion fills
    correctly, reading the first 16 digits of its ``<answer>`` block (of the whole text when it
    has none); cells it leaves out count as wrong."""
    answer = extract_xml_answer(text)
    filled = re.findall(r"\d", text if answer is None else answer)[:CELLS]
    graded_cells = [cell for cell in range(CELLS) if puzzle[cell] == "0"] or list(range(CELLS))
    correct = sum(1 for cell in graded_cells if cell < len(filled) and filled[cell] == solution[cell])
    return correct / len(graded_cells)


def sudoku_reward(prompts: list, completions: list, **kwargs) -> list[float]:
    """Per completion, :func:`sudoku_score` against the ``puzzle`` and ``solution`` columns."""
    puzzles = dataset_column(kwargs, "puzzle", "sudoku_reward")
    solutions = dataset_column(kwargs, "solution", "sudoku_reward")
    return [
        sudoku_score(text, sudoku_grid(puzzle), sudoku_grid(solution))
        for text, puzzle, solution in zip(completion_texts(completions, "sudoku_reward"), puzzles, solutions,
                                          strict=True)
    ]


TASK = Task(
    name="sudoku",
    reward_funcs=(sudoku_reward,),
    accuracy=accuracy_of(sudoku_reward, 1.0, "sudoku_accuracy"),
    to_example=to_example,
    required_columns=(("puzzle",), ("solution",)),
    retyped_columns=("puzzle", "solution"),
    sample_rows=({"puzzle": "1030000221000300", "solution": "1234341221434321"},),
)
