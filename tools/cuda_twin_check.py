"""The MLX CUDA twin (kq_mlx/route_shed.cu) on a real NVIDIA GPU through CuPy; one-line summary.

Usage: PYTHONPATH=. python tools/cuda_twin_check.py [--rows 200000]
Every golden case, then random rows (router-like and adversarial, every index
and score dtype, K = 1..64) against the oracle, bit for bit.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from kq.compare import first_mismatch  # noqa: E402
from kq.inputs import adversarial_inputs, router_inputs  # noqa: E402
from kq.oracle import route_shed_oracle  # noqa: E402
from kq.spec import load_spec  # noqa: E402
from kq_mlx.cuda_cupy import route_shed_cuda_cupy  # noqa: E402

SHAPES = [(1, 8, 256), (8, 8, 256), (4097, 8, 256), (3001, 6, 4096), (2049, 10, 128), (1023, 64, 1024),
          (5000, 2, 64), (777, 1, 1), (20000, 8, 256)]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=200_000, help="random rows at least")
    args = parser.parse_args()
    import cupy

    start = time.time()
    device = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    failures = []
    spec = load_spec()
    for case in spec.cases:
        mismatch = first_mismatch(case.expected, route_shed_cuda_cupy(*case.inputs.values()))
        if mismatch:
            failures.append(f"{case.name}: {mismatch}")
    rng = np.random.default_rng(11)
    rows = runs = 0
    while rows < args.rows:
        for shape in SHAPES:
            for index_dtype in ("int32", "uint32"):
                for score_dtype in ("float32", "bfloat16", "float16"):
                    make = router_inputs if runs % 2 else adversarial_inputs
                    inputs = make(rng, *shape, index_dtype=index_dtype, score_dtype=score_dtype)
                    mismatch = first_mismatch(route_shed_oracle(*inputs), route_shed_cuda_cupy(*inputs))
                    runs += 1
                    rows += shape[0]
                    if mismatch:
                        failures.append(f"{make.__name__} {shape} {index_dtype}/{score_dtype}: {mismatch}")
    for line in failures[:20]:
        print("MISMATCH", line)
    print(f"SUMMARY {'PASS' if not failures else 'FAIL'}: route_shed.cu on {device} via CuPy "
          f"{cupy.__version__}: golden {len(spec.cases)} cases, {rows} random rows in {runs} runs, "
          f"{len(failures)} mismatching; {time.time() - start:.0f}s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
