"""Sweeps the Pallas kernel's launch parameters on a GPU: bits checked, device time per call.

Usage: PYTHONPATH=. python tools/gpu_tune.py [--json PATH]
For each benchmark shape with K <= 16 and each (block_rows, num_warps, tiled_io), checks the outputs against
the oracle bit for bit and times the call as kq bench does; prints the table and the fastest
configuration per shape next to block_config's default.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from kq.bench import SHAPE_SETS, _jax_timer  # noqa: E402
from kq.compare import first_mismatch  # noqa: E402
from kq.inputs import router_inputs  # noqa: E402
from kq.oracle import route_shed_oracle  # noqa: E402
from kq_jax.route_shed_pallas import KernelConfig, block_config, route_shed_pallas  # noqa: E402

BLOCK_ROWS = (32, 64, 128, 256, 512)
NUM_WARPS = (1, 4, 8)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows_out, bad = [], 0
    shapes = [s for name in ("decode", "prefill") for s in SHAPE_SETS[name] if s[1] <= 16]
    for rows, top_k, experts in shapes:
        inputs = router_inputs(rng, rows, top_k, experts)
        expected = route_shed_oracle(*inputs)
        default = block_config(rows, top_k)
        configs = {default} | {(b, w, tiled) for b in BLOCK_ROWS for w in NUM_WARPS for tiled in (False, True)
                                if 32 * w <= b and b <= 2 * max(rows, 32)}
        timings = []
        for block_rows, num_warps, tiled_io in sorted(configs):
            config = KernelConfig(block_rows, num_warps, tiled_io)
            op = functools.partial(route_shed_pallas, config=config)
            mismatch = first_mismatch(expected, jax.jit(op)(*inputs))
            bad += mismatch is not None
            per_call, _ = _jax_timer(op, inputs, args.repeats)
            print(f"  {rows} x {top_k} E={experts} {config}: {per_call:8.2f} us"
                  f"{'' if mismatch is None else f'  MISMATCH {mismatch}'}", flush=True)
            timings.append((per_call, config, mismatch is None))
            rows_out.append(dict(rows=rows, top_k=top_k, experts=experts, block_rows=block_rows,
                                 num_warps=num_warps, tiled_io=tiled_io, per_call_us=per_call,
                                 exact=mismatch is None))
        best = min(timings, key=lambda timing: timing[0])
        default_time = next(t for t, c, _ in timings if c == KernelConfig(*default))
        print(f"{rows:>8} x {top_k:<2} E={experts:<5} best {best[0]:8.2f} us at {best[1]}; "
              f"default {default}: {default_time:8.2f} us", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows_out, indent=1))
    print(f"SUMMARY: {len(rows_out)} configurations, {bad} with mismatching bits")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
