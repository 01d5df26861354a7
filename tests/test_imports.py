"""Imports go one way: the product (swa_ext) <- its tools (swa_ext.simulator, swa_ext.cli)
<- the benchmarks (bench/, installed as swa_ext_bench) and the tests.

The graph is read from the sources' import statements, those inside functions too (what
runs late still runs), with bench/ named swa_ext_bench as installed. A package's
``__init__`` re-exporting its modules is not an edge back from them: they never import
their package by name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"swa_ext": ROOT / "swa_ext", "swa_ext_bench": ROOT / "bench"}
# Each package's modules, each importing only those before it.
ORDERED = {
    "swa_ext.simulator": ("scenario", "node", "budgets", "runs", "report"),
    "swa_ext_bench.micro": ("cases", "measure", "report", "cli"),
}


def modules() -> dict[str, Path | None]:
    found = {"swa_ext._C": None}  # the native module: it imports nothing of these
    for package, root in PACKAGES.items():
        for path in root.rglob("*.py"):
            if path.name == "setup.py":
                continue
            parts = [package, *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path | None]) -> set[str]:
    """The known modules that module ``name`` imports (a name imported from a package is
    that package's module when there is one, else the package)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


GRAPH = {name: imports(name, path, modules()) if path else set() for name, path in modules().items()}


def test_the_graph_sees_the_packages():
    assert {"swa_ext.cli", "swa_ext.simulator.node", "swa_ext_bench.micro.cli", "swa_ext_bench.sglang_step"} <= set(GRAPH)
    assert "swa_ext.decode" in GRAPH["swa_ext_bench.micro.cases"]


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph``, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle():
    assert cycle(GRAPH) is None, " -> ".join(cycle(GRAPH))


def test_a_cycle_is_found():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_product_imports_no_benchmark():
    wrong = {name: sorted(t for t in targets if t.startswith("swa_ext_bench"))
             for name, targets in GRAPH.items() if name.startswith("swa_ext.")}
    assert not any(wrong.values()), wrong


@pytest.mark.parametrize("package", sorted(ORDERED))
def test_each_module_imports_only_those_before_it(package):
    order = ORDERED[package]
    assert {n.rpartition(".")[2] for n in GRAPH if n.startswith(package + ".")} == set(order)
    for i, module in enumerate(order):
        siblings = {t.rpartition(".")[2] for t in GRAPH[f"{package}.{module}"] if t.startswith(package + ".")}
        assert siblings <= set(order[:i]), (module, siblings)
