"""The experts' computation fenced: its bits in every program around it, and what the fence costs.

    python -m kq.bench.jobs experts_fence --json docs/h200/experts_fence.json

``kq_jax.moe.experts_apply`` and ``combine`` put ``lax.optimization_barrier`` around the gather, the
SwiGLU and the weighted sum, so XLA fuses them alike in every program. For each expert size (the
tests', OLMoE's, Qwen3-30B-A3B's) and T = 1 and 5 tokens, random weights (never zeros) and routing:

* bits: the layer jitted alone against the same experts reached through a conditional (as the exact
  rule's filled misses reach it: ``apply_gathered``), from a permuted arena, sliced from a stack of
  layers, and inside other work (a residual around it): ``true`` where every output bit is the same;
  and whether the unfenced layer (the same einsums without barriers) gives those bits too;
* milliseconds (median of ``--repeats`` calls, each waited for): unfenced, fenced, through the
  conditional, and both layers on weights sliced from a stack of ``STACKED_LAYERS`` layers inside the
  program (how a decode loop reads its layer's experts).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from kq.bench.common import median_seconds, run_header, write_json

# (experts, hidden, expert width, top-k)
SIZES = {"tests": (16, 64, 32, 4), "olmoe": (64, 2048, 1024, 8), "qwen3-30b-a3b": (128, 2048, 768, 8)}
STACKED_LAYERS = 4


def layers():
    """The layer's variants, each ``f(x, weights, rows, mix) -> [T, D]``."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from kq_jax.moe import Experts, apply_gathered, combine, experts_apply

    def unfenced(x, weights, rows, mix):
        gathered = Experts(*(w[rows] for w in weights))
        gate = jnp.einsum("td,tkfd->tkf", x, gathered.gate)
        up = jnp.einsum("td,tkfd->tkf", x, gathered.up)
        y = jnp.einsum("tkf,tkdf->tkd", jax.nn.silu(gate) * up, gathered.down)
        return jnp.einsum("tkd,tk->td", y, mix)

    def fenced(x, weights, rows, mix):
        return combine(experts_apply(x, weights, rows), mix)

    def through_a_conditional(x, weights, rows, mix):
        gathered = Experts(*(w[rows] for w in weights))
        gathered = lax.cond(jnp.all(rows >= 0), lambda g: g, lambda g: Experts(*(-w for w in g)), gathered)
        return combine(apply_gathered(x, gathered), mix)

    def from_stack(layer):
        def run(x, stacked, rows, mix):
            return layer(x, Experts(*(w[STACKED_LAYERS - 1] for w in stacked)), rows, mix)
        return run

    def inside_other_work(x, weights, rows, mix):
        h = x * 1.5 + 0.25
        return fenced(h, weights, rows, mix * jnp.exp(h[:, :1] * 0)) + h

    return dict(unfenced=unfenced, fenced=fenced, through_a_conditional=through_a_conditional,
                stacked_unfenced=from_stack(unfenced), stacked_fenced=from_stack(fenced),
                inside_other_work=inside_other_work)


def measure(size: str, dtype: str, tokens: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp
    import ml_dtypes

    from kq_jax.moe import Experts

    experts, hidden, width, top_k = SIZES[size]
    np_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    rng = np.random.default_rng(tokens)
    shapes = ((experts, width, hidden), (experts, width, hidden), (experts, hidden, width))
    weights = Experts(*(jnp.asarray((rng.standard_normal(s) * 0.1 + 0.01).astype(np_dtype)) for s in shapes))
    stacked = Experts(*(jnp.stack([w] * STACKED_LAYERS) for w in weights))
    x = jnp.asarray(rng.standard_normal((tokens, hidden)).astype(np.float32))
    rows = jnp.asarray(np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int32))
    mix = jnp.asarray(rng.dirichlet(np.ones(top_k), size=tokens).astype(np.float32))
    order = rng.permutation(experts)
    arena = Experts(*(w[order] for w in weights))
    slots = jnp.asarray(np.argsort(order)[np.asarray(rows)].astype(np.int32))

    variants = {name: jax.jit(fn) for name, fn in layers().items()}
    want = np.asarray(variants["fenced"](x, weights, rows, mix)).view(np.uint32)
    h = jax.jit(lambda x: x * 1.5 + 0.25)(x)

    def same(got) -> bool:
        return bool((np.asarray(got).view(np.uint32) == want).all())

    bits = {
        "through_a_conditional": same(variants["through_a_conditional"](x, weights, rows, mix)),
        "from_a_permuted_arena": same(variants["fenced"](x, arena, slots, mix)),
        "sliced_from_a_stack": same(variants["stacked_fenced"](x, stacked, rows, mix)),
        "inside_other_work": bool((np.asarray(variants["inside_other_work"](x, weights, rows, mix)).view(np.uint32)
                                   == np.asarray(variants["fenced"](h, weights, rows, mix) + h).view(np.uint32)).all()),
        "unfenced": same(variants["unfenced"](x, weights, rows, mix)),
    }

    def ms(name, *args) -> float:
        return 1e3 * median_seconds(lambda: jax.block_until_ready(variants[name](*args)), repeats)

    timings = {name: ms(name, x, weights, rows, mix) for name in ("unfenced", "fenced", "through_a_conditional")}
    timings.update({name: ms(name, x, stacked, rows, mix) for name in ("stacked_unfenced", "stacked_fenced")})
    return {"size": size, "dtype": dtype, "tokens": tokens, "same_bits": bits, "ms": timings}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--repeats", type=int, default=100, help="timed calls per variant (default 100)")
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    payload = {**run_header("jax", repeats=args.repeats), "rows": []}
    for size in args.sizes:
        for dtype in ("float32", "bfloat16") if size == "tests" else ("bfloat16",):
            for tokens in (1, 5):
                row = measure(size, dtype, tokens, args.repeats)
                payload["rows"].append(row)
                print(row, flush=True)
                if args.json:
                    write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
