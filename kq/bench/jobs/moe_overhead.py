"""Overhead of the JAX MoE layer on an arena over the fully resident layer (the target: at most 5%).

Usage: python -m kq.bench.jobs moe_overhead [--hidden 2048 --ffn 768] [--json PATH]
Decode sizes: T in 1, 2, 4, 8; E in 64, 256; K = 8; bf16 weights. For each, the resident layer
(E experts in memory, gathered by router ids) and the arena layer (S slots fed by route_shed) are
timed as N calls unrolled in one jitted function, each call's input tied to the previous call's
output, minus the same chain around a null layer; the chains run interleaved, median over repeats. With residency 1.0 (S = E,
slots permuted) both layers do the same gathers and products, so the difference is route_shed and
its plumbing: that is the bar's number. Residency 0.25 is reported too; there shed entries reuse
the first kept slot, so its gathers hit cache more often.

--profile adds, from JAX's profiler on one run of each chain: kernels per layer, their summed time
per layer, and the GPU's busy span per layer (first kernel's start to last kernel's end over the
chain, so the gaps between kernels are in it); with the chain timer's time these tell launch gaps
and host-bound dispatch from kernel work. The kernels of one call of each layer go into the JSON.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time


import jax
import jax.numpy as jnp
import numpy as np

from kq.bench.kernels import trace_kernels
from kq_jax.arena_moe import moe_ffn_arena
from kq_jax.moe import Experts, moe_ffn_resident
from kq.bench.common import run_header, write_json


@functools.cache  # one jitted chain per (layer, n): the profile reuses the timer's compiled chain
def chained(layer, n):
    def run(x, *params):
        for _ in range(n):
            x = x + 0.0 * layer(x, *params).astype(x.dtype)
        return x

    return jax.jit(run)


def per_call_us(layers, args, n, repeats):
    """Device time per call of each layer: chains of n calls minus a null chain, median over repeats.

    The chains run interleaved, one of each per repeat, so clock and thermal drift hit every layer alike.
    """
    null = lambda x, *params: x  # noqa: E731
    chains = [chained(layer, n) for layer in (null, *layers)]
    samples = [[] for _ in chains]
    for _ in range(repeats + 1):  # the first round compiles and warms up
        for chain, layer_args, times in zip(chains, ((args[0][0],), *args), samples):
            start = time.perf_counter()
            jax.block_until_ready(chain(*layer_args))
            times.append(time.perf_counter() - start)
    medians = [statistics.median(times[1:]) * 1e6 for times in samples]
    return [(m - medians[0]) / n for m in medians[1:]]


def kernel_profile(layer, args, n):
    """Kernels per layer, their summed us per layer, and the busy span per layer of a chain of n layers."""
    kernels = trace_kernels(chained(layer, n), args, 1)
    if not kernels:
        return {}
    span = max(k["ts"] + k["dur"] for k in kernels) - min(k["ts"] for k in kernels)
    one_call = trace_kernels(jax.jit(layer), args, 1)
    return dict(kernels=len(kernels) / n, kernel_us=sum(k["dur"] for k in kernels) / n, span_us=span / n,
                one_call=[(k["name"], k["dur"]) for k in one_call])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=768)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--experts", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--residency", type=float, nargs="+", default=[1.0, 0.25])
    parser.add_argument("--unroll", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--impl", default="auto", help="route_shed's impl in the arena layer")
    parser.add_argument("--profile", action="store_true", help="also profile the chains' kernels (GPU)")
    parser.add_argument("--json")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    device = jax.devices()[0]
    rows = []
    print(f"device {getattr(device, 'device_kind', device.platform)}, jax {jax.__version__}, "
          f"hidden {args.hidden}, ffn {args.ffn}, K {args.top_k}, bf16 weights, route_shed impl {args.impl}, "
          f"XLA_FLAGS {os.environ.get('XLA_FLAGS', '')!r}")
    print(f"{'T':>3} {'E':>4} {'S':>4} {'resident us':>12} {'arena us':>10} {'overhead':>9}")
    for experts in args.experts:
        weights = Experts(*(jnp.asarray(rng.normal(size=(experts, *shape)) / np.sqrt(shape[1]), jnp.bfloat16)
                            for shape in [(args.ffn, args.hidden), (args.ffn, args.hidden), (args.hidden, args.ffn)]))
        router = jnp.asarray(rng.normal(size=(args.hidden, experts)), jnp.bfloat16)
        for residency, tokens in ((r, t) for r in args.residency for t in args.tokens):
            slots = max(args.top_k, int(experts * residency))
            resident_ids = rng.choice(experts, slots, replace=False)
            table = np.full(experts, -1, np.int32)
            table[resident_ids] = np.arange(slots)
            arena = Experts(*(w[jnp.asarray(resident_ids)] for w in weights))
            x = jnp.asarray(rng.normal(size=(tokens, args.hidden)), jnp.bfloat16)
            layers = [lambda x, r, w: moe_ffn_resident(x, r, w, top_k=args.top_k),
                      lambda x, r, a, t: moe_ffn_arena(x, r, a, t, top_k=args.top_k, impl=args.impl)[0]]
            layer_args = [(x, router, weights), (x, router, arena, jnp.asarray(table))]
            resident, on_arena = per_call_us(layers, layer_args, args.unroll, args.repeats)
            rows.append(dict(tokens=tokens, experts=experts, slots=slots, resident_us=resident, arena_us=on_arena,
                             overhead=on_arena / resident - 1))
            print(f"{tokens:>3} {experts:>4} {slots:>4} {resident:>12.1f} {on_arena:>10.1f} {rows[-1]['overhead']:>8.1%}")
            if args.profile:
                for name, layer, a in zip(("resident", "arena"), layers, layer_args):
                    rows[-1][f"{name}_profile"] = profile = kernel_profile(layer, a, args.unroll)
                    if profile:
                        print(f"    {name}: {profile['kernels']:.1f} kernels, {profile['kernel_us']:.1f} us of "
                              f"kernels, {profile['span_us']:.1f} us busy span per layer")
    if args.json:
        write_json(args.json, run_header(xla_flags=os.environ.get("XLA_FLAGS", ""), args=vars(args), results=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
