"""The exact layer-by-layer loop: the resident model's logits, bit for bit, at partial residency, with and
without look-ahead; the residency manager's per-layer steps (acquire, prefetch) and their accounting."""

import numpy as np
import pytest

from kq_host.residency import ResidencyManager


def _manager(layers=2, experts=8, slots=3, policy="lfu", **options):
    reads = []

    def loader(layer, expert, slot):
        reads.append((layer, expert))

    return ResidencyManager(layers, experts, slots, loader=loader, policy=policy, queue_depth=0, **options), reads


@pytest.mark.parametrize("policy", ["lfu", "lru"])
def test_acquire_makes_every_routed_expert_resident_and_counts_the_critical_reads(policy):
    manager, reads = _manager(policy=policy)
    manager.preload(0, [0, 1, 2])
    table = manager.acquire(0, np.array([[1, 5, 6]]), np.array([[0.5, 0.3, 0.2]]))
    assert (table[[1, 5, 6]] >= 0).all() and (table >= 0).sum() == 3
    assert reads[-2:] == [(0, 5), (0, 6)]
    stats = manager.lookahead_stats()
    assert stats["critical_reads"].tolist() == [2, 0] and stats["critical_wait_s"][0] >= 0
    _, total = manager.stats()
    assert (total.lookups, total.hits) == (3, 1)
    assert (manager.acquire(0, np.array([[1, 5, 6]]), np.array([[0.5, 0.3, 0.2]])) == table).all()
    assert manager.lookahead_stats()["critical_reads"][0] == 2  # all hits the second time


def test_a_prefetch_is_not_a_use_until_its_layer_routes_it():
    manager, _ = _manager(experts=8, slots=3, policy="lfu")
    manager.preload(1, [0, 1, 2])
    manager.acquire(1, np.array([[0, 1, 2]]), np.ones((1, 3)))
    priority_before = manager._tables.priority[1].copy()
    started = manager.prefetch(1, np.array([[4, 1, -1]]), np.array([[0.9, 0.5, 0.0]]))
    assert started == 1  # 1 is resident, -1 is padding
    assert np.array_equal(manager._tables.priority[1], priority_before)  # nothing credited
    manager.acquire(1, np.array([[4, 1, 2]]), np.ones((1, 3)))  # 4 landed in 0's slot (the lowest credit): a hit
    stats = manager.lookahead_stats()
    assert stats["prefetches"][1] == 1 and stats["prefetch_used"][1] == 1 and stats["critical_reads"][1] == 0
    _, total = manager.stats()
    assert total.hits == total.lookups == 6


def test_a_prefetch_evicted_before_any_use_is_wasted():
    manager, _ = _manager(experts=8, slots=3)
    manager.preload(0, [0, 1, 2])
    manager.prefetch(0, np.array([[5]]), np.array([[0.9]]))
    manager.next_token()
    manager.acquire(0, np.array([[0, 1, 6]]), np.ones((1, 3)))  # 6 takes 5's slot: 0 and 1 are routed
    stats = manager.lookahead_stats()
    assert stats["prefetch_wasted"][0] == 1 and stats["prefetch_used"][0] == 0 and stats["prefetch_unused"][0] == 0
    manager.prefetch(0, np.array([[7]]), np.array([[0.9]]))
    assert manager.lookahead_stats()["prefetch_unused"][0] == 1


def test_a_budget_caps_the_prefetch_and_the_best_score_goes_first():
    manager, reads = _manager(experts=8, slots=4)
    assert manager.prefetch(0, np.array([[3, 6, 5]]), np.array([[0.1, 0.7, 0.3]]), budget=2) == 2
    assert reads == [(0, 6), (0, 5)]


@pytest.mark.parametrize("call, message", [
    (lambda m: m.acquire(2, np.array([[0]]), np.array([[1.0]])), "layer"),
    (lambda m: m.acquire(0, np.array([[8]]), np.array([[1.0]])), "ids"),
    (lambda m: m.acquire(0, np.array([[-1]]), np.array([[1.0]])), "ids"),
    (lambda m: m.acquire(0, np.array([[0.5]]), np.array([[1.0]])), "ids must be integers"),
    (lambda m: m.acquire(0, np.array([[1, 2]]), np.array([[1.0]])), "same shape"),
    (lambda m: m.prefetch(0, np.array([[1]]), np.array([[1.0]]), budget=-1), "budget"),
    (lambda m: m.prefetch(0, np.array([[1]]), np.array([[1.0]]), budget=True), "budget"),
])
def test_bad_arguments_are_refused_by_name(call, message):
    manager, _ = _manager()
    with pytest.raises(ValueError, match=message):
        call(manager)


def test_a_failed_critical_read_is_raised_naming_the_layer():
    from kq_host.residency import PreloadError

    def loader(layer, expert, slot):
        raise OSError("disk gone")

    manager = ResidencyManager(1, 8, 3, loader=loader, queue_depth=0)
    with pytest.raises(PreloadError, match="acquire: layer 0"):
        manager.acquire(0, np.array([[3]]), np.array([[1.0]]))
    assert manager.resident(0) == {}


@pytest.fixture(scope="module")
def model():
    pytest.importorskip("jax")
    pytest.importorskip("tokenizers")
    import jax
    import jax.numpy as jnp

    from kq.study import StudyConfig
    from kq.study_jax import JaxStudy
    from kq_jax import qwen3_moe

    study = JaxStudy(StudyConfig(tokens=10, warmup=1))
    cfg, params = study.cfg, study.full_params()
    step = jax.jit(lambda params, token, position, cache: qwen3_moe.decode_step(
        params, token, position, cache, cfg, lambda layer, p, x: (qwen3_moe.moe_resident(p, x, cfg), None))[:2])
    tokens = study.tokens[:12]
    cache, resident = qwen3_moe.empty_cache(cfg, 1, tokens.size), []
    for position, token in enumerate(tokens.tolist()):
        logits, cache = step(params, jnp.asarray([token], jnp.int32), position, cache)
        resident.append(np.asarray(logits).view(np.uint32))
    return study, cfg, tokens, resident


def _loop_logits(model, slots, *, lookahead, policy="lfu"):
    """Each token's logits bits through the exact loop with ``slots`` per layer, and the manager's stats."""
    from kq_host.checkpoint import open_experts
    from kq_jax import qwen3_moe
    from kq_jax.arena import JaxArena
    from kq_jax.exact_loop import ExactLoop

    study, cfg, tokens, _ = model
    with open_experts(study.config.checkpoint, qwen3_moe.PROJECTIONS) as store:
        shapes = {name: (shape, np.float32) for name, (shape, _) in store.expert_shapes(0).items()}
        arena = JaxArena(cfg.num_hidden_layers, slots, shapes)
        manager = ResidencyManager(cfg.num_hidden_layers, cfg.num_experts, slots, arena=arena, policy=policy,
                                   loader=lambda layer, expert, slot: store.read_expert(layer, expert), queue_depth=2)
        loop = ExactLoop(study.params, cfg, manager, arena, length=tokens.size, lookahead=lookahead)
        logits = [np.asarray(loop.step(token, position)) for position, token in enumerate(tokens.tolist())]
        stats = manager.lookahead_stats()
        manager.close()
    return [a.view(np.uint32) for a in logits], stats


@pytest.fixture(scope="module")
def full_loop(model):
    return _loop_logits(model, model[1].num_experts, lookahead=False)[0]


def test_the_loop_with_every_expert_resident_is_the_resident_model(model, full_loop):
    """To the bit on XLA's CPU backend; on a GPU XLA fuses the per-layer programs otherwise than the
    whole-model program, and they agree to float32 rounding."""
    import jax

    resident = model[3]
    for position, (got, want) in enumerate(zip(full_loop, resident)):
        if jax.default_backend() == "cpu":
            assert np.array_equal(got, want), f"token {position}"
        else:
            np.testing.assert_allclose(got.view(np.float32), want.view(np.float32), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("lookahead", [2, True, False], ids=["two-ahead", "lookahead", "no-lookahead"])
@pytest.mark.parametrize("policy", ["lfu", "lru"])
def test_the_exact_loop_at_a_quarter_of_the_experts_is_the_full_arena_to_the_bit(model, full_loop, lookahead, policy):
    got, stats = _loop_logits(model, model[1].num_experts // 4, lookahead=lookahead, policy=policy)
    for position, (bits, want) in enumerate(zip(got, full_loop)):
        assert np.array_equal(bits, want), f"token {position}"
    assert stats["critical_reads"].sum() > 0
    if lookahead:
        assert stats["prefetches"].sum() > 0 and stats["prefetch_used"].sum() > 0
        assert stats["prefetches"][0] == 0  # nothing predicts the first layer
    else:
        assert stats["prefetches"].sum() == 0


def test_two_ahead_prefetches_each_layer_from_the_two_layers_before_it_nearest_first(model):
    from kq_host.checkpoint import open_experts
    from kq_jax import qwen3_moe
    from kq_jax.arena import JaxArena
    from kq_jax.exact_loop import ExactLoop

    study, cfg, tokens, _ = model
    layers = cfg.num_hidden_layers
    manager, _ = _manager(layers=layers, experts=cfg.num_experts, slots=cfg.num_experts)
    for layer in range(layers):
        manager.preload(layer, range(cfg.num_experts))
    targets = []
    manager.prefetch = lambda layer, ids, scores, budget=None: targets.append((layer, ids.shape))
    with open_experts(study.config.checkpoint, qwen3_moe.PROJECTIONS) as store:
        shapes = {name: (shape, np.float32) for name, (shape, _) in store.expert_shapes(0).items()}
    loop = ExactLoop(study.params, cfg, manager, JaxArena(layers, cfg.num_experts, shapes), length=4, lookahead=2)
    loop.step(int(tokens[0]), 0)
    manager.close()
    want = [target for layer in range(layers) for target in (layer + 1, layer + 2) if target < layers]
    assert [t for t, _ in targets] == want
    assert all(shape == (1, cfg.num_experts_per_tok) for _, shape in targets)


@pytest.mark.parametrize("lookahead", [3, -1, 1.5, "1"])
def test_the_exact_loop_refuses_a_lookahead_it_cannot_run(model, lookahead):
    from kq_jax.exact_loop import ExactLoop

    study, cfg, _, _ = model
    manager, _ = _manager(layers=cfg.num_hidden_layers, experts=cfg.num_experts, slots=8)
    with pytest.raises(ValueError, match="lookahead"):
        ExactLoop(study.params, cfg, manager, None, length=4, lookahead=lookahead)


def test_the_exact_loop_refuses_a_manager_of_another_shape(model):
    from kq_jax.exact_loop import ExactLoop

    study, cfg, _, _ = model
    manager, _ = _manager(layers=cfg.num_hidden_layers + 1, experts=cfg.num_experts, slots=8)
    with pytest.raises(ValueError, match="layers"):
        ExactLoop(study.params, cfg, manager, None, length=4)


def test_a_prefetch_still_loading_when_its_layer_routes_it_is_late():
    """The prefetch of 5 is held until acquire's own read of 6 starts: 5 is certainly still loading when the
    layer routes it, and acquire waits for it."""
    import threading

    acquire_reading = threading.Event()

    def loader(layer, expert, slot):
        if expert == 5:
            assert acquire_reading.wait(10), "acquire never started its own read"
        if expert == 6:
            acquire_reading.set()

    manager = ResidencyManager(1, 8, 3, loader=loader, queue_depth=2)
    manager.prefetch(0, np.array([[5]]), np.array([[0.9]]))
    table = manager.acquire(0, np.array([[5, 6]]), np.array([[0.6, 0.4]]), timeout=30)
    stats = manager.lookahead_stats()
    manager.close()
    assert acquire_reading.is_set() and table[5] >= 0 and table[6] >= 0
    assert (stats["prefetch_late"][0], stats["prefetch_used"][0], stats["critical_reads"][0]) == (1, 0, 2)
    assert stats["critical_wait_s"][0] > 0
    assert not manager.failures


def test_a_layer_routing_more_experts_than_it_has_slots_is_refused_by_name():
    manager, _ = _manager(experts=8, slots=3)
    with pytest.raises(ValueError, match="routed 4 experts into 3 slots"):
        manager.acquire(0, np.array([[0, 1], [2, 3]]), np.ones((2, 2)))


@pytest.mark.parametrize("framework, prompt, message", [("torch", [1], "framework"), ("jax", [], "no tokens")])
def test_generate_exact_refuses_bad_arguments_by_name(framework, prompt, message):
    from kq.demo import generate_exact
    from kq.study import SHIPPED_MODEL

    with pytest.raises(ValueError, match=message):
        generate_exact(framework, SHIPPED_MODEL, prompt, 4, 0.25)


def _retried_run(model, fail_layer):
    """Three tokens through the loop at a quarter of the experts, each step run again after a PreloadError,
    the loader failing its first read of ``fail_layer``: the logits bits, the manager's (lookups, hits),
    and how many steps failed."""
    from kq_host.checkpoint import open_experts
    from kq_host.residency import PreloadError
    from kq_jax import qwen3_moe
    from kq_jax.arena import JaxArena
    from kq_jax.exact_loop import ExactLoop

    study, cfg, tokens, _ = model
    failed, logits = [], []
    with open_experts(study.config.checkpoint, qwen3_moe.PROJECTIONS) as store:
        def loader(layer, expert, slot):
            if layer == fail_layer and not failed:
                failed.append(expert)
                raise OSError("a flaky disk")
            return store.read_expert(layer, expert)

        shapes = {name: (shape, np.float32) for name, (shape, _) in store.expert_shapes(0).items()}
        slots = cfg.num_experts // 4
        arena = JaxArena(cfg.num_hidden_layers, slots, shapes)
        manager = ResidencyManager(cfg.num_hidden_layers, cfg.num_experts, slots, arena=arena, loader=loader,
                                   queue_depth=0)
        loop = ExactLoop(study.params, cfg, manager, arena, length=3, lookahead=False)
        for position, token in enumerate(tokens[:3].tolist()):
            try:
                logits.append(np.asarray(loop.step(token, position)).view(np.uint32))
            except PreloadError:
                logits.append(np.asarray(loop.step(token, position)).view(np.uint32))
        _, total = manager.stats()
        manager.close()
    return logits, (total.lookups, total.hits), len(failed)


def test_a_step_run_again_after_a_failed_read_credits_each_layers_routing_once(model):
    """The layers before the failed one, and the failed one, were credited by the failed step; its retry
    reads the failed miss again without crediting them a second time: the stats and logits of a clean run."""
    clean, clean_stats, _ = _retried_run(model, fail_layer=None)
    retried, retried_stats, failures = _retried_run(model, fail_layer=2)
    assert failures == 1
    assert retried_stats == clean_stats
    for position, (got, want) in enumerate(zip(retried, clean)):
        assert np.array_equal(got, want), f"token {position}"
