"""Tables, figures and progress for the ``kq`` commands, drawn by rich.

Tables go to stdout and never wrap: on a terminal they take its width, piped
or captured they are laid out on a wide page (a command keeps its own within
:data:`TEXT_COLUMNS`, splitting a wide table and giving a header two lines).
Prose and figures are wrapped within :data:`TEXT_COLUMNS` (:func:`wrap`,
:func:`render_figures`). Progress goes to stderr: a live bar on a terminal;
elsewhere (a pipe, a log) plain lines, one for the first step, then one
whenever a step ends 10 s or more after the last line, and one for the last
step; a run's phases one line each as they start (:func:`phase_lines`).
"""

from __future__ import annotations

import contextlib
import sys
import textwrap
import time
from typing import Iterator, Sequence

from rich import box
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

_PAGE_WIDTH = 400
TEXT_COLUMNS = 100  # the width the commands' own lines keep to


def wrap(text: str, *, indent: str = "", width: int = TEXT_COLUMNS) -> str:
    """``text`` as lines within ``width`` columns, lines after the first indented by ``indent``; a word
    longer than a line (a path) is left whole. Newlines in ``text`` start new paragraphs."""
    return "\n".join(textwrap.fill(paragraph, width, subsequent_indent=indent, break_long_words=False,
                                   break_on_hyphens=False) for paragraph in text.split("\n"))


def render_figures(rows: Sequence[tuple[str, str, str]], *, width: int = TEXT_COLUMNS) -> str:
    """Rows of ``(name, value, what it is)`` as aligned lines within ``width`` columns: the name and the value in
    columns, what it is beside them, wrapped under itself."""
    names = max(len(name) for name, _, _ in rows)
    values = max(len(value) for _, value, _ in rows)
    lines = []
    for name, value, what in rows:
        start = f"  {name:<{names}}  {value:<{values}}  "
        text = textwrap.wrap(what, max(width - len(start), 30), break_long_words=False, break_on_hyphens=False)
        lines.append(start + (text[0] if text else ""))
        lines.extend(" " * len(start) + line for line in text[1:])
    return "\n".join(line.rstrip() for line in lines)


def _console(stream) -> Console:
    return Console(file=stream, width=None if stream.isatty() else _PAGE_WIDTH, highlight=False,
                   soft_wrap=False)


def render_table(header: Sequence[str], rows: Sequence[Sequence[object]], *, title: str | None = None,
                 left: Sequence[int] = (0,)) -> str:
    """The rows under the header as a plain-text table: the columns in ``left`` left-aligned, the rest right.

    A header name may hold a newline: a header of two lines, which keeps a table of many columns narrow.
    """
    table = Table(*header, title=title, box=box.SIMPLE_HEAD, title_justify="left", show_edge=False,
                  pad_edge=False)
    for i, column in enumerate(table.columns):
        column.justify = "left" if i in left else "right"
        column.no_wrap = True
    for row in rows:
        table.add_row(*(str(cell) for cell in row))
    console = Console(width=_PAGE_WIDTH, color_system=None, highlight=False)
    with console.capture() as captured:
        console.print(table)
    return "\n".join(line.rstrip() for line in captured.get().splitlines())


# Piped progress: the least time between two plain lines (the first and the last step always print).
PLAIN_LINE_SECONDS = 10.0


@contextlib.contextmanager
def progress_bar(total: int, *, enabled: bool = True, description: str = "") -> Iterator:
    """Yields ``advance(label)``: one step done, ``label`` shown beside the bar on a terminal, in a plain
    line on stderr elsewhere (see the module docstring)."""
    if enabled and not sys.stderr.isatty():
        yield _plain_lines(total, description)
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[label]}"), console=_console(sys.stderr), transient=True,
                  disable=not enabled) as progress:
        task = progress.add_task(description, total=total, label="")

        def advance(label: str = "") -> None:
            progress.update(task, advance=1, label=label)

        yield advance


def _plain_lines(total: int, description: str):
    start = time.monotonic()
    state = {"done": 0, "printed": None}

    def advance(label: str = "") -> None:
        state["done"] += 1
        now = time.monotonic()
        last = state["printed"]
        if last is None or now - last >= PLAIN_LINE_SECONDS or state["done"] == total:
            state["printed"] = now
            step = f"{state['done']}/{total}" + (f" {label}" if label else "")
            print(f"{description}: {step} ({now - start:.0f} s)", file=sys.stderr, flush=True)

    return advance


def phase_lines(description: str):
    """Returns ``say(phase)``: prints ``{description}: {phase} ... ({seconds} s)`` on stderr as a phase of a run
    starts, the seconds counted from the first, so a run that compiles or reads for a while says what it does."""
    start = []

    def say(phase: str) -> None:
        now = time.monotonic()
        start.append(now)
        print(f"{description}: {phase} ... ({now - start[0]:.0f} s)", file=sys.stderr, flush=True)

    return say
