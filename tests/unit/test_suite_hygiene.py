"""The test suite checks itself: no test file holds a statement that can never run.

A statement after `return`, `raise`, `continue` or `break` in the same block is dead: an assertion
there passes silently forever (tests/distributed/test_eplb_collectives.py once had its last check
of the ranks' expert slots after a `return`). Every .py file under tests/ is parsed with `ast`, and
every block is checked: module and function bodies (nested ones too), both branches of an `if`,
loop bodies and their `else`, `try` bodies, handlers, `else` and `finally`, `with` bodies, `match`
cases.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
TERMINAL = (ast.Return, ast.Raise, ast.Continue, ast.Break)


def unreachable(source: str, filename: str = "<string>") -> list[str]:
    """'file:line: <statement> follows <terminal> at line N' for each block's first statement that
    follows a return/raise/continue/break of the same block."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        for _, block in ast.iter_fields(node):
            if not isinstance(block, list) or not block or not all(isinstance(s, ast.stmt) for s in block):
                continue
            for before, after in zip(block, block[1:]):
                if isinstance(before, TERMINAL):
                    found.append(f"{filename}:{after.lineno}: {type(after).__name__.lower()} follows "
                                 f"{type(before).__name__.lower()} at line {before.lineno}")
                    break  # the rest of the block is dead for the same reason
    return found


def test_no_test_file_has_unreachable_statements():
    found = []
    files = sorted(TESTS.rglob("*.py"))
    assert len(files) > 50, files  # the whole suite, not an empty glob
    for path in files:
        found += unreachable(path.read_text(), str(path.relative_to(TESTS.parent)))
    assert not found, "statements that can never run:\n" + "\n".join(found)


@pytest.mark.parametrize("src, line", [
    ("def f():\n    return 1\n    assert False\n", 3),
    ("def f(x):\n    if x:\n        raise ValueError\n        x = 2\n    return x\n", 4),
    ("def f(x):\n    if x:\n        pass\n    else:\n        return 0\n        print(x)\n", 6),
    ("for i in range(3):\n    continue\n    print(i)\n", 3),
    ("while True:\n    break\n    x = 1\n", 3),
    ("for i in range(3):\n    pass\nelse:\n    raise SystemExit\n    y = 1\n", 5),
    ("try:\n    raise KeyError\n    z = 1\nexcept KeyError:\n    pass\n", 3),
    ("try:\n    pass\nexcept KeyError:\n    raise\n    z = 1\n", 5),
    ("try:\n    pass\nfinally:\n    raise SystemExit\n    z = 1\n", 5),
    ("with open('f') as f:\n    return_ = f\n    raise SystemExit\n    f.read()\n", 4),
    ("def outer():\n    def inner():\n        return 1\n        inner()\n    return inner\n", 4),
    ("class C:\n    def m(self):\n        return 1\n        self.x = 2\n", 4),
    ("async def f():\n    async with a:\n        return 1\n        await b\n", 4),
    ("match x:\n    case 1:\n        return_ = 1\n        raise SystemExit\n        y = 2\n", 5),
])
def test_unreachable_statements_are_found(src, line):
    assert [f.split(":")[1] for f in unreachable(src)] == [str(line)], unreachable(src)


def test_reachable_code_is_not_flagged():
    src = ("def f(x):\n    if x:\n        return 1\n    for i in x:\n        if i:\n            continue\n        "
           "print(i)\n    try:\n        g()\n    except Exception:\n        raise\n    finally:\n        h()\n"
           "    return 2\n")
    assert unreachable(src) == []
