"""Code shape limits: no function over 100 lines and no class over 300 lines in the engine's packages,
and the engine core's class and step kept short (the step reads as a sequence of named calls).

Lengths are those `ast` gives: a function or class from its `def` / `class` line (decorators aside)
to its last line, docstring and comments included. Nested functions and methods count on their own.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("moe_serve", "attention", "expert_parallel", "launcher")
# Outside the limits: the benchmark scripts, the bundled default model, and the ahead-of-time
# compile check (a command-line tool whose configuration tables read best whole).
EXCLUDED = ("moe_serve/benchmarks/", "moe_serve/default_model/", "moe_serve/kernels/aot_check.py")
MAX_FUNCTION = 100
MAX_CLASS = 300
ENGINE_CORE = ("moe_serve/engine/core.py", "EngineCore")
MAX_ENGINE_CORE = 250
ENGINE_STEP_METHODS = ("execute", "step")
MAX_ENGINE_STEP = 40


def _length(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


def violations(source: str, path: str, max_function: int = MAX_FUNCTION, max_class: int = MAX_CLASS) -> list[str]:
    """'path:line name: N lines (limit L)' for every function over max_function lines and class over
    max_class lines in source."""
    out = []
    for node in ast.walk(ast.parse(source, filename=path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            kind, limit = "function", max_function
        elif isinstance(node, ast.ClassDef):
            kind, limit = "class", max_class
        else:
            continue
        if _length(node) > limit:
            out.append(f"{path}:{node.lineno} {kind} {node.name}: {_length(node)} lines (limit {limit})")
    return out


def _sources() -> list[Path]:
    files = []
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            rel = p.relative_to(ROOT).as_posix()
            if not rel.startswith(EXCLUDED) and rel not in EXCLUDED:
                files.append(p)
    return files


def test_sources_are_found():
    rels = {p.relative_to(ROOT).as_posix() for p in _sources()}
    assert {"moe_serve/engine/core.py", "attention/backends/triton_paged.py", "moe_serve/scheduler.py"} <= rels
    assert not any(r.startswith(("moe_serve/benchmarks/", "moe_serve/default_model/")) for r in rels)
    assert "moe_serve/kernels/aot_check.py" not in rels
    assert any(r.startswith("expert_parallel/") for r in rels) and any(r.startswith("launcher/") for r in rels)


def test_no_long_functions_or_classes():
    found = []
    for p in _sources():
        found += violations(p.read_text(), p.relative_to(ROOT).as_posix())
    assert not found, "split these into named steps:\n  " + "\n  ".join(found)


def test_engine_core_and_its_step_are_short():
    path, name = ENGINE_CORE
    tree = ast.parse((ROOT / path).read_text(), filename=path)
    core = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)
    assert core is not None, f"{path} defines no class {name}"
    problems = []
    if _length(core) > MAX_ENGINE_CORE:
        problems.append(f"{path}:{core.lineno} class {name}: {_length(core)} lines (limit {MAX_ENGINE_CORE})")
    for node in core.body:
        if isinstance(node, ast.FunctionDef) and node.name in ENGINE_STEP_METHODS and _length(node) > MAX_ENGINE_STEP:
            problems.append(f"{path}:{node.lineno} {name}.{node.name}: {_length(node)} lines "
                            f"(limit {MAX_ENGINE_STEP})")
    assert not problems, "\n".join(problems)


def test_the_check_names_what_is_too_long():
    body = "\n".join(f"    x{i} = {i}" for i in range(101))
    src = f"class Small:\n    pass\n\n\ndef long_one():\n{body}\n\n\ndef short_one():\n    return 1\n"
    assert violations(src, "pkg/mod.py") == ["pkg/mod.py:5 function long_one: 102 lines (limit 100)"]
    methods = "\n".join(f"    def m{i}(self):\n        return {i}\n" for i in range(101))
    assert violations(f"class Big:\n{methods}", "pkg/big.py") == ["pkg/big.py:1 class Big: 303 lines (limit 300)"]
    assert violations("async def f():\n" + body.replace("    x", "    y"), "a.py", max_function=50) == [
        "a.py:1 function f: 102 lines (limit 50)"]
