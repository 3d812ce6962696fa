"""The package's import rules, read from its source (tools/import_graph.py): each package
by concern imports only the packages below it, and nothing imports in a circle."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("import_graph", ROOT / "tools" / "import_graph.py")
import_graph = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(import_graph)

# what each package may import beside itself (its package docstring says the same);
# cli may import anything
MAY_IMPORT = {
    "core": set(),
    "engine": {"core"},
    "net": {"core"},
    "route": {"core", "net"},
    "weights": {"core", "engine", "net"},
    "stage": {"core", "engine", "net", "weights"},
    "launch": {"core", "engine", "net", "route", "stage", "weights"},
    "serve": {"core", "engine", "net", "route", "stage", "launch", "weights"},
    "evidence": {"core", "engine", "net", "route", "stage", "launch", "weights"},
}


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_module_lives_in_a_package_by_concern():
    loose = [m for m, path in import_graph.modules("meshnet", ROOT).items()
             if m != "meshnet" and path.parent.name == "meshnet"]
    assert not loose, f"modules outside a package by concern: {loose}"
    packages = {package_of(m) for m in import_graph.modules("meshnet", ROOT)} - {""}
    assert packages == set(MAY_IMPORT) | {"cli"}


def test_each_package_imports_only_the_packages_below_it():
    broken = []
    for module, targets in import_graph.graph("meshnet", ROOT).items():
        allowed = MAY_IMPORT.get(package_of(module))
        if allowed is None:
            continue
        for target in targets:
            if package_of(target) not in allowed | {package_of(module)}:
                broken.append(f"{module} -> {target}")
    assert not broken, "imports against the package rules:\n" + "\n".join(sorted(broken))


def test_the_route_never_imports_the_engine_or_a_stage():
    edges = import_graph.graph("meshnet", ROOT)
    assert not [(m, t) for m, ts in edges.items() if package_of(m) == "route"
                for t in ts if package_of(t) in ("engine", "stage")]


def test_nothing_imports_in_a_circle():
    assert import_graph.cycles(import_graph.graph("meshnet", ROOT)) == []


def test_the_graph_reader_sees_relative_absolute_and_nested_imports(tmp_path):
    # a fake package of plain files, so the reader itself is checked
    pkg = tmp_path / "pkg"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("from . import y\n")
    (pkg / "a" / "y.py").write_text("def f():\n    from pkg.b import z\n")
    (pkg / "b.py").write_text("from .a.x import thing\nz = 1\n")
    edges = import_graph.graph("pkg", tmp_path)
    assert edges["pkg.a.x"] == {"pkg.a.y"}
    assert edges["pkg.a.y"] == {"pkg.b"}
    assert edges["pkg.b"] == {"pkg.a.x"}
    assert import_graph.cycles(edges) == [["pkg.a.x", "pkg.a.y", "pkg.b"]]
