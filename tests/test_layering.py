"""The import structure the house rests on, read from the source (every import, those inside functions too):
no module imports itself back through others, not even for a type; every package imports only the packages
below it (PACKAGE_ORDER; imports under ``if TYPE_CHECKING:`` never run and are left out of this one); the cost
models sit below everything that plans with them, and the simulator above the engine it drives."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "tokenmill"


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def import_graph(typing: bool = False) -> dict[str, set[str]]:
    """tokenmill module -> the tokenmill modules it imports (``from a.b import c`` counts as a.b.c where c is a
    module, else a.b); with ``typing``, those imported under ``if TYPE_CHECKING:`` too."""
    modules = {_name(p): p for p in ROOT.rglob("*.py")}

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for mod, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        typing_only = set() if typing else {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
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
    assert _cycles(import_graph(typing=True)) == []  # not even for a type annotation


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


def test_only_the_command_line_and_the_live_replay_import_the_simulator():
    """The engine starts without sim/: the simulator drives the engine's scheduler, not the other way; the
    server's live replay (server/live_replay.py) runs it on the served traffic."""
    graph = import_graph()
    users = sorted(m for m, deps in graph.items() if not m.startswith("tokenmill.sim")
                   and any(d.startswith("tokenmill.sim") for d in deps))
    assert users == ["tokenmill.cli", "tokenmill.server.live_replay"]


# The packages from the bottom up: a module may import its own package and those in tiers below its own, never
# one beside or above it. (The wire contract core/sched_output.py imports nothing of tokenmill, so the runner,
# the drafters and the connector can read it while sitting above the scheduler.)
PACKAGE_ORDER = [
    {"pooling_params"},  # (a field of SamplingParams)
    {"config", "platform", "sampling_params", "outputs", "generation_config", "monitor", "version"},
    {"request", "structured_output", "perf"},
    {"distributed"},  # process groups, messages, sharding, pipeline stages: no model code
    {"layers"},
    {"tokenizer"},
    {"models"},
    {"lora"},  # adapters (files, the wrapper layer, the pool and slots): around the model, below the scheduler
    {"core"},  # the scheduler, the KV pool, the contract
    {"spec_decode"},
    {"worker"},
    {"executor"},
    {"kv_transfer"},
    {"engine"},
    {"bench", "eval"},
    {"sim"},  # drives the engine's scheduler; the server replays its own traffic through it
    {"server"},
    {"cli", "__init__"},
]


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _against_order(graph: dict[str, set[str]], order: list[set[str]]) -> list[tuple[str, str]]:
    tier = {p: i for i, ps in enumerate(order) for p in ps}
    return sorted((m, d) for m, deps in graph.items() for d in deps
                  if _package(d) != _package(m) and tier[_package(d)] >= tier[_package(m)])


def test_every_package_imports_only_packages_below_it():
    graph = import_graph()
    assert {_package(m) for m in graph} == set().union(*PACKAGE_ORDER)  # every package has its tier
    assert _against_order(graph, PACKAGE_ORDER) == []


def test_the_order_check_finds_an_import_upwards():  # negative control: the scheduler importing the engine
    graph = {"tokenmill.core.scheduler": {"tokenmill.engine.core", "tokenmill.config"},
             "tokenmill.engine.core": {"tokenmill.core.scheduler"}, "tokenmill.config": set()}
    assert _against_order(graph, PACKAGE_ORDER) == [("tokenmill.core.scheduler", "tokenmill.engine.core")]
