"""``kq bench --sets host``: the residency manager's token boundary, timed at real model sizes.

For each ``(L, E, S, K, rows)`` a routing trace is made first (Zipf-like expert popularity per
layer, every row's top-K drawn from it), then decoded through a :class:`ResidencyManager` whose
loader is a no-op returning at once, inline (so only the bookkeeping is timed: credit, publish,
evict, schedule, snapshot). Each token's reports come as one :class:`LayerReport` of ``[L, T, K]``
arrays, as a decode graph returns them in one transfer. The misses each token reports are ``route_shed``'s against the
tables the manager handed out, computed before the clock starts. After ``warmup`` tokens the
time of every ``step`` is taken; the median and 90th percentile per token are reported.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np

from kq.terminal import progress_bar, render_table

# (layers L, experts E, slots per layer S, top-k K, rows per token)
HOST_SHAPES = ((8, 64, 16, 8, 1), (48, 128, 32, 8, 1), (61, 256, 64, 8, 1), (48, 128, 32, 8, 8),
               (61, 256, 64, 8, 8))


@dataclass
class HostResult:
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


def time_host(layers: int, experts: int, slots: int, top_k: int, rows: int, *, tokens: int = 300,
              warmup: int = 50, seed: int = 0, manager_class=None) -> HostResult:
    """Median and p90 ms per ``ResidencyManager.step`` over ``tokens`` tokens after ``warmup``."""
    from kq_core.inputs import expert_popularity
    from kq_core.oracle import route_shed_oracle
    from kq_host.residency import LayerReport, ResidencyManager

    manager_class = manager_class or ResidencyManager
    rng = np.random.default_rng(seed)
    popularity = [expert_popularity(rng, experts) for _ in range(layers)]
    manager = manager_class(layers, experts, slots, loader=lambda layer, expert, slot: 0, queue_depth=0)
    tables, times = manager.snapshot(), []
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
            _, before = manager.stats()
        start = time.perf_counter()
        tables = manager.step(reports)
        if token >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    _, after = manager.stats()
    since = after.since(before)
    times.sort()
    return HostResult(layers, experts, slots, top_k, rows, tokens, statistics.median(times),
                      times[int(0.9 * (len(times) - 1))], since.reads_landed / tokens, since.hit_rate)


def run(shapes=None, *, tokens: int = 300, progress: bool = True) -> list[HostResult]:
    """One :class:`HostResult` per ``(L, E, S, K, rows)`` of ``shapes`` (default :data:`HOST_SHAPES`)."""
    shapes = HOST_SHAPES if shapes is None else shapes
    results = []
    with progress_bar(len(shapes), enabled=progress, description="kq bench host") as advance:
        for shape in shapes:
            results.append(time_host(*shape, tokens=tokens))
            advance("x".join(map(str, shape)))
    return results


def format_table(results: list[HostResult]) -> str:
    header = ("L", "E", "S", "K", "rows", "ms/token (median)", "p90", "reads/token", "hit rate")
    rows = [(r.layers, r.experts, r.slots, r.top_k, r.rows, f"{r.median_ms:.3f}", f"{r.p90_ms:.3f}",
             f"{r.reads_per_token:.1f}", f"{r.hit_rate:.3f}") for r in results]
    return render_table(header, rows, left=())


def write_json(results: list[HostResult], path: str) -> None:
    payload = {"date": time.strftime("%Y-%m-%d"), "machine": platform.platform(), "processor": platform.processor(),
               "python": platform.python_version(), "numpy": np.__version__, "method": __doc__,
               "results": [asdict(r) for r in results]}
    with open(path, "w") as handle:
        json.dump(payload, handle, indent=1)
