"""``kq bench``: time every route_shed backend on this machine against its floors and peers.

Methods (they are printed with the results):

* JAX (``jax-*``): ``N`` calls unrolled inside one jitted function, each call's
  scores made to depend on every output of the previous call (``s + 0 * sum(outputs)``,
  which XLA does not fold for floats), so the calls run in sequence and none, nor
  any of their outputs, is hoisted or removed; device time per call = (time of the
  N-call function - time of the same function with a null op of the same output
  shapes) / N, median over repeats. Unrolling avoids a ``fori_loop``'s own
  per-iteration cost; subtracting the null chain removes dispatch and the tie-in.
  ``eager`` is one jitted call from Python, synchronised, as an eager user sees it.
* JAX on a GPU, also ``kernel``: the GPU time of one call's kernels, summed, from
  JAX's profiler (CUPTI): one jitted call run ``KERNEL_CALLS`` times back to back in
  one trace, the kernel durations of the device's stream lines added up and divided
  by the number of calls. No harness at all, no launch gaps: the time the op keeps
  the GPU busy. The bandwidth ratio (``x bw``) is taken on it where it exists.
* MLX (``mlx-*``): one call evaluated on its own (``eager``), and, at decode
  sizes (T * K <= 4096), a chain of 64 calls built then evaluated once, as a
  decode graph over 64 layers would be (``per_call`` = chain time / 64).
* NumPy and the C++-executed Metal source: one call, wall clock.

Every kq backend's outputs on the timed inputs are also compared once with
the oracle, bit for bit (column ``bits``), so a benchmark run is a check at
sizes the tests do not reach (2^20 rows).

Floors, measured in the same run: the launch floor (the same harness around
a trivial op on a one-row input: a one-element ``pallas_call`` on a GPU, a
one-element ``mx`` op for MLX; none for JAX on the CPU, where nothing is
launched; on a GPU also that op's kernel time, ``floor kernel``) and the
bandwidth floor (bytes the op must move, every input read once and every
output written once, over the copy bandwidth measured on the device).
"""

from __future__ import annotations

import functools
import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np

from kq.bench import common
from kq.bench.common import jax_device_name, median_seconds
from kq.terminal import progress_bar, render_table
from kq_core.contract import MAX_TOP_K
from kq_core.inputs import router_inputs

SHAPE_SETS = {  # (rows T, top-k K, experts E)
    "tiny": [(4, 8, 64)],
    "decode": [(1, 8, 256), (8, 8, 256), (64, 8, 256), (1, 64, 1024)],
    "prefill": [(4096, 8, 256), (65536, 8, 256), (65536, 2, 64), (4096, 64, 1024), (1048576, 8, 256)],
}
MLX_CHAIN = 64
KERNEL_CALLS = 20


@dataclass
class Result:
    backend: str
    device: str
    shape_set: str
    rows: int
    top_k: int
    experts: int
    per_call_us: float  # device time per call (JAX), per call in a 64-call graph (MLX), wall clock otherwise
    eager_us: float  # one call from Python, synchronised
    launch_floor_us: float | None = None
    bandwidth_floor_us: float | None = None
    bits_exact: bool | None = None  # one call's outputs against the oracle; None for the inexact baseline
    kernel_us: float | None = None  # GPU kernel time of one call, from the profiler (JAX on a GPU only)
    launch_floor_kernel_us: float | None = None  # the trivial op's kernel time, from the profiler


MAX_SHAPE_BYTES = 4 * 2**30  # a benchmarked call's inputs and outputs, held several times over (so ids fit int32)


def parse_shape(text: str) -> tuple[int, int, int]:
    """``"TxKxE"`` (rows, top-k, experts; the x in either case) as three positive integers, K <= MAX_TOP_K, at
    most ``MAX_SHAPE_BYTES`` moved a call (``route_shed``'s inputs and outputs, or ``topk_route_shed``'s
    ``[T, E]`` probabilities)."""
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(part.isdigit() and int(part) > 0 for part in parts):
        raise ValueError(f"a shape is ROWSxKxE with three positive integers, e.g. 1x8x128; got {text!r}")
    rows, top_k, experts = (int(part) for part in parts)
    if top_k > MAX_TOP_K:
        raise ValueError(f"route_shed takes K <= {MAX_TOP_K}; got K = {top_k}")
    moved = max(op_bytes(rows, top_k, experts), rows * experts * 4)  # route_shed's, or topk_route_shed's probs
    if moved > MAX_SHAPE_BYTES:
        raise ValueError(f"{text!r} moves {moved / 2**30:.0f} GiB a call; a benchmarked shape moves at most "
                         f"{MAX_SHAPE_BYTES // 2**30} GiB")
    return rows, top_k, experts


def op_bytes(rows: int, top_k: int, experts: int) -> int:
    """Bytes route_shed must move: ids, scores (f32) and table read; four [T, K] 4-byte outputs written."""
    return rows * top_k * 4 * 2 + experts * 4 + rows * top_k * 4 * 4


def median_us(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``repeats`` calls of ``fn`` after a warm-up call, in microseconds."""
    return median_seconds(fn, repeats) * 1e6


def _unroll_count(rows: int, top_k: int) -> int:
    return int(max(2, min(32, 2**21 // max(1, rows * top_k))))


# ---- JAX --------------------------------------------------------------------------------------


def _null_route_shed(indices, scores, table):
    """Outputs of route_shed's shapes and dtypes at the cost of casts: the harness's own share."""
    import jax.numpy as jnp

    del table
    return indices, scores.astype(jnp.float32), indices, scores.astype(jnp.float32)


def _jax_timer(fn, inputs, repeats):
    import jax
    import jax.numpy as jnp

    n = _unroll_count(inputs[0].shape[0], inputs[0].shape[1])
    args = tuple(jax.device_put(a) for a in inputs)

    def chain(op):
        def run(indices, scores, table):
            for _ in range(n):
                outs = op(indices, scores, table)
                # Every output feeds the next call's scores (+ 0 * ..., which XLA does not fold
                # for floats), so no call, and no output of any call, can be removed or hoisted.
                tied = sum(jnp.asarray(o).astype(jnp.float32) for o in outs)
                scores = scores + (tied * 0.0).astype(scores.dtype)
            return scores

        return jax.jit(run)

    full, empty, single = chain(fn), chain(_null_route_shed), jax.jit(fn)
    per_call = (median_us(lambda: jax.block_until_ready(full(*args)), repeats)
                - median_us(lambda: jax.block_until_ready(empty(*args)), repeats)) / n
    eager = median_us(lambda: jax.block_until_ready(single(*args)), repeats)
    return max(per_call, 0.0), eager


def jax_kernel_us(fn, inputs) -> float | None:
    """One call's GPU kernel time (us) from JAX's profiler; None off the GPU or when the trace has none."""
    import jax

    if jax.default_backend() != "gpu":
        return None
    kernels = trace_kernels(jax.jit(fn), tuple(jax.device_put(a) for a in inputs), KERNEL_CALLS)
    return sum(k["dur"] for k in kernels) / KERNEL_CALLS if kernels else None


def trace_kernels(jitted, args, calls: int) -> list[dict]:
    """The GPU kernels of ``calls`` back-to-back calls of a jitted function, from JAX's profiler.

    The function is run once untraced first (compile, warm up). Returns the
    perfetto ``X`` events of the GPU's stream lines (``name``, ``ts`` and ``dur``
    in us), in trace order; empty when the trace has none.
    """
    import gzip
    import tempfile
    from pathlib import Path

    import jax

    jax.block_until_ready(jitted(*args))
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(calls):
                outputs = jitted(*args)
            jax.block_until_ready(outputs)
        traces = sorted(Path(trace_dir).rglob("perfetto_trace.json.gz"))
        if not traces:
            return []
        with gzip.open(traces[-1]) as handle:
            return kernel_events_in_trace(json.load(handle)["traceEvents"])


def kernel_events_in_trace(events: list[dict]) -> list[dict]:
    """The events on a GPU's stream lines of a perfetto trace (its kernels and copies).

    The GPU's other lines (XLA modules and ops) repeat the same time as annotations and are left out.
    """
    gpus = {e["pid"] for e in events
            if e.get("ph") == "M" and e.get("name") == "process_name" and "GPU" in e["args"].get("name", "")}
    streams = {(e["pid"], e["tid"]) for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name" and e.get("pid") in gpus
               and "stream" in e["args"].get("name", "").lower()}
    spans = [e for e in events if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in streams]
    if gpus and not spans:
        lines = sorted({e["args"].get("name") for e in events if e.get("name") == "thread_name" and e["pid"] in gpus})
        sys.stderr.write(f"kq bench: no kernel events on the GPU's stream lines; its lines: {lines}\n")
    return spans


def _jax_floor_fn():
    """A one-element pallas_call on a GPU; None on the CPU, where nothing is launched."""
    import jax

    if jax.default_backend() != "gpu":
        return None
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1

    def floor(indices, scores, table):
        del indices, table
        # Reads scores[0, 0] in place (one launch, nothing else: its kernel time is one trivial
        # kernel's). Fed from the scores, which change every call in the chain: an input that did
        # not would let XLA merge the chain's identical launches into one (the first GPU run's
        # floor read ~0 us).
        one = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((1, 1), scores.dtype),
                             in_specs=[pl.BlockSpec((1, 1), lambda: (0, 0))],
                             out_specs=pl.BlockSpec((1, 1), lambda: (0, 0)), compiler_params=plgpu.CompilerParams())
        return (one(scores),) * 4

    return floor


def _jax_copy_bandwidth() -> float:
    """Bytes per second of a large elementwise pass (read + write counted)."""
    import jax
    import jax.numpy as jnp

    # 1 GiB on a GPU, so that one call's dispatch (~10 us) is ~2% of its time; 256 MiB on a CPU.
    x = jnp.ones((1 << 28 if jax.default_backend() == "gpu" else 1 << 26,), jnp.float32)
    step = jax.jit(lambda a: a + 1.0)
    if jax.default_backend() == "gpu":
        # Measured first in a run, so it also warms the GPU up: nvidia-smi reads 345 MHz on an idle H200,
        # and a launch floor timed at the start of a call read 6.2 us where a later run read 2.7 us.
        deadline = time.perf_counter() + 2.0
        while time.perf_counter() < deadline:
            jax.block_until_ready(step(x))
    seconds = median_us(lambda: jax.block_until_ready(step(x)), 9) / 1e6
    return 2 * x.nbytes / seconds


def _jax_backends():
    import jax

    import kq_jax
    from kq_jax.naive import route_shed_naive

    out = {"jax-reference": kq_jax.route_shed_reference, "jax-naive": route_shed_naive}
    if jax.default_backend() == "gpu":
        out["jax-pallas"] = functools.partial(kq_jax.route_shed, impl="pallas")
    return out


# ---- MLX --------------------------------------------------------------------------------------


def _mlx_timer(fn, inputs, repeats):
    import mlx.core as mx

    from kq_mlx.route_shed_mlx import from_numpy

    args = tuple(from_numpy(a) for a in inputs)
    mx.eval(*args)
    eager = median_us(lambda: mx.eval(*fn(*args)), repeats)
    # A decode graph holds one call per MoE layer; at prefill sizes one call already fills the machine.
    length = MLX_CHAIN if inputs[0].size <= 4096 else 1
    chain = median_us(lambda: mx.eval([o for _ in range(length) for o in fn(*args)]), repeats)
    return chain / length, eager


def _mlx_backends():
    """name -> (call, device description, floor key); GPU-stream rows where MLX has a GPU."""
    import mlx.core as mx

    import kq_mlx
    from kq_mlx.route_shed_mlx import implementation_for

    def on(device, fn):
        def call(i, s, t):
            with mx.stream(device):
                return fn(i, s, t)

        return call

    out = {
        "mlx-ops": (on(mx.cpu, functools.partial(kq_mlx.route_shed_ops, compiled=True)), "cpu (mlx)", "mlx-cpu"),
        "mlx-ops-eager": (on(mx.cpu, functools.partial(kq_mlx.route_shed_ops, compiled=False)), "cpu (mlx)",
                          "mlx-cpu"),
    }
    kind = implementation_for(mx.gpu)
    if kind != "ops":
        gpu = f"gpu ({kind}, mlx)"
        out[f"mlx-{kind}"] = (functools.partial(kq_mlx.route_shed, stream=mx.gpu), gpu, "mlx-gpu")
        out["mlx-ops-gpu"] = (on(mx.gpu, functools.partial(kq_mlx.route_shed_ops, compiled=True)), gpu, "mlx-gpu")
    return out


def _native_timer(prepare, inputs, repeats):
    """The C++-executed Metal source: the kernel loop alone, buffers prepared once."""
    launch, _ = prepare(*inputs)
    per_call = median_us(launch, repeats)
    return per_call, per_call


def _numpy_timer(fn, inputs, repeats):
    per_call = median_us(lambda: fn(*inputs), repeats)
    return per_call, per_call


# ---- the run ----------------------------------------------------------------------------------


def _available(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


class UnknownBackendError(ValueError):
    """A requested backend is not one this machine has; the message names it and lists those it has."""


def run(sets=("decode",), backends=None, *, shapes=(), repeats: int = 7, resident_fraction: float = 0.7,
        seed: int = 0, progress: bool = True) -> list[Result]:
    """Times every requested backend over the named shape sets and ``shapes``; one Result per (backend, shape).

    ``shapes`` are ``(rows, top_k, experts)`` tuples of the caller's own, reported as set ``"custom"``.

    Raises:
        UnknownBackendError: a name in ``backends`` is not a backend here (the message lists those here).
        ValueError: ``resident_fraction`` is not in [0, 1].
    """
    from kq_core.oracle import route_shed_oracle

    if not 0.0 <= resident_fraction <= 1.0:
        raise ValueError(f"resident_fraction must be a fraction in [0, 1], got {resident_fraction}")
    # name -> (call, timer, device, floor key: the launch floor measured once per key)
    timers: dict[str, tuple[Callable, Callable, str, str | None]] = {
        "numpy-oracle": (route_shed_oracle, _numpy_timer, "cpu (numpy)", None)}

    def add_jax():
        for name, fn in _jax_backends().items():
            timers[name] = (fn, _jax_timer, jax_device_name(), "jax")

    def add_mlx():
        for name, (fn, device, floor_key) in _mlx_backends().items():
            timers[name] = (fn, _mlx_timer, device, floor_key)

    def add_metal_source():
        from kq_mlx import metal_cpu

        try:
            timers["metal-source-cpu"] = (metal_cpu.prepare, _native_timer, f"cpu ({metal_cpu.compiler()})", None)
        except metal_cpu.CompilerUnavailable:
            pass

    # A framework no requested backend needs is not even started (a JAX CUDA client in the process of
    # an MLX-CUDA run is a second CUDA user on the GPU that the MLX rows did not ask for); an unknown
    # name starts them all, so that the refusal lists every backend this machine has.
    families = [("jax", _available("jax"), add_jax), ("mlx", _available("mlx"), add_mlx),
                ("metal-source-cpu", True, add_metal_source)]
    for prefix, available, add in families:
        if available and (not backends or any(b.startswith(prefix) for b in backends)):
            add()
    if backends:
        unknown = set(backends) - set(timers)
        if unknown:
            for prefix, available, add in families:
                if available and not any(name.startswith(prefix) for name in timers):
                    add()
            raise UnknownBackendError(f"kq bench: unknown or unavailable backends {sorted(unknown)}; "
                                      f"here: {sorted(timers)}")
        timers = {k: v for k, v in timers.items() if k in backends}
    timing_jax = any(name.startswith("jax") for name in timers)
    jax_floor = _jax_floor_fn() if timing_jax else None
    bandwidth = _jax_copy_bandwidth() if timing_jax else None
    floor_ops = {}
    if any(name.startswith("mlx") for name in timers):
        import mlx.core as mx

        for key, device in (("mlx-cpu", mx.cpu), ("mlx-gpu", mx.gpu)):
            floor_ops[key] = (lambda i, s, t, device=device: (mx.add(i[:1, :1], 1, stream=device),), _mlx_timer)
    if jax_floor is not None:
        floor_ops["jax"] = (jax_floor, _jax_timer)

    named = [(set_name, shape) for set_name in sets for shape in SHAPE_SETS[set_name]]
    work = [(set_name, shape, name) for set_name, shape in named + [("custom", s) for s in shapes] for name in timers]
    with progress_bar(len(work), enabled=progress, description="kq bench") as advance:
        return _run_work(work, timers, floor_ops, bandwidth, repeats, resident_fraction, seed, advance)


def _run_work(work, timers, floor_ops, bandwidth, repeats, resident_fraction, seed, advance) -> list[Result]:
    from kq_core.oracle import route_shed_oracle

    rng = np.random.default_rng(seed)
    results, floors = [], {}
    inputs_cache = {}
    for set_name, (rows, top_k, experts), name in work:
        key = (rows, top_k, experts)
        if key not in inputs_cache:
            inputs_cache.clear()
            inputs = router_inputs(rng, rows, top_k, experts, resident_fraction=resident_fraction)
            inputs_cache[key] = inputs, route_shed_oracle(*inputs)
        inputs, expected = inputs_cache[key]
        fn, timer, device, family = timers[name]
        per_call, eager = timer(fn, inputs, repeats)
        kernel = jax_kernel_us(fn, inputs) if name.startswith("jax") else None
        launch = launch_kernel = None
        if family in floor_ops:
            if family not in floors:
                # Measured once, on one row: at large shapes the chain's own tie-in work over the whole
                # scores array would bury a ~2 us launch in its noise (the H200 run read 0 to 11 us).
                floor_fn, floor_timer = floor_ops[family]
                one_row = (inputs[0][:1], inputs[1][:1], inputs[2])
                # The kernel time of one output: the floor's four are one array, which a jitted
                # function returns as four buffers, three of them device copies in the trace.
                floors[family] = (floor_timer(floor_fn, one_row, repeats)[0],
                                  jax_kernel_us(lambda *a: floor_fn(*a)[0], one_row) if family == "jax" else None)
            launch, launch_kernel = floors[family]
        band = op_bytes(*key) / bandwidth * 1e6 if bandwidth and name.startswith("jax") else None
        results.append(Result(name, device, set_name, rows, top_k, experts, per_call, eager, launch, band,
                              _bits_exact(name, inputs, expected), kernel, launch_kernel))
        advance(f"{name} {rows}x{top_k} E={experts}")
    return results


def _bits_exact(name: str, inputs, expected) -> bool | None:
    """Whether one call of a kq backend gives the oracle's bits on the timed inputs (a benchmark that is
    also a check at sizes the tests do not reach); None for the oracle itself and for the naive
    baseline, which is not exact."""
    from kq.backends import Unavailable, backend
    from kq_core.compare import first_mismatch

    if name == "numpy-oracle":
        return None
    try:
        runner, _ = backend(name).probe()
    except (KeyError, Unavailable):
        return None
    mismatch = first_mismatch(expected, runner(*inputs))
    if mismatch is not None:
        sys.stderr.write(f"kq bench: {name} does not match the oracle at {inputs[0].shape}: {mismatch}\n")
    return mismatch is None


def format_table(results: list[Result]) -> str:
    header = ("backend", "T", "K", "E", "per call us", "kernel us", "eager us", "launch floor", "x floor",
              "floor kernel", "bw floor", "x bw", "bits")
    rows = []
    for r in results:
        ratio = f"{r.per_call_us / r.launch_floor_us:.2f}" if r.launch_floor_us else "-"
        busy = r.per_call_us if r.kernel_us is None else r.kernel_us
        bw_ratio = f"{busy / r.bandwidth_floor_us:.2f}" if r.bandwidth_floor_us else "-"
        rows.append((r.backend, r.rows, r.top_k, r.experts, f"{r.per_call_us:.2f}",
                     "-" if r.kernel_us is None else f"{r.kernel_us:.2f}", f"{r.eager_us:.1f}",
                     "-" if r.launch_floor_us is None else f"{r.launch_floor_us:.2f}", ratio,
                     "-" if r.launch_floor_kernel_us is None else f"{r.launch_floor_kernel_us:.2f}",
                     "-" if r.bandwidth_floor_us is None else f"{r.bandwidth_floor_us:.2f}", bw_ratio,
                     {None: "-", True: "exact", False: "DIFFER"}[r.bits_exact]))
    return render_table(header, rows)


def write_json(results: list[Result], path: str) -> None:
    """The run header (each row names its own device), the method and the rows."""
    common.write_json(path, common.run_header(None, method=__doc__, results=[asdict(r) for r in results]))


def read_json(path: str) -> list[Result]:
    """The results of an earlier :func:`write_json`."""
    with open(path) as handle:
        return [Result(**r) for r in json.load(handle)["results"]]


def plot_floors(results: list[Result]) -> dict[tuple[str, str], list[tuple[int, float]]]:
    """The floor lines a plot of ``results`` draws: ``{(label, line style): [(rows, us), ...]}``, one
    bandwidth floor per device and one launch floor per framework (the part of a backend's name before
    its first '-'), each point the lowest of its rows; a line of one point is drawn as a tick."""
    lines: dict[tuple[str, str], dict[int, float]] = {}
    for r in results:
        for label, style, value in ((f"bandwidth floor ({r.device})", "k--", r.bandwidth_floor_us),
                                    (f"launch floor ({r.backend.split('-')[0]})", "k:", r.launch_floor_us)):
            if value:
                points = lines.setdefault((label, style), {})
                points[r.rows] = min(value, points.get(r.rows, value))
    return {key: sorted(points.items()) for key, points in lines.items()}


def write_plot(results: list[Result], path: str) -> None:
    """Time per call against rows at the most common top-k (8 in both sets), one line per backend, floors dashed.

    Where the results carry GPU kernel times, each backend also gets a dotted line of those in its colour.
    The other shapes (K = 2 and 64) are in the table and the JSON.
    """
    import collections

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    top_k = collections.Counter(r.top_k for r in results).most_common(1)[0][0]
    results = [r for r in results if r.top_k == top_k]
    fig, ax = plt.subplots(figsize=(8, 5))
    series: dict[str, list[Result]] = {}
    for r in results:
        series.setdefault(r.backend, []).append(r)
    for label, points in sorted(series.items()):
        points.sort(key=lambda r: r.rows)
        [line] = ax.plot([p.rows for p in points], [p.per_call_us for p in points], marker="o", label=label)
        kernels = [(p.rows, p.kernel_us) for p in points if p.kernel_us is not None]
        if kernels:
            ax.plot(*zip(*kernels), ":", marker="x", color=line.get_color(), label=f"{label} (kernel time)")
    for (kind, style), group in plot_floors(results).items():
        ax.plot(*zip(*group), style, marker="_", markersize=12, label=kind)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("rows T")
    ax.set_ylabel("time per call (us)")
    ax.set_title(f"route_shed, K = {top_k}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
