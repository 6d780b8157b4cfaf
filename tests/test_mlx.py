"""kq_mlx: laziness, dispatch, eager vs mx.compile, and composing with mx.gather_mm."""

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from conftest import assert_same_bits  # noqa: E402

import kq_mlx  # noqa: E402
from kq_core.inputs import adversarial_inputs, router_inputs  # noqa: E402
from kq_core.oracle import route_shed_oracle  # noqa: E402
from kq_mlx.route_shed_mlx import cuda_kernel, from_numpy, metal_kernel  # noqa: E402


def as_mx(*arrays):
    return tuple(from_numpy(a) for a in arrays)


def test_building_the_op_evaluates_nothing(rng):
    """mx.compile refuses any evaluation while tracing, so a clean trace proves laziness."""
    inputs = router_inputs(rng, 16, 8, 64, index_dtype="uint32")
    traced = mx.compile(lambda i, s, t: tuple(kq_mlx.route_shed(i, s, t)))
    out = traced(*as_mx(*inputs))
    assert_same_bits(route_shed_oracle(*inputs), [np.array(o) for o in out])


def test_eval_during_compile_is_what_the_laziness_test_would_catch():
    with pytest.raises(ValueError):
        mx.compile(lambda x: x * float(x.sum().item()))(mx.ones(3))


def test_cpu_stream_uses_the_ops_path():
    assert kq_mlx.implementation_for(mx.cpu) == "ops"
    assert kq_mlx.implementation_for(mx.default_stream(mx.cpu)) == "ops"


@pytest.mark.skipif(mx.metal.is_available(), reason="this machine has Metal")
def test_metal_kernel_refuses_to_build_without_metal():
    with pytest.raises(RuntimeError, match="Metal"):
        metal_kernel.__wrapped__("uint32", "float32", 8)


@pytest.mark.skipif(hasattr(mx, "cuda") and mx.cuda.is_available(), reason="this MLX has CUDA")
def test_cuda_kernel_refuses_to_build_without_cuda():
    with pytest.raises(RuntimeError, match="CUDA"):
        cuda_kernel.__wrapped__("uint32", "float32", 8)


@pytest.mark.parametrize("score_dtype", ["float32", "bfloat16", "float16"])
def test_eager_and_compiled_agree(rng, score_dtype):
    inputs = adversarial_inputs(rng, 300, 8, 64, score_dtype=score_dtype, index_dtype="uint32")
    eager = kq_mlx.route_shed_ops(*as_mx(*inputs), compiled=False)
    compiled = kq_mlx.route_shed_ops(*as_mx(*inputs), compiled=True)
    assert_same_bits(route_shed_oracle(*inputs), [np.array(o) for o in eager])
    assert_same_bits(route_shed_oracle(*inputs), [np.array(o) for o in compiled])


def test_the_compiled_ops_path_retraces_for_k_and_e_but_not_for_rows(rng):
    """route_shed_ops compiles shapeless: new row counts reuse one compile, while a new K or E of the same
    rank (which a shapeless trace would not notice) gets a trace of its own. Bits equal in every call."""
    from kq_mlx.route_shed_mlx import _route_shed_ops_compiled

    _route_shed_ops_compiled.cache_clear()
    for rows, top_k, experts in [(3, 8, 40), (70, 8, 40), (5, 2, 40), (1, 8, 40), (9, 2, 40), (9, 2, 12),
                                 (4, 8, 12), (6, 1, 12), (300, 1, 12)]:
        inputs = adversarial_inputs(rng, rows, top_k, experts)
        out = kq_mlx.route_shed_ops(*as_mx(*inputs))
        assert_same_bits(route_shed_oracle(*inputs), [np.array(o) for o in out])
    assert _route_shed_ops_compiled.cache_info().currsize == 5  # (8, 40), (2, 40), (2, 12), (8, 12), (1, 12)


def test_slots_feed_gather_mm_like_a_resident_block(rng):
    """An arena of S slots fed slots/mix gives the fully resident block's output."""
    tokens, top_k, experts, d_in, d_out = 6, 4, 16, 64, 64  # sizes MLX's CUDA gather_mm takes (see below)
    ids, scores, _ = router_inputs(rng, tokens, top_k, experts, index_dtype="uint32")
    weights = rng.normal(size=(experts, d_in, d_out)).astype(np.float32)
    resident = np.sort(rng.choice(experts, 9, replace=False))
    table = np.full(experts, -1, np.int32)
    table[resident] = rng.permutation(len(resident))
    arena = np.zeros((len(resident), d_in, d_out), np.float32)
    arena[table[resident]] = weights[resident]
    x = mx.array(rng.normal(size=(tokens, 1, 1, d_in)).astype(np.float32))

    out = kq_mlx.route_shed(*as_mx(ids, scores, table))
    arena_y = mx.gather_mm(x, mx.array(arena), rhs_indices=out.slots)  # [T, K, 1, O]
    arena_y = mx.sum(arena_y[:, :, 0, :] * out.mix[..., None], axis=1)

    expected = route_shed_oracle(ids, scores, table)
    full_y = mx.gather_mm(x, mx.array(weights), rhs_indices=mx.array(ids))
    full_y = mx.sum(full_y[:, :, 0, :] * mx.array(expected.mix)[..., None], axis=1)
    np.testing.assert_array_equal(np.array(arena_y), np.array(full_y))
    assert out.slots.dtype == mx.uint32


def test_all_resident_matches_the_unmodified_block(rng):
    tokens, top_k, experts, d_in, d_out = 5, 8, 32, 64, 64
    ids, scores, _ = router_inputs(rng, tokens, top_k, experts, index_dtype="uint32", normalized=True)
    table = np.arange(experts, dtype=np.int32)
    weights = mx.array(rng.normal(size=(experts, d_in, d_out)).astype(np.float32))
    x = mx.array(rng.normal(size=(tokens, 1, 1, d_in)).astype(np.float32))
    out = kq_mlx.route_shed(*as_mx(ids, scores, table))
    shed = mx.sum(mx.gather_mm(x, weights, rhs_indices=out.slots)[:, :, 0, :] * out.mix[..., None], axis=1)
    plain = mx.sum(mx.gather_mm(x, weights, rhs_indices=mx.array(ids))[:, :, 0, :] * mx.array(scores)[..., None],
                   axis=1)
    np.testing.assert_array_equal(np.array(shed), np.array(plain))


@pytest.mark.skipif(hasattr(mx, "cuda") and mx.cuda.is_available(),
                    reason="MLX's CUDA backend (0.32.4) fails mx.gather_mm on 8 x 5 expert matrices with 'misaligned "
                           "address', an error that then fails every later CUDA call of the process")
def test_gather_mm_on_small_expert_matrices(rng):
    """mx.gather_mm itself on 8 x 5 experts (the arena tests above use 64 x 64)."""
    weights = rng.normal(size=(16, 8, 5)).astype(np.float32)
    x = rng.normal(size=(6, 1, 1, 8)).astype(np.float32)
    ids = rng.integers(0, 16, (6, 4)).astype(np.uint32)
    got = np.array(mx.gather_mm(mx.array(x), mx.array(weights), rhs_indices=mx.array(ids)))
    np.testing.assert_allclose(got[:, :, 0, :], np.einsum("ti,tkio->tko", x[:, 0, 0, :], weights[ids]), rtol=1e-5,
                               atol=1e-5)


def test_wrong_arguments_name_the_argument():
    ids = mx.zeros((2, 4), mx.uint32)
    with pytest.raises(ValueError, match="scores"):
        kq_mlx.route_shed(ids, mx.zeros((2, 3)), mx.zeros(8, mx.int32))
    with pytest.raises(TypeError, match="indices"):
        kq_mlx.route_shed(ids.astype(mx.float32), mx.zeros((2, 4)), mx.zeros(8, mx.int32))
    with pytest.raises(TypeError, match="slot_table"):
        kq_mlx.route_shed(ids, mx.zeros((2, 4)), mx.zeros(8, mx.int64))


def test_kq_route_shed_dispatches_mlx_arrays(rng):
    import kq

    inputs = router_inputs(rng, 3, 8, 32)
    out = kq.route_shed(*as_mx(*inputs))
    assert isinstance(out.mix, mx.array)
    assert_same_bits(route_shed_oracle(*inputs), [np.array(o) for o in out])


_GPU_KERNEL = kq_mlx.implementation_for(mx.gpu) != "ops"


@pytest.mark.parametrize("dtypes", [("int32", "float32"), ("uint32", "bfloat16")], ids=["int32-f32", "uint32-bf16"])
@pytest.mark.parametrize("stream", ["cpu", "gpu"])
@pytest.mark.parametrize("top_k", [1, 8], ids=["k1", "k8"])
def test_one_shapeless_compile_serves_every_row_count(rng, dtypes, stream, top_k):
    """mx.compile(shapeless=True), as mlx-lm compiles in places: row counts and ranks change between calls
    of one compiled function; every output is the oracle's, adversarial rows included. On a CPU stream
    through the dispatcher, on a GPU stream through the pure-mx path (MLX's custom kernels have no shape
    inference: the next test)."""
    if stream == "gpu" and not mx.is_available(mx.gpu):
        pytest.skip("no MLX GPU")
    index_dtype, score_dtype = dtypes
    device = mx.cpu if stream == "cpu" else mx.gpu
    op = kq_mlx.route_shed if stream == "cpu" else kq_mlx.route_shed_ops

    def traced(i, s, t):
        with mx.stream(device):
            return tuple(op(i, s, t))

    fn = mx.compile(traced, shapeless=True)
    for leading in [(3,), (64,), (1,), (200,), (2, 5), (1, 1), (4, 33)]:
        rows = int(np.prod(leading))
        ids, scores, table = adversarial_inputs(rng, rows, top_k, 40, index_dtype=index_dtype,
                                                score_dtype=score_dtype)
        ids, scores = ids.reshape(*leading, top_k), scores.reshape(*leading, top_k)
        out = fn(*as_mx(ids, scores, table))
        expected = route_shed_oracle(ids, scores, table)
        assert_same_bits(expected, [np.array(o) for o in out])


@pytest.mark.skipif(not _GPU_KERNEL, reason="no Metal or CUDA kernel in this MLX")
def test_shapeless_compile_of_the_gpu_kernel_is_refused_by_mlx(rng):
    """MLX 0.32.4 cannot infer a custom kernel's output shapes, so a shapeless compile over the kernel
    stops with MLX's error; a compile with shapes retraces per row count and serves them all."""
    inputs = [router_inputs(rng, rows, 8, 64) for rows in (3, 17)]
    shapeless = mx.compile(lambda i, s, t: tuple(kq_mlx.route_shed(i, s, t, stream=mx.gpu)), shapeless=True)
    with pytest.raises(ValueError, match="CustomKernel cannot infer output shapes"):
        for case in inputs:
            mx.eval(shapeless(*as_mx(*case)))
    shaped = mx.compile(lambda i, s, t: tuple(kq_mlx.route_shed(i, s, t, stream=mx.gpu)))
    for case in inputs:
        assert_same_bits(route_shed_oracle(*case), [np.array(o) for o in shaped(*as_mx(*case))])


@pytest.mark.parametrize("rows", [255, 256, 257, 4096])
@pytest.mark.parametrize("top_k", [1, 8, 64])
def test_default_stream_across_block_boundaries(rng, rows, top_k):
    """Row counts around and past one thread block of the GPU kernel (one thread per row), each K's variant;
    on a CPU-only MLX the ops path."""
    inputs = adversarial_inputs(rng, rows, top_k, max(64, 2 * top_k))
    out = kq_mlx.route_shed(*as_mx(*inputs))
    assert_same_bits(route_shed_oracle(*inputs), [np.array(o) for o in out])


@pytest.mark.parametrize("on_miss", ["shed", "substitute"])
def test_topk_route_shed_sorts_in_blocks_of_rows(rng, monkeypatch, on_miss):
    """Where one sort may take only so many rows (MLX-CUDA: 65,535), the rows go through in blocks and
    come back in their shape with the oracle's bits; here blocks of 7 rows, on any stream."""
    from kq_core.oracle import topk_route_shed_oracle
    from kq_mlx import route_shed_mlx

    monkeypatch.setattr(route_shed_mlx, "rows_per_sort", lambda stream=None: 7)
    probs = rng.dirichlet(np.ones(32), size=(4, 5)).astype(np.float32)
    probs[0, 1, 3] = probs[0, 1, 4]  # a tie across experts
    table = np.where(rng.random(32) < 0.5, rng.permutation(32), -1).astype(np.int32)
    out = kq_mlx.topk_route_shed(probs, table, top_k=4, on_miss=on_miss)
    assert out.indices.shape == (4, 5, 4)
    assert_same_bits(topk_route_shed_oracle(probs, table, 4, on_miss=on_miss), out)
