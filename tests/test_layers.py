"""The import graph between the packages, read from the code's own imports, points only down.

Layers, top to bottom: kq (applications, the benchmarks among them); kq_jax and kq_mlx (backends); kq_host (the
host side); kq_core (the contract). A package may import from its own layer's package itself and
from any layer below; imports inside functions count as much as those at the top of a file.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYER = {"kq_core": 0, "kq_host": 1, "kq_jax": 2, "kq_mlx": 2, "kq": 3}


def imported_packages(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & set(LAYER)


EDGES = sorted({(package, path.relative_to(ROOT).as_posix(), target)
                for package in LAYER for path in (ROOT / package).rglob("*.py")
                for target in imported_packages(path) if target != package})


@pytest.mark.parametrize("package, path, target", EDGES, ids=[f"{p}->{t}" for _, p, t in EDGES])
def test_imports_point_down(package, path, target):
    assert LAYER[target] < LAYER[package], f"{path} imports {target}, a layer at or above {package}'s"


def test_the_graph_was_read():
    assert ("kq", "kq/backends.py", "kq_jax") in EDGES  # an import inside a function counts
    assert any(p == "kq_jax" and t == "kq_core" for p, _, t in EDGES)
    assert any(p == "kq" and t == "kq_jax" for p, _, t in EDGES)


def private_imports(path: Path) -> list[str]:
    """``module.name`` for each ``from module import _name`` of another module of kq's in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.split(".")[0] in LAYER:
            found += [f"{node.module}.{alias.name}" for alias in node.names
                      if alias.name.startswith("_") and not alias.name.startswith("__")]
    return found


PRIVATE_IMPORTS = sorted((path.relative_to(ROOT).as_posix(), name) for package in LAYER
                         for path in (ROOT / package).rglob("*.py") for name in private_imports(path))


def test_no_module_imports_another_modules_private_name():
    assert PRIVATE_IMPORTS == [], "private names imported across modules: " + ", ".join(
        f"{path} imports {name}" for path, name in PRIVATE_IMPORTS)


# The files the project's specification names.
SPECIFIED_PATHS = ("pyproject.toml", "kq_jax/route_shed_pallas.py", "kq_jax/reference.py",
                   "kq_mlx/route_shed.metal", "shared/spec.json", "tests")


@pytest.mark.parametrize("path", SPECIFIED_PATHS)
def test_specified_path_exists(path):
    assert (ROOT / path).exists(), f"{path} is named by the specification"


def test_route_shed_pallas_holds_the_kernel():
    tree = ast.parse((ROOT / "kq_jax/route_shed_pallas.py").read_text())
    defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    assert {"route_shed_kernel", "route_shed_lanes_kernel", "route_shed_pallas"} <= defined
