"""``kq bench --sets host``: the residency manager's token boundary, timed at real model sizes.

For each ``(L, E, S, K, rows)`` a routing trace is made token by token (Zipf-like expert popularity
per layer, every row's top-K drawn from it) and decoded through one :class:`ResidencyManager` per
bookkeeping implementation (NumPy, and Numba where it is installed), side by side: each token's
reports go to every manager, in an order that alternates from token to token, and the managers'
tables are compared after every token (they make the same decisions). Loaders are no-ops returning
at once, inline, so only the step is timed: credit, publish, evict, place, the reads' dispatch,
snapshot. Each token's reports come as one :class:`LayerReport` of ``[L, T, K]`` arrays, as a decode
graph returns them in one transfer; the misses are ``route_shed``'s against the tables the managers
handed out, computed before the clock starts. After ``warmup`` tokens the time of every ``step`` is
taken; the median and 90th percentile per token are reported, and each implementation's median
over the NumPy one's.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np

from kq.bench import common
from kq.terminal import progress_bar, render_table

# (layers L, experts E, slots per layer S, top-k K, rows per token)
HOST_SHAPES = ((8, 64, 16, 8, 1), (48, 128, 32, 8, 1), (61, 256, 64, 8, 1), (48, 128, 32, 8, 8),
               (61, 256, 64, 8, 8))


@dataclass
class HostResult:
    impl: str
    layers: int
    experts: int
    slots: int
    top_k: int
    rows: int
    tokens: int
    median_ms: float
    p90_ms: float
    reads_per_token: float
    hit_rate: float
    vs_numpy: float  # this median over the NumPy implementation's, same tokens


def implementations() -> tuple[str, ...]:
    """The bookkeeping implementations this machine can run."""
    from kq_host.residency import ResidencyManager

    available = ["numpy"]
    try:
        ResidencyManager(1, 1, 1, loader=lambda *a: 0, queue_depth=0, impl="numba")
        available.append("numba")
    except ImportError:
        pass
    return tuple(available)


def time_host(layers: int, experts: int, slots: int, top_k: int, rows: int, *, tokens: int = 300,
              warmup: int = 50, seed: int = 0, impls: tuple[str, ...] | None = None) -> list[HostResult]:
    """One :class:`HostResult` per implementation: median and p90 ms per ``ResidencyManager.step``
    over ``tokens`` tokens after ``warmup``, the implementations taking turns on one trace."""
    from kq_core.inputs import expert_popularity
    from kq_core.oracle import route_shed_oracle
    from kq_host.residency import LayerReport, ResidencyManager

    impls = implementations() if impls is None else impls
    rng = np.random.default_rng(seed)
    popularity = [expert_popularity(rng, experts) for _ in range(layers)]
    managers = [ResidencyManager(layers, experts, slots, loader=lambda layer, expert, slot: 0, queue_depth=0,
                                 impl=impl) for impl in impls]
    tables, times = managers[0].snapshot(), [[] for _ in impls]
    for token in range(warmup + tokens):
        per_layer = []
        for layer in range(layers):
            ids = np.stack([rng.choice(experts, top_k, replace=False, p=popularity[layer])
                            for _ in range(rows)]).astype(np.int32)
            scores = rng.dirichlet(np.ones(top_k), rows).astype(np.float32)
            out = route_shed_oracle(ids, scores, tables[layer])
            per_layer.append(LayerReport(ids, scores, out.miss_ids, out.miss_scores))
        # One report of [L, T, K] arrays, as a graph hands a token's reports back in one transfer.
        reports = LayerReport.stacked(per_layer)
        if token == warmup:
            before = [manager.stats()[1] for manager in managers]
        turn = list(range(len(managers)))
        for i in turn[token % len(turn):] + turn[:token % len(turn)]:
            start = time.perf_counter()
            next_tables = managers[i].step(reports)
            if token >= warmup:
                times[i].append((time.perf_counter() - start) * 1e3)
            if i == 0:
                tables = next_tables
        for manager in managers[1:]:
            if not np.array_equal(manager.snapshot(), tables):
                raise AssertionError(f"kq bench host: impl={manager.impl!r} decided otherwise than "
                                     f"impl={managers[0].impl!r} at token {token}")
    results = []
    for impl, manager, taken, earlier in zip(impls, managers, times, before):
        since = manager.stats()[1].since(earlier)
        taken.sort()
        results.append(HostResult(impl, layers, experts, slots, top_k, rows, tokens, statistics.median(taken),
                                  taken[int(0.9 * (len(taken) - 1))], since.reads_landed / tokens, since.hit_rate,
                                  statistics.median(taken) / statistics.median(times[0])))
    return results


def run(shapes=None, *, tokens: int = 300, progress: bool = True) -> list[HostResult]:
    """:class:`HostResult` s per ``(L, E, S, K, rows)`` of ``shapes`` (default :data:`HOST_SHAPES`), one per
    implementation (:func:`implementations`)."""
    shapes = HOST_SHAPES if shapes is None else shapes
    results = []
    with progress_bar(len(shapes), enabled=progress, description="kq bench host") as advance:
        for shape in shapes:
            results.extend(time_host(*shape, tokens=tokens))
            advance("x".join(map(str, shape)))
    return results


def format_table(results: list[HostResult]) -> str:
    header = ("L", "E", "S", "K", "rows", "impl", "ms/token (median)", "p90", "vs numpy", "reads/token", "hit rate")
    rows = [(r.layers, r.experts, r.slots, r.top_k, r.rows, r.impl, f"{r.median_ms:.3f}", f"{r.p90_ms:.3f}",
             f"{r.vs_numpy:.2f}x", f"{r.reads_per_token:.1f}", f"{r.hit_rate:.3f}") for r in results]
    return render_table(header, rows, left=(5,))


def write_json(results: list[HostResult], path: str) -> None:
    common.write_json(path, common.run_header(None, method=__doc__, results=[asdict(r) for r in results]))
