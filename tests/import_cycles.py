"""The arrows between gpuctl's own modules, and the cycles among them.

`python tests/import_cycles.py` prints every mutual pair (A imports B and B imports A) and every
longer cycle in provision/ and trainer/; tests/test_layout.py fails on any of them.
`python tests/import_cycles.py --runtime` leaves out the `if TYPE_CHECKING:` imports (for
information: the arrows that run, the ones an import-time loop can come from).

An arrow is any import statement: at module level, inside a function (a lazy import still ties the
two modules together) or under `if TYPE_CHECKING:` (it never runs, but the module still needs the
other one's types: when both need each other's, one of them should own what both need, e.g. a
small module of shared types, or a Protocol for the shape one of them uses). Dynamic imports
(importlib.import_module with a computed name, as providers.backend does) are not seen.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("provision", "trainer")


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for pkg in PACKAGES for p in sorted((root / pkg).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST, runtime_only: bool = False) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement; with `runtime_only`, those that can run (`if TYPE_CHECKING:` bodies
    skipped, their else kept)."""
    for child in ast.iter_child_nodes(tree):
        if runtime_only and isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.orelse:
                yield from _import_nodes(ast.Module(body=[stmt], type_ignores=[]), runtime_only)
            continue
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child
        yield from _import_nodes(child, runtime_only)


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The project module an import names: the longest known prefix (`a.b.func` -> `a.b`)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if (candidate := ".".join(parts[:end])) in known:
            return candidate
    return None


def arrows_of(module: str, path: Path, known: dict[str, Path], runtime_only: bool = False) -> dict[str, int]:
    """{imported project module: first line that imports it} for one module (itself excluded)."""
    found: dict[str, int] = {}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in _import_nodes(ast.parse(path.read_text()), runtime_only):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:  # a relative import: climb from this module's package
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            # `from pkg import mod` names the submodule; `from mod import func` names mod
            names = [f"{base}.{alias.name}" for alias in node.names]
        for name in names:
            target = _resolve(name, known)
            if target is not None and target != module:
                found.setdefault(target, node.lineno)
    return found


def import_graph(root: Path = ROOT, runtime_only: bool = False) -> dict[str, dict[str, int]]:
    known = project_modules(root)
    return {module: arrows_of(module, path, known, runtime_only) for module, path in known.items()}


def mutual_pairs(graph: dict[str, dict[str, int]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, targets in graph.items() for b in targets if a < b and a in graph.get(b, {}))


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, {}):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def describe(graph: dict[str, dict[str, int]], a: str, b: str) -> str:
    return f"{a} (line {graph[a][b]}) <-> {b} (line {graph[b][a]})"


def main() -> int:
    graph = import_graph(runtime_only="--runtime" in sys.argv[1:])
    pairs = mutual_pairs(graph)
    print(f"{len(pairs)} mutual pairs")
    for a, b in pairs:
        print("  " + describe(graph, a, b))
    groups = cycles(graph)
    print(f"{len(groups)} cycles (strongly connected groups)")
    for group in groups:
        print(f"  {len(group)} modules: {', '.join(group)}")
    return 1 if groups else 0


if __name__ == "__main__":
    raise SystemExit(main())
