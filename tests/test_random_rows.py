"""Hypothesis-driven random rows: every backend against the oracle, the oracle against the contract."""

from conftest import HYPOTHESIS_SHAPES, assert_same_bits
from hypothesis import HealthCheck, given, settings
from scalar_contract import route_shed_scalar
from strategies import route_shed_inputs

from kq_core.oracle import route_shed_oracle

@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(inputs=route_shed_inputs(shapes=HYPOTHESIS_SHAPES))
def test_backend_matches_oracle(runner, inputs):
    assert_same_bits(route_shed_oracle(*inputs), runner(*inputs))


@settings(max_examples=150, deadline=None)
@given(inputs=route_shed_inputs(max_rows=6))
def test_oracle_matches_scalar_contract(inputs):
    assert_same_bits(route_shed_scalar(*inputs), route_shed_oracle(*inputs))
