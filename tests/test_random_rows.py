"""Hypothesis-driven random rows: every backend against the oracle, the oracle against the contract."""

import pytest
from conftest import HYPOTHESIS_SHAPES, assert_same_bits
from hypothesis import HealthCheck, given, settings
from scalar_contract import route_shed_scalar
from strategies import route_shed_inputs

from kq_core.oracle import route_shed_oracle

@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(inputs=route_shed_inputs(shapes=HYPOTHESIS_SHAPES))
def test_backend_matches_oracle(runner, inputs):
    assert_same_bits(route_shed_oracle(*inputs), runner(*inputs))


# The backends that compile per shape on the CPU: a short run here, the full one under -m exhaustive.
@pytest.mark.parametrize("runner", ["jax-pallas-interpret", "jax-reference", "mlx-ops"], indirect=True)
@settings(max_examples=10, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(inputs=route_shed_inputs(shapes=HYPOTHESIS_SHAPES))
def test_compiling_backend_matches_oracle_on_a_few_rows(runner, inputs):
    assert_same_bits(route_shed_oracle(*inputs), runner(*inputs))


@settings(max_examples=150, deadline=None)
@given(inputs=route_shed_inputs(max_rows=6))
def test_oracle_matches_scalar_contract(inputs):
    assert_same_bits(route_shed_scalar(*inputs), route_shed_oracle(*inputs))
