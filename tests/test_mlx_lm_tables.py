"""Slot tables entering the mlx-lm adapter: a table that puts two experts in one slot, directly or through values
that wrap or truncate into one, is refused by name (the arena would run one expert on another's weights and
report no miss); tables that name no slot twice go in, whatever integer dtype carries them."""

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from kq_host.residency import ResidencyManager  # noqa: E402
from kq_mlx.mlx_lm_adapter import (ArenaMoeBlock, ArenaSwitch, SwitchGLUArena, attach_arena, attach_exact,  # noqa: E402
                                   generate_greedy, set_tables)
from test_mlx_families import EXPERTS, VARIANTS, build, logits_of  # noqa: E402

SLOTS = 4
# (family, the class attach_arena puts there): a router kq runs, and one at the SwitchGLU seam
FAMILIES = [pytest.param("qwen3_moe", ArenaMoeBlock, id="ArenaMoeBlock"),
            pytest.param("deepseek_v3", ArenaSwitch, id="ArenaSwitch")]


def _good_tables(layers: int) -> np.ndarray:
    """Experts 0..3 in slots 3..0 of every layer, the rest not resident."""
    tables = np.full((layers, EXPERTS), -1, np.int32)
    tables[:, :SLOTS] = np.arange(SLOTS)[::-1]
    return tables


def _bad_tables(case: str, layers: int):
    """A table whose layer 1 (layer 0 for ``"uint32 past int32"``) would put two experts in one slot, or holds a
    value that is no slot; and what the refusal must say of that row (a regex)."""
    tables = _good_tables(layers).astype(np.int64)
    if case == "duplicate":
        tables[1, 1] = tables[1, 0]
        return tables.astype(np.int32), r"puts experts 0 and 1 in slot 3; a slot holds one expert"
    if case == "int64 past int32":
        tables[1, 1] = 2**32 + 3  # int32 wraps it to 3, expert 0's slot
        return tables, r"holds 4294967299 for expert 1, outside int32"
    if case == "uint32 past int32":
        tables = np.where(tables < 0, 2**32 - 1, tables).astype(np.uint32)
        return tables, r"holds 4294967295 for expert 4, outside int32"
    if case == "float fraction":
        tables = tables.astype(np.float64)
        tables[1, 1] = 3.5  # truncated to 3, expert 0's slot
        return tables, r"must hold integer slot ids, got float64: .*holds 3\.5 for expert 1"
    if case == "float NaN":
        tables = tables.astype(np.float32)
        tables[1, 5] = np.nan
        return tables, r"must hold integer slot ids, got float32: .*holds nan for expert 5"
    if case == "float whole":
        return tables.astype(np.float64), r"must hold integer slot ids, got float64"
    if case == "bool":
        return tables >= 0, r"must hold integer slot ids, got bool"
    if case == "str":
        return tables.astype(str), r"must hold integer slot ids, got <U"
    raise AssertionError(case)


BAD = ["duplicate", "int64 past int32", "uint32 past int32", "float fraction", "float NaN", "float whole", "bool",
       "str"]
ROW_NAMED = {"duplicate": 1, "int64 past int32": 1, "uint32 past int32": 0, "float fraction": 1, "float NaN": 1}


def _state(blocks):
    return [(block.slot_table, np.array(block.slot_table).tolist()) for block in blocks]


@pytest.mark.parametrize("quantized", VARIANTS)
@pytest.mark.parametrize("family, kind", FAMILIES)
@pytest.mark.parametrize("case", BAD)
def test_set_tables_refuses_a_table_that_is_no_slots_of_one_expert_each_by_name(family, kind, quantized, case):
    """Refused naming ``tables``, the layer (index and path) and what is wrong; no block's table changes, and
    the model runs as before the call."""
    model = build(family, quantized=quantized)
    blocks = attach_arena(model, SLOTS)
    assert all(isinstance(block, kind) for block in blocks)
    set_tables(blocks, _good_tables(len(blocks)))
    before, want = _state(blocks), logits_of(model, [1, 2, 3], 2)
    tables, says = _bad_tables(case, len(blocks))
    with pytest.raises(ValueError, match=r"^set_tables: tables") as refused:
        set_tables(blocks, tables)
    assert refused.match(says)
    if case in ROW_NAMED:
        layer = ROW_NAMED[case]
        assert f"tables[{layer}] (layer {layer}, {blocks[layer].module_path}) " in str(refused.value)
    after = _state(blocks)
    assert all(a[0] is b[0] and a[1] == b[1] for a, b in zip(after, before))
    for step, (a, b) in enumerate(zip(logits_of(model, [1, 2, 3], 2), want)):
        assert np.array_equal(a, b), f"step {step}"


@pytest.mark.parametrize("family, kind", FAMILIES)
@pytest.mark.parametrize("case", BAD)
def test_setting_a_slot_table_by_hand_refuses_the_same_tables_by_name(family, kind, case):
    """``block.slot_table = ...`` (NumPy or MLX) is checked as set_tables checks a row: refused naming
    ``slot_table`` and the layer, nothing changed."""
    model = build(family, quantized=False)
    blocks = attach_arena(model, SLOTS)
    set_tables(blocks, _good_tables(len(blocks)))
    before = _state(blocks)
    tables, says = _bad_tables(case, len(blocks))
    layer = ROW_NAMED.get(case, 1)
    row = tables[layer]
    for given in (row, mx.array(row)) if row.dtype.kind in "biuf" and row.dtype != np.float64 else (row,):
        with pytest.raises(ValueError, match=r"slot_table") as refused:
            blocks[layer].slot_table = given
        assert str(refused.value).startswith(f"{kind.__name__} at {blocks[layer].module_path} (layer {layer}): ")
        assert refused.match(says)
    assert all(a[0] is b[0] and a[1] == b[1] for a, b in zip(_state(blocks), before))
    with pytest.raises(ValueError, match=rf"slot_table must be \[{EXPERTS}\]"):
        blocks[0].slot_table = np.zeros((2, EXPERTS), np.int32)
    with pytest.raises(ValueError, match=r"slot_table puts experts 0 and 1 in slot 0"):
        blocks[0].slot_table = mx.array([0, 0] + [-1] * (EXPERTS - 2))


@pytest.mark.parametrize("family, kind", FAMILIES)
def test_tables_naming_no_slot_twice_go_in_from_any_integer_dtype(family, kind):
    """Entries past the arena or negative are misses, any number of them; int64, uint8, a list of lists and an
    MLX array carry the same table."""
    model = build(family, quantized=False)
    blocks = attach_arena(model, SLOTS)
    tables = _good_tables(len(blocks))
    tables[:, SLOTS:] = [SLOTS, SLOTS, 2**31 - 1, 2**31 - 1] + [-7] * (EXPERTS - 2 * SLOTS)
    for given in (tables, tables.astype(np.int64), tables.tolist(), mx.array(tables)):
        set_tables(blocks, given)
        assert all(np.array_equal(np.array(block.slot_table), row) for block, row in zip(blocks, tables))
    small = np.where(tables >= SLOTS, 255, np.where(tables < 0, 200, tables)).astype(np.uint8)
    set_tables(blocks, small)
    assert all(np.array_equal(np.array(block.slot_table), row) for block, row in zip(blocks, small.astype(np.int32)))
    blocks[0].slot_table = small[0].astype(np.int16)
    assert blocks[0].slot_table.dtype == mx.int32 and np.array(blocks[0].slot_table).tolist() == small[0].tolist()


class _DuplicatingManager:
    """A residency manager whose acquire answers a table that names one slot twice."""

    def __init__(self, manager):
        self._manager = manager

    def __getattr__(self, name):
        return getattr(self._manager, name)

    def acquire(self, layer, *args, **kwargs):
        table = np.array(self._manager.acquire(layer, *args, **kwargs))
        held = np.flatnonzero(table >= 0)
        table[np.flatnonzero(table < 0)[0]] = table[held[0]]
        return table


def test_a_table_the_manager_hands_the_exact_rule_is_checked_too():
    model = build("deepseek_v3", quantized=False)
    blocks = attach_arena(model, SLOTS)
    manager = ResidencyManager(len(blocks), EXPERTS, SLOTS, arena=SwitchGLUArena(blocks), queue_depth=0,
                               loader=lambda layer, expert, slot: blocks[layer].expert_weights(expert))
    attach_exact(model, blocks, _DuplicatingManager(manager))
    with pytest.raises(ValueError, match=r"slot_table.* puts experts \d+ and \d+ in slot \d+"):
        mx.eval(model(mx.array([[1, 2, 3]])))
    with pytest.raises(ValueError, match=r"slot_table.* puts experts \d+ and \d+ in slot \d+"):
        generate_greedy(model, blocks, _DuplicatingManager(manager), [1, 2], 2, exact=True)
    manager.close()
