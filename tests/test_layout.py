"""The house's rules, read from the code's own imports (every import, lazy ones included).

Floors point down (scripts -> models -> {data, sparse, dense}), the ground floors import
nothing of each other, `serving/` and `evaluation/` never import `train/`, nothing outside
`train/` but the command line imports it, no module imports itself back through others,
and no file outgrows what one concern fills.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("data", "sparse", "dense", "models", "scripts")
GROUND = {"data", "sparse", "dense"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["genrec", *parts])


def _sources() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The genrec modules `name` imports (anywhere in the file), resolved to known modules."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor if is_pkg else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and t.startswith("genrec."):
                out.add(t)
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    sources = _sources()
    known = set(sources)
    return {n: _imports(n, p, known) for n, p in sources.items()}


def _package(module: str) -> str:
    return module.split(".")[1]


def test_floors_point_down(graph):
    rank = {"data": 0, "sparse": 0, "dense": 0, "models": 1, "scripts": 2}
    bad = []
    for mod, deps in graph.items():
        for dep in deps:
            a, b = _package(mod), _package(dep)
            if a == b:
                continue
            if rank[b] >= rank[a]:
                bad.append(f"{mod} -> {dep}")
    assert not bad, "imports that do not point down a floor: " + ", ".join(sorted(bad))


def test_train_room_is_imported_only_by_itself_and_the_command_line(graph):
    bad = [f"{m} -> {d}" for m, deps in graph.items() for d in deps
           if d.startswith("genrec.models.train") and not m.startswith(("genrec.models.train", "genrec.scripts"))]
    assert not bad, ", ".join(sorted(bad))


def test_no_import_cycles(graph):
    # Tarjan's strongly connected components: any component of size > 1 is a cycle.
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
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
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    # A package importing its own submodules (for re-export) is not a cycle of concerns.
    cycles = [c for c in cycles if not all(m == c[0] or m.startswith(c[0] + ".") for m in c)]
    assert not cycles, f"import cycles: {cycles}"


def test_files_stay_small():
    too_big = []
    for pkg in PACKAGES:
        limit = 150 if pkg == "scripts" else 600
        for p in (ROOT / pkg).rglob("*.py"):
            n = len(p.read_text().splitlines())
            if n > limit:
                too_big.append(f"{p.relative_to(ROOT)}: {n} lines (limit {limit})")
    assert not too_big, "; ".join(too_big)


def test_every_package_says_what_it_holds_and_may_import():
    missing = []
    for init in sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        if "May import" not in doc and "may import" not in doc:
            missing.append(str(init.relative_to(ROOT)))
    assert not missing, f"package docstrings without their import rule: {missing}"
