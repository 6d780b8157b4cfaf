"""Hypothesis-driven random rows: every backend against the oracle, the oracle against the contract."""

import numpy as np
import pytest
from conftest import HYPOTHESIS_SHAPES, assert_same_bits
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scalar_contract import route_shed_scalar
from strategies import route_shed_inputs

from kq_core.oracle import route_shed_oracle

# Either no options, or an arena bound at a fraction of E with the misses served from the tier.
OPTIONS = st.sampled_from([None, 0.25, 0.5, 1.0])


def options_for(slot_table, arena_fraction) -> dict:
    if arena_fraction is None:
        return {}
    return {"num_slots": max(1, int(arena_fraction * slot_table.shape[0])), "on_miss": "tier"}


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(inputs=route_shed_inputs(shapes=HYPOTHESIS_SHAPES), arena_fraction=OPTIONS)
def test_backend_matches_oracle(runner, inputs, arena_fraction):
    options = options_for(inputs[2], arena_fraction)
    assert_same_bits(route_shed_oracle(*inputs, **options), runner(*inputs, **options))


# The backends that compile per shape on the CPU: a short run here, the full one under -m exhaustive.
@pytest.mark.parametrize("runner", ["jax-pallas-interpret", "jax-reference", "mlx-ops"], indirect=True)
@settings(max_examples=10, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(inputs=route_shed_inputs(shapes=HYPOTHESIS_SHAPES), arena_fraction=OPTIONS)
def test_compiling_backend_matches_oracle_on_a_few_rows(runner, inputs, arena_fraction):
    options = options_for(inputs[2], arena_fraction)
    assert_same_bits(route_shed_oracle(*inputs, **options), runner(*inputs, **options))


@settings(max_examples=150, deadline=None)
@given(inputs=route_shed_inputs(max_rows=6), arena_fraction=OPTIONS)
def test_oracle_matches_scalar_contract(inputs, arena_fraction):
    indices, scores, table = inputs
    options = options_for(table, arena_fraction)
    num_slots = options.get("num_slots")
    bounded = table if num_slots is None else np.where(table >= num_slots, -1, table).astype(np.int32)
    assert_same_bits(route_shed_scalar(indices, scores, bounded, num_slots), route_shed_oracle(*inputs, **options))
