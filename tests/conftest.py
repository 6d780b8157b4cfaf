import ctypes
import gc
import os
import sys

# Eight host devices for the sharding tests (tests/test_sharding.py); set before JAX starts.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import numpy as np
import pytest
from hypothesis import settings

from kq.backends import Unavailable, all_backends, backend
from kq_core.spec import load_spec

SPEC = load_spec()
BACKEND_NAMES = [b.name for b in all_backends()]

# Hypothesis profiles: "ci" (the default) and "gpu", where every new shape costs a kernel compile, so
# fewer examples drawn from a few shared shapes (KQ_HYPOTHESIS_PROFILE=gpu; kq/bench/jobs/gpu_job.sh sets it).
HYPOTHESIS_PROFILE = os.environ.get("KQ_HYPOTHESIS_PROFILE", "ci")
settings.register_profile("ci", max_examples=60, deadline=None)
settings.register_profile("gpu", max_examples=12, deadline=None)
settings.load_profile(HYPOTHESIS_PROFILE)
# (rows, K, E) the "gpu" profile draws from; None: any shape.
HYPOTHESIS_SHAPES = ((1, 8, 64), (8, 8, 300), (24, 64, 300), (0, 6, 1)) if HYPOTHESIS_PROFILE == "gpu" else None


@pytest.fixture(scope="session", params=BACKEND_NAMES)
def runner(request):
    """Each backend's runner; skips (with the reason) where it cannot run here."""
    if request.param == "jax-pallas-interpret" and _jax_on_gpu():
        pytest.skip("jax-pallas-interpret: on a GPU the compiled kernel is tested; the interpreter runs in CI")
    try:
        run, _device = backend(request.param).probe()
    except Unavailable as why:
        pytest.skip(f"{request.param}: {why}")
    return run


def _jax_on_gpu() -> bool:
    try:
        import jax
    except ImportError:
        return False
    return jax.default_backend() == "gpu"


def assert_same_bits(expected, got):
    """Every bit of ``got`` is ``expected``'s: a route_shed result field by field, or one array whole."""
    from kq_core.compare import first_mismatch

    if isinstance(expected, np.ndarray):  # one array (a result's fields are compared by first_mismatch)
        got = np.asarray(got)
        assert (got.dtype, got.shape) == (expected.dtype, expected.shape), (got.dtype, got.shape)
        width = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[expected.dtype.itemsize]
        differs = np.argwhere(expected.view(width) != got.view(width))
        assert differs.size == 0, f"first differing element {tuple(differs[0])}: {expected[tuple(differs[0])]!r} " \
                                  f"against {got[tuple(differs[0])]!r}"
        return
    mismatch = first_mismatch(expected, got)
    assert mismatch is None, str(mismatch)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def on_cpu():
    """MLX's default device the CPU for the test (where a graph takes route_shed_columns), then back."""
    import mlx.core as mx

    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(device)


def _release_compiled_programs() -> None:
    """Lets go of the compiled programs and buffer caches that tests left behind."""
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
    if "mlx.core" in sys.modules:
        sys.modules["mlx.core"].clear_cache()
    gc.collect()
    if sys.platform == "linux":  # glibc keeps freed heap pages; hand them back
        ctypes.CDLL(None).malloc_trim(0)


# Files whose every test compiles programs of its own (the Pallas interpreter's among them): released
# after each test, where the rest are released after each file.
RELEASED_PER_TEST = {"test_jax.py", "test_topk_options.py"}


@pytest.fixture(scope="module", autouse=True)
def _release_after_each_file():
    """One worker runs many files: none keeps another file's compiles resident."""
    yield
    _release_compiled_programs()


@pytest.fixture(autouse=True)
def _release_after_each_test(request):
    yield
    if request.path.name in RELEASED_PER_TEST:
        _release_compiled_programs()


# The part of the suite a CUDA machine runs (`pytest -m gpu`): the JAX modules, and every backend test of
# the backends that run on a GPU. Tagged here, in one place; it runs on the CPU too.
GPU_MODULES = {"test_jax.py", "test_topk_route_shed.py", "test_moe_jax.py", "test_ieee_f32.py",
               "test_pallas_lowering.py", "test_miss_fetch.py", "test_nnx.py", "test_qwen3_moe_nnx.py"}
GPU_BACKENDS = {"jax-pallas", "jax-reference", "cuda-source-cupy", "mlx-cuda"}


# Exhaustive cases (`pytest -m exhaustive`; .ci/run runs them after the README's command): every Pallas
# kernel variant over every golden case through the interpreter, the longest interpreted top-k case,
# full hypothesis runs of the backends that compile per shape on the CPU (a short run of each stays in
# the default suite: test_random_rows.py), and the compile benchmark end to end.
EXHAUSTIVE = (
    "test_jax.py::test_pallas_variant_keeps_the_bits_on_every_golden_case",
    "test_topk_route_shed.py::test_matches_the_oracle[6x40-k16-res0.5-pallas_interpret]",
    "test_random_rows.py::test_backend_matches_oracle[jax-pallas-interpret]",
    "test_random_rows.py::test_backend_matches_oracle[jax-reference]",
    "test_random_rows.py::test_backend_matches_oracle[mlx-ops]",
    "test_cli.py::test_bench_compile_counts_kernels_per_bucket",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        params = getattr(item, "callspec", None)
        if item.path.name in GPU_MODULES or (params and params.params.get("runner") in GPU_BACKENDS):
            item.add_marker(pytest.mark.gpu)
        if any(pattern in item.nodeid for pattern in EXHAUSTIVE):
            item.add_marker(pytest.mark.exhaustive)


def _skip_kind(reason: str) -> str:
    """A skip reason, grouped: what the skipped tests need that this machine lacks."""
    lowered = reason.lower()
    for needle, kind in (("cupy", "need CuPy"), ("metal", "need a Metal GPU"), ("mlx with a", "need an MLX GPU"),
                         ("mlx gpu", "need an MLX GPU"), ("cuda", "need a CUDA GPU"), ("gpu", "need a GPU"),
                         ("ptx", "need a CUDA GPU")):
        if needle in lowered:
            return kind
    return reason.split(": ", 1)[-1]


def pytest_terminal_summary(terminalreporter):
    """One line saying why tests were skipped, e.g. ``skipped 180: 120 need a CUDA GPU, ...``."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    kinds: dict[str, int] = {}
    for report in skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        kind = _skip_kind(reason.removeprefix("Skipped: "))
        kinds[kind] = kinds.get(kind, 0) + 1
    ranked = sorted(kinds.items(), key=lambda item: -item[1])
    terminalreporter.write_line(f"skipped {len(skipped)}: " + ", ".join(f"{n} {kind}" for kind, n in ranked))
