"""``credit`` given a token's reported misses instead of the tables it ran with: the same counts as given the
tables the report describes, in NumPy and compiled alike."""

import copy

import numpy as np
import pytest

from kq_host import bookkeeping
from kq_host.bookkeeping import Tables
from kq_host.residency import _COUNTERS

try:
    from kq_host import bookkeeping_numba
    MODULES = (bookkeeping, bookkeeping_numba)
except ImportError:
    MODULES = (bookkeeping,)


def served_tables(layers, experts, miss_ids):
    """int32 ``[L, E]``, -1 where a layer reported the expert missed, written plainly."""
    served = np.zeros((layers, experts), np.int32)
    for layer in range(layers):
        for expert in miss_ids[layer]:
            if expert >= 0:
                served[layer, expert] = -1
    return served


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # inf - inf: a NaN mass, on every path
@pytest.mark.parametrize("policy", ["lfu", "lru"])
@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_credit_from_the_reported_misses_counts_as_from_the_tables_they_describe(module, policy):
    rng = np.random.default_rng(3)
    for trial in range(60):
        layers, experts, entries = int(rng.integers(1, 6)), int(rng.integers(1, 40)), int(rng.integers(0, 60))
        width = int(rng.integers(0, 20))
        tables = Tables.empty(layers, experts, 4, policy, _COUNTERS)
        tables.priority[:] = rng.integers(0, 4, (layers, experts)) * 0.5
        ids = rng.integers(-2, experts + 2, (layers, entries))  # out of range ones too
        scores = np.where(rng.random((layers, entries)) < 0.2, rng.choice([np.nan, np.inf, -0.0], (layers, entries)),
                          rng.standard_normal((layers, entries)))
        miss_ids = rng.integers(-1, experts, (layers, width))  # padding and repeats anywhere
        if trial % 3 == 0 and entries:  # the routed entries themselves missed
            miss_ids = np.where(rng.random(ids.shape) < 0.5, np.where((ids >= 0) & (ids < experts), ids, -1), -1)
        want_tables, got_tables = copy.deepcopy(tables), copy.deepcopy(tables)
        want = bookkeeping.credit(want_tables, ids, scores, served_tables(layers, experts, miss_ids), 7, 0.9)
        got = module.credit(got_tables, ids, scores, None, 7, 0.9, miss_ids=miss_ids)
        assert np.array_equal(want, got), trial
        assert np.array_equal(want_tables.priority.view(np.int64), got_tables.priority.view(np.int64)), trial
        for name in want_tables.counts:
            assert np.array_equal(want_tables.counts[name].view(np.int64), got_tables.counts[name].view(np.int64)), \
                (trial, name)


@pytest.mark.parametrize("backing_off", [True, False])
@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_publish_writes_retry_after_only_while_an_expert_may_back_off(module, backing_off):
    rng = np.random.default_rng(5)
    tables = Tables.empty(2, 8, 4, "lfu", _COUNTERS)
    layers, experts, slots = np.array([0, 0, 1]), np.array([3, 5, 3]), np.array([0, 1, 2])
    bookkeeping.claim(tables, layers, experts, slots)
    tables.retry_after[:] = rng.integers(0, 9, tables.retry_after.shape)
    before = tables.retry_after.copy()
    failed = np.array([False, True, False])
    module.publish(tables, layers, experts, slots, failed, np.array([1, 2, 3]), backing_off=backing_off)
    want = before.copy()
    if backing_off:
        want[[0, 1], [3, 3]] = 0  # the landed reads' experts read again at once, should they fail later
    assert np.array_equal(tables.retry_after, want)
    assert tables.table[0, 3] == 0 and tables.table[1, 3] == 2 and tables.table[0, 5] == -1
    assert tables.counts["bytes_read"].tolist() == [1, 3] and tables.counts["reads_failed"].tolist() == [1, 0]
