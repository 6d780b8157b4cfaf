"""``kq bench``'s refusal of backend names it does not know, by type."""

import pytest


def test_an_unknown_backend_raises_its_own_error_type_naming_it():
    from kq.bench.kernels import UnknownBackendError, run

    with pytest.raises(UnknownBackendError, match="'nonsense'") as error:
        run(backends=["numpy-oracle", "nonsense"], progress=False)
    assert isinstance(error.value, ValueError) and "numpy-oracle" in str(error.value)
