"""kq_mlx.load: an mlx-lm model whose experts stream through an arena, run by mlx-lm's own entry points.

Under rule "exact" a seeded sampler gives the unmodified model's tokens at a quarter of the experts
(``mlx_lm.generate``, ``stream_generate`` with a sampler and logits processors, a prompt cache reused over
two chat turns), on both shipped models and tiny random DeepSeek-V3 and gpt-oss checkpoints (gpt-oss with a
sliding window the decoding runs past).
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
from mlx_lm import stream_generate  # noqa: E402
from mlx_lm import load as mlx_lm_load  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from mlx_lm.sample_utils import make_logits_processors, make_sampler  # noqa: E402

from kq_host.memory_plan import MemoryPlanError, parse_size, plan_memory  # noqa: E402
from kq_mlx.load import LoadError, load, stream_of  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STDLIB, WHEELS = ROOT / "models" / "stdlib-moe", ROOT / "models" / "wheels-moe"


def write_tiny(directory: Path, family: str) -> Path:
    """A tiny random checkpoint of ``family`` (16 experts, top-4), saved by mlx-lm with the shipped tokenizer."""
    import importlib

    from mlx_lm.utils import save_config, save_model

    module = importlib.import_module(f"mlx_lm.models.{family}")
    common = dict(vocab_size=4096, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  num_experts_per_tok=4, rms_norm_eps=1e-6, rope_theta=10000.0)
    own = {
        "deepseek_v3": dict(intermediate_size=96, moe_intermediate_size=32, n_shared_experts=1, n_routed_experts=16,
                            routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
                            v_head_dim=16, qk_nope_head_dim=16, topk_method="noaux_tc", scoring_func="sigmoid",
                            norm_topk_prob=True, n_group=2, topk_group=1, moe_layer_freq=1, first_k_dense_replace=1,
                            max_position_embeddings=512, rope_scaling=None, attention_bias=False),
        "gpt_oss": dict(intermediate_size=32, num_local_experts=16, head_dim=16, sliding_window=6,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    }[family]
    mx.random.seed(11)
    args = module.ModelArgs.from_dict({"model_type": family, **common, **own})
    model = module.Model(args)
    for name, module_ in model.named_modules():  # mlx-lm starts some routers at zero: every token alike
        if name.endswith("mlp.gate") or name.endswith("mlp.router"):
            module_.weight = mx.random.normal(module_.weight.shape)
    mx.eval(model.parameters())
    directory.mkdir(parents=True, exist_ok=True)
    save_model(directory, model)
    save_config({**dataclasses.asdict(args), "model_type": family}, directory / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(STDLIB / name, directory / name)
    return directory


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {family: write_tiny(root / family, family) for family in ("deepseek_v3", "gpt_oss")}


def reference(path: Path):
    """The unmodified model as mlx-lm loads it, in the dtype kq_mlx.load runs it in on this backend."""
    import mlx.nn as nn

    model, tokenizer = mlx_lm_load(str(path))
    quantized = any(isinstance(m, nn.QuantizedLinear) or type(m).__name__ == "QuantizedSwitchLinear"
                    for m in model.modules())
    if mx.default_device() == mx.cpu and not quantized:
        model.set_dtype(mx.float32)
    return model, tokenizer


def sampled(model, tokenizer, prompt, *, seed: int, max_tokens: int, **kwargs) -> list[int]:
    mx.random.seed(seed)
    sampler = make_sampler(0.9, top_p=0.95, top_k=40)
    return [response.token for response in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens,
                                                           sampler=sampler, **kwargs)]


MODELS = [pytest.param("stdlib", id="stdlib-moe"), pytest.param("wheels", id="wheels-moe"),
          pytest.param("deepseek_v3", id="tiny-deepseek_v3"), pytest.param("gpt_oss", id="tiny-gpt_oss")]


def model_path(name: str, tiny_models) -> Path:
    return {"stdlib": STDLIB, "wheels": WHEELS}.get(name) or tiny_models[name]


@pytest.mark.parametrize("name", MODELS)
def test_a_seeded_sampler_gives_the_unmodified_models_tokens_at_a_quarter(name, tiny_models):
    path = model_path(name, tiny_models)
    plain, tokenizer = reference(path)
    prompt = "import os\n\ndef read_config(path):" if name in ("stdlib", "wheels") else [5, 9, 17, 33, 65, 129, 7]
    # The gpt-oss window is 6 positions: 7 prompt tokens and 14 generated run past it.
    want = sampled(plain, tokenizer, prompt, seed=4, max_tokens=14,
                   logits_processors=make_logits_processors(repetition_penalty=1.1))
    model, tokenizer = load(path, residency=0.25)
    stream = stream_of(model)
    got = sampled(model, tokenizer, prompt, seed=4, max_tokens=14,
                  logits_processors=make_logits_processors(repetition_penalty=1.1))
    assert got == want
    figures = stream.stats()
    assert figures["reads"] > 0 and figures["slots"] == max(1, round(0.25 * stream.plan.num_experts))
    assert 0 < figures["hit_rate"] < 1
    stream.close()


def test_mlx_lm_generate_gives_the_same_text(tiny_models):
    from mlx_lm import generate

    plain, tokenizer = reference(WHEELS)
    mx.random.seed(1)
    want = generate(plain, tokenizer, "class Wheel:", max_tokens=12, sampler=make_sampler(0.7, min_p=0.05))
    model, tokenizer = load(WHEELS, residency=0.25)
    mx.random.seed(1)
    assert generate(model, tokenizer, "class Wheel:", max_tokens=12, sampler=make_sampler(0.7, min_p=0.05)) == want
    stream_of(model).close()


def chat(model, tokenizer, turns: list[str]) -> list[list[int]]:
    """Two turns as mlx_lm.chat runs them: one prompt cache, each turn's new text fed on top of it."""
    cache = make_prompt_cache(model)
    replies = []
    for turn in turns:
        prompt = tokenizer.encode(turn)
        replies.append([r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=8, prompt_cache=cache,
                                                         sampler=make_sampler(0.0))])
    return replies


def test_two_chat_turns_on_a_reused_prompt_cache(tiny_models):
    plain, tokenizer = reference(STDLIB)
    turns = ["def add(a, b):", "\nclass Stack:"]
    want = chat(plain, tokenizer, turns)
    model, tokenizer = load(STDLIB, residency=0.25)
    assert chat(model, tokenizer, turns) == want
    stream_of(model).close()


@pytest.mark.parametrize("rule", ["shed", "tier"])
def test_the_lossy_rules_run_through_mlx_lm_and_report_their_misses(rule, tmp_path, monkeypatch):
    monkeypatch.setenv("KQ_CACHE_DIR", str(tmp_path))
    model, tokenizer = load(WHEELS, residency=0.25, rule=rule, **({"tier_bits": 2} if rule == "tier" else {}))
    stream = stream_of(model)
    tokens = sampled(model, tokenizer, "def parse(text):", seed=0, max_tokens=10)
    assert len(tokens) == 10
    assert stream.stats()["passes"] >= 10 and stream.manager.stats()[1].lookups > 0
    if rule == "tier":
        assert stream.tier_bytes > 0
    stream.close()


def test_full_residency_gives_the_unmodified_models_bits_and_reads_each_expert_once():
    plain, tokenizer = reference(STDLIB)
    model, _ = load(STDLIB, residency=1.0)
    cache_a, cache_b = make_prompt_cache(plain), make_prompt_cache(model)
    x = mx.array([tokenizer.encode("import sys")])
    for _ in range(3):
        want, got = plain(x, cache=cache_a)[0, -1], model(x, cache=cache_b)[0, -1]
        assert np.array_equal(np.array(got).view(np.uint32), np.array(want).view(np.uint32))
        x = mx.argmax(want)[None, None]
    stream = stream_of(model)
    reads = stream.manager.stats()[1].reads_landed
    assert reads <= stream.plan.num_layers * stream.plan.num_experts
    stream.close()


def test_a_budget_in_bytes_sizes_the_arena_and_a_small_one_is_refused():
    model, _ = load(WHEELS, memory="64MiB", context=256)
    plan = stream_of(model).plan
    assert plan.budget == 64 * 2**20 and plan.total <= plan.budget
    assert plan.slots == min(plan.num_experts, (plan.budget - plan.other - plan.kv_cache) //
                             (plan.num_layers * plan.expert))
    stream_of(model).close()
    with pytest.raises(LoadError, match=r"memory: .*smallest budget that works is"):
        load(WHEELS, memory="1MiB")


def test_bad_arguments_are_named():
    for kwargs, name in (({"rule": "fast"}, "rule"), ({"memory": "lots"}, "memory"), ({"residency": 0}, "residency"),
                         ({"memory": "1GiB", "residency": 0.5}, "memory/residency"),
                         ({"rule": "exact", "tier_bits": 2}, "tier_bits"), ({"queue_depth": -1}, "queue_depth"),
                         ({"context": 0}, "context")):
        with pytest.raises(LoadError, match=f"^{name}"):
            load(WHEELS, **kwargs)
    with pytest.raises(LoadError, match="^path"):
        load(ROOT / "docs")
    with pytest.raises(ValueError, match="stream_of"):
        stream_of(object())


def test_sizes_parse_in_decimal_and_binary_units():
    assert parse_size("8GiB") == 8 * 2**30 and parse_size("8 GB") == 8 * 10**9 and parse_size(512) == 512
    assert parse_size("1.5mib") == int(1.5 * 2**20)
    for bad in ("8 parsecs", "-1GB", 0, "nan", None, True):
        with pytest.raises(MemoryPlanError, match="^memory"):
            parse_size(bad)


def test_the_plan_splits_what_is_left_evenly_over_the_layers():
    plan = plan_memory(other=1000, expert=10, num_layers=4, num_experts=8, top_k=2, kv_cache=100, tier=0,
                       memory=1100 + 4 * 10 * 5 + 39)
    assert plan.slots == 5 and plan.arena == 200 and plan.total == 1300
    capped = plan_memory(other=0, expert=1, num_layers=1, num_experts=8, top_k=2, memory=10**6)
    assert capped.slots == 8 and capped.residency == 1.0
    with pytest.raises(MemoryPlanError, match=r"smallest budget that works is .*\(1180 bytes\)"):
        plan_memory(other=1000, expert=10, num_layers=4, num_experts=8, top_k=2, kv_cache=100, memory=1179)


@pytest.mark.parametrize("rule", ["exact", "shed"])
def test_batch_generate_runs_and_exact_gives_the_unmodified_models_batch(rule):
    from mlx_lm import batch_generate

    plain, tokenizer = reference(WHEELS)
    prompts = [tokenizer.encode(text) for text in ("def main():", "class Stack(object):\n    def")]
    want = batch_generate(plain, tokenizer, prompts, max_tokens=10).texts
    model, tokenizer = load(WHEELS, residency=0.25, rule=rule)
    got = batch_generate(model, tokenizer, prompts, max_tokens=10).texts
    assert len(got) == 2 and all(got)
    if rule == "exact":
        assert got == want
    assert stream_of(model).stats()["lookups"] > 0
    stream_of(model).close()


def test_mlx_lm_chat_runs_two_turns_on_the_loaded_model(monkeypatch, capsys):
    """mlx-lm's own chat command (its loop, its prompt cache kept over the turns) on kq_mlx.load's model prints
    what it prints on the unmodified model; the shipped tokenizer is given a plain chat template."""
    import builtins
    import sys

    from mlx_lm import chat

    template = "{% for message in messages %}{{ message['content'] }}\n{% endfor %}"

    def run(loader) -> str:
        turns = iter(["def add(a, b):", "class Stack:", "q"])
        monkeypatch.setattr(builtins, "input", lambda *_: next(turns))
        monkeypatch.setattr(sys, "argv", ["mlx_lm.chat", "--model", str(WHEELS), "--temp", "0", "--max-tokens", "8"])
        monkeypatch.setattr(chat, "load", loader)
        capsys.readouterr()
        chat.main()
        return "\n".join(line for line in capsys.readouterr().out.splitlines() if "tok/s" not in line)  # no speeds

    def with_template(model, tokenizer):
        tokenizer._tokenizer.chat_template = template
        return model, tokenizer

    want = run(lambda *args, **kwargs: with_template(*mlx_lm_load(str(WHEELS))))
    loaded = []
    got = run(lambda *args, **kwargs: with_template(*loaded.append(load(WHEELS, residency=0.25)) or loaded[0]))
    assert got == want and got.count("\n") >= 2
    assert stream_of(loaded[0][0]).stats()["reads"] > 0
    stream_of(loaded[0][0]).close()
