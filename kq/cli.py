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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kq", description="route_shed kernels, checked against one spec.")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="run every golden case and random rows through every backend")
    check.add_argument("--backends", nargs="+", metavar="NAME",
                       help=f"subset of: {', '.join(b.name for b in all_backends())}")
    check.add_argument("--random-rows", type=int, default=4096, help="random rows per backend (default 4096)")
    check.add_argument("--seed", type=int, default=0)
    check.set_defaults(func=_check)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
