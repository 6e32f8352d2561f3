"""The config's reference text: the field list of `dllm-ais train --help` and docs/configuration.md, both generated
from the fields' metadata (help, choices, range) of `GRPOConfig` and its settings groups.

This module imports nothing heavy: `dllm-ais --help` must not import torch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dllm_ais.config import GRPOConfig
from dllm_ais.settings import GROUP, SETTINGS_GROUPS
from dllm_ais.validation import Interval


# The top-level fields' sections in `--help` and docs/configuration.md: (title, the section's first field)
TOP_LEVEL_SECTIONS = (("model", "model_name_or_path"), ("data and rewards", "task"),
                      ("sampling (TRL's names)", "num_generations"), ("loss", "beta"),
                      ("optimisation", "learning_rate"), ("output and run", "output_dir"))
HELP_WIDTH = 150


def config_sections() -> list[tuple[str, str, list[dataclasses.Field]]]:
    """(title, option prefix, fields) of each section of the config: the top-level fields by `TOP_LEVEL_SECTIONS`,
    then each settings group (prefix ``group.``)."""
    top = [f for f in dataclasses.fields(GRPOConfig) if not f.metadata.get(GROUP)]
    starts = [next(i for i, f in enumerate(top) if f.name == first) for _, first in TOP_LEVEL_SECTIONS]
    sections = [(title, "", top[start:end]) for (title, _), start, end
                in zip(TOP_LEVEL_SECTIONS, starts, [*starts[1:], len(top)])]
    return sections + [(f"{name}: {group.TITLE}", f"{name}.", list(dataclasses.fields(group)))
                       for name, group in SETTINGS_GROUPS.items()]


def describe_fields() -> str:
    """The body of `dllm-ais train --help`: each section of the config under its heading, one line per field
    (``--name=default  help [choices] range``, the help's first sentence, at most `HELP_WIDTH` characters; the full
    text is in docs/configuration.md, `configuration_reference`)."""
    lines = []
    for title, prefix, fields in config_sections():
        lines += [f"{title}:"] + [_field_line(prefix, f) for f in fields] + [""]
    return "\n".join(lines).rstrip()


def configuration_reference() -> str:
    """docs/configuration.md: every field of every section with its default, its full help, choices and range
    (a test keeps the file equal to this)."""
    lines = ["# Configuration reference", "",
             "Generated from `dllm_ais/config.py` by `dllm_ais.config_reference.configuration_reference` (the test suite checks it "
             "is current). Set a field in "
             "a YAML recipe (settings groups as nested mappings: `rollout: {cache: dual}`) or on the command line "
             "(`--learning_rate=1e-5`, `--rollout.cache=dual`). The `experimental` group holds study knobs: they may "
             "change between releases.", ""]
    for title, prefix, fields in config_sections():
        lines += [f"## {title}", "", "| field | default | description |", "| --- | --- | --- |"]
        lines += [f"| `{prefix}{f.name}` | `{_default(f)}` | {_field_text(f, full=True)} |" for f in fields]
        lines.append("")
    return "\n".join(lines)


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _field_text(f: dataclasses.Field, full: bool) -> str:
    """A field's help (the first sentence unless `full`), choices and range."""
    help_text = f.metadata.get("help", "")
    extra = [help_text if full else _first_sentence(help_text)]
    if "choices" in f.metadata:
        extra.append("[" + "|".join(f.metadata["choices"]) + "]")
    if "range" in f.metadata:
        extra.append(Interval.parse(f.metadata["range"]).describe().replace("must be ", ""))
    return " ".join(e for e in extra if e).replace("|", "\\|" if full else "|")


def _field_line(prefix: str, f: dataclasses.Field) -> str:
    """``  --prefix.name=default  help [choices] range`` of one field, cut to `HELP_WIDTH` characters."""
    line = f"  {f'--{prefix}{f.name}={_default(f)}':<44} {_field_text(f, full=False)}".rstrip()
    return line if len(line) <= HELP_WIDTH else line[:HELP_WIDTH - 1] + "…"


def _first_sentence(text: str) -> str:
    """`text` up to the end of its first sentence (a period followed by a space)."""
    head, period, _ = text.partition(". ")
    return head + "." if period else text
