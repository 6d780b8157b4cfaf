"""The Metal and CUDA kernel sources: what MLX would compile, executed or inspected here."""

import re
import shutil
import subprocess

import pytest
from conftest import assert_same_bits

from kq_core.inputs import adversarial_inputs
from kq_core.oracle import route_shed_oracle
from kq_mlx import cuda_cupy, metal_cpu, sources


def test_sources_split_into_header_and_body():
    for filename in ("route_shed.metal", "route_shed.cu"):
        source = sources.load(filename)
        assert "kq_mul_flush" in source.header and "kq_flush" in source.header
        assert "miss_scores[" in source.body and "==== body" not in source.body


def test_metal_signature_matches_what_mlx_generates():
    signature = sources.metal_signature("uint32", "bfloat16", 8)
    assert "[[kernel]] void custom_kernel_kq_route_shed_uint32_bfloat16_k8(" in signature
    assert "const device uint32_t* indices [[buffer(0)]]" in signature
    assert "const constant int* indices_shape [[buffer(1)]]" in signature
    assert "device float* miss_scores [[buffer(8)]]" in signature
    assert signature.endswith("uint3 thread_position_in_grid [[thread_position_in_grid]])")
    # The file's top comment shows the same signature.
    text = (metal_cpu.resources.files("kq_mlx") / "route_shed.metal").read_text()
    assert "const constant int* slot_table_shape [[buffer(4)]]" in text


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
@pytest.mark.parametrize("top_k", [1, 6, 64])
def test_metal_source_runs_past_the_last_row_without_writing(rng, top_k):
    """The harness launches extra threads and checks guard bands around every output."""
    inputs = adversarial_inputs(rng, 7, top_k, 50)
    assert_same_bits(route_shed_oracle(*inputs), metal_cpu.route_shed_metal_cpu(*inputs))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
@pytest.mark.parametrize("index_dtype, score_dtype, top_k", [("uint32", "bfloat16", 8), ("int32", "float16", 6),
                                                            ("int32", "float32", 64)])
def test_cuda_twin_ptx_holds_only_round_to_nearest_float_ops(tmp_path, index_dtype, score_dtype, top_k):
    unit = tmp_path / "route_shed.cu"
    unit.write_text(cuda_cupy.translation_unit(index_dtype, score_dtype, top_k))
    ptx = tmp_path / "route_shed.ptx"
    subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "-ptx", str(unit), "-o", str(ptx)], check=True)
    ops = set(re.findall(r"\b(?:add|sub|mul|div|fma|rcp)\.[a-z0-9.]*f32\b", ptx.read_text()))
    assert ops, "no float ops found: the PTX was not what we think"
    assert ops <= {"add.rn.f32", "div.rn.f32"}, sorted(ops)
