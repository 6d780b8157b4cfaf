"""``kq check``: every golden case and a batch of random rows through every backend."""

from __future__ import annotations

import itertools
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from kq.backends import Backend, Unavailable, all_backends
from kq.terminal import progress_bar, render_table
from kq_core.compare import Mismatch, first_mismatch
from kq_core.inputs import adversarial_inputs, router_inputs
from kq_core.oracle import route_shed_oracle
from kq_core.spec import load_spec

# (rows weight, K, E): single-row decode cases stay one row; the others share the row budget by weight.
RANDOM_SHAPES = ((1, 8, 256), (8, 6, 40), (4, 10, 64), (1, 64, 512), (16, 2, 8), (2, 1, 4))


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

    @property
    def ok(self) -> bool:
        return not self.skipped and self.passed == self.run


def split_rows(total: int, weights) -> list[int]:
    """``total`` split in proportion to ``weights``, exactly (largest remainders get the leftover rows)."""
    weights = np.asarray(weights, np.float64)
    quotas = total * weights / weights.sum()
    rows = np.floor(quotas).astype(int)
    leftover = total - int(rows.sum())
    rows[np.argsort(-(quotas - rows), kind="stable")[:leftover]] += 1
    return rows.tolist()


# Random rows the interpreted backends get by default, over one (index, score) dtype pair per shape.
QUICK_RANDOM_ROWS = 512
DTYPE_PAIRS = tuple(itertools.product(("int32", "uint32"), ("float32", "bfloat16", "float16")))


def random_cases(seed: int, rows_budget: int, *, every_dtype: bool = True):
    """Yields ``(name, inputs)``: exactly ``rows_budget`` random rows over shapes, dtypes and edge mixes.

    Each (shape, index dtype, score dtype) gets a router-like and an adversarial case; the
    row budget is split between them by the shapes' weights, and a case given no row is left out.
    With ``every_dtype=False`` each shape takes one dtype pair, the pairs taken in turn (a twelfth
    of the shapes to compile).
    """
    rng = np.random.default_rng(seed)
    pairs = [(shape, *pair) for shape, pair in itertools.product(RANDOM_SHAPES, DTYPE_PAIRS)] if every_dtype else [
        (shape, *DTYPE_PAIRS[i % len(DTYPE_PAIRS)]) for i, shape in enumerate(RANDOM_SHAPES)]
    combos = [(shape, index_dtype, score_dtype, generator) for shape, index_dtype, score_dtype in pairs
              for generator in (router_inputs, adversarial_inputs)]
    for ((weight, top_k, experts), index_dtype, score_dtype, generator), rows in zip(
            combos, split_rows(rows_budget, [shape[0] for shape, *_ in combos])):
        if rows:
            kind = "router" if generator is router_inputs else "edges"
            yield f"{kind}-{rows}x{top_k}-E{experts}-{index_dtype}-{score_dtype}", generator(
                rng, rows, top_k, experts, index_dtype=index_dtype, score_dtype=score_dtype)


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
                report.run += 1
                try:
                    mismatch = first_mismatch(expected, runner(*inputs, **options))
                except Exception as error:  # a crash is a failure of that case, not of the check
                    mismatch = f"{type(error).__name__}: {error}"
                if mismatch is None:
                    report.passed += 1
                else:
                    report.failures.append((name, mismatch))
                    report.first_failure = report.first_failure or f"{name}: {mismatch}"
                advance(name)
        if progress:
            sys.stderr.write(f"{backend.name}: {report.passed}/{report.run} bit-identical "
                             f"({time.perf_counter() - start:.1f} s)\n")
    return reports


def format_table(reports: list[BackendReport]) -> str:
    rows = [(r.name, r.device, f"{r.passed}/{r.run}" if not r.skipped else "skipped",
             f"{r.random_rows}" if not r.skipped else "-", r.skipped or r.first_failure or "-") for r in reports]
    return render_table(("backend", "device", "passed/run", "random rows", "first mismatch"), rows, left=(0, 1, 4))
