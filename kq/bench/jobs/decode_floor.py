"""Where a full arena's token goes: the decode loop at 100% residency taken apart, in one run.

    python -m kq.bench.jobs decode_floor --json docs/h200/decode_floor.json

For each model of ``kq.bench.decode_e2e`` (recorded routing of its checkpoint, random experts at its
size), with ``route_shed`` as the Pallas kernel and as the jnp reference: the resident program and the
arena's (every expert resident, the slot tables the identity), each timed three ways, the median of
``--rounds`` rounds of ``--tokens`` tokens: ``floor`` (dispatched back to back, nothing read back: the
device's and the dispatch's rate), ``loop`` (decode_e2e's loop: token t+1 dispatched before token t is
read, one readback per token, no host work after it) and, for the arena, ``loop + step`` (the
residency manager's boundary on each token's reports, as the lossy mode runs it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

from kq.bench.common import run_header, write_json
from kq.bench import decode_e2e


def measure(model: str, impl: str, *, tokens: int, rounds: int, routing) -> list[dict]:
    import jax

    from kq_host.residency import LayerReport, ResidencyManager

    _, layers, hidden, ffn = decode_e2e.RECORDED_MODELS[model]
    routing = tuple(np.ascontiguousarray(a[:tokens, :layers]) for a in routing)
    layers, top_k = routing[0].shape[1:]
    experts = 64
    weights = decode_e2e.random_experts(layers, experts, hidden, ffn, np.random.default_rng(0))
    engine = decode_e2e.Engine(weights, top_k, tokens, routing=routing, impl=impl)
    del weights
    positions = engine.positions
    tables = jax.device_put(np.tile(np.arange(experts, dtype=np.int32), (layers, 1)))
    programs = {"resident": lambda x, p: engine.resident(x, positions[p], engine.weights),
                "arena": lambda x, p: engine.streamed(x, positions[p], engine.weights, tables)}
    rows = []
    for name, dispatch in programs.items():
        dispatch(engine.first, 0)[1].block_until_ready()  # compile
        ways = {"floor": None, "loop": lambda position, packed: False}
        if name == "arena":
            manager = ResidencyManager(layers, experts, experts, loader=lambda l, e, s: None)
            for layer in range(layers):
                manager.preload(layer, range(experts))

            def step(position, packed, manager=manager):
                manager.step(LayerReport.from_packed(packed))
                return False

            ways["loop + step"] = step
        for way, boundary in ways.items():
            per_token = []
            for _ in range(rounds + 1):  # the first round warms
                if boundary is None:
                    per_token.append(1.0 / decode_e2e.device_floor(dispatch, engine.first, tokens))
                else:
                    stamps, _, _ = decode_e2e.decode(dispatch, boundary, engine.first, tokens, overlap=True)
                    per_token.append(float(np.median(np.diff(stamps))))
            median = statistics.median(per_token[1:])
            rows.append({"model": model, "layers": int(layers), "hidden": hidden, "ffn": ffn, "impl": impl,
                         "program": name, "way": way, "ms_per_token": median * 1e3, "tokens_per_s": 1 / median})
            print(f"{model:18s} {impl:9s} {name:8s} {way:11s} {median * 1e3:7.3f} ms/token", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["stdlib-moe-size", "wheels-moe-size", "olmoe-size"])
    parser.add_argument("--impls", nargs="+", default=["pallas", "reference"])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    payload = {**run_header(), "tokens": args.tokens, "rounds": args.rounds, "method": __doc__, "rows": []}
    recordings = {}
    for model in args.models:
        checkpoint = decode_e2e.RECORDED_MODELS[model][0]
        if checkpoint not in recordings:
            recordings[checkpoint] = decode_e2e.record(checkpoint, args.tokens, 0)
        for impl in args.impls:
            payload["rows"] += measure(model, impl, tokens=args.tokens, rounds=args.rounds,
                                       routing=recordings[checkpoint])
            write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
