"""Every Python example in the README and docs/ runs as written (each skips where its framework is missing)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLES = [(page, code) for page in PAGES for code in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)]


def _needs(code: str) -> list[str]:
    return [name for name in ("jax", "mlx", "safetensors") if re.search(rf"^\s*(import|from) {name}\b", code, re.M)]


@pytest.mark.parametrize("page, code", EXAMPLES, ids=[f"{page.stem}-example{i}" for i, (page, _) in enumerate(EXAMPLES)])
def test_readme_example_runs(page, code):
    for module in _needs(code):
        pytest.importorskip(module)
    exec(compile(code, str(page), "exec"), {"__name__": "readme_example"})


def test_the_pages_have_examples():
    pages = {page.name for page, _ in EXAMPLES}
    assert "README.md" in pages and "api.md" in pages and len(EXAMPLES) >= 4


def test_every_local_link_resolves():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which is not there"
