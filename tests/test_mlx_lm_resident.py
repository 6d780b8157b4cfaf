"""The mlx-lm adapter's resident path: a layer whose published table holds every expert runs as mlx-lm's own
block, with the general graph's bits (logits and reports), and goes back to the general graph when a table
misses again."""

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from kq_host.residency import LayerReport  # noqa: E402
from kq_mlx.mlx_lm_adapter import (SwitchGLUArena, attach_arena, attach_tier, generate_greedy,  # noqa: E402
                                   pack_reports, set_tables)
from test_mlx_lm import (EXPERTS, LAYERS, PROMPT, _manager_over, _quantized,  # noqa: E402
                         deepseek_v3_model, evaluated, mixtral_model, qwen3_model)
from tiny_models import tier_of  # noqa: E402

IDENTITY = np.arange(EXPERTS, dtype=np.int32)
PERMUTED = np.random.default_rng(5).permutation(EXPERTS).astype(np.int32)
PARTIAL = np.where(np.arange(EXPERTS) % 3 == 1, -1, PERMUTED).astype(np.int32)
# The table each token runs on: the identity, a permutation (the slots rewritten to match), a table with misses,
# the permutation again.
SCHEDULE = [IDENTITY, IDENTITY, PERMUTED, PERMUTED, PARTIAL, PARTIAL, PERMUTED]

CASES = ([pytest.param(qwen3_model, rule, id=f"qwen3_moe-{rule}") for rule in ("route_shed", "shed", "renormalize",
                                                                               "tier")]
         + [pytest.param(mixtral_model, "route_shed", id="mixtral-route_shed"),
            pytest.param(mixtral_model, "tier", id="mixtral-tier"),
            pytest.param(_quantized(qwen3_model), "route_shed", id="qwen3_moe-q4-route_shed"),
            pytest.param(_quantized(qwen3_model), "tier", id="qwen3_moe-q4-tier"),
            pytest.param(_quantized(mixtral_model), "shed", id="mixtral-q4-shed"),
            pytest.param(deepseek_v3_model, "shed", id="deepseek_v3-seam-shed"),
            pytest.param(deepseek_v3_model, "tier", id="deepseek_v3-seam-tier"),
            pytest.param(_quantized(deepseek_v3_model), "shed", id="deepseek_v3-q4-seam-shed")])


def _float_weights(block, expert):
    """One expert's projections as float32 ``[out, in]``: a quantized arena's dequantized (4-bit, groups of 32)."""
    payload = block.expert_weights(expert)
    if "gate_proj" in payload:
        return payload
    return {projection: np.array(mx.dequantize(*(mx.array(payload[f"{projection}.{name}"])
                                                 for name in ("weight", "scales", "biases")), group_size=32, bits=4))
            for projection in ("gate_proj", "up_proj", "down_proj")}


def _tier(blocks):
    """A 3-bit tier (groups of 32) of every expert, float or 4-bit arenas."""
    return tier_of(blocks, _float_weights, experts=EXPERTS, bits=3)


def _fill(blocks, table):
    """Every expert e into slot ``table[e]`` of every layer (the arena as a full table describes it)."""
    arena = SwitchGLUArena(blocks)
    for layer, block in enumerate(blocks):
        for expert in range(EXPERTS):
            arena.write_slot(layer, int(table[expert]), block.expert_weights(expert))


def _resident_model(make_model, seed: int, rule: str):
    """A model on arenas holding every expert (permuted slots, their tables set), every layer under ``rule``."""
    model = evaluated(make_model, seed=seed)
    blocks = attach_arena(model, EXPERTS)
    if rule == "tier":
        attach_tier(blocks, _tier(blocks))
    _fill(blocks, PERMUTED)
    set_tables(blocks, np.tile(PERMUTED, (LAYERS, 1)))
    for block in blocks:
        block.rule = rule
    return model, blocks


def _decode(make_model, rule: str, *, full_path: bool):
    """Greedy decoding through full arenas under ``rule``, each token on its table of :data:`SCHEDULE`; returns
    each token's logits and packed reports (uint32 bits), the blocks' own reports, and whether each token
    ran every layer on the resident path."""
    model = evaluated(make_model, seed=7)
    blocks = attach_arena(model, EXPERTS)
    if rule == "tier":
        attach_tier(blocks, _tier(blocks))
    for block in blocks:
        block.rule, block.full_path = rule, full_path
    cache, x, seen, filled = make_prompt_cache(model), mx.array([PROMPT[:5]]), [], None
    for table in SCHEDULE:
        full = table if (table >= 0).all() else None
        if full is not None and (filled is None or not np.array_equal(filled, full)):
            _fill(blocks, full)
            filled = full
        set_tables(blocks, np.tile(table, (len(blocks), 1)))
        logits = model(x, cache=cache)[0, -1]
        packed = pack_reports(blocks)
        mx.eval(logits, packed)
        own = LayerReport.stacked([block.report() for block in blocks])
        resident = all(block._deferred is not None and block._deferred.miss is None for block in blocks)
        seen.append((np.array(logits.astype(mx.float32)).view(np.uint32), np.array(packed),
                     *(np.asarray(getattr(own, name)).view(np.uint32)
                       for name in ("indices", "scores", "miss_ids", "miss_scores", "served")), resident))
        x = mx.array([[int(mx.argmax(logits).item())]])
    return seen


@pytest.mark.parametrize("make_model, rule", CASES)
def test_the_resident_path_gives_the_general_graphs_bits_and_leaves_it_when_a_table_misses(make_model, rule):
    """Full tables (the identity, then a permutation) on the resident path, then a table with misses on the
    general graph, then full again: every token's logits, packed reports and per-layer reports are those of the
    general graph run on the same tables, bit for bit."""
    fast = _decode(make_model, rule, full_path=True)
    general = _decode(make_model, rule, full_path=False)
    for step, (got, want, table) in enumerate(zip(fast, general, SCHEDULE)):
        for a, b in zip(got[:-1], want[:-1]):
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), step
        assert got[-1] == bool((table >= 0).all()), f"token {step}: resident path taken: {got[-1]}"
        assert not want[-1]
        misses = int((got[4].view(np.int32) >= 0).sum())
        assert (misses > 0) == (not (table >= 0).all()), step
    assert all(logits.any() for logits, *_ in fast)
    assert any(served.any() for *_, served, _ in fast)


def test_the_resident_path_is_one_gather_and_the_experts(on_cpu):
    """The resident layer's graph is mlx-lm's own block's (routing, experts, combine), the flush of the weights
    and one gather for a remapped table (none for the identity): no route_shed, no tier. Counted on a CPU
    stream, where the general graph runs route_shed as ops (on a GPU stream it is one kernel)."""
    import collections
    import io
    import re

    model = evaluated(qwen3_model, seed=2)
    own_block = evaluated(qwen3_model, seed=2).model.layers[0].mlp
    blocks = attach_arena(model, EXPERTS)
    attach_tier(blocks, _tier(blocks))
    x = mx.array(np.random.default_rng(2).standard_normal((1, 1, 64)).astype(np.float32))

    def primitives(out):
        dot = io.StringIO()
        mx.export_to_dot(dot, out)
        return collections.Counter(re.findall(r'label ="(\w+)", shape=rectangle', dot.getvalue()))

    def layer(table, full_path):
        set_tables(blocks, np.tile(table, (LAYERS, 1)))
        blocks[0].rule, blocks[0].full_path = "tier", full_path
        return primitives(blocks[0](x))

    own, general = primitives(own_block(x)), layer(IDENTITY, False)
    identity, remapped = layer(IDENTITY, True), layer(PERMUTED, True)
    assert general["GatherQMM"] == 3 and general["Min"] == 1  # the tier and route_shed
    for counts in (identity, remapped):
        assert counts["GatherQMM"] == 0 and counts["Min"] == 0 and counts["GatherMM"] == own["GatherMM"] == 3
    assert identity["Gather"] == 0 and remapped["Gather"] == 1
    assert sum(identity.values()) <= sum(own.values()) + 2 < sum(general.values())


@pytest.mark.parametrize("exact", [False, True], ids=["overlapped", "exact"])
@pytest.mark.parametrize("rule", ["route_shed", "tier"])
def test_generate_greedy_at_full_residency_steps_on_the_general_graphs_reports(rule, exact):
    """generate_greedy (overlapped and exact) with every expert resident: the tokens and every report the
    manager steps on are those of the general graph, bit for bit, and nothing runs again."""
    def run(full_path):
        model = evaluated(qwen3_model, seed=11)
        blocks = attach_arena(model, EXPERTS)
        if rule == "tier":
            attach_tier(blocks, _tier(blocks))
        for block in blocks:
            block.rule, block.full_path = rule, full_path
        manager = _manager_over(blocks, EXPERTS)
        for layer in range(LAYERS):
            manager.preload(layer, PERMUTED.tolist())
        stepped, step = [], manager.step

        def recording(report):
            stepped.append(report)
            return step(report)
        manager.step = recording
        tokens = generate_greedy(model, blocks, manager, PROMPT[:4], 6, exact=exact)
        resident = [block._deferred is not None and block._deferred.miss is None for block in blocks]
        manager.close()
        return tokens, stepped, resident

    fast, general = run(True), run(False)
    assert fast[0] == general[0] and len(fast[1]) == len(general[1]) > 0
    for got, want in zip(fast[1], general[1]):
        for name in ("indices", "scores", "miss_ids", "miss_scores", "served"):
            a, b = np.asarray(getattr(got, name)), np.asarray(getattr(want, name))
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), name
        assert (np.asarray(got.miss_ids) < 0).all()
    assert all(fast[2]) and not any(general[2])


@pytest.mark.parametrize("slots, exact", [(EXPERTS, True), (EXPERTS, False), (EXPERTS // 4, False)],
                         ids=["full-exact", "full", "quarter"])
def test_generate_greedy_dispatches_the_next_token_before_reading_one_that_cannot_miss(monkeypatch, slots, exact):
    """Every layer on its resident path: the next token is dispatched before this one is read, as mlx-lm's own
    loop does (the model's tokens); an arena that can miss reads a token before dispatching the next."""
    import kq_mlx.mlx_lm_adapter as adapter
    from test_mlx_lm import _greedy_prefilled

    want = _greedy_prefilled(qwen3_model, 11, PROMPT[:4], 6)
    model = evaluated(qwen3_model, seed=11)
    blocks = attach_arena(model, slots)
    manager = _manager_over(blocks, slots)
    for layer in range(LAYERS):
        manager.preload(layer, range(slots))
    events, async_eval, read_token = [], mx.async_eval, adapter._read_token
    monkeypatch.setattr(adapter.mx, "async_eval", lambda *arrays: events.append("dispatch") or async_eval(*arrays))
    monkeypatch.setattr(adapter, "_read_token", lambda token: events.append("read") or read_token(token))
    got = generate_greedy(model, blocks, manager, PROMPT[:4], 6, exact=exact, prefill_prompt=True)
    manager.close()
    assert events.count("read") == 6 and events.count("dispatch") == 6
    if slots == EXPERTS:
        assert got == want and events[:3] == ["dispatch", "dispatch", "read"]
    else:
        assert events[:4] == ["dispatch", "read", "dispatch", "read"]


@pytest.mark.parametrize("make_model", [qwen3_model, mixtral_model], ids=["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("rule", ["route_shed", "tier"])
def test_the_resident_weights_are_route_sheds_on_extreme_router_inputs(make_model, rule):
    """Saturated routers (scores 0.0, subnormal or 1.0), NaN and inf inputs: the resident path's output, weights
    and reports are the general graph's bits (a router's row is all NaN or of a finite positive mass)."""
    model, blocks = _resident_model(make_model, 13, rule)
    block = blocks[0]
    rows = np.random.default_rng(13).standard_normal((7, 64)).astype(np.float32)
    rows[1] *= 1e3
    rows[2] *= 1e30
    rows[3, 5] = np.nan
    rows[4, 7] = np.inf
    rows[5] *= 1e-30
    rows[6] = rows[0] * 196  # a routed score subnormal (Qwen3-MoE's router)
    x = mx.array(rows[None])
    seen = []
    for full_path in (True, False):
        block.full_path = full_path
        out = block(x)
        packed = pack_reports(blocks[:1])
        mx.eval(out, packed, block.last_mix)
        seen.append([np.array(a.astype(mx.float32) if a.dtype != mx.int32 else a).view(np.uint32)
                     for a in (out, block.last_mix, block.last[2].mix, packed)])
        # The resident path leaves a pass with nothing to rank (the general graph's kernel, on a GPU, nothing).
        assert (block._deferred is not None and block._deferred.miss is None) == full_path
    for got, want in zip(*seen):
        assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()
    scores = np.array(block.last[1].astype(mx.float32))
    assert np.isnan(scores).any() and (scores == 1.0).any() and (scores == 0.0).any()
    assert ((0 < scores) & (scores < np.finfo(np.float32).tiny)).any() == (make_model is qwen3_model)


@pytest.mark.parametrize("rule", ["route_shed", "shed", "tier"])
def test_a_resident_token_packs_its_last_reports_where_one_launch_packs_them(monkeypatch, rule):
    """Where report_pack.pack is one kernel launch (MLX-CUDA) a resident token's reports go through it, from
    each layer's ``last``: the same bits as the resident packing graph (on this backend pack concatenates;
    the kernel's bits are the concatenation's, test_mlx_lm's report_pack test)."""
    import types

    import kq_mlx.mlx_lm_adapter as adapter
    from kq_mlx import report_pack

    model, blocks = _resident_model(qwen3_model, 17, rule)
    mx.eval(model(mx.array([PROMPT[:5]]), cache=make_prompt_cache(model)))
    assert all(block._deferred is not None and block._deferred.miss is None for block in blocks)
    want = np.array(pack_reports(blocks))
    packed = []
    monkeypatch.setattr(adapter, "report_pack", types.SimpleNamespace(
        one_launch=lambda: True, pack=lambda fields: packed.append(fields) or report_pack.pack(fields)))
    got = np.array(pack_reports(blocks))
    assert len(packed) == 1 and got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes() and (want[2] == -1).all()


def _preloaded_manager(blocks):
    """A residency manager over ``blocks`` with every expert read into their arenas."""
    manager = _manager_over(blocks, EXPERTS)
    for layer in range(LAYERS):
        manager.preload(layer, range(EXPERTS))
    return manager


@pytest.mark.parametrize("make_model, rule", [pytest.param(qwen3_model, "route_shed", id="qwen3_moe-route_shed"),
                                              pytest.param(_quantized(mixtral_model), "tier", id="mixtral-q4-tier"),
                                              pytest.param(deepseek_v3_model, "shed", id="deepseek_v3-seam-shed")])
@pytest.mark.parametrize("tokens", [5, 21], ids=["fewer-than-a-batch", "a-batch-and-more"])
def test_generate_greedy_hands_the_manager_each_resident_pass_report_in_order(make_model, rule, tokens):
    """Passes that ran every layer resident have their reports packed and read back in batches: the manager
    still gets one step a pass, in order, each with the bits pack_reports gives that pass alone (the prompt's
    pass of other rows among them), and none is left out at the end or at a stop token."""
    import kq_mlx.mlx_lm_adapter as adapter

    prompt = PROMPT[:4]
    model, blocks = _resident_model(make_model, 17, rule)
    want_tokens = generate_greedy(model, blocks, _preloaded_manager(blocks), prompt, tokens, overlap=False)
    model, blocks = _resident_model(make_model, 17, rule)  # the reports each pass alone gives, in order
    manager = _preloaded_manager(blocks)
    set_tables(blocks, manager.snapshot())
    manager.close()
    cache, want = make_prompt_cache(model), []
    for x in [prompt] + [[token] for token in want_tokens[:-1]]:
        mx.eval(model(mx.array([x]), cache=cache))
        want.append(LayerReport.from_packed(np.array(pack_reports(blocks))))
    for stop in (None, want_tokens[len(want_tokens) // 2]):
        model, blocks = _resident_model(make_model, 17, rule)
        manager = _preloaded_manager(blocks)
        got, step = [], manager.step
        manager.step = lambda report, **kwargs: got.append(report) or step(report, **kwargs)
        out = generate_greedy(model, blocks, manager, prompt, tokens, stop_tokens=() if stop is None else (stop,))
        manager.close()
        assert out == want_tokens[:len(out)] and (stop is None or out[-1] == stop)
        assert len(got) == len(out) and manager.token == len(out)
        for have, expected in zip(got, want):
            for name in ("indices", "scores", "miss_ids", "miss_scores", "served"):
                assert np.asarray(getattr(have, name)).tobytes() == np.asarray(getattr(expected, name)).tobytes(), name
    assert tokens < adapter.RESIDENT_REPORTS_BATCH or tokens > adapter.RESIDENT_REPORTS_BATCH + 1


def test_generate_greedy_credits_the_resident_passes_read_before_an_error():
    """An error that ends the loop (here the caller's on_token at the fifth token) goes on, and the manager has
    had the report of every pass read before it, as one report a token would have given it."""
    model, blocks = _resident_model(qwen3_model, 19, "route_shed")
    manager = _preloaded_manager(blocks)
    seen = []

    def on_token(token):
        seen.append(token)
        if len(seen) == 5:
            raise KeyboardInterrupt("the caller stops")
    with pytest.raises(KeyboardInterrupt, match="the caller stops"):
        generate_greedy(model, blocks, manager, PROMPT[:4], 20, on_token=on_token)
    manager.close()
    assert manager.token == 5
