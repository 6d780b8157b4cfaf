"""mlx-lm's idioms on a model whose experts run on arenas: ``copy.deepcopy``, ``Model.shard``, a cast through
``model.update(tree_map(...))``, ``save_weights`` / ``load_weights`` and ``nn.quantize`` work on the attached model
as on the model, and leave it the model bit for bit where every expert is resident."""

import copy

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
import mlx.nn as nn  # noqa: E402
from mlx.utils import tree_flatten, tree_map  # noqa: E402

from kq_host.residency import ResidencyManager  # noqa: E402
from kq_mlx.mlx_lm_adapter import (ArenaLayer, SwitchGLUArena, _slot_arrays, attach_arena, attach_exact,  # noqa: E402
                                   attach_lookahead, attach_tier, set_tables)
from test_mlx_families import EXPERTS, build, fill_every_expert, logits_of, random_tier  # noqa: E402

PROMPT = [1, 2, 3]
# An ArenaMoeBlock (a router kq runs), and families at the SwitchGLU seam: multi-head latent attention (DeepSeek-V3,
# GLM-4-MoE-Lite, both with mlx-lm's own shard) and projection biases (gpt-oss)
FAMILIES = ["qwen3_moe", "deepseek_v3", "glm4_moe_lite", "gpt_oss"]


def _wide(family: str, *, seed: int = 0):
    """test_mlx_families' model of ``family`` with experts 64 wide (a 4-bit tier of groups of 32 then splits in
    two along the experts' width)."""
    import importlib

    from test_mlx_families import SMALL, SPECIAL

    module = importlib.import_module(f"mlx_lm.models.{family}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict({"model_type": family, **SMALL, **SPECIAL.get(family, {}),
                                                     "moe_intermediate_size": 64, "intermediate_size": 64}))
    mx.eval(model.parameters())
    return model


def _attached(family: str, *, quantized: bool = False, seed: int = 0, tier: bool = False, wide: bool = False):
    """The family's model with every expert resident in slots that are not the expert ids (and a random tier)."""
    model = _wide(family, seed=seed) if wide else build(family, quantized=quantized, seed=seed)
    blocks = attach_arena(model, EXPERTS)
    fill_every_expert(blocks)
    if tier:
        attach_tier(blocks, random_tier(blocks))
    return model, blocks


def _blocks_of(model) -> list[ArenaLayer]:
    """The model's arenas, each once (a look-ahead layer holds the next one too), in layer order."""
    found = {id(module): module for _, module in model.named_modules() if isinstance(module, ArenaLayer)}
    return sorted(found.values(), key=lambda block: block.model_layer)


def _same(got, want):
    for step, (a, b) in enumerate(zip(got, want)):
        assert np.array_equal(a, b), f"step {step}"


def _slot(block, slot: int) -> dict:
    return {key: np.array(array[slot]) for key, array in _slot_arrays(block.arena)}


def _bits(payload: dict) -> dict:
    return {key: (value.dtype.str, value.shape, value.tobytes()) for key, value in payload.items()}


# ---- copy.deepcopy -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("forward_first", [False, True], ids=["before-a-forward", "after-a-forward"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_deep_copy_runs_and_gives_the_same_bits_on_arenas_of_its_own(family, forward_first):
    """The copy gives the original's logits bit for bit (the model's), its rules and tables as the original's; its
    arenas, tables and compiled graphs are its own: a slot the copy writes leaves the original as it was."""
    want = logits_of(build(family, quantized=False), PROMPT, 3)
    model, blocks = _attached(family, tier=True)
    for block in blocks:
        block.rule = "tier"
    if forward_first:
        _same(logits_of(model, PROMPT, 3), want)
    twin = copy.deepcopy(model)
    twins = _blocks_of(twin)
    assert len(twins) == len(blocks) and not {id(b) for b in twins} & {id(b) for b in blocks}
    assert all(t.rule == "tier" and np.array_equal(np.array(t.slot_table), np.array(b.slot_table))
               for t, b in zip(twins, blocks))
    _same(logits_of(twin, PROMPT, 3), want)
    _same(logits_of(model, PROMPT, 3), want)
    for layer, block in enumerate(twins):  # the copy's arenas emptied: the original keeps its experts
        for slot in range(EXPERTS):
            SwitchGLUArena(twins).write_slot(layer, slot, {k: np.zeros_like(v) for k, v in
                                                           block.expert_weights(0).items()})
    assert not all(np.array_equal(a, b) for a, b in zip(logits_of(twin, PROMPT, 3), want))
    _same(logits_of(model, PROMPT, 3), want)


def test_a_deep_copy_of_a_model_with_look_ahead_predicts_with_its_own_routers():
    model, blocks = _attached("qwen3_moe")
    attach_lookahead(model, blocks)
    want = logits_of(model, PROMPT, 2)
    twin = copy.deepcopy(model)
    twins = _blocks_of(twin)
    assert twin.model.layers[0].following is twins[1]
    _same(logits_of(twin, PROMPT, 2), want)


def test_a_model_bound_to_a_residency_manager_refuses_a_deep_copy_by_name():
    """The manager fills the original's arenas: a copy bound to it would run on slots it never writes."""
    model = build("deepseek_v3", quantized=False)
    blocks = attach_arena(model, 2)
    manager = ResidencyManager(len(blocks), EXPERTS, 2, arena=SwitchGLUArena(blocks), queue_depth=0,
                               loader=lambda layer, expert, slot: blocks[layer].expert_weights(expert))
    attach_exact(model, blocks, manager)
    with pytest.raises(TypeError, match=r"deep.copied.*residency manager.*attach_exact"):
        copy.deepcopy(model)
    manager.close()


# ---- Model.shard ----------------------------------------------------------------------------------------------------


class FakeGroup:
    """What mlx-lm's shard reads of an ``mx.distributed`` group: its size and this process's rank."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


SHARDED = ["deepseek_v3", "glm4_moe_lite", "gpt_oss", "qwen3_moe"]


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "q4"])
@pytest.mark.parametrize("family", SHARDED)
def test_mlx_lms_shard_on_one_process_leaves_the_attached_model_the_models_bits(family, quantized):
    """``model.shard()`` over this process's group (size 1) reaches the projections the arenas took the place of
    and runs; the logits are the unmodified model's."""
    want = logits_of(build(family, quantized=quantized), PROMPT, 3)
    model, blocks = _attached(family, quantized=quantized)
    model.shard(mx.distributed.init())
    _same(logits_of(model, PROMPT, 3), want)


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("family", SHARDED)
def test_shard_splits_every_copy_of_the_experts_as_it_splits_the_models(family, rank):
    """Sharded over two ranks (a stand-in group: mlx-lm reads its size and rank): the layer's own experts, every
    slot of the arena (as the expert it holds), the experts' biases and the tier are this rank's parts, as
    mlx-lm's shard cuts the unattached model's; the payloads a loader writes from now on are those parts."""
    plain = _wide(family)
    tier = random_tier(attach_arena(_wide(family), EXPERTS))
    model, blocks = _attached(family, wide=True)
    attach_tier(blocks, tier)
    tables = [np.array(block.slot_table) for block in blocks]
    plain.shard(FakeGroup(2, rank))
    model.shard(FakeGroup(2, rank))
    mx.eval(plain.parameters(), model.parameters())
    reference = attach_arena(plain, EXPERTS)  # reads the sharded model's experts
    for block, ref, table in zip(blocks, reference, tables):
        assert block.slot_layout() == ref.slot_layout()
        for expert in range(EXPERTS):
            want = _bits(ref.expert_weights(expert))
            assert _bits(block.expert_weights(expert)) == want
            assert _bits({k: v.astype(np.float32) for k, v in _slot(block, int(table[expert])).items()}) == want
        for projection, bias in block.expert_biases.items():
            assert np.array_equal(np.array(bias), np.array(ref.expert_biases[projection]))
            assert np.array_equal(np.array(block.tier[projection].bias), np.array(ref.expert_biases[projection]))
    for layer, block in enumerate(blocks):  # the tier: each array cut on the axis its projection is cut on
        for projection, weight in tier.layer(layer).items():
            axis = -1 if projection == "down_proj" else -2
            for name, full in (("weight", weight.packed), ("scales", weight.scales), ("biases", weight.biases)):
                part = np.split(np.asarray(full), 2, axis=axis)[rank]
                assert np.array_equal(np.array(block.tier[projection][name]).view(np.uint8),
                                      part.astype(np.array(block.tier[projection][name]).dtype).view(np.uint8))
    arena = SwitchGLUArena(blocks)
    arena.write_slot(0, 0, blocks[0].expert_weights(3))
    assert _bits(_slot(blocks[0], 0)) == _bits(reference[0].expert_weights(3))


def _switch_of(model):
    """Layer 0's SwitchGLU as the family's code reaches it."""
    mlp = model.model.layers[0].mlp
    return mlp.experts if "experts" in mlp else mlp.switch_mlp


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_the_projections_the_arena_took_the_place_of_read_and_write_the_layers_experts(family):
    """``switch.gate_proj`` (``switch_mlp`` of a block kq wraps) reads as the layer's own projection; setting one
    of its per-expert arrays sets the experts', their tier's bias and the arena's slots that hold them: the
    logits are the unmodified model's with the same array set."""
    want = logits_of(build(family, quantized=False), PROMPT, 2)
    model, blocks = _attached(family, tier=True)
    plain = build(family, quantized=False)
    block, switch, plain_switch = blocks[0], _switch_of(model), _switch_of(plain)
    assert (switch is block) == (family != "qwen3_moe")
    for projection in block.projections:
        assert getattr(switch, projection).weight is block._own_switch()[projection].weight
    rng = np.random.default_rng(0)
    weight = rng.normal(0, 0.2, block._own_switch().up_proj.weight.shape).astype(np.float32)
    switch.up_proj.weight = mx.array(weight)
    plain_switch.up_proj.weight = mx.array(weight)
    _same(logits_of(model, PROMPT, 2), logits_of(plain, PROMPT, 2))
    assert not all(np.array_equal(a, b) for a, b in zip(logits_of(plain, PROMPT, 2), want))
    if family == "gpt_oss":
        bias = rng.normal(0, 0.5, block.source.down_proj.bias.shape).astype(np.float32)
        switch.down_proj.bias = mx.array(bias)  # the experts', the tier's and the arena's slots
        plain_switch.down_proj.bias = mx.array(bias)
        _same(logits_of(model, PROMPT, 2), logits_of(plain, PROMPT, 2))
        switch.down_proj.bias /= 2  # as mlx-lm's gpt-oss shard divides it among ranks
        plain_switch.down_proj.bias /= 2
        _same(logits_of(model, PROMPT, 2), logits_of(plain, PROMPT, 2))
        bias = np.array(block.source.down_proj.bias)
        assert np.array_equal(np.array(block.expert_biases["down_proj"]), bias)
        assert np.array_equal(np.array(block.tier.down_proj.bias), bias)
    with pytest.raises(ValueError, match=r"gate_proj\.weight must be .*\[8, "):
        switch.gate_proj.weight = mx.zeros((3, 2))
    with pytest.raises(AttributeError, match="no_such"):
        switch.gate_proj.no_such


def test_a_layer_whose_experts_were_dropped_shards_its_arena_and_biases():
    model = build("gpt_oss", quantized=False)
    source = attach_arena(build("gpt_oss", quantized=False), EXPERTS)
    blocks = attach_arena(model, EXPERTS, keep_experts=False)
    fill_every_expert(blocks, source)
    want = logits_of(model, PROMPT, 2)
    model.shard(mx.distributed.init())
    _same(logits_of(model, PROMPT, 2), want)
    with pytest.raises(AttributeError, match="keep_experts=False"):
        model.model.layers[0].mlp.experts.gate_proj.weight


# ---- a cast through model.update(tree_map(...)) ---------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_a_cast_of_every_parameter_leaves_the_tables_and_gives_the_cast_models_bits(family):
    """``model.update(tree_map(lambda p: p.astype(dtype), model.parameters()))`` to bfloat16 and back to float32 (MLX's
    CPU runs the experts' gather_mm in float32 alone): the tables are no parameters (they stay the same int32
    arrays), nor is what the last pass left; the logits are the model's cast the same way, bit for bit."""
    def cast(model, dtype):
        model.update(tree_map(lambda p: p.astype(dtype), model.parameters()))

    plain = build(family, quantized=False)
    cast(plain, mx.bfloat16)
    cast(plain, mx.float32)
    want = logits_of(plain, PROMPT, 3)
    model, blocks = _attached(family)
    logits_of(model, PROMPT, 1)  # a pass first: what it leaves on the layers must not be cast
    names = [name for name, _ in tree_flatten(model.parameters())]
    assert not any(name.rsplit(".", 1)[-1] in ("slot_table", "last_mix", "last") for name in names)
    tables = [(block.slot_table, np.array(block.slot_table)) for block in blocks]
    cast(model, mx.bfloat16)
    assert blocks[0].arena[blocks[0].projections[0]].weight.dtype == mx.bfloat16
    assert all(block.slot_table is table and block.slot_table.dtype == mx.int32 for block, (table, _) in
               zip(blocks, tables))
    cast(model, mx.float32)
    _same(logits_of(model, PROMPT, 3), want)
    arena = SwitchGLUArena(blocks)  # the payloads and slots as cast, written as before
    arena.write_slot(0, int(tables[0][1][5]), blocks[0].expert_weights(5))
    set_tables(blocks, np.stack([table for _, table in tables]))
    _same(logits_of(model, PROMPT, 3), want)


# ---- save_weights / load_weights ------------------------------------------------------------------------------------


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "q4"])
@pytest.mark.parametrize("family", FAMILIES)
def test_weights_saved_from_an_attached_model_load_back_and_give_the_same_bits(family, quantized, tmp_path):
    """Saved after a forward (what the pass left is not saved, nor are the tables), loaded into the model after its
    arenas were emptied and into another model of other weights attached the same way: the same logits."""
    model, blocks = _attached(family, quantized=quantized, tier=True)
    want = logits_of(model, PROMPT, 3)
    path = str(tmp_path / "attached.safetensors")
    model.save_weights(path)
    saved = mx.load(path)
    assert not any(name.rsplit(".", 1)[-1] in ("slot_table", "last_mix") for name in saved)
    for layer, block in enumerate(blocks):
        for slot in range(EXPERTS):
            SwitchGLUArena(blocks).write_slot(layer, slot, {k: np.zeros_like(v) for k, v in
                                                            block.expert_weights(0).items()})
    assert not all(np.array_equal(a, b) for a, b in zip(logits_of(model, PROMPT, 3), want))
    model.load_weights(path)
    _same(logits_of(model, PROMPT, 3), want)
    other, other_blocks = _attached(family, quantized=quantized, seed=5, tier=True)
    other.load_weights(path)
    _same(logits_of(other, PROMPT, 3), want)


# ---- nn.quantize ----------------------------------------------------------------------------------------------------


def _quantize(model):
    nn.quantize(model, group_size=32, bits=4,
                class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % 32 == 0)


@pytest.mark.parametrize("family", FAMILIES)
def test_quantizing_an_attached_model_is_the_quantized_model(family):
    """``nn.quantize`` of an attached model (every expert resident) quantizes the arenas' slots as it quantizes
    the experts they hold: the quantized model's logits, bit for bit; the payloads are then the packed ones, and a
    slot written with one serves it."""
    want = logits_of(build(family, quantized=True), PROMPT, 3)
    model, blocks = _attached(family)
    logits_of(model, PROMPT, 1)  # compiled graphs of the float arenas first: quantizing replaces what they read
    _quantize(model)
    assert type(blocks[0].arena[blocks[0].projections[0]]).__name__ == "QuantizedSwitchLinear"
    assert blocks[0].slot_layout()[f"{blocks[0].projections[0]}.weight"][1] == np.uint32
    _same(logits_of(model, PROMPT, 3), want)
    table = np.array(blocks[0].slot_table)
    SwitchGLUArena(blocks).write_slot(0, int(table[2]), {k: np.zeros_like(v) for k, v in
                                                         blocks[0].expert_weights(2).items()})
    SwitchGLUArena(blocks).write_slot(0, int(table[2]), blocks[0].expert_weights(2))
    _same(logits_of(model, PROMPT, 3), want)
