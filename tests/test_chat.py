"""``kq chat`` fed two turns on its input: each reply is the unmodified model's for the same conversation (one
prompt cache over the turns), at a quarter of the experts under rule exact."""

import subprocess
import sys
from pathlib import Path

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
from mlx_lm import load, stream_generate  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from kq.chat import turn_ids  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / "models" / "wheels-moe"
TURNS = ["def add(a, b):", "class Stack:"]


def test_two_turns_give_the_unmodified_models_replies():
    model, tokenizer = load(str(WHEELS))
    cache, history, want = make_prompt_cache(model), [], ""
    for text in TURNS:
        reply = "".join(r.text for r in stream_generate(model, tokenizer, turn_ids(tokenizer, history, text, None),
                                                        max_tokens=10, prompt_cache=cache))
        want += reply + "\n"
        history += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]
    run = subprocess.run([sys.executable, "-m", "kq", "chat", "--model", str(WHEELS), "--residency", "0.25",
                          "--max-tokens", "10"], input="\n".join(TURNS) + "\nq\n", capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout == want and want.strip()


def test_a_bad_budget_is_named():
    run = subprocess.run([sys.executable, "-m", "kq", "chat", "--model", str(WHEELS), "--memory", "1KiB"],
                         input="", capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 2 and "--memory:" in run.stderr and "smallest budget" in run.stderr
