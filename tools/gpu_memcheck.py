"""Small route_shed launches for ``compute-sanitizer --tool memcheck``.

Ragged tails (rows not a multiple of the block), K not a power of two,
E = 1, zero rows; every result is also compared with the oracle.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import kq_jax  # noqa: E402
from kq.compare import first_mismatch  # noqa: E402
from kq.inputs import adversarial_inputs  # noqa: E402
from kq.oracle import route_shed_oracle  # noqa: E402

CASES = [(1, 8, 256), (3, 8, 256), (257, 8, 256), (1023, 6, 64), (129, 10, 1), (77, 64, 1024), (5, 1, 1), (0, 8, 16)]


def main() -> int:
    rng = np.random.default_rng(5)
    fn = jax.jit(lambda i, s, t: kq_jax.route_shed(i, s, t, impl="pallas"))
    bad = 0
    for rows, top_k, experts in CASES:
        inputs = adversarial_inputs(rng, rows, top_k, experts)
        mismatch = first_mismatch(route_shed_oracle(*inputs), fn(*inputs))
        print(f"memcheck case rows={rows} K={top_k} E={experts}: {'ok' if mismatch is None else mismatch}")
        bad += mismatch is not None
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
