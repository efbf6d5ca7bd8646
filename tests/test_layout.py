"""The package layout: no import cycle between dijax's modules (imports inside functions included), and
dijax/kernels a leaf package (it imports nothing from the rest of dijax)."""

from __future__ import annotations

import ast
import os

import dijax

ROOT = os.path.dirname(dijax.__file__)


def _modules() -> dict[str, str]:
    """{dotted module name: file path} of every module in the dijax package."""
    found = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                parts = os.path.relpath(path, os.path.dirname(ROOT))[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                found[".".join(parts)] = path
    return found


def _imports(module: str, path: str, modules: dict[str, str]) -> set[str]:
    """The dijax modules ``module`` imports anywhere in its file: ``from a import b`` counts as an import of a.b when
    that is a module, else of a."""
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: the package, less one level per dot beyond the first
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                name = f"{base}.{alias.name}"
                found.add(name if name in modules else base)
    return {name for name in found if name in modules and name != module}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {module: _imports(module, path, modules) for module, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_is_read():
    graph = _graph()
    assert {"dijax.model.attention", "dijax.kernels.topk", "dijax.runtime.llm_engine"} <= set(graph)
    assert "dijax.kernels.topk" in graph["dijax.model.attention"]  # `from dijax.kernels.topk import topk_ascending`
    assert "dijax.kernels.indexer" in graph["dijax.model.attention"]  # `from dijax.kernels import indexer, quant`


def test_no_import_cycle():
    assert _cycles(_graph()) == []


def test_a_planted_cycle_is_found():
    graph = _graph()
    graph["dijax.kernels.topk"] = graph["dijax.kernels.topk"] | {"dijax.model.attention"}
    assert any({"dijax.kernels.topk", "dijax.model.attention"} <= set(c) for c in _cycles(graph))


def test_kernels_is_a_leaf_package():
    for module, imports in _graph().items():
        if module.startswith("dijax.kernels"):
            outside = sorted(name for name in imports if not name.startswith("dijax.kernels"))
            assert outside == [], f"{module} imports {outside}"
