"""The README stays short, and its Python example runs as written."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
MAX_LINES = 250


def python_example(text: str) -> str:
    """The first ```python block under the README's heading that contains "Python"."""
    heading = re.search(r"^#+ .*Python.*$", text, flags=re.MULTILINE)
    assert heading, "README has no heading naming Python"
    block = re.search(r"^```python\n(.*?)^```", text[heading.end():], flags=re.MULTILINE | re.DOTALL)
    assert block, "no ```python block under the README's Python heading"
    return block.group(1)


def test_readme_is_at_most_250_lines():
    lines = README.read_text().count("\n")
    assert lines <= MAX_LINES, f"README.md has {lines} lines; keep it to {MAX_LINES} (details go to docs/)"


@pytest.mark.slow
def test_readme_python_example_trains(tmp_path):
    code = python_example(README.read_text())
    (tmp_path / "example.py").write_text(code)
    # A fresh interpreter in an empty directory: the example must define every name it uses, and its
    # output_dir lands in tmp_path. This checkout's package comes first on the path.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"README example failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert "held-out reward: before" in done.stdout + done.stderr
    assert list(tmp_path.glob("outputs/*/final")), "the example wrote no model under its output_dir"
