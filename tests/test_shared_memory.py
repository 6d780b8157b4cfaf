"""kq_host.expert_store's shared-memory and file-identity checks, which the store, the tier and the
residency manager share."""

import os

import numpy as np

from kq_host.expert_store import FileIdentity, file_identity, shared_memory_pairs


def test_overlapping_views_are_paired_by_their_positions():
    buffer = np.arange(64, dtype=np.float32)
    arrays = [buffer[:32], "not an array", buffer[32:], buffer[16:48].reshape(4, 8), buffer[::-1][:8]]
    assert shared_memory_pairs(arrays) == [(0, 3), (2, 3), (2, 4)]


def test_interleaved_views_span_the_same_bytes_and_share_none():
    buffer = np.arange(64, dtype=np.float32)
    assert shared_memory_pairs([buffer[::2], buffer[1::2]]) == []
    assert shared_memory_pairs([buffer[::2], buffer[2::4]]) == [(0, 1)]


def test_separate_and_empty_arrays_share_nothing():
    buffer = np.arange(8, dtype=np.float32)
    assert shared_memory_pairs([buffer, buffer.copy(), buffer[:0], buffer[4:4], None]) == []
    assert shared_memory_pairs([]) == []


def test_a_rewrite_or_a_replacement_changes_the_file_identity(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\x01" * 16)
    before = file_identity(os.stat(path))
    assert isinstance(before, FileIdentity) and before.size == 16 and before.device == os.stat(path).st_dev
    with open(path, "rb") as handle:
        assert file_identity(os.fstat(handle.fileno())) == before
    path.write_bytes(b"\x02" * 24)
    assert file_identity(os.stat(path)) != before
    replacement = tmp_path / "new.bin"
    replacement.write_bytes(b"\x03" * 24)
    os.utime(replacement, ns=(before.mtime_ns, before.mtime_ns))
    os.replace(replacement, path)
    assert file_identity(os.stat(path)).inode != before.inode
