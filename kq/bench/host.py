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

The boundary (:func:`time_boundary`), at the largest model of the set (DeepSeek-V3's (61, 256, 64, 8) by
default) and each of its row counts, is timed for each way a loader hands its read over: ``count`` (no
arena; the loader returns its byte count), ``writes`` (the loader writes the expert into a host arena's
slot itself and returns None) and ``payload`` (it returns the expert's arrays, each in memory of its own,
which the manager writes into the arena as it publishes them). Every mode replays one trace, made
first; in each round every mode decodes it through a fresh manager (the default implementation,
``impl="auto"``), the modes taking turns in an order that rotates from round to round, so a load on
the machine falls on all of them alike. A round's figure is the median over the second half of its
tokens of each ``step``'s wall time and of its thread's CPU time (the loads run inline, on the step's
thread); min, median and max over the rounds are reported.
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
# How a loader hands its read over, in the boundary's timing (the module docstring).
BOUNDARY_MODES = ("count", "writes", "payload")
BOUNDARY_TOKENS, BOUNDARY_ROUNDS = 120, 5
# One expert of the boundary's arena: small, so that the manager's work per read is what is timed.
_BOUNDARY_EXPERT = {"gate_proj": ((4, 8), np.float32), "down_proj": ((8, 4), np.float32)}


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


@dataclass
class BoundaryResult:
    """One mode of the boundary at one shape: per round, the median ms of a ``step`` (wall, and the thread's
    CPU time); min, median and max over the rounds."""

    mode: str
    impl: str
    layers: int
    experts: int
    slots: int
    top_k: int
    rows: int
    tokens: int
    rounds: int
    wall_ms: dict
    cpu_ms: dict
    reads_per_token: float


class HostRun(list):
    """The :class:`HostResult` s of :func:`run` (a list of them), and the boundary's
    :class:`BoundaryResult` s in ``boundary``."""

    def __init__(self, results=(), boundary=()):
        super().__init__(results)
        self.boundary = list(boundary)


def _trace(layers: int, experts: int, slots: int, top_k: int, rows: int, tokens: int, seed: int):
    """``tokens`` tokens' stacked reports and the tables each step returns, decoded once (the misses are
    ``route_shed``'s against the tables the manager handed out; every read lands at once)."""
    from kq_core.inputs import expert_popularity
    from kq_core.oracle import route_shed_oracle
    from kq_host.residency import LayerReport, ResidencyManager

    rng = np.random.default_rng(seed)
    popularity = [expert_popularity(rng, experts) for _ in range(layers)]
    manager = ResidencyManager(layers, experts, slots, loader=lambda layer, expert, slot: 0, queue_depth=0,
                               impl="numpy")
    tables, reports, expected = manager.snapshot(), [], []
    for _ in range(tokens):
        per_layer = []
        for layer in range(layers):
            ids = np.stack([rng.choice(experts, top_k, replace=False, p=popularity[layer])
                            for _ in range(rows)]).astype(np.int32)
            scores = rng.dirichlet(np.ones(top_k), rows).astype(np.float32)
            out = route_shed_oracle(ids, scores, tables[layer])
            per_layer.append(LayerReport(ids, scores, out.miss_ids, out.miss_scores))
        reports.append(LayerReport.stacked(per_layer))
        tables = manager.step(reports[-1])
        expected.append(tables)
    return reports, expected


def _boundary_manager(mode: str, layers: int, experts: int, slots: int):
    """A manager (``queue_depth=0``, ``impl="auto"``) whose loader hands its reads over as ``mode`` says."""
    from kq_host.arena import NumpyArena
    from kq_host.residency import ResidencyManager

    if mode == "count":
        return ResidencyManager(layers, experts, slots, loader=lambda layer, expert, slot: 256, queue_depth=0)
    arena = NumpyArena(layers, slots, _BOUNDARY_EXPERT)
    expert_bytes = sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in _BOUNDARY_EXPERT.values())
    if mode == "writes":
        block = {name: np.zeros((layers, experts, *shape), dtype) for name, (shape, dtype) in _BOUNDARY_EXPERT.items()}
        targets = [(arena.arrays[name], block[name]) for name in _BOUNDARY_EXPERT]

        def loader(layer, expert, slot):
            for target, source in targets:
                target[layer, slot] = source[layer, expert]
    elif mode == "payload":
        # Every expert's arrays made once, each in memory of its own (as a store's reads land by default).
        payloads = [[{name: np.zeros(shape, dtype) for name, (shape, dtype) in _BOUNDARY_EXPERT.items()}
                     for _ in range(experts)] for _ in range(layers)]

        def loader(layer, expert, slot):
            return payloads[layer][expert]
    else:
        raise ValueError(f"time_boundary: modes must be among {BOUNDARY_MODES}, got {mode!r}")
    return ResidencyManager(layers, experts, slots, loader=loader, arena=arena, queue_depth=0,
                            bytes_per_expert=expert_bytes)


def _spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def time_boundary(layers: int, experts: int, slots: int, top_k: int, rows: int, *, modes=BOUNDARY_MODES,
                  tokens: int | None = None, rounds: int | None = None, seed: int = 0) -> list[BoundaryResult]:
    """One :class:`BoundaryResult` per mode of ``modes``: ``ResidencyManager.step`` over one trace of ``tokens``
    tokens (default :data:`BOUNDARY_TOKENS`), ``rounds`` times (default :data:`BOUNDARY_ROUNDS`), the modes in
    turn (the module docstring).

    Raises:
        ValueError: a mode is not one of :data:`BOUNDARY_MODES`.
    """
    tokens = BOUNDARY_TOKENS if tokens is None else tokens
    rounds = BOUNDARY_ROUNDS if rounds is None else rounds
    if not modes or any(mode not in BOUNDARY_MODES for mode in modes):
        raise ValueError(f"time_boundary: modes must be among {BOUNDARY_MODES}, got {modes!r}")
    reports, expected = _trace(layers, experts, slots, top_k, rows, tokens, seed)
    wall, cpu = {mode: [] for mode in modes}, {mode: [] for mode in modes}
    reads, impls = {}, {}
    for round_index in range(rounds):
        turn = list(modes)
        for mode in turn[round_index % len(turn):] + turn[:round_index % len(turn)]:
            manager = _boundary_manager(mode, layers, experts, slots)
            walls, cpus = [], []
            for token, report in enumerate(reports):
                cpu_start, start = time.thread_time(), time.perf_counter()
                tables = manager.step(report)
                stop, cpu_stop = time.perf_counter(), time.thread_time()
                walls.append((stop - start) * 1e3)
                cpus.append((cpu_stop - cpu_start) * 1e3)
                if not np.array_equal(tables, expected[token]):
                    raise AssertionError(f"kq bench host: mode {mode!r} decided otherwise than the trace at "
                                         f"token {token}")
            wall[mode].append(statistics.median(walls[tokens // 2:]))
            cpu[mode].append(statistics.median(cpus[tokens // 2:]))
            total = manager.stats()[1]
            if total.reads_failed:
                raise AssertionError(f"kq bench host: mode {mode!r}: {total.reads_failed} reads failed")
            reads[mode], impls[mode] = total.reads_landed / tokens, manager.impl
            manager.close()
    return [BoundaryResult(mode, impls[mode], layers, experts, slots, top_k, rows, tokens, rounds,
                           _spread(wall[mode]), _spread(cpu[mode]), reads[mode]) for mode in modes]


def boundary_shapes(shapes) -> list[tuple[int, int, int, int, int]]:
    """The shapes of ``shapes`` at its largest model (by ``(L, E, S, K)``), one per row count."""
    largest = max(shape[:4] for shape in shapes)
    return sorted({tuple(shape) for shape in shapes if tuple(shape[:4]) == largest}, key=lambda shape: shape[4])


def run(shapes=None, *, tokens: int = 300, progress: bool = True, boundary: bool = True) -> HostRun:
    """:class:`HostResult` s per ``(L, E, S, K, rows)`` of ``shapes`` (default :data:`HOST_SHAPES`), one per
    implementation (:func:`implementations`); with ``boundary``, the boundary's :class:`BoundaryResult` s at
    :func:`boundary_shapes` in ``.boundary``."""
    shapes = HOST_SHAPES if shapes is None else shapes
    at = boundary_shapes(shapes) if boundary and shapes else []
    results = HostRun()
    with progress_bar(len(shapes) + len(at), enabled=progress, description="kq bench host") as advance:
        for shape in shapes:
            results.extend(time_host(*shape, tokens=tokens))
            advance("x".join(map(str, shape)))
        for shape in at:
            results.boundary.extend(time_boundary(*shape))
            advance("boundary " + "x".join(map(str, shape)))
    return results


def format_table(results: list[HostResult]) -> str:
    header = ("L", "E", "S", "K", "rows", "impl", "ms/token (median)", "p90", "vs numpy", "reads/token", "hit rate")
    rows = [(r.layers, r.experts, r.slots, r.top_k, r.rows, r.impl, f"{r.median_ms:.3f}", f"{r.p90_ms:.3f}",
             f"{r.vs_numpy:.2f}x", f"{r.reads_per_token:.1f}", f"{r.hit_rate:.3f}") for r in results]
    table = render_table(header, rows, left=(5,))
    boundary = getattr(results, "boundary", [])
    if not boundary:
        return table
    header = ("L", "E", "S", "K", "rows", "mode", "impl", "wall ms (min / median / max)", "CPU ms (median)",
              "reads/token")
    rows = [(b.layers, b.experts, b.slots, b.top_k, b.rows, b.mode, b.impl,
             " / ".join(f"{b.wall_ms[key]:.3f}" for key in ("min", "median", "max")), f"{b.cpu_ms['median']:.3f}",
             f"{b.reads_per_token:.1f}") for b in boundary]
    return table + "\n\n" + render_table(header, rows, left=(5, 6),
                                           title=f"the boundary, {boundary[0].rounds} rounds of "
                                                 f"{boundary[0].tokens} tokens")


def write_json(results: list[HostResult], path: str) -> None:
    try:
        import numba
    except ImportError:
        numba = None
    common.write_json(path, common.run_header(None, method=__doc__, numba=getattr(numba, "__version__", None),
                                              results=[asdict(r) for r in results],
                                              boundary=[asdict(b) for b in getattr(results, "boundary", [])]))
