"""Exact generation on sliding-window families once the rotating KV cache wraps.

Each family is a tiny random model (test_mlx_families' small config) whose sliding layers keep a window of
:data:`WINDOW` tokens in mlx-lm's ``RotatingKVCache``; prompts are longer than the window and decoding runs well
past it, so a token that misses has to be cut back from a cache that has wrapped. The tokens must be the
unmodified model's (mlx-lm's own ``generate_step``, or the model fed a token a pass), and a cache put back must be
the cache as it was, bit for bit.
"""

import importlib

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache  # noqa: E402

from kq_host.residency import PreloadError, ResidencyManager  # noqa: E402
from kq_mlx.mlx_lm_adapter import (SwitchGLUArena, _CacheCheckpoint, attach_arena, attach_exact,  # noqa: E402
                                   generate_greedy)
from test_mlx_families import EXPERTS, SMALL, SPECIAL  # noqa: E402

WINDOW = 4
SLIDING_THEN_FULL = ["sliding_attention", "full_attention"]
# Each family's small config with layer 0 a sliding-window layer of WINDOW tokens (a RotatingKVCache).
WINDOWED = {
    "gpt_oss": dict(layer_types=SLIDING_THEN_FULL, sliding_window=WINDOW),
    "gemma4_text": dict(layer_types=SLIDING_THEN_FULL, sliding_window=WINDOW, enable_moe_block=True, top_k_experts=2,
                        num_kv_shared_layers=0, hidden_size_per_layer_input=0, global_head_dim=8,
                        num_global_key_value_heads=2, vocab_size_per_layer_input=64),
    "mimo_v2_flash": dict(hybrid_layer_pattern=[1, 0], moe_layer_freq=[1, 1], sliding_window_size=WINDOW,
                          add_swa_attention_sink_bias=True, add_full_attention_sink_bias=False, topk_method="noaux_tc",
                          scoring_func="sigmoid", layernorm_epsilon=1e-6, swa_rope_theta=10000.0,
                          swa_num_attention_heads=4, swa_num_key_value_heads=2, v_head_dim=8, swa_head_dim=8,
                          swa_v_head_dim=8, partial_rotary_factor=1),
    "step3p5": dict(layer_types=SLIDING_THEN_FULL, sliding_window=WINDOW),
    "afmoe": dict(layer_types=SLIDING_THEN_FULL, sliding_window=WINDOW),
}
PROMPT = [2, 7, 1, 8, 2, 8, 1, 8, 28, 18, 28]  # 11 tokens: longer than the window
STEPS = 14


def build_windowed(family: str, *, seed: int):
    """The family's tiny model of random weights drawn from ``seed``, its first layer's cache a window of WINDOW."""
    module = importlib.import_module(f"mlx_lm.models.{family}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict({"model_type": family, **SMALL, **SPECIAL.get(family, {}),
                                                     **WINDOWED[family]}))
    for _, gate in model.named_modules():  # a router made of zeros (MiMo's MoEGate) would route experts 0 and 1 always
        weight = gate.get("weight") if type(gate).__name__ == "MoEGate" else None
        if weight is not None and not mx.any(weight != 0).item():
            gate.weight = mx.random.normal(weight.shape, weight.dtype)
    mx.eval(model.parameters())
    return model


def _greedy(logprobs):
    return mx.argmax(logprobs, axis=-1)


def mlx_lm_tokens(family: str, seed: int, prompt, steps: int) -> list[int]:
    """mlx-lm's own greedy generation (``generate_step``) on the unmodified model."""
    model = build_windowed(family, seed=seed)
    return [int(token) for token, _ in generate_step(mx.array(prompt), model, max_tokens=steps, sampler=_greedy)]


def one_at_a_time_tokens(family: str, seed: int, prompt, steps: int) -> list[int]:
    """The unmodified model's greedy tokens, the prompt fed a token a pass (as exact=True without prefill runs it)."""
    model = build_windowed(family, seed=seed)
    cache = make_prompt_cache(model)
    for token in prompt[:-1]:
        mx.eval(model(mx.array([[token]]), cache=cache))
    tokens, x = [], mx.array([prompt[-1:]])
    for _ in range(steps):
        tokens.append(int(mx.argmax(model(x, cache=cache)[0, -1]).item()))
        x = mx.array([tokens[-1:]])
    return tokens


def _manager(blocks, slots, loader=None):
    return ResidencyManager(len(blocks), EXPERTS, slots, arena=SwitchGLUArena(blocks), queue_depth=0,
                            loader=loader or (lambda layer, expert, slot: blocks[layer].expert_weights(expert)))


def test_every_windowed_family_keeps_a_window_shorter_than_the_prompt():
    for family in WINDOWED:
        caches = make_prompt_cache(build_windowed(family, seed=0))
        assert any(isinstance(c, RotatingKVCache) and c.max_size == WINDOW for c in caches), family


def _wrapped_restores(monkeypatch) -> list[bool]:
    """Records, for each checkpoint restored from now on, whether it held a rotating cache that had wrapped."""
    import kq_mlx.mlx_lm_adapter as adapter

    seen, restore = [], adapter._CacheCheckpoint.restore

    def recording(checkpoint):
        seen.append(any(isinstance(cache, RotatingKVCache) and cache.offset > cache.max_size
                        for cache, _ in checkpoint._restorers.values()))
        return restore(checkpoint)
    monkeypatch.setattr(adapter._CacheCheckpoint, "restore", recording)
    return seen


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "serial"])
@pytest.mark.parametrize("prefill_prompt, slots", [(True, 2), (True, 6), (False, 6)],
                         ids=["prefilled-2", "prefilled-6", "token-a-pass-6"])
@pytest.mark.parametrize("family", list(WINDOWED))
def test_exact_generation_past_the_window_is_the_models_greedy_tokens(family, prefill_prompt, slots, overlap,
                                                                      monkeypatch):
    """A prompt longer than the window, then decoding well past it, at 2 and 6 of 8 slots: the unmodified model's
    tokens (mlx-lm's generate_step where the prompt is prefilled, the model fed a token a pass otherwise), the
    tokens that missed cut back from a wrapped cache and run again."""
    want = (mlx_lm_tokens if prefill_prompt else one_at_a_time_tokens)(family, 1, PROMPT, STEPS)
    model = build_windowed(family, seed=1)
    blocks = attach_arena(model, slots)
    manager = _manager(blocks, slots)
    restored = _wrapped_restores(monkeypatch)
    cache = make_prompt_cache(model)
    got = generate_greedy(model, blocks, manager, PROMPT, STEPS, exact=True, overlap=overlap,
                          prefill_prompt=prefill_prompt, cache=cache)
    manager.close()
    assert got == want
    assert any(restored), "the case must cut back a token from a wrapped window"
    # The caches hold what the unmodified model's hold after the same passes, bit for bit (the last token is not fed)
    plain = build_windowed(family, seed=1)
    plain_cache = make_prompt_cache(plain)
    if prefill_prompt:
        mx.eval(plain(mx.array([PROMPT[:-1]]), cache=plain_cache))
    for token in (PROMPT[-1:] if prefill_prompt else PROMPT) + want[:-1]:
        mx.eval(plain(mx.array([[token]]), cache=plain_cache))
    assert [_snapshot(c) for c in cache] == [_snapshot(c) for c in plain_cache]


def _snapshot(cache) -> list:
    """What a cache holds, bit for bit: a rotating cache its whole arrays and its counters; a KVCache the keys
    and values it holds (up to its offset) and the offset."""
    if isinstance(cache, RotatingKVCache):
        arrays = [] if cache.keys is None else [cache.keys, cache.values]
        return [np.array(a).view(np.uint32).tolist() for a in arrays] + [cache.offset, cache._idx, cache.keep,
                                                                          cache.max_size]
    if isinstance(cache, KVCache):
        if cache.keys is None:
            return [cache.offset]
        return [np.array(a[..., :cache.offset, :]).view(np.uint32).tolist() for a in (cache.keys, cache.values)] + [
            cache.offset]
    raise AssertionError(type(cache).__name__)


def _kv(tokens: int, seed: int):
    rng = np.random.default_rng(seed)
    return tuple(mx.array(rng.standard_normal((1, 2, tokens, 8)).astype(np.float32)) for _ in range(2))


# Rotating caches in every state a pass may find them: empty, filling, full with its write position at the end
# (about to rotate), wrapped, longer than the window (after a pass of several tokens), and keeping a first token.
STATES = {"empty": (0, [], 0), "filling": (0, [1, 1], 0), "full, about to rotate": (0, [1] * WINDOW, 0),
          "wrapped": (0, [1] * (WINDOW + 3), 0), "after a long pass": (0, [1, 6], 0),
          "wrapped, a long pass after": (0, [1] * 6 + [3], 0), "keeping the first token": (1, [3] + [1] * 6, 0)}


@pytest.mark.parametrize("passes", [[1], [3], [1, 1], [1, 3], [3, 1]], ids=str)
@pytest.mark.parametrize("state", list(STATES))
def test_a_rotating_cache_put_back_is_the_cache_before_the_passes(state, passes):
    """Passes of one token (written in place) and of several (concatenated) after a checkpoint each, put back
    newest first: the cache is the one before, bit for bit, arrays and counters, and the same passes run again
    give the same cache as the first time."""
    keep, history, seed = STATES[state]
    cache = RotatingKVCache(max_size=WINDOW, keep=keep)
    for step, tokens in enumerate(history):
        mx.eval(cache.update_and_fetch(*_kv(tokens, seed + step)))
    before = _snapshot(cache)
    checkpoints = []
    for step, tokens in enumerate(passes):
        checkpoints.append(_CacheCheckpoint([cache]))
        mx.eval(cache.update_and_fetch(*_kv(tokens, 100 + step)))
    after = _snapshot(cache)
    for checkpoint in reversed(checkpoints):
        checkpoint.restore()
    assert _snapshot(cache) == before
    for step, tokens in enumerate(passes):
        mx.eval(cache.update_and_fetch(*_kv(tokens, 100 + step)))
    assert _snapshot(cache) == after


def test_a_rotating_cache_put_back_before_it_was_evaluated_is_the_cache_before():
    """The checkpoint of a pass whose writes are still lazy (an overlapped token's) puts the cache back too."""
    cache = RotatingKVCache(max_size=WINDOW)
    for step in range(WINDOW + 2):
        mx.eval(cache.update_and_fetch(*_kv(1, step)))
    before = _snapshot(cache)
    first = _CacheCheckpoint([cache])
    cache.update_and_fetch(*_kv(1, 50))
    second = _CacheCheckpoint([cache])
    cache.update_and_fetch(*_kv(1, 51))
    second.restore()
    first.restore()
    assert _snapshot(cache) == before


def test_a_rotating_cache_put_back_out_of_order_says_it_cannot_be_cut_back():
    """Putting back an older pass while a newer one still holds its write would lose that write's overwritten
    entry: refused, naming the cache, rather than put back wrong."""
    cache = RotatingKVCache(max_size=WINDOW)
    for step in range(WINDOW + 2):
        mx.eval(cache.update_and_fetch(*_kv(1, step)))
    first = _CacheCheckpoint([cache])
    cache.update_and_fetch(*_kv(1, 50))
    cache.update_and_fetch(*_kv(1, 51))
    with pytest.raises(RuntimeError, match="RotatingKVCache"):
        first.restore()


@pytest.mark.parametrize("family", ["gpt_oss", "gemma4_text"])
def test_a_failed_read_past_the_window_leaves_every_cache_as_before_the_token(family):
    """attach_exact, the window wrapped: a read failing in layer 1 leaves every cache as before the token, bit
    for bit (layer 0's rotating cache had taken it in place), and the token run again once the disk heals gives
    the unmodified model's logits."""
    tokens = PROMPT + [5, 9, 2, 6, 5, 3]
    plain = build_windowed(family, seed=3)
    cache, want = make_prompt_cache(plain), []
    for token in tokens:
        want.append(np.array(plain(mx.array([[token]]), cache=cache)[0, -1]).view(np.uint32))
    model = build_windowed(family, seed=3)
    blocks = attach_arena(model, 2)
    broken = {"on": False}

    def loader(layer, expert, slot):
        if broken["on"] and layer == 1:
            raise OSError("input/output error")
        return blocks[layer].expert_weights(expert)

    manager = _manager(blocks, 2, loader)
    attach_exact(model, blocks, manager)
    cache, failures = make_prompt_cache(model), 0
    for position, token in enumerate(tokens):
        broken["on"] = position >= WINDOW and position % 2 == 1
        before = [_snapshot(c) for c in cache]
        try:
            logits = model(mx.array([[token]]), cache=cache)[0, -1]
        except PreloadError:
            failures += 1
            assert [_snapshot(c) for c in cache] == before, f"token {position}"
            broken["on"] = False
            logits = model(mx.array([[token]]), cache=cache)[0, -1]
        manager.next_token()
        assert np.array_equal(np.array(logits).view(np.uint32), want[position]), f"token {position}"
    manager.close()
    assert failures > 0
