"""``python -m kq.bench.jobs JOB [ARGS]``: runs one job of :mod:`kq.bench.jobs` (``--help`` after JOB for its arguments)."""

import importlib
import sys

JOBS = ("sweep_route_shed", "sweep_topk", "launches", "moe_overhead", "expert_parallel", "mlx_decode", "h2d_staging",
        "frontier", "lookahead", "study_grid", "tier_decode", "exact_loop", "decode_floor", "huge_model",
        "experts_fence", "chunk_bits", "mlx_token_parts")


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in JOBS:
        print(f"usage: python -m kq.bench.jobs {{{','.join(JOBS)}}} [ARGS]", file=sys.stderr)
        return 2
    job = sys.argv.pop(1)
    sys.argv[0] = f"python -m kq.bench.jobs {job}"
    return importlib.import_module(f"kq.bench.jobs.{job}").main()


if __name__ == "__main__":
    sys.exit(main())
