"""The low-precision tier under bad inputs: counts and formats that disagree, stores whose reads alias,
stale, corrupt and unwritable caches, failed writes, and weights the format cannot hold."""

import json
import os
import threading
import zipfile

import ml_dtypes
import numpy as np
import pytest

import kq_host.tier as tier_module
from kq_host.expert_store import ExpertStore, ExpertStoreError
from kq_host.tier import (DEFAULT_TIER_BITS, DEFAULT_TIER_GROUP_SIZE, QuantizedWeight, TierOptionError, build_tier,
                          quantize)

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _write_checkpoint(path, rng, *, layers=2, experts=4, hidden=64, ffn=32, dtype=np.float32, scale=1.0):
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for layer in range(layers):
        for expert in range(experts):
            prefix = f"model.layers.{layer}.mlp.experts.{expert}"
            for projection, shape in zip(PROJECTIONS, ((ffn, hidden), (ffn, hidden), (hidden, ffn))):
                tensors[f"{prefix}.{projection}.weight"] = (rng.normal(size=shape) * scale).astype(dtype)
    save_file(tensors, str(path / "model.safetensors"))
    return tensors


def _expected(tensors, layer, expert, projection, bits=DEFAULT_TIER_BITS, group_size=DEFAULT_TIER_GROUP_SIZE):
    return quantize(tensors[f"model.layers.{layer}.mlp.experts.{expert}.{projection}.weight"], bits=bits,
                    group_size=group_size)


def _assert_tier_is(tier, tensors, *, layers=2, experts=4, bits=DEFAULT_TIER_BITS,
                    group_size=DEFAULT_TIER_GROUP_SIZE):
    assert (tier.num_layers, tier.num_experts, tier.bits, tier.group_size) == (layers, experts, bits, group_size)
    for layer in range(layers):
        for expert in range(experts):
            for projection in PROJECTIONS:
                got = QuantizedWeight(*(a[layer, expert] for a in tier.weights[projection]))
                want = _expected(tensors, layer, expert, projection, bits, group_size)
                for a, b in zip(got, want):
                    assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), \
                        (layer, expert, projection)


def _build(checkpoint, cache, layers=2, experts=4, **options):
    with ExpertStore(checkpoint) as store:
        return build_tier(store, layers, experts, cache_dir=cache, **options)


def _cached(cache):
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


# ---- counts that disagree with the store ---------------------------------------------------------


@pytest.mark.parametrize("layers, experts, argument", [(2, 2, "num_experts"), (2, 5, "num_experts"),
                                                       (1, 4, "num_layers"), (3, 4, "num_layers")])
def test_build_tier_refuses_counts_the_store_does_not_hold(tmp_path, rng, layers, experts, argument):
    _write_checkpoint(tmp_path / "ckpt", rng)
    with pytest.raises(TierOptionError, match=argument):
        _build(tmp_path / "ckpt", tmp_path / "cache", layers, experts)
    assert _cached(tmp_path / "cache") == []


# ---- a store whose host_allocator hands out one buffer per shape ---------------------------------


def test_a_reusing_allocator_never_gives_or_caches_a_wrong_tier(tmp_path, rng):
    tensors = _write_checkpoint(tmp_path / "ckpt", rng)
    buffers = {}

    def one_buffer_per_shape(shape, dtype):
        return buffers.setdefault((tuple(shape), np.dtype(dtype)), np.empty(shape, dtype))

    cache = tmp_path / "cache"
    with ExpertStore(tmp_path / "ckpt", host_allocator=one_buffer_per_shape) as store:
        try:
            tier = build_tier(store, 2, 4, cache_dir=cache)
        except (ExpertStoreError, TierOptionError) as error:
            assert "host_allocator" in str(error)
            assert _cached(cache) == []
        else:
            _assert_tier_is(tier, tensors)
    _assert_tier_is(_build(tmp_path / "ckpt", cache), tensors)


class _AliasingStore(ExpertStore):
    """A store whose reads hand gate_proj and up_proj one array (up_proj's weights)."""

    def read_expert(self, layer, expert, **options):
        read = super().read_expert(layer, expert, **options)
        return {**read, "gate_proj": read["up_proj"]}


def test_reads_whose_projections_share_memory_are_refused_and_not_cached(tmp_path, rng):
    tensors = _write_checkpoint(tmp_path / "ckpt", rng)
    cache = tmp_path / "cache"
    with _AliasingStore(tmp_path / "ckpt") as store:
        with pytest.raises(ExpertStoreError, match="gate_proj and up_proj share memory"):
            build_tier(store, 2, 4, cache_dir=cache)
    assert _cached(cache) == []
    _assert_tier_is(_build(tmp_path / "ckpt", cache), tensors)


# ---- stale and mismatched cache entries ----------------------------------------------------------


def test_a_same_size_rewrite_with_its_mtime_restored_is_not_served_the_old_tier(tmp_path, rng):
    checkpoint, cache = tmp_path / "ckpt", tmp_path / "cache"
    _write_checkpoint(checkpoint, rng)
    file = checkpoint / "model.safetensors"
    before = os.stat(file)
    _build(checkpoint, cache)
    tensors = _write_checkpoint(tmp_path / "new", rng)
    with open(file, "r+b") as out:  # in place: the same inode
        out.write((tmp_path / "new" / "model.safetensors").read_bytes())
    os.utime(file, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(file)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    _assert_tier_is(_build(checkpoint, cache), tensors)


class _CountingFile:
    """A file whose reads are counted in ``counts[path]``."""

    def __init__(self, handle, counts):
        self._handle, self._counts = handle, counts

    def __getattr__(self, name):
        return getattr(self._handle, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._handle.close()

    def _count(self, size):
        self._counts[self._handle.name] = self._counts.get(self._handle.name, 0) + (size or 0)
        return size

    def read(self, *args):
        data = self._handle.read(*args)
        self._count(len(data))
        return data

    def readinto(self, buffer):
        return self._count(self._handle.readinto(buffer))


def test_a_cache_hit_reads_the_checkpoints_headers_not_its_weights(tmp_path, rng, monkeypatch):
    checkpoint, cache = tmp_path / "ckpt", tmp_path / "cache"
    tensors = _write_checkpoint(checkpoint, rng, experts=16)
    _build(checkpoint, cache, experts=16)
    counts = {}
    monkeypatch.setattr(tier_module, "open", lambda *a, **k: _CountingFile(open(*a, **k), counts), raising=False)
    _assert_tier_is(_build(checkpoint, cache, experts=16), tensors, experts=16)
    file = checkpoint / "model.safetensors"
    header = 8 + int.from_bytes(file.read_bytes()[:8], "little")
    read_of_the_checkpoint = {name: count for name, count in counts.items() if not name.startswith(str(cache))}
    assert read_of_the_checkpoint == {str(file): header} and header * 20 < file.stat().st_size


def test_a_same_size_rewrite_of_a_tensors_bytes_is_not_served_the_old_tier_though_its_header_is_the_same(
        tmp_path, rng):
    """The header and the mtime the same: the inode's change time tells the rewrite apart."""
    checkpoint, cache = tmp_path / "ckpt", tmp_path / "cache"
    tensors = _write_checkpoint(checkpoint, rng)
    file = checkpoint / "model.safetensors"
    before = os.stat(file)
    _build(checkpoint, cache)
    with ExpertStore(checkpoint) as store:
        entry = store.tensors["model.layers.1.mlp.experts.2.down_proj.weight"]
    name = "model.layers.1.mlp.experts.2.down_proj.weight"
    tensors[name] = -tensors[name]
    with open(file, "r+b") as out:
        out.seek(entry.offset)
        out.write(tensors[name].tobytes())
    os.utime(file, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(file)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    _assert_tier_is(_build(checkpoint, cache), tensors)


class _PublicNamesStore:
    """A store holding an ExpertStore's public surface only: its tensor names through ``layer_tensor_names``."""

    def __init__(self, store):
        self._store = store

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._store, name)


def test_the_cache_key_reads_the_stores_public_tensor_names(tmp_path, rng):
    """Two stores naming other layers of one file, seen through their public attributes only, get their own tiers."""
    from safetensors.numpy import save_file

    file, cache = tmp_path / "model.safetensors", tmp_path / "cache"
    stacks = {layer: rng.normal(size=(2, 32, 64)).astype(np.float32) for layer in range(4)}
    save_file({f"model.layers.{layer}.w": stack for layer, stack in stacks.items()}, str(file))
    for served in ((0, 1), (2, 3)):
        names = {index: {"w": f"model.layers.{layer}.w"} for index, layer in enumerate(served)}
        with ExpertStore.for_tensors(file, names) as store:
            tier = build_tier(_PublicNamesStore(store), 2, 2, bits=4, group_size=32, cache_dir=cache)
        for index, layer in enumerate(served):
            want = quantize(stacks[layer], bits=4, group_size=32)
            for got, expected in zip(tier.layer(index)["w"], want):
                assert got.dtype == expected.dtype and got.tobytes() == expected.tobytes(), (served, layer)
    assert len(_cached(cache)) == 2
    recorded = []
    for name in _cached(cache):
        with np.load(cache / name) as entry:
            recorded.append(json.loads(str(entry["meta"][()]))["layer_tensors"])
    assert sorted(recorded) == [[[index, [["w", f"model.layers.{layer}.w"]]] for index, layer in enumerate(served)]
                                for served in ((0, 1), (2, 3))]

@pytest.mark.parametrize("name", ["model.layers.{layer}.mlp.experts.w", "model.layers.{layer}.mlp.experts.{expert}.w"])
def test_stores_naming_other_layers_of_one_file_get_their_own_tiers(tmp_path, rng, name):
    """Two stores over one file whose layers are other tensors (a stack per layer, or a tensor per expert)."""
    from safetensors.numpy import save_file

    experts, file = 2, tmp_path / "model.safetensors"
    stacks = {layer: rng.normal(size=(experts, 32, 64)).astype(np.float32) for layer in range(4)}
    if "{expert}" in name:
        save_file({name.format(layer=layer, expert=expert): stack[expert] for layer, stack in stacks.items()
                   for expert in range(experts)}, str(file))
    else:
        save_file({name.format(layer=layer): stack for layer, stack in stacks.items()}, str(file))
    cache = tmp_path / "cache"

    def build_and_check(served):
        names = {index: {"w": name.format(layer=layer, expert="{expert}")} for index, layer in enumerate(served)}
        with ExpertStore.for_tensors(file, names) as store:
            tier = build_tier(store, 2, experts, bits=4, group_size=32, cache_dir=cache)
        for index, layer in enumerate(served):
            want = quantize(stacks[layer], bits=4, group_size=32)
            for got, expected in zip(tier.layer(index)["w"], want):
                assert got.dtype == expected.dtype and got.tobytes() == expected.tobytes(), (served, layer)

    build_and_check((0, 1))
    (first,) = _cached(cache)
    for served in ((2, 3), (0, 1)):
        build_and_check(served)
    assert len(_cached(cache)) == 2
    (second,) = set(_cached(cache)) - {first}
    os.replace(cache / first, cache / second)  # layers 0 and 1's entry under the key of layers 2 and 3
    build_and_check((2, 3))


def test_a_cached_file_that_does_not_answer_the_request_is_rebuilt(tmp_path, rng):
    """A tier of other options (or another checkpoint) under the request's name is not returned."""
    tensors = _write_checkpoint(tmp_path / "ckpt", rng)
    _write_checkpoint(tmp_path / "other", rng, experts=8)
    cache, elsewhere = tmp_path / "cache", tmp_path / "elsewhere"
    _build(tmp_path / "ckpt", cache)
    (name,) = _cached(cache)
    for options, layers, experts, checkpoint in (({"bits": 2}, 2, 4, "ckpt"), ({}, 2, 8, "other")):
        _build(tmp_path / checkpoint, elsewhere, layers, experts, **options)
        planted = max(elsewhere.iterdir(), key=lambda p: p.stat().st_mtime_ns)
        os.replace(planted, cache / name)
        _assert_tier_is(_build(tmp_path / "ckpt", cache), tensors)
    assert _cached(cache) == [name]


def test_touching_or_rewriting_the_checkpoint_keeps_one_cached_tier(tmp_path, rng):
    checkpoint, cache = tmp_path / "ckpt", tmp_path / "cache"
    _write_checkpoint(checkpoint, rng)
    for _ in range(3):
        os.utime(checkpoint / "model.safetensors")
        _build(checkpoint, cache)
    tensors = _write_checkpoint(checkpoint, rng)
    _assert_tier_is(_build(checkpoint, cache), tensors)
    assert len(_cached(cache)) == 1


# ---- failed writes -------------------------------------------------------------------------------


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_a_failed_write_leaves_no_temporary(tmp_path, rng, monkeypatch, failure):
    tensors = _write_checkpoint(tmp_path / "ckpt", rng)
    cache = tmp_path / "cache"

    def half_written(out, **arrays):
        out.write(b"PK\x03\x04 partial")
        raise failure

    monkeypatch.setattr(tier_module.np, "savez", half_written)
    if isinstance(failure, KeyboardInterrupt):
        with pytest.raises(KeyboardInterrupt):
            _build(tmp_path / "ckpt", cache)
    else:
        with pytest.warns(UserWarning, match="No space left"):
            _assert_tier_is(_build(tmp_path / "ckpt", cache), tensors)
    assert _cached(cache) == []


def test_a_failed_rename_leaves_no_temporary(tmp_path, rng, monkeypatch):
    tensors = _write_checkpoint(tmp_path / "ckpt", rng)
    cache = tmp_path / "cache"

    def refuse(source, target):
        raise PermissionError(13, "Permission denied", str(target))

    monkeypatch.setattr(tier_module.os, "replace", refuse)
    with pytest.warns(UserWarning, match=str(cache)):
        _assert_tier_is(_build(tmp_path / "ckpt", cache), tensors)
    assert _cached(cache) == []


def test_an_unusable_cache_directory_returns_the_tier_with_a_warning(tmp_path, rng, monkeypatch):
    tensors = _write_checkpoint(tmp_path / "ckpt", rng)
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("KQ_CACHE_DIR", str(blocker))
    with pytest.warns(UserWarning, match=str(blocker)):
        _assert_tier_is(_build(tmp_path / "ckpt", None), tensors)
    with pytest.warns(UserWarning, match="a_file"):
        _assert_tier_is(_build(tmp_path / "ckpt", blocker / "tier"), tensors)
    assert blocker.read_text() == "not a directory"


def test_two_threads_building_one_tier_do_not_collide(tmp_path, rng, monkeypatch, recwarn):
    """Both threads write their temporary at once (a barrier inside the write), then both rename."""
    tensors = _write_checkpoint(tmp_path / "ckpt", rng)
    cache = tmp_path / "cache"
    savez, barrier = np.savez, threading.Barrier(2, timeout=30)

    def together(out, **arrays):
        barrier.wait()
        savez(out, **arrays)
        barrier.wait()

    monkeypatch.setattr(tier_module.np, "savez", together)
    results, errors = [None, None], []

    def build(index):
        try:
            results[index] = _build(tmp_path / "ckpt", cache)
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=build, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == [] and not [w for w in recwarn if "tier" in str(w.message)]
    for result in results:
        _assert_tier_is(result, tensors)
    monkeypatch.setattr(tier_module.np, "savez", savez)
    assert len(_cached(cache)) == 1
    _assert_tier_is(_build(tmp_path / "ckpt", cache), tensors)


# ---- corrupt cache entries -----------------------------------------------------------------------


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _garbage(path):
    path.write_bytes(b"\x00garbage" * 64)


def _empty(path):
    path.write_bytes(b"")


def _missing_member(path):
    with zipfile.ZipFile(path) as old:
        members = {name: old.read(name) for name in old.namelist()}
    with zipfile.ZipFile(path, "w") as new:
        for name, data in members.items():
            if not name.startswith("down_proj.scales"):
                new.writestr(name, data)


def _wrong_shape(path):
    with np.load(path) as old:
        arrays = dict(old)
    arrays["gate_proj.packed"] = arrays["gate_proj.packed"][:, :3]
    with open(path, "wb") as out:
        np.savez(out, **arrays)


@pytest.mark.parametrize("damage", [_truncate, _garbage, _empty, _missing_member, _wrong_shape])
def test_a_damaged_cached_tier_is_rebuilt(tmp_path, rng, damage):
    tensors = _write_checkpoint(tmp_path / "ckpt", rng)
    cache = tmp_path / "cache"
    _build(tmp_path / "ckpt", cache)
    (name,) = _cached(cache)
    damage(cache / name)
    with pytest.warns(UserWarning, match=name):
        _assert_tier_is(_build(tmp_path / "ckpt", cache), tensors)
    assert _cached(cache) == [name]
    _assert_tier_is(_build(tmp_path / "ckpt", cache), tensors)  # the rebuilt entry loads


@pytest.mark.parametrize("dtype", [np.float64, np.float16, ml_dtypes.bfloat16])
def test_a_checkpoint_of_any_float_dtype_caches_a_tier_that_loads(tmp_path, rng, dtype):
    tensors = _write_checkpoint(tmp_path / "ckpt", rng, dtype=dtype)
    cache = tmp_path / "cache"
    first = _build(tmp_path / "ckpt", cache)
    _assert_tier_is(first, tensors)
    again = _build(tmp_path / "ckpt", cache)
    _assert_tier_is(again, tensors)


# ---- quantize: weights the format cannot hold ----------------------------------------------------


@pytest.mark.parametrize("dtype", [np.int32, np.int8, np.uint8, np.bool_, np.complex64])
def test_weights_that_are_not_floats_are_refused(dtype):
    with pytest.raises(TierOptionError, match="weight"):
        quantize(np.ones((2, 32), dtype), bits=4, group_size=32)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float64])
def test_a_range_that_overflows_float32_is_refused(dtype):
    weight = np.ones((2, 64), np.float32)
    weight[1, 33], weight[1, 40] = -3e38, 3e38
    with pytest.raises(TierOptionError, match="weight"):
        quantize(weight.astype(dtype), bits=4, group_size=32)
    with pytest.raises(TierOptionError, match="weight"):
        quantize(np.array([[1e300] + [0.0] * 31]), bits=4, group_size=32)


def test_a_large_range_that_fits_dequantizes_finite():
    weight = np.zeros((1, 32), np.float32)
    weight[0, 0], weight[0, 1] = -1e38, 1e38
    quantized = quantize(weight, bits=8, group_size=32)
    back = tier_module.dequantize(quantized, bits=8, group_size=32)
    # The edge (the extreme of larger magnitude, the maximum on a tie) lies on the grid.
    assert np.all(np.isfinite(back)) and back.max() == np.float32(1e38).astype(ml_dtypes.bfloat16)


def test_a_constant_group_too_large_for_mlx_s_smallest_scale_comes_back_exactly():
    """edge / 1e-7 overflows float32: the scale is 0, every q 0, and the value the bias alone."""
    weight = np.full((1, 32), 1e35, np.float32)
    quantized = quantize(weight, bits=4, group_size=32)
    back = tier_module.dequantize(quantized, bits=4, group_size=32)
    assert back.tobytes() == weight.astype(ml_dtypes.bfloat16).astype(np.float32).tobytes()


# ---- the JAX layer: a tier that does not fit the layer -------------------------------------------


def _layer(rng, experts=16, hidden=64, ffn=32, tokens=5):
    jnp = pytest.importorskip("jax.numpy")
    from kq_jax.moe import Experts

    full = Experts(*(jnp.asarray(rng.normal(size=shape).astype(np.float32) * 0.2)
                     for shape in ((experts, ffn, hidden), (experts, ffn, hidden), (experts, hidden, ffn))))
    x = jnp.asarray(rng.normal(size=(tokens, hidden)).astype(np.float32))
    router = jnp.asarray(rng.normal(size=(hidden, experts)).astype(np.float32))
    return x, router, full


def _tier(full, bits=3, group_size=32, experts=None, as_bits=None, as_group_size=None):
    from kq_jax.moe import tier_experts

    layer = {name: QuantizedWeight(*(a[:experts] for a in quantize(np.asarray(w), bits=bits, group_size=group_size)))
             for name, w in zip(PROJECTIONS, full)}
    return tier_experts(layer, bits=as_bits or bits, group_size=as_group_size or group_size)


def _arena(full, resident=(0, 2, 3, 5, 8, 13)):
    from kq_jax.moe import Experts

    resident = np.asarray(resident, np.int32)
    table = np.full(full.gate.shape[0], -1, np.int32)
    table[resident] = np.arange(resident.size, dtype=np.int32)
    return Experts(*(w[resident] for w in full)), table


@pytest.mark.parametrize("jit", [False, True])
def test_tiered_layer_refuses_a_tier_of_fewer_experts_than_the_router(rng, jit):
    jax = pytest.importorskip("jax")
    from kq_jax.arena_moe import moe_ffn_tiered

    x, router, full = _layer(rng)
    arena, table = _arena(full)
    short = _tier(full, experts=12)

    def layer(x):
        return moe_ffn_tiered(x, router, arena, short, table, top_k=4)

    with pytest.raises(ValueError, match="tier.*12.*16|16.*tier.*12"):
        (jax.jit(layer) if jit else layer)(x)


@pytest.mark.parametrize("mismatch, argument", [({"as_bits": 4}, "bits"), ({"as_bits": 2}, "bits"),
                                                ({"as_group_size": 64}, "group_size"),
                                                ({"bits": 4, "as_bits": 8}, "bits")])
@pytest.mark.parametrize("jit", [False, True])
def test_tiered_layer_names_a_format_that_disagrees_with_the_arrays(rng, mismatch, argument, jit):
    jax = pytest.importorskip("jax")
    from kq_jax.arena_moe import moe_ffn_tiered

    x, router, full = _layer(rng)
    arena, table = _arena(full)
    tier = _tier(full, **mismatch)

    def layer(x):
        return moe_ffn_tiered(x, router, arena, tier, table, top_k=4)

    with pytest.raises(ValueError, match=argument):
        (jax.jit(layer) if jit else layer)(x)


def test_dequantize_rows_and_quantized_apply_name_a_format_that_disagrees(rng):
    jnp = pytest.importorskip("jax.numpy")
    from kq_jax.moe import dequantize_rows, quantized_apply

    _, _, full = _layer(rng)
    tier = _tier(full, bits=3)
    rows = jnp.asarray([[1, 2]])
    with pytest.raises(ValueError, match="bits"):
        dequantize_rows(tier.down, rows, bits=4, group_size=32, dtype=jnp.float32)
    with pytest.raises(ValueError, match="group_size"):
        quantized_apply(tier.gate, rows, jnp.ones((1, 2, 64)), bits=3, group_size=64)
    with pytest.raises(ValueError, match="bits"):
        quantized_apply(tier.gate, rows, jnp.ones((1, 2, 64)), bits=5, group_size=32)


def test_a_weight_of_no_rows_quantizes_and_dequantizes_to_no_rows():
    from kq_host.tier import dequantize

    weight = quantize(np.zeros((0, 64), np.float32), bits=3, group_size=32)
    assert weight.packed.shape == (0, 6) and weight.scales.shape == (0, 2)
    assert dequantize(weight, bits=3, group_size=32).shape == (0, 64)


@pytest.mark.parametrize("options, message", [
    (dict(bits=0, group_size=32), "bits must be an int in \\[1, 8\\]"), (dict(bits=3, group_size=32), "packs"),
    (dict(bits=4, group_size=0), "group_size"), (dict(bits=4, group_size=48), "packs"),
], ids=["zero-bits", "bits-disagree", "zero-group", "group-disagrees"])
def test_dequantize_names_options_that_disagree_with_the_weight(options, message):
    from kq_host.tier import dequantize

    weight = quantize(np.ones((2, 64), np.float32), bits=4, group_size=32)
    with pytest.raises(TierOptionError, match=message):
        dequantize(weight, **options)
    with pytest.raises(TierOptionError, match="bits"):
        tier_module.unpack(weight.packed, 0)


@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.uint16, np.uint64])
def test_dequantize_refuses_packed_words_that_are_no_uint32_naming_the_dtype(dtype):
    # a float32 word array had been unpacked as if its bits were words: garbage weights, a RuntimeWarning only
    from kq_host.tier import dequantize

    weight = quantize(np.random.default_rng(0).normal(size=(2, 64)).astype(np.float32), bits=4, group_size=32)
    with pytest.raises(TierOptionError, match=f"uint32 words.*{np.dtype(dtype).name}"):
        dequantize(weight._replace(packed=weight.packed.view(np.uint8).view(dtype) if np.dtype(dtype).itemsize == 4
                                   else weight.packed.astype(dtype)), bits=4, group_size=32)


def test_a_tier_of_no_projections_is_refused():
    with pytest.raises(TierOptionError, match="weights"):
        tier_module.Tier({}, 4, 32)
