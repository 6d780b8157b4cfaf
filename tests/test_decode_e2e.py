"""The engine loop of ``kq bench --sets decode-e2e``: its exact mode gives the resident model's bits, with
recorded and with routed routing; the lossy and tier modes give them with every expert resident. Its floor
columns: the arithmetic on made-up rates, the misses' path read through the store, and every row of a run
consistent with its own measurements (never a timing compared with another)."""

import json

import numpy as np
import pytest

pytest.importorskip("jax")
pytest.importorskip("safetensors")

from kq.bench import decode_e2e, floor  # noqa: E402
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


@pytest.mark.parametrize("residency", [1.0, 0.5, 0.25], ids=lambda r: f"residency{r:.0%}")
@pytest.mark.parametrize("routed", [False, True], ids=["recorded", "routed"])
def test_the_exact_fetch_mode_gives_the_resident_models_bits_in_one_pass(setting, routed_setting, routed, residency):
    chosen = routed_setting if routed else setting
    run = _run(chosen, residency, "exact-fetch")
    assert np.array_equal(_bits(run.last), _bits(chosen[2]))
    assert sum(run.reruns) == 0 and (sum(run.critical) > 0) == (residency < 1.0)
    assert run.stats.lookups == (STEPS - 2) * LAYERS * TOP_K and len(run.stamps) == STEPS


@pytest.mark.parametrize("residency", [1.0, 0.25], ids=["full", "quarter"])
def test_the_exact_fetch_mode_dispatches_ahead_while_its_tables_cannot_miss(setting, monkeypatch, residency):
    """exact-fetch dispatches the next token before reading this one while every table holds every expert
    (nothing to fetch, nothing to change at the boundary), and after the boundary while a table can miss
    (the next token takes the tables holding this one's misses)."""
    asked, decode = [], decode_e2e.decode

    def recorded(dispatch, boundary, first, steps, *, overlap):
        return decode(dispatch, boundary, first, steps, overlap=lambda: asked.append(overlap()) or asked[-1])
    monkeypatch.setattr(decode_e2e, "decode", recorded)
    run = _run(setting, residency, "exact-fetch")
    assert np.array_equal(_bits(run.last), _bits(setting[2]))
    assert len(asked) == STEPS - 1 and set(asked) == {residency == 1.0}


def test_the_engine_loop_dispatches_ahead_only_while_asked():
    """decode's overlap asked before each token: the next token dispatched before this one is read while it
    says so, after this one's boundary otherwise; the tokens the same either way."""
    import jax.numpy as jnp

    events = []

    def dispatch(x, position):
        events.append(("dispatch", position))
        return x + 1, jnp.asarray(x)

    def boundary(position, readback):
        events.append(("read", position))
        return False
    ahead = iter([True, False, True])
    stamps, _, last = decode_e2e.decode(dispatch, boundary, 0, 4, overlap=lambda: next(ahead))
    assert last == 4 and len(stamps) == 4
    assert events == [("dispatch", 0), ("dispatch", 1), ("read", 0), ("read", 1), ("dispatch", 2), ("dispatch", 3),
                      ("read", 2), ("read", 3)]


@pytest.mark.parametrize("mode", ["lossy", "tier"])
def test_the_lossy_modes_match_at_full_residency_and_differ_below(setting, mode):
    full, quarter = _run(setting, 1.0, mode), _run(setting, 0.25, mode)
    assert np.array_equal(_bits(full.last), _bits(setting[2])) and full.stats.hit_rate == 1.0
    assert not np.array_equal(_bits(quarter.last), _bits(setting[2])) and quarter.stats.hit_rate < 1.0
    assert sum(quarter.critical) == sum(quarter.reruns) == 0 and quarter.floor_tokens_per_s > 0


@pytest.mark.parametrize("residency", [1.0, 0.25], ids=["full", "quarter"])
@pytest.mark.parametrize("mode", ["lossy", "tier", "exact"])
def test_a_token_whose_tables_hold_every_expert_runs_the_full_table_program(setting, monkeypatch, residency, mode):
    """While every table holds every expert a token runs ``Engine.full`` (no route_shed, tier or fetch), in
    every mode; a table that can miss puts it on the mode's own program. The program a run cannot dispatch is
    never compiled nor run. Counted over the compile, the decode and its floor (the bits: the tests above)."""
    engine = setting[0]
    own = {"lossy": "streamed", "tier": "tiered", "exact": "streamed"}[mode]
    calls = {own: 0, "full": 0}
    for name in calls:
        def counted(*args, program=getattr(engine, name), name=name, **kwargs):
            calls[name] += 1
            return program(*args, **kwargs)
        monkeypatch.setattr(engine, name, counted)
    _run(setting, residency, mode)
    used, unused = ("full", own) if residency == 1.0 else (own, "full")
    assert calls[unused] == 0
    assert calls[used] - 1 >= STEPS + min(STEPS, 64)  # the decode's tokens (and any runs again), the floor's


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


def _fabricated(mode, tokens_per_s, resident_tokens_per_s, critical_mib_per_token, read_gib_per_s):
    """A result with made-up rates (not timings): its floor columns from :func:`floor.floor_columns`."""
    return decode_e2e.DecodeResult(
        device="cpu", model="made-up", routing="recorded", checkpoint="stdlib-moe", layers=2, experts=16, hidden=32,
        ffn=32, mode=mode, residency=0.5, tokens=8, tokens_per_s=tokens_per_s, floor_tokens_per_s=900.0,
        token_ms=1e3 / tokens_per_s, wait_ms=0.5, boundary_ms=0.25, publish_ms=0.125, critical_reads_per_token=4.0,
        reruns_per_token=1.0, mib_read_per_token=3.0, h2d_ms=0.01, hit_rate=0.75, memory_gib=0.5, tier_bits=None,
        resident_tokens_per_s=resident_tokens_per_s, read_gib_per_s=read_gib_per_s,
        critical_mib_per_token=critical_mib_per_token,
        **floor.floor_columns(tokens_per_s, resident_tokens_per_s, critical_mib_per_token, read_gib_per_s))


def test_the_floor_is_the_slower_of_the_resident_token_and_its_critical_reads(tmp_path):
    # 2 MiB a token at 1 GiB/s is 1/512 s, slower than the resident's 1/1000 s: the reads set the floor.
    read_bound = _fabricated("exact", 256.0, 1000.0, 2.0, 1.0)
    assert (read_bound.floor_with_reads_tokens_per_s, read_bound.x_floor, read_bound.x_resident) == (512.0, 0.5, 0.256)
    # 0.5 MiB at 1 GiB/s is 1/2048 s, faster than the resident token: the resident token sets it.
    compute_bound = _fabricated("exact", 250.0, 1000.0, 0.5, 1.0)
    assert (compute_bound.floor_with_reads_tokens_per_s, compute_bound.x_floor) == (1000.0, 0.25)
    lossy = _fabricated("lossy", 800.0, 1000.0, 0.0, 1.0)
    assert (lossy.floor_with_reads_tokens_per_s, lossy.x_floor) == (1000.0, 0.8)
    table = decode_e2e.format_table([read_bound, lossy]).splitlines()
    header = table[0].split()
    for column in ("x floor", "floor tok/s", "no-read tok/s", "critical MiB/token", "read GiB/s"):
        assert column in table[0]
    assert header.index("resident") < header.index("floor") and "0.500" in table[2] and "512.0" in table[2]
    decode_e2e.write_json([read_bound], str(tmp_path / "fabricated.json"))
    row = json.loads((tmp_path / "fabricated.json").read_text())["results"][0]
    assert {key: row[key] for key in ("floor_with_reads_tokens_per_s", "x_floor", "x_resident", "read_gib_per_s",
                                       "critical_mib_per_token", "resident_tokens_per_s")} == {
        "floor_with_reads_tokens_per_s": 512.0, "x_floor": 0.5, "x_resident": 0.256, "read_gib_per_s": 1.0,
        "critical_mib_per_token": 2.0, "resident_tokens_per_s": 1000.0}


@pytest.mark.parametrize("argument, bad", [("tokens_per_s", 0.0), ("resident_tokens_per_s", -1.0),
                                           ("resident_tokens_per_s", float("inf")), ("read_gib_per_s", float("nan")),
                                           ("critical_mib_per_token", -0.5)])
def test_the_floor_refuses_rates_it_cannot_divide_by(argument, bad):
    arguments = dict(tokens_per_s=100.0, resident_tokens_per_s=200.0, critical_mib_per_token=1.0, read_gib_per_s=2.0)
    with pytest.raises(ValueError, match=argument):
        floor.floor_columns(**{**arguments, argument: bad})


def test_the_misses_path_is_read_through_the_store(setting):
    _, directory, _ = setting
    copied = []
    with ExpertStore(directory, layout="per_expert", projections=decode_e2e.PROJECTIONS) as store:
        expert = store.expert_nbytes(0)
        gib_per_s = floor.miss_path_gib_per_s(store, LAYERS, EXPERTS, to_device=copied.append, workers=2,
                                                   passes=2, max_bytes=5 * expert)
        assert np.isfinite(gib_per_s) and gib_per_s > 0
        assert store.bytes_read == 3 * 5 * expert  # a warming pass and two timed ones, five experts each
        assert len(copied) == 15 and all(set(payload) == set(decode_e2e.PROJECTIONS) for payload in copied)
        before = store.bytes_read
        floor.miss_path_gib_per_s(store, LAYERS, EXPERTS, passes=1, max_bytes=1)  # at least one expert
        assert store.bytes_read - before == 2 * expert
        for argument in ("layers", "experts", "workers", "passes", "max_bytes"):
            arguments = {**dict(layers=LAYERS, experts=EXPERTS, workers=1, passes=1, max_bytes=expert), argument: 0}
            with pytest.raises(ValueError, match=argument):
                floor.miss_path_gib_per_s(store, **arguments)


def test_every_row_of_a_run_has_consistent_floor_columns(monkeypatch):
    """A tiny recorded model through run_model: the floor columns follow from the row's own measurements."""
    rng = np.random.default_rng(5)
    experts, steps = 64, 9  # the shipped checkpoint's experts; 3 warm-up tokens and 6 timed
    indices = np.stack([[rng.permutation(experts)[:TOP_K] for _ in range(LAYERS)] for _ in range(steps)])
    scores = np.sort(rng.random((steps, LAYERS, TOP_K), dtype=np.float32), axis=-1)[..., ::-1].copy()
    monkeypatch.setitem(decode_e2e.RECORDED_MODELS, "tiny", ("stdlib-moe", LAYERS, HIDDEN, FFN))
    rows = decode_e2e.run_model("tiny", tokens=6, warmup=3, routing=(indices.astype(np.int32), scores),
                                residencies=(1.0, 0.25))
    assert [(r.mode, r.residency) for r in rows] == [("resident", 1.0)] + [
        (mode, residency) for residency in (1.0, 0.25) for mode in ("lossy", "tier", "exact", "exact-fetch")]
    expert_mib = 3 * HIDDEN * FFN * 2 / 2**20  # three bfloat16 projections
    assert len({r.read_gib_per_s for r in rows}) == 1 and rows[0].read_gib_per_s > 0
    assert rows[0].resident_tokens_per_s == rows[0].tokens_per_s and rows[0].x_floor == rows[0].x_resident == 1.0
    for row in rows:
        assert row.critical_mib_per_token == row.critical_reads_per_token * expert_mib
        assert (row.critical_mib_per_token > 0) == (row.mode.startswith("exact") and row.residency < 1.0)
        assert {key: getattr(row, key) for key in ("x_resident", "floor_with_reads_tokens_per_s", "x_floor")} == \
            floor.floor_columns(row.tokens_per_s, row.resident_tokens_per_s, row.critical_mib_per_token,
                                     row.read_gib_per_s)


def test_run_model_runs_the_modes_given_in_their_order(monkeypatch):
    """``modes`` picks the arena modes and their order (a mode's place in a run is then a variable of its
    own); a mode the model lacks, a repeat or none is refused by name before anything runs."""
    rng = np.random.default_rng(6)
    experts, steps = 64, 6
    indices = np.stack([[rng.permutation(experts)[:TOP_K] for _ in range(LAYERS)] for _ in range(steps)])
    scores = np.sort(rng.random((steps, LAYERS, TOP_K), dtype=np.float32), axis=-1)[..., ::-1].copy()
    monkeypatch.setitem(decode_e2e.RECORDED_MODELS, "tiny", ("stdlib-moe", LAYERS, HIDDEN, FFN))
    routing = (indices.astype(np.int32), scores)
    rows = decode_e2e.run_model("tiny", tokens=3, warmup=3, routing=routing, residencies=(1.0,),
                                modes=("exact-fetch", "tier", "lossy"))
    assert [r.mode for r in rows] == ["resident", "exact-fetch", "tier", "lossy"]
    for modes in ((), ("lossy", "lossy"), ("resident",), ("shed",)):
        with pytest.raises(ValueError, match="modes"):
            decode_e2e.run_model("tiny", tokens=3, warmup=3, routing=routing, residencies=(1.0,), modes=modes)
    with pytest.raises(ValueError, match="modes"):  # the random models have no tier
        decode_e2e.run_model("random-8x64-512", tokens=3, warmup=3, modes=("tier",))


def test_the_mlx_decode_job_reads_the_shipped_checkpoints():
    from kq.bench.jobs import mlx_decode

    for name, checkpoint, _ in mlx_decode.VARIANTS:
        assert checkpoint.name == name and (checkpoint / "config.json").is_file()


@pytest.mark.parametrize("mode", ["lossy", "exact", "exact-fetch"])
def test_a_full_arena_holds_the_checkpoints_bytes(setting, mode):
    """Every expert resident, the arena is the resident model's bytes (its dtype on every backend: on a CPU
    the bfloat16 bits held as uint16, which XLA writes in place), so both programs gather the same weights."""
    engine, _, resident_last = setting
    run = _run(setting, 1.0, mode)
    assert run.memory_bytes == sum(a.nbytes for a in engine.weights.values())
    assert np.array_equal(_bits(run.last), _bits(resident_last))
