"""The JAX backend's whole check on a CUDA GPU, in one run; prints a one-line summary.

Usage (on a machine with a GPU, from the repo root):
    PYTHONPATH=. python tools/gpu_check.py --out DIR

1. every golden case and random rows through jax-pallas and jax-reference (``kq check``);
2. random rows over the benchmark shapes (~8.4 million; each shape started before ``--rows-seconds``), every index and score dtype,
   router-like and adversarial, compiled kernel and jitted reference vs the oracle;
3. the JAX tests (jit / vmap / scan / grad, every kernel path) with the compiled kernel, and the
   kernel's PTX roundings against NumPy;
4. what the lowering emits for this GPU: the kernel's Triton IR and the reference's
   optimised HLO, searched for float division, float multiply and fused multiply-add;
5. plain jnp division on this GPU, to show the approximation the kernel avoids.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
import time
from pathlib import Path

SHAPES = [  # (rows, K, E)
    (1, 8, 256), (8, 8, 256), (64, 8, 256), (1, 64, 1024), (4096, 8, 256), (65536, 8, 256),
    (65536, 2, 64), (4096, 64, 1024), (3001, 6, 4096), (2049, 10, 128), (1 << 20, 8, 256),
]


def log(line: str, sink) -> None:
    print(line, flush=True)
    sink.write(line + "\n")
    sink.flush()


def random_rows(sink, seconds: float) -> tuple[int, int, int]:
    import jax
    import numpy as np

    import kq_jax
    from kq.compare import first_mismatch
    from kq.inputs import adversarial_inputs, router_inputs
    from kq.oracle import route_shed_oracle

    fns = {impl: jax.jit(lambda i, s, t, impl=impl: kq_jax.route_shed(i, s, t, impl=impl))
           for impl in ("pallas", "reference")}
    rng = np.random.default_rng(2026)
    rows_checked = failures = cases = 0
    deadline = time.time() + seconds
    for rows, top_k, experts in SHAPES:
        if time.time() > deadline:
            log(f"random rows: stopped at the {seconds:.0f} s deadline before {rows}x{top_k} E={experts}", sink)
            break
        for index_dtype in ("int32", "uint32"):
            for score_dtype in ("float32", "bfloat16", "float16"):
                for make in (router_inputs, adversarial_inputs):
                    if rows >= 65536 and (index_dtype, score_dtype) != ("int32", "float32") and make is adversarial_inputs:
                        continue  # the largest shapes once per flavour keep the run short
                    kw = dict(index_dtype=index_dtype, score_dtype=score_dtype)
                    if make is router_inputs:
                        kw["resident_fraction"] = float(rng.choice([0.25, 0.7, 1.0]))
                    inputs = make(rng, rows, top_k, experts, **kw)
                    expected = route_shed_oracle(*inputs)
                    for impl, fn in fns.items():
                        cases += 1
                        mismatch = first_mismatch(expected, fn(*inputs))
                        if mismatch is not None:
                            failures += 1
                            log(f"MISMATCH {impl} {make.__name__} {rows}x{top_k} E={experts} "
                                f"{index_dtype}/{score_dtype}: {mismatch}", sink)
                    rows_checked += rows
        log(f"  {rows}x{top_k} E={experts} done: {rows_checked} rows, {cases} runs, {failures} mismatching", sink)
    return rows_checked, cases, failures


def compile_for_dump() -> None:
    """Compiles the kernel (printing its Triton IR) and the reference once each."""
    import functools

    import jax
    import numpy as np
    from jax.experimental import pallas as pl

    import kq_jax.route_shed_pallas as kernel_module
    from kq.inputs import router_inputs
    from kq_jax.reference import route_shed_reference

    kernel_module.pl.pallas_call = functools.partial(pl.pallas_call, debug=True)
    inputs = router_inputs(np.random.default_rng(0), 4096, 8, 256)
    jax.block_until_ready(jax.jit(kernel_module.route_shed_pallas)(*inputs))
    jax.block_until_ready(jax.jit(route_shed_reference)(*inputs))


def inspect_lowering(dump_dir: Path, sink) -> int:
    """Counts float multiplies/divides/FMAs in what this GPU compiles; -1 if nothing was captured.

    The kernel: its Triton IR as lowered for this device (Pallas' debug print).
    The reference: XLA's HLO after optimisations, where an f32 divide or
    multiply would become the approximate/contractible PTX the contract forbids.
    """
    env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={dump_dir}")
    done = subprocess.run([sys.executable, __file__, "--dump-only"], env=env, check=True,
                          capture_output=True, text=True)
    triton_ir = done.stdout
    float_ops = re.compile(r"arith\.(mulf|divf|remf)|math\.fma|tt\.precise_divf")
    hits = sorted(set(m.group(0) for m in float_ops.finditer(triton_ir)))
    captured = "tt.func" in triton_ir
    log(f"kernel Triton IR ({'captured' if captured else 'NOT captured'}): float mul/div/fma ops "
        f"{hits or 'none'}; float adds {triton_ir.count('arith.addf')}", sink)
    bad = len(hits)
    hlo_files = sorted(glob.glob(str(dump_dir / "*after_optimizations.txt")))
    hlo_float = re.compile(r"f32\[[^\]]*\]\{?[^ ]*\s+(divide|multiply)\(")
    for path in hlo_files:
        found = sorted(set(m.group(1) for m in hlo_float.finditer(Path(path).read_text(errors="replace"))))
        log(f"reference HLO {Path(path).name}: f32 ops {found or 'none'}", sink)
        bad += len(found)
    return bad if captured and hlo_files else -1


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="out")
    parser.add_argument("--dump-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--parts", default="check,rows,pytest,lowering",
                        help="comma-separated subset of check,rows,pytest,lowering")
    parser.add_argument("--pytest-timeout", type=int, default=300)
    parser.add_argument("--rows-seconds", type=float, default=240,
                        help="the random-rows part starts no new shape after this many seconds")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    if args.dump_only:
        compile_for_dump()
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dump_dir = out / "xla_dump"

    import jax
    import jax.numpy as jnp
    import numpy as np

    from kq.backends import backend
    from kq.check import format_table, run_checks
    from kq_jax.exact_f32 import div_flush_raw

    sink = open(out / "gpu_check.log", "a")  # several partial runs in one call add up in one log
    device = jax.devices()[0]
    log(f"device: {device.device_kind}; jax {jax.__version__}; backend {jax.default_backend()}", sink)
    if jax.default_backend() != "gpu":
        log("FAIL: no GPU", sink)
        return 1

    parts = set(args.parts.split(","))
    start = time.time()
    reports, golden_ok = [], True
    if "check" in parts:
        reports = run_checks(tuple(backend(n) for n in ("jax-reference", "jax-pallas")), random_rows=8192)
        log(format_table(reports), sink)
        golden_ok = all(r.ok for r in reports)

    rows = cases = failures = 0
    if "rows" in parts:
        log(f"[{time.time() - start:.0f}s] random rows", sink)
        rows, cases, failures = random_rows(sink, args.rows_seconds)
        log(f"random rows: {rows} rows in {cases} (case, impl) runs, {failures} mismatching", sink)

    tests_ok, summary = True, "not run"
    if "pytest" in parts:
        log(f"[{time.time() - start:.0f}s] pytest", sink)
        # The compiled kernel and the jitted reference under jit / vmap / scan / grad, and the PTX
        # roundings; the interpreter is CI's job. The golden cases and random rows are the "check" and
        # "rows" parts: through pytest they compile once per case and example, and test_golden +
        # test_random_rows with test_jax ran past 300 s on the H200 (72 of ~250 tests done).
        command = [sys.executable, "-m", "pytest", "-q", "-x", "tests/test_jax.py", "tests/test_exact_f32.py",
                   "-k", "not interpret", "--durations=15"]
        try:
            tests = subprocess.run(command, capture_output=True, text=True, timeout=args.pytest_timeout)
            sink.write(tests.stdout[-6000:] + tests.stderr[-3000:])
            summary = (tests.stdout.strip().splitlines() or ["(no output)"])[-1]
            tests_ok = tests.returncode == 0
        except subprocess.TimeoutExpired as expired:
            sink.write(str(expired.stdout or "")[-6000:])
            summary, tests_ok = f"timed out after {args.pytest_timeout} s", False
        log(f"pytest (GPU): {summary}", sink)

    plain = jax.jit(lambda a, b: a / b)
    x = jnp.float32(3163.328613)
    log(f"plain jnp division on this GPU: 3163.328613/3163.328613 = {float(plain(x, x))!r} "
        f"(bits 0x{int(np.asarray(plain(x, x)).view(np.uint32)):08x}); exact_f32: "
        f"{float(jax.jit(div_flush_raw)(x, x))!r}", sink)

    bad_ops = inspect_lowering(dump_dir, sink) if "lowering" in parts else 0
    ok = golden_ok and failures == 0 and tests_ok and bad_ops == 0
    log(f"SUMMARY {'PASS' if ok else 'FAIL'}: {device.device_kind}, jax {jax.__version__}: "
        f"golden+random kq check {'ok' if golden_ok else 'FAILED'} "
        f"({', '.join(f'{r.name} {r.passed}/{r.run}' for r in reports)}); "
        f"{rows} random rows x 2 impls, {failures} mismatches; pytest {summary}; "
        f"float mul/div in lowering: {bad_ops if 'lowering' in parts else 'not inspected'}; parts {args.parts}; "
        f"{time.time() - start:.0f}s", sink)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
