"""gc's capacity pass under a listing that names objects more than once (review of 2026-12-01, finding 2): an
S3-compatible server that repeats a page, a file store whose directory is read while it changes. Each block counts
once: gc deletes the oldest blocks only down to ``target_bytes`` and counts the repeats (``listed_duplicates``).
Before, every listed entry counted: a target of 8 of 10 blocks listed twice deleted 6 good blocks, not 2. Real
file stores and real SeaweedFS behind a real loopback proxy that repeats pages."""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Iterator

from kvbm_backend.config import G4Config
from kvbm_backend.pool.g4.fs_store import FsStore
from kvbm_backend.pool.g4.gc import run_gc
from kvbm_backend.pool.g4.store import ObjectInfo, ObjectStore
from tests.helpers.lying_proxy import LyingProxy

NS, TEN = "0123456789abcdef", "ab" * 16
SIZE = 1000
T0 = 1_700_000_000.0  # block i's mtime: T0 + i (block 0 oldest)


def _name(i: int) -> str:
    return f"{NS}/{TEN}/0/00/{i:032x}"  # name order is age order (S3 mtime ties)


class RepeatingFsStore(FsStore):
    """A real file store whose listing comes in pages of ``page`` objects, each page listed twice (the second
    time after the first, as a server answering a continuation token with the previous page again)."""

    def __init__(self, root, page: int):
        super().__init__(root, fsync=False)
        self.page = page

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        buf: list[ObjectInfo] = []
        for o in super().list(prefix):
            buf.append(o)
            if len(buf) == self.page:
                yield from buf
                yield from buf
                buf = []
        yield from buf
        yield from buf


def _fill(st: FsStore, root, n: int) -> None:
    for i in range(n):
        st.put_if_absent(_name(i), b"x" * SIZE)
        os.utime(root / _name(i), (T0 + i, T0 + i))


@contextmanager
def _lying_seaweed(seaweed, s3_prefix) -> Iterator[tuple[ObjectStore, LyingProxy]]:
    """``(store, proxy)``: the S3 store of ``seaweed`` under ``s3_prefix`` reached through a :class:`LyingProxy`
    (timeout 30 s), holding the 10 blocks ``_name(0..9)`` of SIZE bytes, written in that order; both closed after."""
    from kvbm_backend.pool.g4.factory import open_store
    host, port = seaweed.endpoint.rsplit("//", 1)[1].rsplit(":", 1)
    proxy = LyingProxy(host, int(port))
    url = seaweed.url(s3_prefix)
    st = open_store(url, G4Config(url=url, endpoint_url=proxy.endpoint, timeout_s=30.0))
    try:
        for i in range(10):
            assert st.put_if_absent(_name(i), b"x" * SIZE)
        yield st, proxy
    finally:
        st.close()
        proxy.close()


def test_a_file_store_listing_every_page_twice_deletes_only_down_to_the_target(tmp_path):
    root = tmp_path / "store"
    _fill(FsStore(root, fsync=False), root, 10)
    st = RepeatingFsStore(root, page=3)
    assert len(list(st.list(""))) == 20  # the lie: every object listed twice
    res = run_gc(st, target_bytes=8 * SIZE, now=T0 + 100)
    left = sorted(o.name for o in FsStore(root, fsync=False).list(""))
    assert left == sorted(_name(i) for i in range(2, 10)), left  # the 2 oldest went, 8 good blocks stay
    assert res["deleted_by"]["capacity"] == 2 and res["listed_duplicates"] == 10, res
    assert (res["scanned_objects"], res["scanned_bytes"], res["remaining_bytes"]) == (10, 10 * SIZE, 8 * SIZE), res
    assert res["errors"] == 0, res
    again = run_gc(st, target_bytes=8 * SIZE, now=T0 + 100)  # at the target: nothing more goes
    assert again["deleted_objects"] == 0 and again["listed_duplicates"] == 8, again
    honest = run_gc(FsStore(root, fsync=False), target_bytes=8 * SIZE, now=T0 + 100)
    assert honest["listed_duplicates"] == 0 and honest["deleted_objects"] == 0, honest


def test_an_s3_server_repeating_a_list_page_deletes_only_down_to_the_target(seaweed, s3_prefix):
    """SeaweedFS behind a proxy that serves a ListObjectsV2 page twice (a continuation token of its own, answered
    with the page again): boto3's paging lists the 10 objects twice. The capacity pass still deletes exactly the
    2 oldest blocks (LastModified ties broken by name: the blocks are written oldest first, in name order)."""
    with _lying_seaweed(seaweed, s3_prefix) as (st, proxy):
        proxy.repeat_list_pages = 1
        assert len(list(st.list(""))) == 20 and proxy.repeated == 1  # the lie, as boto3's paging sees it
        proxy.repeat_list_pages = 1
        res = run_gc(st, target_bytes=8 * SIZE)
        assert proxy.repeated == 2, proxy.repeated
        left = sorted(o.name for o in st.list(""))
        assert left == sorted(_name(i) for i in range(2, 10)), (left, res)
        assert res["deleted_by"]["capacity"] == 2 and res["listed_duplicates"] == 10, res
        assert (res["scanned_objects"], res["remaining_bytes"], res["errors"]) == (10, 8 * SIZE, 0), res


def test_an_age_pass_counts_a_repeated_block_once_dry_run_or_not(tmp_path):
    """The age pass (``max_age_s`` a day: the 6 blocks written 10 days ago, not the 4 written 10 s ago; on the store's
    clock, a probe's mtime, in the run) under a file store listing every page twice. Each block it deletes counts
    once, in the dry run's report as in the run's: 6 objects and 6 x SIZE bytes deleted (or to be), their 6 repeats
    ``listed_duplicates``, none ``changed_since_listed``. Old code: the dry run reported 12 objects and 12 x SIZE bytes
    (an age pass kept nothing per object, so it never saw a repeat); the run counted the 6 repeats
    ``changed_since_listed``. The run deletes exactly the 6 oldest blocks. (The young blocks' repeats still count in
    ``scanned_*``: such a pass keeps nothing per block it leaves, gc module doc "Repeated listings".)"""
    root = tmp_path / "store"
    _fill(FsStore(root, fsync=False), root, 10)
    now = time.time()
    for i in range(10):
        os.utime(root / _name(i), (now - (864000 if i < 6 else 10),) * 2)
    st = RepeatingFsStore(root, page=3)
    for dry in (True, False):
        res = run_gc(st, max_age_s=86400.0, dry_run=dry)
        got = {k: res[k] for k in ("deleted_objects", "deleted_bytes", "listed_duplicates", "changed_since_listed",
                                   "errors")}
        assert got == {"deleted_objects": 6, "deleted_bytes": 6 * SIZE, "listed_duplicates": 6,
                       "changed_since_listed": 0, "errors": 0}, (dry, res)
        assert res["deleted_by"]["age"] == 6, (dry, res)
        left = sorted(o.name for o in FsStore(root, fsync=False).list(""))
        assert left == sorted(_name(i) for i in range(0 if dry else 6, 10)), (dry, left)


def test_an_s3_server_repeating_a_list_page_counts_each_block_once_in_a_dry_run(seaweed, s3_prefix):
    """SeaweedFS behind a proxy that serves the ListObjectsV2 page twice: a dry run of the age pass (``max_age_s``
    0: every block) reports each of the 10 blocks once, deleted and scanned (old code: 20 objects, 20 x SIZE bytes,
    20 scanned), and deletes nothing; the real pass under the same lie deletes the 10 blocks, each counted once (old
    code: 20 scanned, the 10 repeats ``changed_since_listed``)."""
    with _lying_seaweed(seaweed, s3_prefix) as (st, proxy):
        for dry in (True, False):
            proxy.repeat_list_pages, before = 1, proxy.repeated
            res = run_gc(st, max_age_s=0.0, dry_run=dry)
            assert proxy.repeated == before + 1, proxy.repeated
            got = (res["deleted_objects"], res["deleted_bytes"], res["scanned_objects"], res["remaining_bytes"])
            assert got == (10, 10 * SIZE, 10, 0), (dry, res)
            assert (res["listed_duplicates"], res["changed_since_listed"], res["errors"]) == (10, 0, 0), (dry, res)
            assert len(list(st.list(""))) == (10 if dry else 0), dry
