"""``kq bench --sets host``'s timing of the token boundary per loader mode (kq.bench.host.time_boundary)."""

import json

import pytest

from kq.bench import host


def test_the_boundary_times_every_mode_on_one_trace_in_rounds():
    results = host.time_boundary(2, 16, 4, 4, 3, tokens=12, rounds=3)
    assert [r.mode for r in results] == list(host.BOUNDARY_MODES)
    for r in results:
        assert (r.layers, r.experts, r.slots, r.top_k, r.rows, r.tokens, r.rounds) == (2, 16, 4, 4, 3, 12, 3)
        for spread in (r.wall_ms, r.cpu_ms):
            assert 0 < spread["min"] <= spread["median"] <= spread["max"]
        assert r.impl in host.implementations()
    # One trace, the same decisions in every mode: the same reads.
    assert len({r.reads_per_token for r in results}) == 1 and results[0].reads_per_token > 0


def test_a_mode_that_decides_otherwise_than_the_trace_is_an_error(monkeypatch):
    made = host._boundary_manager

    def failing(mode, layers, experts, slots):
        manager = made(mode, layers, experts, slots)
        manager.loader = lambda layer, expert, slot: -1  # every read fails: the tables differ from the trace's
        return manager

    monkeypatch.setattr(host, "_boundary_manager", failing)
    with pytest.raises(AssertionError, match="decided otherwise than the trace"):
        host.time_boundary(2, 16, 4, 4, 1, tokens=6, rounds=1)


def test_an_unknown_mode_is_refused_by_name():
    with pytest.raises(ValueError, match="modes must be among"):
        host.time_boundary(2, 16, 4, 4, 1, modes=("count", "mmap"), tokens=4, rounds=1)


def test_the_boundary_runs_at_the_largest_model_of_the_set_per_row_count():
    assert host.boundary_shapes(host.HOST_SHAPES) == [(61, 256, 64, 8, 1), (61, 256, 64, 8, 8)]
    assert host.boundary_shapes(((2, 16, 4, 4, 1), (1, 8, 2, 2, 1), (2, 16, 4, 4, 3))) == [(2, 16, 4, 4, 1),
                                                                                        (2, 16, 4, 4, 3)]


def test_the_json_carries_the_boundary_beside_the_shapes(tmp_path, monkeypatch):
    monkeypatch.setattr(host, "BOUNDARY_TOKENS", 8)
    monkeypatch.setattr(host, "BOUNDARY_ROUNDS", 2)
    results = host.run(((2, 16, 4, 4, 1),), tokens=10, progress=False)
    path = tmp_path / "host.json"
    host.write_json(results, str(path))
    written = json.loads(path.read_text())
    assert len(written["results"]) == len(host.implementations())
    assert [b["mode"] for b in written["boundary"]] == list(host.BOUNDARY_MODES)
    assert all(set(b["wall_ms"]) == {"min", "median", "max"} for b in written["boundary"])
    table = host.format_table(results)
    assert "the boundary" in table and "payload" in table
