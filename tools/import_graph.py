#!/usr/bin/env python3
"""The shape of the meshnet package, read from its source: modules and packages, import
arrows between modules, the longest chain of imports (its layers), cycles, the largest
module and every function over a length.

    python3 tools/import_graph.py [--package meshnet] [--long 80]

Only imports of the package itself count, at any depth in a module (an import inside a
function is still an arrow). Nothing is imported or run.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(package: str, root: Path = ROOT) -> dict[str, Path]:
    return {module_name(path, root): path for path in sorted((root / package).rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that NAME imports (a package's __init__ counts as the package)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` imports the module pkg.mod where there is one
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph(package: str, root: Path = ROOT) -> dict[str, set[str]]:
    found = modules(package, root)
    known = set(found)
    return {name: imports_of(name, path, known) for name, path in found.items()}


def components(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components (Tarjan), a module alone being one of its own."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            out.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The modules that import each other in a circle, one list per circle."""
    return [c for c in components(edges) if len(c) > 1]


def layers(edges: dict[str, set[str]]) -> int:
    """The longest chain of imports, in modules; a circle counts as one layer."""
    owner = {v: i for i, c in enumerate(components(edges)) for v in c}
    depth: dict[int, int] = {}

    def walk(c: int, members: dict[int, list[str]]) -> int:
        if c not in depth:
            below = {owner[w] for v in members[c] for w in edges[v]} - {c}
            depth[c] = 1 + max((walk(d, members) for d in below), default=0)
        return depth[c]

    members: dict[int, list[str]] = {}
    for v, c in owner.items():
        members.setdefault(c, []).append(v)
    return max((walk(c, members) for c in members), default=0)


def package_graph(edges: dict[str, set[str]], package: str) -> dict[str, set[str]]:
    """Arrows between the package's subpackages (a module directly in the package is its own)."""
    def owner(module: str) -> str:
        parts = module.split(".")
        return ".".join(parts[:2]) if len(parts) > 1 else module
    out: dict[str, set[str]] = {}
    for module, targets in edges.items():
        out.setdefault(owner(module), set()).update(owner(t) for t in targets if owner(t) != owner(module))
    return out


def long_functions(path: Path, limit: int) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > limit:
                out.append((f"{path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path}:{node.lineno} "
                            f"{node.name}", length))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--package", default="meshnet")
    ap.add_argument("--long", type=int, default=80, help="list functions longer than this many lines")
    args = ap.parse_args()
    found = modules(args.package)
    edges = graph(args.package)
    packages = {name for name, path in found.items() if path.name == "__init__.py"}
    sizes = sorted(((len(path.read_text().splitlines()), name) for name, path in found.items()), reverse=True)
    print(f"modules {len(found)} (packages {len(packages)})")
    print(f"import arrows {sum(len(v) for v in edges.values())}")
    print(f"import layers (longest chain) {layers(edges)}")
    between = package_graph(edges, args.package)
    print(f"between packages: arrows {sum(len(v) for v in between.values())}, layers {layers(between)}, "
          f"cycles {len(cycles(between))}")
    found_cycles = cycles(edges)
    print(f"cycles {len(found_cycles)}" + "".join(f"\n  {' <-> '.join(c)}" for c in found_cycles))
    print(f"largest module {sizes[0][1]} ({sizes[0][0]} lines)")
    long = sorted((item for path in found.values() for item in long_functions(path, args.long)), key=lambda x: -x[1])
    print(f"functions over {args.long} lines {len(long)}" + "".join(f"\n  {n} ({k})" for n, k in long))
    return 0


if __name__ == "__main__":
    sys.exit(main())
