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


def test_figures_keep_within_the_width_and_wrap_under_their_explanation():
    rows = [("hit rate", "0.595", "fraction of the routed experts found in the arena; " * 4),
            ("speed", "112 tokens/s", "the median token")]
    lines = terminal.render_figures(rows, width=80).splitlines()
    assert max(len(line) for line in lines) <= 80 and len(lines) > 2
    column = lines[0].index("fraction")
    assert lines[0].startswith("  hit rate  0.595") and lines[1][:column].isspace() and lines[1][column] != " "
    assert lines[-1].startswith("  speed     112 tokens/s") and lines[-1].index("the median") == column
    # Every word is kept, in order.
    assert " ".join(" ".join(lines).split()).count("fraction of the routed experts") == 4


def test_wrap_keeps_paragraphs_and_long_words():
    path = "/a/very/long/path/" * 8
    text = terminal.wrap(f"first {path} and more words\nsecond paragraph", width=40, indent="  ")
    assert "  " + path in text.splitlines() and text.splitlines()[-1] == "second paragraph"
    assert all(len(line) <= 40 for line in text.splitlines() if path not in line)


def test_a_table_header_may_take_two_lines():
    table = terminal.render_table(("framework", "hit rate\nsteady"), [("jax", "0.482")])
    lines = table.splitlines()
    assert lines[0].split() == ["hit", "rate"] and lines[1].split() == ["framework", "steady"]
    assert lines[-1].split() == ["jax", "0.482"] and max(map(len, lines)) <= 30


def test_phase_lines_name_each_phase_on_stderr_as_it_starts(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr(terminal.sys, "stderr", err)
    clock = iter([5.0, 7.4, 19.0])
    monkeypatch.setattr(terminal.time, "monotonic", lambda: next(clock))
    say = terminal.phase_lines("kq demo")
    for phase in ("jax: loading the model", "jax: compiling", "mlx: loading the model"):
        say(phase)
    assert err.getvalue().splitlines() == ["kq demo: jax: loading the model ... (0 s)",
                                           "kq demo: jax: compiling ... (2 s)",
                                           "kq demo: mlx: loading the model ... (14 s)"]
