"""The vectorised residency manager replays routing traces exactly as the plainly written reference does."""

import importlib.util

import numpy as np
import pytest
from reference_manager import ReferenceManager

from kq import route_shed
from kq_core.inputs import expert_popularity
from kq_host.residency import LayerReport, ResidencyManager

has_numba = importlib.util.find_spec("numba") is not None


def recording_loader(log, failing=()):
    """Logs every read; the experts in ``failing`` fail their first two reads."""
    failures = {}

    def loader(layer, expert, slot):
        log.append((layer, expert, slot))
        if expert in failing and failures.get((layer, expert), 0) < 2:
            failures[(layer, expert)] = failures.get((layer, expert), 0) + 1
            raise OSError(f"read {layer}/{expert} failed")
        return 0

    return loader


def trace(rng, layers, experts, rows, top_k, tokens):
    """Zipf-like routing with slow drift: ``[tokens][layers] -> (ids [rows, K], scores [rows, K])``."""
    popularity = [expert_popularity(rng, experts) for _ in range(layers)]
    out = []
    for _ in range(tokens):
        per_layer = []
        for layer in range(layers):
            ids = np.stack([rng.choice(experts, top_k, replace=False, p=popularity[layer]) for _ in range(rows)])
            scores = rng.dirichlet(np.ones(top_k), rows).astype(np.float32)
            if rng.random() < 0.05:
                scores[0, 0] = np.nan
            per_layer.append((ids.astype(np.int32), scores))
        out.append(per_layer)
    return out


CONFIGS = [
    dict(policy="lfu", read_budget=None, pinned=None, decay_interval=8),
    dict(policy="lru", read_budget=None, pinned=None, decay_interval=64),
    dict(policy="lfu", read_budget=5, pinned={0: [1, 2], 2: [0]}, decay_interval=4),
    dict(policy="lru", read_budget=3, pinned={1: [5]}, decay_interval=0),
]


IMPLS = ["numpy", pytest.param("numba", marks=pytest.mark.skipif(not has_numba, reason="Numba is not installed"))]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("stacked", [False, True], ids=["per-layer-reports", "stacked-report"])
@pytest.mark.parametrize("config", CONFIGS, ids=["lfu", "lru", "lfu-budget-pinned", "lru-budget-pinned"])
@pytest.mark.parametrize("layers, experts, slots, rows, top_k", [(3, 16, 6, 1, 4), (4, 32, 8, 4, 4), (2, 64, 16, 2, 8)])
def test_replay_matches_the_reference(config, layers, experts, slots, rows, top_k, stacked, impl):
    """The reference takes one report per layer; the manager under test the same, or one report of
    [L, T, K] arrays."""
    rng = np.random.default_rng(layers * 100 + experts + rows)
    logs = ([], [])
    failing = {3, 11}
    config = dict(config, pinned={layer: ids for layer, ids in (config["pinned"] or {}).items() if layer < layers})
    managers = [ReferenceManager(layers, experts, slots, loader=recording_loader(logs[0], failing), queue_depth=0,
                                 **config),
                ResidencyManager(layers, experts, slots, loader=recording_loader(logs[1], failing), queue_depth=0,
                                 impl=impl, **config)]
    assert managers[1].impl == impl
    for manager in managers:
        for layer, pinned in config["pinned"].items():
            manager.preload(layer, pinned)
    tables = managers[0].snapshot()
    for step, routed in enumerate(trace(rng, layers, experts, rows, top_k, 60)):
        reports = []
        for layer, (ids, scores) in enumerate(routed):
            out = route_shed(ids, scores, tables[layer])
            reports.append(LayerReport(ids, scores, out.miss_ids, out.miss_scores))
        want = managers[0].step(reports)
        got = managers[1].step(LayerReport.stacked(reports) if stacked else reports)
        assert np.array_equal(want, got), f"tables differ after token {step}"
        for layer in range(layers):
            assert np.array_equal(managers[0].slot_owner(layer), managers[1].slot_owner(layer))
        assert logs[0] == logs[1], f"reads differ after token {step}"
        assert managers[0].stats() == managers[1].stats(), f"statistics differ after token {step}"
        assert managers[0].failures == managers[1].failures
        tables = got
    total = managers[1].stats()[1]
    assert total.reads_failed > 0 and total.evictions > 0 and total.hits > 0  # the trace exercised them
