"""The engine loop of ``kq bench --sets decode-e2e``: its exact mode gives the resident model's bits."""

import numpy as np
import pytest

pytest.importorskip("jax")
pytest.importorskip("safetensors")

from kq.bench import decode_e2e  # noqa: E402
from kq_host.expert_store import ExpertStore  # noqa: E402

LAYERS, EXPERTS, TOP_K, HIDDEN, FFN, STEPS = 2, 16, 4, 32, 16, 12


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    """An engine on recorded-style routing (distinct ids per row, scores falling), its checkpoint, and the
    resident model's last input after STEPS tokens."""
    rng = np.random.default_rng(3)
    indices = np.stack([[rng.permutation(EXPERTS)[:TOP_K] for _ in range(LAYERS)] for _ in range(STEPS)])
    scores = np.sort(rng.random((STEPS, LAYERS, TOP_K), dtype=np.float32), axis=-1)[..., ::-1].copy()
    weights = decode_e2e.random_experts(LAYERS, EXPERTS, HIDDEN, FFN, rng)
    engine = decode_e2e.Engine(weights, TOP_K, STEPS, routing=(indices.astype(np.int32), scores))
    directory = tmp_path_factory.mktemp("checkpoint")
    decode_e2e.write_checkpoint(directory, weights)
    _, _, last = decode_e2e.decode(lambda x, position: engine.resident(x, position, engine.weights),
                                   lambda position, token: None, engine.first, STEPS, overlap=True)
    return engine, directory, np.asarray(last)


@pytest.mark.parametrize("residency", [1.0, 0.5, 0.25], ids=lambda r: f"residency{r:.0%}")
def test_the_exact_mode_gives_the_resident_models_bits(setting, residency):
    engine, directory, want = setting
    with ExpertStore(directory, layout="per_expert", projections=decode_e2e.PROJECTIONS) as store:
        *_, critical, stats, last = decode_e2e.run_streamed(engine, store, residency=residency, mode="exact",
                                                            warmup=2, experts=EXPERTS)
    assert np.array_equal(np.asarray(last).view(np.uint32), want.view(np.uint32))
    assert (sum(critical) > 0) == (residency < 1.0) and stats.lookups == (STEPS - 2) * LAYERS * TOP_K


def test_the_lossy_mode_sheds_below_full_residency_and_matches_at_it(setting):
    engine, directory, want = setting
    got = {}
    with ExpertStore(directory, layout="per_expert", projections=decode_e2e.PROJECTIONS) as store:
        for residency in (1.0, 0.25):
            *_, stats, last = decode_e2e.run_streamed(engine, store, residency=residency, mode="lossy",
                                                      warmup=2, experts=EXPERTS)
            got[residency] = np.asarray(last)
    assert np.array_equal(got[1.0].view(np.uint32), want.view(np.uint32))
    assert not np.array_equal(got[0.25], want) and stats.hit_rate < 1.0


def test_the_exact_report_is_what_route_shed_reports(setting):
    from kq_core.oracle import route_shed_oracle

    engine, _, _ = setting
    rng = np.random.default_rng(8)
    tables = np.where(rng.random((LAYERS, EXPERTS)) < 0.5, rng.integers(0, 8, (LAYERS, EXPERTS)), -1).astype(np.int32)
    for position in range(STEPS):
        indices, scores = (a[position] for a in engine.routing)
        report = decode_e2e.exact_report(tables, indices, scores)
        for layer in range(LAYERS):
            want = route_shed_oracle(indices[layer][None], scores[layer][None], tables[layer])
            assert np.array_equal(report.miss_ids[layer], want.miss_ids)
            assert np.array_equal(report.miss_scores[layer].view(np.uint32), want.miss_scores.view(np.uint32))
