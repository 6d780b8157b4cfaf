"""``kq demo --random``: a stack of random MoE blocks decoding with a fraction of its experts resident.

Builds random weights for ``layers`` Qwen3-MoE-style blocks (softmax top-k
router, renormalised; SwiGLU experts), saves them as safetensors (one tensor per
expert, HF names) in a temporary directory, and decodes ``steps`` tokens twice
per framework: with every expert in memory, and streamed, with ``residency`` of
each layer's experts in an arena fed by the residency manager and real file
reads through :class:`kq_host.expert_store.ExpertStore`. The hidden states drift
slowly from step to step, so routing has the temporal locality real decode has.

Random weights are not a trained router: the numbers show the mechanism and its
costs, not the quality loss of a real model.
"""

from __future__ import annotations

import importlib.util
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from kq.terminal import render_figures, render_table, wrap
from kq_core.contract import EXPERT_PROJECTIONS, MAX_TOP_K
from kq_host.expert_store import ExpertStore
from kq_host.residency import LayerReport, ResidencyManager

PROJECTIONS = EXPERT_PROJECTIONS
POLICY_WORDS = {"lfu": "the least frequently used expert is evicted first, its counts decayed over time",
                "lru": "the least recently used expert is evicted first"}


@dataclass
class DemoConfig:
    layers: int = 8
    experts: int = 64
    top_k: int = 8
    hidden: int = 256
    ffn: int = 128
    rows: int = 1
    steps: int = 200
    residency: float = 0.25
    policy: str = "lfu"
    keep_mass: float = 0.9
    read_budget: int | None = None
    drift: float = 0.05
    seed: int = 0
    queue_depth: int = 8
    frameworks: tuple[str, ...] = ("jax", "mlx")

    def __post_init__(self):
        positive = {"layers": self.layers, "experts": self.experts, "hidden": self.hidden, "ffn": self.ffn,
                    "rows": self.rows, "steps": self.steps}
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"--{name} must be at least 1, got {value}")
        if not 1 <= self.top_k <= min(self.experts, MAX_TOP_K):
            raise ValueError(f"--top-k must be in [1, min(--experts, {MAX_TOP_K})] = [1, "
                             f"{min(self.experts, MAX_TOP_K)}], got {self.top_k}")
        if not 0.0 < self.residency <= 1.0:
            raise ValueError(f"--residency is the fraction of each layer's experts in the arena, in (0, 1]; "
                             f"got {self.residency}")
        if not 0.0 <= self.keep_mass <= 1.0:
            raise ValueError(f"--keep-mass must be in [0, 1], got {self.keep_mass}")
        if self.read_budget is not None and self.read_budget < 0:
            raise ValueError(f"--read-budget must be at least 0 reads per step, got {self.read_budget}")
        if self.queue_depth < 0:
            raise ValueError(f"queue_depth is the number of loader threads, at least 0 (0 reads inline); "
                             f"got {self.queue_depth}")
        if self.policy not in ("lfu", "lru"):
            raise ValueError(f"--policy must be lfu or lru, got {self.policy!r}")

    @property
    def slots(self) -> int:
        return max(self.top_k, int(round(self.residency * self.experts)))


@dataclass
class RunTrace:
    """Per-step series of one streamed run, and its summary numbers."""

    framework: str
    hit_rate: list[float] = field(default_factory=list)
    shed_experts: list[float] = field(default_factory=list)  # per step, over all layers and rows
    shed_mass: list[float] = field(default_factory=list)  # fraction of routed mass shed, per step
    over_budget: list[int] = field(default_factory=list)
    bytes_read: list[int] = field(default_factory=list)
    divergence: list[float] = field(default_factory=list)  # ||y_stream - y_resident|| / ||y_resident||
    boundary_ms: list[float] = field(default_factory=list)  # host time in ResidencyManager.step
    resident_steps_per_s: float = 0.0
    streamed_steps_per_s: float = 0.0


# ---- weights and inputs -----------------------------------------------------------------------


def make_weights(cfg: DemoConfig, rng: np.random.Generator):
    """Router ``[L, D, E]`` (f32) and experts ``{proj: [L, E, out, in]}`` (f16, as stored)."""
    router = (rng.normal(size=(cfg.layers, cfg.hidden, cfg.experts)) / np.sqrt(cfg.hidden) * 4).astype(np.float32)
    shapes = {"gate_proj": (cfg.ffn, cfg.hidden), "up_proj": (cfg.ffn, cfg.hidden), "down_proj": (cfg.hidden, cfg.ffn)}
    experts = {p: (rng.normal(size=(cfg.layers, cfg.experts, *shape)) / np.sqrt(shape[1])).astype(np.float16)
               for p, shape in shapes.items()}
    return router, experts


def write_checkpoint(directory: Path, experts) -> None:
    from safetensors.numpy import save_file

    layers = next(iter(experts.values())).shape[0]
    for layer in range(layers):  # one shard per layer, one tensor per expert and projection
        save_file({f"model.layers.{layer}.mlp.experts.{e}.{p}.weight": np.ascontiguousarray(experts[p][layer, e])
                   for p in PROJECTIONS for e in range(experts[p].shape[1])},
                  str(directory / f"model-{layer:05d}.safetensors"))


def hidden_states(cfg: DemoConfig, rng: np.random.Generator):
    """``[rows, D]`` per step, drifting slowly (unit RMS)."""
    h = rng.normal(size=(cfg.rows, cfg.hidden))
    for _ in range(cfg.steps):
        h = (1 - cfg.drift) * h + np.sqrt(2 * cfg.drift) * rng.normal(size=h.shape)
        yield (h / np.sqrt((h**2).mean(axis=1, keepdims=True))).astype(np.float32)


# ---- framework stacks -------------------------------------------------------------------------


class JaxStack:
    """The block stack in JAX, ``x <- x + moe_l(x)`` over layers, one jitted function per step."""

    name = "jax"

    def __init__(self, cfg: DemoConfig, router, experts):
        import jax
        import jax.numpy as jnp

        from kq_jax.arena import JaxArena, pack_reports
        from kq_jax.arena_moe import moe_ffn_arena
        from kq_jax.moe import Experts, moe_ffn_resident

        self.router = jnp.asarray(router)
        self.experts = Experts(*(jnp.asarray(experts[p]).astype(jnp.float32) for p in PROJECTIONS))
        self._new_arena = lambda slots: JaxArena(cfg.layers, slots, {p: (experts[p].shape[2:], np.float32)
                                                                     for p in PROJECTIONS})
        self.arena = self._new_arena(cfg.slots)

        def resident(x, router, weights):
            for layer in range(cfg.layers):
                x = x + moe_ffn_resident(x, router[layer], Experts(*(w[layer] for w in weights)), top_k=cfg.top_k)
            return x

        def streamed(x, router, arrays, tables):
            routings = []
            for layer in range(cfg.layers):
                arena = Experts(*(arrays[p][layer] for p in PROJECTIONS))
                y, routing = moe_ffn_arena(x, router[layer], arena, tables[layer], top_k=cfg.top_k)
                x = x + y
                routings.append(routing)
            return x, pack_reports(routings)

        self._resident, self._streamed = jax.jit(resident), jax.jit(streamed)

    def resident_step(self, h):
        return np.asarray(self._resident(h, self.router, self.experts))

    def reset_arena(self, slots: int) -> None:
        """An empty arena of ``slots`` slots per layer in place of the current one."""
        self.arena = self._new_arena(slots)

    def dispatch(self, h, tables):
        """Queues one streamed step; returns its device outputs ``(y, packed reports)`` at once."""
        return self._streamed(h, self.router, self.arena.arrays, tables)

    @staticmethod
    def readback(out):
        """Waits for a dispatched step: its output and every layer's report, in one transfer each."""
        y, packed = out
        from kq_host.residency import LayerReport

        return np.asarray(y), LayerReport.from_packed(np.asarray(packed))

    def streamed_step(self, h, tables):
        """Returns the output (evaluated: the fence) and the layers' reports (one LayerReport, [L, T, K])."""
        return self.readback(self.dispatch(h, tables))


class MlxStack:
    """The block stack on mlx-lm's ``Qwen3MoeSparseMoeBlock``, streamed through ``ArenaMoeBlock``."""

    name = "mlx"

    def __init__(self, cfg: DemoConfig, router, experts):
        import mlx.core as mx
        from mlx_lm.models import qwen3_moe

        self.mx = mx
        mx.set_default_device(mx.cpu)
        args = qwen3_moe.ModelArgs(
            model_type="qwen3_moe", hidden_size=cfg.hidden, num_hidden_layers=cfg.layers,
            intermediate_size=cfg.ffn, num_attention_heads=1, num_experts=cfg.experts,
            num_experts_per_tok=cfg.top_k, decoder_sparse_step=1, mlp_only_layers=[],
            moe_intermediate_size=cfg.ffn, rms_norm_eps=1e-6, vocab_size=1, num_key_value_heads=1,
            head_dim=cfg.hidden, rope_theta=1e4, tie_word_embeddings=False, max_position_embeddings=1,
            norm_topk_prob=True)
        self.blocks = []
        for layer in range(cfg.layers):
            block = qwen3_moe.Qwen3MoeSparseMoeBlock(args)
            block.gate.weight = mx.array(router[layer].T)
            for p in PROJECTIONS:
                getattr(block.switch_mlp, p).weight = mx.array(experts[p][layer].astype(np.float32))
            self.blocks.append(block)
        self.reset_arena(cfg.slots)

    def reset_arena(self, slots: int) -> None:
        """An empty arena of ``slots`` slots per layer in place of the current one."""
        from kq_mlx.mlx_lm_adapter import ArenaMoeBlock, SwitchGLUArena

        self.arena_blocks = [ArenaMoeBlock(block, slots) for block in self.blocks]
        self.arena = SwitchGLUArena(self.arena_blocks)

    def _run(self, blocks, h):
        x = self.mx.array(h)
        for block in blocks:
            x = x + block(x)
        self.mx.eval(x)  # the fence: every gather of this step is done
        return np.array(x)

    def resident_step(self, h):
        return self._run(self.blocks, h)

    def streamed_step(self, h, tables):
        from kq_mlx.mlx_lm_adapter import set_tables

        set_tables(self.arena_blocks, tables)
        y = self._run(self.arena_blocks, h)
        return y, LayerReport.stacked([block.report() for block in self.arena_blocks])


STACKS = {"jax": (JaxStack, "jax"), "mlx": (MlxStack, "mlx_lm")}


def available_frameworks() -> tuple[str, ...]:
    return tuple(name for name, (_, module) in STACKS.items() if importlib.util.find_spec(module) is not None)


# ---- the run ----------------------------------------------------------------------------------


def steady_half(cfg: DemoConfig) -> slice:
    """The steps the steady-state figures are taken over: the second half (warm-up reads are done)."""
    return slice(cfg.steps // 2, None)


def _quiet(phase: str) -> None:
    """A ``say`` that says nothing."""


def run_framework(stack, cfg: DemoConfig, store: ExpertStore, states, say: Callable[[str], None] = _quiet) -> RunTrace:
    """Both runs of one framework. Steps/s and the boundary are steady-state figures: each step's wall
    time over the second half of the run, the compiles done before the clock (one call of each step
    function on the first state). ``say(phase)`` is called as the decoding starts."""
    trace = RunTrace(stack.name)
    with ResidencyManager(cfg.layers, cfg.experts, cfg.slots, loader=lambda l, e, s: store.read_expert(l, e),
                          arena=stack.arena, policy=cfg.policy, keep_mass=cfg.keep_mass, read_budget=cfg.read_budget,
                          queue_depth=cfg.queue_depth, bytes_per_expert=store.expert_nbytes(0)) as manager:
        tables = manager.snapshot()
        stack.resident_step(states[0])
        stack.streamed_step(states[0], tables)  # compiles; the manager sees none of it
        say(f"{stack.name}: decoding {cfg.steps} steps resident, then streamed")
        resident, resident_s = [], []
        for h in states:
            start = time.perf_counter()
            resident.append(stack.resident_step(h))
            resident_s.append(time.perf_counter() - start)
        streamed_s = []
        _, before = manager.stats()
        for h, want in zip(states, resident):
            start = time.perf_counter()
            y, reports = stack.streamed_step(h, tables)
            boundary = time.perf_counter()
            tables = manager.step(reports)
            manager.raise_failures("kq demo --random")  # a shed read would change the figures unsaid
            streamed_s.append(time.perf_counter() - start)
            trace.boundary_ms.append((time.perf_counter() - boundary) * 1e3)
            _, after = manager.stats()
            step = after.since(before)
            before = after
            trace.hit_rate.append(step.hit_rate)
            trace.shed_experts.append(step.shed_count / cfg.rows)
            trace.shed_mass.append(step.shed_mass / step.routed_mass if step.routed_mass else 0.0)
            trace.over_budget.append(step.over_budget)
            trace.bytes_read.append(step.bytes_read)
            trace.divergence.append(float(np.linalg.norm(y - want) / np.linalg.norm(want)))
        steady = steady_half(cfg)
        trace.resident_steps_per_s = 1.0 / float(np.mean(resident_s[steady]))
        trace.streamed_steps_per_s = 1.0 / float(np.mean(streamed_s[steady]))
    return trace


def run(cfg: DemoConfig, *, say: Callable[[str], None] = _quiet) -> list[RunTrace]:
    """Each of ``cfg.frameworks`` decoding the random stack resident and streamed, one :class:`RunTrace` each.

    ``say(phase)`` is called as each slow phase starts: writing the checkpoint, building each framework's stack
    and compiling its steps, decoding (``kq demo --random`` prints them: :func:`kq.terminal.phase_lines`).
    """
    rng = np.random.default_rng(cfg.seed)
    router, experts = make_weights(cfg, rng)
    states = list(hidden_states(cfg, rng))
    traces = []
    with tempfile.TemporaryDirectory(prefix="kq-demo-") as workdir:
        mib = sum(weights.nbytes for weights in experts.values()) / 2**20
        say(f"writing the random checkpoint ({mib:.1f} MiB of experts) to a temporary directory")
        write_checkpoint(Path(workdir), experts)
        for name in cfg.frameworks:
            stack_class, _ = STACKS[name]
            say(f"{name}: building the stack and compiling its steps")
            with ExpertStore(workdir, layout="per_expert", projections=PROJECTIONS) as store:
                traces.append(run_framework(stack_class(cfg, router, experts), cfg, store, states, say))
    return traces


# The columns of ``kq demo --random``'s two tables: ``(header, what it is)``, a header's two lines its name and
# its unit. :func:`summarize` prints them under the tables, ``kq demo --help`` too.
ROUTING_COLUMNS = (
    ("hit rate\nfirst 10%", "fraction of the routed experts found in the arena over the first tenth of the steps "
                            "(the arena still filling)"),
    ("hit rate\nsteady", "the same over the second half of the steps (steady state)"),
    ("shed experts\nper step", "routed experts not run (not resident), per step and row, over all layers"),
    ("shed mass\nper step", "fraction of the routed gate weight on those experts, per step"),
    ("over-budget\nlayer-steps", "layer-steps whose shed mass exceeded 1 - --keep-mass of their routed mass"),
    ("MiB read\nin all", "expert bytes read from the checkpoint's files over the run"),
)
SPEED_COLUMNS = (
    ("steps/s\nresident", "decode steps per second with every expert in memory, over the second half of the "
                          "steps (the compiles are done before the clock)"),
    ("steps/s\nstreamed", "the same through the arena, the residency manager's step included"),
    ("boundary\nms/step", "host time per step in ResidencyManager.step (credit, publish, evict, prestage), over "
                          "the second half"),
    ("divergence\nmean, max", "||y_streamed - y_resident|| / ||y_resident|| of the stack's output, mean and "
                              "largest over the steps: 0 is the resident output, 1 a change as large as the "
                              "output itself. The weights are random, so this shows the mechanism, not a trained "
                              "model's quality loss (kq study measures that)"),
)


def column_legend(columns=ROUTING_COLUMNS + SPEED_COLUMNS) -> str:
    """What each column of :func:`summarize`'s tables is, one entry a column, within 100 columns."""
    return render_figures([(header.replace("\n", " "), "", what) for header, what in columns])


def summarize(cfg: DemoConfig, traces: list[RunTrace]) -> str:
    """The run's sizes, its two tables (the routing, then speed and divergence) and what each column is."""
    warm = max(1, cfg.steps // 10)
    steady = steady_half(cfg)
    lines = [wrap(f"{cfg.layers} layers x {cfg.experts} experts (top-{cfg.top_k}, hidden {cfg.hidden}, ffn "
                  f"{cfg.ffn}), {cfg.slots} slots per layer ({cfg.slots / cfg.experts:.0%} resident), evicting by "
                  f"{cfg.policy} ({POLICY_WORDS[cfg.policy]}), {cfg.steps} steps of {cfg.rows} row(s)"), ""]
    routing = [(t.framework, f"{np.mean(t.hit_rate[:warm]):.3f}", f"{np.mean(t.hit_rate[steady]):.3f}",
                f"{np.mean(t.shed_experts):.2f}", f"{np.mean(t.shed_mass):.3f}", str(sum(t.over_budget)),
                f"{sum(t.bytes_read) / 2**20:.1f}") for t in traces]
    speed = [(t.framework, f"{t.resident_steps_per_s:.1f}", f"{t.streamed_steps_per_s:.1f}",
              f"{np.mean(t.boundary_ms[steady]):.2f}", f"{np.mean(t.divergence):.4f}, {np.max(t.divergence):.4f}")
             for t in traces]
    lines.append(render_table(("framework", *(h for h, _ in ROUTING_COLUMNS)), routing))
    lines.append("")
    lines.append(render_table(("framework", *(h for h, _ in SPEED_COLUMNS)), speed))
    lines.append("")
    lines.append(column_legend())
    return "\n".join(lines)


def plot(traces: list[RunTrace], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for t in traces:
        top.plot(t.hit_rate, label=t.framework, linewidth=1)
        bottom.plot(t.shed_mass, label=t.framework, linewidth=1)
    top.set_ylabel("hit rate")
    bottom.set_ylabel("shed mass (fraction)")
    bottom.set_xlabel("decode step")
    top.legend()
    top.set_title("kq demo: streamed decode")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
