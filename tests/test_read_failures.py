"""A read that fails ends the run that needed it, with its message: ``kq generate`` under every rule, ``kq study``
and ``kq demo`` (whose figures a shed read would change without a word); never a traceback."""

import shutil

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")

from kq.cli import main  # noqa: E402
from kq.study import SHIPPED_MODEL  # noqa: E402
from tiny_models import with_header  # noqa: E402

WEIGHTS = "model.safetensors"


def _relabelled(directory, layers, experts, dtype="F16"):
    """The shipped model in ``directory``, the up projections of ``experts`` in ``layers`` stored as ``dtype``
    (of the same size: their reads fail the arena's dtype check, nothing else changes)."""
    def edit(header):
        for layer in layers:
            for expert in experts:
                header[f"model.layers.{layer}.mlp.experts.{expert}.up_proj.weight"]["dtype"] = dtype

    return with_header(SHIPPED_MODEL, directory, edit)


def _ended(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err.strip().splitlines()[-1]


FRAMEWORKS = ["jax", "mlx"]


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("where", ["after-the-preload", "in-the-preload"])
def test_kq_study_ends_at_a_failed_read_naming_it(tmp_path, capsys, framework, where):
    # a half arena preloads experts 0-31: the reads of 32-63 fail as the text routes to them; expert 7 fails at once
    pytest.importorskip("mlx_lm" if framework == "mlx" else "jax")
    experts = range(32, 64) if where == "after-the-preload" else [7]
    directory = _relabelled(tmp_path / "model", range(4), experts)
    code, line = _ended(capsys, ["study", "--checkpoint", str(directory), "--framework", framework, "--tokens", "32",
                                 "--warmup", "0", "--residency", "0.5", "--policies", "lfu", "--rules", "shed",
                                 "--no-progress"])
    assert code == 1 and line.startswith("kq study: reading experts failed: "), line
    assert "up_proj" in line and "float16" in line, line


@pytest.mark.parametrize("where", ["after-the-preload", "in-the-preload"])
def test_kq_demo_ends_at_a_failed_read_naming_it(tmp_path, capsys, where):
    pytest.importorskip("mlx_lm")
    experts = range(32, 64) if where == "after-the-preload" else [7]
    directory = _relabelled(tmp_path / "model", range(4), experts)
    code, line = _ended(capsys, ["demo", "--checkpoint", str(directory), "--frameworks", "mlx", "--tokens", "24",
                                 "--residency", "0.5", "--rule", "shed"])
    assert code == 1 and line.startswith("kq demo: reading experts failed: "), line
    assert "up_proj" in line and "float16" in line, line


def test_kq_demo_refuses_a_checkpoint_missing_an_expert_by_name(tmp_path, capsys):
    pytest.importorskip("mlx_lm")
    name = "model.layers.2.mlp.experts.7.up_proj.weight"
    directory = with_header(SHIPPED_MODEL, tmp_path / "model",
                             lambda header: header.__setitem__(name.replace("experts.7", "experts.x7"), header.pop(name)))
    with pytest.raises(SystemExit) as caught:
        main(["demo", "--checkpoint", str(directory), "--frameworks", "mlx", "--tokens", "2", "--rule", "shed"])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert caught.value.code == 2 and line.startswith("kq demo: error: --checkpoint: ") and "experts.7" in line, line


@pytest.mark.parametrize("rule", ["shed", "tier"])
def test_kq_generate_under_a_lossy_rule_ends_at_a_failed_read(tmp_path, rule):
    """The model file cut short once the first text comes: every later read fails, and the run ends with the
    read's message (before, shed and tier went on, shedding every miss, and reported a normal run)."""
    pytest.importorskip("mlx_lm")
    from kq.generate import GenerateConfig, generate
    from kq_host.residency import PreloadError

    directory = shutil.copytree(SHIPPED_MODEL, tmp_path / "model")

    def cut(text):
        with open(directory / WEIGHTS, "r+b") as handle:
            handle.truncate(5_000_000)

    config = GenerateConfig(model=directory, prompt="def read_config(path):", max_tokens=64, residency=0.25, rule=rule)
    with pytest.raises(PreloadError, match="changed after its header was read"):
        generate(config, on_text=cut)


def _reads_failing_from(monkeypatch, expert):
    """Every ExpertStore read of an expert numbered ``expert`` or more raises, as a failing disk's would."""
    from kq_host.expert_store import ExpertStore

    read = ExpertStore.read_expert

    def failing(self, layer, which, *args, **kwargs):
        if which >= expert:
            raise OSError(5, "Input/output error")
        return read(self, layer, which, *args, **kwargs)

    monkeypatch.setattr(ExpertStore, "read_expert", failing)


def test_kq_demo_random_ends_at_a_failed_read(monkeypatch, capsys):
    pytest.importorskip("jax")
    _reads_failing_from(monkeypatch, 8)
    code, line = _ended(capsys, ["demo", "--random", "--frameworks", "jax", "--layers", "2", "--experts", "16",
                                 "--top-k", "4", "--hidden", "32", "--ffn", "16", "--steps", "12", "--residency",
                                 "0.5", "--plot", ""])
    assert code == 1 and line.startswith("kq demo: reading experts failed: kq demo --random: "), line
    assert "Input/output error" in line, line


@pytest.mark.parametrize("mode", ["lossy", "tier", "exact"])
def test_decode_e2e_ends_at_a_failed_read(tmp_path, monkeypatch, mode):
    pytest.importorskip("jax")
    import numpy as np

    from kq.bench import decode_e2e
    from kq_host.expert_store import ExpertStore
    from kq_host.residency import PreloadError

    rng = np.random.default_rng(0)
    layers, experts, top_k, hidden, ffn, steps = 2, 8, 2, 32, 32, 6
    weights = decode_e2e.random_experts(layers, experts, hidden, ffn, rng)
    router = (rng.normal(size=(layers, hidden, experts)) * 4).astype(np.float32)
    engine = decode_e2e.Engine(weights, top_k, steps, router=router,
                               tier=decode_e2e.random_tier(layers, experts, hidden, ffn))
    decode_e2e.write_checkpoint(tmp_path, weights)
    _reads_failing_from(monkeypatch, experts // 2)  # the arena starts with experts 0-3: later misses fail
    with ExpertStore(tmp_path, layout="per_expert", projections=decode_e2e.PROJECTIONS) as store:
        with pytest.raises(PreloadError, match=f"decode-e2e {mode}: token .*Input/output error"):
            decode_e2e.run_streamed(engine, store, residency=0.5, mode=mode, warmup=0, experts=experts)
