"""The compiled bookkeeping's pieces that must match NumPy bit for bit on their own."""

import numpy as np
import pytest

numba_bookkeeping = pytest.importorskip("kq_host.bookkeeping_numba")


@pytest.mark.parametrize("size", [1, 2, 7, 8, 9, 15, 16, 17, 64, 127, 128, 129, 136, 255, 256, 257, 1000, 4099])
def test_sums_add_in_numpys_order(size):
    """The masses' sums take NumPy's pairwise order, so the statistics match the NumPy path's bits:
    random magnitudes over twelve decades (where the order shows), signed zeros, NaN-free."""
    rng = np.random.default_rng(size)
    for trial in range(200):
        values = rng.standard_normal(size) * 10.0 ** rng.integers(-6, 6, size)
        if trial % 20 == 0:
            values[:] = -0.0
        assert np.float64(numba_bookkeeping._numpy_sum(values)).view(np.int64) == values.sum().view(np.int64), trial


def random_tables(rng, layers, experts, slots, policy):
    """Tables in a state a manager can reach: each slot free, loading or resident for a distinct
    expert, a few pinned residents, priorities with many ties, some experts backing off."""
    from kq_host.bookkeeping import LOADING, RESIDENT, Tables
    from kq_host.residency import _COUNTERS

    tables = Tables.empty(layers, experts, slots, policy, _COUNTERS)
    for layer in range(layers):
        owners = rng.permutation(experts)[:slots]
        states = rng.choice([0, LOADING, RESIDENT], slots, p=[0.15, 0.15, 0.7])
        for slot, (expert, state) in enumerate(zip(owners, states)):
            if state:
                tables.owner[layer, slot], tables.state[layer, slot] = expert, state
                tables.held[layer, expert] = True
                if state == RESIDENT:
                    tables.table[layer, expert] = slot
                    tables.pinned[layer, expert] = rng.random() < 0.05
    tables.priority[:] = rng.integers(0, 4, (layers, experts)) * rng.choice([1.0, 0.5, 0.25], (layers, experts))
    tables.retry_after[:] = np.where(rng.random((layers, experts)) < 0.1, 12, 0)
    return tables


ADVERSARIAL_SCORES = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-45, 0.5, 0.5, 0.25, -2.0, 3e38],
                              np.float32)


@pytest.mark.parametrize("policy", ["lfu", "lru"])
@pytest.mark.parametrize("read_budget", [None, 0, 3, 40])
def test_place_decides_as_numpy_does(policy, read_budget):
    """Same reads and same tables after ``place`` on random reachable states, with miss scores that
    tie, NaN, +-inf, signed zeros and subnormals, repeated experts and padding."""
    import copy

    from kq_host import bookkeeping

    rng = np.random.default_rng(0 if read_budget is None else read_budget + 1)
    for trial in range(40):
        layers, experts, width = int(rng.integers(1, 6)), int(rng.integers(4, 40)), int(rng.integers(1, 12))
        slots = int(rng.integers(1, experts + 1))
        tables = random_tables(rng, layers, experts, slots, policy)
        miss_ids = rng.integers(-1, experts, (layers, width))
        miss_scores = np.where(rng.random((layers, width)) < 0.5, rng.choice(ADVERSARIAL_SCORES, (layers, width)),
                               rng.random((layers, width))).astype(np.float32)
        shielded = rng.random((layers, experts)) < 0.2
        outcomes = []
        for module in (bookkeeping, numba_bookkeeping):
            mine = copy.deepcopy(tables)
            reads = module.place(mine, miss_ids, miss_scores, shielded, token=10, read_budget=read_budget,
                                 backing_off=bool(trial % 2))
            outcomes.append((reads, mine))
        (want_reads, want), (got_reads, got) = outcomes
        for name, a, b in zip("layers experts slots".split(), want_reads, got_reads):
            assert np.array_equal(a, b), (trial, name, a, b)
        for field in ("table", "owner", "state", "held"):
            assert np.array_equal(getattr(want, field), getattr(got, field)), (trial, field)
        for name in want.counts:
            assert np.array_equal(want.counts[name], got.counts[name]), (trial, name)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # inf - inf: a NaN mass, on both paths
@pytest.mark.parametrize("policy", ["lfu", "lru"])
def test_credit_and_publish_count_as_numpy_does(policy):
    """Routed ids out of range, NaN, +-inf and negative scores: same priorities, routed mask and
    counters (masses to the bit); then the same publishing of a mix of landed and failed reads."""
    import copy

    from kq_host import bookkeeping

    rng = np.random.default_rng(7)
    for trial in range(40):
        layers, experts, entries = int(rng.integers(1, 6)), int(rng.integers(4, 40)), int(rng.integers(1, 200))
        tables = random_tables(rng, layers, experts, int(rng.integers(1, experts + 1)), policy)
        ids = rng.integers(-2, experts + 2, (layers, entries))
        scores = np.where(rng.random((layers, entries)) < 0.3, rng.choice(ADVERSARIAL_SCORES, (layers, entries)),
                          rng.standard_normal((layers, entries)) * 10.0 ** rng.integers(-8, 8, (layers, entries)))
        loading = np.argwhere(tables.state == bookkeeping.LOADING)
        layers_read, slots_read = loading[:, 0].astype(np.int64), loading[:, 1].astype(np.int64)
        experts_read = tables.owner[layers_read, slots_read].astype(np.int64)
        failed = rng.random(layers_read.size) < 0.3
        nbytes = rng.integers(0, 1 << 40, layers_read.size)
        outcomes = []
        for module in (bookkeeping, numba_bookkeeping):
            mine = copy.deepcopy(tables)
            routed = module.credit(mine, ids, scores, tables.table, 5, 0.9)
            module.publish(mine, layers_read, experts_read, slots_read, failed, nbytes)
            outcomes.append((routed, mine))
        (want_routed, want), (got_routed, got) = outcomes
        assert np.array_equal(want_routed, got_routed), trial
        assert np.array_equal(want.priority.view(np.int64), got.priority.view(np.int64)), trial
        for field in ("table", "owner", "state", "held", "retry_after"):
            assert np.array_equal(getattr(want, field), getattr(got, field)), (trial, field)
        for name in want.counts:
            assert np.array_equal(want.counts[name].view(np.int64), got.counts[name].view(np.int64)), (trial, name)
