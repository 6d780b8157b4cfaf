"""Progress when the output is not a terminal: plain lines, spaced out, never silence."""

import io

from kq import terminal


def test_piped_progress_prints_plain_lines(monkeypatch):
    err = io.StringIO()  # not a terminal
    monkeypatch.setattr(terminal.sys, "stderr", err)
    clock = iter([0.0, 1.0, 12.0, 13.0, 14.0])
    monkeypatch.setattr(terminal.time, "monotonic", lambda: next(clock))
    with terminal.progress_bar(4, description="kq study") as advance:
        for label in ("a", "b", "c", "d"):
            advance(label)
    lines = err.getvalue().splitlines()
    # The first step, a step 10 s or more after the last line, and the last step.
    assert lines == ["kq study: 1/4 a (1 s)", "kq study: 2/4 b (12 s)", "kq study: 4/4 d (14 s)"]


def test_disabled_progress_prints_nothing(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr(terminal.sys, "stderr", err)
    with terminal.progress_bar(3, enabled=False, description="x") as advance:
        advance("a")
    assert err.getvalue() == ""
