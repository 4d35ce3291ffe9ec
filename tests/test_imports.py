"""memfit's imports, read from the source (ast), nothing imported. Counting every import: at the
top, inside a function (lazy) and under ``TYPE_CHECKING``:

- no import circles among memfit's modules;
- the layers: each folder of memfit (and each top-level module) imports only what :data:`LAYERS`
  lets it, so no two folders import each other;
- no name that starts with an underscore (a module, a function, a constant) is taken from
  another folder, nor read as an attribute of a module imported from one.
"""

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

import memfit

SRC = Path(memfit.__file__).parent

# None known: add one here only with the reason it cannot be helped.
KNOWN: set[frozenset[str]] = set()

_BASE = {"errors", "units"}

LAYERS: dict[str, set[str]] = {
    # the bottom: imports nothing of memfit but its errors
    "errors": set(),
    "units": {"errors"},
    "compat": {"errors"},  # torch's, bitsandbytes' and transformers' fragile corners
    "cuda": {"errors"},  # CUDA simulated: the caching allocator, snapshots, GPU datasheets, fake CUDA
    "workload": _BASE,  # the user's step: model, inputs, loss, optimizer
    # mechanism
    "recompute": _BASE | {"compat"},  # checkpointing on the user's model, the KV cache switch, their guards
    "measure": _BASE | {"compat", "cuda", "workload", "recompute"},  # running and recording a step
    # policy over what measure records
    "plan": _BASE | {"compat", "cuda", "workload", "recompute", "measure"},  # what to recompute
    "levers": _BASE | {"compat", "cuda", "workload", "recompute", "measure", "plan"},  # every lever: fit, max_batch
    # models to run it on
    "zoo": _BASE | {"workload", "measure"},
    "target": _BASE | {"workload", "zoo"},
    # putting decisions on the user's model, and where training happens
    "apply": _BASE | {"compat", "workload", "recompute", "measure", "plan", "levers"},
    # compat: memfit finetune builds a QLoRA base with bitsandbytes' 4-bit layers (compat/bnb4bit), as
    # transformers' own bitsandbytes integration would from a checkpoint
    "integrations": _BASE | {"compat", "workload", "recompute", "measure", "plan", "levers", "apply"},
    "report": _BASE | {"cuda", "measure", "plan", "levers", "integrations"},
    # the edges
    # the four questions, for one device or each rank of a world: a dispatch over measure, plan and levers
    "api": _BASE | {"cuda", "workload", "measure", "plan", "levers"},
    "memfit": _BASE | {"api", "cuda", "workload", "measure", "plan", "levers", "apply", "target"},  # __init__: the public API
    "bench": _BASE | {"memfit", "api", "compat", "workload", "recompute", "measure", "plan", "levers", "apply", "zoo", "target"},
    # the top: the memfit command (cli/, a module per command); nothing but __main__ imports it
    "cli": _BASE | {"memfit", "api", "cuda", "workload", "measure", "plan", "levers", "zoo", "integrations", "report", "bench"},
    "__main__": {"cli"},
}
"""Each folder of ``src/memfit`` and each module beside them (``"memfit"``: the package's own
``__init__``), with the folders and modules it may import. Lower layers first."""


def _modules(root: Path = SRC) -> dict[str, Path]:
    out = {}
    for path in root.rglob("*.py"):
        parts = ("memfit", *path.relative_to(root).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


@functools.cache
def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _layer(module: str) -> str:
    """The folder (or top-level module) ``module`` is in: ``memfit.measure.profile`` -> ``measure``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "memfit"


@dataclass(frozen=True)
class _Import:
    module: str
    """The importing module."""
    target: str
    """The memfit module imported (the longest prefix that exists)."""
    name: str | None
    """The name taken from it (``from target import name``), None when the module itself is."""
    bound: tuple[str, str] | None
    """The local name an import binds to a module, and that module (``import memfit.cuda.fake``
    binds ``memfit``, the package); None when a name is taken from the module."""
    line: int


def _imports(mods: dict[str, Path]) -> list[_Import]:
    def resolve(name: str) -> str | None:
        parts = name.split(".")
        while parts and ".".join(parts) not in mods:
            parts.pop()
        return ".".join(parts) or None

    out = []
    for mod, path in mods.items():
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(_parse(path)):
            found: list[tuple[str, str | None, tuple[str, str] | None]] = []  # (module path, name, bound)
            if isinstance(node, ast.Import):
                for a in node.names:
                    found.append((a.name, None, (a.asname, a.name) if a.asname else (a.name.split(".")[0], a.name.split(".")[0])))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
                for a in node.names:
                    # `from pkg import sub` imports the module pkg.sub (pkg's __init__ runs first as
                    # its parent, not as a dependency)
                    sub = f"{base}.{a.name}"
                    found.append((sub, None, (a.asname or a.name, sub)) if sub in mods else (base, a.name, None))
            for name, taken, bound in found:
                target = resolve(name) if name.split(".")[0] == "memfit" else None
                if target is not None and target != mod:
                    out.append(_Import(mod, target, taken, bound, node.lineno))
    return out


def _graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for imp in _imports(mods):
        graph[imp.module].add(imp.target)
    return graph


def _layer_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {_layer(m): set() for m in mods}
    for imp in _imports(mods):
        if _layer(imp.target) != _layer(imp.module):
            graph[_layer(imp.module)].add(_layer(imp.target))
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while not comp or v not in comp:
                comp.add(stack.pop())
            if len(comp) > 1:
                out.append(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _outside_layers(mods: dict[str, Path], layers: dict[str, set[str]]) -> list[str]:
    """Imports the table does not allow: ``"memfit.measure.profile:27 imports memfit.plan.planner (measure -> plan)"``."""
    found = {
        f"{imp.module}:{imp.line} imports {imp.target} ({_layer(imp.module)} -> {_layer(imp.target)})"
        for imp in _imports(mods)
        if _layer(imp.target) != _layer(imp.module) and _layer(imp.target) not in layers.get(_layer(imp.module), set())
    }
    return sorted(found)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_across(mods: dict[str, Path]) -> list[str]:
    """Underscore names taken from another folder: in the module's path, imported from it, or
    read as an attribute of a module of it (``torch_compat._rule``, ``memfit.measure.profile._run``)."""
    out = set()
    bound: dict[str, dict[str, str]] = {}  # module -> {local name: the memfit module it is}
    for imp in _imports(mods):
        if imp.bound is not None:
            bound.setdefault(imp.module, {})[imp.bound[0]] = imp.bound[1]
        if _layer(imp.target) == _layer(imp.module):
            continue
        where = f"{imp.module}:{imp.line}"
        if any(_private(part) for part in imp.target.split(".")):
            out.add(f"{where} imports {imp.target}")
        if imp.name is not None and _private(imp.name):
            out.add(f"{where} imports {imp.target}.{imp.name}")
    for mod, names in bound.items():
        for node in ast.walk(_parse(mods[mod])):
            chain, inner = [], node
            while isinstance(inner, ast.Attribute):
                chain.insert(0, inner.attr)
                inner = inner.value
            if not chain or not isinstance(inner, ast.Name) or inner.id not in names:
                continue
            parts = [names[inner.id], *chain]
            k = max(i for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in mods or i == 1)
            owner = ".".join(parts[:k])
            # only the attribute right after the module (a longer chain reads it again)
            if k == len(parts) - 1 and owner in mods and _layer(owner) != _layer(mod) and _private(parts[k]):
                out.add(f"{mod}:{node.lineno} reads {owner}.{parts[k]}")
    return sorted(out, key=lambda s: (s.split(":")[0], int(s.split(":")[1].split()[0]), s))


def _package(root: Path, files: dict[str, str]) -> dict[str, Path]:
    """A made-up memfit under ``root``: ``{"measure/x.py": source}``."""
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return _modules(root)


def test_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]


def test_no_import_circles():
    mods = _modules()
    assert "memfit.levers.fit" in mods and "memfit.workload" in mods
    graph = _graph(mods)
    assert "memfit.zoo" in graph["memfit.target"]  # the walk sees imports
    found = set(_cycles(graph))
    assert found == KNOWN, f"import circles among memfit's modules: {sorted(sorted(c) for c in found - KNOWN)}"


def test_the_layers_are_a_stack():
    """The table names every folder and top-level module there is, only those, and allows no circle."""
    layers = {_layer(m) for m in _modules()}
    assert set(LAYERS) == layers, f"not in LAYERS: {sorted(layers - set(LAYERS))}; gone: {sorted(set(LAYERS) - layers)}"
    assert all(allowed <= set(LAYERS) for allowed in LAYERS.values())
    assert not any(name in allowed for name, allowed in LAYERS.items())
    assert _cycles(LAYERS) == []


def test_finds_imports_outside_the_layers(tmp_path):
    mods = _package(
        tmp_path,
        {
            "__init__.py": "",
            "errors.py": "",
            "measure/__init__.py": "",
            "measure/profile.py": "def run():\n    from memfit.plan import planner\n",  # lazy, upwards
            "plan/__init__.py": "",
            "plan/planner.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from memfit.measure.profile import run\n",
            "cuda/__init__.py": "from ..errors import *\n",  # relative, allowed
        },
    )
    layers = {"memfit": set(), "errors": set(), "cuda": {"errors"}, "measure": {"errors"}, "plan": {"measure"}}
    assert _outside_layers(mods, layers) == ["memfit.measure.profile:2 imports memfit.plan.planner (measure -> plan)"]
    assert _cycles(_layer_graph(mods)) == [frozenset({"measure", "plan"})]


def test_imports_follow_the_layers():
    bad = _outside_layers(_modules(), LAYERS)
    assert not bad, "imports the layers (tests/test_imports.py: LAYERS) do not allow:\n" + "\n".join(bad)


def test_no_circle_between_folders():
    graph = _layer_graph(_modules())
    assert "measure" in graph["plan"] and "plan" in graph["levers"]  # the walk sees the folders' imports
    assert _cycles(graph) == [], f"folders that import each other: {_cycles(graph)}"


def test_finds_underscore_names_across_folders(tmp_path):
    mods = _package(
        tmp_path,
        {
            "__init__.py": "",
            "measure/__init__.py": "",
            "measure/_fake.py": "",
            "measure/profile.py": "from memfit.measure import _fake\n_x = 1\ndef _run(): pass\n__all__ = []\n",
            "levers/__init__.py": "",
            "levers/fit.py": (
                "from memfit.measure import _fake\n"
                "from memfit.measure.profile import _run, __all__\n"
                "from memfit.measure import profile as p\n"
                "p._x, p.public\n"
                "def f():\n    import memfit.measure.profile\n    memfit.measure.profile._x\n"
            ),
        },
    )
    assert _private_across(mods) == [
        "memfit.levers.fit:1 imports memfit.measure._fake",
        "memfit.levers.fit:2 imports memfit.measure.profile._run",
        "memfit.levers.fit:4 reads memfit.measure.profile._x",
        "memfit.levers.fit:7 reads memfit.measure.profile._x",
    ]


def test_no_underscore_name_across_folders():
    mods = _modules()
    assert ("torch_compat", "memfit.compat.torch_compat") in {imp.bound for imp in _imports(mods)}  # modules bound to names
    bad = _private_across(mods)
    assert not bad, "underscore names taken from another folder (make them public, or move the code):\n" + "\n".join(bad)


ARGV_READERS = {
    "memfit.cli": "main: the memfit command's own command line",
    "memfit.bench.child": "the child process's own command line (python -m memfit.bench.child ...), run again as it was",
}
"""The only modules that read ``sys.argv`` or ``sys.orig_argv``, and why: the library never
decides anything from the process's command line (issue 25)."""


def _argv_readers(mods: dict[str, Path]) -> set[str]:
    """The modules that read ``sys.argv`` or ``sys.orig_argv`` (as ``sys.X``, or imported from sys)."""
    out = set()
    for mod, path in mods.items():
        for node in ast.walk(_parse(path)):
            attr = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "sys"
            taken = isinstance(node, ast.ImportFrom) and node.module == "sys"
            names = [node.attr] if attr else [a.name for a in node.names] if taken else []
            if any(n in ("argv", "orig_argv") for n in names):
                out.add(mod)
    return out


def test_finds_modules_reading_the_command_line(tmp_path):
    mods = _package(
        tmp_path,
        {
            "__init__.py": "",
            "measure/a.py": "import sys\nflag = '--x' in sys.orig_argv\n",
            "measure/b.py": "from sys import argv\n",
            "measure/c.py": "import sys\nsys.path\n",
        },
    )
    assert _argv_readers(mods) == {"memfit.measure.a", "memfit.measure.b"}


def test_only_the_command_reads_the_command_line():
    found = _argv_readers(_modules())
    assert "memfit.cli" in found  # the walk sees main's reading
    assert found <= set(ARGV_READERS), f"modules reading sys.argv: {sorted(found - set(ARGV_READERS))}; take it as an argument"
