"""file:// store publish durability: every directory a put creates is fsynced into its parent before the put
returns (a power cut after the publish must not lose the directory holding the object). Real files; the real
``os.fsync`` wrapped to record which directory each synced fd is."""
from __future__ import annotations

from kvbm_backend.pool.g4.fs_store import FsStore
from tests.helpers.fsync_spy import record_fsyncs


def test_every_directory_a_put_creates_is_fsynced_into_its_parent(tmp_path, monkeypatch):
    root = tmp_path / "store"
    st = FsStore(root)
    synced = record_fsyncs(monkeypatch)
    st.put("team/a/b/obj", b"x" * 5000)
    assert (root / "team/a/b/obj").read_bytes() == b"x" * 5000
    # the parent of each new directory (root, team, team/a) and the object's own directory (team/a/b)
    for parent in (root, root / "team", root / "team/a", root / "team/a/b"):
        assert str(parent) in synced, (str(parent), synced)
    # a second object in existing directories syncs only its temp file and its own directory
    synced.clear()
    st.put("team/a/b/obj2", b"y" * 10)
    assert str(root / "team/a") not in synced and str(root / "team/a/b") in synced, synced


def test_a_store_without_fsync_syncs_nothing(tmp_path, monkeypatch):
    st = FsStore(tmp_path / "store", fsync=False)
    synced = record_fsyncs(monkeypatch)
    st.put("team/a/obj", b"z")
    assert synced == []
