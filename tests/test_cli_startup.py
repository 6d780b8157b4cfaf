"""`kq --help` and each subcommand's help start no framework: a subcommand imports what it needs when it runs.

Each check runs in a fresh interpreter (this test process has imported everything already) and reads
``sys.modules`` there.
"""

import json
import subprocess
import sys

import pytest

FRAMEWORKS = ("jax", "jaxlib", "mlx", "mlx_lm", "numba", "flax", "matplotlib", "safetensors", "tokenizers")


def _modules_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running ``code`` (its stdout discarded)."""
    probe = (f"import io, contextlib, json, sys\nwith contextlib.redirect_stdout(io.StringIO()):\n"
             f"    try:\n        {code}\n    except SystemExit:\n        pass\n"
             f"print(json.dumps(sorted(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.splitlines()[-1]))


def _frameworks(modules: set[str]) -> list[str]:
    return sorted({name.split(".")[0] for name in modules} & set(FRAMEWORKS))


def test_importing_the_cli_imports_no_framework_nor_any_subcommand():
    modules = _modules_after("import kq.cli")
    assert _frameworks(modules) == []
    # Nor NumPy's extensions (ml_dtypes alone took 0.6 s of CPU) or any subcommand's module.
    assert {"numpy", "ml_dtypes", "kq.study", "kq.demo", "kq.bench.kernels", "kq.backends"}.isdisjoint(modules)


def test_kq_help_imports_no_framework_nor_any_subcommand():
    modules = _modules_after("from kq.cli import main; main(['--help'])")
    assert _frameworks(modules) == []
    assert {"numpy", "ml_dtypes", "kq.study", "kq.demo", "kq.bench.kernels", "kq.backends"}.isdisjoint(modules)


@pytest.mark.parametrize("command", ["check", "bench", "demo", "generate", "study"])
def test_a_subcommands_help_imports_no_framework(command):
    modules = _modules_after(f"from kq.cli import main; main([{command!r}, '--help'])")
    assert _frameworks(modules) == []
    if command != "study":  # the study's options show its grid's defaults; no other help needs the study
        assert "kq.study" not in modules


def test_kq_help_lists_every_subcommand():
    done = subprocess.run([sys.executable, "-m", "kq", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for command in ("check", "bench", "demo", "generate", "study"):
        assert f"    {command} " in done.stdout, done.stdout


def test_the_route_shed_names_stay_at_the_top_of_the_package():
    """``kq``'s names from kq_core are imported when first used, and are kq_core's own."""
    import kq
    import kq_core

    for name in kq.__all__:
        assert getattr(kq, name) is getattr(kq_core, name, getattr(kq, name))
    from kq import RouteShedInputError, route_shed_oracle  # noqa: F401  (from-imports reach them too)

    assert route_shed_oracle is kq_core.route_shed_oracle
    with pytest.raises(AttributeError, match="no_such_name"):
        kq.no_such_name  # noqa: B018
