"""Every Python example in the README runs as written (each skips where its framework is missing)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _needs(code: str) -> list[str]:
    return [name for name in ("jax", "mlx", "safetensors") if re.search(rf"^\s*(import|from) {name}\b", code, re.M)]


@pytest.mark.parametrize("code", EXAMPLES, ids=[f"example{i}" for i in range(len(EXAMPLES))])
def test_readme_example_runs(code):
    for module in _needs(code):
        pytest.importorskip(module)
    exec(compile(code, str(README), "exec"), {"__name__": "readme_example"})


def test_the_readme_has_examples():
    assert len(EXAMPLES) >= 4
