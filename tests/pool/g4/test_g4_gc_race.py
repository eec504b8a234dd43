"""gc deletes a listed object only while its name still holds that object (2026-12-01). Before, gc deleted by name
after listing: when something else deleted a listed block (another gc, a reader's drop) and a worker published a
fresh good copy under the same name between gc's listing and its delete, gc deleted the fresh copy (a good block
lost, never wrong bytes). The interleaving is made deterministic by a real store (file, SeaweedFS S3) whose
delete of one chosen name first runs worker B's delete and worker C's create-exclusive write of new bytes (no
sleeps). Now the delete is conditional on the listed object (``ObjectStore.delete_if_listed``: S3 ``If-Match`` the
listed ETag, file stores a quarantine rename and the listed inode/mtime/size), and the skipped delete is counted
``changed_since_listed``."""
from __future__ import annotations

import os

import pytest

from kvbm_backend.pool.g4.fs_store import FsStore
from kvbm_backend.pool.g4.gc import run_gc
from kvbm_backend.pool.g4.s3_store import S3Store
from kvbm_backend.pool.g4.store import ObjectInfo
from tests.helpers.lying_proxy import LyingProxy
from tests.helpers.race_store import race_store

NS, TEN = "0123456789abcdef", "ab" * 16
SIZE = 1000
T0 = 1_700_000_000.0  # block i's mtime on a file store: T0 + i (block 0 oldest)
OLD, NEW = b"o" * SIZE, b"n" * SIZE  # the listed copy, the copy written again after the listing (other bytes)


def _name(i: int) -> str:
    return f"{NS}/{TEN}/0/00/{i:032x}"  # name order is age order (S3 LastModified ties)


@pytest.fixture(params=["file", "s3"])
def racing(request, tmp_path):
    """A :class:`~tests.helpers.race_store.RewrittenBeforeDelete` store of kind ``request.param`` writing :data:`NEW`
    in the race (worker B's delete, worker C's create-exclusive write), holding blocks 0..2 (:data:`OLD`), oldest
    first (file: mtimes ``T0 + i``; S3: written in that order, ties broken by name)."""
    st = race_store(request, tmp_path)
    st.rewrite = NEW
    for i in range(3):
        assert st.put_if_absent(_name(i), OLD)
        if request.param == "file":
            os.utime(tmp_path / "g4" / _name(i), (T0 + i, T0 + i))
    yield st
    st.close()


def _held(st: FsStore | S3Store) -> dict[int, bytes]:
    return {i: bytes(b) for i in range(3) if (b := st.get(_name(i))) is not None}  # type: ignore[misc]


def test_an_age_pass_keeps_a_block_written_again_between_listing_and_delete(racing):
    racing.target = _name(1)
    res = run_gc(racing, max_age_s=0)  # every listed block is old
    assert racing.raced == 1
    assert _held(racing) == {1: NEW}, res  # the fresh copy stays; the two listed copies went
    assert res["deleted_by"]["age"] == 2 and res["changed_since_listed"] == 1 and res["errors"] == 0, res
    assert res["deleted_bytes"] == 2 * SIZE and res["remaining_bytes"] == SIZE, res


def test_a_capacity_pass_keeps_a_block_written_again_between_listing_and_delete(racing):
    racing.target = _name(0)  # the oldest: the capacity pass's first delete
    res = run_gc(racing, target_bytes=SIZE)
    assert racing.raced == 1
    assert _held(racing) == {0: NEW, 2: OLD}, res  # block 1 went for the target; block 0's new copy stays
    assert res["deleted_by"]["capacity"] == 1 and res["changed_since_listed"] == 1 and res["errors"] == 0, res
    assert res["listed_duplicates"] == 0, res


def test_fs_delete_if_listed_deletes_only_the_file_listed(tmp_path):
    st = FsStore(tmp_path / "g4", fsync=False)
    assert st.put_if_absent(_name(0), OLD)
    listed = next(iter(st.list("")))
    assert listed.version is not None and listed == ObjectInfo(_name(0), SIZE, listed.mtime)
    st.delete(_name(0))
    assert st.delete_if_listed(listed) is False  # absent
    assert st.put_if_absent(_name(0), NEW)
    os.utime(tmp_path / "g4" / _name(0), (T0, T0))  # another file, whatever inode it got
    assert st.delete_if_listed(listed) is False and bytes(st.get(_name(0)) or b"") == NEW  # kept
    assert not [f for f in os.listdir(tmp_path / "g4" / NS / TEN / "0" / "00") if "quarantine" in f]
    assert st.delete_if_listed(next(iter(st.list("")))) is True and st.get(_name(0)) is None


def test_an_s3_server_without_conditional_deletes_compares_the_listed_etag_then_deletes(seaweed, s3_prefix):
    """A server that answers 501 to ``If-Match`` on DELETE (a real proxy in front of SeaweedFS): gc's delete
    compares the listed ETag with a HEAD, then deletes by name (racy, as before 2026-12-01)."""
    host, port = seaweed.endpoint.rsplit("//", 1)[1].rsplit(":", 1)
    proxy = LyingProxy(host, int(port))
    proxy.no_conditional_delete = True
    st = S3Store(seaweed.bucket, s3_prefix, endpoint_url=proxy.endpoint, timeout_s=30.0)
    try:
        assert st.put_if_absent(_name(0), OLD)
        listed = next(iter(st.list("")))
        assert listed.version is not None
        st.delete(_name(0))
        assert st.put_if_absent(_name(0), NEW)
        assert st.delete_if_listed(listed) is False and bytes(st.get(_name(0)) or b"") == NEW  # the HEAD: kept
        assert proxy.refused_deletes == 1 and not st.supports_conditional_delete
        assert st.delete_if_listed(next(iter(st.list("")))) is True and st.get(_name(0)) is None
    finally:
        st.close()
        proxy.close()
