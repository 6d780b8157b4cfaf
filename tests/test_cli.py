"""The command line: `kq check` and a smoke run of `kq bench` (a benchmark, not a timed test)."""

import functools
import json
import re

import numpy as np
import pytest

import kq
from kq.cli import main
from kq_core.inputs import router_inputs
from kq_core.oracle import route_shed_oracle


def test_check_passes_and_prints_a_table(capsys):
    assert main(["check", "--backends", "numpy-oracle", "jax-reference", "--random-rows", "24"]) == 0
    out = capsys.readouterr().out
    assert "jax-reference" in out and "first mismatch" in out and "0 with mismatches" in out


def test_check_lists_unavailable_backends_as_skipped(capsys):
    main(["check", "--backends", "numpy-oracle", "jax-pallas", "--random-rows", "10"])
    out = capsys.readouterr().out
    assert "skipped" in out and "needs a CUDA GPU" in out


def test_check_fails_on_a_mismatch(monkeypatch, capsys):
    from kq import backends

    def broken_probe():
        def run(indices, scores, slot_table, **options):
            out = kq.route_shed_oracle(indices, scores, slot_table, **options)
            with np.errstate(over="ignore"):  # the largest float's next one up is inf
                return out._replace(mix=np.nextafter(out.mix, np.float32(np.inf)))  # one ulp off everywhere

        return run, "cpu"

    monkeypatch.setattr(backends, "BACKENDS", (backends.Backend("off-by-one-ulp", broken_probe),))
    assert main(["check", "--random-rows", "10"]) == 1
    assert "off-by-one-ulp" in capsys.readouterr().out


def test_bench_smoke_writes_json_and_plot(tmp_path, capsys):
    json_path, plot_path = tmp_path / "bench.json", tmp_path / "bench.png"
    assert main(["bench", "--sets", "tiny", "--repeats", "1", "--no-progress", "--backends", "numpy-oracle",
                 "jax-reference", "jax-naive", "mlx-ops", "metal-source-cpu", "--json", str(json_path),
                 "--plot", str(plot_path)]) == 0
    results = json.loads(json_path.read_text())["results"]
    assert {r["backend"] for r in results} == {"numpy-oracle", "jax-reference", "jax-naive", "mlx-ops",
                                               "metal-source-cpu"}
    assert all(r["per_call_us"] >= 0 and r["rows"] == 4 for r in results)
    exact = {r["backend"]: r["bits_exact"] for r in results}
    assert exact == {"numpy-oracle": None, "jax-naive": None, "jax-reference": True, "mlx-ops": True,
                     "metal-source-cpu": True}
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "per call us" in capsys.readouterr().out


def test_the_plot_draws_each_floor_it_lists_once_per_framework():
    """A floor at a single row count is still drawn (as a tick), and frameworks' launch floors are not mixed."""
    from kq.bench.kernels import Result, plot_floors

    def result(backend, rows, launch, bandwidth=None):
        return Result(backend, "cpu", "decode", rows, 8, 64, 1.0, 1.0, launch_floor_us=launch,
                      bandwidth_floor_us=bandwidth)

    floors = plot_floors([result("jax-reference", 1, 5.0, 0.1), result("jax-naive", 1, 4.0, 0.1),
                          result("mlx-ops", 1, 20.0), result("mlx-ops", 8, 21.0), result("numpy-oracle", 1, None)])
    assert floors == {("bandwidth floor (cpu)", "k--"): [(1, 0.1)], ("launch floor (jax)", "k:"): [(1, 4.0)],
                      ("launch floor (mlx)", "k:"): [(1, 20.0), (8, 21.0)]}


def test_bench_times_shapes_of_ones_own(tmp_path):
    json_path = tmp_path / "bench.json"
    assert main(["bench", "--shapes", "3x5x40", "2X1x7", "--repeats", "1", "--no-progress", "--backends",
                 "jax-reference", "--json", str(json_path)]) == 0
    results = json.loads(json_path.read_text())["results"]
    assert [(r["shape_set"], r["rows"], r["top_k"], r["experts"]) for r in results] == [
        ("custom", 3, 5, 40), ("custom", 2, 1, 7)]
    assert all(r["bits_exact"] for r in results)


@pytest.mark.parametrize("shape", ["3x5", "3x0x40", "3x65x40", "ax5x40", "1x8x99999999999", "99999999999x8x64",
                                   "1x8x2147483648", "1000000x8x4096"])
def test_bench_refuses_a_malformed_shape(shape, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--shapes", shape])
    assert exit_info.value.code == 2 and "--shapes" in capsys.readouterr().err


def test_bench_bit_check_reports_a_wrong_bit(rng):
    from kq.bench.kernels import _bits_exact

    inputs = router_inputs(rng, 6, 8, 64)
    expected = route_shed_oracle(*inputs)
    assert _bits_exact("jax-reference", inputs, expected)
    expected.mix.view(np.uint32)[2, 3] ^= 1
    assert not _bits_exact("jax-reference", inputs, expected)


def test_kernel_events_are_the_gpu_stream_lines_only():
    from kq.bench.kernels import kernel_events_in_trace

    def meta(pid, tid, kind, name):
        return {"ph": "M", "pid": pid, "tid": tid, "name": kind, "args": {"name": name}}

    events = [
        meta(1, 0, "process_name", "/host:CPU"), meta(1, 5, "thread_name", "python"),
        meta(2, 0, "process_name", "/device:GPU:0"), meta(2, 7, "thread_name", "Stream #14(Kernel)"),
        meta(2, 8, "thread_name", "XLA Ops"),
        {"ph": "X", "pid": 2, "tid": 7, "dur": 3.5, "name": "route_shed_k8"},
        {"ph": "X", "pid": 2, "tid": 7, "dur": 1.25, "name": "fusion"},
        {"ph": "X", "pid": 2, "tid": 8, "dur": 4.75, "name": "custom-call"},  # the same time, annotated
        {"ph": "X", "pid": 1, "tid": 5, "dur": 100.0, "name": "PjitFunction"},
    ]
    kernels = kernel_events_in_trace(events)
    assert [k["name"] for k in kernels] == ["route_shed_k8", "fusion"]
    assert sum(k["dur"] for k in kernels) == 4.75
    assert kernel_events_in_trace(events[:2] + events[-1:]) == []


def test_readme_example_row():
    """The row drawn in the README, computed."""
    table = np.full(10, -1, np.int32)
    table[7], table[3] = 2, 0
    out = kq.route_shed(np.array([[7, 5, 3, 9]], np.int32), np.array([[0.4, 0.3, 0.2, 0.1]], np.float32), table)
    assert out.slots.tolist() == [[2, 2, 0, 2]]
    np.testing.assert_allclose(out.mix, [[0.4 / 0.6, 0, 0.2 / 0.6, 0]], rtol=1e-6)
    assert out.miss_ids.tolist() == [[5, 9, -1, -1]]
    np.testing.assert_array_equal(out.miss_scores, np.array([[0.3, 0.1, 0, 0]], np.float32))


def test_demo_runs_both_frameworks_small(tmp_path, capsys):
    pytest = __import__("pytest")
    pytest.importorskip("mlx_lm")
    pytest.importorskip("jax")
    plot = tmp_path / "demo.png"
    assert main(["demo", "--random", "--layers", "2", "--experts", "16", "--top-k", "4", "--hidden", "32", "--ffn", "16",
                 "--steps", "12", "--residency", "0.5", "--plot", str(plot)]) == 0
    out, err = capsys.readouterr()
    for phase in ("writing the random checkpoint", "jax: building the stack and compiling",
                  "mlx: decoding 12 steps resident, then streamed"):
        assert f"kq demo: {phase}" in err, err
    assert "jax " in out and "mlx " in out and "hit rate steady" in out
    # Two tables within 100 columns, then what each column is (the divergence's scale among them).
    assert max(len(line) for line in out.splitlines()) <= 100, out
    flat = " ".join(out.split())
    assert "divergence mean, max" in flat and "0 is the resident output" in flat and "evicting by lfu (" in flat
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_demo_with_every_expert_resident_does_not_diverge():
    from kq.demo_random import DemoConfig, run

    cfg = DemoConfig(layers=2, experts=8, top_k=2, hidden=16, ffn=8, steps=6, residency=1.0, frameworks=("jax",),
                     queue_depth=0)
    (trace,) = run(cfg)
    # Cold arena first; once every expert has landed, streamed == resident bit for bit. Reads run inline
    # (queue_depth=0), so when they land does not depend on how busy the machine is.
    assert trace.hit_rate[-1] == 1.0 and trace.divergence[-1] == 0.0


def test_check_refuses_an_unknown_backend_listing_the_names(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["check", "--backends", "foo"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "invalid choice: 'foo'" in err and "jax-reference" in err


def test_bench_command_refuses_an_unknown_backend_naming_the_argument(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--backends", "nonexistent", "--no-progress"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--backends" in err and "'nonexistent'" in err
    assert "numpy-oracle" in err and "jax-reference" in err


def test_study_help_explains_every_option_and_shows_the_choices(capsys):
    with pytest.raises(SystemExit):
        main(["study", "--help"])
    out = capsys.readouterr().out
    assert "--tier-bits {2,3,4,8}" in out and "--tier-group-size {32,64,128}" in out
    # Each option's help follows its flags (on the same line or the next): text, not the next option.
    for flags in (r"--policies \{lfu,lru\} \[\{lfu,lru\} \.\.\.\]", r"--no-progress"):
        assert re.search(flags + r"\s+[A-Za-z(]", out), flags


def test_bench_refuses_an_unknown_backend_listing_the_names():
    """A misspelt backend gets the names this machine has, though the run starts only the frameworks
    the requested backends need."""
    from kq.bench.kernels import run

    with pytest.raises(ValueError, match="'jax-refrence'") as error:
        run(backends=["jax-refrence"], progress=False)
    assert "jax-reference" in str(error.value) and "mlx-ops" in str(error.value)
    with pytest.raises(ValueError, match="'nonsense'") as error:
        run(backends=["nonsense"], progress=False)
    assert "jax-reference" in str(error.value) and "mlx-ops" in str(error.value)


@pytest.mark.parametrize("every_dtype", [True, False])
@pytest.mark.parametrize("rows", [0, 1, 7, 4096])
def test_check_runs_exactly_the_random_rows_asked_for(rows, every_dtype):
    from kq.check import random_cases

    assert sum(inputs[0].shape[0] for _, inputs in random_cases(0, rows, every_dtype=every_dtype)) == rows


def test_check_gives_an_interpreted_backend_fewer_random_shapes_unless_thorough():
    from kq import backends
    from kq.check import QUICK_RANDOM_ROWS, random_cases, run_checks
    from kq_core.spec import load_spec

    seen = {}

    def counting_probe(name):
        def probe():
            def run(indices, scores, slot_table, **options):
                seen[name].add((indices.shape[-1], indices.dtype.name, scores.dtype.name, slot_table.shape[0]))
                return kq.route_shed_oracle(indices, scores, slot_table, **options)
            seen[name] = set()
            return run, "cpu"
        return probe

    chosen = (backends.Backend("compiled", counting_probe("compiled")),
              backends.Backend("interpreted", counting_probe("interpreted"), interpreted=True))
    golden = len(load_spec().cases)
    quick = run_checks(chosen, random_rows=4096)
    assert [r.random_rows for r in quick] == [4096, QUICK_RANDOM_ROWS]
    assert quick[0].run == golden + len(list(random_cases(0, 4096)))
    assert quick[1].run == golden + len(list(random_cases(0, QUICK_RANDOM_ROWS, every_dtype=False))) < quick[0].run
    assert all(r.ok for r in quick)
    thorough = run_checks(chosen, random_rows=4096, thorough=True)
    assert [r.random_rows for r in thorough] == [4096, 4096] and thorough[0].run == thorough[1].run


@pytest.mark.parametrize("argv, message", [
    (["--residency", "2"], "--residency"), (["--residency", "-0.5"], "--residency"),
    (["--top-k", "100"], "--top-k"), (["--experts", "4"], "--top-k"), (["--steps", "0"], "--steps"),
    (["--keep-mass", "1.5"], "--keep-mass"), (["--read-budget", "-1"], "--read-budget"),
])
def test_demo_refuses_bad_options_naming_them(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--random", *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("rule", ["shed", "route_shed", "exact"])
def test_demo_refuses_tier_bits_without_the_tier_rule(rule, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--rule", rule, "--tier-bits", "3"])
    assert exit_info.value.code == 2 and "--tier-bits serves the misses of --rule tier" in capsys.readouterr().err


def test_a_demo_config_is_rebuilt_as_it_was():
    import dataclasses

    from kq.demo import ModelDemoConfig
    from kq_host.tier import DEFAULT_TIER_BITS

    for rule in ("shed", "tier"):
        config = ModelDemoConfig(rule=rule, frameworks=("jax",))
        assert dataclasses.replace(config, tokens=5).tier_bits == config.tier_bits == (
            DEFAULT_TIER_BITS if rule == "tier" else None)


def test_demo_generate_and_study_default_to_the_one_tier(capsys):
    """kq demo's tier is kq generate's and kq study's where none is asked for, and each --help says so."""
    from kq.demo import ModelDemoConfig
    from kq_host.tier import DEFAULT_TIER_BITS, DEFAULT_TIER_GROUP_SIZE

    assert ModelDemoConfig(frameworks=("jax",)).tier_bits == DEFAULT_TIER_BITS
    for command in ("demo", "generate", "study"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        out = " ".join(capsys.readouterr().out.split())
        bits = re.search(r"--tier-bits \{[\d,]+\} (.*?) --", out)[1]
        assert re.search(rf"\(default {DEFAULT_TIER_BITS}\b", bits), (command, bits)
        if command != "demo":
            size = re.search(r"--tier-group-size \{[\d,]+\} (.*?) --", out)[1]
            assert re.search(rf"\(default {DEFAULT_TIER_GROUP_SIZE}\)", size), (command, size)


def test_demo_help_explains_its_columns_and_files(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = capsys.readouterr().out
    assert "divergence" in out and "over-budget" in out and "boundary ms/step" in out and "temporary" in out
    assert "shipped model" in out and "--random" in out


def _demo_own_lines(out: str) -> list[str]:
    """The lines ``kq demo`` writes itself: its header and each framework's figures (not the generated texts)."""
    header, *frameworks = out.split("\n== ")
    return header.splitlines() + [line for block in frameworks if "figures" in block.splitlines()[0]
                                  for line in block.splitlines()]


def test_demo_generates_with_the_shipped_model_through_a_quarter_arena(capsys):
    pytest.importorskip("jax")
    pytest.importorskip("tokenizers")
    assert main(["demo", "--frameworks", "jax", "--tokens", "6"]) == 0
    out, err = capsys.readouterr()
    # Each slow phase is named on stderr as it starts (as kq check's progress is), in the order they run.
    from kq_host.tier import DEFAULT_TIER_BITS

    phases = ["jax: loading the model", f"jax: building the {DEFAULT_TIER_BITS}-bit tier", "jax: compiling",
              "jax: generating 6 tokens with every expert resident"]
    lines = [line for line in err.splitlines() if line.startswith("kq demo: ")]
    assert len(lines) == len(phases) and all(line.startswith(f"kq demo: {phase}")
                                             for line, phase in zip(lines, phases)), err
    assert "through the arena (16 slots per layer)" in out and "every expert resident" in out and "hit rate" in out
    # Before any text: the lossy rule's text may differ, and how to get the resident model's word for word.
    note = out.index("may differ from the resident model's")
    assert note < out.index("== jax") and "--rule exact" in out[:out.index("== jax")]
    assert f"{DEFAULT_TIER_BITS}-bit copy" in out and "experts in memory" in out
    # With the tier no routed weight goes unserved; shedding leaves some. Each figure says what it is.
    assert re.search(r"gate weight not run +0\.000 of \d\.\d{3} +per token, summed over the 4 layers", out), out
    assert "evicting by lfu: the least frequently used expert" in out
    assert all(len(line) <= 100 for line in _demo_own_lines(out)), out
    assert main(["demo", "--frameworks", "jax", "--tokens", "6", "--rule", "shed"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"gate weight not run +0\.\d*[1-9]\d* of", out) and "each run from its" not in out, out


@pytest.mark.parametrize("framework", ["jax", "mlx"])
def test_demo_exact_gives_the_resident_text_through_a_quarter_arena(framework, capsys):
    pytest.importorskip({"jax": "jax", "mlx": "mlx_lm"}[framework])
    pytest.importorskip("tokenizers")
    assert main(["demo", "--frameworks", framework, "--tokens", "8", "--rule", "exact"]) == 0
    out, err = capsys.readouterr()
    assert f"kq demo: {framework}: loading the model" in err and f"kq demo: {framework}: compiling" in err
    assert "the exact loop (16 slots per layer)" in out and "every expert resident (the same text)" in out
    assert all(len(line) <= 100 for line in _demo_own_lines(out)), out
    out = " ".join(out.split())  # the figures' explanations wrap
    assert "expert reads per token waited for" in out and "experts in memory 3.0 MiB" in out
    # Every prefetch is in one category, so the printed counts add up.
    counts = re.search(r"prefetches \d+ started over the 8 tokens: (\d+) started(?: \+ (\d+) still unused from the prompt)? = "
                       r"(\d+) used \+ (\d+) late .*?\+ (\d+) wasted .*?\+ (\d+) still unused at the end", out)
    assert counts, out
    started, from_prompt, used, late, wasted, unused = (int(n or 0) for n in counts.groups())
    assert started > 0 and started + from_prompt == used + late + wasted + unused
    # The hit rate says what it counts: a late prefetch is a miss; counted as a hit, the rate is the predictions'.
    rates = re.search(rf"hit rate (\d\.\d+) .*? hit rate, late as hits (\d\.\d+) the same, counting the {late} "
                      rf"late prefetches as hits", out)
    assert rates, out
    assert float(rates[2]) >= float(rates[1]) and "how fast" in out


def test_bench_host_times_the_token_boundary(monkeypatch, tmp_path, capsys):
    from kq.bench import host

    monkeypatch.setattr(host, "HOST_SHAPES", ((2, 16, 4, 4, 1), (2, 16, 4, 4, 3)))
    json_path = tmp_path / "host.json"
    assert main(["bench", "--sets", "host", "--no-progress", "--json", str(json_path)]) == 0
    results = json.loads(json_path.read_text())["results"]
    impls = host.implementations()
    assert impls[0] == "numpy" and len(results) == 2 * len(impls)
    assert [(r["layers"], r["rows"], r["impl"]) for r in results] == [(2, rows, impl) for rows in (1, 3)
                                                                     for impl in impls]
    assert all(r["median_ms"] > 0 and r["reads_per_token"] > 0 and 0 < r["hit_rate"] < 1 for r in results)
    for shape in (results[:len(impls)], results[len(impls):]):  # same trace, same decisions: same reads
        assert len({(r["reads_per_token"], r["hit_rate"]) for r in shape}) == 1
        assert shape[0]["vs_numpy"] == 1.0
    assert "ms/token" in capsys.readouterr().out


def test_bench_compile_counts_kernels_per_bucket(monkeypatch, tmp_path, capsys):
    pytest.importorskip("jax")
    from kq.bench import compiles
    from kq_jax.pallas_config import row_bucket

    monkeypatch.setattr(compiles, "INTERPRETER_SIZES", dict(count=3, max_rows=16, boundary_rows=(9,)))
    monkeypatch.setattr(compiles, "OPS", ("route_shed",))
    json_path = tmp_path / "compile.json"
    assert main(["bench", "--sets", "compile", "--no-progress", "--json", str(json_path)]) == 0
    result = json.loads(json_path.read_text())
    counts = result["row_counts"]
    assert counts == result["row_counts_planned"] and len(counts) == 3 and all(1 <= c <= 16 for c in counts)
    calls = result["first_calls"]
    assert all(c["bits_exact"] for c in calls)
    eager = {b: [c for c in calls if c["mode"] == "eager" and c["buckets"] == b] for b in (True, False)}
    # Exact-size launches compile per row count; bucketed ones at most once per bucket (and none for a
    # bucket an earlier call of this process compiled).
    assert sum(c["kernels_compiled"] for c in eager[False]) == len(counts)
    assert sum(c["kernels_compiled"] for c in eager[True]) <= len({row_bucket(c) for c in counts})
    [boundary] = result["boundary"]
    assert boundary["rows"] == 9 and boundary["launch_rows"] == 12 and boundary["bucketed_us"] > 0
    assert "first call per new row count" in capsys.readouterr().out


def test_bench_decode_e2e_runs_every_mode_in_one_loop(monkeypatch, tmp_path, capsys):
    """Tiny models through the engine loop: every mode on recorded routing and on the random stack, at two
    residencies; a full arena hits every time and reads nothing, the exact mode reads its misses on the
    critical path and runs those tokens again (exact-fetch reads them inside its one pass), the lossy and tier
    modes read in the background."""
    pytest.importorskip("jax")
    pytest.importorskip("safetensors")
    from kq.bench import decode_e2e

    monkeypatch.setitem(decode_e2e.RECORDED_MODELS, "tiny", ("stdlib-moe", 2, 32, 32))
    monkeypatch.setitem(decode_e2e.RANDOM_MODELS, "tiny-random", (2, 8, 2, 32, 32))
    monkeypatch.setattr(decode_e2e, "CPU_MODELS", ("tiny", "tiny-random"))
    monkeypatch.setattr(decode_e2e, "GPU_MODELS", ("tiny", "tiny-random"))
    monkeypatch.setattr(decode_e2e, "RESIDENCIES", (1.0, 0.25))
    monkeypatch.setattr(decode_e2e, "run", functools.partial(decode_e2e.run, tokens=6, warmup=3))
    json_path = tmp_path / "decode.json"
    assert main(["bench", "--sets", "decode-e2e", "--no-progress", "--json", str(json_path)]) == 0
    out = capsys.readouterr()
    assert "x resident" in out.out and "tiny exact residency=25%" in out.err  # a line per run as it ends
    rows = json.loads(json_path.read_text())["results"]
    modes = {"tiny": ("lossy", "tier", "exact", "exact-fetch"),
             "tiny-random": ("lossy", "exact", "exact-fetch")}  # no tier on a routed model
    assert [(r["model"], r["mode"], r["residency"]) for r in rows] == [
        (model, mode, residency) for model in ("tiny", "tiny-random")
        for mode, residency in [("resident", 1.0)] + [(m, res) for res in (1.0, 0.25) for m in modes[model]]]
    by = {(r["model"], r["mode"], r["residency"]): r for r in rows}
    for model in ("tiny", "tiny-random"):
        for mode in modes[model]:
            full, quarter = by[model, mode, 1.0], by[model, mode, 0.25]
            assert full["hit_rate"] == 1.0 and full["mib_read_per_token"] == 0.0
            assert quarter["hit_rate"] < 1.0 and quarter["mib_read_per_token"] > 0.0
            assert 0.0 <= quarter["publish_ms"] <= quarter["boundary_ms"] and quarter["tokens"] == 6
            assert (quarter["critical_reads_per_token"] > 0) == mode.startswith("exact")
            assert (quarter["reruns_per_token"] > 0) == (mode == "exact")  # exact-fetch reads in its one pass
    assert by["tiny", "tier", 0.25]["memory_gib"] > by["tiny", "lossy", 0.25]["memory_gib"]
    assert all(row["tokens_per_s"] > 0 and row["floor_tokens_per_s"] > 0 for row in rows)
    assert {(row["model"], row["routing"], row["checkpoint"]) for row in rows} == {
        ("tiny", "recorded", "stdlib-moe"), ("tiny-random", "random", None)}


@pytest.fixture(scope="module")
def broken_inputs(tmp_path_factory):
    """Checkpoints and texts a user may hand `kq study` and `kq demo` by mistake, by name."""
    from kq.study import SHIPPED_MODEL

    root = tmp_path_factory.mktemp("broken")
    config = json.loads((SHIPPED_MODEL / "config.json").read_text())
    for name, text in {"not-json": "{model_type: qwen3_moe", "a-list": "[1, 2]",
                       "no-model-type": json.dumps({k: v for k, v in config.items() if k != "model_type"}),
                       "no-num-experts": json.dumps({k: v for k, v in config.items() if k != "num_experts"}),
                       "no-tokenizer": json.dumps(config)}.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(text)
        if name != "no-tokenizer":
            (root / name / "tokenizer.json").symlink_to(SHIPPED_MODEL / "tokenizer.json")
    (root / "empty.txt").write_text("")
    (root / "short.txt").write_text("x = 1")
    (root / "binary.txt").write_bytes(bytes(range(256)) * 4)
    (root / "a-directory.txt").mkdir()
    return root


STUDY_RUN = ["study", "--tokens", "4", "--warmup", "2", "--residency", "1", "--rules", "shed", "--policies", "lfu",
             "--no-progress"]
RANDOM_DEMO = ["demo", "--random", "--frameworks", "jax", "--steps", "2"]


@pytest.mark.parametrize("argv, message", [
    pytest.param(["demo", "--checkpoint", "{root}/nope"], "--checkpoint", id="demo-missing-checkpoint"),
    pytest.param(["demo", "--checkpoint", "{root}/not-json"], "--checkpoint", id="demo-malformed-config"),
    pytest.param(["demo", "--prompt", ""], "--prompt", id="demo-empty-prompt"),
    pytest.param(["demo", "--top-k", "100"], "--top-k only applies with --random", id="demo-top-k-without-random"),
    pytest.param(["demo", "--steps", "0"], "--steps only applies with --random", id="demo-steps-without-random"),
    pytest.param(["demo", "--random", "--tier-bits", "3"], "--tier-bits does not apply with --random",
                 id="demo-tier-bits-with-random"),
    pytest.param([*RANDOM_DEMO, "--plot", "{root}/nodir/demo.png"], "--plot", id="demo-plot-into-missing-dir"),
    pytest.param([*STUDY_RUN, "--checkpoint", "{root}/not-json"], "cannot be read as JSON", id="study-malformed-config"),
    pytest.param([*STUDY_RUN, "--checkpoint", "{root}/a-list"], "a JSON object", id="study-config-not-an-object"),
    pytest.param([*STUDY_RUN, "--checkpoint", "{root}/no-model-type"], "model_type", id="study-no-model-type"),
    pytest.param([*STUDY_RUN, "--checkpoint", "{root}/no-num-experts"], "num_experts", id="study-missing-key"),
    pytest.param([*STUDY_RUN, "--checkpoint", "{root}/no-tokenizer"], "tokenizer.json", id="study-no-tokenizer"),
    pytest.param([*STUDY_RUN, "--text", "{root}/nope.txt"], "--text", id="study-missing-text"),
    pytest.param([*STUDY_RUN, "--text", "{root}/a-directory.txt"], "--text", id="study-text-is-a-directory"),
    pytest.param([*STUDY_RUN, "--text", "{root}/empty.txt"], "--text", id="study-empty-text"),
    pytest.param([*STUDY_RUN, "--text", "{root}/short.txt"], "--text", id="study-short-text"),
    pytest.param([*STUDY_RUN, "--text", "{root}/binary.txt"], "--text", id="study-binary-text"),
    pytest.param([*STUDY_RUN, "--json", "{root}/nodir/study.json"], "--json", id="study-json-into-missing-dir"),
    pytest.param([*STUDY_RUN, "--plot", "{root}/empty.txt/study.png"], "--plot", id="study-plot-under-a-file"),
    pytest.param(["bench", "--backends", "numpy-oracle", "--json", "{root}/nodir/b.json"], "--json",
                 id="bench-json-into-missing-dir"),
    pytest.param(["bench", "--backends", "numpy-oracle", "--resident-fraction", "2"], "--resident-fraction",
                 id="bench-resident-fraction-above-one"),
    pytest.param(["bench", "--backends", "numpy-oracle", "--resident-fraction", "nan"], "--resident-fraction",
                 id="bench-resident-fraction-nan"),
    pytest.param(["study", "--framework", "mlx", "--rules", "shed", "prior", "--tokens", "4", "--warmup", "2"],
                 "JAX only", id="study-jax-only-rule-through-mlx"),
    pytest.param(["study", "--framework", "mlx", "--rules", "shed", "--tokens", "4", "--warmup", "2", "--lookahead",
                  "1"], "--lookahead", id="study-lookahead-through-mlx"),
    pytest.param([*STUDY_RUN, "--lookahead", "3"], "--lookahead", id="study-lookahead-three-layers"),
    pytest.param([*STUDY_RUN, "--prefetch-budget", "2"], "--prefetch-budget", id="study-budget-without-lookahead"),
    pytest.param([*STUDY_RUN, "--lookahead", "1", "--prefetch-budget", "0"], "--prefetch-budget",
                 id="study-budget-zero"),
])
def test_bad_inputs_are_refused_naming_them_before_any_run(argv, message, broken_inputs, capsys):
    pytest.importorskip("jax")
    pytest.importorskip("tokenizers")
    with pytest.raises(SystemExit) as exit_info:
        main([arg.format(root=broken_inputs) for arg in argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err, err
    assert "Traceback" not in err


def test_the_study_replays_the_exact_loop_with_look_ahead(tmp_path, capsys):
    pytest.importorskip("jax")
    pytest.importorskip("tokenizers")
    path = tmp_path / "study.json"
    argv = ["study", "--tokens", "24", "--warmup", "4", "--residency", "0.25", "--rules", "stall", "--policies", "lru",
            "lfu", "--lookahead", "1", "2", "--prefetch-budget", "2", "--no-progress", "--json", str(path)]
    assert main(argv) == 0
    assert "lands before layer l+1 routes" in capsys.readouterr().out
    rows = json.loads(path.read_text())["lookahead"]["rows"]
    assert sorted({(r["policy"], r["lookahead"], r["budget"]) for r in rows}, key=str) == sorted(
        {(p, d, b) for p in ("lru", "lfu") for d in (0, 1, 2) for b in ((None,) if d == 0 else (None, 2))}, key=str)
    for r in rows:
        assert r["hits"] + r["critical_reads"] == r["lookups"] == 24 * 4 * 8  # tokens x layers x top-k
        assert (r["prefetches"] > 0) == (r["lookahead"] > 0)
        if r["budget"] is not None:
            assert r["prefetches"] <= 24 * 3 * 2 * r["lookahead"]  # at most 2 a layer and token, per layer ahead


def test_the_bench_refuses_a_resident_fraction_outside_zero_one():
    from kq.bench.kernels import run

    for fraction in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="resident_fraction"):
            run(backends=["numpy-oracle"], resident_fraction=fraction, progress=False)


def test_generate_refuses_a_prompt_without_tokens():
    pytest.importorskip("jax")
    pytest.importorskip("tokenizers")
    from kq.demo import generate_through_arena
    from kq.study import SHIPPED_MODEL

    with pytest.raises(ValueError, match="prompt"):
        generate_through_arena("jax", SHIPPED_MODEL, "", 2, 0.5)


@pytest.mark.parametrize("argv", [["bench", "--models", "olmoe-size"],
                                  ["bench", "--sets", "host", "--models", "olmoe-size"]],
                         ids=["no-set", "host-set"])
def test_bench_models_belong_to_decode_e2e(argv, capsys):
    assert main(argv) == 2
    assert "--models picks decode-e2e's models" in capsys.readouterr().out



def test_study_long_context_scores_past_the_trained_length_and_says_so(tmp_path, capsys):
    """The shipped model recorded as trained on 8-token sequences: by default 4 warm-up and 6 scored tokens are
    cut into windows within 8 tokens; --long-context decodes them as one window of 10 and labels the table."""
    pytest.importorskip("jax")
    pytest.importorskip("tokenizers")
    from kq.study import SHIPPED_MODEL

    for path in SHIPPED_MODEL.iterdir():
        if path.name != "training.json":
            (tmp_path / path.name).symlink_to(path)
    (tmp_path / "training.json").write_text(json.dumps({"args": {"seq": 8}}))
    argv = ["study", "--checkpoint", str(tmp_path), "--tokens", "6", "--warmup", "4", "--residency", "1", "--rules",
            "shed", "--policies", "lfu", "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Scored in 2 window(s) a stream of at most 8 tokens" in out and "LONG CONTEXT" not in out
    assert main([*argv, "--long-context"]) == 0
    out = capsys.readouterr().out
    assert "LONG CONTEXT: scored in 1 window(s) a stream of up to 10 tokens, past the 8-token sequences" in out
