"""Greedy decode through mlx-lm: the unmodified model beside the same model on arenas, tokens per second.

The shipped checkpoint (``models/stdlib-moe``) as it is and quantized by mlx-lm's ``nn.quantize``
(4-bit, group 32), and the deeper one (``models/wheels-moe``, 16 layers) as stored (4-bit), on MLX's
default device (the GPU where there is one). Every loop decodes the way an
engine does, greedily and autoregressively, the next token's input kept on the device:

* ``unmodified``: the model as mlx-lm ships it, the next token dispatched (``mx.async_eval``) before
  the host reads this one, as ``mlx_lm.generate`` runs it;
* ``per-layer``: the arena, each token evaluated, then each layer's ``report()`` read back on its own
  and ``manager.step`` (the adapter's loop before one readback per token);
* ``packed``: :func:`kq_mlx.mlx_lm_adapter.generate_greedy` without overlap: one readback per token
  (every layer's report packed with the token; a pass that ran every layer resident, its token alone, the
  reports of such passes read in batches), then the boundary;
* ``dispatch-first``: the next token built and dispatched, then this token read back and its boundary
  run (a read may wait for the token in flight behind it as well);
* ``overlapped``: ``generate_greedy``: the next token built, this token read back, the next token
  dispatched, then this token's boundary (misses shed: the lossy rule);
* ``tier``: the same with rule ``"tier"``: each miss served from a 3-bit copy (groups of 32) of every
  expert, on the device;
* ``exact``: ``generate_greedy(exact=True)``: a token that missed runs again layer by layer once its
  misses are read (on its critical path), and while tokens need reads the next runs layer by layer at
  once; the prompt fed a token a pass; its tokens are checked against the unmodified model fed the same
  way, at every residency.

Each arena row also has the hit rate, the experts read on the critical path (the reads of the
layer-by-layer passes, before their layers ran), the runs again (passes dropped for missing) and the
passes run layer by layer (a run again's and those run so at once) per token (exact), and the MiB the
manager read per token (after the preload), over all ``warmup + tokens``.

The token taken apart, at 100% only (the slot tables never change, so every expert must be resident):

* ``fixed-tables``: the arena's graph decoded as ``unmodified`` is, nothing but the token read back;
* ``fixed-tables+readback``: the same with every layer's report packed, evaluated with its token and
  read back as the arena loops read it, no ``manager.step``, no ``set_tables``.

``unmodified`` to ``fixed-tables`` is the graph's cost; ``fixed-tables`` to ``+readback`` the packed
reports'; from there to ``overlapped`` the host's boundary. Those loops, ``unmodified`` and
``overlapped-phases`` (``generate_greedy``'s order, written out) also time each token's host phases
(medians, ms): ``build`` (the graph built), ``dispatch`` (``mx.async_eval``), ``read`` (waiting for the
token and copying it, and its reports, back), ``step`` (``manager.step``) and ``tables``
(:func:`~kq_mlx.mlx_lm_adapter.set_tables`).

Each row also has the floor it could reach (:func:`kq.bench.floor.floor_columns`): 1 / max(the
unmodified model's token time, the token's critical bytes / the read bandwidth of the misses' path), and
``x_floor`` beside ``x_resident`` (over the unmodified model's median round). A token's critical bytes
(``critical_mib_per_token``) are the exact loop's misses read on its critical path (0 in the other loops,
whose reads land at a later boundary: ``mib_per_token`` counts them). The bandwidth (``read_gib_per_s``)
is measured in the same run, per checkpoint: its experts read through
:class:`~kq_host.expert_store.ExpertStore` (the reads a streaming engine makes; the loops below read
their misses from memory), by the residency manager's number of workers, the page cache warm, and on
a GPU each expert's bytes copied into an MLX array and evaluated (page cache to memory on a CPU or
unified memory).

Each arena loop runs at 100% residency (every expert preloaded: the adapter's own cost; its tokens are
compared with the unmodified model's) and at 25% (experts read between tokens by the residency
manager; host copies of the model's experts are the 'disk', :func:`host_loader`, so this is the arena's
cost, not an SSD's). Steady
state: the last ``tokens`` of ``warmup + tokens`` over the time they took (work done every few tokens, as
reports credited in batches, counted), each loop run ``rounds`` times, the loops interleaved within a round,
the median round reported with the range.

    python -m kq.bench.jobs mlx_decode --json out/mlx_decode.json [--residencies 1.0] [--variants 0 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from kq.bench.common import run_header, write_json
from kq.study import SHIPPED_MODEL

MODELS = SHIPPED_MODEL.parent
# (name, checkpoint, quantized by nn.quantize here)
VARIANTS = (("stdlib-moe", MODELS / "stdlib-moe", False),
            ("stdlib-moe", MODELS / "stdlib-moe", True),
            ("wheels-moe", MODELS / "wheels-moe", False))
PROMPT = "def read_config(path):\n"
MODES = ("per-layer", "packed", "dispatch-first", "overlapped", "overlapped-phases", "tier", "exact")
FIXED_TABLE_MODES = ("fixed-tables", "fixed-tables+readback")


class Phases:
    """Each token's host time split into named phases: ``mark(name)`` ends the phase begun at the last
    mark (or ``start``)."""

    def __init__(self):
        self.spans: dict[str, list[float]] = {}
        self.last = time.perf_counter()

    def start(self) -> None:
        self.last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.spans.setdefault(name, []).append(now - self.last)
        self.last = now

    def medians_ms(self, tokens: int) -> dict[str, float]:
        return {name: 1e3 * statistics.median(spans[-tokens:]) for name, spans in self.spans.items()}


def unmodified_loop(model, prompt: list[int], steps: int, phases: Phases) -> tuple[list[int], list[float]]:
    """Greedy tokens and the time each arrived, the next token dispatched before this one is read."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache, tokens, stamps = make_prompt_cache(model), [], []
    token = mx.argmax(model(mx.array([prompt]), cache=cache)[0, -1], axis=-1)
    mx.async_eval(token)
    for _ in range(steps):
        phases.start()
        following = mx.argmax(model(token.reshape(1, 1), cache=cache)[0, -1], axis=-1)
        phases.mark("build")
        mx.async_eval(following)
        phases.mark("dispatch")
        tokens.append(int(token.item()))
        phases.mark("read")
        stamps.append(time.perf_counter())
        token = following
    return tokens, stamps


def unmodified_fed(model, prompt: list[int], steps: int) -> list[int]:
    """The unmodified model's greedy tokens with the prompt fed a token a pass, as the exact loop feeds it."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache, tokens = make_prompt_cache(model), []
    for token in prompt[:-1]:
        mx.eval(model(mx.array([[token]]), cache=cache))
    x = mx.array([prompt[-1:]])
    for _ in range(steps):
        tokens.append(int(mx.argmax(model(x, cache=cache)[0, -1], axis=-1).item()))
        x = mx.array([tokens[-1:]])
    return tokens


def _per_layer(model, blocks, manager, prompt: list[int], steps: int) -> list[int]:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from kq_mlx.mlx_lm_adapter import set_tables

    cache, tokens, x = make_prompt_cache(model), [], mx.array([prompt])
    set_tables(blocks, manager.snapshot())
    for _ in range(steps):
        token = mx.argmax(model(x, cache=cache)[0, -1], axis=-1)
        mx.eval(token)
        set_tables(blocks, manager.step([block.report() for block in blocks]))
        tokens.append(int(token.item()))
        x = token.reshape(1, 1)
    return tokens


def _dispatch_first(model, blocks, manager, prompt: list[int], steps: int) -> list[int]:
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    from kq_host.residency import LayerReport
    from kq_mlx.mlx_lm_adapter import pack_reports, set_tables

    cache, tokens, x, pending = make_prompt_cache(model), [], mx.array([prompt]), None

    def boundary(token, packed):
        tokens.append(int(token.item()))
        set_tables(blocks, manager.step(LayerReport.from_packed(np.array(packed))))

    set_tables(blocks, manager.snapshot())
    for _ in range(steps):
        token = mx.argmax(model(x, cache=cache)[0, -1], axis=-1)
        packed = pack_reports(blocks)
        mx.async_eval(token, packed)
        if pending is not None:
            boundary(*pending)
        pending, x = (token, packed), token.reshape(1, 1)
    boundary(*pending)
    return tokens


def _overlapped_phases(model, blocks, manager, prompt: list[int], steps: int, phases: Phases) -> list[int]:
    """:func:`~kq_mlx.mlx_lm_adapter.generate_greedy`'s overlapped order, each phase timed."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    from kq_host.residency import LayerReport
    from kq_mlx.mlx_lm_adapter import pack_reports, set_tables

    cache, tokens, x, pending = make_prompt_cache(model), [], mx.array([prompt]), None
    set_tables(blocks, manager.snapshot())

    for _ in range(steps):
        phases.start()
        token = mx.argmax(model(x, cache=cache)[0, -1], axis=-1)
        packed = pack_reports(blocks)
        phases.mark("build")
        if pending is not None:
            tokens.append(int(pending[0].item()))
            landed = np.array(pending[1])
            phases.mark("read")
        mx.async_eval(token, packed)
        phases.mark("dispatch")
        if pending is not None:
            tables = manager.step(LayerReport.from_packed(landed))
            phases.mark("step")
            set_tables(blocks, tables)
            phases.mark("tables")
        pending, x = (token, packed), token.reshape(1, 1)
    tokens.append(int(pending[0].item()))
    set_tables(blocks, manager.step(LayerReport.from_packed(np.array(pending[1]))))
    return tokens


def fixed_tables_loop(model, blocks, manager, prompt: list[int], steps: int, phases: Phases, *, read_reports: bool):
    """The arena's graph on the manager's first tables, dispatched as :func:`unmodified_loop`; with
    ``read_reports`` every layer's report packed, evaluated with the token and read back. Tokens, stamps."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    from kq_mlx.mlx_lm_adapter import pack_reports, set_tables

    set_tables(blocks, manager.snapshot())
    cache, tokens, stamps = make_prompt_cache(model), [], []

    def forward(x):
        token = mx.argmax(model(x, cache=cache)[0, -1], axis=-1)
        packed = pack_reports(blocks) if read_reports else None
        phases.mark("build")
        mx.async_eval(token, *([packed] if read_reports else []))
        phases.mark("dispatch")
        return token, packed

    token, packed = forward(mx.array([prompt]))
    for _ in range(steps):
        phases.start()
        following = forward(token.reshape(1, 1))
        tokens.append(int(token.item()))
        if read_reports:
            np.array(packed)
        phases.mark("read")
        stamps.append(time.perf_counter())
        token, packed = following
    return tokens, stamps


class _Stamped:
    """A residency manager whose ``step`` notes when each token's boundary began, and which counts the passes
    the exact loop ran layer by layer (``next_token``: a token run again, or run so at once)."""

    def __init__(self, manager):
        self.manager, self.stamps, self.layered = manager, [], 0

    def next_token(self):
        self.layered += 1
        return self.manager.next_token()

    def __getattr__(self, name):
        return getattr(self.manager, name)

    def step(self, reports):
        self.stamps.append(time.perf_counter())
        return self.manager.step(reports)


def checkpoint_store(checkpoint: Path):
    """An :class:`~kq_host.expert_store.ExpertStore` over an mlx-lm checkpoint's experts: one tensor per expert
    and projection (Hugging Face's names) or stacked ``[E, ...]`` under ``switch_mlp`` (every array of a
    projection: a quantized one's weight, scales and biases).

    Raises:
        ValueError: the checkpoint has neither layout (the message names its directory).
    """
    from kq_host.expert_store import PER_EXPERT_TEMPLATE, ExpertStore

    store = ExpertStore(checkpoint)
    if PER_EXPERT_TEMPLATE.format(layer=0, expert=0, projection="gate_proj") in store.tensors:
        return store
    store.close()
    prefix = "model.layers.0.mlp.switch_mlp."
    arrays = sorted(name[len(prefix):] for name in store.tensors if name.startswith(prefix))
    if not arrays:
        raise ValueError(f"checkpoint_store: {checkpoint} holds no experts under Hugging Face's per-expert names "
                         f"or mlx-lm's {prefix}*")
    return ExpertStore(checkpoint, layout="stacked", projections=arrays,
                       template="model.layers.{layer}.mlp.switch_mlp.{projection}")


def _mlx_to_device(payload) -> None:
    """An expert's bytes copied into MLX arrays on the default device, evaluated."""
    import mlx.core as mx
    import numpy as np

    mx.eval([mx.array(np.ascontiguousarray(array).view(np.uint8)) for array in payload.values()])


def read_gib_per_s(checkpoint: Path) -> float:
    """The misses' path's read bandwidth over ``checkpoint``'s experts
    (:func:`kq.bench.floor.miss_path_gib_per_s`); on a GPU each read also goes into MLX arrays."""
    import mlx.core as mx

    from kq.bench.floor import miss_path_gib_per_s

    config = json.loads((checkpoint / "config.json").read_text())
    with checkpoint_store(checkpoint) as store:
        return miss_path_gib_per_s(store, config["num_hidden_layers"], config["num_experts"],
                                   to_device=_mlx_to_device if mx.default_device() == mx.gpu else None)


def load_model(checkpoint: Path, quantized: bool):
    """``(model, tokenizer)`` from an mlx-lm checkpoint, evaluated: float32 on MLX's CPU, quantized (4-bit,
    groups of 32) by ``nn.quantize`` with ``quantized``."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm import load

    model, tokenizer = load(str(checkpoint))
    if mx.default_device() == mx.cpu:
        model.set_dtype(mx.float32)  # MLX's CPU gather_mm takes float32
    if quantized:
        nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model, tokenizer


def num_experts_of(model) -> int:
    """The routed experts a layer of the job's models has (Qwen3-MoE: ``mlp.switch_mlp``)."""
    return model.layers[0].mlp.switch_mlp.gate_proj.weight.shape[0]


def host_loader(blocks):
    """A residency manager's loader over host copies of every expert, made once
    (:meth:`~kq_mlx.mlx_lm_adapter.ArenaLayer.stacked_expert_weights`): an in-memory 'disk' as the page
    cache holds a checkpoint's, whose reads touch no device."""
    stacked = [block.stacked_expert_weights() for block in blocks]
    return lambda layer, expert, slot: {key: array[expert] for key, array in stacked[layer].items()}


def arena_manager(blocks, slots: int, loader):
    """A residency manager over ``blocks``' arenas of ``slots`` slots, each read counted at one expert's bytes;
    every expert preloaded where the arenas hold them all, none otherwise (the arenas start cold)."""
    import numpy as np

    from kq_host.residency import ResidencyManager
    from kq_mlx.mlx_lm_adapter import SwitchGLUArena

    num_experts = blocks[0].num_experts
    expert_bytes = sum(int(np.prod(shape)) * np.dtype(dtype).itemsize
                       for shape, dtype in blocks[0].slot_layout().values())
    manager = ResidencyManager(len(blocks), num_experts, slots, arena=SwitchGLUArena(blocks),
                               bytes_per_expert=expert_bytes, loader=loader)
    for layer in range(len(blocks)):
        manager.preload(layer, range(slots) if slots == num_experts else [])
    return manager


def tok_s_of(stamps: list[float], tokens: int) -> float:
    """Tokens per second over the last ``tokens`` of ``stamps`` (each token's arrival): ``tokens`` over the
    time they took, so work done every few tokens (reports credited in batches) counts as it is paid."""
    return tokens / (stamps[-1] - stamps[-tokens - 1])


def _arena_run(checkpoint: Path, quantized: bool, residency: float, mode: str, prompt: list[int], steps: int,
               phases: Phases):
    """One arena loop on a freshly loaded model: its tokens, the time each token arrived (through
    ``generate_greedy``'s ``on_token``; each token's boundary in the loops written out here), and the
    manager's counts."""
    import kq_mlx.mlx_lm_adapter as adapter
    from kq_mlx.tier import arena_tier
    from kq_mlx.mlx_lm_adapter import attach_arena, attach_tier, generate_greedy

    model, _ = load_model(checkpoint, quantized)
    num_experts = num_experts_of(model)
    slots = max(1, int(round(residency * num_experts)))
    blocks = attach_arena(model, slots)
    manager = _Stamped(arena_manager(blocks, slots, host_loader(blocks)))
    expert_bytes = manager.bytes_per_expert
    preloaded = manager.stats()[1]
    stamps, reruns = manager.stamps, 0
    if mode in FIXED_TABLE_MODES:
        got, stamps = fixed_tables_loop(model, blocks, manager, prompt, steps, phases,
                                    read_reports=mode.endswith("readback"))
    elif mode == "overlapped-phases":
        got = _overlapped_phases(model, blocks, manager, prompt, steps, phases)
    elif mode == "per-layer":
        got = _per_layer(model, blocks, manager, prompt, steps)
    elif mode == "dispatch-first":
        got = _dispatch_first(model, blocks, manager, prompt, steps)
    else:  # generate_greedy's loops: each token's time is its arrival (a boundary may credit several)
        stamps = []
        if mode == "tier":
            attach_tier(blocks, arena_tier(checkpoint, bits=3))  # the 3-bit tier its recorded runs used
            for block in blocks:
                block.rule = "tier"
        # The exact loop feeds the prompt a token a pass (each pass's misses read on its critical path), as
        # its reference (unmodified_fed) does, not through prefill in mlx-lm's order. Every pass it reads is
        # kept from the graph (a step), run layer by layer (next_token) or dropped for missing: the last
        # are the runs again.
        passes_read, read_token = [0], adapter._read_token
        adapter._read_token = lambda token: passes_read.__setitem__(0, passes_read[0] + 1) or read_token(token)
        try:
            got = generate_greedy(model, blocks, manager, prompt, steps, overlap=mode != "packed",
                                  exact=mode == "exact", prefill_prompt=False if mode == "exact" else None,
                                  on_token=lambda token: stamps.append(time.perf_counter()))
        finally:
            adapter._read_token = read_token
        reruns = passes_read[0] - len(manager.stamps) - manager.layered
    manager.close()
    stats = manager.stats()[1].since(preloaded)
    # Critical reads: the experts the layer-by-layer passes read before their layers ran (acquire).
    critical = int(manager.lookahead_stats()["critical_reads"].sum())
    counts = dict(hit_rate=stats.hit_rate, critical_per_token=critical / steps,
                  critical_mib_per_token=critical / steps * expert_bytes / 2**20,
                  reruns_per_token=reruns / steps,
                  layered_per_token=manager.layered / steps, mib_per_token=stats.bytes_read / steps / 2**20)
    return got, stamps, counts


def run(tokens: int = 64, warmup: int = 16, residencies=(1.0, 0.25), rounds: int = 3, variants=VARIANTS,
        modes=MODES) -> dict:
    """Every loop ``rounds`` times, the loops interleaved within a round; a row is a loop's median round."""

    from kq.bench.floor import floor_columns
    from kq_host.checkpoint import Quantization

    steps = warmup + tokens
    rows = []
    for name, checkpoint, quantized in variants:
        bandwidth = read_gib_per_s(checkpoint)
        model, tokenizer = load_model(checkpoint, quantized)
        prompt = tokenizer.encode(PROMPT)
        loops = ([("unmodified", 1.0)] + [(mode, 1.0) for mode in FIXED_TABLE_MODES if 1.0 in residencies]
                 + [(mode, residency) for residency in residencies for mode in modes])
        runs: dict[tuple[str, float], list[dict]] = {loop: [] for loop in loops}
        want, want_fed = None, unmodified_fed(model, prompt, steps) if "exact" in modes else None
        for _ in range(rounds):
            for mode, residency in loops:
                phases = Phases()
                if mode == "unmodified":
                    got, stamps = unmodified_loop(model, prompt, steps, phases)
                    want = want or got
                    counts = dict(hit_rate=None)
                else:
                    got, stamps, counts = _arena_run(checkpoint, quantized, residency, mode, prompt, steps, phases)
                runs[mode, residency].append(dict(tok_s=tok_s_of(stamps, tokens), **counts,
                                                  same_tokens=got == (want_fed if mode == "exact" else want),
                                                  phases_ms=phases.medians_ms(tokens)))
        unmodified = sorted(r["tok_s"] for r in runs["unmodified", 1.0])[rounds // 2]
        for (mode, residency), done in runs.items():
            ordered = sorted(done, key=lambda r: r["tok_s"])
            middle = ordered[len(done) // 2]
            critical_mib = middle.get("critical_mib_per_token", 0.0)
            rows.append(dict(model=name, quantized=quantized or Quantization.of(checkpoint) is not None, mode=mode,
                             residency=residency, tok_s=middle["tok_s"],
                             tok_s_range=[ordered[0]["tok_s"], ordered[-1]["tok_s"]], hit_rate=middle["hit_rate"],
                             same_tokens=all(r["same_tokens"] for r in done),
                             **{key: middle[key] for key in ("critical_per_token", "reruns_per_token",
                                                             "layered_per_token", "mib_per_token") if key in middle},
                             unmodified_tok_s=unmodified, read_gib_per_s=bandwidth, critical_mib_per_token=critical_mib,
                             **floor_columns(middle["tok_s"], unmodified, critical_mib, bandwidth),
                             **({"phases_ms": middle["phases_ms"]} if middle["phases_ms"] else {})))
            print(json.dumps(rows[-1]), flush=True)
    return {**run_header("mlx"), "tokens": tokens, "warmup": warmup,
            "rounds": rounds, "rows": rows}


def _residency(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"a residency is a fraction in (0, 1], got {text}")
    return value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="runs of every loop, interleaved")
    parser.add_argument("--residencies", type=_residency, nargs="+", default=[1.0, 0.25])
    parser.add_argument("--variants", nargs="+", type=int, choices=range(len(VARIANTS)),
                        default=list(range(len(VARIANTS))),
                        help="indices into " + ", ".join(f"{i}: {n}{' 4-bit' if q else ''}"
                                                         for i, (n, _, q) in enumerate(VARIANTS)))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="the arena loops (unmodified and the fixed-table loops always run)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    result = run(args.tokens, args.warmup, tuple(args.residencies), args.rounds,
                 tuple(VARIANTS[i] for i in args.variants), tuple(args.modes))
    if args.json:
        write_json(args.json, result)
    # Every expert resident, every loop must give the unmodified model's tokens; the exact loop, at any residency.
    return 0 if all(r["same_tokens"] for r in result["rows"] if r["residency"] == 1.0 or r["mode"] == "exact") else 1
