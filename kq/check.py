"""``kq check``: every golden case and a batch of random rows through every backend, or through another
project's ``route_shed`` (``--impl MODULE:FUNCTION``), each output compared bit for bit with the oracle's.

An ``--impl`` function runs in a process of its own, one case at a time, so whatever it does ends in a verdict on
a case: a call that does not return within the timeout (``hung``), a crash of the process (``died``), an exception
of any kind (``raised``), outputs that are not the contract's, or inputs written into (``modified its inputs``).
Ctrl-C stops the check, and the table printed is the part that ran.
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import signal
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Pipe
from pathlib import Path
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
# Seconds an --impl function may take on one case before the case fails as hung and the check of that function
# ends. A first call at a new shape compiles: kq_mlx.route_shed took 35 s on the golden case k64 on MLX 0.32.4's
# CPU backend (2 cores of an AMD EPYC, shared and busy, 2026-12-07).
DEFAULT_TIMEOUT = 300.0


class ImplementationError(ValueError):
    """An implementation to check cannot be loaded: the message says why."""


class CaseSkipped(Exception):
    """The case needs an option the implementation does not take; the message says which."""


class OutputError(Exception):
    """An implementation's result is not the contract's four arrays; the message says how."""


class CaseFailed(Exception):
    """An implementation failed a case with no outputs to compare (it raised, for one); the message says how."""


class CaseStopped(CaseFailed):
    """An implementation takes no more cases: it did not return within the timeout, or its process died."""


class InputsModified(Exception):
    """An implementation wrote into the inputs it was handed; the message names them, ``outputs`` are what it
    returned (a :class:`~kq_core.contract.RouteShedResult` of NumPy arrays)."""

    def __init__(self, message: str, outputs: RouteShedResult):
        super().__init__(message)
        self.outputs = outputs


def _described(error: BaseException) -> str:
    """``TypeName: message`` of ``error``, whatever its ``__str__`` does."""
    try:
        text = str(error)
    except Exception:  # a message that cannot be formatted is no reason to lose the verdict
        text = "(its message could not be read)"
    return f"{type(error).__name__}: {text}"


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
        stopped: the implementation takes no more cases (it hung, or its process died).
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
    stopped: bool = False


@dataclass
class BackendReport:
    """What :func:`run_checks` found for one backend or implementation.

    Attributes:
        name, device: as the table prints them.
        passed, run: cases that matched bit for bit, of the cases run.
        first_failure: ``"case: problem"`` of the first case that failed ("" when none did).
        skipped: why the backend did not run at all ("" when it ran).
        random_rows: the random rows among its cases.
        failures: ``(case, problem)`` of every failed case.
        skipped_cases, skip_reason: cases needing an option the implementation does not take, and the first's why.
        first_failed_case: the first failed case as it is printed (:func:`printable_case`).
        stopped: ``"case: problem"`` of the case after which no more ran (it hung, or its process died).
        not_run: the cases not run, after a stop or Ctrl-C.
        interrupted: Ctrl-C stopped the check during this backend, or before it ran.
    """

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
    stopped: str = ""
    not_run: int = 0
    interrupted: bool = False

    @property
    def ok(self) -> bool:
        return not self.skipped and not self.interrupted and not self.not_run and self.passed == self.run


# Random rows the interpreted backends get by default, over one (index, score) dtype pair per shape.
QUICK_RANDOM_ROWS = 512


def run_checks(backends: tuple[Backend, ...] | None = None, *, random_rows: int = 4096, seed: int = 0,
               thorough: bool = False, progress: bool = False):
    """Runs the golden cases and random rows; returns one report per backend.

    Every backend runs every golden case. An interpreted backend runs ``min(random_rows,
    QUICK_RANDOM_ROWS)`` random rows over one dtype pair per shape, the others ``random_rows`` over
    every pair; with ``thorough`` every backend runs them all. With ``progress``, a bar per backend
    while it runs (on a terminal) and a line per backend when it is done, on stderr.

    A case after which a backend takes no more (an ``--impl`` function that hung, or whose process died) ends that
    backend's cases: the rest are counted as not run (``stopped``, ``not_run``) and the next backend runs. Ctrl-C
    (KeyboardInterrupt) ends the check: the reports returned are what ran, the backend it stopped marked
    ``interrupted``, those after it skipped. A backend's runner with a ``close`` method is closed when its cases
    are done (an ``--impl`` function's process ends then).
    """
    backends = tuple(backends or all_backends())
    reports: list[BackendReport] = []
    try:
        spec = load_spec()
        golden = [(c.name, tuple(c.inputs.values()), c.expected, c.options) for c in spec.cases]

        def with_randoms(rows: int, every_dtype: bool):
            randoms = [(name, inputs, route_shed_oracle(*inputs), {})
                       for name, inputs in random_cases(seed, rows, every_dtype=every_dtype)]
            return golden + randoms, sum(inputs[0].shape[0] for _, inputs, _, _ in randoms)

        full = with_randoms(random_rows, True)
        quick = full if thorough else with_randoms(min(random_rows, QUICK_RANDOM_ROWS), False)
        for backend in backends:
            cases, random_row_count = quick if backend.interpreted else full
            report = BackendReport(backend.name, random_rows=random_row_count)
            reports.append(report)
            try:
                _check_backend(backend, cases, report, progress)
            except KeyboardInterrupt:
                report.interrupted = True
                report.not_run = len(cases) - report.run - report.skipped_cases
                if progress:
                    sys.stderr.write(f"{backend.name}: interrupted (Ctrl-C)\n")
                raise
    except KeyboardInterrupt:
        reports += [BackendReport(backend.name, skipped="not run: the check was interrupted (Ctrl-C)",
                                  interrupted=True) for backend in backends[len(reports):]]
    return reports


def _check_backend(backend: Backend, cases, report: BackendReport, progress: bool) -> None:
    """Runs ``cases`` through ``backend``, counting into ``report``; closes the runner at the end."""
    start = time.perf_counter()
    try:
        runner, report.device = backend.probe()
    except Unavailable as why:
        report.skipped = str(why)
        if progress:
            sys.stderr.write(f"{backend.name}: skipped ({why})\n")
        return
    try:
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
                    if failed.stopped:
                        report.stopped = f"{name}: {failed.problem}"
                        report.not_run = len(cases) - report.run - report.skipped_cases
                        break
                advance(name)
    finally:
        close = getattr(runner, "close", None)
        if callable(close):
            close()
    if progress:
        stopped = f"; stopped at {report.stopped}" if report.stopped else ""
        sys.stderr.write(f"{backend.name}: {report.passed}/{report.run} bit-identical "
                         f"({time.perf_counter() - start:.1f} s){stopped}\n")


def check_case(runner: Runner, name: str, inputs, expected: RouteShedResult, options: dict) -> FailedCase | None:
    """Runs one case and compares every output's dtype, shape and bits with ``expected``.

    Returns:
        None when every bit matches, else the :class:`FailedCase`. Whatever the runner raises (but
        :class:`CaseSkipped` and KeyboardInterrupt) is that case's failure: any exception, a ``BaseException``
        such as ``SystemExit``, ``GeneratorExit`` or ``asyncio.CancelledError`` too. Inputs the runner reports
        written into (:class:`InputsModified`) fail the case when its outputs match (wrong outputs are named
        first).

    Raises:
        CaseSkipped: the runner does not take an option the case needs.
        KeyboardInterrupt: Ctrl-C, as it came.
    """
    got, stopped = None, False
    try:
        got = runner(*inputs, **options)
        problem = first_mismatch(expected, got)
    except (CaseSkipped, KeyboardInterrupt):
        raise
    except InputsModified as modified:
        got = modified.outputs
        problem = first_mismatch(expected, got) or str(modified)
    except (OutputError, CaseFailed) as error:
        problem, stopped = str(error), isinstance(error, CaseStopped)
    except BaseException as error:  # a crash, a sys.exit or a CancelledError fails that case, not the check
        problem = f"raised {_described(error)}"
    if problem is None:
        return None
    return FailedCase(name, tuple(inputs), dict(options), expected, got, problem, stopped=stopped)


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
    """The reports as ``kq check`` prints them: a row each, then a line for each backend stopped at a case and
    one saying the table is partial when Ctrl-C ended the check."""

    def passed(report: BackendReport) -> str:
        if report.skipped:
            return "skipped"
        counts = ((report.skipped_cases, "skipped"), (report.not_run, "not run"))
        return f"{report.passed}/{report.run}" + "".join(f" ({n} {what})" for n, what in counts if n)

    rows = [(r.name, r.device, passed(r), f"{r.random_rows}" if not r.skipped else "-",
             r.skipped or r.first_failure or "-") for r in reports]
    lines = [render_table(("backend", "device", "passed/run", "random rows", "first mismatch"), rows, left=(0, 1, 4))]
    lines += [f"stopped {r.name} at {r.stopped}; the other {r.not_run} cases were not run"
              for r in reports if r.stopped]
    if any(r.interrupted for r in reports):
        during = next((r.name for r in reports if r.interrupted and not r.skipped), None)
        lines.append(f"interrupted (Ctrl-C) {f'during {during}' if during else 'before any backend ran'}: "
                     "the table is partial")
    return "\n".join(lines)


def was_interrupted(reports: list[BackendReport]) -> bool:
    """Ctrl-C ended the check the reports come from (``kq check`` then exits with 130)."""
    return any(report.interrupted for report in reports)


# ---- implementations of other projects ---------------------------------------------------------


def _parse_target(target: str) -> tuple[str, str]:
    """``(MODULE, FUNCTION)`` of ``target``, or :class:`ImplementationError` when it is no ``MODULE:FUNCTION``."""
    module_name, colon, attribute = str(target).partition(":")
    if not colon or not module_name or not attribute:
        raise ImplementationError(f"{target!r} is not MODULE:FUNCTION (e.g. mypackage.kernels:route_shed)")
    return module_name, attribute


def load_implementation(target: str) -> Callable:
    """The callable ``target`` names, ``MODULE:FUNCTION`` (``FUNCTION`` may be dotted: ``Class.method``).

    Raises:
        ImplementationError: ``target`` is malformed, its module does not import (whatever it raised
            while importing is named, a ``BaseException`` such as ``SystemExit`` too), it has no such
            attribute, or the attribute is not callable.
        KeyboardInterrupt: Ctrl-C while importing.
    """
    module_name, attribute = _parse_target(target)
    try:
        found = importlib.import_module(module_name)
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # an ImportError, or anything the module raised on import
        raise ImplementationError(f"{target}: module {module_name!r} does not import ({_described(error)})") from None
    for part in attribute.split("."):
        try:
            found = getattr(found, part)
        except AttributeError:
            raise ImplementationError(f"{target}: {module_name} has no attribute {attribute!r}") from None
        except KeyboardInterrupt:
            raise
        except BaseException as error:  # a module's __getattr__ may raise anything
            raise ImplementationError(f"{target}: reading {attribute!r} raised {_described(error)}") from None
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
    """NumPy to what the function is given: always a new array of its own (the cases stay as they are)."""
    if arrays == "jax":
        import jax.numpy as jnp

        return jnp.array  # a copy: a CPU array from jnp.asarray may share the NumPy array's memory
    if arrays == "mlx":
        from kq_mlx.route_shed_mlx import from_numpy

        return from_numpy
    return np.copy


def _reader(arrays: str) -> Callable[[object, np.ndarray], np.ndarray]:
    """``read(handed, like)``: an array handed to the function, read back as NumPy of ``like``'s dtype."""
    if arrays == "mlx":
        import mlx.core as mx

        def read(handed, like):
            if like.dtype.name == "bfloat16":  # NumPy reads no MLX bfloat16: its bits
                return np.array(handed.view(mx.uint16)).view(like.dtype)
            return np.array(handed)

        return read
    return lambda handed, like: np.asarray(handed)


def _inputs_modified(originals, handed, read) -> str | None:
    """What the function wrote into the inputs it was handed, as the message of :class:`InputsModified`; None when
    every input still holds the case's bits."""
    changes = []
    for name, original, given in zip(("indices", "scores", "slot_table"), originals, handed):
        try:
            now = read(given, original)
        except KeyboardInterrupt:
            raise
        except BaseException as error:  # a donated (deleted) JAX array, say
            changes.append(f"{name} (could not be read after the call: {_described(error)})")
            continue
        if now.dtype != original.dtype or now.shape != original.shape:
            changes.append(f"{name} (now {now.dtype}{list(now.shape)}, was {original.dtype}{list(original.shape)})")
            continue
        bits = f"u{original.dtype.itemsize}"
        differ = int(np.count_nonzero(original.view(bits) != now.view(bits)))
        if differ:
            changes.append(f"{name} ({differ} of {original.size} entries differ after the call)")
    return f"modified its inputs: {', '.join(changes)}" if changes else None


def _as_outputs(result) -> RouteShedResult:
    """An implementation's result as four NumPy arrays of their own (copies, so a function reusing its output
    buffers cannot change them later), or :class:`OutputError` saying what it is instead."""
    names = ", ".join(RouteShedResult._fields)
    if not isinstance(result, (tuple, list)):
        raise OutputError(f"returned {_a(type(result).__name__)}; the contract's outputs are a sequence of 4 "
                          f"arrays ({names})")
    if len(result) != len(RouteShedResult._fields):
        raise OutputError(f"returned {len(result)} outputs; the contract has 4: {names}")
    outputs = []
    for name, output in zip(RouteShedResult._fields, result):
        try:
            outputs.append(np.array(output))
        except KeyboardInterrupt:
            raise
        except BaseException as error:  # a lazy array may fail only now, when it is evaluated
            raise OutputError(f"{name} could not be read as a NumPy array ({_described(error)})") from None
    return RouteShedResult(*outputs)


def implementation_runner(fn: Callable, label: str, arrays: str = "numpy") -> Runner:
    """A runner of ``fn`` in this process: NumPy inputs in (handed to ``fn`` as new ``arrays`` arrays), NumPy
    outputs back, copied as soon as ``fn`` returns them.

    Args:
        fn: ``fn(indices, scores, slot_table[, num_slots=..., on_miss=...])`` returning the four outputs.
        label: how messages name ``fn``.
        arrays: one of :data:`ARRAY_KINDS`: what ``fn`` is given.

    Returns:
        ``runner(indices, scores, slot_table, **options) -> RouteShedResult`` of NumPy arrays; it raises
        :class:`CaseSkipped` for an option ``fn`` does not take, :class:`OutputError` for a result that is not
        four arrays, :class:`InputsModified` when ``fn`` wrote into the arrays it was handed, and whatever ``fn``
        raised.
    """
    if arrays not in ARRAY_KINDS:
        raise ValueError(f"arrays must be one of {ARRAY_KINDS}, got {arrays!r}")
    accepted, convert, read = accepted_options(fn), _converter(arrays), _reader(arrays)

    def run(indices, scores, slot_table, **options):
        lacking = [name for name in options if accepted is None or name not in accepted]
        if lacking:
            why = "its signature cannot be read" if accepted is None else f"{label} takes no {lacking[0]}"
            raise CaseSkipped(f"{why} (the case needs {', '.join(f'{k}={options[k]!r}' for k in lacking)})")
        originals = (indices, scores, slot_table)
        handed = tuple(convert(array) for array in originals)
        outputs = _as_outputs(fn(*handed, **options))
        modified = _inputs_modified(originals, handed, read)
        if modified is not None:
            raise InputsModified(modified, outputs)
        return outputs

    return run


def _check_timeout(timeout) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"timeout must be a number of seconds > 0 (or None: no limit), got {timeout!r}")
    return float(timeout)


class IsolatedImplementation:
    """A runner of ``target`` in a process of its own: the cases go there one at a time, the outputs come back.

    Whatever the function does ends in a verdict on the case: a call that does not return within ``timeout``
    seconds is :class:`CaseStopped` ``hung`` (the process is killed), a process that dies is :class:`CaseStopped`
    ``died``, anything it raises is :class:`CaseFailed` ``raised ...`` (``SystemExit``, ``GeneratorExit`` and any
    other ``BaseException`` too), and the rest is as :func:`implementation_runner` says. NumPy's error state, a
    module's own settings and what it prints (to stderr) stay in that process. After :meth:`close` (or a stop),
    the next call starts a new process.

    Args:
        target: ``MODULE:FUNCTION``, imported there with this process's ``sys.path``.
        arrays: one of :data:`ARRAY_KINDS`.
        timeout: seconds a call may take (None: no limit); starting the process and importing the module get
            as long, and :data:`DEFAULT_TIMEOUT` at least.
    """

    def __init__(self, target: str, arrays: str = "numpy", timeout: float | None = DEFAULT_TIMEOUT):
        _parse_target(target)
        if arrays not in ARRAY_KINDS:
            raise ValueError(f"arrays must be one of {ARRAY_KINDS}, got {arrays!r}")
        self.target, self.arrays, self.timeout = target, arrays, _check_timeout(timeout)
        self.process: subprocess.Popen | None = None
        self._connection: Connection | None = None
        self._finalizer = None

    def start(self) -> None:
        """Starts the process and imports the function there.

        Raises:
            ImplementationError: as :func:`load_implementation`, or the import hung or killed the process.
        """
        self.close()
        ours, theirs = Pipe()
        # JAX there takes GPU memory as it needs it, not three quarters of it at once (kq's backends may hold some).
        env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", **os.environ}
        try:
            # Its own session: Ctrl-C reaches this process alone, which then ends that one (and its children).
            self.process = subprocess.Popen(
                [sys.executable, "-c", _WORKER, str(theirs.fileno()), str(Path(__file__).resolve().parents[1])],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=2, env=env, start_new_session=True)
        finally:
            theirs.close()
        self._connection = ours
        self._finalizer = weakref.finalize(self, _end_process, self.process, ours, politely=True)
        module_name = _parse_target(self.target)[0]
        try:
            self._connection.send(("load", list(sys.path), self.target, self.arrays))
            reply = self._receive(None if self.timeout is None else max(self.timeout, DEFAULT_TIMEOUT))
        except CaseStopped as stopped:
            raise ImplementationError(f"{self.target}: module {module_name!r} did not import ({stopped})") from None
        if reply[0] != "ready":
            self.close()
            raise ImplementationError(reply[1])

    def __call__(self, indices, scores, slot_table, **options) -> RouteShedResult:
        if self.process is None:
            try:
                self.start()
            except ImplementationError as error:
                raise CaseStopped(str(error)) from None
        try:
            self._connection.send(("case", indices, scores, slot_table, options))
        except (OSError, EOFError):
            raise CaseStopped(f"died: the process running it {self._ended()}") from None
        except KeyboardInterrupt:
            self.close(politely=False)
            raise
        reply = self._receive()
        if reply[0] == "outputs":
            return RouteShedResult(*reply[1])
        if reply[0] == "skipped":
            raise CaseSkipped(reply[1])
        if reply[0] == "output_error":
            raise OutputError(reply[1])
        if reply[0] == "modified":
            raise InputsModified(reply[1], RouteShedResult(*reply[2]))
        raise CaseFailed(reply[1])

    def _receive(self, timeout: float | None | str = "call"):
        """The process's next reply, waiting ``timeout`` at most (a call's by default); :class:`CaseStopped` when
        none came."""
        timeout = self.timeout if timeout == "call" else timeout
        try:
            came = self._connection.poll(timeout)
            reply = self._connection.recv() if came else None
        except KeyboardInterrupt:
            self.close(politely=False)
            raise
        except (OSError, EOFError):
            raise CaseStopped(f"died: the process running it {self._ended()}") from None
        if not came:
            self.close(politely=False)
            raise CaseStopped(f"hung: did not return within {timeout:g} s")
        return reply

    def _ended(self) -> str:
        """How the process ended (it is reaped, and killed if it had only closed its end)."""
        process = self.process
        try:
            code = process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        self.close(politely=False)
        if code is None:
            return "stopped answering"
        if code < 0:
            try:
                return f"ended by signal {signal.Signals(-code).name}"
            except ValueError:
                return f"ended by signal {-code}"
        return f"ended with exit code {code}"

    def close(self, politely: bool = True) -> None:
        """Ends the process: asked to exit (``politely``, given 2 s), else killed with its process group."""
        if self._finalizer is not None:
            self._finalizer.detach()
            _end_process(self.process, self._connection, politely=politely)
        self.process, self._connection, self._finalizer = None, None, None


def _end_process(process: subprocess.Popen, connection: Connection, *, politely: bool) -> None:
    if politely and process.poll() is None:
        try:
            connection.send(None)
            process.wait(timeout=2)
        except (OSError, EOFError, subprocess.TimeoutExpired):
            pass
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except OSError:
            process.kill()
        process.wait()
    connection.close()


# The process an --impl function runs in: argv[1] its end of the pipe, argv[2] the directory kq is in.
_WORKER = "import sys; sys.path.insert(0, sys.argv[2]); from kq.check import _serve; _serve(int(sys.argv[1]))"


def _serve(fd: int) -> None:
    """The loop of :class:`IsolatedImplementation`'s process: imports the function, then runs each case it is
    sent and sends back its outputs or what went wrong; exits at ``None`` or when the other end is gone."""
    connection = Connection(fd)
    try:
        _, path, target, arrays = connection.recv()
        sys.path[:] = path
        try:
            runner = implementation_runner(load_implementation(target), target, arrays)
        except ImplementationError as error:
            connection.send(("refused", str(error)))
            return
        except BaseException as error:  # the arrays' framework does not import, say
            connection.send(("refused", f"{target}: {arrays} arrays cannot be made ({_described(error)})"))
            return
        connection.send(("ready",))
        while (message := connection.recv()) is not None:
            _, indices, scores, slot_table, options = message
            reply = _answer(runner, indices, scores, slot_table, options)
            try:
                connection.send(reply)
            except Exception as error:  # outputs that do not pickle (object arrays of anything)
                connection.send(("output_error", f"its outputs could not be passed back ({_described(error)})"))
    except (EOFError, OSError):
        pass  # the checking process is gone
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(0)  # threads or exit handlers of the function's libraries do not keep it alive


def _answer(runner: Runner, indices, scores, slot_table, options) -> tuple:
    try:
        return ("outputs", tuple(runner(indices, scores, slot_table, **options)))
    except CaseSkipped as why:
        return ("skipped", str(why))
    except OutputError as error:
        return ("output_error", str(error))
    except InputsModified as modified:
        return ("modified", str(modified), tuple(modified.outputs))
    except BaseException as error:  # KeyboardInterrupt too: Ctrl-C does not reach this process; the function raised it
        return ("raised", f"raised {_described(error)}")


def implementation_backend(target: str, arrays: str = "numpy", *, timeout: float | None = DEFAULT_TIMEOUT) -> Backend:
    """``target`` (``MODULE:FUNCTION``) as a :class:`~kq.backends.Backend` that :func:`run_checks` runs, in a
    process of its own (:class:`IsolatedImplementation`), started and the module imported now.

    Args:
        target: ``MODULE:FUNCTION``.
        arrays: one of :data:`ARRAY_KINDS`: what the function is given.
        timeout: seconds one case may take before it fails as hung and the check of the function ends (None: no
            limit); starting its process and importing the module get as long, and :data:`DEFAULT_TIMEOUT` at
            least.

    Raises:
        ImplementationError: as :func:`load_implementation`, or the import did not end within ``timeout``, or
            killed the process.
        ValueError: ``arrays`` or ``timeout`` is none of the values above (the message names it).
    """
    runner = IsolatedImplementation(target, arrays, timeout)
    runner.start()
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
