"""No import cycle among the engine's packages (moe_serve, launcher, expert_parallel, attention).

The graph is read from the source with `ast`, not by importing: an edge A -> B for every import in
A that names a module B of these packages, at module level or inside a function (a lazy import only
defers a cycle to the call that closes it). `from P import X` is an edge to P.X when that is a
module, else to P. Imports under `if TYPE_CHECKING:` never run and do not count. The command-line
modules share their flags through one leaf (moe_serve/entrypoints/cli_args.py) for this reason.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("moe_serve", "launcher", "expert_parallel", "attention")


def module_files(root: Path = ROOT, packages=PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the packages (a package is its __init__)."""
    out = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every Import / ImportFrom node, at any depth, outside `if TYPE_CHECKING:` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        children = list(ast.iter_child_nodes(node))
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            children = node.orelse
        stack.extend(children)


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """Module -> the modules (of `sources`) it imports. sources: module -> (its source, whether it
    is a package's __init__), the package for relative imports."""
    def known(name: str) -> str | None:
        while name and name not in sources:  # `import a.b.c` of a name inside a module: that module
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, (text, is_pkg) in sources.items():
        edges = graph.setdefault(mod, set())
        for node in _imports(ast.parse(text)):
            if isinstance(node, ast.Import):
                targets = [known(a.name) for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    pkg = pkg[:len(pkg) - (node.level - 1)]
                    base = ".".join(pkg + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in sources else known(base) for a in node.names]
            edges.update(t for t in targets if t is not None and t != mod)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search, iterative)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, its = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while path:
            nxt = next(its[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                its.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                its.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_no_import_cycle():
    files = module_files()
    assert "launcher.worker" in files and "moe_serve.entrypoints.cli" in files
    graph = import_graph({m: (p.read_text(), p.name == "__init__.py") for m, p in files.items()})
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_check_finds_a_cycle():
    """The check can fail: function-level, relative and from-imports close a cycle; a
    TYPE_CHECKING import does not."""
    sources = {
        "p": ("", True),
        "p.cli": ("def main():\n    from p.worker import run\n", False),
        "p.worker": ("from . import helpers\n", False),
        "p.helpers": ("import p.cli.main\n", False),
        "p.typed": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.cli import main\n", False),
    }
    graph = import_graph(sources)
    assert graph["p.worker"] == {"p.helpers"} and graph["p.helpers"] == {"p.cli"} and graph["p.typed"] == set()
    assert find_cycle(graph) == ["p.cli", "p.worker", "p.helpers", "p.cli"]
    sources["p.helpers"] = ("", False)
    assert find_cycle(import_graph(sources)) is None
