"""The import graph of `dllm_ais`: no import circles, and no module importing one of a higher layer.

Every module under `dllm_ais/` is parsed with `ast`; each `import dllm_ais...` / `from dllm_ais... import ...` in it
is an arrow, wherever it stands: at the top, inside a function, or under `if TYPE_CHECKING:` (a dependency all the
same, and the usual way to hide a circle). `from package import name` points at the submodule `package.name` when
there is one, else at the package. Importing `a.b` also runs `a/__init__.py`; that implicit arrow is not counted
(a package's `__init__` re-exporting its own submodules is no circle).
"""
from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "dllm_ais"
ROOT = PACKAGE_DIR.name

LAYERS: list[tuple[str, set[str]]] = [
    # bottom → top: a module may import modules of its own layer and of the layers below, never above. The units are
    # dllm_ais's top-level modules and packages (every module of `likelihood/` is in `likelihood`'s layer);
    # "__init__" is `dllm_ais/__init__.py`.
    ("foundations: no dllm_ais import", {"ops", "choices", "validation", "console", "interruption", "trackers",
                                         "rollout", "models", "safe_json", "safe_files", "statistics"}),
    ("the stages' settings groups", {"settings"}),
    ("the step's numerical stages", {"sampling", "likelihood", "quantization", "engine", "correction", "loss",
                                     "metrics"}),
    ("tasks and their rewards", {"tasks", "rewards"}),
    ("the config and its rules", {"config", "config_rules", "config_reference", "decoding_protocols"}),
    ("a run's inputs and outputs", {"data", "loading", "run_lock", "run_dir", "reporting"}),
    ("the policy seam", {"policy", "fidelity"}),
    ("one GRPO step and what it is built from", {"grpo", "components", "evaluation", "checkpoint",
                                                  "checkpoint_choice", "checkpoint_loading"}),
    ("training loops", {"trainer", "sft", "launch"}),
    ("entry points", {"cli", "commands", "inference_commands", "dry_run", "export", "__init__", "compare",
                      "compare_plan", "compare_reuse", "compare_report", "bench", "experimental", "lm_eval_model",
                      "lm_eval_requests", "lm_eval_arguments"}),
]

def _module_files() -> dict[str, Path]:
    modules = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


MODULES = _module_files()


def _known_module(name: str) -> str:
    """The longest prefix of the dotted `name` that is a module of the package."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imported_modules(module: str, path: Path) -> dict[str, int]:
    """The dllm_ais modules `module` imports, each with the line of its first import there."""
    arrows: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = module if path.name == "__init__.py" else module.rpartition(".")[0]
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in MODULES else source
                       for alias in node.names]
        else:
            continue
        for target in targets:
            if target == ROOT or target.startswith(f"{ROOT}."):
                imported = _known_module(target)
                if imported != module:
                    arrows.setdefault(imported, node.lineno)
    return arrows


GRAPH = {module: _imported_modules(module, path) for module, path in MODULES.items()}


def _unit(module: str) -> str:
    """The layered unit of a module: its top-level name under dllm_ais, "__init__" for dllm_ais itself."""
    return module.split(".")[1] if "." in module else "__init__"


LAYER_OF = {unit: index for index, (_, units) in enumerate(LAYERS) for unit in units}


def _arrow(source: str, target: str) -> str:
    return f"{source} → {target} ({MODULES[source].relative_to(PACKAGE_DIR.parent)}:{GRAPH[source][target]})"


def _edges() -> dict[str, set[str]]:
    return {source: set(targets) for source, targets in GRAPH.items()}


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One shortest circle through each strongly connected component of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(edges):
        if node not in index:
            visit(node)
    cycles = []
    for component in components:
        start = min(component)
        previous = {start: None}
        queue = deque([start])
        while queue:
            node = queue.popleft()
            for target in sorted(edges[node] & component):
                if target == start:
                    chain = [node]
                    while previous[chain[-1]] is not None:
                        chain.append(previous[chain[-1]])
                    cycles.append([*reversed(chain), start])
                    queue.clear()
                    break
                if target not in previous:
                    previous[target] = node
                    queue.append(target)
    return cycles


def _package_edges(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """The arrows between layered units (`likelihood.registry → rollout` is `likelihood → rollout`)."""
    units: dict[str, set[str]] = {}
    for source, targets in edges.items():
        units.setdefault(_unit(source), set()).update(_unit(target) for target in targets)
    return {unit: targets - {unit} for unit, targets in units.items()}


def _circle_report(edges: dict[str, set[str]]) -> list[str]:
    modules = [" → ".join(chain) for chain in _cycles(edges)]
    units = [" → ".join(chain) for chain in _cycles(_package_edges(edges))]
    return [f"module circle: {chain}" for chain in modules] + [f"package circle: {chain}" for chain in units]


def _back_arrows(edges: dict[str, set[str]]) -> list[str]:
    return [
        f"{_arrow(source, target)}: layer {LAYER_OF[_unit(source)]} imports layer {LAYER_OF[_unit(target)]} "
        f"({LAYERS[LAYER_OF[_unit(target)]][0]})"
        for source in sorted(edges) for target in sorted(edges[source])
        if LAYER_OF[_unit(target)] > LAYER_OF[_unit(source)]
    ]


def test_the_graph_sees_the_package():
    assert f"{ROOT}.likelihood.registry" in MODULES
    assert f"{ROOT}.rollout" in GRAPH[f"{ROOT}.likelihood.trajectory"]
    assert f"{ROOT}.likelihood" in GRAPH[f"{ROOT}.sampling.autoregressive"]


def test_every_module_has_one_layer():
    units = {_unit(module) for module in MODULES}
    declared = [unit for _, layer in LAYERS for unit in layer]
    assert sorted(units - set(declared)) == [], "modules without a layer: add them to LAYERS"
    assert sorted(set(declared) - units) == [], "LAYERS names modules that do not exist"
    assert len(declared) == len(set(declared)), "a unit is in two layers"


def test_no_import_circles():
    circles = _circle_report(_edges())
    assert circles == [], "import circles:\n" + "\n".join(circles)


def test_no_import_from_a_higher_layer():
    back_arrows = _back_arrows(_edges())
    assert back_arrows == [], "imports from a higher layer:\n" + "\n".join(back_arrows)
