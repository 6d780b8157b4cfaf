"""The spec of ``route_shed`` as test cases for any implementation, for another project's test suite.

The golden vectors of ``shared/spec.json`` and seeded random rows (router-like and edge-value mixes over
every index and score dtype), each with the oracle's outputs, and a bit-for-bit check of a function
against them. A project that implements ``route_shed`` (a Metal or CUDA kernel, a port to another
framework) parametrizes its tests over the spec in a few lines::

    import pytest
    from kq.spec import assert_matches, golden_cases, random_cases
    from mypackage import route_shed

    @pytest.mark.parametrize("case", golden_cases() + random_cases(seed=0, rows=256), ids=str)
    def test_route_shed_matches_the_spec(case):
        assert_matches(route_shed, case)

``kq check --impl mypackage:route_shed`` runs the same cases from the command line. The cases come from
:mod:`kq_core` (the spec, the generators, the oracle); this module only packages them for tests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from kq.check import (ARRAY_KINDS, CaseSkipped, check_case, format_failed_case, implementation_runner,
                      printable_case)
from kq_core.contract import RouteShedResult
from kq_core.inputs import random_cases as random_inputs
from kq_core.oracle import route_shed_oracle
from kq_core.spec import load_spec

__all__ = ["Case", "Matched", "assert_matches", "golden_cases", "random_cases"]


class Matched(NamedTuple):
    """What :func:`assert_matches` checked: ``cases`` matched bit for bit; ``skipped``, one line per case
    skipped (its name and the option the function does not take)."""

    cases: int
    skipped: tuple[str, ...]


@dataclass(frozen=True, eq=False)
class Case:
    """One call of ``route_shed`` and the outputs the contract assigns it.

    Attributes:
        name: the case's name (``str(case)`` too, so ``ids=str`` names pytest's parameters).
        indices: int32 or uint32 ``[..., K]``; scores: float32, bfloat16 or float16 ``[..., K]``;
            slot_table: int32 ``[E]`` (NumPy arrays).
        options: the keyword options the call takes, e.g. ``{"num_slots": 6, "on_miss": "tier"}``.
        expected: the oracle's :class:`~kq_core.contract.RouteShedResult`, NumPy arrays shaped like ``indices``.
        drawn_from: ``(seed, rows)`` of the :func:`random_cases` call that made the case (a failure prints
            that call to fetch it again); None for the others.
    """

    name: str
    indices: np.ndarray
    scores: np.ndarray
    slot_table: np.ndarray
    options: dict = field(default_factory=dict)
    expected: RouteShedResult | None = None
    drawn_from: tuple[int, int] | None = field(default=None, kw_only=True)

    def __post_init__(self):
        if self.expected is None:
            object.__setattr__(self, "expected", route_shed_oracle(self.indices, self.scores, self.slot_table,
                                                                   **self.options))

    def __str__(self) -> str:
        return self.name

    @property
    def inputs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.indices, self.scores, self.slot_table


def golden_cases() -> list[Case]:
    """Every golden vector of ``shared/spec.json``, in the file's order (some with options); the arrays are
    the caller's own copies."""
    return [Case(c.name, *(np.copy(a) for a in c.inputs.values()), dict(c.options),
                 RouteShedResult(*(np.copy(a) for a in c.expected))) for c in load_spec().cases]


def random_cases(seed: int = 0, rows: int = 4096) -> list[Case]:
    """``rows`` random rows in all, over shapes (K from 1 to 64), every index and score dtype, router-like
    and edge-value mixes, as ``kq check`` runs them; the same seed gives the same cases on any machine.

    Args:
        seed: an int >= 0.
        rows: the rows of all the cases together, an int >= 0.

    Returns:
        :class:`Case` s, each with ``drawn_from=(seed, rows)``.

    Raises:
        ValueError: ``seed`` or ``rows`` is not an int >= 0 (the message names it).
    """
    drawn = random_inputs(seed, rows)  # checks seed and rows
    return [Case(name, *inputs, drawn_from=(int(seed), int(rows))) for name, inputs in drawn]


def assert_matches(fn: Callable, cases: Case | Iterable[Case] | None = None, *, arrays: str = "numpy") -> Matched:
    """Asserts that ``fn`` gives the oracle's outputs, bit for bit, on ``cases``.

    ``fn(indices, scores, slot_table)`` is given ``num_slots`` and ``on_miss`` only when its signature
    takes them; a case needing one it does not take is skipped (with one case, or when every case is
    skipped, through ``pytest.skip``). ``fn`` runs in this process, with no timeout, on new arrays of its own;
    its outputs are copied as it returns them, so a function reusing its output buffers is reported with the
    failing case's outputs.

    Args:
        fn: the implementation; returns ``(slots, mix, miss_ids, miss_scores)``, arrays NumPy can read.
        cases: one :class:`Case`, several (at least one), or None for every golden case and ``random_cases()``.
        arrays: what ``fn`` is given: ``"numpy"``, ``"jax"`` or ``"mlx"`` arrays.

    Returns:
        :class:`Matched`: how many cases matched, and the skipped ones.

    Raises:
        AssertionError: a case differs (or ``fn`` raised on it, a ``BaseException`` such as ``SystemExit`` or
            ``GeneratorExit`` too, returned no four arrays, or wrote into the inputs it was handed: ``modified its
            inputs``): how many, and the first in full, as Python to paste into a test.
        KeyboardInterrupt: Ctrl-C during a call, as it came.
        ValueError: ``cases`` holds no case (nothing would be checked).
    """
    if not callable(fn):
        raise TypeError(f"assert_matches: fn must be callable, got {type(fn).__name__}")
    if arrays not in ARRAY_KINDS:
        raise ValueError(f"assert_matches: arrays must be one of {ARRAY_KINDS}, got {arrays!r}")
    cases = [cases] if isinstance(cases, Case) else golden_cases() + random_cases() if cases is None else list(cases)
    if not all(isinstance(case, Case) for case in cases):
        raise TypeError("assert_matches: cases must be a Case or an iterable of Case (kq.spec.golden_cases(), "
                        "kq.spec.random_cases())")
    if not cases:
        raise ValueError("assert_matches: cases is empty, so nothing would be checked; give at least one Case "
                         "(kq.spec.golden_cases(), kq.spec.random_cases(seed, rows) with rows >= 1)")
    label = f"{getattr(fn, '__module__', None)}:{getattr(fn, '__qualname__', type(fn).__name__)}"
    runner = implementation_runner(fn, label, arrays)
    failures, skipped, first, first_case = 0, [], None, None
    for case in cases:
        try:
            failed = check_case(runner, case.name, case.inputs, case.expected, case.options)
        except CaseSkipped as why:
            skipped.append(f"{case.name}: {why}")
            continue
        if failed is not None:
            failures += 1
            if first is None:
                first, first_case = printable_case(runner, failed), case
    if failures:
        ran = len(cases) - len(skipped)
        seed, rows = first_case.drawn_from or (None, 0)
        raise AssertionError(f"{failures} of {ran} cases differ; the first, {first.name}: {first.problem}\n"
                             f"{format_failed_case(label, first, seed=seed, random_rows=rows)}")
    if len(skipped) == len(cases):
        reason = skipped[0] if len(skipped) == 1 else f"every case skipped; the first, {skipped[0]}"
        try:
            import pytest
        except ImportError:
            raise CaseSkipped(reason) from None
        pytest.skip(reason)
    return Matched(len(cases) - len(skipped), tuple(skipped))
