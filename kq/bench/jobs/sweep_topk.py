"""topk_route_shed's kernel on a GPU: bits checked, kernel time per launch configuration and against the
two-launch path it replaces.

Usage: python -m kq.bench.jobs sweep_topk [--json PATH] [--shapes ROWSxKxE ...]

For each shape: ``lax.top_k`` alone, then ``lax.top_k`` + XLA's renormalisation + ``route_shed_pallas``
(what a MoE layer on an arena ran before), then the fused kernel at topk_block_config's default and
at each (block_rows, num_warps) below. Every fused configuration's six outputs are compared with the
oracle bit for bit; kernel time is the summed kernel durations per call from JAX's profiler (kq bench's
``kernel`` column). Exits non-zero if any configuration's bits differ.
"""

from __future__ import annotations

import argparse
import functools
import sys


import jax
import jax.numpy as jnp
import numpy as np

from kq.bench.kernels import jax_kernel_us, parse_shape
from kq_core.compare import first_mismatch
from kq_core.oracle import topk_route_shed_oracle
from kq_jax.pallas_config import KernelConfig, topk_block_config
from kq_jax.route_shed_pallas import route_shed_pallas
from kq_jax.topk_route_shed_pallas import topk_route_shed_pallas
from kq.bench.common import run_header, write_json

BLOCKS = ((1, 1), (2, 1), (4, 1), (8, 1), (8, 2), (8, 4), (16, 2), (16, 4), (32, 4), (32, 8))
DEFAULT_SHAPES = ("1x8x64", "8x8x64", "1x8x256", "8x8x256", "1x8x128", "4096x8x128", "65536x8x256")


def two_launches(probs, table, *, top_k):
    scores, indices = jax.lax.top_k(probs, top_k)
    return route_shed_pallas(indices, scores / scores.sum(-1, keepdims=True), table)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--shapes", nargs="+", type=parse_shape, metavar="ROWSxKxE",
                        default=[parse_shape(s) for s in DEFAULT_SHAPES])
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    results, bad = [], 0
    print(f"{'shape':>14} {'what':>22} {'kernel us':>10}  bits")
    for rows, top_k, experts in args.shapes:
        logits = rng.normal(size=(rows, experts)).astype(np.float32) * 2
        probs = jax.nn.softmax(jnp.asarray(logits), axis=-1)
        table = np.where(rng.random(experts) < 0.5, rng.permutation(experts), -1).astype(np.int32)
        inputs = (probs, jnp.asarray(table))
        expected = topk_route_shed_oracle(np.asarray(probs), table, top_k)
        shape = f"{rows}x{top_k}x{experts}"
        default = topk_block_config(rows, experts)
        candidates = [("lax.top_k", lambda p, t: jax.lax.top_k(p, top_k), None),
                      ("top_k+route_shed", functools.partial(two_launches, top_k=top_k), None),
                      (f"fused default {default.block_rows}/{default.num_warps}", None, KernelConfig())]
        candidates += [(f"fused {b}/{w}", None, KernelConfig(block_rows=b, num_warps=w)) for b, w in BLOCKS
                       if b <= max(rows, 1) and (b, w) != (default.block_rows, default.num_warps)]
        for what, fn, config in candidates:
            exact = None
            if fn is None:
                fn = functools.partial(topk_route_shed_pallas, top_k=top_k, config=config)
                exact = first_mismatch(expected, jax.jit(fn)(*inputs)) is None
                bad += not exact
            kernel_us = jax_kernel_us(fn, inputs)
            results.append(dict(shape=shape, what=what, kernel_us=kernel_us, bits_exact=exact))
            print(f"{shape:>14} {what:>22} {kernel_us if kernel_us is not None else float('nan'):>10.2f}  "
                  f"{'' if exact is None else 'ok' if exact else 'MISMATCH'}", flush=True)
    if args.json:
        write_json(args.json, run_header(results=results))
    print(f"{bad} configurations with differing bits")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
