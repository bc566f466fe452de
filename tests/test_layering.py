"""The import structure the house rests on, read from the source (every import, those inside functions too;
those under ``if TYPE_CHECKING:`` never run and are left out): no module imports itself back through others,
the cost models sit below everything that plans with them, and the simulator above the engine it drives."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "tokenmill"


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """tokenmill module -> the tokenmill modules it imports (``from a.b import c`` counts as a.b.c where c is a
    module, else a.b)."""
    modules = {_name(p): p for p in ROOT.rglob("*.py")}

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for mod, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
        deps = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            deps.update(r for n in names if n.startswith("tokenmill") and (r := resolve(n)) not in (None, mod))
        graph[mod] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                on.discard(w)
                comp.append(w)
            on.discard(v)
            if comp:
                out.append(sorted([v, *comp]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_itself_back():
    assert _cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle():  # the negative control: a circle through three modules is reported
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_cost_models_import_only_the_config_and_platform():
    """perf/ (what a step costs) is below the engine, the scheduler and the simulator, which all use it."""
    allowed = {"tokenmill.config", "tokenmill.platform"}
    graph = import_graph()
    wrong = {m: sorted(d for d in deps if not d.startswith("tokenmill.perf") and d not in allowed)
             for m, deps in graph.items() if m.startswith("tokenmill.perf")}
    assert {m: d for m, d in wrong.items() if d} == {}
    assert "tokenmill.perf.cost" in graph  # (the package is where this test looks)


def test_only_the_command_line_imports_the_simulator():
    """The engine starts without sim/: the simulator drives the engine's scheduler, not the other way."""
    graph = import_graph()
    users = sorted(m for m, deps in graph.items() if not m.startswith("tokenmill.sim")
                   and any(d.startswith("tokenmill.sim") for d in deps))
    assert users == ["tokenmill.cli"]
