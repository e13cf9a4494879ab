"""The library's import structure, checked statically (function-level imports included, imports under
``if TYPE_CHECKING:`` excluded): layers import only downward, nothing imports the package root,
no module imports another's private names, and no import cycle appears (importing a submodule
runs its packages' ``__init__`` too, so those count).

Layers, lowest first: native, core, features, engines, interfaces. ``errors``, ``telemetry`` and
``_version`` are shared by all; the package root imports everything and nothing imports it.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "llama_ctypes"
LAYERS = {"native": 0, "core": 1, "features": 2, "engines": 3, "interfaces": 4}

#: Import edges (importer, imported) that still close a cycle, each with its reason. Shrink it; never
#: grow it without a reason as good.
KNOWN_CYCLE_EDGES: dict[tuple[str, str], str] = {}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _short(name: str) -> str:
    return name.removeprefix("llama_ctypes.")


def _imports() -> tuple[set[str], list[tuple[str, str, int, list[str]]]]:
    """Every module, and every import of a library module: (importer, imported, line, names)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        typing_only = {id(node) for branch in ast.walk(tree)
                       if isinstance(branch, ast.If) and "TYPE_CHECKING" in ast.unparse(branch.test)
                       for stmt in branch.body for node in ast.walk(stmt)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if not target.startswith("llama_ctypes"):
                    continue
                names = [a.name for a in node.names]
                # "from .pkg import module" imports the module; "from .module import name" the module
                candidates = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
                for imported in candidates or [target]:
                    edges.append((name, imported, node.lineno, [] if candidates else names))
            elif isinstance(node, ast.Import):
                edges += [(name, a.name, node.lineno, []) for a in node.names if a.name.startswith("llama_ctypes")]
    return set(modules), edges


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def test_layers_import_only_downward():
    _, edges = _imports()
    upward = [f"{_short(a)}:{line} imports {_short(b)}" for a, b, line, _ in edges
              if _layer(a) is not None and _layer(b) is not None and _layer(b) > _layer(a)]
    assert upward == []


def test_nothing_imports_the_package_root():
    _, edges = _imports()
    assert [f"{_short(a)}:{line} {names}" for a, b, line, names in edges if b == "llama_ctypes"] == []


def test_no_private_names_imported_across_modules():
    _, edges = _imports()
    private = [f"{_short(a)}:{line} imports {n} from {_short(b)}" for a, b, line, names in edges for n in names
               if n.startswith("_") and not n.startswith("__") and a != b]
    assert private == []


def _cycles(modules: set[str], edges: list) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b, _, _ in edges:
        if a != b and b in modules:
            graph[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def _with_packages(modules: set[str], edges: list) -> list:
    """``edges`` plus, for each import of a submodule from outside its package, an edge to each package
    above it: importing ``core.rpc.watch`` runs ``core/rpc/__init__.py`` first."""
    extra = []
    for a, b, line, _ in edges:
        parts = b.split(".")
        for k in range(2, len(parts)):
            package = ".".join(parts[:k])
            if package in modules and not a.startswith(package + ".") and a != package:
                extra.append((a, package, line, []))
    return edges + extra


def test_no_import_cycle_but_the_listed_ones():
    modules, edges = _imports()
    edges = _with_packages(modules, edges)
    known = {(f"llama_ctypes.{a}", f"llama_ctypes.{b}") for a, b in KNOWN_CYCLE_EDGES}
    remaining = [(a, b, line, names) for a, b, line, names in edges if (a, b) not in known]
    cycles = _cycles(modules, remaining)
    assert cycles == [], [sorted(_short(m) for m in c) for c in cycles]
    # and each listed edge still exists (a stale entry would hide a new cycle through it)
    present = {(a, b) for a, b, _, _ in edges}
    assert known <= present, sorted(known - present)


def test_the_cycle_check_finds_a_cycle():
    edges = [("p.a", "p.b", 1, []), ("p.b", "p.c", 1, []), ("p.c", "p.a", 1, []), ("p.c", "p.d", 1, [])]
    assert _cycles({"p.a", "p.b", "p.c", "p.d"}, edges) == [{"p.a", "p.b", "p.c"}]


def test_names_moved_by_the_split_still_resolve_with_a_warning():
    import warnings

    import pytest

    from llama_ctypes.core import rpc
    from llama_ctypes.core.rpc import endpoints, worker
    from llama_ctypes.engines import manager
    from llama_ctypes.engines.manager.budget import BudgetPool

    with pytest.warns(DeprecationWarning, match="core.rpc.endpoints.probe"):
        assert rpc.probe is endpoints.probe
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert rpc.WorkerConfig is worker.WorkerConfig
        assert manager.Pool is BudgetPool
    with pytest.raises(AttributeError):
        rpc.no_such_name  # noqa: B018
