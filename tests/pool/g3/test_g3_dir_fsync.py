"""G3 open: the directories whose slab (and namespace) files it created are fsynced, so a power cut in a pool's
first run does not lose the files its journal names. Real files; the real ``os.fsync`` wrapped to record
each fd's path."""
from __future__ import annotations

import os

from tests.helpers.pools import open_g3, tiny_ns
from tests.helpers.fsync_spy import record_fsyncs


def test_a_new_pool_fsyncs_each_directory_after_creating_its_slab_files(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    synced = record_fsyncs(monkeypatch)
    with open_g3(a, tiny_ns(), paths=[str(a), str(b)], files_per_path=2):
        slabs = {d: sorted(n for n in os.listdir(d) if n.endswith(".slab")) for d in (a, b)}
        assert all(len(v) == 2 for v in slabs.values()), slabs
        for d in (a, b):
            assert str(d) in synced, (str(d), synced)


def test_fsync_off_syncs_no_slab_directory(tmp_path, monkeypatch):
    """(The journal's directory is synced by the journal's own create-and-rename, whatever ``fsync`` says.)"""
    a, b = tmp_path / "a", tmp_path / "b"
    synced = record_fsyncs(monkeypatch)
    with open_g3(a, tiny_ns(), paths=[str(a), str(b)], fsync=False):
        assert any(n.endswith(".slab") for n in os.listdir(b))
    assert str(b) not in synced, synced
