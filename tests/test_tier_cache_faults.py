"""The tier's cache on disk: a save ended by SIGTERM leaves no temporary behind, an entry is an ordinary file
(0644 under the umask), and an entry that holds a NaN scale is built again, never served."""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from kq_host.expert_store import ExpertStore
from kq_host.tier import build_tier
from tiny_models import PROJECTIONS, write_per_expert_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def _build(checkpoint, cache, **options):
    with ExpertStore(checkpoint) as store:
        return build_tier(store, 2, 4, cache_dir=cache, **options)


def _terminating_savez(monkeypatch, calls):
    """np.savez that writes a little, then has SIGTERM sent to this process, then writes the rest."""
    savez = np.savez

    def terminated(out, **arrays):
        out.write(b"PK")
        calls.append("savez")
        os.kill(os.getpid(), signal.SIGTERM)
        return savez(out, **arrays)

    monkeypatch.setattr(np, "savez", terminated)


def test_sigterm_during_the_save_leaves_no_temporary_and_ends_the_process_as_sigterm_does(tmp_path):
    """``timeout`` ends a run with SIGTERM: a save then in progress removes its temporary and the process still
    ends as SIGTERM ends it (SIGINT had cleaned up, SIGTERM had left a ``.tier_*.npz.*.tmp`` nothing removed)."""
    script = textwrap.dedent("""
        import os, signal, sys
        from pathlib import Path
        import numpy as np
        import kq_host.tier as tier
        savez = np.savez
        def terminated(out, **arrays):
            out.write(b"PK")
            os.kill(os.getpid(), signal.SIGTERM)
            return savez(out, **arrays)
        np.savez = terminated
        weights = {"gate_proj": tier.quantize(np.ones((4, 32), np.float32), bits=3, group_size=32)}
        tier._save(Path(sys.argv[1]) / "tier_entry.npz", weights, {"version": "test"})
        print("saved")
    """)
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == -signal.SIGTERM, (run.returncode, run.stderr)
    assert "saved" not in run.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither a temporary nor a half-written entry


def test_a_programs_own_sigterm_handler_runs_once_and_the_aborted_save_leaves_the_tier_uncached(
        tmp_path, rng, monkeypatch):
    """A program that handles SIGTERM and goes on: its handler is called, the save is dropped with its temporary
    (the tier returned uncached, with a warning), and its handler is in place again afterwards."""
    checkpoint = write_per_expert_checkpoint(tmp_path / "ckpt", rng)
    handled = []

    def handler(signum, frame):
        handled.append(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        calls = []
        _terminating_savez(monkeypatch, calls)
        with pytest.warns(UserWarning, match="could not cache the tier"):
            tier = _build(checkpoint, tmp_path / "cache")
        assert signal.getsignal(signal.SIGTERM) is handler
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert calls == ["savez"] and handled == [signal.SIGTERM]
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == []
    monkeypatch.undo()
    again = _build(checkpoint, tmp_path / "cache")  # built and cached now
    assert len(list((tmp_path / "cache").iterdir())) == 1
    for name in PROJECTIONS:
        for got, want in zip(again.weights[name], tier.weights[name]):
            assert got.tobytes() == want.tobytes()


def test_a_save_leaves_the_sigterm_disposition_as_it_found_it(tmp_path, rng):
    checkpoint = write_per_expert_checkpoint(tmp_path / "ckpt", rng)
    before = signal.getsignal(signal.SIGTERM)
    _build(checkpoint, tmp_path / "cache")
    assert signal.getsignal(signal.SIGTERM) == before


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_a_cached_entry_is_an_ordinary_file_under_the_umask(tmp_path, rng, umask, mode):
    """An entry is created as open() creates a file, 0666 less the umask (the temporary's 0600 had been kept)."""
    checkpoint = write_per_expert_checkpoint(tmp_path / "ckpt", rng)
    previous = os.umask(umask)
    try:
        _build(checkpoint, tmp_path / "cache")
    finally:
        os.umask(previous)
    (entry,) = (tmp_path / "cache").iterdir()
    assert entry.stat().st_mode & 0o777 == mode


@pytest.mark.parametrize("field", ["scales", "biases"])
def test_a_cached_entry_holding_a_nan_scale_is_built_again_not_served(tmp_path, rng, field):
    """An entry whose meta and shapes answer the request but whose scale (or bias) is NaN, as a damaged disk or
    an edit leaves it: built again with a warning, never handed out (a NaN scale makes its misses NaN)."""
    checkpoint = write_per_expert_checkpoint(tmp_path / "ckpt", rng)
    want = _build(checkpoint, tmp_path / "cache")
    (entry,) = (tmp_path / "cache").iterdir()
    with np.load(entry) as cached:
        arrays = {name: cached[name] for name in cached.files}
    damaged = arrays[f"up_proj.{field}"].copy()
    damaged[1, 2, 3, 0] = 0x7FC0  # bfloat16 NaN
    arrays[f"up_proj.{field}"] = damaged
    with open(entry, "wb") as out:
        np.savez(out, **arrays)
    with pytest.warns(UserWarning, match=rf"up_proj.{field} holds a value that is not finite.*building it again"):
        got = _build(checkpoint, tmp_path / "cache")
    for name in PROJECTIONS:
        for a, b in zip(got.weights[name], want.weights[name]):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    again = _build(checkpoint, tmp_path / "cache")  # the entry written again, finite: served
    assert np.isfinite(again.weights["up_proj"].scales.astype(np.float32)).all()
