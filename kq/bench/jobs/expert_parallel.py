"""The expert-parallel arena layer on this machine's accelerators: bits, time per step, collectives.

For every mesh over the devices here (``(data, expert)`` = ``(1, n)``, and
``(n, 1)`` when n > 1) and every row count T, the layer with every expert
resident is compared bit for bit with the single-device ``moe_ffn_resident``,
and timed (median of jitted steps) with the Pallas kernels and with the jnp
reference, beside the single-device arena layer (the replicated run). The
layers gather each entry's expert weights (``[T, k, F, D]``), so rows stop at
prefill sizes that fit (256 at the default layer: 4.8 GB per projection). The
compiled program's collectives are counted from its HLO.

    python -m kq.bench.jobs expert_parallel --json out/expert_parallel.json
"""

from __future__ import annotations

import argparse
import json
import re

import numpy as np
from kq.bench.common import median_seconds, run_header, write_json

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")


def _median_ms(fn, args, repeats: int) -> float:
    import jax

    return median_seconds(lambda: jax.block_until_ready(fn(*args)), repeats) * 1e3


def _collectives(hlo: str) -> dict[str, int]:
    return {c: len(re.findall(rf"\b{c}(-start)?\(", hlo)) for c in COLLECTIVES if re.search(rf"\b{c}", hlo)}


def run(rows=(1, 8, 64, 256), *, hidden: int = 2048, ffn: int = 768, experts: int = 64, top_k: int = 8,
        repeats: int = 20, seed: int = 0) -> dict:
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from kq_jax.expert_parallel import arena_sharding, moe_ffn_arena_sharded
    from kq_jax.arena_moe import moe_ffn_arena
    from kq_jax.moe import Experts, moe_ffn_resident

    devices = jax.devices()
    n = len(devices)
    rng = np.random.default_rng(seed)
    scale = 1 / np.sqrt(hidden)
    experts_w = Experts(*(rng.normal(size=s).astype(np.float32) * scale
                          for s in [(experts, ffn, hidden), (experts, ffn, hidden), (experts, hidden, ffn)]))
    router = rng.normal(size=(hidden, experts)).astype(np.float32) * scale
    order = rng.permutation(experts)
    table = np.empty(experts, np.int32)
    table[order] = np.arange(experts, dtype=np.int32)
    arena = Experts(*(w[order] for w in experts_w))
    one = devices[0]
    resident = jax.jit(lambda x, r, e: moe_ffn_resident(x, r, e, top_k=top_k))
    single = {impl: jax.jit(lambda x, r, a, t, impl=impl: moe_ffn_arena(x, r, a, t, top_k=top_k, impl=impl)[0])
              for impl in ("auto", "reference")}
    on_one = jax.device_put((router, experts_w, arena, table), one)
    meshes = [(1, n)] + ([(n, 1)] if n > 1 else [])
    results = []
    for t in rows:
        x = rng.normal(size=(t, hidden)).astype(np.float32)
        x_one = jax.device_put(x, one)
        want = np.asarray(resident(x_one, on_one[0], on_one[1]))
        base = {f"single_{impl}_ms": _median_ms(fn, (x_one, on_one[0], on_one[2], on_one[3]), repeats)
                for impl, fn in single.items()}
        base["resident_ms"] = _median_ms(resident, (x_one, on_one[0], on_one[1]), repeats)
        for data, expert in meshes:
            if t % data:
                continue
            mesh = Mesh(np.array(devices).reshape(data, expert), ("data", "expert"))
            args = (jax.device_put(x, NamedSharding(mesh, P("data", None))),
                    jax.device_put(router, NamedSharding(mesh, P())), jax.device_put(arena, arena_sharding(mesh)),
                    jax.device_put(table, NamedSharding(mesh, P())))
            entry = dict(rows=t, mesh=[data, expert], **base)
            for impl in ("auto", "reference"):
                fn = jax.jit(lambda x, r, a, tb, mesh=mesh, impl=impl: moe_ffn_arena_sharded(
                    x, r, a, tb, top_k=top_k, mesh=mesh, impl=impl)[0])
                got = np.asarray(fn(*args))
                entry[f"sharded_{impl}_ms"] = _median_ms(fn, args, repeats)
                entry[f"sharded_{impl}_bits_exact"] = bool(np.array_equal(got.view(np.uint32), want.view(np.uint32)))
                entry[f"sharded_{impl}_collectives"] = _collectives(fn.lower(*args).compile().as_text())
            results.append(entry)
            print(json.dumps(entry), flush=True)
    return {**run_header(), "devices": [str(d.device_kind) for d in devices],
            "layer": dict(hidden=hidden, ffn=ffn, experts=experts, top_k=top_k, dtype="float32"),
            "results": results}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    import jax

    # Full-precision float32 matmuls, so the layers' bits do not hang on which GEMM each program picks.
    with jax.default_matmul_precision("highest"):
        result = run(tuple(args.rows), repeats=args.repeats)
    if args.json:
        write_json(args.json, result)
    return 0 if all(v for r in result["results"] for k, v in r.items() if k.endswith("bits_exact")) else 1
