"""``kq check``: every golden case and a batch of random rows through every backend."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from kq.backends import Backend, Unavailable, all_backends
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


def random_cases(seed: int, rows_budget: int):
    """Yields ``(name, inputs)``: about ``rows_budget`` random rows over shapes, dtypes and edge mixes.

    Each (shape, index dtype, score dtype) gets a router-like and an adversarial case; the
    row budget is split between them by the shapes' weights (at least one row each).
    """
    rng = np.random.default_rng(seed)
    combos = list(itertools.product(RANDOM_SHAPES, ("int32", "uint32"), ("float32", "bfloat16", "float16")))
    unit = rows_budget / (2 * sum(weight for (weight, _, _), _, _ in combos))
    for (weight, top_k, experts), index_dtype, score_dtype in combos:
        rows = max(1, int(weight * unit))
        kw = dict(index_dtype=index_dtype, score_dtype=score_dtype)
        yield f"router-{rows}x{top_k}-E{experts}-{index_dtype}-{score_dtype}", router_inputs(
            rng, rows, top_k, experts, **kw)
        yield f"edges-{rows}x{top_k}-E{experts}-{index_dtype}-{score_dtype}", adversarial_inputs(
            rng, rows, top_k, experts, **kw)


def run_checks(backends: tuple[Backend, ...] | None = None, *, random_rows: int = 4096, seed: int = 0):
    """Runs the golden cases and random rows; returns one report per backend."""
    spec = load_spec()
    randoms = [(name, inputs, route_shed_oracle(*inputs)) for name, inputs in random_cases(seed, random_rows)]
    random_row_count = sum(inputs[0].shape[0] for _, inputs, _ in randoms)
    cases = [(c.name, tuple(c.inputs.values()), c.expected) for c in spec.cases] + randoms
    reports = []
    for backend in backends or all_backends():
        report = BackendReport(backend.name, random_rows=random_row_count)
        reports.append(report)
        try:
            runner, report.device = backend.probe()
        except Unavailable as why:
            report.skipped = str(why)
            continue
        for name, inputs, expected in cases:
            report.run += 1
            try:
                mismatch = first_mismatch(expected, runner(*inputs))
            except Exception as error:  # a crash is a failure of that case, not of the check
                mismatch = f"{type(error).__name__}: {error}"
            if mismatch is None:
                report.passed += 1
            else:
                report.failures.append((name, mismatch))
                report.first_failure = report.first_failure or f"{name}: {mismatch}"
    return reports


def format_table(reports: list[BackendReport]) -> str:
    header = ("backend", "device", "passed/run", "first mismatch")
    rows = [
        (r.name, r.device, f"{r.passed}/{r.run}" if not r.skipped else "skipped",
         r.skipped or r.first_failure or "-")
        for r in reports
    ]
    widths = [max(len(str(x[i])) for x in [header, *rows]) for i in range(3)]
    lines = []
    for row in [header, *rows]:
        lines.append("  ".join(str(cell).ljust(w) for cell, w in zip(row[:3], widths)) + "  " + row[3])
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)
