"""Every Python example in the README and docs/ runs as written (each skips where its framework is missing)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLES = [(page, code) for page in PAGES for code in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)]


def _needs(code: str) -> list[str]:
    return [name for name in ("jax", "mlx", "safetensors", "flax")
            if re.search(rf"^\s*(import|from) {name}\b", code, re.M)]


@pytest.mark.parametrize("page, code", EXAMPLES, ids=[f"{page.stem}-example{i}" for i, (page, _) in enumerate(EXAMPLES)])
def test_readme_example_runs(page, code):
    for module in _needs(code):
        pytest.importorskip(module)
    exec(compile(code, str(page), "exec"), {"__name__": "readme_example"})


def test_an_example_needs_each_framework_it_imports():
    code = ("import jax\nimport numpy as np\nfrom flax import nnx\nimport mlx.core as mx\n"
            "from safetensors.numpy import save_file\n")
    assert _needs(code) == ["jax", "mlx", "safetensors", "flax"]
    assert _needs("import numpy as np\nfrom kq_jax.nnx import ArenaMoE\n") == []


def test_the_pages_have_examples():
    pages = {page.name for page, _ in EXAMPLES}
    assert "README.md" in pages and "api.md" in pages and len(EXAMPLES) >= 4


def test_every_local_link_resolves():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which is not there"


TOP_LEVEL_DIRS = frozenset({".ci", "benchmarks", "docs", "kq", "kq_core", "kq_host", "kq_jax", "kq_mlx", "models",
                            "shared", "tests", "tools"})


def _code_span_paths(text: str) -> list[str]:
    """The repo file paths a page writes in code spans: `docs/x.md`, `kq/y.py`, `tests/t.py::case`, `models/m/`.

    A span counts when it is one word holding a slash and either starts at a top-level directory of the
    repository or names a file with an extension; a ``::test`` suffix and trailing punctuation are dropped.
    """
    paths = []
    for span in re.findall(r"(?<!`)`([^`\s]+)`(?!`)", text):
        path = span.split("::")[0].rstrip(".,;:")
        if "/" not in path or not re.fullmatch(r"[\w.*/-]+", path) or "//" in path:
            continue
        first = path.split("/")[0]
        if first in TOP_LEVEL_DIRS or (first not in (".", "..") and re.search(r"\.[A-Za-z]\w*$", path)):
            paths.append(path)
    return paths


def _path_exists(page: Path, path: str) -> bool:
    bases = (ROOT,) if path.split("/")[0] in TOP_LEVEL_DIRS else (ROOT, page.parent)
    return any(any(base.glob(path)) if "*" in path else (base / path).exists() for base in bases)


def test_the_code_span_path_finder_takes_paths_and_leaves_code():
    text = ("`docs/x.md`, `kq/y.py`'s, `tests/test_z.py::test_case`, `models/wheels-moe/`, `h200/run.json`, "
            "`benchmarks/gpu_job.sh`, `P(\"data\", None)`, `[L, E]`, `jax.jit`, `a/b`, `1/x`, "
            "`git show abc:kq/old.py`, `https://example.org/a.md`")
    assert _code_span_paths(text) == ["docs/x.md", "kq/y.py", "tests/test_z.py", "models/wheels-moe/", "h200/run.json",
                                      "benchmarks/gpu_job.sh"]


def test_every_path_in_a_code_span_exists():
    missing = [f"{page.relative_to(ROOT)}: `{path}`" for page in PAGES
               for path in _code_span_paths(page.read_text()) if not _path_exists(page, path)]
    assert not missing, "paths written in code spans that are not in the repository:\n" + "\n".join(missing)


README_TEST_COMMAND = 'python -m pip install -e ".[all]" && python -m pytest -q'


def _fake_python(tmp_path, pip_install_fails: bool):
    """A `python3` whose venv's `python` logs every call instead of running it, `pip install -e` failing at will."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f"""#!/bin/sh
# python3 -m venv DIR: a venv whose activate puts the fake python first
mkdir -p "$3/bin" && echo 'PATH="{bin_dir}:$PATH"' > "$3/bin/activate"
""")
    (bin_dir / "python").write_text(f"""#!/bin/sh
echo "$*" >> {log}
case "$*" in
  *"pip install -e"*) exit {1 if pip_install_fails else 0} ;;
  *"pip list"*) echo "numpy==2.4.6" ;;
esac
""")
    for script in ("python3", "python"):
        (bin_dir / script).chmod(0o755)
    return bin_dir, log


@pytest.mark.parametrize("pip_install_fails", [True, False])
def test_ci_runs_the_readme_test_command_and_stops_when_the_install_fails(tmp_path, pip_install_fails):
    import os
    import subprocess

    assert README_TEST_COMMAND in (ROOT / "README.md").read_text()
    assert README_TEST_COMMAND in (ROOT / ".ci" / "run").read_text()
    bin_dir, log = _fake_python(tmp_path, pip_install_fails)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    result = subprocess.run(["bash", str(ROOT / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=60)
    calls = log.read_text().splitlines()
    if pip_install_fails:
        assert result.returncode != 0 and not any("pytest" in call for call in calls), calls
    else:
        assert result.returncode == 0, result.stderr
        assert [call for call in calls if "pytest" in call] == ["-m pytest -q", "-m pytest -q -m exhaustive"]
