"""Sweeps the Pallas kernel's launch parameters on a GPU: bits checked, device time per call.

Usage: python -m kq.bench.jobs sweep_route_shed [--json PATH] [--shapes ROWSxKxE ...]

For each benchmark shape, prefill shapes first: stage 1 times the code paths
(strided, ``tiled_io`` for K <= 16, ``entry_lanes``; each with and without
``ptx_arith``) at block_config's default blocks;
stage 2 sweeps (block_rows, num_warps) for the fastest path. Every
configuration's outputs are compared with the oracle bit for bit and timed by
its kernel's duration from JAX's profiler (kq bench's ``kernel`` column: the
unrolled-chain timings of a first sweep scattered by more than the differences
between configurations); prints every configuration and the best per shape
next to the default. Exits non-zero if any configuration's bits differ.
"""

from __future__ import annotations

import argparse
import functools
import sys


import jax
import numpy as np

from kq.bench.kernels import SHAPE_SETS, jax_kernel_us, parse_shape
from kq_core.compare import first_mismatch
from kq_core.inputs import router_inputs
from kq_core.oracle import route_shed_oracle
from kq_jax.pallas_config import MAX_UNROLLED_K, KernelConfig, block_config
from kq_jax.route_shed_pallas import route_shed_pallas
from kq.bench.common import run_header, write_json

# (block_rows, num_warps): one row per thread, and fewer warps than rows / 32 (rows per thread > 1);
# for entry_lanes (a row per K lanes) also blocks of a few rows.
BLOCKS = ((32, 1), (64, 2), (128, 4), (256, 8), (128, 1), (256, 4), (512, 8), (512, 4), (1024, 8))
LANES_BLOCKS = ((1, 2), (2, 2), (4, 2), (4, 4), (8, 2), (8, 4), (16, 4), (16, 8), (32, 4), (32, 8))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--shapes", nargs="+", type=parse_shape, metavar="ROWSxKxE",
                        help="shapes to sweep (default: kq bench's prefill then decode sets)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows_out, bad = [], 0
    shapes = args.shapes or [s for name in ("prefill", "decode") for s in SHAPE_SETS[name]]
    for rows, top_k, experts in shapes:
        inputs = router_inputs(rng, rows, top_k, experts)
        expected = route_shed_oracle(*inputs)
        timed: dict[KernelConfig, float] = {}

        def measure(config: KernelConfig) -> None:
            nonlocal bad
            if config in timed:
                return
            op = functools.partial(route_shed_pallas, config=config)
            mismatch = first_mismatch(expected, jax.jit(op)(*inputs))
            bad += mismatch is not None
            kernel = jax_kernel_us(op, inputs)
            timed[config] = kernel if mismatch is None and kernel is not None else float("inf")
            print(f"  {rows} x {top_k} E={experts} {tuple(config)}: kernel {kernel} us"
                  f"{'' if mismatch is None else f'  MISMATCH {mismatch}'}", flush=True)
            rows_out.append(dict(rows=rows, top_k=top_k, experts=experts, **config._asdict(),
                                 kernel_us=kernel, exact=mismatch is None))

        default = block_config(rows, top_k)
        paths = [dict(tiled_io=False, entry_lanes=False), dict(entry_lanes=True)] + (
            [dict(tiled_io=True)] if top_k <= MAX_UNROLLED_K else [])
        for path in paths:
            for ptx_arith in (False, True):
                measure(block_config(rows, top_k, KernelConfig(ptx_arith=ptx_arith, **path)))
        path = min(timed, key=timed.get)
        for block_rows, num_warps in LANES_BLOCKS if path.entry_lanes else BLOCKS:
            if block_rows <= 2 * max(rows, 32):
                measure(block_config(rows, top_k, path._replace(block_rows=block_rows, num_warps=num_warps)))
        best = min(timed, key=timed.get)
        print(f"{rows:>8} x {top_k:<2} E={experts:<5} best {timed[best]:8.2f} us at {tuple(best)}; "
              f"default {tuple(default)}: {timed[default]:8.2f} us", flush=True)
        if args.json:  # rewritten after every shape, so a run cut short keeps what it measured
            write_json(args.json, run_header(results=rows_out))
    print(f"SUMMARY: {len(rows_out)} configurations, {bad} with mismatching bits")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
