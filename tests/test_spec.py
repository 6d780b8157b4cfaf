"""shared/spec.json and the oracle cannot drift apart, and the spec covers the contract."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from conftest import SPEC, assert_same_bits
from scalar_contract import route_shed_scalar

from kq_core.contract import RouteShedResult
from kq_core.oracle import bounded_table, route_shed_oracle
from kq_core.spec import decode_array, default_spec_path, encode_array

REQUIRED_CASES = {
    "decode_typical", "decode_uint32", "k1_kept", "k1_shed", "k6", "k10", "k64", "e1", "all_resident",
    "none_resident", "first_kept_not_first", "tied_miss_scores", "special_scores", "kept_mass_zero",
    "ids_out_of_range_int32", "ids_out_of_range_uint32", "duplicate_ids", "scores_bfloat16",
    "scores_float16", "leading_dims_bsk", "zero_rows", "random_block", "product_rounds_up_to_normal",
}
CASES = {c.name: c for c in SPEC.cases}
MAKE_SPEC_PATH = Path(__file__).resolve().parents[1] / "tools" / "make_spec.py"


@pytest.fixture
def make_spec():
    """tools/make_spec.py, the maintainer's script that writes shared/spec.json, loaded as a module."""
    spec = importlib.util.spec_from_file_location("make_spec", MAKE_SPEC_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_spec_has_every_required_case():
    assert REQUIRED_CASES <= set(CASES)


def test_spec_covers_dtypes_and_shapes():
    index_dtypes = {c.inputs["indices"].dtype.name for c in SPEC.cases}
    score_dtypes = {c.inputs["scores"].dtype.name for c in SPEC.cases}
    assert index_dtypes == {"int32", "uint32"}
    assert score_dtypes == {"float32", "bfloat16", "float16"}
    assert CASES["leading_dims_bsk"].inputs["indices"].ndim == 3
    assert CASES["zero_rows"].rows == 0
    assert CASES["random_block"].rows >= 1000
    assert CASES["e1"].inputs["slot_table"].shape == (1,)


def test_spec_scores_hold_every_edge_value():
    bits = np.concatenate([c.inputs["scores"].astype(np.float32).reshape(-1) for c in SPEC.cases]).view(np.uint32)
    values = bits.view(np.float32)
    assert (bits == 0x80000000).any(), "-0.0"
    assert ((np.abs(values) < 2.0**-126) & (values != 0)).any(), "subnormal"
    assert (values < 0).any() and np.isposinf(values).any() and np.isneginf(values).any()
    assert np.isnan(values).any() and (np.isnan(values) & (bits != 0x7FC00000)).any(), "non-canonical NaN"


@pytest.mark.parametrize("name", list(CASES))
def test_oracle_regenerates_spec(name):
    case = CASES[name]
    assert_same_bits(case.expected, route_shed_oracle(*case.inputs.values(), **case.options))


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n].rows <= 300])
def test_scalar_transcription_agrees_with_spec(name):
    case = CASES[name]
    indices, scores, table = case.inputs.values()
    num_slots = case.options.get("num_slots")
    tier_base = num_slots if case.options.get("on_miss") == "tier" else None
    assert_same_bits(case.expected, route_shed_scalar(indices, scores, bounded_table(table, num_slots), tier_base))


def test_all_resident_scale_is_exactly_one():
    case = CASES["all_resident"]
    np.testing.assert_array_equal(case.expected.mix, case.inputs["scores"])


def test_spec_roundtrip_is_lossless(rng):
    bits = rng.integers(0, 2**32, 100, dtype=np.uint64).astype(np.uint32)
    for array in (bits.view(np.float32), bits.astype(np.int32), bits, bits[:50].astype(np.uint16).view(np.float16)):
        back = decode_array(encode_array(array))
        assert back.dtype == array.dtype and back.tobytes() == array.tobytes()


def test_spec_file_is_the_packaged_one():
    repo_spec = Path(__file__).resolve().parents[1] / "shared" / "spec.json"
    assert default_spec_path().read_bytes() == repo_spec.read_bytes()


def test_make_spec_reproduces_the_file(make_spec):
    assert make_spec.dump(make_spec.build()) == default_spec_path().read_text()


# NumPy functions whose last bit depends on the build and the CPU (SIMD libm variants), and the
# Generator methods that are exact: integers and doubles made from integers by exact operations.
_PLATFORM_ROUNDED = {"exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "power", "float_power",
                     "sin", "cos", "tan", "tanh", "arctan", "sinh", "cosh", "cbrt"}
_EXACT_DRAWS = {"integers", "random", "permutation", "choice", "uniform"}


class _ExactOnlyGenerator:
    def __init__(self, rng):
        self._rng = rng

    def __getattr__(self, name):
        assert name in _EXACT_DRAWS, f"rng.{name} goes through libm: its bits differ across platforms"
        method = getattr(self._rng, name)
        if name != "choice":
            return method

        def choice(*args, **kwargs):
            assert kwargs.get("p") is None, "rng.choice(p=...) draws through float cumulative sums"
            return method(*args, **kwargs)
        return choice


class _ExactOnlyNumpy:
    def __init__(self):
        self.random = self  # np.random.default_rng is the only np.random name the generators use

    def default_rng(self, seed=None):
        return _ExactOnlyGenerator(np.random.default_rng(seed))

    def __getattr__(self, name):
        assert name not in _PLATFORM_ROUNDED, f"np.{name} rounds differently across NumPy builds and CPUs"
        return getattr(np, name)


def test_golden_inputs_use_only_exactly_rounded_operations(monkeypatch, make_spec):
    """Any NumPy on any CPU must regenerate the golden inputs bit for bit."""
    from kq_core import inputs

    monkeypatch.setattr(inputs, "np", _ExactOnlyNumpy())
    monkeypatch.setattr(make_spec, "np", _ExactOnlyNumpy())
    names = [name for name, _, _ in make_spec.cases()]
    assert set(names) == set(CASES)


def test_result_fields_are_the_contract_outputs():
    assert RouteShedResult._fields == ("slots", "mix", "miss_ids", "miss_scores")
