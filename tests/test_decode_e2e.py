"""The engine loop of ``kq bench --sets decode-e2e``: its exact mode gives the resident model's bits, with
recorded and with routed routing; the lossy and tier modes give them with every expert resident."""

import numpy as np
import pytest

pytest.importorskip("jax")
pytest.importorskip("safetensors")

from kq.bench import decode_e2e  # noqa: E402
from kq_host.expert_store import ExpertStore  # noqa: E402

LAYERS, EXPERTS, TOP_K, HIDDEN, FFN, STEPS = 2, 16, 4, 32, 32, 12


def _setting(tmp_path_factory, routed: bool):
    """An engine (recorded-style routing: distinct ids per row, scores falling; or random routers), its
    checkpoint, and the resident model's last input after STEPS tokens."""
    rng = np.random.default_rng(3)
    weights = decode_e2e.random_experts(LAYERS, EXPERTS, HIDDEN, FFN, rng)
    tier = decode_e2e.random_tier(LAYERS, EXPERTS, HIDDEN, FFN)
    if routed:
        router = (rng.normal(size=(LAYERS, HIDDEN, EXPERTS)) / np.sqrt(HIDDEN) * 4).astype(np.float32)
        engine = decode_e2e.Engine(weights, TOP_K, STEPS, router=router, tier=tier)
    else:
        indices = np.stack([[rng.permutation(EXPERTS)[:TOP_K] for _ in range(LAYERS)] for _ in range(STEPS)])
        scores = np.sort(rng.random((STEPS, LAYERS, TOP_K), dtype=np.float32), axis=-1)[..., ::-1].copy()
        engine = decode_e2e.Engine(weights, TOP_K, STEPS, routing=(indices.astype(np.int32), scores), tier=tier)
    directory = tmp_path_factory.mktemp("checkpoint")
    decode_e2e.write_checkpoint(directory, weights)
    _, _, last = decode_e2e.decode(lambda x, position: engine.resident(x, position, engine.weights),
                                   lambda position, token: False, engine.first, STEPS, overlap=True)
    return engine, directory, np.asarray(last)


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    return _setting(tmp_path_factory, routed=False)


@pytest.fixture(scope="module")
def routed_setting(tmp_path_factory):
    return _setting(tmp_path_factory, routed=True)


def _run(setting, residency, mode):
    engine, directory, _ = setting
    with ExpertStore(directory, layout="per_expert", projections=decode_e2e.PROJECTIONS) as store:
        return decode_e2e.run_streamed(engine, store, residency=residency, mode=mode, warmup=2, experts=EXPERTS)


def _bits(array):
    return np.asarray(array).view(np.uint32)


@pytest.mark.parametrize("residency", [1.0, 0.5, 0.25], ids=lambda r: f"residency{r:.0%}")
def test_the_exact_mode_gives_the_resident_models_bits(setting, residency):
    run = _run(setting, residency, "exact")
    assert np.array_equal(_bits(run.last), _bits(setting[2]))
    assert (sum(run.critical) > 0) == (sum(run.reruns) > 0) == (residency < 1.0)
    # A token run again after its misses were read is credited once.
    assert run.stats.lookups == (STEPS - 2) * LAYERS * TOP_K and len(run.stamps) == STEPS


@pytest.mark.parametrize("residency", [0.5, 0.25], ids=lambda r: f"residency{r:.0%}")
def test_the_exact_mode_gives_the_resident_models_bits_when_the_model_routes(routed_setting, residency):
    run = _run(routed_setting, residency, "exact")
    assert np.array_equal(_bits(run.last), _bits(routed_setting[2])) and sum(run.reruns) > 0


@pytest.mark.parametrize("mode", ["lossy", "tier"])
def test_the_lossy_modes_match_at_full_residency_and_differ_below(setting, mode):
    full, quarter = _run(setting, 1.0, mode), _run(setting, 0.25, mode)
    assert np.array_equal(_bits(full.last), _bits(setting[2])) and full.stats.hit_rate == 1.0
    assert not np.array_equal(_bits(quarter.last), _bits(setting[2])) and quarter.stats.hit_rate < 1.0
    assert sum(quarter.critical) == sum(quarter.reruns) == 0 and quarter.floor_tokens_per_s > 0


def test_the_tier_serves_misses_the_lossy_mode_sheds(setting):
    tier, lossy = _run(setting, 0.25, "tier"), _run(setting, 0.25, "lossy")
    assert not np.array_equal(_bits(tier.last), _bits(lossy.last))
    assert tier.memory_bytes > lossy.memory_bytes


def test_the_tier_mode_needs_a_tier(setting):
    engine, directory, _ = setting
    bare = decode_e2e.Engine({name: np.asarray(a) for name, a in engine.weights.items()}, TOP_K, STEPS,
                             routing=engine.routing)
    with ExpertStore(directory, layout="per_expert", projections=decode_e2e.PROJECTIONS) as store:
        with pytest.raises(ValueError, match="tier="):
            decode_e2e.run_streamed(bare, store, residency=0.5, mode="tier", warmup=2, experts=EXPERTS)
        with pytest.raises(ValueError, match="mode must be"):
            decode_e2e.run_streamed(engine, store, residency=0.5, mode="resident", warmup=2, experts=EXPERTS)
