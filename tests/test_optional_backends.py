"""kq works with only JAX or only MLX installed: each framework is blocked in turn in a fresh process."""

import subprocess
import sys
import textwrap

import pytest

BLOCK = textwrap.dedent("""
    import sys

    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == {blocked!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)")
            return None

    sys.meta_path.insert(0, Block())
""")

SCRIPT = BLOCK + textwrap.dedent("""
    import kq
    from kq.check import run_checks
    from kq.backends import backend

    names = ("numpy-oracle", "jax-reference", "mlx-ops", "metal-source-cpu")
    reports = run_checks(tuple(backend(n) for n in names), random_rows=60)
    for r in reports:
        print(r.name, "skipped" if r.skipped else f"{{r.passed}}/{{r.run}}", r.skipped)
    assert {blocked!r} not in {{m.split(".")[0] for m in sys.modules}}
""")


@pytest.mark.parametrize("blocked, survivors", [("mlx", ("jax-reference",)), ("jax", ("mlx-ops",))])
def test_one_framework_missing(blocked, survivors):
    pytest.importorskip("jax" if blocked == "mlx" else "mlx.core")
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(blocked=blocked)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = {line.split()[0]: line for line in done.stdout.splitlines()}
    dead = "mlx-ops" if blocked == "mlx" else "jax-reference"
    assert "skipped" in lines[dead] and f"{blocked} cannot be imported" in lines[dead]
    for name in ("numpy-oracle", "metal-source-cpu", *survivors):
        passed, run = lines[name].split()[1].split("/")
        assert passed == run and int(run) > 20, lines[name]


NO_NUMBA = BLOCK + textwrap.dedent("""
    import numpy as np
    from kq_host.residency import LayerReport, ResidencyManager

    manager = ResidencyManager(1, 8, 2, loader=lambda *a: 0, queue_depth=0)
    ids = np.array([[[3, 5]]], np.int32)
    scores = np.array([[[0.75, 0.25]]], np.float32)
    tables = manager.step(LayerReport(ids, scores, ids, scores))
    print(manager.impl, tables[0, 3], tables[0, 5])
    try:
        ResidencyManager(1, 8, 2, loader=lambda *a: 0, impl="numba")
    except ImportError as error:
        print("refused:", error)
""")


def test_the_host_side_without_numba():
    """Without Numba the manager keeps its tables in NumPy (``impl="auto"``), and ``impl="numba"``
    is refused naming the argument and the package."""
    done = subprocess.run([sys.executable, "-c", NO_NUMBA.format(blocked="numba")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    first, second = done.stdout.splitlines()
    assert first.split() == ["numpy", "-1", "-1"]  # both misses read inline and published next step
    assert second.startswith("refused:") and "impl='numba'" in second and "Numba" in second
