"""``kq bench --sets compile``: what a new row count costs the JAX kernels, with and without row buckets.

A server meets prompts of every length; each new row count used to compile a
kernel. Two measurements, with the kernels' row buckets (the default) beside
exact-size launches (``KernelConfig(row_buckets=False)``):

* **first calls**: ``count`` row counts drawn log-uniformly from
  ``[1, max_rows]`` (seeded), each op called once per count, eagerly as a user
  calls it (bucketed and exact), and inside a fresh user ``jax.jit`` (bucketed): the wall time of that first
  call, the kernels compiled (new entries in the launch's jit cache) and the
  XLA compiles (JAX's compile events). Every output is checked bit for bit
  against the jnp reference.
* **just above a bucket**: the time per call at a row count one past a bucket
  boundary (where padding is largest), bucketed against the exact-size kernel,
  from ``kq.bench.kernels``'s chained timer (calls inside one jit, the harness's own
  cost subtracted).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import numpy as np

from kq.bench import common
from kq.bench.common import run_header
from kq.terminal import progress_bar, render_table

OPS = ("route_shed", "topk_route_shed")
TOP_K, NUM_EXPERTS = 8, 128
# Row counts one past a bucket boundary (padded to 1.5x or 1.33x).
BOUNDARY_ROWS = (9, 65, 1025, 4097, 65537)


@dataclass
class FirstCall:
    op: str
    mode: str  # "eager" or "jit"
    buckets: bool
    rows: int
    seconds: float
    kernels_compiled: int | None  # new executables of the launch (eager calls; None inside a user's jit)
    xla_compiles: int
    bits_exact: bool


@dataclass
class BoundaryTime:
    op: str
    rows: int
    launch_rows: int
    bucketed_us: float
    exact_us: float

    @property
    def ratio(self) -> float:
        return self.bucketed_us / self.exact_us if self.exact_us > 0 else float("nan")


def row_counts(count: int, max_rows: int, seed: int = 0) -> list[int]:
    """``count`` distinct row counts, log-uniform in ``[1, max_rows]``, in a seeded order."""
    rng = np.random.default_rng(seed)
    counts: list[int] = []
    while len(counts) < min(count, max_rows):
        rows = int(np.exp(rng.uniform(0.0, np.log(max_rows + 1))))
        if 1 <= rows <= max_rows and rows not in counts:
            counts.append(rows)
    return counts


class _CompileCounter:
    """Counts JAX's backend compile events while registered (one listener for the process)."""

    _instance = None

    def __init__(self):
        import jax

        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    @classmethod
    def get(cls) -> _CompileCounter:
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def _on_event(self, event: str, duration: float, **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            self.count += 1


def _op_inputs(op: str, rows: int, rng):
    from kq_core.inputs import router_inputs, slot_table

    if op == "route_shed":
        return router_inputs(rng, rows, TOP_K, NUM_EXPERTS, resident_fraction=0.5)
    table = slot_table(rng, NUM_EXPERTS, 0.5)
    logits = rng.standard_normal((rows, NUM_EXPERTS)).astype(np.float32)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    return ((probs / probs.sum(-1, keepdims=True)).astype(np.float32), table)


def _op_fn(op: str, impl: str, buckets: bool):
    import kq_jax
    from kq_jax.pallas_config import KernelConfig

    config = None if buckets else KernelConfig(row_buckets=False)
    if op == "route_shed":
        return lambda i, s, t: kq_jax.route_shed(i, s, t, impl=impl, config=config)
    return lambda p, t: kq_jax.topk_route_shed(p, t, top_k=TOP_K, impl=impl, config=config)


def _reference_fn(op: str):
    import kq_jax

    if op == "route_shed":
        return kq_jax.route_shed_reference
    return lambda p, t: kq_jax.topk_route_shed_reference(p, t, top_k=TOP_K)


def _launch_cache_size(op: str) -> int:
    from kq_jax import route_shed_pallas, topk_route_shed_pallas

    # The jitted row-wise op an eager call dispatches to (kq_jax.partition.rowwise), one executable per shape.
    rows_op = route_shed_pallas._route_shed_rows if op == "route_shed" else topk_route_shed_pallas._topk_rows
    return rows_op._cache_size()


def first_call(op: str, rows: int, *, impl: str, buckets: bool, mode: str, rng) -> FirstCall:
    """The first call at ``rows`` rows (see the module docstring)."""
    import jax

    from kq_core.compare import first_mismatch

    counter = _CompileCounter.get()
    fn, reference = _op_fn(op, impl, buckets), _reference_fn(op)
    args = tuple(jax.device_put(a) for a in _op_inputs(op, rows, rng))
    call = fn if mode == "eager" else jax.jit(fn)
    kernels, compiles = _launch_cache_size(op), counter.count
    start = time.perf_counter()
    out = jax.block_until_ready(call(*args))
    seconds = time.perf_counter() - start
    # A launch traced inside the user's jit compiles into that program, not into the launch's cache.
    compiled = _launch_cache_size(op) - kernels if mode == "eager" else None
    expected = jax.tree.map(np.asarray, reference(*args))
    return FirstCall(op, mode, buckets, rows, seconds, compiled, counter.count - compiles,
                     first_mismatch(expected, out) is None)


def _chained_us(fn, args, float_arg: int, repeats: int, calls: int = 16) -> float:
    """Microseconds per call of ``fn`` over ``calls`` calls chained in one jit (each feeds the next)."""
    import jax
    import jax.numpy as jnp

    from kq.bench.kernels import median_us

    def chain(*args):
        args = list(args)
        for _ in range(calls):
            tie = sum(leaf.reshape(-1)[0].astype(jnp.float32) for leaf in jax.tree.leaves(fn(*args)))
            args[float_arg] = args[float_arg] + (tie * 0.0).astype(args[float_arg].dtype)
        return args[float_arg]

    jitted, args = jax.jit(chain), tuple(jax.device_put(a) for a in args)
    return median_us(lambda: jax.block_until_ready(jitted(*args)), repeats) / calls


def boundary_times(op: str, rows_list=BOUNDARY_ROWS, *, impl: str, repeats: int = 7,
                   seed: int = 0) -> list[BoundaryTime]:
    """Time per call one row past a bucket boundary: bucketed against exact size."""
    from kq_jax.pallas_config import row_bucket

    rng = np.random.default_rng(seed)
    float_arg = 1 if op == "route_shed" else 0
    results = []
    for rows in rows_list:
        inputs = _op_inputs(op, rows, rng)
        times = [_chained_us(_op_fn(op, impl, buckets), inputs, float_arg, repeats) for buckets in (True, False)]
        results.append(BoundaryTime(op, rows, row_bucket(rows), *times))
    return results


# Without a GPU the kernels run in Pallas' interpreter, which is far slower: fewer and smaller row counts.
INTERPRETER_SIZES = dict(count=6, max_rows=256, boundary_rows=(9, 65))


def run(*, count: int | None = None, max_rows: int | None = None, boundary_rows=None, budget_s: float | None = None,
        progress: bool = True, log=None) -> dict:
    """Both measurements for both ops: 50 row counts up to 2^20 with the compiled kernel on a GPU,
    :data:`INTERPRETER_SIZES` with Pallas' interpreter elsewhere.

    ``budget_s`` stops starting new row counts once that many seconds have
    passed (every variant then has the same counts); ``log`` gets one line per call.
    """
    import jax

    on_gpu = jax.default_backend() == "gpu"
    impl = "pallas" if on_gpu else "pallas_interpret"
    sizes = dict(count=50, max_rows=2**20, boundary_rows=BOUNDARY_ROWS) if on_gpu else INTERPRETER_SIZES
    count = sizes["count"] if count is None else count
    max_rows = sizes["max_rows"] if max_rows is None else max_rows
    boundary_rows = sizes["boundary_rows"] if boundary_rows is None else boundary_rows
    started = time.monotonic()
    boundary = [t for op in OPS for t in boundary_times(op, boundary_rows, impl=impl)]
    counts = row_counts(count, max_rows)
    # Exact-size launches are timed eagerly only: inside a user's jit every new row count compiles the
    # program anyway, and the bucketed jit row shows what the kernel's share of that is.
    plan = [(op, mode, buckets) for op in OPS for mode, buckets in (("eager", True), ("eager", False), ("jit", True))]
    calls: list[FirstCall] = []
    done: list[int] = []
    rng = np.random.default_rng(0)
    with progress_bar(len(plan) * len(counts), enabled=progress, description="first calls") as advance:
        for rows in counts:
            if budget_s is not None and time.monotonic() - started > budget_s:
                break
            for op, mode, buckets in plan:
                calls.append(first_call(op, rows, impl=impl, buckets=buckets, mode=mode, rng=rng))
                advance(f"{op} {mode} {rows} rows")
                if log:
                    log(json.dumps(asdict(calls[-1])))
            done.append(rows)
    return {**run_header(), "impl": impl, "row_counts": done, "row_counts_planned": counts,
            "first_calls": [asdict(c) for c in calls],
            "boundary": [dict(asdict(t), ratio=t.ratio) for t in boundary]}


def summary(result: dict) -> list[dict]:
    """Per (op, mode, buckets): kernels and XLA compiles over all counts, total and median first-call time."""
    rows = []
    groups: dict[tuple, list[dict]] = {}
    for call in result["first_calls"]:
        groups.setdefault((call["op"], call["mode"], call["buckets"]), []).append(call)
    for (op, mode, buckets), calls in groups.items():
        seconds = [c["seconds"] for c in calls]
        rows.append(dict(op=op, mode=mode, buckets=buckets, calls=len(calls),
                         kernels=None if calls[0]["kernels_compiled"] is None
                         else sum(c["kernels_compiled"] for c in calls),
                         xla_compiles=sum(c["xla_compiles"] for c in calls), total_s=sum(seconds),
                         median_s=float(np.median(seconds)), bits_exact=all(c["bits_exact"] for c in calls)))
    return rows


def format_table(result: dict) -> str:
    first = render_table(
        ["op", "mode", "row buckets", "row counts", "kernels compiled", "XLA compiles", "first calls s",
         "median s", "bits"],
        [[r["op"], r["mode"], "on" if r["buckets"] else "off", r["calls"],
          "-" if r["kernels"] is None else r["kernels"], r["xla_compiles"],
          f"{r['total_s']:.2f}", f"{r['median_s']:.3f}", "exact" if r["bits_exact"] else "DIFFER"]
         for r in summary(result)],
        title=f"first call per new row count ({result['impl']}, {result['device']})")
    boundary = render_table(
        ["op", "rows", "launch rows", "bucketed us", "exact us", "ratio"],
        [[b["op"], b["rows"], b["launch_rows"], f"{b['bucketed_us']:.1f}", f"{b['exact_us']:.1f}",
          f"{b['ratio']:.2f}"] for b in result["boundary"]],
        title="time per call one row past a bucket boundary")
    return first + "\n" + boundary


def write_json(result: dict, path: str) -> None:
    common.write_json(path, dict(result, summary=summary(result)))
