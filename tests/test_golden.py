"""Every golden case through every backend that can run here (one id per case x backend)."""

import pytest
from conftest import SPEC, assert_same_bits


@pytest.mark.parametrize("case", SPEC.cases, ids=lambda c: c.name)
def test_golden_case(runner, case):
    assert_same_bits(case.expected, runner(*case.inputs.values(), **case.options))
