import os

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
# fewer examples drawn from a few shared shapes (KQ_HYPOTHESIS_PROFILE=gpu; benchmarks/gpu_job.sh sets it).
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
    from kq_core.compare import first_mismatch

    mismatch = first_mismatch(expected, got)
    assert mismatch is None, str(mismatch)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


# The part of the suite a CUDA machine runs (`pytest -m gpu`): the JAX modules, and every backend test of
# the backends that run on a GPU. Tagged here, in one place; it runs on the CPU too.
GPU_MODULES = {"test_jax.py", "test_topk_route_shed.py", "test_moe_jax.py", "test_exact_f32.py",
               "test_pallas_lowering.py"}
GPU_BACKENDS = {"jax-pallas", "jax-reference", "cuda-source-cupy", "mlx-cuda"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        params = getattr(item, "callspec", None)
        if item.path.name in GPU_MODULES or (params and params.params.get("runner") in GPU_BACKENDS):
            item.add_marker(pytest.mark.gpu)
