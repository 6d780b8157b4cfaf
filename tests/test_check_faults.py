"""`kq check --impl` and `kq.spec` against implementations that misbehave beyond wrong bits: a BaseException, a
call that never returns, a crash, output buffers reused, inputs written into, NumPy's error state set to raise;
and Ctrl-C during a check. Each ends in a verdict, never in a traceback or a hang."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

import kq.check
from kq.cli import main
from kq_core.spec import load_spec

GOLDEN = len(load_spec().cases)
ROOT = Path(__file__).resolve().parents[1]

IMPLEMENTATIONS = {
    "correct_impl": """
        from kq_core.oracle import route_shed_oracle

        def route_shed(indices, scores, slot_table, num_slots=None, on_miss="shed"):
            return route_shed_oracle(indices, scores, slot_table, num_slots=num_slots, on_miss=on_miss)
    """,
    "base_exception_impl": """
        import asyncio

        import numpy as np
        from kq_core.oracle import route_shed_oracle

        def cancelled(indices, scores, slot_table):
            raise asyncio.CancelledError("the event loop went away")

        def generator_exit(indices, scores, slot_table):
            raise GeneratorExit("closed")

        class Lazy:
            def __array__(self, dtype=None, copy=None):
                raise GeneratorExit("evaluated too late")

        def lazy_slots(indices, scores, slot_table):
            out = route_shed_oracle(indices, scores, slot_table)
            return (Lazy(), *out[1:])
    """,
    "cancelled_import_impl": """
        import asyncio

        raise asyncio.CancelledError("no event loop at import")
    """,
    # Writes its pid to a file, then never returns on the golden case zero_rows: asleep (the GIL released), or in a
    # regular expression that backtracks for ever (the GIL held, in C).
    "hanging_impl": """
        import os
        import re
        import time

        from kq_core.oracle import route_shed_oracle

        def _hang(indices, how):
            if indices.shape[0] == 0:
                with open(f"{how}.pid", "w") as file:
                    file.write(str(os.getpid()))
                if how == "sleeping":
                    time.sleep(3600)
                re.match(r"(a+)+b", "a" * 64)

        def sleeping(indices, scores, slot_table, num_slots=None, on_miss="shed"):
            _hang(indices, "sleeping")
            return route_shed_oracle(indices, scores, slot_table, num_slots=num_slots, on_miss=on_miss)

        def backtracking(indices, scores, slot_table, num_slots=None, on_miss="shed"):
            _hang(indices, "backtracking")
            return route_shed_oracle(indices, scores, slot_table, num_slots=num_slots, on_miss=on_miss)
    """,
    "crashing_impl": """
        import ctypes

        def route_shed(indices, scores, slot_table):
            ctypes.string_at(0)  # reads address 0: the process dies of SIGSEGV
    """,
    "seterr_impl": """
        import numpy as np
        from kq_core.oracle import route_shed_oracle

        np.seterr(all="raise")  # a library's own choice, made at import

        def route_shed(indices, scores, slot_table, num_slots=None, on_miss="shed"):
            return route_shed_oracle(indices, scores, slot_table, num_slots=num_slots, on_miss=on_miss)
    """,
    # One buffer per output, its outputs views of it: every call overwrites what the last one returned. One ulp
    # off in special_scores' mix[0, 1].
    "reusing_impl": """
        import numpy as np
        from kq_core.oracle import route_shed_oracle

        _BUFFERS = {}

        def route_shed(indices, scores, slot_table, num_slots=None, on_miss="shed"):
            out = route_shed_oracle(indices, scores, slot_table, num_slots=num_slots, on_miss=on_miss)
            if indices.shape == (9, 4):
                out.mix.view(np.uint32)[0, 1] += 1
            reused = []
            for name, array in zip(out._fields, out):
                buffer = _BUFFERS.setdefault(name, np.zeros(1 << 16, array.dtype))
                view = buffer.view(array.dtype)[:array.size].reshape(array.shape)
                view[...] = array
                reused.append(view)
            return tuple(reused)
    """,
    # Right outputs, then the slot table (and, in mlx_route_shed, the MLX slot table) overwritten, as a kernel
    # using its inputs for scratch would.
    "writing_impl": """
        import numpy as np
        from kq_core.oracle import route_shed_oracle

        def route_shed(indices, scores, slot_table):
            out = route_shed_oracle(indices, scores, slot_table)
            slot_table[:2] = -7
            return out

        def mlx_route_shed(indices, scores, slot_table):
            out = route_shed_oracle(*(np.array(a) for a in (indices, scores, slot_table)))
            slot_table[0] = -7
            return out
    """,
}


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A directory of the modules above, importable (as the current directory is to `kq check`); NumPy's error
    state as it was afterwards, whatever a module set."""
    for name, source in IMPLEMENTATIONS.items():
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    saved = np.geterr()
    yield tmp_path
    np.seterr(**saved)


def _table_row(out: str, label: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(label))


def _random_case_count(rows: int) -> int:
    return len(list(kq.check.random_cases(0, rows)))


def _run_kq(args, cwd, timeout=240, **popen):
    """``python -m kq ARGS`` in ``cwd``, kq importable from this checkout."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "kq", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, **popen)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# ---- BaseException -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("function, message", [
    ("cancelled", "raised CancelledError: the event loop went away"),
    ("generator_exit", "raised GeneratorExit: closed"),
    ("lazy_slots", "slots could not be read as a NumPy array (GeneratorExit: evaluated too late)"),
])
def test_a_base_exception_from_the_function_fails_that_case_naming_it(project, capsys, function, message):
    assert main(["check", "--impl", f"base_exception_impl:{function}", "--random-rows", "0"]) == 1
    out = capsys.readouterr().out
    assert message in _table_row(out, f"base_exception_impl:{function}")
    assert "1 implementation ran, 1 with mismatches" in out


def test_a_base_exception_at_import_is_named_as_the_module_not_importing(project, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["check", "--impl", "cancelled_import_impl:route_shed"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert ("module 'cancelled_import_impl' does not import (CancelledError: no event loop at import)" in err), err


def test_assert_matches_names_a_base_exception_and_lets_ctrl_c_through(project):
    from base_exception_impl import generator_exit

    from kq.spec import assert_matches, golden_cases

    with pytest.raises(AssertionError, match="raised GeneratorExit: closed"):
        assert_matches(generator_exit, golden_cases()[0])

    def interrupted(indices, scores, slot_table):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        assert_matches(interrupted, golden_cases()[0])


# ---- Ctrl-C ------------------------------------------------------------------------------------------------

def test_ctrl_c_stops_the_check_with_the_partial_table():
    import kq
    from kq.backends import Backend

    calls = []

    def probe():
        def run(indices, scores, slot_table, **options):
            calls.append(1)
            if len(calls) == 5:
                raise KeyboardInterrupt
            return kq.route_shed_oracle(indices, scores, slot_table, **options)

        return run, "cpu"

    reports = kq.check.run_checks((Backend("first", probe), Backend("second", probe)), random_rows=8)
    assert [r.name for r in reports] == ["first", "second"]
    assert reports[0].interrupted and reports[0].run == reports[0].passed == 4 and not reports[0].ok
    assert reports[1].skipped and not reports[1].ok and len(calls) == 5
    table = kq.check.format_table(reports)
    assert re.search(r"first\s+cpu\s+4/4 \(\d+ not run\)", table), table
    assert "interrupted (Ctrl-C) during first: the table is partial" in table


def test_ctrl_c_during_an_implementations_call_prints_the_partial_table_and_ends_it(project):
    kq_run = subprocess.Popen([sys.executable, "-m", "kq", "check", "--impl", "hanging_impl:sleeping",
                               "--random-rows", "0"], cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    pid_file = project / "sleeping.pid"
    deadline = time.monotonic() + 120
    while not pid_file.exists() and time.monotonic() < deadline and kq_run.poll() is None:
        time.sleep(0.1)
    assert pid_file.exists(), kq_run.communicate(timeout=30)
    time.sleep(0.2)  # the pid written, the call asleep
    kq_run.send_signal(signal.SIGINT)
    out, err = kq_run.communicate(timeout=60)
    # 130 (128 + SIGINT) where the command line returns it for an interrupted run; never killed by the signal
    assert kq_run.returncode == 130, (kq_run.returncode, out, err)
    assert "interrupted (Ctrl-C) during hanging_impl:sleeping: the table is partial" in out, out + err
    assert re.search(r"hanging_impl:sleeping\s+numpy arrays\s+\d+/\d+ \(\d+ not run\)", out), out
    assert "Traceback" not in err, err
    assert _gone(int(pid_file.read_text())), "the implementation's process outlived the check"


# ---- a call that never returns, a crash ------------------------------------------------------------------

@pytest.mark.parametrize("function", ["sleeping", "backtracking"])
def test_a_call_that_never_returns_fails_that_case_and_the_next_implementation_runs(project, function):
    backends = (kq.check.implementation_backend(f"hanging_impl:{function}", timeout=1.5),
                kq.check.implementation_backend("correct_impl:route_shed", timeout=30))
    start = time.monotonic()
    hung, correct = kq.check.run_checks(backends, random_rows=8)
    assert time.monotonic() - start < 60
    cases = GOLDEN + _random_case_count(8)
    assert hung.failures[0] == ("zero_rows", "hung: did not return within 1.5 s")
    assert hung.not_run == cases - hung.run > 0 and hung.passed == hung.run - 1 and not hung.ok
    assert "zero_rows: hung: did not return within 1.5 s" in hung.first_failure
    assert correct.ok and correct.run == cases
    assert _gone(int((project / f"{function}.pid").read_text())), "the hung process was left running"
    table = kq.check.format_table([hung, correct])
    assert f"{hung.passed}/{hung.run} ({hung.not_run} not run)" in _table_row(table, f"hanging_impl:{function}")
    assert (f"stopped hanging_impl:{function} at zero_rows: hung: did not return within 1.5 s; the other "
            f"{hung.not_run} cases were not run") in table


def test_the_command_line_names_a_call_that_never_returns(project, capsys):
    assert main(["check", "--impl", "hanging_impl:sleeping", "--random-rows", "0", "--timeout", "1"]) == 1
    out = capsys.readouterr().out
    assert "zero_rows: hung: did not return within 1 s" in _table_row(out, "hanging_impl:sleeping")
    assert "# got: hung: did not return within 1 s" in out  # the case, printed as a test


def test_a_crash_of_the_function_is_that_cases_failure(project):
    result = _run_kq(["check", "--impl", "crashing_impl:route_shed", "--random-rows", "0"], project)
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    row = _table_row(result.stdout, "crashing_impl:route_shed")
    assert "died: the process running it ended by signal SIGSEGV" in row, row


# ---- NumPy's error state -----------------------------------------------------------------------------------

def test_random_cases_and_the_check_run_under_any_numpy_error_state():
    from kq.backends import backend
    from kq.spec import random_cases

    want = random_cases(seed=0, rows=512)
    for state in ({"under": "raise"}, {"all": "raise"}, {"all": "warn"}):
        with np.errstate(**state), warnings.catch_warnings():
            warnings.simplefilter("error")  # no warning either
            got = random_cases(seed=0, rows=512)
            reports = kq.check.run_checks((backend("numpy-oracle"),), random_rows=512)
        assert reports[0].ok and reports[0].run == GOLDEN + _random_case_count(512)
        assert [case.name for case in got] == [case.name for case in want]
        for ours, theirs in zip(want, got):
            for a, b in zip((*ours.inputs, *ours.expected), (*theirs.inputs, *theirs.expected)):
                assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


def test_an_implementation_setting_numpy_to_raise_at_import_is_checked(project, capsys):
    assert main(["check", "--impl", "seterr_impl:route_shed", "--random-rows", "64"]) == 0
    assert "1 implementation ran, 0 with mismatches" in capsys.readouterr().out


# ---- output buffers reused, inputs written into -------------------------------------------------------------

def _pasted(snippet: str) -> dict:
    """The names a printed case defines, run up to its failing assert_matches."""
    namespace = {}
    with pytest.raises(AssertionError, match=r"special_scores: mix\[0, 1\]"):
        exec(compile(snippet, "pasted", "exec"), namespace)
    return namespace


def _assert_got_is_the_special_scores_case(namespace):
    case = load_spec().case("special_scores")
    got, want = namespace["got"], case.expected
    for name in ("slots", "miss_ids", "miss_scores"):
        assert getattr(got, name).tobytes() == getattr(want, name).tobytes(), name
    bits = want.mix.view(np.uint32).copy()
    bits[0, 1] += 1
    assert got.mix.view(np.uint32).tolist() == bits.tolist()


def test_outputs_in_reused_buffers_are_printed_as_the_failing_case_gave_them(project, capsys):
    from reusing_impl import route_shed

    from kq.spec import assert_matches, golden_cases

    with pytest.raises(AssertionError) as error:
        assert_matches(route_shed, golden_cases())
    message = str(error.value)
    _assert_got_is_the_special_scores_case(_pasted(message[message.index("import numpy"):]))

    assert main(["check", "--impl", "reusing_impl:route_shed", "--random-rows", "8"]) == 1
    out = capsys.readouterr().out
    _assert_got_is_the_special_scores_case(_pasted(out[out.index("```python\n") + 10:out.rindex("```")]))


def test_a_function_writing_into_its_inputs_fails_naming_them(project, capsys):
    from writing_impl import route_shed

    from kq.spec import assert_matches, golden_cases

    assert main(["check", "--impl", "writing_impl:route_shed", "--random-rows", "0"]) == 1
    row = _table_row(capsys.readouterr().out, "writing_impl:route_shed")
    assert re.search(r"decode_typical: modified its inputs: slot_table \(2 of \d+ entries differ after the call\)",
                     row), row
    with pytest.raises(AssertionError, match=r"modified its inputs: slot_table \(2 of \d+ entries differ"):
        assert_matches(route_shed, golden_cases()[0])
    before = golden_cases()[0]
    assert before.slot_table.tobytes() == load_spec().cases[0].inputs["slot_table"].tobytes()


def test_a_function_writing_into_its_mlx_inputs_fails_naming_them(project, capsys):
    pytest.importorskip("mlx")
    assert main(["check", "--impl", "writing_impl:mlx_route_shed", "--impl-arrays", "mlx", "--random-rows", "0"]) == 1
    row = _table_row(capsys.readouterr().out, "writing_impl:mlx_route_shed")
    assert "modified its inputs: slot_table (1 of" in row, row


# ---- docs/conformance.md ------------------------------------------------------------------------------------

def _conformance_block(containing: str) -> str:
    page = (ROOT / "docs" / "conformance.md").read_text()
    return next(code for code in re.findall(r"```python\n(.*?)```", page, flags=re.S) if containing in code)


def test_the_conformance_shim_saved_as_a_module_checks_only_when_run(tmp_path, capsys):
    (tmp_path / "shim_module.py").write_text(_conformance_block("def route_shed_shim"))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    imported = subprocess.run([sys.executable, "-c", "import shim_module"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)
    assert imported.returncode == 0 and imported.stdout == "", imported.stdout + imported.stderr
    run = subprocess.run([sys.executable, "shim_module.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and re.search(r"\d+ cases bit for bit, \d+ skipped", run.stdout), run.stdout + run.stderr
    result = _run_kq(["check", "--impl", "shim_module:route_shed_shim", "--random-rows", "8"], tmp_path)
    assert result.returncode == 0 and "1 implementation ran, 0 with mismatches" in result.stdout, result.stdout


def test_the_pytest_example_says_first_what_it_needs():
    first_line = _conformance_block("import pytest").splitlines()[0]
    assert first_line.startswith("#") and "pip install" in first_line and "pytest" in first_line, first_line
