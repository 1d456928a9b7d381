"""The house keeps its shape: arrows point down, services stay apart, no cycles, privates stay home.

    rsd (algorithm, torch only)
      └─ rsd_wire (protos <-> algorithm types; the only reader of the generated rsd_proto)
           ├─ rsd_runtime (model runtime: torch + transformers, no grpc)
           └─ rsd_service (service kit: grpc, no torch at import)
                └─ gateway | drafter_service | verifier_service   (none imports another)
                     └─ deploy | rsd_tools | rsd_api              (none imports another)
                          └─ rsd_bench                            (benchmarks with commands of their own)
                               └─ rsd_cli                         (the `rsd` command: the tools' and the benchmarks')

Read from the source (ast), so a lazy import inside a function counts as an arrow too. `if TYPE_CHECKING:`
imports are annotations, not arrows, and are skipped.
"""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterator

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# package -> level; a module may import its own package and packages of a lower level only.
LEVELS = {
    "rsd": 0,
    "rsd_proto": 0,
    "rsd_wire": 1,
    "rsd_runtime": 2,
    "rsd_service": 2,
    "gateway": 3,
    "drafter_service": 3,
    "verifier_service": 3,
    "deploy": 4,
    "rsd_tools": 4,
    "rsd_api": 4,
    "rsd_bench": 5,
    "rsd_cli": 6,
}
# Third-party packages a layer must not import (at module level for the service kit: core pinning sets
# torch's thread count lazily, after the affinity is applied).
FORBIDDEN = {
    "rsd": {"grpc", "redis", "ray", "asyncio", "transformers", "os"},
    "rsd_runtime": {"grpc", "redis", "ray"},
    "rsd_service": {"torch", "transformers"},
}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for package in LEVELS:
        if package == "rsd_proto":  # generated, git-ignored
            continue
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()
# Parsed once, at collection, before any test leaves a thread running: CPython 3.11 keeps the AST builder's
# recursion depth per interpreter, so a parse racing another thread's can fail with "AST constructor
# recursion depth mismatch" (python/cpython#106905; seen once in CI).
TREES = {module: ast.parse(path.read_text(), str(path)) for module, path in MODULES.items()}


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _imports(tree: ast.AST, module: str, top_only: bool = False) -> Iterator[tuple[str, list[str], int]]:
    """(imported module, imported names, line) for each import."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            continue
        if top_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"{module}:{node.lineno}: relative import (the house uses absolute ones)"
            yield node.module or "", [a.name for a in node.names], node.lineno
        stack.extend(ast.iter_child_nodes(node))


def _parsed(module: str) -> ast.AST:
    return TREES[module]


def test_the_layers_are_all_found():
    packages = {m.split(".")[0] for m in MODULES}
    assert packages >= {"rsd", "rsd_wire", "rsd_runtime", "rsd_service", "gateway", "drafter_service"}
    assert packages >= {"verifier_service", "deploy", "rsd_tools", "rsd_api"}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_arrows_point_down(module):
    package, level = module.split(".")[0], LEVELS[module.split(".")[0]]
    for imported, _, line in _imports(_parsed(module), module):
        top = imported.split(".")[0]
        if top == package or top not in LEVELS:
            continue
        where = f"{MODULES[module].relative_to(ROOT)}:{line} imports {imported}"
        assert LEVELS[top] < level, f"{where}: {top} is not below {package}"
        if top == "rsd_proto":
            assert package == "rsd_wire", f"{where}: only rsd_wire reads the generated code"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.split(".")[0] in FORBIDDEN))
def test_layers_keep_their_dependencies(module):
    package = module.split(".")[0]
    top_only = package == "rsd_service"
    for imported, _, line in _imports(_parsed(module), module, top_only=top_only):
        assert imported.split(".")[0] not in FORBIDDEN[package], (
            f"{MODULES[module].relative_to(ROOT)}:{line} imports {imported} ({package} must not)"
        )


@pytest.mark.parametrize("module", sorted(MODULES))
def test_private_names_stay_in_their_module(module):
    for imported, names, line in _imports(_parsed(module), module):
        if imported.split(".")[0] not in LEVELS:
            continue
        private = [n for n in names if n.startswith("_") and not n.startswith("__")]
        assert not private, f"{MODULES[module].relative_to(ROOT)}:{line} imports {private} from {imported}"


def _import_graph(trees: dict[str, ast.AST]) -> dict[str, set[str]]:
    """module -> the modules of `trees` it imports, at module level or inside a function."""
    graph: dict[str, set[str]] = {}
    for module, tree in trees.items():
        deps = set()
        for imported, names, _ in _imports(tree, module):
            for candidate in [imported, *(f"{imported}.{n}" for n in names)]:
                if candidate in trees and candidate != module:
                    deps.add(candidate)
        graph[module] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles a depth-first walk of `graph` meets. A package's __init__ importing its own
    submodules is how re-exports work, not a cycle."""
    found: list[list[str]] = []
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycle = [*path[path.index(dep) :], dep] if dep in path else [node, dep]
                if not all(m == cycle[0] or m.startswith(cycle[0] + ".") for m in cycle):
                    found.append(cycle)
            elif dep not in state:
                visit(dep, [*path, dep])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return found


def test_no_import_cycles():
    """Imports between our modules, inside functions too, form no cycle (a lazy import that closes a
    cycle only hides it: the two modules are one concern, or an arrow points the wrong way)."""
    cycles = _cycles(_import_graph(TREES))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


# A made-up package whose only cycle is closed by an import inside a function (parsed at collection, as TREES).
FUNCTION_LEVEL_CYCLE = {
    "pkg": ast.parse("from pkg import a, b, c\n"),  # pkg <-> pkg.c: a package's re-exports, no cycle
    "pkg.a": ast.parse("import torch\n\ndef f():\n    from pkg.b import g\n    return g\n"),
    "pkg.b": ast.parse("from pkg.a import f\n\ndef g():\n    return f\n"),
    "pkg.c": ast.parse("import pkg\n"),
}


def test_the_cycle_finder_sees_a_cycle_closed_inside_a_function():
    trees = dict(FUNCTION_LEVEL_CYCLE)
    assert _cycles(_import_graph(trees)) == [["pkg.a", "pkg.b", "pkg.a"]]
    del trees["pkg.b"]
    assert _cycles(_import_graph(trees)) == []


def test_no_package_is_too_big():
    """No package over a third of the code (a package that big is two)."""
    lines = {m: len(p.read_text().splitlines()) for m, p in MODULES.items()}
    total = sum(lines.values())
    by_package: dict[str, int] = {}
    for m, n in lines.items():
        by_package[m.split(".")[0]] = by_package.get(m.split(".")[0], 0) + n
    big = {p: f"{n / total:.0%}" for p, n in by_package.items() if n > total / 3}
    assert not big, f"packages over a third of {total} lines: {big}"


def test_the_algorithm_package_is_pure():
    """rsd/ imports torch and the standard library's pure parts only (an allow-list: FORBIDDEN is its floor)."""
    allowed = {"torch", "rsd", "__future__", "dataclasses", "collections", "typing", "math", "functools", "enum"}
    modules = [m for m in MODULES if m.split(".")[0] == "rsd"]
    assert {"rsd", "rsd.acceptance", "rsd.drafting", "rsd.sampling", "rsd.tree"} <= set(modules)
    for module in modules:
        for imported, _, line in _imports(_parsed(module), module):
            assert imported.split(".")[0] in allowed, f"{MODULES[module].relative_to(ROOT)}:{line} imports {imported}"
