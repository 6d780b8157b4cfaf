"""``kq check``: every golden case and a batch of random rows through every backend, or through another
project's ``route_shed`` (``--impl MODULE:FUNCTION``), each output compared bit for bit with the oracle's."""

from __future__ import annotations

import importlib
import inspect
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from kq.backends import Backend, Runner, Unavailable, all_backends
from kq.terminal import progress_bar, render_table
from kq_core.compare import Mismatch, first_mismatch
from kq_core.contract import RouteShedResult
from kq_core.inputs import random_cases
from kq_core.oracle import route_shed_oracle
from kq_core.spec import load_spec

# The keyword options of route_shed a case may need; an implementation gets those its signature takes.
OPTIONS = ("num_slots", "on_miss")
# What ``--impl-arrays`` hands an implementation.
ARRAY_KINDS = ("numpy", "jax", "mlx")
# A failing case of at most this many rows is printed whole; a larger one as its first differing row.
PRINTED_ROWS = 16


class ImplementationError(ValueError):
    """An implementation to check cannot be loaded: the message says why."""


class CaseSkipped(Exception):
    """The case needs an option the implementation does not take; the message says which."""


class OutputError(Exception):
    """An implementation's result is not the contract's four arrays; the message says how."""


@dataclass(frozen=True)
class FailedCase:
    """One case an implementation got wrong, with what is needed to print it as a test.

    Attributes:
        name: the case's name (a golden case's, or a random case's).
        inputs: ``(indices, scores, slot_table)`` NumPy arrays.
        options: the keyword options of the call (``num_slots``, ``on_miss``).
        expected: the oracle's outputs.
        got: the implementation's outputs as NumPy arrays; None when it raised or returned no four arrays.
        problem: the first differing bit (a :class:`Mismatch`) or what went wrong, as text.
        whole_rows: the rows of the case it was cut from, when it is one row of a larger case.
        row: that row's index among the case's rows (leading dimensions flattened).
        alone_passes: the row alone gives the expected outputs (the difference needs the rest of the batch).
    """

    name: str
    inputs: tuple[np.ndarray, np.ndarray, np.ndarray]
    options: dict
    expected: RouteShedResult
    got: RouteShedResult | None
    problem: Mismatch | str
    whole_rows: int | None = None
    row: int | None = None
    alone_passes: bool = False


@dataclass
class BackendReport:
    name: str
    device: str = "-"
    passed: int = 0
    run: int = 0
    first_failure: str = ""
    skipped: str = ""
    random_rows: int = 0
    failures: list[tuple[str, Mismatch | str]] = field(default_factory=list)
    skipped_cases: int = 0  # cases needing an option the implementation does not take
    skip_reason: str = ""
    first_failed_case: FailedCase | None = None

    @property
    def ok(self) -> bool:
        return not self.skipped and self.passed == self.run


# Random rows the interpreted backends get by default, over one (index, score) dtype pair per shape.
QUICK_RANDOM_ROWS = 512


def run_checks(backends: tuple[Backend, ...] | None = None, *, random_rows: int = 4096, seed: int = 0,
               thorough: bool = False, progress: bool = False):
    """Runs the golden cases and random rows; returns one report per backend.

    Every backend runs every golden case. An interpreted backend runs ``min(random_rows,
    QUICK_RANDOM_ROWS)`` random rows over one dtype pair per shape, the others ``random_rows`` over
    every pair; with ``thorough`` every backend runs them all. With ``progress``, a bar per backend
    while it runs (on a terminal) and a line per backend when it is done, on stderr.
    """
    spec = load_spec()
    golden = [(c.name, tuple(c.inputs.values()), c.expected, c.options) for c in spec.cases]

    def with_randoms(rows: int, every_dtype: bool):
        randoms = [(name, inputs, route_shed_oracle(*inputs), {})
                   for name, inputs in random_cases(seed, rows, every_dtype=every_dtype)]
        return golden + randoms, sum(inputs[0].shape[0] for _, inputs, _, _ in randoms)

    full = with_randoms(random_rows, True)
    quick = full if thorough else with_randoms(min(random_rows, QUICK_RANDOM_ROWS), False)
    reports = []
    for backend in backends or all_backends():
        cases, random_row_count = quick if backend.interpreted else full
        report = BackendReport(backend.name, random_rows=random_row_count)
        reports.append(report)
        start = time.perf_counter()
        try:
            runner, report.device = backend.probe()
        except Unavailable as why:
            report.skipped = str(why)
            if progress:
                sys.stderr.write(f"{backend.name}: skipped ({why})\n")
            continue
        with progress_bar(len(cases), enabled=progress, description=backend.name) as advance:
            for name, inputs, expected, options in cases:
                try:
                    failed = check_case(runner, name, inputs, expected, options)
                except CaseSkipped as why:
                    report.skipped_cases += 1
                    report.skip_reason = report.skip_reason or f"{name}: {why}"
                    advance(name)
                    continue
                report.run += 1
                if failed is None:
                    report.passed += 1
                else:
                    report.failures.append((name, failed.problem))
                    if report.first_failed_case is None:
                        report.first_failed_case = printable_case(runner, failed)
                        report.first_failure = f"{name}: {failed.problem}"
                advance(name)
        if progress:
            sys.stderr.write(f"{backend.name}: {report.passed}/{report.run} bit-identical "
                             f"({time.perf_counter() - start:.1f} s)\n")
    return reports


def check_case(runner: Runner, name: str, inputs, expected: RouteShedResult, options: dict) -> FailedCase | None:
    """Runs one case and compares every output's dtype, shape and bits with ``expected``.

    Returns:
        None when every bit matches, else the :class:`FailedCase`; an exception the runner raises
        (but :class:`CaseSkipped`) is that case's failure.

    Raises:
        CaseSkipped: the runner does not take an option the case needs.
    """
    try:
        got = runner(*inputs, **options)
        problem = first_mismatch(expected, got)
    except CaseSkipped:
        raise
    except OutputError as error:
        problem = str(error)
    except (Exception, SystemExit) as error:  # a crash (or a sys.exit) is a failure of that case, not of the check
        problem = f"raised {type(error).__name__}: {error}"
    if problem is None:
        return None
    readable = got if isinstance(problem, Mismatch) else None
    return FailedCase(name, tuple(inputs), dict(options), expected, readable, problem)


def _row_of(failed: FailedCase) -> int | None:
    """The first differing row (leading dimensions flattened), when the difference is at one entry."""
    if not isinstance(failed.problem, Mismatch) or failed.problem.index is None:
        return None
    leading = failed.inputs[0].shape[:-1]
    return int(np.ravel_multi_index(failed.problem.index[:-1], leading)) if leading else 0


def printable_case(runner: Runner, failed: FailedCase) -> FailedCase:
    """``failed`` as it is printed: whole when it has at most :data:`PRINTED_ROWS` rows, else its first
    differing row as a one-row case, run again alone (route_shed works row by row)."""
    rows = int(np.prod(failed.inputs[0].shape[:-1]))
    row = _row_of(failed)
    if rows <= PRINTED_ROWS or row is None:
        return failed
    indices, scores, slot_table = failed.inputs
    top_k = indices.shape[-1]
    one_row = (indices.reshape(-1, top_k)[row:row + 1], scores.reshape(-1, top_k)[row:row + 1], slot_table)
    expected = RouteShedResult(*(out.reshape(-1, top_k)[row:row + 1] for out in failed.expected))
    batch_got = RouteShedResult(*(out.reshape(-1, top_k)[row:row + 1] for out in failed.got))
    alone = check_case(runner, failed.name, one_row, expected, failed.options)
    got, problem = (alone.got, alone.problem) if alone is not None else (batch_got, first_mismatch(expected, batch_got))
    return FailedCase(failed.name, one_row, failed.options, expected, got, problem, whole_rows=rows, row=row,
                      alone_passes=alone is None)


def format_table(reports: list[BackendReport]) -> str:
    def passed(report: BackendReport) -> str:
        if report.skipped:
            return "skipped"
        skipped = f" ({report.skipped_cases} skipped)" if report.skipped_cases else ""
        return f"{report.passed}/{report.run}{skipped}"

    rows = [(r.name, r.device, passed(r), f"{r.random_rows}" if not r.skipped else "-",
             r.skipped or r.first_failure or "-") for r in reports]
    return render_table(("backend", "device", "passed/run", "random rows", "first mismatch"), rows, left=(0, 1, 4))


# ---- implementations of other projects ---------------------------------------------------------


def load_implementation(target: str) -> Callable:
    """The callable ``target`` names, ``MODULE:FUNCTION`` (``FUNCTION`` may be dotted: ``Class.method``).

    Raises:
        ImplementationError: ``target`` is malformed, its module does not import (whatever it raised
            while importing is named), it has no such attribute, or the attribute is not callable.
    """
    module_name, colon, attribute = target.partition(":")
    if not colon or not module_name or not attribute:
        raise ImplementationError(f"{target!r} is not MODULE:FUNCTION (e.g. mypackage.kernels:route_shed)")
    try:
        found = importlib.import_module(module_name)
    except (Exception, SystemExit) as error:  # an ImportError, or anything the module raised on import
        raise ImplementationError(f"{target}: module {module_name!r} does not import "
                                  f"({type(error).__name__}: {error})") from None
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise ImplementationError(f"{target}: {module_name} has no attribute {attribute!r}")
        found = getattr(found, part)
    if not callable(found):
        raise ImplementationError(f"{target}: {attribute} is {_a(type(found).__name__)}, not a callable")
    return found


def _a(noun: str) -> str:
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


def accepted_options(fn: Callable) -> frozenset[str] | None:
    """The :data:`OPTIONS` ``fn`` takes by keyword (all of them with ``**kwargs``); None when its signature
    cannot be read (some compiled functions), and then it is called with the three arrays only."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return frozenset(OPTIONS)
    return frozenset(p.name for p in parameters if p.name in OPTIONS and p.kind in (p.POSITIONAL_OR_KEYWORD,
                                                                                    p.KEYWORD_ONLY))


def _converter(arrays: str) -> Callable[[np.ndarray], object]:
    if arrays == "jax":
        import jax.numpy as jnp

        return jnp.asarray
    if arrays == "mlx":
        from kq_mlx.route_shed_mlx import from_numpy

        return from_numpy
    return np.copy  # the function may write into its inputs; the cases stay as they are


def _as_outputs(result) -> RouteShedResult:
    """An implementation's result as four NumPy arrays, or :class:`OutputError` saying what it is instead."""
    names = ", ".join(RouteShedResult._fields)
    if not isinstance(result, (tuple, list)):
        raise OutputError(f"returned {_a(type(result).__name__)}; the contract's outputs are a sequence of 4 "
                          f"arrays ({names})")
    if len(result) != len(RouteShedResult._fields):
        raise OutputError(f"returned {len(result)} outputs; the contract has 4: {names}")
    outputs = []
    for name, output in zip(RouteShedResult._fields, result):
        try:
            outputs.append(np.asarray(output))
        except Exception as error:  # a lazy array may fail only now, when it is evaluated
            raise OutputError(f"{name} could not be read as a NumPy array ({type(error).__name__}: {error})") from None
    return RouteShedResult(*outputs)


def implementation_runner(fn: Callable, label: str, arrays: str = "numpy") -> Runner:
    """A runner of ``fn``: NumPy inputs in (handed to ``fn`` as ``arrays`` arrays), NumPy outputs back.

    Args:
        fn: ``fn(indices, scores, slot_table[, num_slots=..., on_miss=...])`` returning the four outputs.
        label: how messages name ``fn``.
        arrays: one of :data:`ARRAY_KINDS`: what ``fn`` is given.

    Returns:
        ``runner(indices, scores, slot_table, **options) -> RouteShedResult`` of NumPy arrays; it raises
        :class:`CaseSkipped` for an option ``fn`` does not take and :class:`OutputError` for a result that
        is not four arrays.
    """
    if arrays not in ARRAY_KINDS:
        raise ValueError(f"arrays must be one of {ARRAY_KINDS}, got {arrays!r}")
    accepted, convert = accepted_options(fn), _converter(arrays)

    def run(indices, scores, slot_table, **options):
        lacking = [name for name in options if accepted is None or name not in accepted]
        if lacking:
            why = "its signature cannot be read" if accepted is None else f"{label} takes no {lacking[0]}"
            raise CaseSkipped(f"{why} (the case needs {', '.join(f'{k}={options[k]!r}' for k in lacking)})")
        return _as_outputs(fn(convert(indices), convert(scores), convert(slot_table), **options))

    return run


def implementation_backend(target: str, arrays: str = "numpy") -> Backend:
    """``target`` (``MODULE:FUNCTION``) as a :class:`~kq.backends.Backend` that :func:`run_checks` runs.

    Raises:
        ImplementationError: as :func:`load_implementation`.
    """
    fn = load_implementation(target)
    runner = implementation_runner(fn, target, arrays)
    return Backend(target, lambda: (runner, f"{arrays} arrays"))


# ---- a failing case as a test -----------------------------------------------------------------

_BITS_VIEW = {"float32": ("np.uint32", "np.float32"), "float16": ("np.uint16", "np.float16"),
              "bfloat16": ("np.uint16", "ml_dtypes.bfloat16")}


def _literal(array: np.ndarray) -> str:
    """``array`` as a NumPy expression that rebuilds it bit for bit (floats through their bits)."""
    array = np.asarray(array)
    name = array.dtype.name
    if name in _BITS_VIEW:
        width, view = _BITS_VIEW[name]
        digits = 2 * array.dtype.itemsize
        values = "[" + ", ".join(f"0x{bits:0{digits}x}" for bits in
                                 array.reshape(-1).view(f"uint{8 * array.dtype.itemsize}").tolist()) + "]"
        text = f"np.array({values}, {width}).view({view})"
    elif array.dtype.kind in "iub":
        text = f"np.array({array.reshape(-1).tolist()}, np.{name})"
    else:
        return f"np.asarray({array.tolist()!r})  # dtype {name}"
    return f"{text}.reshape({array.shape})" if array.ndim != 1 else text


def _result_literal(result: RouteShedResult) -> str:
    fields = ",\n".join(f"    {name}={_literal(output)}" for name, output in zip(result._fields, result))
    return f"RouteShedResult(\n{fields},\n)"


def format_failed_case(label: str, case: FailedCase, *, seed: int | None = 0, random_rows: int = 4096) -> str:
    """``case`` as Python to paste into a test: the inputs, the options, the expected outputs and what
    ``label`` gave, then ``assert_matches`` on the case (a ``MODULE:FUNCTION`` label is imported).

    A case too large to print whole (more than :data:`PRINTED_ROWS` rows, its difference not at one
    entry) is fetched by name from :mod:`kq.spec` instead: a golden case from ``golden_cases()``, any
    other from ``random_cases(seed, random_rows)``, the call it came from; with ``seed`` None (a case
    of the caller's own) it is named only.
    """
    module, _, attribute = label.partition(":")
    importable = bool(attribute) and "<" not in attribute and module not in ("", "None", "__main__")
    fn = attribute if importable else "route_shed"
    golden = case.name in {c.name for c in load_spec().cases}
    source = "golden_cases()" if golden else None if seed is None else f"random_cases({seed}, {random_rows})"
    fetch = (f"next(c for c in kq.spec.{source} if c.name == {case.name!r})" if source is not None else
             f"...  # the Case named {case.name!r} that was checked")
    rows = int(np.prod(case.inputs[0].shape[:-1]))
    what = case.name if case.row is None else f"row {case.row} of {case.name} ({case.whole_rows} rows)"
    lines = [f"# {label}, {what}: {case.problem}"]
    if case.row is not None:
        lines.append("# route_shed works row by row, so one row is a case; " + (
            "alone, this row gives the expected outputs: the difference needs the rest of the batch "
            "('got' is this row of the whole case's outputs)" if case.alone_passes else
            "alone, this row differs the same way"))
        lines.append(f"# the whole case: {fetch}")
    whole = case.row is not None or rows <= PRINTED_ROWS
    needs_bf16 = whole and any(np.asarray(a).dtype.name == "bfloat16" for a in (*case.inputs, *(case.got or ())))
    lines += [*(["import ml_dtypes"] if needs_bf16 else []), "import numpy as np", "",
              *(["import kq.spec"] if not whole and source is not None else []),
              "from kq.spec import Case, assert_matches",
              "from kq_core.contract import RouteShedResult"]
    lines.append(f"from {module} import {attribute.split('.')[0]}" if importable else
                 f"{fn} = ...  # the function that gave these outputs")
    if not whole:
        lines += ["", f"# {rows} rows, too many to print", f"case = {fetch}", f"# got: {case.problem}",
                  f"assert_matches({fn}, case)"]
        return "\n".join(lines)
    indices, scores, slot_table = case.inputs
    lines += ["", f"indices = {_literal(indices)}", f"scores = {_literal(scores)}",
              f"slot_table = {_literal(slot_table)}", f"options = {case.options!r}",
              f"expected = {_result_literal(case.expected)}",
              f"got = {_result_literal(case.got)}" if case.got is not None else f"# got: {case.problem}",
              f"assert_matches({fn}, Case({case.name!r}, indices, scores, slot_table, options, expected))"]
    return "\n".join(lines)
