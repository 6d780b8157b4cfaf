"""Where a full arena's token goes: the decode loop at 100% residency taken apart, in one run.

    python -m kq.bench.jobs decode_floor --json docs/h200/decode_floor.json

For each model of ``kq.bench.decode_e2e`` (recorded routing of its checkpoint, random experts at its
size), with ``route_shed`` as the Pallas kernel and as the jnp reference (on a CPU only the reference:
there the kernel runs in Pallas' interpreter): the resident program on the checkpoint's bfloat16
weights (``resident``, decode-e2e's baseline) and the arena's on an arena holding every expert as
decode-e2e holds them (``arena``: bfloat16, on a CPU its bits as uint16, which XLA writes in place), the
slot tables the identity; on a CPU also the arena's program on a float32 arena (``arena-float32``,
how decode-e2e held a CPU arena before, since XLA's CPU backend writes a bfloat16 slot slowly); and the
tier's program on that arena (``tier``: decode-e2e's ``tier`` mode on tables that could miss, a 3-bit
tier of every expert beside the arena), and the program decode-e2e runs in every mode while the tables
hold every expert (``arena-full-tables``: no ``route_shed``, tier or fetch). ``--programs`` picks them
(``resident`` is always measured).
Each is timed four ways, the programs interleaved within a round (so a round sees every program in one
state of a shared machine), the median of ``--rounds`` rounds of ``--tokens`` tokens with the range:
``floor`` (dispatched back to back, nothing read back: the device's and the dispatch's rate),
``latency`` (each token dispatched and waited for alone), ``loop`` (decode_e2e's loop: token t+1
dispatched before token t is read, one readback per token, no host work after it) and, for the arena,
``loop + step`` (the residency manager's boundary on each token's reports, as the lossy mode runs it).
``x resident`` is the median over rounds of the row's time over ``resident``'s, the same way and round.

Each program's compiled HLO is described beside its timings (``hlo``): the operations of its entry
computation by opcode (each a launch on a GPU, a thunk on a CPU), its fusions and XLA's cost analysis
(flops, bytes accessed).
"""

from __future__ import annotations

import argparse
import collections
import functools
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from kq.bench.common import run_header, write_json
from kq.bench import decode_e2e

WAYS = ("floor", "latency", "loop", "loop + step")
PROGRAMS = ("resident", "arena", "arena-full-tables", "arena-float32", "tier")


def hlo_profile(program, *args) -> dict:
    """A jitted program's compiled HLO at ``args`` (``program`` may be a ``functools.partial`` of one):
    ``{"entry_ops": int, "fusions": int, "by_opcode": {opcode: count}, "flops": float, "bytes_accessed":
    float}``."""
    jitted, keywords = (program.func, program.keywords) if isinstance(program, functools.partial) else (program, {})
    compiled = jitted.lower(*args, **keywords).compile()
    text = compiled.as_text()
    entry = text[text.index("\nENTRY"):]
    opcodes = collections.Counter(re.findall(r"= \S+ ([a-z][\w-]*)\(", entry))
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
    return {"entry_ops": sum(opcodes.values()), "fusions": opcodes.get("fusion", 0),
            "by_opcode": dict(opcodes.most_common()), "flops": float(cost.get("flops", 0.0)),
            "bytes_accessed": float(cost.get("bytes accessed", 0.0))}


def latency_ms(dispatch, first, tokens: int) -> float:
    """The median time of a token dispatched and waited for alone, each on the last one's output, ms."""
    x, seconds = first, []
    for position in range(tokens):
        start = time.perf_counter()
        x, readback = dispatch(x, position)
        readback.block_until_ready()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds) * 1e3


def measure(model: str, impl: str, *, tokens: int, rounds: int, routing, names) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from kq_host.residency import LayerReport, ResidencyManager

    _, layers, hidden, ffn = decode_e2e.RECORDED_MODELS[model]
    routing = tuple(np.ascontiguousarray(a[:tokens, :layers]) for a in routing)
    layers, top_k = routing[0].shape[1:]
    experts = 64
    weights = decode_e2e.random_experts(layers, experts, hidden, ffn, np.random.default_rng(0))
    tier = decode_e2e.random_tier(layers, experts, hidden, ffn) if "tier" in names else None
    engine = decode_e2e.Engine(weights, top_k, tokens, routing=routing, impl=impl, tier=tier)
    del weights
    positions = engine.positions
    tables = jax.device_put(np.tile(np.arange(experts, dtype=np.int32), (layers, 1)))
    if jax.default_backend() == "gpu":
        arena = engine.weights
    else:  # decode-e2e's CPU arena: the bfloat16 bits as uint16
        arena = {name: jax.lax.bitcast_convert_type(a, jnp.uint16) for name, a in engine.weights.items()}
    programs = {"resident": (engine.resident, engine.weights), "arena": (engine.streamed, arena),
                "arena-float32": (engine.streamed, {name: a.astype(jnp.float32) for name, a in
                                                      engine.weights.items()}),
                "arena-full-tables": (engine.full, arena), "tier": (engine.tiered, arena)}
    programs = {name: program for name, program in programs.items() if name == "resident" or name in names}
    dispatches, boundaries, hlo = {}, {}, {}
    for name, (program, arrays) in programs.items():
        extra = (arrays,) if program is engine.resident else (arrays, tables)
        dispatches[name] = lambda x, p, program=program, extra=extra: program(x, positions[p], *extra)
        hlo[name] = hlo_profile(program, engine.first, positions[0], *extra)
        dispatches[name](engine.first, 0)[1].block_until_ready()  # compile
        boundaries[name] = {"loop": lambda position, packed: False}
        if name.startswith("arena"):
            manager = ResidencyManager(layers, experts, experts, loader=lambda l, e, s: None)
            for layer in range(layers):
                manager.preload(layer, range(experts))

            def step(position, packed, manager=manager):
                manager.step(LayerReport.from_packed(packed))
                return False

            boundaries[name]["loop + step"] = step
    per_token = collections.defaultdict(list)  # (program, way) -> seconds per token, one per round
    for round_ in range(rounds + 1):  # the first round warms
        for name, dispatch in dispatches.items():
            timed = {"floor": 1.0 / decode_e2e.device_floor(dispatch, engine.first, tokens),
                     "latency": latency_ms(dispatch, engine.first, tokens) / 1e3}
            for way, boundary in boundaries[name].items():
                stamps, _, _ = decode_e2e.decode(dispatch, boundary, engine.first, tokens, overlap=True)
                timed[way] = float(np.median(np.diff(stamps)))
            if round_:
                for way, seconds in timed.items():
                    per_token[name, way].append(seconds)
    rows = []
    for (name, way), seconds in per_token.items():
        baseline = per_token.get(("resident", way), per_token["resident", "loop"])
        median = statistics.median(seconds)
        rows.append({"model": model, "layers": int(layers), "hidden": hidden, "ffn": ffn, "impl": impl,
                     "program": name, "way": way, "ms_per_token": median * 1e3,
                     "ms_range": [min(seconds) * 1e3, max(seconds) * 1e3], "tokens_per_s": 1 / median,
                     "x_resident": statistics.median(b / s for b, s in zip(baseline, seconds)), "hlo": hlo[name]})
        print(f"{model:18s} {impl:9s} {name:15s} {way:11s} {median * 1e3:7.3f} ms/token "
              f"[{min(seconds) * 1e3:.3f}, {max(seconds) * 1e3:.3f}] {rows[-1]['x_resident']:.2f}x resident; "
              f"{hlo[name]['entry_ops']} ops, {hlo[name]['fusions']} fusions", flush=True)
    return rows


def main() -> int:
    import jax

    on_gpu = jax.default_backend() == "gpu"
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["stdlib-moe-size", "wheels-moe-size", "olmoe-size"],
                        choices=sorted(decode_e2e.RECORDED_MODELS))
    parser.add_argument("--impls", nargs="+", choices=("pallas", "reference"),
                        default=["pallas", "reference"] if on_gpu else ["reference"])
    parser.add_argument("--programs", nargs="+", choices=PROGRAMS,
                        default=[p for p in PROGRAMS if p != "arena-float32" or not on_gpu])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    for name in ("tokens", "rounds"):
        if getattr(args, name) < 2:
            parser.error(f"--{name} must be at least 2, got {getattr(args, name)}")
    payload = {**run_header(), "tokens": args.tokens, "rounds": args.rounds, "method": __doc__, "rows": []}
    recordings = {}
    for model in args.models:
        checkpoint = decode_e2e.RECORDED_MODELS[model][0]
        if checkpoint not in recordings:
            recordings[checkpoint] = decode_e2e.record(checkpoint, args.tokens, 0)
        for impl in args.impls:
            payload["rows"] += measure(model, impl, tokens=args.tokens, rounds=args.rounds,
                                       routing=recordings[checkpoint], names=args.programs)
            write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
