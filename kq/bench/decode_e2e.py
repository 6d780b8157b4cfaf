"""``kq bench --sets decode-e2e``: decoding through an arena end to end, resident against streamed.

For each model shape and framework (JAX on its default device, MLX on the CPU) the demo's random
Qwen3-MoE-style block stack is built, its experts are written as safetensors and read back by the
residency manager's workers through :class:`kq_host.expert_store.ExpertStore`. Every run first
compiles (one call of each step function, not timed), then decodes ``warmup + tokens`` tokens; the
figures are over the last ``tokens``:

* ``resident``: every expert in memory, no manager: the model as it would run unconstrained;
* ``serial``: the arena at 100 / 50 / 25% residency (100%: every expert preloaded), per read budget;
  each token: dispatch, wait for its output and its reports (one transfer), then the boundary
  (``ResidencyManager.step``), split into ``publish`` (landed experts into the arena: their
  host-to-device copies and one scatter per projection) and ``bookkeeping`` (the rest);
* ``overlapped`` (JAX): token t+1 is dispatched before token t's boundary, with the tables of the
  boundary before (one token older), so the device computes while the host keeps the books. A JAX
  arena write makes new arrays, so the token in flight reads the arena as dispatched; an arena written
  in place would be safe too, as a slot written at a boundary was cleared from the tables one
  boundary earlier;
* ``overlapped-pinned`` (JAX on a GPU, with CuPy installed): overlapped, the store reading each
  expert straight into page-locked buffers (``ExpertStore(host_allocator=cupyx.empty_pinned)``), so
  the arena's copies to the device start from pinned memory.

``h2d_ms`` is what the token's landed bytes cost at the host-to-device bandwidth measured in the same
run (a pageable NumPy array to the device); the wait bar at 25% is bookkeeping <= 0.5 ms plus that.
"""

from __future__ import annotations

import contextlib
import json
import platform
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kq.terminal import progress_bar, render_table

# name -> (layers, experts, top_k, hidden, ffn, residencies, read budgets): a size a CPU decodes in
# milliseconds; the demo's GPU size; DeepSeek-V3's expert (hidden 7168, width 2048; 2-byte weights on
# disk: 88 MB an expert) in one layer.
DECODE_MODELS = {"8x64-512": (8, 64, 8, 512, 256, (1.0, 0.5, 0.25), (None, 8)),
                 "8x64-2048": (8, 64, 8, 2048, 768, (1.0, 0.5, 0.25), (None, 8)),
                 "deepseek-expert": (1, 16, 8, 7168, 2048, (1.0, 0.25), (None,))}
GPU_MODELS, CPU_MODELS = ("8x64-2048", "deepseek-expert"), ("8x64-512",)


@dataclass
class DecodeResult:
    framework: str
    device: str
    model: str
    layers: int
    experts: int
    hidden: int
    ffn: int
    mode: str  # resident, serial, overlapped
    residency: float | None
    read_budget: int | None
    tokens: int
    tokens_per_s: float
    token_ms: float  # median wall time per token
    wait_ms: float  # dispatch to output and reports on the host
    boundary_ms: float  # ResidencyManager.step
    publish_ms: float  # of the boundary: landed experts into the arena
    bookkeeping_ms: float  # of the boundary: the rest
    mib_read_per_token: float
    h2d_ms: float  # the landed bytes at the measured host-to-device bandwidth
    hit_rate: float | None


class _TimedArena:
    """The stack's arena, with the time spent writing landed experts into it added up."""

    def __init__(self, arena):
        self.arena, self.seconds = arena, 0.0

    def _timed(self, method, *args):
        start = time.perf_counter()
        try:
            return method(*args)
        finally:
            self.seconds += time.perf_counter() - start

    def write_slot(self, layer, slot, payload):
        return self._timed(self.arena.write_slot, layer, slot, payload)

    def write_slots(self, layers, slots, payloads):
        from kq_host.arena import write_landed

        return self._timed(write_landed, self.arena, layers, slots, payloads)


def _median_ms(seconds) -> float:
    return statistics.median(seconds) * 1e3


def h2d_gib_per_s(framework: str) -> float:
    """Host-to-device bandwidth of a pageable 64 MiB NumPy array, median of 5 (JAX; MLX: its CPU, inf)."""
    if framework != "jax":
        return float("inf")
    import jax

    host = np.ones(32 * 2**20, np.float16)
    jax.device_put(host).block_until_ready()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        jax.device_put(host).block_until_ready()
        times.append(time.perf_counter() - start)
    return host.nbytes / statistics.median(times) / 2**30


def _resident(stack, states, warmup: int) -> list[float]:
    stack.resident_step(states[0])  # compile
    seconds = []
    for h in states:
        start = time.perf_counter()
        stack.resident_step(h)
        seconds.append(time.perf_counter() - start)
    return seconds[warmup:]


def _page_locked_allocator(framework: str):
    """CuPy's page-locked host allocator where JAX runs on a GPU and CuPy imports; else None."""
    if framework != "jax" or not _on_gpu():
        return None
    try:
        import cupyx
    except ImportError:
        return None
    return cupyx.empty_pinned


def _streamed(stack, cfg, store, states, *, warmup: int, overlapped: bool, read_budget: int | None):
    """Per-token (wall, wait, boundary, publish) seconds after warm-up, MiB read per token, hit rate."""
    from kq_host.residency import ResidencyManager

    arena = _TimedArena(stack.arena)
    manager = ResidencyManager(cfg.layers, cfg.experts, cfg.slots, loader=lambda l, e, s: store.read_expert(l, e),
                               arena=arena, read_budget=read_budget, bytes_per_expert=store.expert_nbytes(0))
    if cfg.slots == cfg.experts:
        for layer in range(cfg.layers):
            manager.preload(layer, range(cfg.experts))
    tables = manager.snapshot()
    stack.streamed_step(states[0], tables)  # compile; the manager sees none of it
    records = []
    pending = stack.dispatch(states[0], tables) if overlapped else None
    for index, h in enumerate(states):
        if index == warmup:
            _, before = manager.stats()
        start, arena.seconds = time.perf_counter(), 0.0
        if overlapped:  # the next token goes out with the tables of the boundary before this one
            current = pending
            pending = stack.dispatch(states[index + 1], tables) if index + 1 < len(states) else None
            _, reports = stack.readback(current)
        else:
            _, reports = stack.streamed_step(h, tables)
        ready = time.perf_counter()
        tables = manager.step(reports)
        end = time.perf_counter()
        records.append((end - start, ready - start, end - ready, arena.seconds))
    manager.close()  # the reads still out land first, so they count among the bytes read
    _, after = manager.stats()
    since = after.since(before)
    timed = records[warmup:]
    return timed, since.bytes_read / len(timed) / 2**20, since.hit_rate


def run_model(framework: str, model: str, *, tokens: int = 64, warmup: int = 16, seed: int = 0,
              log=None) -> list[DecodeResult]:
    """Every run of one framework on one model of :data:`DECODE_MODELS`."""
    from kq import demo
    from kq_host.expert_store import ExpertStore

    layers, experts, top_k, hidden, ffn, residencies, read_budgets = DECODE_MODELS[model]
    rng = np.random.default_rng(seed)
    base = demo.DemoConfig(layers=layers, experts=experts, top_k=top_k, hidden=hidden, ffn=ffn,
                           steps=warmup + tokens, frameworks=(framework,))
    router, weights = demo.make_weights(base, rng)
    states = list(demo.hidden_states(base, rng))
    stack_class, _ = demo.STACKS[framework]
    bandwidth = h2d_gib_per_s(framework)
    results = []

    def add(mode, residency, budget, timed, mib, hit_rate, device):
        wall, wait, boundary, publish = (np.array(column) for column in zip(*timed))
        result = DecodeResult(
            framework, device, model, layers, experts, hidden, ffn, mode, residency, budget, len(wall),
            len(wall) / float(wall.sum()), _median_ms(wall), _median_ms(wait), _median_ms(boundary),
            _median_ms(publish), _median_ms(boundary - publish), mib,
            mib / 1024 / bandwidth * 1e3 if np.isfinite(bandwidth) else 0.0, hit_rate)
        results.append(result)
        if log:
            log(f"{framework} {model} {mode} residency={residency} budget={budget}: "
                f"{result.tokens_per_s:.1f} tok/s, boundary {result.boundary_ms:.2f} ms")

    page_locked = _page_locked_allocator(framework)
    with tempfile.TemporaryDirectory(prefix="kq-decode-") as workdir, contextlib.ExitStack() as stores:
        demo.write_checkpoint(Path(workdir), weights)
        store = stores.enter_context(ExpertStore(workdir, layout="per_expert", projections=demo.PROJECTIONS))
        pinned_store = page_locked and stores.enter_context(
            ExpertStore(workdir, layout="per_expert", projections=demo.PROJECTIONS, host_allocator=page_locked))
        stack, device = stack_class(base, router, weights), _device(framework)
        add("resident", None, None, [(s, s, 0.0, 0.0) for s in _resident(stack, states, warmup)], 0.0, None,
            device)
        modes = ("serial", "overlapped") if hasattr(stack, "dispatch") else ("serial",)
        if pinned_store and hasattr(stack, "dispatch"):
            modes += ("overlapped-pinned",)
        for residency in residencies:
            cfg = demo.DemoConfig(layers=layers, experts=experts, top_k=top_k, hidden=hidden, ffn=ffn,
                                  steps=warmup + tokens, residency=residency, frameworks=(framework,))
            for budget in (read_budgets if residency < 1.0 else (None,)):
                for mode in modes:
                    stack.reset_arena(cfg.slots)  # an empty arena per run
                    timed, mib, hit_rate = _streamed(
                        stack, cfg, pinned_store if mode == "overlapped-pinned" else store, states,
                        warmup=warmup, overlapped=mode != "serial", read_budget=budget)
                    add(mode, residency, budget, timed, mib, hit_rate, device)
    return results


def _device(framework: str) -> str:
    if framework == "jax":
        import jax

        return f"{jax.devices()[0].device_kind} (jax {jax.__version__})"
    import mlx.core as mx

    return f"cpu (mlx {mx.__version__})"


def run(models=None, frameworks=None, *, tokens: int = 64, warmup: int = 16, progress: bool = True,
        log=None) -> list[DecodeResult]:
    """``run_model`` over models and frameworks (default: both frameworks found here; JAX on a GPU runs
    :data:`GPU_MODELS`, on a CPU and MLX :data:`CPU_MODELS`)."""
    from kq import demo

    frameworks = frameworks or demo.available_frameworks()
    work = []
    for framework in frameworks:
        names = models or (GPU_MODELS if framework == "jax" and _on_gpu() else CPU_MODELS)
        work += [(framework, name) for name in names]
    results = []
    with progress_bar(len(work), enabled=progress, description="kq bench decode-e2e") as advance:
        for framework, name in work:
            results += run_model(framework, name, tokens=tokens, warmup=warmup, log=log)
            advance(f"{framework} {name}")
    return results


def _on_gpu() -> bool:
    import jax

    return jax.default_backend() == "gpu"


def format_table(results: list[DecodeResult]) -> str:
    header = ("framework", "model", "mode", "residency", "budget", "tok/s", "x resident", "token ms", "wait ms",
              "boundary ms", "publish ms", "bookkeeping ms", "MiB read/token", "h2d ms", "hit rate")
    resident = {(r.framework, r.model): r.tokens_per_s for r in results if r.mode == "resident"}
    rows = [(r.framework, r.model, r.mode, "-" if r.residency is None else f"{r.residency:.0%}",
             "-" if r.read_budget is None else r.read_budget, f"{r.tokens_per_s:.1f}",
             f"{r.tokens_per_s / resident[(r.framework, r.model)]:.3f}", f"{r.token_ms:.2f}", f"{r.wait_ms:.2f}",
             f"{r.boundary_ms:.2f}", f"{r.publish_ms:.2f}", f"{r.bookkeeping_ms:.2f}", f"{r.mib_read_per_token:.1f}",
             f"{r.h2d_ms:.2f}", "-" if r.hit_rate is None else f"{r.hit_rate:.3f}") for r in results]
    return render_table(header, rows, left=(0, 1, 2))


def write_json(results: list[DecodeResult], path: str) -> None:
    payload = {"date": time.strftime("%Y-%m-%d"), "machine": platform.platform(), "python": platform.python_version(),
               "numpy": np.__version__, "method": __doc__, "results": [asdict(r) for r in results]}
    with open(path, "w") as handle:
        json.dump(payload, handle, indent=1)
