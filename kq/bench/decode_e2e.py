"""``kq bench --sets decode-e2e``: decoding through an arena end to end, the way an engine runs it.

One loop for every mode, the resident model included (:func:`decode`): autoregressive (token t+1's
input is token t's output, kept on the device), one readback per token (the resident model's token
id; an arena's packed reports), the compiles done before the clock. Figures are over the last
``tokens`` of ``warmup + tokens``. Every arena starts warm, filled before the clock (with recorded
routing, each layer's experts most routed over the warm-up tokens; else the lowest-numbered), and
the slot tables go to the device only when a boundary changes them.

Modes (JAX, on its default device):

* ``resident``: every expert in device memory, no manager; token t+1 dispatched before token t is read;
* ``lossy``: the arena, ``route_shed`` shedding each miss (kept weights rescaled); token t+1 dispatched
  with the tables of the boundary before, then token t's reports read and the boundary kept
  (``ResidencyManager.step``): misses are read in the background and land at a later boundary;
* ``exact``: every routed expert is resident before its token runs: the token's misses are read on
  its critical path (``step`` on its routing, then ``drain``), so its output is the resident model's,
  bit for bit. Token t+1's routing is known only once token t is done, so nothing overlaps the reads.

Routing (the ``routing`` column):

* ``recorded``: each token's top-k per layer is what the shipped checkpoint (``models/stdlib-moe``)
  routed over its held-out text (:func:`kq.study.record_routing`), so hit rates and reads are a trained
  model's; the experts are random at a real model's size (:data:`RECORDED_MODELS`), their weights
  written as safetensors and read back by the manager's workers through
  :class:`kq_host.expert_store.ExpertStore` (from the page cache once read: this is the arena's cost, not
  an SSD's). The ``exact`` mode learns a token's routing from the recording, where an engine learns it
  layer by layer: its wait is the reads', without the per-layer round trips.
* ``random``: the demo's random block stack, routed by its own random routers (no exact mode).

Columns: tokens/s and that over the resident model's in the same loop (``x resident``); the median
token's wall time, readback wait and boundary (of which ``publish``: landed experts into the arena);
critical-path reads per token (``exact``); MiB read per token; hit rate. ``h2d ms`` is what a token's
read bytes cost at the host-to-device bandwidth measured in the same run.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kq.demo import PROJECTIONS, write_checkpoint
from kq.terminal import progress_bar, render_table

MODES = ("resident", "lossy", "exact")
RESIDENCIES = (1.0, 0.75, 0.5, 0.25)
# name -> (layers, experts, top_k, hidden, ffn). Recorded: the shipped checkpoint's layers, experts and
# top-k, each expert at the checkpoint's own size or a real model's (bf16: OLMoE's 12.6 MB, DeepSeek-V3's
# 88 MB); random: the demo's stack.
RECORDED_MODELS = {"stdlib-moe-size": (4, 64, 8, 128, 64), "olmoe-size": (4, 64, 8, 2048, 1024),
                   "deepseek-v3-size": (1, 64, 8, 7168, 2048)}
RANDOM_MODELS = {"random-8x64-512": (8, 64, 8, 512, 256), "random-8x64-2048": (8, 64, 8, 2048, 768)}
GPU_MODELS = ("stdlib-moe-size", "olmoe-size", "deepseek-v3-size", "random-8x64-2048")
CPU_MODELS = ("stdlib-moe-size", "random-8x64-512")


@dataclass
class DecodeResult:
    device: str
    model: str
    routing: str  # recorded, random
    layers: int
    experts: int
    hidden: int
    ffn: int
    mode: str  # resident, lossy, exact
    residency: float
    tokens: int
    tokens_per_s: float
    token_ms: float  # median wall time per token
    wait_ms: float  # median readback wait
    boundary_ms: float  # median host work between tokens (exact: the critical-path reads included)
    publish_ms: float  # of the boundary: landed experts into the arena
    critical_reads_per_token: float
    mib_read_per_token: float
    h2d_ms: float  # a token's read bytes at the measured host-to-device bandwidth
    hit_rate: float | None


def h2d_gib_per_s() -> float:
    """Host-to-device bandwidth of a pageable 64 MiB NumPy array, median of 5."""
    import jax

    host = np.ones(32 * 2**20, np.float16)
    jax.device_put(host).block_until_ready()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        jax.device_put(host).block_until_ready()
        times.append(time.perf_counter() - start)
    return host.nbytes / statistics.median(times) / 2**30


def random_experts(layers: int, experts: int, hidden: int, ffn: int, rng: np.random.Generator):
    """``{projection: bfloat16 [L, E, out, in]}`` of magnitudes 2^-8 to 2^-4, either sign, never zero
    (drawn as bit patterns: quick at any size)."""
    import ml_dtypes

    shapes = {"gate_proj": (ffn, hidden), "up_proj": (ffn, hidden), "down_proj": (hidden, ffn)}
    out = {}
    for name, shape in shapes.items():
        bits = rng.integers(0, 1 << 16, size=(layers, experts, *shape), dtype=np.uint16)
        bits &= 0x81FF  # the sign and 9 random bits of the magnitude
        bits += 0x3B80  # exponents 2^-8 .. 2^-5, no carry into the sign
        out[name] = bits.view(ml_dtypes.bfloat16)
    return out


class Engine:
    """The block stack ``x <- x + moe_l(x)`` over layers as jitted steps, resident (every expert) and on
    an arena. The next token's input is the output plus a fixed random vector per position (as a
    token's embedding would be), at unit RMS, so the random routers do not settle on a few experts.

    Args:
        experts: ``{projection: [L, E, out, in]}`` host arrays (the resident model's weights).
        top_k: experts per token.
        steps: tokens a decode runs.
        routing: ``(indices int32 [T, L, K], scores float32 [T, L, K])`` recorded per token, or None.
        router: float32 ``[L, D, E]`` routers, used when ``routing`` is None.
        seed: of the first input and the per-position vectors.
    """

    def __init__(self, experts, top_k: int, steps: int, *, routing=None, router=None, seed: int = 0):
        import jax
        import jax.numpy as jnp

        import kq_jax
        from kq_core.contract import TopkRouteShedResult
        from kq_jax.arena import pack_reports
        from kq_jax.moe import Experts, experts_apply, route, router_probs

        if (routing is None) == (router is None):
            raise ValueError("Engine: give the recorded routing or the routers, one of them")
        self.layers = next(iter(experts.values())).shape[0]
        self.weights = {name: jnp.asarray(experts[name]) for name in PROJECTIONS}
        self.recorded, self.routing = routing is not None, routing
        trace = tuple(jnp.asarray(a) for a in routing) if self.recorded else None
        routers = None if router is None else jnp.asarray(router)
        hidden = self.weights["gate_proj"].shape[-1]
        drift = np.random.default_rng(seed).normal(size=(steps + 1, 1, hidden)).astype(np.float32)
        self.first = jnp.asarray(drift[0] / np.sqrt((drift[0]**2).mean()))
        drift = jnp.asarray(drift)
        self.steps = steps
        self.positions = [jax.device_put(np.int32(position)) for position in range(steps)]  # on the device once

        def layer_weights(arrays, layer):
            return Experts(*(arrays[name][layer] for name in PROJECTIONS))

        def routed(x, position, layer):
            if self.recorded:
                return trace[0][position, layer][None], trace[1][position, layer][None]
            return route(x, routers[layer], top_k=top_k)

        def next_input(x, position):
            x = x + drift[position + 1]
            return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True))

        def resident(x, position, weights):
            for layer in range(self.layers):
                indices, scores = routed(x, position, layer)
                y = experts_apply(x, layer_weights(weights, layer), indices)
                x = x + jnp.einsum("tkd,tk->td", y, scores.astype(y.dtype))
            return next_input(x, position), jnp.argmax(x[0]).astype(jnp.int32)

        def streamed(x, position, arrays, tables):
            routings, num_slots = [], arrays[PROJECTIONS[0]].shape[1]
            for layer in range(self.layers):
                if self.recorded:
                    indices, scores = routed(x, position, layer)
                    routing = TopkRouteShedResult(indices, scores, kq_jax.route_shed(
                        indices, scores, tables[layer], num_slots=num_slots))
                else:
                    routing = kq_jax.topk_route_shed(router_probs(x, routers[layer]), tables[layer], top_k=top_k,
                                              num_slots=num_slots)
                y = experts_apply(x, layer_weights(arrays, layer), routing.shed.slots)
                x = x + jnp.einsum("tkd,tk->td", y, routing.shed.mix.astype(y.dtype))
                routings.append(routing)
            return next_input(x, position), pack_reports(routings)

        self.resident, self.streamed = jax.jit(resident), jax.jit(streamed)


def decode(dispatch, boundary, first, steps: int, *, overlap: bool) -> tuple[list[float], list[float], object]:
    """The engine loop. ``dispatch(x, position)`` queues a token and returns its device outputs
    ``(next input, readback)``; ``boundary(position, readback)`` is the host's work on the read-back
    array. With ``overlap``, token t+1 is dispatched before token t is read.

    Returns:
        (the time each token was read back, each readback's wait in seconds, the last token's next input).
    """
    stamps, waits = [], []
    current = dispatch(first, 0)
    for position in range(steps):
        following = dispatch(current[0], position + 1) if overlap and position + 1 < steps else None
        start = time.perf_counter()
        readback = np.asarray(current[1])
        stamps.append(time.perf_counter())
        waits.append(stamps[-1] - start)
        boundary(position, readback)
        if not overlap and position + 1 < steps:
            following = dispatch(current[0], position + 1)
        current = following if following is not None else current
    return stamps, waits, current[0]


class _TimedArena:
    """An arena, with the time spent writing landed experts into it added up."""

    def __init__(self, arena):
        self.arena, self.seconds = arena, 0.0

    def write_slots(self, layers, slots, payloads):
        from kq_host.arena import write_landed

        start = time.perf_counter()
        try:
            return write_landed(self.arena, layers, slots, payloads)
        finally:
            self.seconds += time.perf_counter() - start


def exact_report(tables: np.ndarray, indices: np.ndarray, scores: np.ndarray):
    """A token's report before it runs: its routing ``[L, K]`` (each row's scores falling, as top-k gives
    them) and, per layer, the routed experts the tables ``[L, E]`` lack, highest score first, -1 padded
    (what ``route_shed`` would report)."""
    from kq_host.residency import LayerReport

    missing = np.take_along_axis(tables, indices.astype(np.int64), axis=1) < 0  # [L, K]
    order = np.argsort(~missing, axis=1, kind="stable")  # the misses first, in k order
    miss_ids = np.where(np.take_along_axis(missing, order, axis=1), np.take_along_axis(indices, order, axis=1), -1)
    miss_scores = np.where(miss_ids >= 0, np.take_along_axis(scores, order, axis=1), np.float32(0))
    return LayerReport(indices[:, None], scores[:, None], miss_ids[:, None].astype(np.int32),
                       miss_scores[:, None].astype(np.float32))


def warm_experts(engine: Engine, layer: int, slots: int, experts: int, warmup: int) -> list[int]:
    """The experts a layer's arena holds before the clock: with recorded routing, the ``slots`` most routed
    over the first ``warmup`` tokens (ties and the rest by id); else the lowest-numbered."""
    if not engine.recorded:
        return list(range(slots))
    counts = np.bincount(engine.routing[0][:warmup, layer].ravel(), minlength=experts)
    return sorted(np.argsort(-counts, kind="stable")[:slots].tolist())


def run_streamed(engine: Engine, store, *, residency: float, mode: str, warmup: int, experts: int):
    """One arena run of ``engine.steps`` tokens: (readback stamps, waits, boundaries, publishes, critical
    reads per token, the manager's statistics from token ``warmup`` on, the last token's next input)."""
    import jax

    from kq_host.residency import ResidencyManager
    from kq_jax.arena import JaxArena

    positions = engine.positions
    slots = max(1, round(residency * experts))
    # XLA's CPU backend writes a bfloat16 slot slowly, not in place (docs/api.md): there, float32.
    shapes = {name: (shape, dtype if _on_gpu() else np.float32)
              for name, (shape, dtype) in store.expert_shapes(0).items()}
    arena = JaxArena(engine.layers, slots, shapes)
    timed = _TimedArena(arena)
    manager = ResidencyManager(engine.layers, experts, slots, loader=lambda l, e, s: store.read_expert(l, e),
                               arena=timed, bytes_per_expert=store.expert_nbytes(0))
    for layer in range(engine.layers):  # a warm arena before the clock, as an engine starts with one
        manager.preload(layer, warm_experts(engine, layer, slots, experts, warmup))
    state = {"tables": manager.snapshot()}
    engine.streamed(engine.first, positions[0], arena.arrays, state["tables"])[1].block_until_ready()  # compile
    device_tables = {}

    def on_device(tables):  # the tables go to the device only when they change
        if "host" not in device_tables or not np.array_equal(device_tables["host"], tables):
            device_tables.update(host=tables, device=jax.device_put(tables))
        return device_tables["device"]

    boundaries, publishes, critical = [], [], []

    def mark(position):  # the statistics count from token `warmup`'s step on
        if position == warmup:
            state["before"] = manager.stats()[1]

    def dispatch(x, position):
        if mode == "exact":  # this token's misses read and published before it goes out
            mark(position)
            start, timed.seconds = time.perf_counter(), 0.0
            report = exact_report(state["tables"], *(a[position] for a in engine.routing))
            critical.append(int((report.miss_ids >= 0).sum()))
            manager.step(report)
            manager.drain()
            state["tables"] = manager.snapshot()
            boundaries.append(time.perf_counter() - start)
            publishes.append(timed.seconds)
        return engine.streamed(x, positions[position], arena.arrays, on_device(state["tables"]))

    def boundary(position, packed):
        from kq_host.residency import LayerReport

        if mode == "exact":
            missed = int((packed[2] >= 0).sum())
            if missed:
                raise RuntimeError(f"decode-e2e exact: token {position} ran with {missed} misses")
            return
        mark(position)
        start, timed.seconds = time.perf_counter(), 0.0
        state["tables"] = manager.step(LayerReport.from_packed(packed))
        boundaries.append(time.perf_counter() - start)
        publishes.append(timed.seconds)

    stamps, waits, last = decode(dispatch, boundary, engine.first, engine.steps, overlap=mode == "lossy")
    manager.close()  # the reads still out land first, so they count among the bytes read
    return stamps, waits, boundaries, publishes, critical, manager.stats()[1].since(state["before"]), last


def run_model(model: str, *, tokens: int = 64, warmup: int = 16, seed: int = 0, routing=None,
              residencies=None, log=None) -> list[DecodeResult]:
    """Every mode and residency on one model of :data:`RECORDED_MODELS` or :data:`RANDOM_MODELS`.

    Args:
        residencies: default :data:`RESIDENCIES`.
        routing: the recorded routing for a recorded model (default: :func:`kq.study.record_routing` of
            the shipped checkpoint over ``warmup + tokens`` tokens of its held-out text).
    """
    from kq_host.expert_store import ExpertStore

    recorded = model in RECORDED_MODELS
    layers, experts, top_k, hidden, ffn = (RECORDED_MODELS if recorded else RANDOM_MODELS)[model]
    steps = warmup + tokens
    rng = np.random.default_rng(seed)
    weights = random_experts(layers, experts, hidden, ffn, rng)
    if recorded:
        if routing is None:
            from kq.study import StudyConfig, record_routing

            routing = record_routing(StudyConfig(tokens=tokens, warmup=warmup))
        routing = tuple(np.ascontiguousarray(a[:steps, :layers]) for a in routing)
        engine = Engine(weights, top_k, steps, routing=routing, seed=seed)
        modes = MODES
    else:
        router = (rng.normal(size=(layers, hidden, experts)) / np.sqrt(hidden) * 4).astype(np.float32)
        engine = Engine(weights, top_k, steps, router=router, seed=seed)
        modes = ("resident", "lossy")
    device, bandwidth = _device(), h2d_gib_per_s()
    results = []

    def add(mode, residency, stamps, waits, boundaries, publishes, critical, stats):
        gaps = np.diff(stamps[-tokens - 1:])
        mib = 0.0 if stats is None else stats.bytes_read / tokens / 2**20
        result = DecodeResult(
            device, model, "recorded" if recorded else "random", layers, experts, hidden, ffn, mode, residency,
            tokens, 1.0 / float(np.median(gaps)), float(np.median(gaps)) * 1e3, _median_ms(waits[-tokens:]),
            _median_ms(boundaries[-tokens:]), _median_ms(publishes[-tokens:]),
            float(np.mean(critical[-tokens:])) if critical else 0.0, mib, mib / 1024 / bandwidth * 1e3,
            None if stats is None else stats.hit_rate)
        results.append(result)
        if log:
            log(f"{model} {mode} residency={residency:.0%}: {result.tokens_per_s:.1f} tok/s, hit rate "
                f"{'-' if result.hit_rate is None else f'{result.hit_rate:.3f}'}, {mib:.1f} MiB/token")

    positions = engine.positions
    engine.resident(engine.first, positions[0], engine.weights)[1].block_until_ready()  # compile
    stamps, waits, _ = decode(lambda x, position: engine.resident(x, positions[position], engine.weights),
                              lambda position, token: None, engine.first, steps, overlap=True)
    add("resident", 1.0, stamps, waits, [], [], [], None)
    with tempfile.TemporaryDirectory(prefix="kq-decode-") as workdir:
        write_checkpoint(Path(workdir), weights)
        with ExpertStore(workdir, layout="per_expert", projections=PROJECTIONS) as store:
            for residency in residencies or RESIDENCIES:
                for mode in modes[1:]:
                    *timings, stats, _ = run_streamed(engine, store, residency=residency, mode=mode, warmup=warmup,
                                                      experts=experts)
                    add(mode, residency, *timings, stats)
    return results


def _median_ms(seconds) -> float:
    return statistics.median(seconds) * 1e3 if len(seconds) else 0.0


def _device() -> str:
    import jax

    return f"{jax.devices()[0].device_kind} (jax {jax.__version__})"


def _on_gpu() -> bool:
    import jax

    return jax.default_backend() == "gpu"


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run(models=None, *, tokens: int = 64, warmup: int = 16, progress: bool = True,
        log=_to_stderr) -> list[DecodeResult]:
    """``run_model`` over ``models`` (default: :data:`GPU_MODELS` where JAX runs on a GPU, else
    :data:`CPU_MODELS`); the recorded models share one recording. ``log`` takes a line per run."""
    names = models or (GPU_MODELS if _on_gpu() else CPU_MODELS)
    routing = None
    if any(name in RECORDED_MODELS for name in names):
        from kq.study import StudyConfig, record_routing

        routing = record_routing(StudyConfig(tokens=tokens, warmup=warmup))
    results = []
    with progress_bar(len(names), enabled=progress, description="kq bench decode-e2e") as advance:
        for name in names:
            results += run_model(name, tokens=tokens, warmup=warmup, routing=routing, log=log)
            advance(name)
    return results


def format_table(results: list[DecodeResult]) -> str:
    header = ("model", "routing", "mode", "residency", "tok/s", "x resident", "token ms", "wait ms", "boundary ms",
              "publish ms", "critical reads/token", "MiB read/token", "h2d ms", "hit rate")
    resident = {r.model: r.tokens_per_s for r in results if r.mode == "resident"}
    rows = [(r.model, r.routing, r.mode, f"{r.residency:.0%}", f"{r.tokens_per_s:.1f}",
             f"{r.tokens_per_s / resident[r.model]:.3f}", f"{r.token_ms:.2f}", f"{r.wait_ms:.2f}",
             f"{r.boundary_ms:.2f}", f"{r.publish_ms:.2f}", f"{r.critical_reads_per_token:.2f}",
             f"{r.mib_read_per_token:.1f}", f"{r.h2d_ms:.2f}", "-" if r.hit_rate is None else f"{r.hit_rate:.3f}")
            for r in results]
    return render_table(header, rows, left=(0, 1, 2))


def write_json(results: list[DecodeResult], path: str) -> None:
    payload = {"date": time.strftime("%Y-%m-%d"), "machine": platform.platform(), "python": platform.python_version(),
               "numpy": np.__version__, "method": __doc__, "results": [asdict(r) for r in results]}
    with open(path, "w") as handle:
        json.dump(payload, handle, indent=1)
