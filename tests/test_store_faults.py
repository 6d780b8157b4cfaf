"""The expert store on a failing disk: a read's OSError becomes the store's own error naming the file, tensor,
layer and expert, and the commands that build a tier from the store (``kq study --rules tier``, ``kq demo``) end
at it in one line (exit 1), never a traceback."""

import errno
import os

import numpy as np
import pytest

from kq_host.expert_store import ExpertReadError, ExpertStore, ExpertStoreError
from tiny_models import PROJECTIONS, write_per_expert_checkpoint



def _failing(monkeypatch, name, *, after=0):
    """``os.<name>`` raising EIO from its ``after``-th call on, as a failing disk's read does."""
    calls, real = [], getattr(os, name)

    def failing(*args):
        calls.append(args)
        if len(calls) > after:
            raise OSError(errno.EIO, "Input/output error")
        return real(*args)

    monkeypatch.setattr(os, name, failing)
    return calls


@pytest.mark.parametrize("allocator", [None, "fresh"], ids=["pread", "preadv"])
def test_a_read_error_is_the_stores_own_error_naming_file_tensor_layer_and_expert(tmp_path, rng, monkeypatch,
                                                                                 allocator):
    weights = write_per_expert_checkpoint(tmp_path / "ckpt", rng) / "model.safetensors"
    host_allocator = None if allocator is None else (lambda shape, dtype: np.empty(shape, dtype))
    with ExpertStore(tmp_path / "ckpt", host_allocator=host_allocator) as store:
        want = store.read_expert(1, 2)
        _failing(monkeypatch, "pread" if allocator is None else "preadv", after=1)  # up_proj's read fails
        with pytest.raises(ExpertReadError) as caught:
            store.read_expert(1, 2)
        message = str(caught.value)
        assert isinstance(caught.value, ExpertStoreError)  # what callers of the store already catch
        for part in (str(weights), "model.layers.1.mlp.experts.2.up_proj.weight", "expert 2 of layer 1",
                     "Input/output error"):
            assert part in message, message
        assert store.submit(1, 3).exception() is not None  # through the pool as well
        monkeypatch.undo()
        got = store.read_expert(1, 2)  # the store reads again once the disk does
    for name in PROJECTIONS:
        assert got[name].tobytes() == want[name].tobytes()


def test_a_file_changed_after_its_header_was_read_is_a_read_error(tmp_path, rng):
    weights = write_per_expert_checkpoint(tmp_path / "ckpt", rng) / "model.safetensors"
    with ExpertStore(tmp_path / "ckpt") as store:
        os.truncate(weights, 1000)
        with pytest.raises(ExpertReadError, match="changed after its header was read"):
            store.read_expert(0, 0)


def _ended(capsys, argv):
    from kq.cli import main

    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, err.strip().splitlines()[-1]


@pytest.mark.parametrize("command", ["study-jax", "study-mlx", "demo"])
def test_a_read_error_building_the_tier_ends_kq_study_and_kq_demo_in_one_line(tmp_path, monkeypatch, capsys,
                                                                            command):
    """The tier is built from the checkpoint's experts through the store before the arena reads any: a disk error
    there ends the command at once, exit 1, naming the file and the tensor (it had escaped as a traceback)."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("jax" if command == "study-jax" else "mlx_lm")
    from kq.study import SHIPPED_MODEL

    monkeypatch.setenv("KQ_CACHE_DIR", str(tmp_path / "cache"))
    _failing(monkeypatch, "pread")
    if command == "demo":
        argv = ["demo", "--frameworks", "mlx", "--rule", "tier", "--tokens", "2"]
    else:
        argv = ["study", "--framework", command[len("study-"):], "--rules", "tier", "--tokens", "2", "--warmup", "0",
                "--residency", "0.5", "--policies", "lfu", "--no-progress"]
    code, line = _ended(capsys, argv)
    name = command.partition("-")[0]
    assert code == 1 and line.startswith(f"kq {name}: reading experts failed: the tier's build: "), line
    for part in (str(SHIPPED_MODEL / "model.safetensors"), "experts.0.gate_proj.weight", "Input/output error"):
        assert part in line, line
