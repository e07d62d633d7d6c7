"""The house rules of imports, read from the source with ``ast`` (nothing is imported):

- no two modules of our packages import each other, directly or around a circle. Every import
  counts: module-level, inside functions (they run when called), under ``if TYPE_CHECKING:`` (a
  type-only import still ties the two modules into one circle: neither reads without the other),
  and ``importlib.import_module("a.literal.name")``;
- ``kernels/`` imports nothing from ``engine/`` or ``lora/`` (a kernel knows nothing of its callers);
- ``engine/`` reaches ``lora/`` only through its entry modules (the adapter update enters the
  layers through ``engine.layers.adapter``), and ``lora/`` never imports model files.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "lora", "kernels", "multimodal", "encoders")
LORA_ENTRY_MODULES = {"lora", "lora.request", "lora.errors", "lora.manager", "lora.slot_manager"}
"""What engine/ may import from lora/: the request type, errors, the runner-side manager and the
scheduler-side slot manager; never the layers, kernels glue or PEFT reading."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _all_modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}


def _literal_import_module(node: ast.AST) -> str | None:
    """The module a call ``importlib.import_module("name")`` (or ``import_module("name")``) names
    with a string literal; None for any other node."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)):
        return None
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    return node.args[0].value if name == "import_module" else None


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> list[str]:
    """Dotted names this module imports anywhere in its source (see the module docstring)."""
    out: list[str] = []

    def visit(node: ast.AST) -> None:
        literal = _literal_import_module(node)
        if literal is not None:
            out.append(literal)
        elif isinstance(node, ast.Import):
            out.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            out.extend(f"{prefix}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _all_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for imported in _imported_names(ast.parse(path.read_text()), name, path.name == "__init__.py"):
            # the most specific module of ours that the name is (or lies in)
            parts = imported.split(".")
            while parts and ".".join(parts) not in modules:
                parts.pop()
            target = ".".join(parts)
            if target and target != name:
                deps.add(target)
        graph[name] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_kernels_import_nothing_from_their_callers():
    bad = {m: sorted(d for d in deps if d.split(".")[0] in ("engine", "lora"))
           for m, deps in _graph().items() if m.split(".")[0] == "kernels"}
    assert {m: d for m, d in bad.items() if d} == {}


def test_engine_reaches_lora_through_its_entry_modules_only():
    bad = {m: sorted(d for d in deps if d.split(".")[0] == "lora" and d not in LORA_ENTRY_MODULES)
           for m, deps in _graph().items() if m.split(".")[0] == "engine"}
    assert {m: d for m, d in bad.items() if d} == {}


def test_lora_never_imports_model_files():
    bad = {m: sorted(d for d in deps if d.startswith("engine.models"))
           for m, deps in _graph().items() if m.split(".")[0] == "lora"}
    assert {m: d for m, d in bad.items() if d} == {}


CIRCLE = [["engine.a", "engine.b"]]
"""What the walk reports when engine.a imports engine.b (which imports engine.a)."""


@pytest.mark.parametrize("source, expected", [
    ("import engine.b\n", CIRCLE),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import engine.b\n", CIRCLE),
    ("def f():\n    from engine import b\n", CIRCLE),
    ("import importlib\ndef f():\n    return importlib.import_module('engine.b')\n", CIRCLE),
    ("import importlib\ndef f(name):\n    return importlib.import_module(name)\n", []),
    ("import engine\n", []),
])
def test_the_walk_finds_a_planted_cycle(source, expected):
    """The checker itself: engine.b imports engine.a; engine.a's source decides whether they circle."""
    graph = {"engine.a": set(), "engine.b": {"engine.a"}}
    modules = {"engine.a", "engine.b", "engine"}
    for imported in _imported_names(ast.parse(source), "engine.a", False):
        parts = imported.split(".")
        while parts and ".".join(parts) not in modules:
            parts.pop()
        if parts and ".".join(parts) != "engine.a" and ".".join(parts) != "engine":
            graph["engine.a"].add(".".join(parts))
    assert _cycles(graph) == expected
