"""A create-exclusive ``file://`` put racing a delete of the same name (2026-12). ``put_if_absent`` links its
temp file to the name; EEXIST sends it to ``stat`` the name (a regular file, not something planted there); a
concurrent delete (gc, another worker's reader dropping a bad object) can remove the name in between. Before,
that ``stat``'s ENOENT escaped: the writer counted ``dropped_error`` and logged "the store refuses requests ...
check credentials". Now the link is made again (``fs_put.link_exclusive``): the block is stored.

The interleaving is made deterministic with the real ``os.stat`` wrapped to unlink the object (the other
worker's delete, a real unlink on the real file) once, right before the ``stat`` of that name runs."""
from __future__ import annotations

import os

from kvbm_backend.config import G4Config
from kvbm_backend.pool.g4.fs_put import LINK_ATTEMPTS
from kvbm_backend.pool.g4.fs_store import FsStore
from kvbm_backend.pool.g4.pool import G4Pool
from tests.helpers.g4_writer import namespace, put_blocks, read_checked
from tests.helpers.pools import G4_TIMEOUT_S

HANG_S = 600.0  # a hang guard, not a bound: waits for results that must come; returns as soon as they do


def _delete_before_stat(monkeypatch, base: str | None = None) -> list[str]:
    """Wrap ``os.stat``: the first stat, relative to a directory fd, of ``base`` (or of any name but a temp
    file's when None) is preceded by unlinking that name (a concurrent delete). Returns the names so deleted."""
    real_stat = os.stat
    deleted: list[str] = []

    def racing_stat(path, *args, **kw):
        dfd = kw.get("dir_fd")
        if (not deleted and dfd is not None and isinstance(path, str)
                and (path == base if base is not None else not path.startswith("."))):
            os.unlink(path, dir_fd=dfd)  # the other worker's delete lands between link and stat
            deleted.append(path)
        return real_stat(path, *args, **kw)

    monkeypatch.setattr(os, "stat", racing_stat)
    return deleted


def test_put_if_absent_links_again_when_the_name_is_deleted_before_its_check(tmp_path, monkeypatch):
    store = FsStore(tmp_path / "g4")
    name = "ns/tenant/0/00/block"
    assert store.put_if_absent(name, b"old" * 1000)
    deleted = _delete_before_stat(monkeypatch, "block")
    created = store.put_if_absent(name, b"new" * 1000)  # before: FileNotFoundError
    monkeypatch.undo()
    assert deleted == ["block"]
    assert created is True
    assert bytes(store.get(name)) == b"new" * 1000
    assert [o.name for o in store.list("ns")] == [name] and list(store.list_temps("ns")) == []  # no temp left


def test_a_g4_offload_racing_a_delete_is_stored_not_an_error(tmp_path, monkeypatch):
    pool = G4Pool(G4Config(url=f"file://{tmp_path / 'g4'}", encrypt=False, timeout_s=G4_TIMEOUT_S), namespace())
    try:
        assert put_blocks(pool, [1], "").written == 1
        assert pool.flush(HANG_S)
        deleted = _delete_before_stat(monkeypatch)
        res = put_blocks(pool, [1], "")  # meets the object, which is deleted before it is checked
        monkeypatch.undo()
        assert len(deleted) == 1, deleted
        s = pool.stats()
        assert s.get("dropped_error", 0) == 0 and (res.written, res.dropped) == (1, 0), (res, s)
        assert s["written"] == 2 and s["breaker_state"] == "closed"
        assert read_checked(pool, [1], "") == [True]
    finally:
        pool.close(timeout=HANG_S)


def test_a_name_published_and_deleted_at_every_try_ends_as_existing_not_an_error(tmp_path, monkeypatch):
    """Another writer publishes the name right before each of this put's links and a delete removes it right
    before each check: after ``LINK_ATTEMPTS`` tries the put answers False (an object was there each time, what a
    create-exclusive PUT answers), never an error, and leaves no temp file."""
    store = FsStore(tmp_path / "g4")
    name = "ns/tenant/0/00/block"
    store.put_if_absent("ns/tenant/0/00/other", b"o")  # the directory exists
    real_link = os.link
    links: list[str] = []

    def peer_publishes_first(src, dst, *args, **kw):
        if dst == "block":
            links.append(dst)
            fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=kw["dst_dir_fd"])
            os.close(fd)
        return real_link(src, dst, *args, **kw)

    monkeypatch.setattr(os, "link", peer_publishes_first)
    deleted = []
    real_stat = os.stat

    def racing_stat(path, *args, **kw):
        if path == "block" and kw.get("dir_fd") is not None:
            os.unlink(path, dir_fd=kw["dir_fd"])
            deleted.append(path)
        return real_stat(path, *args, **kw)

    monkeypatch.setattr(os, "stat", racing_stat)
    created = store.put_if_absent(name, b"new")
    monkeypatch.undo()
    assert created is False and len(links) == len(deleted) == LINK_ATTEMPTS
    assert list(store.list_temps("ns")) == []
