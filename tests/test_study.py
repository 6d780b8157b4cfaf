"""kq study on the shipped model: through a full arena it is the resident model, bit for bit; shedding costs."""

import dataclasses
import json

import numpy as np
import pytest

pytest.importorskip("jax")
pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")

from kq.study import SHIPPED_MODEL, StudyConfig  # noqa: E402
from kq.study_runner import make_study  # noqa: E402
from tiny_models import write_mixtral  # noqa: E402


def _framework(name):
    if name == "mlx":
        pytest.importorskip("mlx_lm")
    return name


@pytest.fixture(scope="module", params=["jax", "mlx"])
def study(request):
    return make_study(StudyConfig(tokens=12, warmup=4, framework=_framework(request.param)))


def test_full_residency_through_the_arena_is_the_resident_model_to_the_bit(study):
    resident = study.resident()
    streamed = study.run(1.0, "lfu", "route_shed")
    assert streamed.bits == resident.bits and streamed.perplexity == resident.perplexity
    config = json.loads((SHIPPED_MODEL / "config.json").read_text())
    assert streamed.hits == streamed.lookups == 12 * config["num_hidden_layers"] * config["num_experts_per_tok"]
    assert np.isfinite(resident.perplexity) and resident.perplexity > 1


def test_stall_is_exact_and_pays_its_misses_on_the_critical_path(study):
    stall = study.run(0.125, "lru", "stall")
    assert stall.bits == study.resident().bits
    assert stall.critical_reads == stall.lookups - stall.hits > 0


def test_the_tier_at_full_residency_is_the_resident_model_to_the_bit(study):
    if "tier" not in study.rules:
        pytest.skip("the tier rule runs in the JAX study")
    assert study.run(1.0, "lfu", "tier").bits == study.resident().bits


def test_the_tier_serves_misses_at_less_cost_than_shedding(study):
    if "tier" not in study.rules:
        pytest.skip("the tier rule runs in the JAX study")
    resident, tier, shed = study.resident(), study.run(0.25, "lfu", "tier"), study.run(0.25, "lfu", "shed")
    assert tier.hits < tier.lookups and tier.reads > 0  # misses happen and are still prestaged
    assert tier.shed_mass == 0.0  # every miss served by its tier copy
    assert abs(tier.bits - resident.bits) < abs(shed.bits - resident.bits)
    slots_only = shed.memory_bytes
    assert slots_only < tier.memory_bytes < resident.memory_bytes  # the arena plus a 3-bit copy of every expert


@pytest.mark.parametrize("rule", ["route_shed", "shed", "renormalize", "substitute"])
def test_a_small_arena_sheds_and_reads(study, rule):
    run = study.run(0.125, "lfu", rule)
    assert run.hits < run.lookups and run.reads > 0 and run.bytes_read > 0
    assert run.bits != study.resident().bits
    if rule == "substitute":
        assert run.shed_mass < 0.5 * run.routed_mass  # most misses find a resident stand-in
    else:
        assert run.shed_mass > 0


def test_the_shipped_model_is_a_qwen3_moe_that_learned():
    config = json.loads((SHIPPED_MODEL / "config.json").read_text())
    record = json.loads((SHIPPED_MODEL / "training.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["norm_topk_prob"] is False
    assert config["num_experts"] >= 64 and config["num_experts_per_tok"] == 8 and config["num_hidden_layers"] >= 4
    assert (SHIPPED_MODEL / "model.safetensors").stat().st_size <= 16 * 2**20
    bpb = record["heldout_bits_per_byte"]
    assert bpb["model"] < bpb["bigram"] < bpb["unigram"]
    for layer in record["routing"]["layers"]:
        assert layer["load_entropy_bits"] > 4.5  # not collapsed (6 is even over 64 experts)
        assert layer["reuse"] > record["routing"]["independent_reuse"]


def test_mlx_lm_loads_and_generates_the_shipped_model():
    pytest.importorskip("mlx_lm")
    import mlx.core as mx
    from mlx_lm import generate, load

    model, tokenizer = load(str(SHIPPED_MODEL))
    if not mx.metal.is_available():
        model.set_dtype(mx.float32)  # MLX's CPU gather_mm takes float32 only
    text = generate(model, tokenizer, prompt="def main():\n    ", max_tokens=12)
    assert isinstance(text, str) and len(text) > 0


def test_study_refuses_a_directory_without_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="--checkpoint"):
        StudyConfig(checkpoint=tmp_path)


def test_the_jax_model_reads_the_files_as_mlx_lm_does():
    pytest.importorskip("mlx_lm")
    import jax.numpy as jnp
    import mlx.core as mx
    from mlx_lm import load

    from kq_jax import qwen3_moe

    model, tokenizer = load(str(SHIPPED_MODEL))
    model.set_dtype(mx.float32)
    ids = tokenizer.encode("import os\n\ndef walk(top):\n    for name in os.listdir(top):")
    want = np.array(model(mx.array([ids])))
    cfg = qwen3_moe.Qwen3MoeConfig.load(SHIPPED_MODEL)

    def resident(p, x, c):
        return qwen3_moe.moe_resident(p, x, c), 0.0

    got, _ = qwen3_moe.forward(qwen3_moe.load_params(SHIPPED_MODEL, cfg), jnp.asarray([ids]), cfg, moe=resident)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-4, rtol=2e-4)
    assert (np.asarray(got).argmax(-1) == want.argmax(-1)).all()


@pytest.fixture(scope="module")
def mixtral_checkpoint(tmp_path_factory):
    """A tiny random Mixtral in the Hugging Face layout (one tensor per expert: w1, w2, w3), the shipped tokenizer."""
    pytest.importorskip("mlx_lm")
    return write_mixtral(tmp_path_factory.mktemp("mixtral"), seed=3, files=("tokenizer.json", "tokenizer_config.json", "heldout.txt"))


def test_mixtral_checkpoints_run_through_mlx_lm(mixtral_checkpoint):
    study = make_study(StudyConfig(checkpoint=mixtral_checkpoint, tokens=10, warmup=3, framework="mlx",
                                   rules=("route_shed",)))  # its 16-wide experts take no tier of 32-wide groups
    assert "substitute" not in study.rules
    resident = study.resident()
    assert study.run(1.0, "lfu", "route_shed").bits == resident.bits
    small = study.run(0.25, "lru", "route_shed")
    assert small.hits < small.lookups and small.reads > 0 and small.bits != resident.bits


def test_the_jax_model_refuses_a_mixtral_checkpoint(mixtral_checkpoint):
    with pytest.raises(ValueError, match="--framework mlx"):
        make_study(StudyConfig(checkpoint=mixtral_checkpoint, tokens=10, warmup=3, framework="jax"))


def test_the_grid_runs_every_rule_at_full_residency_once():
    from kq.study import RULES, grid

    config = StudyConfig(residencies=(1.0, 0.5), policies=("lfu", "lru"))
    runs = grid(config)
    arena_rules = [rule for rule in RULES if rule != "uniform"]
    assert [(p, r) for x, p, r in runs if x == 1.0] == [("lfu", rule) for rule in arena_rules]
    assert len([run for run in runs if run[0] == 0.5]) == 2 * len(arena_rules)
    assert runs[-1] == (0.0, "-", "uniform")  # no arena: once


def test_renormalize_changes_the_output_with_every_expert_resident(study):
    """With norm_topk_prob false a row's routed mass is below 1: scaling it to 1 is a cost with no miss."""
    assert study.run(1.0, "lfu", "renormalize").bits != study.resident().bits


def _scored(bits):
    from kq.study import RunResult

    result = RunResult(1.0, 64, "lfu", "shed", len(bits), 0.0, 100)
    for value in bits:
        result.score(float(value))
    return result


def test_the_interval_is_paired_by_token_and_exact_for_a_constant_gap():
    from kq.study import paired_interval

    rng = np.random.default_rng(0)
    resident_bits = rng.gamma(2.0, 2.0, size=256)
    resident = _scored(resident_bits)
    assert paired_interval(_scored(resident_bits), resident) == (0.0, 0.0)
    low, high = paired_interval(_scored(resident_bits + 0.01), resident)  # the same 0.01 bit on every token
    assert low == pytest.approx(2**0.01 - 1, rel=1e-9) and high == pytest.approx(2**0.01 - 1, rel=1e-9)
    noisy = _scored(resident_bits + 0.01 + rng.normal(0, 0.5, size=256))
    low, high = paired_interval(noisy, resident)
    assert low < noisy.perplexity / resident.perplexity - 1 < high and high - low > 0.01
    assert all(np.isnan(paired_interval(_scored(resident_bits[:100]), _scored(resident_bits[:100]))))


def test_the_table_and_the_json_carry_the_interval(study, tmp_path):
    from kq.study import format_table, write_json

    resident = study.resident()
    shed = study.run(0.25, "lfu", "shed")
    assert len(shed.token_bits) == len(resident.token_bits) == 12
    assert "95% interval" in format_table(resident, [shed])
    path = tmp_path / "study.json"
    write_json(study.config, resident, [shed], path)
    assert len(json.loads(path.read_text())["runs"][0]["interval_95"]) == 2


@pytest.mark.parametrize("rule", ["reroute", "prior"])
def test_cache_aware_routing_is_the_model_at_full_residency_and_reroutes_below_it(rule):
    study = make_study(StudyConfig(tokens=12, warmup=4, framework="jax"))
    resident = study.resident()
    assert study.run(1.0, "lfu", rule).bits == resident.bits
    small = study.run(0.25, "lfu", rule)
    shed = study.run(0.25, "lfu", "shed")
    assert small.bits != resident.bits and np.isfinite(small.perplexity) and small.bits != shed.bits


def test_cache_aware_routing_picks_resident_experts():
    import jax.numpy as jnp

    from kq_jax.arena_moe import serve

    probs = jnp.asarray([[0.30, 0.20, 0.15, 0.12, 0.10, 0.08, 0.05]], jnp.float32)  # experts 0..6, best first
    indices = jnp.asarray([[0, 1, 2, 3]], jnp.int32)  # k = 4
    table = jnp.asarray([-1, 0, -1, -1, 1, 2, 3], jnp.int32)  # 1, 4, 5, 6 resident

    def _cache_aware(rule, indices, probs, table, normalize):
        return serve(rule, indices, None, probs, table, None, normalize=normalize, num_slots=4)

    slots, mix = _cache_aware("reroute", indices, probs, table, normalize=False)
    # experts 0 and 1 kept (0 shed: not resident); the rest from the top 8 resident not chosen: 4, 5
    assert slots.tolist() == [[0, 0, 1, 2]] and np.allclose(mix, [[0.0, 0.20, 0.10, 0.08]])
    slots, mix = _cache_aware("prior", indices, probs, table, normalize=False)
    # log p + 1 for 1, 4, 5, 6: ranking 1 (0.2e), 0 (0.30), 4 (0.1e), 5 (0.08e); expert 0 shed
    assert slots.tolist() == [[0, 0, 1, 2]] and np.allclose(mix, [[0.20, 0.0, 0.10, 0.08]])


def test_the_uniform_baseline_serves_every_expert_from_the_tier():
    study = make_study(StudyConfig(tokens=12, warmup=4, framework="jax"))
    uniform = study.run(0.0, "-", "uniform")
    tier = study.run(0.25, "lfu", "tier")
    assert uniform.hits == 0 and uniform.lookups == tier.lookups and uniform.reads == 0
    assert 0 < uniform.memory_bytes < tier.memory_bytes and uniform.bits != study.resident().bits
    assert np.isfinite(uniform.perplexity)


def test_rules_jax_runs_alone_are_refused_for_mlx_by_name():
    from kq.study import JAX_ONLY_RULES

    _framework("mlx")
    with pytest.raises(ValueError, match="--rules.*reroute.*JAX only"):
        StudyConfig(framework="mlx", rules=("shed", "reroute"))
    assert not set(StudyConfig(framework="mlx").rules) & set(JAX_ONLY_RULES)
    assert set(JAX_ONLY_RULES) <= set(StudyConfig().rules)


@pytest.fixture(scope="module")
def streamed():
    return make_study(StudyConfig(tokens=8, warmup=4, streams=3, framework="jax"))


def test_streams_at_full_residency_and_stalling_are_the_resident_model_to_the_bit(streamed):
    resident = streamed.resident()
    assert len(resident.token_bits) == 3 * 8 and resident.window == 8
    assert streamed.run(1.0, "lfu", "shed").token_bits == resident.token_bits
    stall = streamed.run(0.125, "lfu", "stall")
    assert stall.token_bits == resident.token_bits
    assert stall.critical_reads == stall.lookups - stall.hits > 0


def test_streams_serve_misses_from_the_tier_and_at_full_residency_are_the_resident_model(streamed):
    resident = streamed.resident()
    assert streamed.run(1.0, "lfu", "tier").token_bits == resident.token_bits
    tier, shed = streamed.run(0.25, "lfu", "tier"), streamed.run(0.25, "lfu", "shed")
    assert tier.hits < tier.lookups and tier.shed_mass == 0.0 < shed.shed_mass
    assert tier.token_bits != shed.token_bits and tier.memory_bytes > shed.memory_bytes
    uniform = streamed.run(0.0, "-", "uniform")
    assert uniform.hits == 0 < uniform.lookups and len(uniform.token_bits) == 3 * 8
    assert uniform.token_bits != resident.token_bits


def test_the_first_stream_is_the_text_decoded_alone(streamed):
    """Each stream has its own arena: stream 0 reads the text's first window, as a single-stream run
    does, with the same hits; its bits agree to float32 rounding (a batch of 3 rounds otherwise)."""
    alone = make_study(StudyConfig(tokens=8, warmup=4, framework="jax")).run(0.25, "lfu", "shed")
    together = streamed.run(0.25, "lfu", "shed")
    assert together.hits < together.lookups  # the case sheds
    # every layer looks up as many entries a token: the layers' mean hit rate is the run's
    for run in (alone, together):
        assert len(run.layer_hit_rates) == 4 and min(run.layer_hit_rates) < 1.0
        assert np.mean(run.layer_hit_rates) == pytest.approx(run.hits / run.lookups, rel=1e-12)
    np.testing.assert_allclose(together.token_bits[:8], alone.token_bits, rtol=0, atol=1e-4)
    assert abs(together.token_bits[8] - alone.token_bits[0]) > 1e-3  # the second stream is another window


@pytest.mark.parametrize("streams, framework, message", [(0, "jax", "--streams"), (2.0, "jax", "--streams"),
                                                         (2, "mlx", "JAX only")])
def test_bad_streams_are_refused_by_name(streams, framework, message):
    with pytest.raises(ValueError, match=message):
        StudyConfig(streams=streams, framework=framework)


def test_more_streams_than_the_text_holds_is_refused_naming_streams():
    with pytest.raises(ValueError, match="--streams"):
        make_study(StudyConfig(tokens=512, warmup=64, streams=10_000, framework="jax"))


# ---- windows within the length the checkpoint was trained on ----------------------------------------


def test_the_shipped_models_were_trained_on_256_token_sequences_and_the_default_scores_within_them():
    from kq.study import trained_length, window_plan

    for name in ("stdlib-moe", "wheels-moe"):
        assert trained_length(SHIPPED_MODEL.parent / name) == 256
    config = StudyConfig()
    assert (config.tokens, config.warmup) == (256, 64)
    assert window_plan(config) == [(0, 192), (192, 64)]  # warm-up 64 + scored 192 = 256 positions at most
    assert window_plan(StudyConfig(long_context=True)) == [(0, 256)]  # positions 64-319, past 256
    assert window_plan(StudyConfig(tokens=512)) == [(0, 192), (192, 192), (384, 128)]


@pytest.fixture(scope="module")
def short_trained(tmp_path_factory):
    """The shipped model, recorded as trained on 8-token sequences: windows of 4 warm-up and 4 scored tokens."""
    directory = tmp_path_factory.mktemp("short")
    for path in SHIPPED_MODEL.iterdir():
        if path.name != "training.json":
            (directory / path.name).symlink_to(path)
    (directory / "training.json").write_text(json.dumps({"args": {"seq": 8}}))
    return directory


@pytest.mark.parametrize("framework", ["jax", "mlx"])
def test_windows_restart_the_context_and_the_arena_and_each_is_the_text_decoded_alone(short_trained, framework,
                                                                                     tmp_path):
    from kq.study import window_plan

    config = StudyConfig(checkpoint=short_trained, tokens=10, warmup=4, framework=_framework(framework))
    assert window_plan(config) == [(0, 4), (4, 4), (8, 2)]
    windowed = make_study(config)
    resident = windowed.resident()
    assert len(resident.token_bits) == resident.tokens == 10 and (resident.windows, resident.context) == (3, 8)
    long = make_study(dataclasses.replace(config, long_context=True)).resident()
    assert (long.windows, long.context) == (1, 14)
    assert long.token_bits[:4] == resident.token_bits[:4]  # the first window: the same context
    assert long.token_bits[4:] != resident.token_bits[4:]  # later tokens lose the context before their window
    for offset, scored in window_plan(config)[1:]:  # each window is its text decoded from position 0
        alone = make_study(StudyConfig(checkpoint=SHIPPED_MODEL, text=_text_file(windowed.tokens[offset:], 4 + scored + 1, tmp_path / f"{offset}.txt"),
                                       tokens=scored, warmup=4, framework=framework)).resident()
        assert alone.token_bits == resident.token_bits[offset:offset + scored]
    full = windowed.run(1.0, "lfu", "route_shed")
    assert full.token_bits == resident.token_bits
    assert full.hits == full.lookups == 10 * windowed_layers() * 8  # every window's arena starts full
    small = windowed.run(0.125, "lfu", "stall")
    assert small.token_bits == resident.token_bits and small.critical_reads == small.lookups - small.hits > 0


def windowed_layers():
    return json.loads((SHIPPED_MODEL / "config.json").read_text())["num_hidden_layers"]


def _text_file(ids, length, path):
    """A text file whose first ``length`` tokens are ``ids``' (the tokenizer's decode round-trips here)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(SHIPPED_MODEL / "tokenizer.json"))
    ids = ids.tolist()
    path.write_text(tokenizer.decode(ids))
    assert tokenizer.encode(path.read_text()).ids[:length] == ids[:length]
    return path


def test_streams_decode_their_windows_round_by_round(short_trained):
    config = StudyConfig(checkpoint=short_trained, tokens=8, warmup=4, streams=2, framework="jax")
    study = make_study(config)
    resident = study.resident()
    assert len(resident.token_bits) == 16 and resident.window == 8 and resident.windows == 2
    alone = make_study(dataclasses.replace(config, streams=1)).resident()
    np.testing.assert_allclose(resident.token_bits[:8], alone.token_bits, rtol=0, atol=1e-4)  # stream 0
    assert study.run(1.0, "lfu", "shed").token_bits == resident.token_bits
    stall = study.run(0.125, "lfu", "stall")
    assert stall.token_bits == resident.token_bits and stall.critical_reads == stall.lookups - stall.hits > 0


def test_the_table_says_whether_the_windows_stay_within_the_trained_length(short_trained):
    from kq.study import format_table

    study = make_study(StudyConfig(checkpoint=short_trained, tokens=6, warmup=4, residencies=(0.5,),
                                   rules=("shed",), policies=("lfu",)))
    resident = study.resident()
    text = format_table(resident, [study.run(0.5, "lfu", "shed")])
    assert "within the 8-token sequences the checkpoint was trained on" in text
    long = make_study(StudyConfig(checkpoint=short_trained, tokens=6, warmup=4, long_context=True))
    assert "LONG CONTEXT" in format_table(long.resident(), [])


@pytest.mark.parametrize("warmup", [8, 9])
def test_a_warmup_that_fills_the_trained_length_is_refused_naming_warmup(short_trained, warmup):
    with pytest.raises(ValueError, match="--warmup.*8-token"):
        StudyConfig(checkpoint=short_trained, tokens=4, warmup=warmup)
    assert StudyConfig(checkpoint=short_trained, tokens=4, warmup=warmup, long_context=True).long_context
