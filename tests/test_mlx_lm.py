"""The mlx-lm adapter: tiny Qwen3-MoE and Mixtral models (random weights, from a config, no network)."""

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
from mlx_lm.models import mixtral, qwen3_moe  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from kq_host.residency import ResidencyManager  # noqa: E402
from kq_mlx.mlx_lm_adapter import SwitchGLUArena, attach_arena, set_tables  # noqa: E402
from tiny_models import tier_of  # noqa: E402

EXPERTS, LAYERS = 16, 2


def qwen3_model(hidden_size: int = 64, moe_intermediate_size: int = 32):
    args = qwen3_moe.ModelArgs(
        model_type="qwen3_moe", hidden_size=hidden_size, num_hidden_layers=LAYERS, intermediate_size=128,
        num_attention_heads=4, num_experts=EXPERTS, num_experts_per_tok=4, decoder_sparse_step=1,
        mlp_only_layers=[], moe_intermediate_size=moe_intermediate_size, rms_norm_eps=1e-6, vocab_size=128,
        num_key_value_heads=2,
        head_dim=16, rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=512,
        norm_topk_prob=True)
    return qwen3_moe.Model(args)


def mixtral_model():
    args = mixtral.ModelArgs(model_type="mixtral", vocab_size=128, hidden_size=64, intermediate_size=32,
                             num_hidden_layers=LAYERS, num_attention_heads=4, num_experts_per_tok=2,
                             num_key_value_heads=2, num_local_experts=EXPERTS)
    return mixtral.Model(args)


def evaluated(make_model, *, seed: int):
    """A model of random weights drawn from ``seed``, its parameters evaluated."""
    mx.random.seed(seed)
    model = make_model()
    mx.eval(model.parameters())
    return model


def _manager_over(blocks, slots, **options):
    return ResidencyManager(LAYERS, EXPERTS, slots, loader=lambda l, e, s: blocks[l].expert_weights(e),
                            arena=SwitchGLUArena(blocks), **options)


def greedy(model, prompt, steps, after_step=None):
    """Greedy decoding; returns (tokens, last-position logits per step)."""
    cache = make_prompt_cache(model)
    tokens, logits_seen, x = list(prompt), [], mx.array([prompt])
    for _ in range(steps):
        logits = model(x, cache=cache)[0, -1]
        mx.eval(logits)
        logits_seen.append(np.array(logits))
        if after_step is not None:
            after_step()
        tokens.append(int(mx.argmax(logits).item()))
        x = mx.array([[tokens[-1]]])
    return tokens, logits_seen


def assert_greedy_matches(model, prompt, steps, want_tokens, want_logits):
    """Greedy decoding of ``model`` gives ``want_tokens`` and ``want_logits`` bit for bit."""
    got_tokens, got_logits = greedy(model, prompt, steps)
    assert got_tokens == want_tokens
    for want, got in zip(want_logits, got_logits):
        np.testing.assert_array_equal(want.view(np.uint32), got.view(np.uint32))


@pytest.mark.parametrize("make_model", [qwen3_model, mixtral_model], ids=["qwen3_moe", "mixtral"])
def test_every_expert_resident_reproduces_the_model_bit_for_bit(make_model):
    model = evaluated(make_model, seed=0)
    want_tokens, want_logits = greedy(model, [1, 2, 3], 10)

    blocks = attach_arena(model, EXPERTS)
    arena = SwitchGLUArena(blocks)
    rng = np.random.default_rng(0)
    tables = np.empty((LAYERS, EXPERTS), np.int32)
    for layer, block in enumerate(blocks):
        slots = rng.permutation(EXPERTS)  # slots deliberately not equal to expert ids
        tables[layer, np.arange(EXPERTS)] = slots
        for expert in range(EXPERTS):
            arena.write_slot(layer, int(slots[expert]), block.expert_weights(expert))
    set_tables(blocks, tables)
    assert_greedy_matches(model, [1, 2, 3], 10, want_tokens, want_logits)


def test_partial_arena_runs_with_the_residency_manager():
    model = evaluated(qwen3_model, seed=1)
    blocks = attach_arena(model, num_slots=6)
    manager = _manager_over(blocks, 6, queue_depth=2, read_budget=8)
    set_tables(blocks, manager.snapshot())

    def boundary():
        set_tables(blocks, manager.step([block.report() for block in blocks]))

    tokens, logits = greedy(model, [5, 6, 7, 8], 16, after_step=boundary)
    manager.drain()
    _, total = manager.stats()
    assert len(tokens) == 20 and all(np.isfinite(step).all() for step in logits)
    assert total.hits > 0 and total.misses > 0 and total.reads_landed > 0
    assert total.lookups == total.hits + total.misses
    assert all(len(manager.resident(layer)) <= 6 for layer in range(LAYERS))
    manager.close()


QUANTIZATIONS = [dict(group_size=32, bits=4), dict(group_size=32, bits=8)]


def _fill_every_expert(blocks, arena, load):
    """Every expert resident, in slots deliberately not equal to the expert ids; returns the tables."""
    rng = np.random.default_rng(0)
    tables = np.empty((LAYERS, EXPERTS), np.int32)
    for layer in range(len(blocks)):
        slots = rng.permutation(EXPERTS)
        tables[layer, np.arange(EXPERTS)] = slots
        for expert in range(EXPERTS):
            arena.write_slot(layer, int(slots[expert]), load(layer, expert))
    set_tables(blocks, tables)


@pytest.mark.parametrize("quantization", QUANTIZATIONS, ids=["4bit", "8bit"])
@pytest.mark.parametrize("make_model", [qwen3_model, mixtral_model], ids=["qwen3_moe", "mixtral"])
def test_quantized_experts_resident_reproduce_the_quantized_model(make_model, quantization):
    import mlx.nn as nn

    mx.random.seed(0)
    model = make_model()
    nn.quantize(model, **quantization)
    mx.eval(model.parameters())
    want_tokens, want_logits = greedy(model, [1, 2, 3], 10)

    blocks = attach_arena(model, EXPERTS)
    layout = blocks[0].slot_layout()
    assert sorted(layout) == sorted(f"{p}.{a}" for p in ("gate_proj", "up_proj", "down_proj")
                                    for a in ("weight", "scales", "biases"))
    assert layout["gate_proj.weight"][1] == np.uint32
    assert type(blocks[0].arena.gate_proj).__name__ == "QuantizedSwitchLinear"
    assert blocks[0].arena.gate_proj.bits == quantization["bits"]
    _fill_every_expert(blocks, SwitchGLUArena(blocks), lambda layer, expert: blocks[layer].expert_weights(expert))
    assert_greedy_matches(model, [1, 2, 3], 10, want_tokens, want_logits)


def test_quantized_experts_stream_from_an_mlx_community_checkpoint(tmp_path):
    """Packed weights, scales and biases read by ExpertStore from the stacked switch_mlp tensors of a file."""
    import mlx.nn as nn

    from kq_host.expert_store import ExpertStore

    mx.random.seed(2)
    model = qwen3_model()
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    want_tokens, want_logits = greedy(model, [4, 5], 8)
    tensors = {f"model.layers.{i}.mlp.switch_mlp.{key}": array
               for i, layer in enumerate(model.layers) for key, array in
               [(f"{p}.{a}", getattr(layer.mlp.switch_mlp, p)[a]) for p in ("gate_proj", "up_proj", "down_proj")
                for a in ("weight", "scales", "biases")]}
    mx.save_safetensors(str(tmp_path / "model.safetensors"), tensors)

    blocks = attach_arena(model, EXPERTS)
    store = ExpertStore(tmp_path, layout="stacked", template="model.layers.{layer}.mlp.switch_mlp.{projection}",
                        projections=tuple(blocks[0].slot_layout()))
    _fill_every_expert(blocks, SwitchGLUArena(blocks), store.read_expert)
    assert_greedy_matches(model, [4, 5], 8, want_tokens, want_logits)


_LAZY_RUN = r"""
import json, sys
from pathlib import Path
import mlx.core as mx
from mlx_lm.utils import load_model
from kq_host.expert_store import ExpertStore
from kq_host.residency import ResidencyManager
from kq_mlx.mlx_lm_adapter import SwitchGLUArena, attach_arena, set_tables

path, keep = Path(sys.argv[1]), sys.argv[2] == "keep"
def status_mib(field):
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field + ":"))
    return int(line.split()[1]) / 1024
mx.eval(mx.ones((8, 8)) @ mx.ones((8, 8)))  # the device's own start-up (a CUDA context) is not the model's
baseline = status_mib("VmRSS")
mx.reset_peak_memory()
model, _ = load_model(path, lazy=True)
blocks = attach_arena(model, 16, keep_experts=keep)
mx.eval(model.parameters())
if keep:  # what an unmodified model reaches once every expert has been routed to
    mx.eval([mx.sum(a) for b in blocks for a in b.block.switch_mlp.parameters()["gate_proj"].values()]
            + [mx.sum(a) for b in blocks for p in ("up_proj", "down_proj")
               for a in b.block.switch_mlp.parameters()[p].values()])
store = ExpertStore(path, layout="stacked", template="model.layers.{layer}.mlp.switch_mlp.{projection}.weight",
                    projections=tuple(blocks[0].slot_layout()))
# NumPy bookkeeping: the peak measured is the model's, not Numba's and LLVM's own (about 130 MiB).
manager = ResidencyManager(len(blocks), 64, 16, loader=lambda l, e, s: store.read_expert(l, e),
                           arena=SwitchGLUArena(blocks), read_budget=16, impl="numpy")
set_tables(blocks, manager.snapshot())
x = mx.array([[1, 2, 3]])
for _ in range(8):
    logits = model(x)[0, -1]
    mx.eval(logits)
    set_tables(blocks, manager.step([b.report() for b in blocks]))
    x = mx.concatenate([x, mx.argmax(logits)[None, None]], axis=1)
manager.drain()
print(json.dumps(dict(baseline=baseline, peak=status_mib("VmHWM"), reads=manager.stats()[1].reads_landed,
                      mlx_peak=mx.get_peak_memory() / 2**20, on_cpu=mx.default_device() == mx.cpu)))
"""


def test_lazy_checkpoint_never_materialises_its_experts(tmp_path):
    """From mlx_lm's lazy load with keep_experts=False, the peak of MLX's allocator holds the other weights
    and the arenas (16 of 64 slots), not the experts; with the experts kept it holds them. Where arrays
    live in host memory (the CPU device), the process's peak RSS tells the same."""
    import dataclasses
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from mlx.utils import tree_flatten
    from mlx_lm.utils import save_config, save_model

    mx.random.seed(3)
    args = qwen3_moe.ModelArgs(
        model_type="qwen3_moe", hidden_size=256, num_hidden_layers=2, intermediate_size=256, num_attention_heads=4,
        num_experts=64, num_experts_per_tok=4, decoder_sparse_step=1, mlp_only_layers=[],
        moe_intermediate_size=512, rms_norm_eps=1e-6, vocab_size=128, num_key_value_heads=2, head_dim=64,
        rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=512, norm_topk_prob=True)
    model = qwen3_moe.Model(args)
    mx.eval(model.parameters())
    save_model(tmp_path, model)
    save_config(dataclasses.asdict(args), tmp_path / "config.json")
    expert_mib = 2 * 64 * 3 * 256 * 512 * 4 / 2**20  # 192 MiB of the file's float32 weights
    arena_mib = expert_mib * 16 / 64
    other_mib = sum(v.nbytes for k, v in tree_flatten(model.parameters()) if "switch_mlp" not in k) / 2**20

    def run(mode):
        root = Path(__file__).resolve().parents[1]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
        out = subprocess.run([sys.executable, "-c", _LAZY_RUN, str(tmp_path), mode], capture_output=True, text=True,
                             env=env, timeout=300)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    dropped, kept = run("drop"), run("keep")
    print(f"peak RSS growth: experts dropped {dropped['peak'] - dropped['baseline']:.0f} MiB, kept and "
          f"touched {kept['peak'] - kept['baseline']:.0f} MiB; MLX's peak: {dropped['mlx_peak']:.0f} / "
          f"{kept['mlx_peak']:.0f} MiB; experts {expert_mib:.0f} MiB, arenas {arena_mib:.0f} MiB, "
          f"other weights {other_mib:.1f} MiB")
    assert dropped["reads"] > 0 and kept["reads"] > 0
    measures = [("mlx_peak", lambda r: r["mlx_peak"])]
    if dropped["on_cpu"]:
        measures.append(("rss", lambda r: r["peak"] - r["baseline"]))
    for name, growth_of in measures:
        growth = growth_of(dropped)
        # 96 MiB for the rest: the reads in flight (up to 16 experts of 1.5 MiB), the modules the run imports
        # lazily, the allocators' slack (the RSS growth of the dropped run measured 114 MiB under load).
        assert growth < other_mib + arena_mib + 96, (name, growth, other_mib, arena_mib)
        assert growth_of(kept) > growth + 0.75 * expert_mib, (name, kept, dropped)


def _tier_of(blocks, bits=4):
    return tier_of(blocks, lambda block, e: block.expert_weights(e), experts=EXPERTS, bits=bits)


def test_tier_with_every_expert_resident_reproduces_the_model_bit_for_bit():
    from kq_mlx.mlx_lm_adapter import attach_tier

    model = evaluated(qwen3_model, seed=3)
    want_tokens, want_logits = greedy(model, [1, 2, 3], 6)
    blocks = attach_arena(model, EXPERTS)
    _fill_every_expert(blocks, SwitchGLUArena(blocks), lambda layer, e: blocks[layer].expert_weights(e))
    attach_tier(blocks, _tier_of(blocks))
    for block in blocks:
        block.rule = "tier"
    assert_greedy_matches(model, [1, 2, 3], 6, want_tokens, want_logits)


def test_tier_serves_misses_closer_to_the_model_than_shedding():
    from kq_mlx.mlx_lm_adapter import attach_tier

    model = evaluated(qwen3_model, seed=4)
    _, want = greedy(model, [1, 2, 3], 1)
    blocks = attach_arena(model, 4)
    arena = SwitchGLUArena(blocks)
    tables = np.full((LAYERS, EXPERTS), -1, np.int32)
    for layer, block in enumerate(blocks):
        for slot, expert in enumerate((0, 5, 9, 12)):
            tables[layer, expert] = slot
            arena.write_slot(layer, slot, block.expert_weights(expert))
    set_tables(blocks, tables)
    attach_tier(blocks, _tier_of(blocks, bits=4))
    errors = {}
    for rule in ("shed", "tier"):
        for block in blocks:
            block.rule = rule
        _, got = greedy(model, [1, 2, 3], 1)
        errors[rule] = float(np.linalg.norm(got[0] - want[0]) / np.linalg.norm(want[0]))
    assert int(np.array(blocks[0].last[2].miss_ids).max()) >= 0, "the case must have misses"
    assert errors["tier"] < 0.25 * errors["shed"], errors


def test_tier_rule_without_a_tier_names_the_call():
    model = qwen3_model()
    blocks = attach_arena(model, 4)
    blocks[0].rule = "tier"
    with pytest.raises(ValueError, match="attach_tier"):
        blocks[0](mx.zeros((1, 1, 64)))


def test_packed_reports_are_the_blocks_reports_bit_for_bit():
    from kq_host.residency import LayerReport
    from kq_mlx.mlx_lm_adapter import pack_reports

    model = evaluated(qwen3_model, seed=4)
    blocks = attach_arena(model, num_slots=6)
    rng = np.random.default_rng(4)
    tables = np.full((LAYERS, EXPERTS), -1, np.int32)  # 6 random experts a layer resident, in random slots
    for layer in range(LAYERS):
        tables[layer, rng.choice(EXPERTS, 6, replace=False)] = rng.permutation(6)
    set_tables(blocks, tables)
    model(mx.array([[3, 1, 4, 1, 5]]), cache=make_prompt_cache(model))
    for score_dtype in (mx.float32, mx.bfloat16):  # bf16 scores (a bf16 model's) are widened exactly
        for block in blocks:
            inds, scores, shed = block.last
            block.last = (inds, scores.astype(score_dtype), shed._replace(miss_scores=shed.miss_scores.astype(
                score_dtype)))
        got = LayerReport.from_packed(np.array(pack_reports(blocks)))
        want = LayerReport.stacked([block.report() for block in blocks])
        for name in ("indices", "scores", "miss_ids", "miss_scores", "served"):
            a, b = getattr(got, name), getattr(want, name)
            assert a.shape == b.shape == (LAYERS, 5, 4) and a.tobytes() == b.tobytes(), name
    with pytest.raises(ValueError, match="packed must be int32"):
        LayerReport.from_packed(np.zeros((5, 2, 5, 4), np.float32))


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "serial"])
def test_generate_greedy_with_every_expert_resident_is_the_model(overlap):
    from kq_mlx.mlx_lm_adapter import generate_greedy

    model = evaluated(qwen3_model, seed=2)
    want, _ = greedy(model, [1, 2, 3], 12)
    blocks = attach_arena(model, EXPERTS)
    manager = _manager_over(blocks, EXPERTS, queue_depth=0)
    for layer in range(LAYERS):
        manager.preload(layer, range(EXPERTS))
    assert generate_greedy(model, blocks, manager, [1, 2, 3], 12, overlap=overlap) == want[3:]
    _, total = manager.stats()
    assert total.hits == total.lookups > 0  # every token's reports reached the manager
    manager.close()


def test_generate_greedy_serial_is_the_per_layer_loop_at_partial_residency():
    """One packed readback instead of a report per layer: the same tokens, the same reads."""
    from kq_mlx.mlx_lm_adapter import generate_greedy

    runs = []
    for packed in (False, True):
        model = evaluated(qwen3_model, seed=3)
        blocks = attach_arena(model, num_slots=6)
        manager = _manager_over(blocks, 6, queue_depth=0)
        if packed:
            tokens = generate_greedy(model, blocks, manager, [5, 6, 7], 14, overlap=False)
        else:
            set_tables(blocks, manager.snapshot())
            tokens, _ = greedy(model, [5, 6, 7], 14, after_step=lambda: set_tables(
                blocks, manager.step([block.report() for block in blocks])))
            tokens = tokens[3:]
        _, total = manager.stats()
        runs.append((tokens, total.hits, total.misses, total.reads_landed))
        manager.close()
    assert runs[0] == runs[1] and runs[0][2] > 0


def test_a_slot_written_while_a_token_is_in_flight_does_not_change_that_token():
    """The overlapped loop writes arena slots while the next token's graph is dispatched: the graph
    computes with the arena as it was when the graph was built."""
    model = evaluated(qwen3_model, seed=5)
    blocks = attach_arena(model, EXPERTS)
    arena = SwitchGLUArena(blocks)
    tables = np.tile(np.arange(EXPERTS, dtype=np.int32), (LAYERS, 1))
    for layer, block in enumerate(blocks):
        for expert in range(EXPERTS):
            arena.write_slot(layer, expert, block.expert_weights(expert))
    set_tables(blocks, tables)
    prompt = mx.array([[1, 2, 3]])
    want = np.array(model(prompt, cache=make_prompt_cache(model)))
    logits = model(prompt, cache=make_prompt_cache(model))
    mx.async_eval(logits)
    zeros = {key: np.zeros(shape, dtype) for key, (shape, dtype) in blocks[0].slot_layout().items()}
    arena.write_slots(np.zeros(EXPERTS, np.int64), np.arange(EXPERTS), [zeros] * EXPERTS)
    assert np.array(logits).tobytes() == want.tobytes()
    assert not np.array_equal(np.array(model(prompt, cache=make_prompt_cache(model))), want)


def test_look_ahead_predicts_from_each_layers_output_and_changes_nothing():
    from kq_mlx.mlx_lm_adapter import _route_qwen3_moe, attach_lookahead, pack_predictions

    prompt = [3, 1, 4, 1, 5]
    plain = evaluated(qwen3_model, seed=6)
    want_tokens, want_logits = greedy(plain, prompt, 4)
    model = evaluated(qwen3_model, seed=6)
    blocks = attach_arena(model, num_slots=EXPERTS)
    _fill_every_expert(blocks, SwitchGLUArena(blocks), lambda layer, expert: blocks[layer].expert_weights(expert))
    attach_lookahead(model, blocks)
    assert_greedy_matches(model, prompt, 4, want_tokens, want_logits)
    # the prediction is the next block's router on the first layer's output, normalised as its input
    x = mx.array([prompt])
    hidden = model.model.embed_tokens(x)
    cache = make_prompt_cache(model)
    out = model.layers[0](hidden, None, cache[0])
    want, _ = _route_qwen3_moe(blocks[1].block, model.layers[1].post_attention_layernorm(out))
    predicted = np.array(pack_predictions(model))
    assert predicted.shape == (LAYERS, 5, 4) and (predicted[0] == -1).all()
    assert np.array_equal(np.sort(predicted[1], axis=-1), np.sort(np.array(want).reshape(5, 4), axis=-1))
    with pytest.raises(ValueError, match="one MoE block per layer"):
        attach_lookahead(model, blocks[:1])


def _decode_one_at_a_time(model, tokens, after_step=None):
    """Each token's logits, the tokens fed one by one (as an exact loop decodes)."""
    cache, seen = make_prompt_cache(model), []
    for token in tokens:
        logits = model(mx.array([[token]]), cache=cache)[0, -1]
        mx.eval(logits)
        seen.append(np.array(logits).view(np.uint32))
        if after_step is not None:
            after_step()
    return seen


@pytest.mark.parametrize("lookahead", [True, False], ids=["lookahead", "no-lookahead"])
@pytest.mark.parametrize("make_model", [qwen3_model, mixtral_model], ids=["qwen3_moe", "mixtral"])
def test_the_exact_mode_is_the_model_to_the_bit_at_a_quarter_of_the_experts(make_model, lookahead):
    from kq_mlx.mlx_lm_adapter import attach_exact

    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]
    want = _decode_one_at_a_time(evaluated(make_model, seed=8), tokens)
    model = evaluated(make_model, seed=8)
    blocks = attach_arena(model, num_slots=EXPERTS // 4)
    manager = _manager_over(blocks, EXPERTS // 4, queue_depth=2)
    attach_exact(model, blocks, manager, lookahead=lookahead)
    got = _decode_one_at_a_time(model, tokens, after_step=manager.next_token)
    stats = manager.lookahead_stats()
    manager.close()
    for position, (a, b) in enumerate(zip(got, want)):
        assert np.array_equal(a, b), f"token {position}"
    assert stats["critical_reads"].sum() > 0
    assert (stats["prefetches"].sum() > 0) == lookahead


@pytest.mark.parametrize("first, second", [(True, True), (True, False), (False, True)])
def test_attach_exact_again_binds_every_layer_and_the_look_ahead_to_the_new_manager(first, second):
    """A second attach_exact after the first manager closed: the passes read through the second manager
    alone (its acquire and, with look-ahead, its prefetch), the logits the model's bits."""
    from kq_mlx.mlx_lm_adapter import attach_exact

    tokens = [3, 1, 4, 1, 5, 9]
    want = _decode_one_at_a_time(evaluated(qwen3_model, seed=8), tokens)
    model = evaluated(qwen3_model, seed=8)
    blocks = attach_arena(model, num_slots=EXPERTS // 4)
    old = _manager_over(blocks, EXPERTS // 4, queue_depth=0)
    attach_exact(model, blocks, old, lookahead=first)
    old.close()
    new = _manager_over(blocks, EXPERTS // 4, queue_depth=0)
    attach_exact(model, blocks, new, lookahead=second)
    got = _decode_one_at_a_time(model, tokens, after_step=new.next_token)
    stats = new.lookahead_stats()
    new.close()
    for position, (a, b) in enumerate(zip(got, want)):
        assert np.array_equal(a, b), f"token {position}"
    assert stats["critical_reads"].sum() > 0 and (stats["prefetches"].sum() > 0) == second


def test_attach_exact_refuses_a_manager_of_another_shape():
    from kq_mlx.mlx_lm_adapter import attach_exact

    model = evaluated(qwen3_model, seed=1)
    blocks = attach_arena(model, num_slots=4)
    with pytest.raises(ValueError, match="attach_exact: the manager has 2 layers of 8 slots"):
        attach_exact(model, blocks, ResidencyManager(LAYERS, EXPERTS, 8, loader=lambda *a: 1, queue_depth=0))
    with pytest.raises(ValueError, match="ResidencyManager: the arena holds 2 layers of 4 slots"):  # over the arenas
        _manager_over(blocks, 8, queue_depth=0)


def test_set_tables_sends_only_the_rows_that_changed():
    model = evaluated(qwen3_model, seed=6)
    blocks = attach_arena(model, num_slots=6)
    tables = np.full((LAYERS, EXPERTS), -1, np.int32)
    tables[:, :6] = np.arange(6)
    set_tables(blocks, tables)
    first = [block.slot_table for block in blocks]
    set_tables(blocks, tables.copy())
    assert all(block.slot_table is table for block, table in zip(blocks, first))  # nothing changed, nothing sent
    tables[1, [0, 7]] = tables[1, [7, 0]]
    set_tables(blocks, tables)
    assert blocks[0].slot_table is first[0] and blocks[1].slot_table is not first[1]
    assert np.array_equal(np.array(blocks[1].slot_table), tables[1])
    blocks[0].slot_table = mx.full((EXPERTS,), -1, mx.int32)  # set by hand: the next call restores its row
    set_tables(blocks, tables)
    assert np.array_equal(np.array(blocks[0].slot_table), tables[0])
    assert "_published" not in blocks[0] and "_published" not in dict(blocks[0].parameters())
    with pytest.raises(ValueError, match=r"set_tables: tables must be int \[L, E\] with L = 2"):
        set_tables(blocks, tables[:1])
    tables[0, [0, 7]] = tables[0, [7, 0]]
    set_tables(blocks, np.ascontiguousarray(tables[:, ::-1])[:, ::-1])  # int32 rows of negative strides
    assert all(np.array_equal(np.array(block.slot_table), row) for block, row in zip(blocks, tables))


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "serial"])
def test_generate_greedy_exact_is_the_model_at_partial_residency(overlap):
    """exact=True: a token that missed runs again once its misses are read, so every kept token is the
    unmodified model's, from a cold arena a third the size of the model's experts."""
    from kq_mlx.mlx_lm_adapter import generate_greedy

    want = _greedy_prefilled(qwen3_model, 7, [2, 7, 1, 8], 16)  # the prompt as mlx-lm feeds it
    model = evaluated(qwen3_model, seed=7)
    blocks = attach_arena(model, num_slots=6)
    manager = _manager_over(blocks, 6, queue_depth=0)
    assert generate_greedy(model, blocks, manager, [2, 7, 1, 8], 16, overlap=overlap, exact=True) == want
    _, total = manager.stats()
    assert total.misses > 0 and total.reads_landed > 0  # it did read on the way
    manager.close()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "serial"])
def test_generate_greedy_exact_runs_a_token_again_once_and_in_chunks_where_its_experts_exceed_the_arena(overlap):
    """A token that missed runs again layer by layer: once, however its routing changes after the misses are
    read, and in chunks that fit where its experts exceed the arena (top-4 routing, 2 slots): the model's
    tokens."""
    from kq_mlx.mlx_lm_adapter import generate_greedy

    want = _greedy_prefilled(qwen3_model, 7, [2, 7, 1, 8], 6)
    model = evaluated(qwen3_model, seed=7)
    blocks = attach_arena(model, num_slots=2)  # top-4 routing: 4 experts a row cannot fit 2 slots
    manager = _manager_over(blocks, 2, queue_depth=0)
    ends = []  # a pass kept from the graph ends its token by step, one run layer by layer by next_token
    for name in ("step", "next_token"):
        method = getattr(manager, name)
        setattr(manager, name, lambda *args, _method=method, _name=name, **kwargs: ends.append(_name)
                or _method(*args, **kwargs))
    assert generate_greedy(model, blocks, manager, [2, 7, 1, 8], 6, overlap=overlap, exact=True) == want
    # one run again at most a token: the prompt's prefill pass and each of the 6 tokens' passes end once
    assert ends.count("next_token") > 1 and len(ends) == 1 + 6
    manager.close()


def test_packed_reports_add_the_same_ops_however_many_layers():
    """pack_reports joins each field over the layers before converting it: its graph does not grow
    with the layers (on a GPU every op is a launch of its own in a host-bound token)."""
    import io
    from types import SimpleNamespace

    from kq_core.contract import RouteShedResult
    from kq_mlx.mlx_lm_adapter import pack_reports

    def primitives(layers):
        rng = np.random.default_rng(layers)
        blocks = []
        for _ in range(layers):
            inds = mx.array(rng.integers(0, EXPERTS, (1, 1, 4)).astype(np.uint32))
            scores = mx.array(rng.random((1, 1, 4)).astype(np.float32)).astype(mx.bfloat16)
            shed = RouteShedResult(inds, scores.astype(mx.float32), mx.array(rng.integers(-1, EXPERTS, (1, 1, 4))
                                                                             .astype(np.int32)), scores.astype(mx.float32))
            mx.eval(inds, scores, *shed)
            blocks.append(SimpleNamespace(last=(inds, scores, shed), last_mix=scores))
        dot = io.StringIO()
        mx.export_to_dot(dot, pack_reports(blocks))
        return dot.getvalue().count("shape=rectangle")

    assert primitives(2) == primitives(16) <= 16  # five fields, served derived from the weights


@pytest.mark.parametrize("layers, shape, score_dtype", [(3, (2, 3, 4), "bfloat16"), (16, (1, 1, 8), "float32"),
                                                        (1, (1, 5, 8), "float16")],
                         ids=["3x2x3x4-bf16", "16x1x1x8-f32", "1x1x5x8-f16"])
@pytest.mark.parametrize("max_inputs", [None, 10], ids=["default-launches", "two-layers-a-launch"])
def test_report_pack_is_each_fields_bits(monkeypatch, layers, shape, score_dtype, max_inputs):
    """kq_mlx.report_pack on every backend (one kernel on MLX-CUDA per launch's layers, concatenations
    elsewhere): ids as int32, scores widened to float32 bits; ids sliced out of a wider array (not contiguous),
    as a router's are; the same bits when the layers go in launches of two."""
    from kq_mlx import report_pack
    from kq_mlx.report_pack import pack

    if max_inputs is not None:
        monkeypatch.setattr(report_pack, "MAX_INPUTS_PER_LAUNCH", max_inputs)

    rng = np.random.default_rng(layers)
    wide = rng.integers(0, 2**31 - 1, (layers, *shape[:-1], 2 * shape[-1])).astype(np.uint32)
    host = {"ids": wide[..., 1::2], "scores": rng.standard_normal((layers, *shape)).astype(np.float32),
            "miss_ids": rng.integers(-1, 64, (layers, *shape)).astype(np.int32),
            "miss_scores": rng.standard_normal((layers, *shape)).astype(np.float32),
            "mix": np.where(rng.random((layers, *shape)) < 0.5, 0.0, rng.random((layers, *shape))).astype(np.float32)}
    dtype = getattr(mx, score_dtype)
    fields = {"ids": [mx.array(wide[layer])[..., 1::2] for layer in range(layers)],
              "scores": [mx.array(host["scores"][layer]).astype(dtype) for layer in range(layers)],
              "miss_ids": [mx.array(a) for a in host["miss_ids"]],
              "miss_scores": [mx.array(a) for a in host["miss_scores"]],
              "mix": [mx.array(a) for a in host["mix"]]}
    host["scores"] = np.stack([np.array(a.astype(mx.float32)) for a in fields["scores"]])
    host["served"] = np.where(host["mix"] > 0, host["scores"], np.float32(0))  # the scores the layer combined
    rows = int(np.prod(shape[:-1]))
    want = np.stack([host["ids"].astype(np.int32), host["scores"].view(np.int32), host["miss_ids"],
                     host["miss_scores"].view(np.int32), host["served"].view(np.int32)]).reshape(5, layers, rows,
                                                                                               shape[-1])
    got = np.array(pack(fields))
    assert got.dtype == np.int32 and got.shape == want.shape and got.tobytes() == want.tobytes()
    fields["scores"][0] = fields["scores"][0][..., :1]
    with pytest.raises(ValueError, match="pack_reports: every layer's report fields"):
        pack(fields)


class FlakyLoader:
    """Reads experts from the blocks; the reads numbered in ``failing`` (1-based, counted over the run) raise, and
    while ``broken`` holds a (layer, expert) -> bool test, every read it selects raises."""

    def __init__(self, blocks, failing=()):
        self.blocks, self.failing, self.count, self.broken = blocks, set(failing), 0, None

    def __call__(self, layer, expert, slot):
        self.count += 1
        if self.count in self.failing or (self.broken is not None and self.broken(layer, expert)):
            raise OSError(f"read {self.count} failed: input/output error")
        return self.blocks[layer].expert_weights(expert)


def _cache_offsets(cache):
    return [c.offset for c in cache]


@pytest.mark.parametrize("lookahead", [True, False], ids=["lookahead", "no-lookahead"])
def test_a_failed_read_in_the_exact_mode_leaves_every_cache_as_before_the_token(lookahead):
    """A read failing in layer 1 of a token: layer 0's cache already took the token; the error leaves every
    cache without it, and the same token run again once the disk heals gives the unmodified model's bits."""
    from kq_host.residency import PreloadError
    from kq_mlx.mlx_lm_adapter import attach_exact

    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    want = _decode_one_at_a_time(evaluated(qwen3_model, seed=8), tokens)
    model = evaluated(qwen3_model, seed=8)
    blocks = attach_arena(model, num_slots=EXPERTS // 4)
    loader = FlakyLoader(blocks)
    manager = ResidencyManager(LAYERS, EXPERTS, EXPERTS // 4, loader=loader, arena=SwitchGLUArena(blocks),
                               queue_depth=0)
    attach_exact(model, blocks, manager, lookahead=lookahead)
    cache, failures = make_prompt_cache(model), 0
    for position, token in enumerate(tokens):
        loader.broken = (lambda layer, expert: layer == 1) if position % 2 else None
        before = _cache_offsets(cache)
        try:
            logits = model(mx.array([[token]]), cache=cache)[0, -1]
        except PreloadError:
            failures += 1
            assert _cache_offsets(cache) == before, "a failed token must leave every cache as before it"
            loader.broken = None
            logits = model(mx.array([[token]]), cache=cache)[0, -1]
        mx.eval(logits)
        manager.next_token()
        assert np.array_equal(np.array(logits).view(np.uint32), want[position]), f"token {position}"
    manager.close()
    assert failures > 0, "the case must fail some reads mid-token"


def test_attach_exact_passes_its_timeout_to_every_wait_and_leaves_the_caches_as_before():
    import threading

    from kq_host.residency import PreloadError
    from kq_mlx.mlx_lm_adapter import attach_exact

    model = evaluated(qwen3_model, seed=8)
    blocks = attach_arena(model, num_slots=EXPERTS // 4)
    release = threading.Event()

    def hanging(layer, expert, slot):
        release.wait(60)
        return blocks[layer].expert_weights(expert)

    manager = ResidencyManager(LAYERS, EXPERTS, EXPERTS // 4, loader=hanging, arena=SwitchGLUArena(blocks),
                               queue_depth=2)
    attach_exact(model, blocks, manager, timeout=0.1)
    cache = make_prompt_cache(model)
    try:
        with pytest.raises(PreloadError, match="still out"):
            model(mx.array([[3]]), cache=cache)
        assert _cache_offsets(cache) == [0] * LAYERS
    finally:
        release.set()
        manager.close()
    with pytest.raises(ValueError, match="attach_exact: timeout"):
        attach_exact(model, blocks, manager, timeout=-1)


def _greedy_one_at_a_time(make_model, seed, prompt, steps):
    """The unmodified model's greedy tokens, the prompt fed a token a pass (as exact=True runs it)."""
    model = evaluated(make_model, seed=seed)
    cache = make_prompt_cache(model)
    for token in prompt[:-1]:
        mx.eval(model(mx.array([[token]]), cache=cache))
    want, x = [], mx.array([prompt[-1:]])
    for _ in range(steps):
        want.append(int(mx.argmax(model(x, cache=cache)[0, -1]).item()))
        x = mx.array([want[-1:]])
    return want


@pytest.mark.parametrize("failing_read", [1, 5, 12])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "serial"])
def test_generate_greedy_exact_retries_a_transient_read_failure(failing_read, overlap):
    from kq_mlx.mlx_lm_adapter import generate_greedy

    want = _greedy_prefilled(qwen3_model, 7, [2, 7, 1, 8], 10)
    totals = []
    for failing in ([failing_read], []):
        model = evaluated(qwen3_model, seed=7)
        blocks = attach_arena(model, num_slots=6)
        loader = FlakyLoader(blocks, failing=failing)
        manager = ResidencyManager(LAYERS, EXPERTS, 6, loader=loader, arena=SwitchGLUArena(blocks), queue_depth=0)
        assert generate_greedy(model, blocks, manager, [2, 7, 1, 8], 10, overlap=overlap, exact=True) == want
        totals.append((manager.stats()[1], loader.count))
        manager.close()
    (failed_run, reads), (clean_run, _) = totals
    assert reads > failing_read and failed_run.reads_failed == 1
    # The read again is not a lookup again: the routing is credited once, as without the failure.
    assert failed_run.lookups == clean_run.lookups


def _greedy_prefilled(make_model, seed, prompt, steps):
    """The unmodified model's greedy tokens in mlx-lm's order: the prompt but its last token in one pass, then
    the last token (as generate_greedy's prefill feeds it)."""
    model = evaluated(make_model, seed=seed)
    cache = make_prompt_cache(model)
    if len(prompt) > 1:
        mx.eval(model(mx.array([prompt[:-1]]), cache=cache))
    want, x = [], mx.array([prompt[-1:]])
    for _ in range(steps):
        want.append(int(mx.argmax(model(x, cache=cache)[0, -1]).item()))
        x = mx.array([want[-1:]])
    return want


@pytest.mark.parametrize("prefill_prompt", [True, False], ids=["prefill", "token-a-pass"])
def test_generate_greedy_exact_names_a_persistent_read_failure_and_works_once_the_disk_heals(prefill_prompt):
    from kq_host.residency import PreloadError
    from kq_mlx.mlx_lm_adapter import generate_greedy

    reference = _greedy_prefilled if prefill_prompt else _greedy_one_at_a_time
    want = reference(qwen3_model, 7, [2, 7, 1, 8], 10)
    model = evaluated(qwen3_model, seed=7)
    blocks = attach_arena(model, num_slots=6)
    loader = FlakyLoader(blocks)
    loader.broken = lambda layer, expert: layer == 1 and expert % 2 == 0
    manager = ResidencyManager(LAYERS, EXPERTS, 6, loader=loader, arena=SwitchGLUArena(blocks), queue_depth=0)
    if prefill_prompt:  # the prompt's layer 1 reads fail first
        message = (r"prefill: acquire: layer 1: the reads of experts \[(\d+, )*\d+\] failed \(expert \d+: OSError: "
                   r"read \d+ failed: input/output error.*\) \(each failed read retried 2 times\)")
    else:  # a pass that missed runs again layer by layer: its reads are the layer's, as prefill's
        message = (r"generate_greedy: acquire: layer 1: the reads of experts \[(\d+, )*\d+\] failed \(expert \d+: "
                   r"OSError: read \d+ failed: input/output error.*\) \(each failed read retried 2 times\)")
    with pytest.raises(PreloadError, match=message) as caught:
        generate_greedy(model, blocks, manager, [2, 7, 1, 8], 10, exact=True, read_retries=2,
                        prefill_prompt=prefill_prompt)
    assert caught.value.failed and all(record.layer == 1 for record in caught.value.failed)
    assert all(record.count == 3 for record in caught.value.failed)  # the read and 2 retries
    loader.broken = None
    assert generate_greedy(model, blocks, manager, [2, 7, 1, 8], 10, exact=True, prefill_prompt=prefill_prompt) == want
    manager.close()


@pytest.mark.parametrize("prefill_prompt", [True, False], ids=["prefill", "token-a-pass"])
def test_generate_greedy_exact_times_out_on_a_hanging_read(prefill_prompt):
    import threading

    from kq_host.residency import PreloadError
    from kq_mlx.mlx_lm_adapter import generate_greedy

    model = evaluated(qwen3_model, seed=7)
    blocks = attach_arena(model, num_slots=6)
    release = threading.Event()

    def hanging(layer, expert, slot):
        release.wait(60)
        return blocks[layer].expert_weights(expert)

    manager = ResidencyManager(LAYERS, EXPERTS, 6, loader=hanging, arena=SwitchGLUArena(blocks), queue_depth=2)
    message = (r"prefill: acquire: layer 0: the reads of experts \[.*\] still out after 0.1 s" if prefill_prompt
               else r"generate_greedy: .*still out after 0.1 s")
    try:
        with pytest.raises(PreloadError, match=message) as caught:
            generate_greedy(model, blocks, manager, [2, 7, 1, 8], 4, exact=True, timeout=0.1,
                            prefill_prompt=prefill_prompt)
        assert caught.value.pending
    finally:
        release.set()
        manager.close()
    for bad in (dict(timeout=-1.0), dict(read_retries=-1), dict(read_retries=1.5)):
        with pytest.raises(ValueError, match=f"generate_greedy: {next(iter(bad))}"):
            generate_greedy(model, blocks, manager, [2], 1, exact=True, **bad)


# ---- prefill through the arena -------------------------------------------------------------------------


def deepseek_v3_model():
    """DeepSeek-V3's layout: its first layer dense, the others MoE at the SwitchGLU seam (a router kq does not run)."""
    from mlx_lm.models import deepseek_v3

    args = deepseek_v3.ModelArgs(
        model_type="deepseek_v3", vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=LAYERS + 1, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=EXPERTS, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
        v_head_dim=16, qk_nope_head_dim=16, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
        n_group=2, topk_group=1, num_experts_per_tok=4, moe_layer_freq=1, first_k_dense_replace=1,
        max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
        attention_bias=False)
    model = deepseek_v3.Model(args)
    for layer in model.model.layers[1:]:  # mlx-lm starts the routers at zero: every token would route alike
        gate = layer.mlp.gate
        gate.weight = mx.random.normal(gate.weight.shape)
        gate.e_score_correction_bias = 0.1 * mx.random.normal(gate.e_score_correction_bias.shape)
    return model


def _quantized(make_model):
    def make():
        import mlx.nn as nn

        model = make_model()
        # every layer whose input splits into groups of 32 (the experts do; DeepSeek's latent attention not all)
        nn.quantize(model, group_size=32, bits=4,
                    class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % 32 == 0)
        return model
    return make


PREFILL_MODELS = [pytest.param(qwen3_model, id="qwen3_moe"), pytest.param(mixtral_model, id="mixtral"),
                  pytest.param(deepseek_v3_model, id="deepseek_v3"),
                  pytest.param(_quantized(qwen3_model), id="qwen3_moe-q4"),
                  pytest.param(_quantized(deepseek_v3_model), id="deepseek_v3-q4")]
PROMPT = [5, 17, 3, 99, 42, 8, 61, 23, 7, 110, 2, 77, 31, 64, 9, 50, 12, 88, 4, 70]


def _cache_bits(cache):
    arrays = [array for c in cache for array in c.state if isinstance(array, mx.array)]
    assert arrays
    return [np.array(array).view(np.uint32) for array in arrays]


@pytest.mark.parametrize("make_model", PREFILL_MODELS)
def test_prefill_is_the_model_bit_for_bit_at_a_quarter_of_the_experts_reading_each_routed_expert_once(make_model):
    """A 20-token prompt through 4 of 16 slots a layer: every layer routes more experts than fit, so they run in
    chunks; the last logits and the cache are the unmodified model's bits, and each (layer, expert) the
    prompt routes is read exactly once."""
    from kq_mlx.mlx_lm_adapter import prefill

    model = evaluated(make_model, seed=11)
    want_cache = make_prompt_cache(model)
    want = model(mx.array([PROMPT]), cache=want_cache)[0, -1]
    mx.eval(want)
    blocks = attach_arena(model, num_slots=EXPERTS // 4)
    manager = ResidencyManager(len(blocks), EXPERTS, EXPERTS // 4,
                               loader=lambda l, e, s: blocks[l].expert_weights(e), arena=SwitchGLUArena(blocks),
                               queue_depth=0)
    cache = make_prompt_cache(model)
    got = prefill(model, blocks, manager, PROMPT, cache)
    np.testing.assert_array_equal(np.array(got).view(np.uint32), np.array(want).view(np.uint32))
    for got_state, want_state in zip(_cache_bits(cache), _cache_bits(want_cache)):
        np.testing.assert_array_equal(got_state, want_state)
    routed = [np.unique(np.array(block.last[0])) for block in blocks]
    assert all(experts.size > EXPERTS // 4 for experts in routed)  # chunked in every layer
    _, total = manager.stats()
    assert total.reads_landed == sum(experts.size for experts in routed)
    assert total.lookups == len(PROMPT) * blocks[0].last[0].shape[-1] * len(blocks) and total.hits == 0
    assert all(block.rule != "exact" for block in blocks)  # the rules as they were
    manager.close()


def test_prefill_in_passes_and_with_a_warm_arena_reads_only_the_experts_not_resident():
    from kq_mlx.mlx_lm_adapter import prefill

    model = evaluated(qwen3_model, seed=12)
    want_cache = make_prompt_cache(model)
    for start in range(0, len(PROMPT), 8):  # mlx-lm's prefill_step_size 8
        want = model(mx.array([PROMPT[start:start + 8]]), cache=want_cache)[0, -1]
    mx.eval(want)
    blocks = attach_arena(model, num_slots=6)
    manager = _manager_over(blocks, 6, queue_depth=0)
    manager.preload(0, [0, 1, 2])
    before = manager.stats()[1].reads_landed
    resident = set(manager.resident(0))
    cache = make_prompt_cache(model)
    got = prefill(model, blocks, manager, PROMPT[:8], cache, step_size=8)
    routed = [set(np.unique(np.array(block.last[0])).tolist()) for block in blocks]
    assert manager.stats()[1].reads_landed - before == len(routed[0] - resident) + len(routed[1])
    got = prefill(model, blocks, manager, PROMPT[8:], cache, step_size=8)
    np.testing.assert_array_equal(np.array(got).view(np.uint32), np.array(want).view(np.uint32))
    assert manager.token == 3  # one token boundary a pass
    manager.close()


def test_prefill_refuses_bad_arguments_by_name_and_leaves_the_cache_on_a_failed_read():
    from kq_host.residency import PreloadError
    from kq_mlx.mlx_lm_adapter import prefill

    model = evaluated(qwen3_model, seed=7)
    blocks = attach_arena(model, num_slots=6)
    loader = FlakyLoader(blocks)
    loader.broken = lambda layer, expert: layer == 1
    manager = ResidencyManager(LAYERS, EXPERTS, 6, loader=loader, arena=SwitchGLUArena(blocks), queue_depth=0)
    cache = make_prompt_cache(model)
    for bad, message in ((dict(prompt=[]), "prefill: the prompt must hold at least one token"),
                         (dict(step_size=0), "prefill: step_size must be an int >= 1"),
                         (dict(timeout=-1), "prefill: timeout"), (dict(read_retries=-1), "prefill: read_retries")):
        arguments = {"prompt": PROMPT, **bad}
        with pytest.raises(ValueError, match=message):
            prefill(model, blocks, manager, arguments.pop("prompt"), cache, **arguments)
    with pytest.raises(PreloadError, match=r"prefill: acquire: layer 1: the reads of experts \[.*\] failed .*"
                                           r"\(each failed read retried 0 times\)"):
        prefill(model, blocks, manager, PROMPT, cache, read_retries=0)
    assert _cache_offsets(cache) == [0, 0]
    other = ResidencyManager(LAYERS, EXPERTS, 4, loader=loader, queue_depth=0)
    with pytest.raises(ValueError, match="prefill: the manager has 2 layers of 4 slots"):
        prefill(model, blocks, other, PROMPT, cache)
    manager.close()
    other.close()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "serial"])
def test_generate_greedy_ends_at_the_first_stop_token_and_extends_a_given_cache(overlap):
    from kq_mlx.mlx_lm_adapter import generate_greedy

    want = _greedy_prefilled(qwen3_model, 7, [2, 7, 1, 8], 12)
    stop = next(token for token in want[3:] if token not in want[:3])  # a token first generated at position >= 3
    model = evaluated(qwen3_model, seed=7)
    blocks = attach_arena(model, num_slots=6)
    manager = _manager_over(blocks, 6, queue_depth=0)
    cache = make_prompt_cache(model)
    got = generate_greedy(model, blocks, manager, [2, 7, 1, 8], 12, overlap=overlap, exact=True, cache=cache,
                          stop_tokens=[stop])
    assert got == want[:want.index(stop) + 1]
    assert cache[0].offset >= 4 + len(got) - 1  # the given cache took the prompt and the tokens
    manager.close()


@pytest.mark.parametrize("make_model", [qwen3_model, _quantized(qwen3_model), deepseek_v3_model],
                         ids=["qwen3_moe", "qwen3_moe-q4", "deepseek_v3"])
def test_token_ids_outside_the_vocabulary_are_refused_by_name(make_model):
    """The models' vocabulary is 128 ids (their embedding's rows): an id past it or below 0 is refused before
    any pass runs, by generate_greedy and prefill alike; nothing is read, no cache takes a token."""
    from kq_mlx.mlx_lm_adapter import generate_greedy, prefill

    model = evaluated(make_model, seed=7)
    blocks = attach_arena(model, num_slots=6)
    manager = ResidencyManager(len(blocks), EXPERTS, 6, loader=lambda l, e, s: blocks[l].expert_weights(e),
                               arena=SwitchGLUArena(blocks), queue_depth=0)
    cache = make_prompt_cache(model)
    for prompt, bad in (([2, 7, 1, 500], 500), ([2, -5, 1, 8], -5), ([128], 128)):
        for exact in (False, True):
            with pytest.raises(ValueError, match=rf"generate_greedy: prompt's token ids must lie in \[0, 128\) "
                                                 rf"\(the model's vocabulary\), got {bad}"):
                generate_greedy(model, blocks, manager, prompt, 2, exact=exact, cache=cache)
        with pytest.raises(ValueError, match=rf"prefill: prompt's token ids must lie in \[0, 128\).*got {bad}"):
            prefill(model, blocks, manager, prompt, cache)
    with pytest.raises(ValueError, match=r"prefill: prompt's token ids must lie in \[0, 128\).*got 1000"):
        prefill(model, blocks, manager, [1000], cache)
    assert manager.stats()[1].lookups == 0 and manager.pending() == [] and manager.token == 0
    assert all(c.offset == 0 for c in cache)
    assert len(generate_greedy(model, blocks, manager, [127, 0], 2, cache=cache)) == 2  # the edges are ids
    manager.close()


def test_generate_greedy_and_prefill_name_each_bad_argument():
    from kq_mlx.mlx_lm_adapter import generate_greedy, prefill

    model = evaluated(qwen3_model, seed=7)
    blocks = attach_arena(model, num_slots=6)
    manager = _manager_over(blocks, 6, queue_depth=0)
    want = _greedy_prefilled(qwen3_model, 7, [2, 7, 1, 8], 3)
    for prompt in ([2, 7, 1, 8], np.array([2, 7, 1, 8]), np.array([2, 7, 1, 8], np.uint8), (2, 7, 1, 8),
                   [np.int64(2), 7, 1, 8], mx.array([2, 7, 1, 8])):
        assert generate_greedy(model, blocks, manager, prompt, 3, exact=True) == want
    for prompt in ("abc", None, 5, [[2, 7], [1, 8]], np.array([[2, 7, 1, 8]]), [2.0, 7.0], [True, False],
                   [2, [7]], np.array([])):
        for call in (lambda: generate_greedy(model, blocks, manager, prompt, 2),
                     lambda: prefill(model, blocks, manager, prompt, make_prompt_cache(model))):
            with pytest.raises(ValueError, match=r"(generate_greedy|prefill): (the )?prompt"):
                call()
    for max_tokens in (None, 2.5, True, 0, -1, "3", np.float32(2)):
        with pytest.raises(ValueError, match=r"generate_greedy: max_tokens must be an int >= 1, got "):
            generate_greedy(model, blocks, manager, [2, 7], max_tokens)
    assert len(generate_greedy(model, blocks, manager, [2, 7], np.int64(2))) == 2
    for stop_tokens in ("ab", [1.5], 3, [None], [True]):
        with pytest.raises(ValueError, match=r"generate_greedy: stop_tokens must be a collection of token ids"):
            generate_greedy(model, blocks, manager, [2, 7], 2, stop_tokens=stop_tokens)
    for cache in (None, [None], "cache", 3):
        with pytest.raises(ValueError, match=r"prefill: cache must be the model's cache"):
            prefill(model, blocks, manager, [2, 7], cache)
    for cache in ([None], "cache", 3, make_prompt_cache(model)[:1]):  # the last: one cache for two layers
        with pytest.raises(ValueError, match=r"generate_greedy: cache must be the model's cache"):
            generate_greedy(model, blocks, manager, [2, 7], 2, cache=cache)
    with pytest.raises(ValueError, match=r"prefill: cache must be the model's cache, a list of one cache a layer "
                                         r"\(2 layers"):
        prefill(model, blocks, manager, [2, 7], make_prompt_cache(model)[:1])
    # stop tokens given as an iterator: read once, kept (the checks once consumed it, and no token stopped)
    assert generate_greedy(model, blocks, manager, [2, 7, 1, 8], 3, exact=True,
                           stop_tokens=iter([want[0]])) == want[:1]
    assert generate_greedy(model, blocks, manager, [2, 7, 1, 8], 3, exact=True,
                           stop_tokens=(token for token in [want[0]])) == want[:1]
    # a manager of other slots than the arenas' is refused however the loop starts (its slots past the
    # arenas' were written nowhere and their tokens were wrong)
    other = ResidencyManager(LAYERS, EXPERTS, 12, loader=lambda l, e, s: blocks[l].expert_weights(e), queue_depth=0)
    for exact, prefill_prompt in ((False, None), (True, False), (True, True)):
        with pytest.raises(ValueError, match=r"generate_greedy: the manager has 2 layers of 12 slots; the model 2 "
                                             r"blocks of \[6\]"):
            generate_greedy(model, blocks, other, [2, 7, 1, 8], 2, exact=exact, prefill_prompt=prefill_prompt)
    assert other.stats()[1].lookups == 0
    other.close()
    manager.close()


def test_attach_exact_takes_every_timeout_the_manager_takes():
    from kq_mlx.mlx_lm_adapter import attach_exact

    model = evaluated(qwen3_model, seed=8)
    blocks = attach_arena(model, num_slots=EXPERTS // 4)
    manager = _manager_over(blocks, EXPERTS // 4, queue_depth=0)
    for timeout in (np.float32(1), np.int64(2), float("inf"), None):
        attach_exact(model, blocks, manager, timeout=timeout)
        assert all(block.timeout is timeout for block in blocks)
        manager.acquire(0, np.array([[1]]), np.array([[1.0]]), timeout=timeout)  # the manager takes it too
    for timeout in (float("nan"), -1, True, "1"):
        with pytest.raises(ValueError, match="attach_exact: timeout must be None or a number of seconds >= 0"):
            attach_exact(model, blocks, manager, timeout=timeout)
    manager.close()


def test_a_retry_that_times_out_says_so():
    """A missed expert's read fails, and reading it again hangs past the timeout: the error says the read
    again timed out, naming the layer and the expert (not that it failed after every retry)."""
    import threading

    from kq_host.residency import PreloadError
    from kq_mlx.mlx_lm_adapter import generate_greedy

    model = evaluated(qwen3_model, seed=7)
    blocks = attach_arena(model, num_slots=6)
    release, first, lock = threading.Event(), [], threading.Lock()

    def fails_then_hangs(layer, expert, slot):
        with lock:
            failing = not first
            if failing:
                first.append((layer, expert))
        if failing:
            raise OSError("input/output error")
        if (layer, expert) == first[0]:
            release.wait(60)
        return blocks[layer].expert_weights(expert)

    # NumPy's bookkeeping: Numba's first call in a process (loading its cache) can outlast the 0.2 s alone
    manager = ResidencyManager(LAYERS, EXPERTS, 6, loader=fails_then_hangs, arena=SwitchGLUArena(blocks),
                               queue_depth=2, impl="numpy")
    try:
        with pytest.raises(PreloadError) as caught:
            generate_greedy(model, blocks, manager, [2], 2, exact=True, timeout=0.2, read_retries=2)
        layer, expert = first[0]
        # the expert is named once, as still out: its read again is what the timeout cut
        assert str(caught.value) == (f"generate_greedy: acquire: layer {layer}: the reads of experts [{expert}] "
                                     f"still out after 0.2 s")
        assert [(read.layer, read.expert) for read in caught.value.pending] == [(layer, expert)]
        assert caught.value.failed == []
    finally:
        release.set()
        manager.close()


# ---- the compiled layer graphs ------------------------------------------------------------------------------


def _decode_through_arenas(make_model, rule: str, slots: int, *, compiled: bool, steps: int = 6):
    """Greedy decoding through arenas of ``slots`` slots under ``rule``, the boundary after every token (its reads
    drained, so both paths see the same tables); returns each token's logits (uint32 bits), packed reports and
    the blocks' own reports (float32 bits and ids, stacked)."""
    from kq_host.residency import LayerReport
    from kq_mlx.mlx_lm_adapter import attach_tier, pack_reports

    model = evaluated(make_model, seed=7)
    blocks = attach_arena(model, slots)
    if rule == "tier":
        attach_tier(blocks, _tier_of(blocks))
    for block in blocks:
        block.rule, block.compiled = rule, compiled
    manager = _manager_over(blocks, slots)
    for layer in range(LAYERS):
        manager.preload(layer, range(0, EXPERTS, EXPERTS // slots))
    set_tables(blocks, manager.snapshot())
    cache, x, seen = make_prompt_cache(model), mx.array([PROMPT[:5]]), []
    for _ in range(steps):
        logits = model(x, cache=cache)[0, -1]
        packed = pack_reports(blocks)
        mx.eval(logits, packed)
        own = LayerReport.stacked([block.report() for block in blocks])
        seen.append((np.array(logits.astype(mx.float32)).view(np.uint32), np.array(packed),
                     *(np.asarray(getattr(own, name)).view(np.uint32) for name in ("indices", "scores", "miss_ids",
                                                                                   "miss_scores", "served"))))
        manager.step(LayerReport.from_packed(np.array(packed)))
        manager.drain()
        set_tables(blocks, manager.snapshot())
        x = mx.array([[int(mx.argmax(logits).item())]])
    manager.close()
    return seen


COMPILED_CASES = ([pytest.param(qwen3_model, rule, id=f"qwen3_moe-{rule}")
                   for rule in ("route_shed", "shed", "renormalize", "tier")]
                  + [pytest.param(mixtral_model, "route_shed", id="mixtral-route_shed"),
                     pytest.param(_quantized(qwen3_model), "route_shed", id="qwen3_moe-q4-route_shed"),
                     pytest.param(_quantized(qwen3_model), "shed", id="qwen3_moe-q4-shed"),
                     pytest.param(deepseek_v3_model, "shed", id="deepseek_v3-seam-shed"),
                     pytest.param(deepseek_v3_model, "tier", id="deepseek_v3-seam-tier"),
                     pytest.param(_quantized(deepseek_v3_model), "shed", id="deepseek_v3-q4-seam-shed")])


@pytest.mark.parametrize("slots", [EXPERTS, EXPERTS // 4], ids=["full", "quarter"])
@pytest.mark.parametrize("make_model, rule", COMPILED_CASES)
def test_the_compiled_layer_graphs_give_the_uncompiled_bits(make_model, rule, slots):
    """Each arena layer's graph through mx.compile (and the prestage lists ranked once a token in pack_reports)
    against the same ops one by one: every token's logits, packed reports and per-layer reports, bit for bit,
    while the tables change and slots are written between tokens."""
    compiled = _decode_through_arenas(make_model, rule, slots, compiled=True)
    uncompiled = _decode_through_arenas(make_model, rule, slots, compiled=False)
    for got, want in zip(compiled, uncompiled):
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    misses = sum(int((miss_ids.view(np.int32) >= 0).sum()) for _, _, _, _, miss_ids, _, _ in compiled)
    assert (misses > 0) == (slots < EXPERTS), "a quarter arena must miss, a full one never"
    assert all(logits.any() for logits, *_ in compiled)


def test_route_shed_columns_is_the_contract_bit_for_bit(on_cpu):
    """kq_mlx.route_shed_columns compiled at each case's shape on the CPU, where a graph runs it: every golden
    vector and random rows (K from 1 to 64, every dtype, NaN, inf, subnormal and negative scores, ids out of
    range); with ``nonnegative`` the cases whose scores are all >= 0 or NaN (a softmax router's)."""
    from kq.spec import assert_matches, golden_cases, random_cases
    from kq_mlx.route_shed_columns import rank_misses, serve

    def through(nonnegative):
        def route_shed(indices, scores, slot_table, num_slots=None, on_miss="shed"):
            def graph(indices, scores, slot_table):
                slots, mix, miss = serve(indices, scores, slot_table, num_slots=num_slots, on_miss=on_miss,
                                         nonnegative=nonnegative)
                return (slots, mix, *rank_misses(indices, scores, miss))
            return mx.compile(graph)(indices, scores, slot_table)
        return route_shed

    cases = golden_cases() + random_cases(seed=3, rows=1024)
    assert assert_matches(through(False), cases, arrays="mlx").cases == len(cases)
    nonnegative = [case for case in cases if not (case.scores.astype(np.float32) < 0).any()]
    assert 10 < len(nonnegative) < len(cases)
    assert assert_matches(through(True), nonnegative, arrays="mlx").cases == len(nonnegative)


def test_a_compiled_layer_graph_holds_fewer_primitives_than_its_ops_one_by_one(on_cpu):
    """What the compiled path is for: a decode step's MoE layer, routing to combine, is fewer primitives (each a
    task of its own on MLX's CPU stream)."""
    import io

    model = evaluated(qwen3_model, seed=2)
    blocks = attach_arena(model, EXPERTS // 4)
    blocks[0].rule = "route_shed"
    set_tables(blocks, np.tile(np.where(np.arange(EXPERTS) % 4 == 0, np.arange(EXPERTS) // 4, -1), (LAYERS, 1)))
    x = mx.array(np.random.default_rng(2).standard_normal((1, 1, 64)).astype(np.float32))

    def primitives(compiled):
        blocks[0].compiled = compiled
        dot = io.StringIO()
        mx.export_to_dot(dot, blocks[0](x))
        return dot.getvalue().count("shape=rectangle")

    assert 3 * primitives(True) < 2 * primitives(False)


def test_a_new_tier_replaces_the_compiled_graph_that_read_the_old_one():
    """attach_tier again: the compiled pass reads the new tier (the bits of the ops one by one with it), and the
    graph that read the old tier is dropped, not kept beside the new one."""
    from kq_mlx.mlx_lm_adapter import attach_tier

    model = evaluated(qwen3_model, seed=8)
    blocks = attach_arena(model, EXPERTS // 4)
    manager = _manager_over(blocks, EXPERTS // 4)
    for layer in range(LAYERS):
        manager.preload(layer, range(EXPERTS // 4))
    set_tables(blocks, manager.snapshot())
    for block in blocks:
        block.rule = "tier"
    prompt = mx.array([PROMPT[:6]])

    def logits(compiled):
        for block in blocks:
            block.compiled = compiled
        out = model(prompt, cache=make_prompt_cache(model))[0, -1]
        return np.array(out.astype(mx.float32)).view(np.uint32)

    seen = []
    for bits in (4, 3):
        attach_tier(blocks, _tier_of(blocks, bits=bits))
        seen.append(logits(True))
        assert seen[-1].tobytes() == logits(False).tobytes()
        assert all(len(block._graphs) == 1 for block in blocks)
    assert seen[0].tobytes() != seen[1].tobytes(), "the tiers must serve the misses differently"
    manager.close()


def test_the_chunk_bits_job_finds_a_chunk_of_a_pass_in_the_pass_bits_on_the_cpu(on_cpu):
    """``python -m kq.bench.jobs chunk_bits`` on the CPU, where gather_mm computes each entry alone: every entry of
    each chunk has the whole pass's bits in every form (float32, 4-bit, and bfloat16 where the CPU's gather_mm
    takes it: MLX 0.32.4's does not, which the job reports as not run)."""
    from kq.bench.jobs import chunk_bits

    rows = {row["dtype"]: row for row in chunk_bits.run(tokens=20, top_k=4, experts=16, chunk_experts=4, seed=5)}
    for dtype in ("float32", "4-bit"):
        assert rows[dtype]["entries"] == 80
        assert rows[dtype]["entries_differing"] == {"alone": 0, "repeated": 0, "sorted": 0}
    bfloat16 = rows["bfloat16"]["entries_differing"]
    assert bfloat16 == {"alone": 0, "repeated": 0, "sorted": 0} or bfloat16.startswith("not run: [GatherMM")


def test_the_token_parts_job_runs_every_graph_and_both_disks_to_the_models_tokens():
    """``python -m kq.bench.jobs mlx_token_parts`` at its smallest on the shipped wheels-moe: every graph at full
    residency gives the unmodified model's tokens, and so do the exact loop at half residency (with its host
    time by function) and the layer-by-layer loop at full residency."""
    from kq.bench.jobs import mlx_decode, mlx_token_parts

    rows = mlx_token_parts.graphs(rounds=1, tokens=2, warmup=1, variants=[mlx_decode.VARIANTS[2]])
    assert [row["graph"] for row in rows] == list(mlx_token_parts.GRAPHS)
    assert all(row["same_tokens"] and row["tok_s"] > 0 for row in rows)
    exact = mlx_token_parts.exact(residency=0.5, tokens=2, warmup=1, top=3)
    assert [row["loop"] for row in exact] == ["unmodified", "exact", "layer by layer, nothing read"]
    assert exact[0]["same_tokens"] is None and all(row["same_tokens"] for row in exact[1:])
    assert all(row["tok_s"] > 0 for row in exact)
    assert len(exact[1]["host_ms_per_token"]) == 3 and exact[1]["host_ms_per_token"][0]["own"] > 0


def _arena_array(block, key: str) -> mx.array:
    """The ``[slots, ...]`` arena array a payload key names: ``"<projection>"`` (a float weight) or
    ``"<projection>.<array>"``."""
    projection, _, name = key.partition(".")
    return block.arena[projection][name or "weight"]


@pytest.mark.parametrize("make_model", [qwen3_model, _quantized(qwen3_model)], ids=["float", "q4"])
def test_a_slot_takes_a_payload_of_negative_strides(make_model):
    """Every array of a payload viewed backwards (MLX refuses negative strides) is written as its contiguous
    copy would be, by write_slot and write_slots: the slot then holds those bytes."""
    model = evaluated(make_model, seed=6)
    blocks = attach_arena(model, 2)
    arena = SwitchGLUArena(blocks)
    backwards = {key: value[::-1] for key, value in blocks[1].expert_weights(3).items()}
    arena.write_slot(1, 0, backwards)
    assert arena.write_slots(np.array([1]), np.array([1]), [backwards]) == [None]
    for slot in (0, 1):
        for key in backwards:
            array = _arena_array(blocks[1], key)
            got = np.array(array[slot].astype(mx.float32) if mx.issubdtype(array.dtype, mx.floating) else array[slot])
            assert got.tobytes() == np.ascontiguousarray(backwards[key]).tobytes(), (key, slot)


@pytest.mark.parametrize("make_model", [qwen3_model, _quantized(qwen3_model)], ids=["float", "q4"])
def test_write_slots_leaves_what_one_write_after_another_leaves(make_model):
    """A batch over two layers, a slot written twice and a refused payload between, gives the arenas'
    bytes that write_slot called in order gives."""
    model = evaluated(make_model, seed=7)
    batched, one_by_one = attach_arena(model, 3), attach_arena(evaluated(make_model, seed=7), 3)
    layers, slots, experts = np.array([1, 0, 1, 1, 0, 1]), np.array([2, 0, 0, 2, 1, 0]), [3, 1, 4, 0, 2, 5]
    payloads = [batched[layer].expert_weights(expert) for layer, expert in zip(layers.tolist(), experts)]
    payloads[5] = {key: value for key, value in list(payloads[5].items())[1:]}  # refused: an array missing
    errors = SwitchGLUArena(batched).write_slots(layers, slots, payloads)
    assert [error is None for error in errors] == [True] * 5 + [False]
    for layer, slot, payload in zip(layers[:5].tolist(), slots[:5].tolist(), payloads[:5]):
        SwitchGLUArena(one_by_one).write_slot(layer, slot, payload)
    for layer in (0, 1):
        for key in batched[layer].slot_layout():
            got, want = (_arena_array(blocks[layer], key) for blocks in (batched, one_by_one))
            view = mx.uint16 if got.dtype in (mx.bfloat16, mx.float16) else got.dtype
            assert np.array(got.view(view)).tobytes() == np.array(want.view(view)).tobytes(), (layer, key)


def test_the_token_parts_job_checks_every_rounds_tokens(monkeypatch):
    """A graph whose tokens go wrong after its first round is reported (same_tokens False), not only the first
    round's compared."""
    from kq.bench.jobs import mlx_decode, mlx_token_parts

    rounds, real = [], mlx_token_parts.fixed_tables_loop

    def wrong_after_the_first(*args, **kwargs):
        tokens, stamps = real(*args, **kwargs)
        rounds.append(1)
        arena_graphs = len(mlx_token_parts.GRAPHS) - 1  # every graph but the unmodified one runs this loop
        return ([token + 1 for token in tokens] if len(rounds) > arena_graphs else tokens), stamps
    monkeypatch.setattr(mlx_token_parts, "fixed_tables_loop", wrong_after_the_first)
    rows = mlx_token_parts.graphs(rounds=2, tokens=1, warmup=1, variants=[mlx_decode.VARIANTS[0]])
    assert [row["same_tokens"] for row in rows] == [True] + [False] * (len(mlx_token_parts.GRAPHS) - 1)


def _wide_qwen3_model():
    """Qwen3-MoE with 3 MiB float32 experts (hidden 256, expert width 1024): arenas large enough to see a copy."""
    return qwen3_model(hidden_size=256, moe_intermediate_size=1024)


def _exact_loop_peaks() -> dict:
    """MLX's peak memory over the start of the exact loop on wide-expert arenas of 8 slots, serial and
    overlapped, its tokens, and one layer's arena bytes (run in a fresh process: what a write copies
    depends on the arrays that earlier work in the process left)."""
    from kq_mlx.mlx_lm_adapter import generate_greedy

    peaks, outputs = {}, {}
    for overlap in (False, True):
        model = evaluated(_wide_qwen3_model, seed=7)
        blocks = attach_arena(model, num_slots=8)
        stacked = [block.stacked_expert_weights() for block in blocks]
        manager = ResidencyManager(LAYERS, EXPERTS, 8, arena=SwitchGLUArena(blocks), queue_depth=0,
                                   loader=lambda l, e, s: {k: v[e].copy() for k, v in stacked[l].items()})
        mx.eval([block.arena.parameters() for block in blocks])
        mx.synchronize()
        mx.reset_peak_memory()
        start = mx.get_active_memory()
        outputs[str(overlap)] = generate_greedy(model, blocks, manager, [2, 7, 1, 8], 24, overlap=overlap, exact=True)
        mx.synchronize()
        peaks[str(overlap)] = mx.get_peak_memory() - start
        manager.close()
    arena_bytes = sum(array.nbytes for projection in blocks[0].arena.children().values()
                      for array in projection.values() if isinstance(array, mx.array))
    return dict(peaks=peaks, outputs=outputs, arena_bytes=arena_bytes)


def test_a_token_that_runs_again_lets_go_of_the_token_built_on_it_before_any_slot_is_written():
    """The overlapped exact loop builds the next token on this one before reading it; when this one missed,
    that token goes before the boundary's and the run again's slot writes (its entries in the caches, there
    still once the caches are cut back, computed first), so the writes update the arenas' arrays in place:
    MLX's peak memory within one layer's arena (24 MiB) of the serial loop's. Its graph kept made every
    array written copy (57 against 24 MiB over the start, in a fresh process)."""
    import json
    import os
    import pathlib
    import subprocess
    import sys

    here = pathlib.Path(__file__).parent
    script = "import json, test_mlx_lm; print(json.dumps(test_mlx_lm._exact_loop_peaks()))"
    run = subprocess.run([sys.executable, "-c", script], cwd=here, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": f"{here}:{here.parent}"})
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    peaks, arena_bytes = result["peaks"], result["arena_bytes"]
    assert result["outputs"]["True"] == result["outputs"]["False"]
    assert peaks["True"] <= peaks["False"] + arena_bytes, (peaks, arena_bytes)


# ---- arguments the adapter refuses by name ------------------------------------------------------------------


@pytest.mark.parametrize("num_slots", [EXPERTS + 1, 2**30, 2**33])
def test_attach_arena_refuses_more_slots_than_a_layer_has_experts(num_slots):
    model = evaluated(qwen3_model, seed=3)
    with pytest.raises(ValueError, match=rf"attach_arena: num_slots must be an int in \[1, {EXPERTS}\]"):
        attach_arena(model, num_slots)
    assert len(attach_arena(model, EXPERTS)) == LAYERS  # refused before any layer was replaced


@pytest.mark.parametrize("columns", [EXPERTS - 1, EXPERTS - 8, EXPERTS + 1])
def test_set_tables_refuses_a_table_of_another_width(columns):
    model = evaluated(qwen3_model, seed=3)
    blocks = attach_arena(model, 4)
    tables = np.full((LAYERS, columns), -1, np.int32)
    tables[:, :4] = np.arange(4)
    with pytest.raises(ValueError, match=rf"set_tables: tables must be int \[L, E\] with L = {LAYERS} blocks and "
                                         rf"E = {EXPERTS} experts, got shape \({LAYERS}, {columns}\)"):
        set_tables(blocks, tables)


def test_attach_tier_refuses_a_tier_of_other_widths_or_no_tier():
    from kq_mlx.mlx_lm_adapter import attach_tier

    model = evaluated(qwen3_model, seed=3)
    blocks = attach_arena(model, 4)
    other = evaluated(lambda: qwen3_model(moe_intermediate_size=64), seed=3)
    other_blocks = attach_arena(other, 4)
    wider = tier_of(other_blocks, lambda block, e: block.expert_weights(e), experts=EXPERTS, bits=4)
    with pytest.raises(ValueError, match=r"attach_tier: the tier's gate_proj experts are \[64, 64\] \(out, in\), "
                                         r"layer 0's \[32, 64\]"):
        attach_tier(blocks, wider)
    assert all(block.tier is None for block in blocks)
    for tier in (None, "tier", {"gate_proj": None}):
        with pytest.raises(ValueError, match=r"attach_tier: the tier must be a kq_host.tier.Tier"):
            attach_tier(blocks, tier)


def test_generate_greedy_and_prefill_refuse_blocks_of_another_model():
    from kq_mlx.mlx_lm_adapter import generate_greedy, prefill

    model = evaluated(qwen3_model, seed=7)
    blocks = attach_arena(model, num_slots=6)
    manager = _manager_over(blocks, 6, queue_depth=0)
    plain = evaluated(qwen3_model, seed=7)
    copy_with_arenas = evaluated(qwen3_model, seed=7)
    attach_arena(copy_with_arenas, num_slots=6)
    for other in (plain, copy_with_arenas):
        with pytest.raises(ValueError, match=r"generate_greedy: blocks must be attach_arena\(model\)'s layers"):
            generate_greedy(other, blocks, manager, [2, 7], 2)
        with pytest.raises(ValueError, match=r"prefill: blocks must be attach_arena\(model\)'s layers"):
            prefill(other, blocks, manager, [2, 7], make_prompt_cache(other))
    assert manager.stats()[1].lookups == 0
    manager.close()


def test_stop_tokens_may_be_an_array_of_ids_but_not_a_scalar():
    from kq_mlx.mlx_lm_adapter import generate_greedy

    model = evaluated(qwen3_model, seed=7)
    blocks = attach_arena(model, num_slots=EXPERTS)
    manager = _manager_over(blocks, EXPERTS, queue_depth=0)
    manager.preload(0, range(EXPERTS))
    manager.preload(1, range(EXPERTS))
    tokens = generate_greedy(model, blocks, manager, [2, 7], 4)
    for stop in (np.array([tokens[1]]), mx.array([tokens[1]]), [tokens[1]], np.array([tokens[1]], dtype=object)):
        assert generate_greedy(model, blocks, manager, [2, 7], 4, stop_tokens=stop) == tokens[:2]
    for none in (np.array([]), mx.array([]), np.array([], np.int64), ()):
        assert generate_greedy(model, blocks, manager, [2, 7], 4, stop_tokens=none) == tokens
    for stop in (np.array(tokens[1]), mx.array(tokens[1]), np.array([[tokens[1]]]), np.array([1.0]),
                 np.array([tokens[1], 1.5], dtype=object)):
        with pytest.raises(ValueError, match=r"generate_greedy: stop_tokens must be a collection of token ids"):
            generate_greedy(model, blocks, manager, [2, 7], 4, stop_tokens=stop)
    manager.close()
