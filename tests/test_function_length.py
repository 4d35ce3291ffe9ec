"""No function over about 80 lines (issue 25): a newcomer reads a function on one screen.

None is longer today, and KNOWN is empty: it is where a function over the limit would be
listed with its length, if one ever had to be, to shrink and leave. A new long function fails,
a listed one that grows fails, and a listed one brought under the limit must leave the list.
Read from the source (ast)."""

import ast
from pathlib import Path

import memfit

SRC = Path(memfit.__file__).parent
LIMIT = 80

# (path under src/memfit, function) -> its length in lines now; shrink, never add.
KNOWN: dict[tuple[str, str], int] = {}


def long_functions(root: Path, limit: int = LIMIT) -> dict[tuple[str, str], int]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    out[(path.relative_to(root).as_posix(), node.name)] = max(length, out.get((path.relative_to(root).as_posix(), node.name), 0))
    return out


def test_finds_a_long_function(tmp_path):
    (tmp_path / "m.py").write_text("def f():\n" + "    x = 1\n" * LIMIT + "def g():\n    pass\n")
    assert long_functions(tmp_path) == {("m.py", "f"): LIMIT + 1}


def test_no_new_long_function_and_none_grows():
    found = long_functions(SRC)
    new = {k: v for k, v in found.items() if k not in KNOWN}
    assert not new, f"functions over {LIMIT} lines: {new}; split them into named steps"
    grown = {k: (KNOWN[k], v) for k, v in found.items() if v > KNOWN[k]}
    assert not grown, f"long functions grew (was, now): {grown}; split them rather than grow them"


def test_the_list_is_current():
    found = long_functions(SRC)
    done = sorted(k for k in KNOWN if k not in found)
    assert not done, f"now within {LIMIT} lines or gone: {done}; remove them from KNOWN"
