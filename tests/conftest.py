import numpy as np
import pytest

from kq.backends import Unavailable, all_backends, backend
from kq_core.spec import load_spec

SPEC = load_spec()
BACKEND_NAMES = [b.name for b in all_backends()]


@pytest.fixture(scope="session", params=BACKEND_NAMES)
def runner(request):
    """Each backend's runner; skips (with the reason) where it cannot run here."""
    try:
        run, _device = backend(request.param).probe()
    except Unavailable as why:
        pytest.skip(f"{request.param}: {why}")
    return run


def assert_same_bits(expected, got):
    from kq_core.compare import first_mismatch

    mismatch = first_mismatch(expected, got)
    assert mismatch is None, str(mismatch)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
