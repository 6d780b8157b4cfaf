"""`kq check --impl` and `kq.spec` against implementations that misbehave beyond wrong bits: a BaseException, a
call that never returns, a crash, output buffers reused, inputs written into, NumPy's error state set to raise;
and Ctrl-C during a check. Each ends in a verdict, never in a traceback or a hang."""

import functools
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
