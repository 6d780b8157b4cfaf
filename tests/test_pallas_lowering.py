"""The Pallas kernel's Triton IR, lowered here for CUDA without a GPU.

The kernel must hold no float multiply, divide or FMA (they would let Triton
pick approximate or contracted forms on the GPU): only float adds, compares
and selects, plus, with ``ptx_arith``, the IEEE ``mul.rn.f32`` and
``div.rn.f32`` written out as inline PTX. ``tests/test_ieee_f32.py`` checks those on a real GPU.
"""

import functools
import re

import numpy as np
import pytest

jax = pytest.importorskip("jax")
from jax import export  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

from kq_core.inputs import router_inputs  # noqa: E402

FORBIDDEN = re.compile(r"arith\.(mulf|divf|remf)|math\.fma|tt\.precise_divf|fdiv")


@pytest.mark.parametrize("rows, top_k, experts, index_dtype, score_dtype, path, ptx_arith", [
    (64, 8, 256, "int32", "float32", "strided", False), (5, 6, 40, "uint32", "bfloat16", "strided", False),
    (3, 64, 1024, "int32", "float16", "strided", False), (7, 1, 1, "uint32", "float32", "strided", False),
    (64, 8, 256, "int32", "float32", "tiled", False), (5, 6, 40, "uint32", "bfloat16", "tiled", False),
    (64, 8, 256, "int32", "float32", "strided", True), (3, 64, 1024, "int32", "float16", "strided", True),
    (64, 8, 256, "int32", "float32", "tiled", True),
    (9, 64, 1024, "uint32", "float32", "lanes", False), (9, 64, 1024, "int32", "bfloat16", "lanes", True),
])
def test_triton_ir_has_no_float_multiply_or_divide(monkeypatch, capfd, rows, top_k, experts, index_dtype,
                                                   score_dtype, path, ptx_arith):
    from kq_jax.pallas_config import KernelConfig
    from kq_jax.route_shed_pallas import route_shed_pallas

    inputs = router_inputs(np.random.default_rng(0), rows, top_k, experts, index_dtype=index_dtype,
                           score_dtype=score_dtype)
    config = KernelConfig(tiled_io=path == "tiled", ptx_arith=ptx_arith, entry_lanes=path == "lanes")
    ir = _triton_ir(monkeypatch, capfd, lambda i, s, t: route_shed_pallas(i, s, t, config=config), inputs)
    assert_only_exact_float_ops(ir, ptx_arith)


@pytest.mark.parametrize("rows, experts, top_k, dtype, ptx_arith", [
    (1, 64, 8, "float32", False), (8, 256, 8, "bfloat16", True), (5, 40, 16, "float16", True),
])
def test_topk_kernel_triton_ir_has_no_float_multiply_or_divide(monkeypatch, capfd, rows, experts, top_k, dtype,
                                                               ptx_arith):
    import jax.numpy as jnp

    from kq_jax.pallas_config import KernelConfig
    from kq_jax.topk_route_shed_pallas import topk_route_shed_pallas

    rng = np.random.default_rng(0)
    probs = jnp.asarray(rng.random((rows, experts)), dtype)
    table = np.where(rng.random(experts) < 0.5, np.arange(experts), -1).astype(np.int32)
    config = KernelConfig(ptx_arith=ptx_arith)
    ir = _triton_ir(monkeypatch, capfd,
                    lambda p, t: topk_route_shed_pallas(p, t, top_k=top_k, config=config), (probs, table))
    assert_only_exact_float_ops(ir, ptx_arith)


def _triton_ir(monkeypatch, capfd, fn, inputs) -> str:
    """The Triton IR the kernels in ``fn`` lower to for CUDA (skips where this jaxlib cannot lower it)."""
    from kq_jax import route_shed_pallas as module

    monkeypatch.setattr(module.pl, "pallas_call", functools.partial(pl.pallas_call, debug=True))
    try:
        export.export(jax.jit(fn), platforms=["cuda"],
                      disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*inputs)
    except (ImportError, NotImplementedError) as why:  # a jaxlib without the Triton dialect
        pytest.skip(f"cannot lower to Triton here: {why}")
    ir = capfd.readouterr().out
    assert "tt.func" in ir and "tt.load" in ir, "the Triton IR was not printed"
    return ir


def assert_only_exact_float_ops(ir: str, ptx_arith: bool):
    assert "arith.addf" in ir
    assert not FORBIDDEN.findall(ir), sorted(set(FORBIDDEN.findall(ir)))
    # With ptx_arith the one multiply and the one divide are the IEEE PTX instructions, written out.
    rounded = sorted(set(re.findall(r"(?:mul|div)\.rn\.f32", ir)))
    assert rounded == (["div.rn.f32", "mul.rn.f32"] if ptx_arith else [])


def test_repeated_calls_lower_the_kernel_once():
    """A model calls route_shed once per MoE layer; each call must not trace and lower the kernel again
    (on the H200 that cost ~1 s per call site and dominated compile time)."""
    from kq_jax.route_shed_pallas import route_shed_pallas

    inputs = router_inputs(np.random.default_rng(0), 64, 8, 256)

    def layers(indices, scores, table):
        for _ in range(4):
            scores = scores + 0 * route_shed_pallas(indices, scores, table).mix
        return scores

    try:
        exported = export.export(jax.jit(layers), platforms=["cuda"], disabled_checks=[
            export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*inputs)
    except (ImportError, NotImplementedError) as why:
        pytest.skip(f"cannot lower to Triton here: {why}")
    module_text = exported.mlir_module()
    assert module_text.count("__gpu$xla.gpu.triton") == 1
    assert module_text.count("call @") >= 4
