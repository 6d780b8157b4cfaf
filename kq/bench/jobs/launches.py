"""route_shed launches for the GPU tools: ``compute-sanitizer`` and Nsight Compute (``ncu``).

Usage (on a GPU, from the repo root):
    python -m kq.bench.jobs launches                      # the memcheck cases
    python -m kq.bench.jobs launches --shape 1048576 8 256  # one shape, for a profile
    python -m kq.bench.jobs launches --shape 65536 8 256 --variants strided+ptx tiled+ptx

The memcheck cases: ragged tails (rows not a multiple of the block), K not a
power of two, E = 1, zero rows. Every result is also compared with the oracle.
``--variants`` launches the kernel once per variant, in the order given: ``default``
(block_config's choice) or words of VARIANT_WORDS joined by ``+``, e.g. ``tiled+ptx``.
"""

import argparse
import sys


import jax
import numpy as np

from kq_core.compare import first_mismatch
from kq_core.inputs import adversarial_inputs, router_inputs
from kq_core.oracle import route_shed_oracle
from kq_jax.pallas_config import MAX_UNROLLED_K, KernelConfig
from kq_jax.route_shed_pallas import route_shed_pallas

# --variants words, joined by "+": the kernel path and the rounding, each forced.
VARIANT_WORDS = {"strided": dict(tiled_io=False, entry_lanes=False), "tiled": dict(tiled_io=True),
                 "lanes": dict(entry_lanes=True), "integer": dict(ptx_arith=False), "ptx": dict(ptx_arith=True)}
CASES = [(1, 8, 256), (3, 8, 256), (257, 8, 256), (1023, 6, 64), (129, 10, 1), (77, 64, 1024), (5, 1, 1), (0, 8, 16)]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", type=int, nargs=3, metavar=("ROWS", "K", "E"), help="one router-like shape")
    parser.add_argument("--variants", nargs="+", default=["default"])
    args = parser.parse_args()
    rng = np.random.default_rng(5)
    interpret = jax.default_backend() != "gpu"  # lets the tool itself be tried without a GPU
    bad = 0
    cases = [(tuple(args.shape), router_inputs)] if args.shape else [(case, adversarial_inputs) for case in CASES]
    for (rows, top_k, experts), make in cases:
        inputs = make(rng, rows, top_k, experts)
        expected = route_shed_oracle(*inputs)
        for variant in args.variants:
            fields = {}
            for word in [] if variant == "default" else variant.split("+"):
                fields.update(VARIANT_WORDS[word])
            if fields.get("tiled_io") and top_k > MAX_UNROLLED_K:
                continue  # tiled I/O is refused past it
            fn = jax.jit(lambda i, s, t, config=KernelConfig(**fields): route_shed_pallas(
                i, s, t, interpret=interpret, config=config))
            mismatch = first_mismatch(expected, fn(*inputs))
            print(f"case rows={rows} K={top_k} E={experts} {variant}: {'ok' if mismatch is None else mismatch}")
            bad += mismatch is not None
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
