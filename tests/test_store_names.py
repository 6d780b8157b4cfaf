"""ExpertStore over per-layer tensor names (dense first layers, biases beside weights) and acquire without credit."""

import numpy as np
import pytest
from safetensors.numpy import save_file

import kq_host
from kq_host.expert_store import ExpertStore, ExpertStoreError
from kq_host.residency import PreloadError, ResidencyManager

EXPERTS = 6


def _stack(seed, shape, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal((EXPERTS, *shape)).astype(dtype)


def write_deepseek_like(directory):
    """Layer 0 dense, layers 1 and 2 with stacked experts: float weights and biases (gpt-oss's names), and
    packed uint32 weights with bfloat16 scales (an mlx-community checkpoint); returns the tensors."""
    import ml_dtypes

    tensors = {"model.layers.0.mlp.gate_proj.weight": np.ones((8, 4), np.float32)}
    for layer in (1, 2):
        prefix = f"model.layers.{layer}.mlp.experts"
        tensors[f"{prefix}.gate_proj.weight"] = _stack(10 * layer, (8, 4))
        tensors[f"{prefix}.gate_proj.bias"] = _stack(10 * layer + 1, (8,))
        tensors[f"{prefix}.down_proj.weight"] = np.random.default_rng(layer).integers(
            0, 2**32, (EXPERTS, 4, 2), dtype=np.uint32)
        tensors[f"{prefix}.down_proj.scales"] = _stack(10 * layer + 2, (4, 1), ml_dtypes.bfloat16)
    save_file({k: v for k, v in tensors.items() if ".1." in k or "layers.0" in k},
              str(directory / "model-00001.safetensors"))
    save_file({k: v for k, v in tensors.items() if ".2." in k}, str(directory / "model-00002.safetensors"))
    return tensors


def names_of(model_layer):
    prefix = f"model.layers.{model_layer}.mlp.experts"
    return {"gate_proj": f"{prefix}.gate_proj.weight", "gate_proj.bias": f"{prefix}.gate_proj.bias",
            "down_proj.weight": f"{prefix}.down_proj.weight", "down_proj.scales": f"{prefix}.down_proj.scales"}


def test_store_reads_each_layers_own_tensors_one_expert_slice(tmp_path):
    """Manager layer 0 is the model's layer 1 (the first is dense): each key's read is the expert's slice of its
    own tensor, bit for bit, and only its bytes are read."""
    tensors = write_deepseek_like(tmp_path)
    with ExpertStore.for_tensors(tmp_path, {0: names_of(1), 1: names_of(2)}) as store:
        for layer, model_layer in ((0, 1), (1, 2)):
            for expert in (0, 4):
                got = store.read_expert(layer, expert)
                assert set(got) == set(names_of(model_layer))
                for key, name in names_of(model_layer).items():
                    want = tensors[name][expert]
                    assert got[key].dtype == want.dtype and got[key].shape == want.shape
                    np.testing.assert_array_equal(got[key].view(np.uint8), want.view(np.uint8))
        one_expert = sum(tensors[name][0].nbytes for name in names_of(1).values())
        assert store.bytes_read == 4 * one_expert == 4 * store.expert_nbytes(0)
        assert store.expert_shapes(1)["gate_proj.bias"] == ((8,), np.dtype(np.float32))
        # the names key a cache of its reads: another mapping of the same files is another store
        assert store.layout == "named" and "model.layers.2.mlp.experts.gate_proj.bias" in store.template
        with ExpertStore.for_tensors(tmp_path, {0: names_of(2), 1: names_of(1)}) as swapped:
            assert swapped.template != store.template
        assert store.layer_tensor_names == {0: names_of(1), 1: names_of(2)}
        store.layer_tensor_names[0]["gate_proj"] = "changed"  # a copy: the store's names stay
        assert store.layer_tensor_names[0] == names_of(1)
    with ExpertStore(tmp_path, layout="stacked") as plain:
        assert plain.layer_tensor_names is None


def test_store_reads_a_tensor_per_expert_where_the_name_holds_the_expert_field(tmp_path):
    tensors = {f"model.layers.3.mlp.experts.{e}.up_proj.weight": np.full((2, 4), e + 0.5, np.float32)
               for e in range(5)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with ExpertStore.for_tensors(tmp_path, {0: {"up_proj": "model.layers.3.mlp.experts.{expert}.up_proj.weight"}}) \
            as store:
        np.testing.assert_array_equal(store.read_expert(0, 4)["up_proj"].view(np.uint32),
                                      tensors["model.layers.3.mlp.experts.4.up_proj.weight"].view(np.uint32))
        assert store.bytes_read == 2 * 4 * 4
        with pytest.raises(ExpertStoreError, match="tensor model.layers.3.mlp.experts.5.up_proj.weight is in none"):
            store.read_expert(0, 5)


def test_store_for_arenas_takes_each_arenas_tensor_names(tmp_path):
    tensors = write_deepseek_like(tmp_path)

    class Arena:
        def __init__(self, model_layer):
            self.model_layer = model_layer

        def tensor_names(self):
            return names_of(self.model_layer)

    with ExpertStore.for_arenas(tmp_path, [Arena(1), Arena(2)]) as store:
        got = store.read_expert(1, 5)
        np.testing.assert_array_equal(got["gate_proj"].view(np.uint32),
                                      tensors["model.layers.2.mlp.experts.gate_proj.weight"][5].view(np.uint32))


def test_store_for_tensors_refuses_bad_names_by_name(tmp_path):
    write_deepseek_like(tmp_path)
    with pytest.raises(ExpertStoreError, match=r"layer 0: tensor model.layers.9.mlp.experts.gate_proj.weight is in "
                                               r"none of the store's files \(model-00001.safetensors"):
        ExpertStore.for_tensors(tmp_path, {0: names_of(9)})
    mixed = dict(names_of(1), dense="model.layers.0.mlp.gate_proj.weight")  # 8 rows, not 6 experts
    with pytest.raises(ExpertStoreError, match="layer 0: its tensors hold different numbers of experts"):
        ExpertStore.for_tensors(tmp_path, {0: mixed})
    for bad in ({}, {-1: names_of(1)}, {0: {}}, {0: {"gate_proj": 3}}, [names_of(1)]):
        with pytest.raises(ValueError, match="ExpertStore.for_tensors: "):
            ExpertStore.for_tensors(tmp_path, bad)
    with ExpertStore.for_tensors(tmp_path, {0: names_of(1)}) as store:
        with pytest.raises(ExpertStoreError, match=r"layer 1: the store names tensors for layers \[0\] only"):
            store.read_expert(1, 0)
        with pytest.raises(ExpertStoreError, match="holds no expert 6"):
            store.read_expert(0, 6)


def test_the_closed_errors_are_exported():
    from kq_host.expert_store import ExpertStoreClosed
    from kq_host.residency import ManagerClosed

    assert kq_host.ManagerClosed is ManagerClosed and kq_host.ExpertStoreClosed is ExpertStoreClosed
    assert {"ManagerClosed", "ExpertStoreClosed", "PreloadError"} <= set(kq_host.__all__)


def test_acquire_without_credit_reads_a_failed_miss_and_counts_the_routing_once():
    broken = {3}

    def loader(layer, expert, slot):
        if expert in broken:
            raise OSError(f"expert {expert}: input/output error")
        return 8

    manager = ResidencyManager(1, 8, 4, loader=loader, queue_depth=0)
    ids, scores = np.array([[3, 5]]), np.array([[0.75, 0.25]])
    with pytest.raises(PreloadError, match=r"acquire: layer 0: the reads of experts \[3\] failed \(expert 3: OSError"):
        manager.acquire(0, ids, scores)
    once = manager.stats()[1]
    priority_once = manager._tables.priority.copy()
    broken.clear()
    table = manager.acquire(0, ids, scores, credit=False)
    assert table[3] >= 0 and table[5] >= 0
    again = manager.stats()[1]
    assert (again.lookups, again.hits, again.misses) == (once.lookups, once.hits, once.misses) == (2, 0, 2)
    np.testing.assert_array_equal(manager._tables.priority.view(np.uint64), priority_once.view(np.uint64))
    manager.acquire(0, ids, scores)  # credited: both hits now
    assert manager.stats()[1].hits == 2 and manager.stats()[1].lookups == 4
    with pytest.raises(ValueError, match="acquire: credit must be a bool"):
        manager.acquire(0, ids, scores, credit=1)
    manager.close()
