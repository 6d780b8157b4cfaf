"""The ``kq`` command line."""

from __future__ import annotations

import argparse
import sys

from kq.backends import all_backends, backend


def _check(args) -> int:
    from kq.check import format_table, run_checks

    chosen = tuple(backend(n) for n in args.backends) if args.backends else all_backends()
    reports = run_checks(chosen, random_rows=args.random_rows, seed=args.seed)
    print(format_table(reports))
    failed = [r for r in reports if not r.skipped and not r.ok]
    ran = [r for r in reports if not r.skipped]
    print(f"\n{len(ran)} backends ran, {len(failed)} with mismatches, {len(reports) - len(ran)} skipped")
    return 1 if failed or not ran else 0


def _bench(args) -> int:
    from kq import bench

    results = bench.run(tuple(args.sets), args.backends, repeats=args.repeats,
                        resident_fraction=args.resident_fraction, progress=not args.no_progress)
    print(bench.format_table(results))
    if args.json:
        bench.write_json(results, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        bench.write_plot(results, args.plot)
        print(f"wrote {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kq", description="route_shed kernels, checked against one spec.")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="run every golden case and random rows through every backend")
    check.add_argument("--backends", nargs="+", metavar="NAME",
                       help=f"subset of: {', '.join(b.name for b in all_backends())}")
    check.add_argument("--random-rows", type=int, default=4096, help="random rows per backend (default 4096)")
    check.add_argument("--seed", type=int, default=0)
    check.set_defaults(func=_check)

    from kq.bench import SHAPE_SETS

    bench = sub.add_parser("bench", help="time every backend here against its floors and the naive baseline")
    bench.add_argument("--sets", nargs="+", default=["decode"], choices=sorted(SHAPE_SETS))
    bench.add_argument("--backends", nargs="+", metavar="NAME", help="subset of the backends found here")
    bench.add_argument("--repeats", type=int, default=7)
    bench.add_argument("--resident-fraction", type=float, default=0.7)
    bench.add_argument("--json", metavar="PATH", help="write the results as JSON")
    bench.add_argument("--plot", metavar="PATH", help="write a PNG plot (needs matplotlib)")
    bench.add_argument("--no-progress", action="store_true")
    bench.set_defaults(func=_bench)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
