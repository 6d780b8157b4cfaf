"""Every Python example in the README and docs/ runs as written (each skips where its framework is missing) and
prints what its page shows.

Conventions an example's page follows:

* the output an example prints is shown in a ```` ```text ```` block right after it (nothing but blank lines
  between); ``...`` in a shown line stands for any text, for what may change from run to run;
* an example whose first line names an install (``# python -m pip install -e ".[nnx]"``) runs in a fresh
  interpreter where every package kq's extras list but that install does not bring cannot be imported: the
  install it names is enough to run it.
"""

import contextlib
import importlib.metadata
import io
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```[ \t]*$", re.M | re.S)
INSTALL = re.compile(r"^# python -m pip install -e \"?\.(?:\[([\w,-]+)\])?\"?(?:\s|$)")


def examples(text: str) -> list[tuple[str, str | None]]:
    """Each ```` ```python ```` block of a page's ``text`` and the output shown under it (None where none is)."""
    blocks = list(FENCE.finditer(text))
    found = []
    for block, after in zip(blocks, [*blocks[1:], None]):
        if block[1] != "python":
            continue
        shown = after is not None and after[1] == "text" and not text[block.end():after.start()].strip()
        found.append((block[2], after[2] if shown else None))
    return found


EXAMPLES = [(page, code, shown) for page in PAGES for code, shown in examples(page.read_text())]


def same_output(shown: str, printed: str) -> bool:
    """Whether ``printed`` is the ``shown`` output, line for line (trailing blanks aside), ``...`` any text."""
    want, got = shown.rstrip().splitlines(), printed.rstrip().splitlines()
    return len(want) == len(got) and all(
        re.fullmatch(".*?".join(map(re.escape, line.rstrip().split("..."))), actual.rstrip(), re.S)
        for line, actual in zip(want, got))


def _needs(code: str) -> list[str]:
    return [name for name in ("jax", "mlx", "safetensors", "flax")
            if re.search(rf"^\s*(import|from) {name}\b", code, re.M)]


def _name(requirement: str) -> str:
    from packaging.requirements import Requirement

    return re.sub(r"[-_.]+", "-", Requirement(requirement).name).lower()


def _extras() -> dict[str, list[str]]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _listed(extras) -> set[str]:
    """The distributions kq's ``extras`` list, through the extras they name (``kq[jax,host]``)."""
    from packaging.requirements import Requirement

    listed, table = set(), _extras()
    for extra in extras:
        for requirement in table[extra]:
            parsed = Requirement(requirement)
            if _name(requirement) == "kq":
                listed |= _listed(parsed.extras)
            elif parsed.marker is None or parsed.marker.evaluate():
                listed.add(_name(requirement))
    return listed


def _installed_with(names: set[str]) -> set[str]:
    """``names`` and every distribution they require here, as installed (their own extras left out)."""
    from packaging.requirements import Requirement

    seen, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for requirement in requires:
            marker = Requirement(requirement).marker
            if marker is None or marker.evaluate({"extra": ""}):
                todo.append(_name(requirement))
    return seen


def blocked_modules(install_line: str) -> set[str]:
    """The top-level modules of every distribution kq's extras list that the install on ``install_line`` does
    not bring here."""
    named = INSTALL.match(install_line)
    assert named, f"not an install line: {install_line!r}"
    extras = named[1].split(",") if named[1] else []
    base = {_name(r) for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    left_out = _listed(_extras()) - _installed_with(base | _listed(extras))
    return {module for module, dists in importlib.metadata.packages_distributions().items()
            if any(_name(dist) in left_out for dist in dists)}


_BLOCKER = """\
import importlib.abc, sys
class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (not brought by the example's first line)")
sys.meta_path.insert(0, _NotInstalled())
"""


def _run(page: Path, code: str) -> str:
    """Runs the example as its page gives it; returns what it printed."""
    first = code.splitlines()[0] if code.strip() else ""
    if INSTALL.match(first):
        prelude = _BLOCKER.format(blocked=sorted(blocked_modules(first)))
        done = subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=600,
                              cwd=ROOT)
        assert done.returncode == 0, f"{page.name}: the example failed with only {first[2:]!r}:\n{done.stderr}"
        return done.stdout
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, str(page), "exec"), {"__name__": "readme_example"})
    return printed.getvalue()


@pytest.mark.parametrize("page, code, shown", EXAMPLES,
                         ids=[f"{page.stem}-example{i}" for i, (page, _, _) in enumerate(EXAMPLES)])
def test_readme_example_runs(page, code, shown):
    for module in _needs(code):
        pytest.importorskip(module)
    printed = _run(page, code)
    if shown is not None:
        assert same_output(shown, printed), f"{page.name}: the example printed\n{printed}\nwhere the page shows\n{shown}"


def test_the_shown_output_is_compared_line_for_line():
    assert same_output("[[2 9 0 13]]\nhit rate 0.57\n", "[[2 9 0 13]]  \nhit rate 0.57")
    assert same_output("hit rate ..., ... experts read", "hit rate 0.57, 235 experts read")
    assert not same_output("hit rate 0.57", "hit rate 0.58")
    assert not same_output("True", "True\nTrue") and not same_output("a ... b", "a b")
    assert not same_output("[[2 9 0 13]]", "x[[2 9 0 13]]")


def test_an_output_block_belongs_to_the_example_right_above_it():
    text = "```python\nprint(1)\n```\n\n```text\n1\n```\n\n```python\nprint(2)\n```\nprose\n```text\n2\n```\n"
    assert examples(text) == [("print(1)\n", "1\n"), ("print(2)\n", None)]


@pytest.mark.parametrize("name", ["README.md", "nnx.md"])
def test_every_example_of_the_readme_and_nnx_page_shows_what_it_prints(name):
    """The README's examples and docs/nnx.md's show their output, so a reader knows what to expect and the
    test compares it; each names on its first line the install it needs."""
    for page, code, shown in EXAMPLES:
        if page.name == name:
            assert "print(" not in code or shown is not None, f"{page.name}: an example prints what it does not show"
            assert INSTALL.match(code), f"{page.name}: an example's first line names no install: {code[:60]!r}"


def test_an_install_line_leaves_out_what_it_does_not_bring():
    numpy_only = blocked_modules('# python -m pip install -e .')
    assert {"jax", "flax", "mlx", "mlx_lm", "numba", "tokenizers"} <= numpy_only
    assert not {"numpy", "ml_dtypes", "rich", "kq"} & numpy_only
    nnx = blocked_modules('# python -m pip install -e ".[nnx]"')
    assert {"jax", "flax"}.isdisjoint(nnx) and {"mlx", "tokenizers", "numba"} <= nnx
    assert not {"jax", "flax", "mlx", "tokenizers", "numba"} & blocked_modules('# python -m pip install -e ".[demo,nnx]"')
    # An example that imports what its install does not bring fails, naming the install.
    with pytest.raises(AssertionError, match="not brought by the example's first line"):
        _run(ROOT / "README.md", '# python -m pip install -e ".[jax]"\nimport numpy\nfrom flax import nnx\n')


def test_an_example_needs_each_framework_it_imports():
    code = ("import jax\nimport numpy as np\nfrom flax import nnx\nimport mlx.core as mx\n"
            "from safetensors.numpy import save_file\n")
    assert _needs(code) == ["jax", "mlx", "safetensors", "flax"]
    assert _needs("import numpy as np\nfrom kq_jax.nnx import ArenaMoE\n") == []


def test_the_pages_have_examples():
    pages = {page.name for page, _, _ in EXAMPLES}
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
