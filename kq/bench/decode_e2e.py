"""``kq bench --sets decode-e2e``: decoding through an arena end to end, the way an engine runs it.

One loop for every mode, the resident model included (:func:`decode`): autoregressive (token t+1's
input is token t's output, kept on the device), one readback per token (the resident model's token
id; an arena's packed reports), the compiles done before the clock. Figures are over the last
``tokens`` of ``warmup + tokens``. Every arena starts warm, filled before the clock (with recorded
routing, each layer's experts most routed over the warm-up tokens; else the lowest-numbered), and
the slot tables go to the device only when a boundary changes them. While every layer's table holds
every expert (:func:`kq_core.contract.holds_every_expert`) nothing can miss, and every arena mode runs
the same program: each routed expert gathered from its slot, no ``route_shed``, tier or fetch
(:func:`kq_jax.arena_moe.full_table_moe`, each mode's bits).

Modes (JAX, on its default device):

* ``resident``: every expert in device memory, no manager; token t+1 dispatched before token t is read;
* ``lossy``: the arena, ``route_shed`` shedding each miss (kept weights rescaled); token t+1 dispatched
  with the tables of the boundary before, then token t's reports read and the boundary kept
  (``ResidencyManager.step``): misses are read in the background and land at a later boundary;
* ``tier``: as ``lossy``, but a miss keeps its router weight and is computed from a low-precision copy
  of every expert on the device (``on_miss="tier"``, :func:`kq_jax.moe.tiered_apply`; ``TIER_BITS``
  bits, groups of ``TIER_GROUP_SIZE``; random words of the tier's shapes: its speed does not depend on
  their values. Recorded routing only: a routed model's misses, served from random words, would steer
  its later routing);
* ``exact``: a token is kept only if it ran with every routed expert resident. Token t+1 is dispatched
  on the tables before token t is read, as in ``lossy``; when token t's reports show misses, they are
  read on its critical path (``step``, then ``drain``), token t runs again on the new tables and token
  t+1, dispatched on token t's first output, is dropped. The kept output is the resident model's, bit
  for bit. A token learns its misses from its own reports, as an engine would, but a whole token at a
  time: with recorded routing a run again routes as the first run did, so one extra run suffices (a
  routed model's run again may find later layers' misses, and runs again until it has none).
* ``exact-fetch``: exact in one pass: a layer that misses calls the host from inside the program
  (:mod:`kq_jax.miss_fetch`), which reads its missed experts (:class:`kq_host.miss_reader.MissReader`,
  as many at once as the manager's workers) while the program waits, and the layer computes every entry
  from its own expert's weights. The token's reports name the same misses; the manager's loader takes
  those reads for the arena instead of reading them again, and they land at the token's boundary, before
  the next token is dispatched (so it finds them resident). Never runs a token again.

Routing (the ``routing`` column):

* ``recorded``: each token's top-k per layer is what a trained checkpoint (``models/stdlib-moe``: 4
  layers; ``models/wheels-moe``: 16 layers, OLMoE's routing shape) routed over its held-out text
  (:func:`kq.study_jax.record_routing`), so hit rates and reads are a trained model's; the experts are random
  at the checkpoint's or a real model's size (:data:`RECORDED_MODELS`), their weights written as
  safetensors and read back by the manager's workers through :class:`kq_host.expert_store.ExpertStore`
  (from the page cache once read: this is the arena's cost, not an SSD's).
* ``random``: the demo's random block stack, routed by its own random routers (no tier mode).

Columns: tokens/s and that over the resident model's in the same loop (``x resident``). The resident loop
is timed once first and again before every arena run, and its row is the median of those runs: on a
shared machine the resident's speed drifts over a run, and a single early run would set every ratio
against one moment of it. ``floor tok/s``: the rate the
row could reach, 1 / max(the resident token's time, its critical bytes / the read bandwidth of the
misses' path), and ``x floor``, tokens/s over it. The read bandwidth (``read GiB/s``) is measured in the
same run (:func:`kq.bench.floor.miss_path_gib_per_s`): the checkpoint's experts read through the same
:class:`~kq_host.expert_store.ExpertStore` the manager's loader reads from, by as many threads as its
workers, the page cache warm, and on a GPU each expert copied to the device (page cache to host memory
to device; on a CPU, page cache to memory). A token's critical bytes (``critical MiB/token``) are the
bytes it must read before it can finish: the exact mode's misses read on its critical path; 0 for the
lossy and tier modes, whose reads land at a later boundary (``MiB read/token`` counts them). The floor
is not a bound the measured rate stays under: the resident token's time is itself a measurement.
``no-read tok/s``: the same program dispatched back to back on the last tables, nothing read back (the
device's and the dispatch's rate, what the loop would reach with a free boundary); the median token's wall time,
readback wait and boundary (of which ``publish``: landed experts into the arena); critical-path reads
per token and runs again per token (``exact``); MiB read per token; hit rate; device memory of the
experts (the resident model's, or the arena's and the tier's). ``h2d ms`` is what a token's read bytes
cost at the host-to-device bandwidth measured in the same run. Each readback's copy to the host is
queued as its token is dispatched (``copy_to_host_async``).
"""

from __future__ import annotations

import functools
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from kq.demo_random import PROJECTIONS, write_checkpoint
from kq.bench import common
from kq.bench.common import EXPERT_SIZES, jax_device_name, median_ms
from kq.bench.floor import floor_columns, miss_path_gib_per_s
from kq.terminal import progress_bar, render_table

MODES = ("resident", "lossy", "tier", "exact", "exact-fetch")
# The lossy mode's rule (kq_core.rules): route_shed, the kept weights rescaled to the routed mass, whose
# one topk_route_shed launch routes and sheds (the recorded timings are its); not kq_core.rules.DEFAULT_RULE.
LOSSY_RULE = "route_shed"
RESIDENCIES = (1.0, 0.75, 0.5, 0.25)
TIER_BITS, TIER_GROUP_SIZE = 3, 32
# Recorded: name -> (checkpoint under models/, layers (None: every layer the checkpoint has), hidden,
# ffn); the experts per layer and top-k are the checkpoint's, each expert at the checkpoint's own size
# or a real model's (bf16: OLMoE's 12.6 MB, DeepSeek-V3's 88 MB; one layer of it, the recording's first).
RECORDED_MODELS = {"stdlib-moe-size": ("stdlib-moe", None, 128, 64), "wheels-moe-size": ("wheels-moe", None, 128, 64),
                   "olmoe-size": ("wheels-moe", None, *EXPERT_SIZES["olmoe"]),
                   "deepseek-v3-size": ("wheels-moe", 1, *EXPERT_SIZES["deepseek-v3"])}
# Random: name -> (layers, experts, top_k, hidden, ffn), the demo's stack.
RANDOM_MODELS = {"random-8x64-512": (8, 64, 8, 512, 256), "random-8x64-2048": (8, 64, 8, 2048, 768)}
GPU_MODELS = ("stdlib-moe-size", "wheels-moe-size", "olmoe-size", "deepseek-v3-size", "random-8x64-2048")
CPU_MODELS = ("stdlib-moe-size", "random-8x64-512")


@dataclass
class DecodeResult:
    device: str
    model: str
    routing: str  # recorded, random
    checkpoint: str | None  # whose routing was recorded
    layers: int
    experts: int
    hidden: int
    ffn: int
    mode: str  # resident, lossy, tier, exact
    residency: float
    tokens: int
    tokens_per_s: float
    floor_tokens_per_s: float  # no-read: the same program back to back, nothing read back
    token_ms: float  # median wall time per token
    wait_ms: float  # median readback wait
    boundary_ms: float  # median host work between tokens (exact: the critical-path reads included)
    publish_ms: float  # of the boundary: landed experts into the arena
    critical_reads_per_token: float
    reruns_per_token: float  # exact: tokens run again after their misses were read
    mib_read_per_token: float
    h2d_ms: float  # a token's read bytes at the measured host-to-device bandwidth
    hit_rate: float | None
    memory_gib: float  # the experts' device memory: every expert, or the arena and the tier
    tier_bits: int | None
    resident_tokens_per_s: float  # the baseline of x resident and of the floor: the resident row's tokens/s
    x_resident: float
    read_gib_per_s: float  # the misses' path, measured in the same run
    critical_mib_per_token: float  # bytes a token must read before it can finish (exact: its critical reads)
    floor_with_reads_tokens_per_s: float  # 1 / max(resident token time, critical bytes / read bandwidth)
    x_floor: float


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


def jax_to_device(payload) -> None:
    """An expert's arrays copied to JAX's default device, waited for (the misses' path on a GPU)."""
    import jax

    jax.block_until_ready(jax.device_put(payload))


def expert_shapes(hidden: int, ffn: int) -> dict[str, tuple[int, int]]:
    """Each projection's ``(out, in)``."""
    return {"gate_proj": (ffn, hidden), "up_proj": (ffn, hidden), "down_proj": (hidden, ffn)}


def random_experts(layers: int, experts: int, hidden: int, ffn: int, rng: np.random.Generator):
    """``{projection: bfloat16 [L, E, out, in]}`` of magnitudes 2^-8 to 2^-4, either sign, never zero
    (drawn as bit patterns: quick at any size)."""
    out = {}
    for name, shape in expert_shapes(hidden, ffn).items():
        bits = rng.integers(0, 1 << 16, size=(layers, experts, *shape), dtype=np.uint16)
        bits &= 0x81FF  # the sign and 9 random bits of the magnitude
        bits += 0x3B80  # exponents 2^-8 .. 2^-5, no carry into the sign
        out[name] = bits.view(ml_dtypes.bfloat16)
    return out


def random_tier(layers: int, experts: int, hidden: int, ffn: int, *, seed: int = 0) -> dict:
    """A tier of ``TIER_BITS`` bits, groups of ``TIER_GROUP_SIZE``, on the device: ``{projection: (packed
    uint32 [L, E, out, in * bits / 32], scales, biases bfloat16 [L, E, out, in / group_size])}``, random
    words and small scales (the tier's shapes and bytes; its speed does not depend on their values)."""
    import jax
    import jax.numpy as jnp

    if hidden % TIER_GROUP_SIZE or ffn % TIER_GROUP_SIZE:
        raise ValueError(f"random_tier: hidden {hidden} and ffn {ffn} must be multiples of {TIER_GROUP_SIZE}")
    key, tier = jax.random.key(seed), {}
    for name, (out, inner) in expert_shapes(hidden, ffn).items():
        key, words, scale = jax.random.split(key, 3)
        packed = jax.random.bits(words, (layers, experts, out, inner * TIER_BITS // 32), jnp.uint32)
        scales = (jax.random.uniform(scale, (layers, experts, out, inner // TIER_GROUP_SIZE)) * 2**-8).astype(
            jnp.bfloat16)
        tier[name] = (packed, scales, -scales)
    return tier


_BFLOAT16, _BITS = np.dtype(ml_dtypes.bfloat16), np.dtype(np.uint16)


def bits_of(payload: dict) -> dict:
    """An expert's ``{projection: array}`` with each bfloat16 array viewed as its uint16 bits (no copy)."""
    return {name: a.view(_BITS) if a.dtype == _BFLOAT16 else a for name, a in payload.items()}


def as_weights(array):
    """Inside a program: an arena array of bfloat16 bits (uint16) viewed as bfloat16; any other as it is."""
    import jax.numpy as jnp
    from jax import lax

    return lax.bitcast_convert_type(array, jnp.bfloat16) if array.dtype == jnp.uint16 else array


class Engine:
    """The block stack ``x <- x + moe_l(x)`` over layers as jitted steps: resident (every expert), on an
    arena that sheds its misses (``streamed``) and on an arena whose misses the tier serves (``tiered``).
    The next token's input is the output plus a fixed random vector per position (as a token's embedding
    would be), at unit RMS, so the random routers do not settle on a few experts.

    Args:
        experts: ``{projection: [L, E, out, in]}`` host arrays (the resident model's weights).
        top_k: experts per token.
        steps: tokens a decode runs.
        routing: ``(indices int32 [T, L, K], scores float32 [T, L, K])`` recorded per token, or None.
        router: float32 ``[L, D, E]`` routers, used when ``routing`` is None.
        seed: of the first input and the per-position vectors.
        tier: :func:`random_tier`'s arrays, for ``tiered`` (None: no tier mode).
        impl: the arena's ``route_shed`` / ``topk_route_shed`` implementation.
    """

    def __init__(self, experts, top_k: int, steps: int, *, routing=None, router=None, seed: int = 0, tier=None,
                 impl: str = "auto"):
        import jax
        import jax.numpy as jnp

        import kq_jax
        from kq_jax.arena import pack_reports
        from kq_jax.arena_moe import arena_moe, full_table_moe
        from kq_jax.moe import Experts, TierExperts, TierWeights, combine, experts_apply, route, router_probs

        if (routing is None) == (router is None):
            raise ValueError("Engine: give the recorded routing or the routers, one of them")
        self.layers = next(iter(experts.values())).shape[0]
        self.weights = {name: jnp.asarray(experts[name]) for name in PROJECTIONS}
        self.recorded, self.routing, self.tier = routing is not None, routing, tier
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
                x = x + combine(experts_apply(x, layer_weights(weights, layer), indices), scores)
            return next_input(x, position), jnp.argmax(x[0]).astype(jnp.int32)

        def streamed(x, position, arrays, tables, tier, rule, fetch=None):
            arrays = {name: as_weights(a) for name, a in arrays.items()}
            reports, num_slots = [], arrays[PROJECTIONS[0]].shape[1]
            on_miss = "tier" if rule == "tier" else "shed"
            for layer in range(self.layers):
                if self.recorded or rule == "full":
                    (indices, scores), shed = routed(x, position, layer), None
                else:  # routed and shed in one launch
                    routing = kq_jax.topk_route_shed(router_probs(x, routers[layer]), tables[layer], top_k=top_k,
                                                     num_slots=num_slots, on_miss=on_miss, impl=impl)
                    indices, scores, shed = routing
                if rule == "full":  # every table holds every expert: nothing can miss
                    y, report = full_table_moe(x, indices, scores, tables[layer], weights=layer_weights(arrays, layer))
                    x = x + y
                    reports.append(report)
                    continue
                low = None if tier is None else TierExperts(
                    *(TierWeights(*(a[layer] for a in tier[name])) for name in PROJECTIONS), bits=TIER_BITS,
                    group_size=TIER_GROUP_SIZE)
                y, report = arena_moe(x, indices, scores, tables[layer], rule=rule, weights=layer_weights(arrays, layer),
                                      num_slots=num_slots, tier=low, shed=shed, impl=impl, fetch=fetch, layer=layer)
                x = x + y
                reports.append(report)
            return next_input(x, position), pack_reports(reports)

        def arena_program(rule: str, fetch=None):
            """A new jitted ``(x, position, arrays, tables) -> (x, packed reports)`` on the arena with ``rule``
            (:data:`LOSSY_RULE`, ``tier`` on ``self.tier``, ``exact`` with misses read by ``fetch``, or ``full``:
            tables that hold every expert, :func:`kq_jax.arena_moe.full_table_moe`)."""
            if rule == "tier":
                tiered = jax.jit(lambda x, position, arrays, tables, tier: streamed(x, position, arrays, tables,
                                                                                    tier, rule))
                return functools.partial(tiered, tier=self.tier)
            return jax.jit(lambda x, position, arrays, tables: streamed(x, position, arrays, tables, None, rule, fetch))

        self.resident = jax.jit(resident)
        self.streamed = arena_program(LOSSY_RULE)
        self.tiered = arena_program("tier")
        self.full = arena_program("full")
        # the exact rule with misses read inside the program, by a host reader given per run
        self.fetching = lambda fetch: arena_program("exact", fetch)


def _queued(outputs):
    """A dispatched token's outputs, its readback's copy to the host queued behind it."""
    outputs[1].copy_to_host_async()
    return outputs


def decode(dispatch, boundary, first, steps: int, *,
           overlap: bool | Callable[[], bool]) -> tuple[list[float], list[float], object]:
    """The engine loop. ``dispatch(x, position)`` queues a token and returns its device outputs
    ``(next input, readback)``; ``boundary(position, readback)`` is the host's work on the read-back
    array, and returns True when the token must run again (on the tables the boundary left). With
    ``overlap`` (a callable: asked before each token that has a next one, whether to now), token t+1 is
    dispatched before token t is read (and dropped if token t runs again).

    Returns:
        (the time each token's kept run was read back, each token's readback waits in seconds, summed,
        the last token's next input).
    """
    stamps, waits, wait = [], [], 0.0
    x, position = first, 0
    current = _queued(dispatch(first, 0))
    while position < steps:
        ahead = position + 1 < steps and (overlap() if callable(overlap) else overlap)
        following = _queued(dispatch(current[0], position + 1)) if ahead else None
        start = time.perf_counter()
        readback = np.asarray(current[1])
        read = time.perf_counter()
        wait += read - start
        if boundary(position, readback):
            current = _queued(dispatch(x, position))
            continue
        stamps.append(read)
        waits.append(wait)
        wait, x, position = 0.0, current[0], position + 1
        if position < steps:
            current = following if following is not None else _queued(dispatch(x, position))
    return stamps, waits, x


def device_floor(dispatch, first, tokens: int) -> float:
    """Tokens/s of ``dispatch`` queued ``tokens`` times back to back, each on the last one's output,
    nothing read back until the end."""
    x = first
    start = time.perf_counter()
    for position in range(tokens):
        x, readback = dispatch(x, position)
    readback.block_until_ready()
    return tokens / (time.perf_counter() - start)


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


def warm_experts(engine: Engine, layer: int, slots: int, experts: int, warmup: int) -> list[int]:
    """The experts a layer's arena holds before the clock: with recorded routing, the ``slots`` most routed
    over the first ``warmup`` tokens (ties and the rest by id); else the lowest-numbered."""
    if not engine.recorded:
        return list(range(slots))
    counts = np.bincount(engine.routing[0][:warmup, layer].ravel(), minlength=experts)
    return sorted(np.argsort(-counts, kind="stable")[:slots].tolist())


@dataclass
class ArenaRun:
    """One arena decode's measurements, per token (each list ``engine.steps`` long but ``stamps`` and
    ``waits``, which hold the kept runs')."""

    stamps: list[float]
    waits: list[float]
    boundaries: list[float]  # seconds of host work after the token's readbacks (exact: its reads included)
    publishes: list[float]  # of those: landed experts written into the arena
    critical: list[int]  # misses read on the token's critical path (exact)
    reruns: list[int]  # runs again (exact)
    stats: object  # the manager's LayerStats from token ``warmup`` on
    last: object  # the last token's next input
    floor_tokens_per_s: float
    memory_bytes: int  # the arena's and the tier's device memory


def run_streamed(engine: Engine, store, *, residency: float, mode: str, warmup: int, experts: int) -> ArenaRun:
    """One arena run of ``engine.steps`` tokens in ``mode`` (``lossy``, ``tier`` or ``exact``)."""
    import jax

    from kq_core.contract import holds_every_expert
    from kq_host.miss_reader import MissReader
    from kq_host.residency import LayerReport, ResidencyManager
    from kq_jax.arena import JaxArena

    if mode not in MODES[1:]:
        raise ValueError(f"run_streamed: mode must be one of {MODES[1:]}, got {mode!r}")
    if mode == "tier" and engine.tier is None:
        raise ValueError("run_streamed: mode 'tier' needs an Engine built with tier=")
    positions, steps = engine.positions, engine.steps
    slots = max(1, round(residency * experts))
    # XLA's CPU backend writes a bfloat16 slot slowly, not in place (docs/api.md): there the arena holds the
    # bfloat16 bits as uint16, which it writes in place, the loader hands it the reads' bits and the
    # programs view them as bfloat16 (:func:`as_weights`), so they gather the resident model's weights.
    as_bits = not _on_gpu()
    shapes = {name: (shape, _BITS if as_bits and np.dtype(dtype) == _BFLOAT16 else dtype)
              for name, (shape, dtype) in store.expert_shapes(0).items()}
    arena = JaxArena(engine.layers, slots, shapes)
    timed = _TimedArena(arena)
    reader = MissReader(store, PROJECTIONS) if mode == "exact-fetch" else None  # 8 reads at once, as the manager
    read = store.read_expert if reader is None else reader.loader
    manager = ResidencyManager(engine.layers, experts, slots, loader=lambda l, e, s: bits_of(read(l, e)) if as_bits else read(l, e),
                               arena=timed, bytes_per_expert=store.expert_nbytes(0))
    for layer in range(engine.layers):  # a warm arena before the clock, as an engine starts with one
        manager.preload(layer, warm_experts(engine, layer, slots, experts, warmup))
    state = {"tables": manager.snapshot()}
    program = {"tier": engine.tiered, "exact-fetch": engine.fetching(reader)}.get(mode, engine.streamed)
    device_tables = {}

    def on_device(tables):  # the tables go to the device only when they change, with the program they take
        if "host" not in device_tables or not np.array_equal(device_tables["host"], tables):
            # while every table holds every expert nothing can miss: every mode's bits without route_shed,
            # the tier or a fetch (kq_jax.arena_moe.full_table_moe)
            cannot_miss = bool(holds_every_expert(tables, slots).all())
            device_tables.update(host=tables, device=jax.device_put(tables),
                                 program=engine.full if cannot_miss else program)
        return device_tables["program"], device_tables["device"]

    def dispatch(x, position):
        chosen, tables = on_device(state["tables"])
        return chosen(x, positions[position], arena.arrays, tables)

    # compiled before the clock: the programs this run can dispatch, and no other (a full arena's tables never
    # miss, a partial one's never hold every expert), as an engine that knows its arena's size builds them
    for compiled in [program] * (slots < experts) + [engine.full] * (slots == experts):
        compiled(engine.first, positions[0], arena.arrays, on_device(state["tables"])[1])[1].block_until_ready()
    boundaries, publishes = [0.0] * steps, [0.0] * steps
    critical, reruns, stepped = [0] * steps, [0] * steps, set()

    def boundary(position, packed):
        if position == warmup and "before" not in state:  # the statistics count from token `warmup`'s step on
            state["before"] = manager.stats()[1]
        start, timed.seconds = time.perf_counter(), 0.0
        report = LayerReport.from_packed(packed)
        missed = int((report.miss_ids >= 0).sum())
        if missed or position not in stepped:  # a run again that hit everything was credited by its first run
            state["tables"] = manager.step(report)
            stepped.add(position)
            manager.raise_failures(f"decode-e2e {mode}: token {position}")  # a read shed unsaid would skew the row
        if mode == "exact-fetch" and missed:  # read inside the program, on the token's critical path: the
            critical[position] += missed      # reads the manager asked for are those, landed now for the next token
            manager.drain()
            state["tables"] = manager.snapshot()
        again = mode == "exact" and missed > 0
        if again:  # the misses read on the token's critical path; the token runs again on them
            if reruns[position] > engine.layers:
                raise RuntimeError(f"decode-e2e exact: token {position} still misses {missed} experts after "
                                   f"{reruns[position]} runs")
            critical[position] += missed
            reruns[position] += 1
            manager.drain()
            state["tables"] = manager.snapshot()
        boundaries[position] += time.perf_counter() - start
        publishes[position] += timed.seconds
        return again

    # exact-fetch: the next token dispatched after the boundary, on the tables holding this token's misses,
    # unless every table holds every expert (the full-table program: nothing to fetch or to change)
    overlap = (lambda: on_device(state["tables"])[0] is engine.full) if mode == "exact-fetch" else True
    try:
        stamps, waits, last = decode(dispatch, boundary, engine.first, steps, overlap=overlap)
        floor = device_floor(dispatch, engine.first, min(steps, 64))
    finally:
        manager.close()  # the reads still out land first, so they count among the bytes read
        if reader is not None:
            reader.close()
    memory = sum(a.nbytes for a in arena.arrays.values())
    if mode == "tier":
        memory += sum(a.nbytes for weight in engine.tier.values() for a in weight)
    return ArenaRun(stamps, waits, boundaries, publishes, critical, reruns, manager.stats()[1].since(state["before"]),
                    last, floor, memory)


def record(checkpoint: str, tokens: int, warmup: int):
    """A checkpoint's routing over ``warmup + tokens`` tokens of its held-out text (:func:`kq.study_jax.record_routing`)."""
    from kq.study import SHIPPED_MODEL, StudyConfig
    from kq.study_jax import record_routing

    return record_routing(StudyConfig(checkpoint=SHIPPED_MODEL.parent / checkpoint, tokens=tokens, warmup=warmup))


def run_model(model: str, *, tokens: int = 64, warmup: int = 16, seed: int = 0, routing=None,
              residencies=None, modes=None, log=None) -> list[DecodeResult]:
    """Every mode and residency on one model of :data:`RECORDED_MODELS` or :data:`RANDOM_MODELS`.

    Args:
        residencies: default :data:`RESIDENCIES`.
        modes: the arena modes, run in this order at each residency (default: every mode of :data:`MODES`
            after ``resident``; a random model has no ``tier`` mode).
        routing: the recorded routing for a recorded model (default: :func:`record` of its checkpoint).
    """
    from kq.study import SHIPPED_MODEL, checkpoint_config
    from kq_host.expert_store import ExpertStore

    recorded = model in RECORDED_MODELS
    available = MODES[1:] if recorded else ("lossy", "exact", "exact-fetch")
    modes = available if modes is None else tuple(modes)
    if not modes or len(set(modes)) != len(modes) or not set(modes) <= set(available):
        raise ValueError(f"run_model: modes must be distinct modes of {available} for {model}, got {modes}")
    steps = warmup + tokens
    rng = np.random.default_rng(seed)
    if recorded:
        checkpoint, layers, hidden, ffn = RECORDED_MODELS[model]
        if routing is None:
            routing = record(checkpoint, tokens, warmup)
        routing = tuple(np.ascontiguousarray(a[:steps, :layers]) for a in routing)
        layers, top_k = routing[0].shape[1:]
        experts = checkpoint_config(SHIPPED_MODEL.parent / checkpoint, "jax")["num_experts"]
    else:
        checkpoint, (layers, experts, top_k, hidden, ffn) = None, RANDOM_MODELS[model]
    weights = random_experts(layers, experts, hidden, ffn, rng)
    tier = random_tier(layers, experts, hidden, ffn, seed=seed)
    if recorded:
        engine = Engine(weights, top_k, steps, routing=routing, seed=seed, tier=tier)
    else:
        router = (rng.normal(size=(layers, hidden, experts)) / np.sqrt(hidden) * 4).astype(np.float32)
        engine = Engine(weights, top_k, steps, router=router, seed=seed, tier=tier)
    device, bandwidth = jax_device_name(), h2d_gib_per_s()
    arena_runs, resident_runs = [], []

    def add(mode, residency, run: ArenaRun, resident_tokens_per_s: float, read_gib_per_s: float,
            expert_bytes: int) -> DecodeResult:
        gaps = np.diff(run.stamps[-tokens - 1:])
        tokens_per_s = 1.0 / float(np.median(gaps))
        mib = run.stats.bytes_read / tokens / 2**20
        timed = {name: getattr(run, name)[-tokens:] for name in ("boundaries", "publishes", "critical", "reruns")}
        critical = float(np.mean(timed["critical"]))
        critical_mib = critical * expert_bytes / 2**20
        result = DecodeResult(
            device=device, model=model, routing="recorded" if recorded else "random", checkpoint=checkpoint,
            layers=layers, experts=experts, hidden=hidden, ffn=ffn, mode=mode, residency=residency, tokens=tokens,
            tokens_per_s=tokens_per_s, floor_tokens_per_s=run.floor_tokens_per_s,
            token_ms=float(np.median(gaps)) * 1e3, wait_ms=median_ms(run.waits[-tokens:]),
            boundary_ms=median_ms(timed["boundaries"]), publish_ms=median_ms(timed["publishes"]),
            critical_reads_per_token=critical, reruns_per_token=float(np.mean(timed["reruns"])),
            mib_read_per_token=mib, h2d_ms=mib / 1024 / bandwidth * 1e3, hit_rate=run.stats.hit_rate,
            memory_gib=run.memory_bytes / 2**30, tier_bits=TIER_BITS if mode == "tier" else None,
            resident_tokens_per_s=resident_tokens_per_s, read_gib_per_s=read_gib_per_s,
            critical_mib_per_token=critical_mib,
            **floor_columns(tokens_per_s, resident_tokens_per_s, critical_mib, read_gib_per_s))
        return result

    positions = engine.positions

    def resident(x, position):
        return engine.resident(x, positions[position], engine.weights)

    def time_resident():  # the resident loop, timed before every arena run: its runs span the arenas' time
        stamps, waits, _ = decode(resident, lambda position, token: False, engine.first, steps, overlap=True)
        resident_runs.append((1.0 / float(np.median(np.diff(stamps[-tokens - 1:]))), stamps, waits))

    resident(engine.first, 0)[1].block_until_ready()  # compile
    time_resident()
    resident_floor = device_floor(resident, engine.first, min(steps, 64))
    with tempfile.TemporaryDirectory(prefix="kq-decode-") as workdir:
        write_checkpoint(Path(workdir), weights)
        del weights
        with ExpertStore(workdir, layout="per_expert", projections=PROJECTIONS) as store:
            read_gib_per_s = miss_path_gib_per_s(store, layers, experts, to_device=jax_to_device if _on_gpu() else None)
            if log:
                log(f"{model}: the misses' path reads {read_gib_per_s:.2f} GiB/s")
            for residency in residencies or RESIDENCIES:
                for mode in modes:
                    time_resident()
                    run = run_streamed(engine, store, residency=residency, mode=mode, warmup=warmup, experts=experts)
                    arena_runs.append((mode, residency, run))
                    if log:
                        log(f"{model} {mode} residency={residency:.0%}: "
                            f"{1.0 / float(np.median(np.diff(run.stamps[-tokens - 1:]))):.1f} tok/s (no-read "
                            f"{run.floor_tokens_per_s:.1f}; the resident's run before it "
                            f"{resident_runs[-1][0]:.1f}), hit rate {run.stats.hit_rate:.3f}, "
                            f"{run.stats.bytes_read / tokens / 2**20:.1f} MiB/token")
            expert_bytes = store.expert_nbytes(0)
    rates = sorted(run[0] for run in resident_runs)
    tokens_per_s, stamps, waits = next(run for run in resident_runs if run[0] == rates[(len(rates) - 1) // 2])
    gaps = np.diff(stamps[-tokens - 1:])
    resident_row = DecodeResult(
        device=device, model=model, routing="recorded" if recorded else "random", checkpoint=checkpoint,
        layers=layers, experts=experts, hidden=hidden, ffn=ffn, mode="resident", residency=1.0, tokens=tokens,
        tokens_per_s=tokens_per_s, floor_tokens_per_s=resident_floor, token_ms=float(np.median(gaps)) * 1e3,
        wait_ms=median_ms(waits[-tokens:]), boundary_ms=0.0, publish_ms=0.0, critical_reads_per_token=0.0,
        reruns_per_token=0.0, mib_read_per_token=0.0, h2d_ms=0.0, hit_rate=None,
        memory_gib=sum(a.nbytes for a in engine.weights.values()) / 2**30, tier_bits=None,
        resident_tokens_per_s=tokens_per_s, read_gib_per_s=read_gib_per_s, critical_mib_per_token=0.0,
        **floor_columns(tokens_per_s, tokens_per_s, 0.0, read_gib_per_s))
    if log:
        log(f"{model} resident: {tokens_per_s:.1f} tok/s, the median of {len(rates)} runs "
            f"[{rates[0]:.1f}, {rates[-1]:.1f}] (no-read {resident_floor:.1f})")
    return [resident_row, *(add(mode, residency, run, tokens_per_s, read_gib_per_s, expert_bytes)
                            for mode, residency, run in arena_runs)]


def _on_gpu() -> bool:
    import jax

    return jax.default_backend() == "gpu"


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run(models=None, *, tokens: int = 64, warmup: int = 16, progress: bool = True,
        log=_to_stderr) -> list[DecodeResult]:
    """``run_model`` over ``models`` (default: :data:`GPU_MODELS` where JAX runs on a GPU, else
    :data:`CPU_MODELS`); the recorded models of one checkpoint share one recording. ``log`` takes a line
    per run."""
    names = models or (GPU_MODELS if _on_gpu() else CPU_MODELS)
    recordings = {}
    results = []
    with progress_bar(len(names), enabled=progress, description="kq bench decode-e2e") as advance:
        for name in names:
            routing = None
            if name in RECORDED_MODELS:
                checkpoint = RECORDED_MODELS[name][0]
                if checkpoint not in recordings:
                    recordings[checkpoint] = record(checkpoint, tokens, warmup)
                routing = recordings[checkpoint]
            results += run_model(name, tokens=tokens, warmup=warmup, routing=routing, log=log)
            advance(name)
    return results


def format_table(results: list[DecodeResult]) -> str:
    header = ("model", "routing", "mode", "residency", "tok/s", "x resident", "x floor", "floor tok/s", "no-read tok/s",
              "token ms", "wait ms", "boundary ms", "publish ms", "critical reads/token", "critical MiB/token",
              "runs again/token", "MiB read/token", "read GiB/s", "h2d ms", "hit rate", "memory GiB")
    rows = [(r.model, r.routing, r.mode, f"{r.residency:.0%}", f"{r.tokens_per_s:.1f}", f"{r.x_resident:.3f}",
             f"{r.x_floor:.3f}", f"{r.floor_with_reads_tokens_per_s:.1f}", f"{r.floor_tokens_per_s:.1f}",
             f"{r.token_ms:.2f}", f"{r.wait_ms:.2f}", f"{r.boundary_ms:.2f}", f"{r.publish_ms:.2f}",
             f"{r.critical_reads_per_token:.2f}", f"{r.critical_mib_per_token:.3f}", f"{r.reruns_per_token:.2f}",
             f"{r.mib_read_per_token:.1f}", f"{r.read_gib_per_s:.2f}", f"{r.h2d_ms:.2f}",
             "-" if r.hit_rate is None else f"{r.hit_rate:.3f}", f"{r.memory_gib:.3f}")
            for r in results]
    return render_table(header, rows, left=(0, 1, 2))


def write_json(results: list[DecodeResult], path: str) -> None:
    common.write_json(path, common.run_header(method=__doc__, results=[asdict(r) for r in results]))
