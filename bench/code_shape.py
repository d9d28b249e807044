"""The package's shape, as the redesign issue measures it: the longest functions and classes, import cycles in
the static import graph (module-level imports, then counting function-level ones too), function-level imports,
and the module counts. `tests/test_architecture.py` holds the package to it.

    python bench/code_shape.py [package_dir]          (default: jaxrl_llm)
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def module_name(path: Path, root: Path) -> str:
    """`jaxrl_llm/run/monitor.py` -> `jaxrl_llm.run.monitor` (a package's `__init__.py` -> the package)."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root: Path, *, top_level_only: bool = True) -> dict[str, set[str]]:
    """module -> the package modules it imports (at module level unless `top_level_only` is False)."""
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        tree = ast.parse(path.read_text())
        nodes = tree.body if top_level_only else list(ast.walk(tree))
        for node in nodes:
            if isinstance(node, ast.If) and top_level_only:  # TYPE_CHECKING blocks do not run
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
                    pkg = pkg[: len(pkg) - node.level + 1]
                    base = ".".join(pkg + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for t in targets:
                while t and t not in files:
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    graph[mod].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def longest(root: Path, kind: type | tuple[type, ...]) -> list[tuple[int, str]]:
    """`(lines, "path:line name")` of every definition of `kind` under `root`, longest first."""
    found = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, kind):
                found.append((node.end_lineno - node.lineno + 1, f"{path}:{node.lineno} {node.name}"))
    return sorted(found, reverse=True)


def function_level_imports(root: Path) -> list[tuple[str, str]]:
    """`(path:line, imported module)` of every import inside a function under `root`."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for n in ast.walk(node):
                    if isinstance(n, ast.Import):
                        found += [(f"{path}:{n.lineno}", a.name) for a in n.names]
                    elif isinstance(n, ast.ImportFrom):
                        found.append((f"{path}:{n.lineno}", n.module or ""))
    return found


if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "jaxrl_llm")
    funcs = longest(root, (ast.FunctionDef, ast.AsyncFunctionDef))
    classes = longest(root, ast.ClassDef)
    print("longest functions:", *[f"  {n} lines  {w}" for n, w in funcs[:3]], sep="\n")
    print("longest classes:", *[f"  {n} lines  {w}" for n, w in classes[:3]], sep="\n")
    print(f"module-level import cycles: {cycles(import_graph(root))}")
    print(f"import cycles counting function-level imports: {cycles(import_graph(root, top_level_only=False))}")
    print(f"function-level imports: {len(function_level_imports(root))}")
    print(f"modules: {sum(1 for _ in root.rglob('*.py'))}, at the package root: {sum(1 for _ in root.glob('*.py'))}")
