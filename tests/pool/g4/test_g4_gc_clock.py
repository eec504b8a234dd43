"""gc's time base against clocks that do not stamp the store's objects (review of 2026-12-03: can a bad server or
clock skew destroy good G4 blocks?).

1. An S3 store behind a reverse proxy whose own clock runs ahead: nginx by default sends its own ``Date`` header,
   not the upstream's, so the ``Date`` gc took as the store's clock was the proxy host's while ``LastModified``
   is the S3 server's. Before, gc took the stated ``Date`` alone: a proxy 2 h ahead made ``--max-age-s 3600``
   delete blocks written seconds before. Now gc also writes a probe object (its ``LastModified`` is stamped by
   the clock that stamps every block) and measures on the earlier of the two, with a ``warnings`` line.
2. A full ``file://`` store (ENOSPC): the one-byte clock probe failed, gc fell back to this host's clock, and a
   host clock 2 h ahead of the file server aged every block by 2 h on the very store gc was run to free. The
   probe is empty now (an inode, no data block): a full filesystem takes it.

Real SeaweedFS behind a real loopback proxy; a real full tmpfs (root needed, skipped with the reason otherwise).
"""
from __future__ import annotations

import math
import os
import time

import pytest

from kvbm_backend.pool.g4.fs_store import FsStore
from kvbm_backend.pool.g4.gc import CLOCK_PROBE_PREFIX, run_gc
from kvbm_backend.pool.g4.s3_store import S3Store
from tests.helpers.date_proxy import DateProxy
from tests.helpers.tmpfs import fill_filesystem, mounted_tmpfs

NS, TEN = "0123456789abcdef", "ab" * 16
AHEAD_S = 7200.0  # the proxy's (or this host's) clock ahead of the store's
SIZE = 1000


def _name(i: int) -> str:
    return f"{NS}/{TEN}/0/00/{i:032x}"


def test_a_proxy_stating_a_clock_ahead_of_the_s3_server_deletes_no_fresh_block(seaweed, s3_prefix):
    host, port = seaweed.endpoint.rsplit("//", 1)[1].rsplit(":", 1)
    proxy = DateProxy(host, int(port), AHEAD_S)
    direct = S3Store(seaweed.bucket, s3_prefix, endpoint_url=seaweed.endpoint, timeout_s=30.0)
    st = S3Store(seaweed.bucket, s3_prefix, endpoint_url=proxy.endpoint, timeout_s=30.0)
    try:
        for i in range(3):
            assert direct.put_if_absent(_name(i), b"x" * SIZE)
        stated = st.server_time()
        assert stated is not None and stated - time.time() > AHEAD_S - 60, stated  # the proxy's clock, as gc sees it
        res = run_gc(st, max_age_s=3600)
        left = sorted(o.name for o in direct.list(""))
        assert left == [_name(i) for i in range(3)], (left, res)  # old code: [] (3 fresh blocks deleted by "age")
        assert res["deleted_objects"] == 0 and res["time_base"] == "server", res
        assert abs(res["clock_skew_s"]) < 60, res  # the S3 server's clock (this host's here), not the proxy's
        assert any("Date header" in w for w in res.get("warnings", [])), res
        assert list(direct.list(CLOCK_PROBE_PREFIX)) == []  # the probe removed
        honest = run_gc(direct, max_age_s=3600)  # no proxy: both clocks agree, no warning
        assert honest["deleted_objects"] == 0 and "warnings" not in honest, honest
        old = run_gc(st, max_age_s=0)  # 0 still means every block
        assert old["deleted_by"]["age"] == 3 and list(direct.list("")) == [], old
    finally:
        st.close()
        direct.close()
        proxy.close()


def test_a_full_file_store_is_measured_on_its_own_clock_not_this_hosts(tmp_path):
    with mounted_tmpfs(tmp_path / "mnt", "1M", "mode=0700") as mnt:
        st = FsStore(mnt / "g4", fsync=False)
        for i in range(3):
            assert st.put_if_absent(_name(i), b"x" * SIZE)
        fill_filesystem(mnt)
        # this host's clock 2 h ahead of the file server's (here: the same clock, so `now` is moved)
        res = run_gc(st, max_age_s=3600, now=time.time() + AHEAD_S)
        left = sorted(o.name for o in st.list(""))
        assert left == [_name(i) for i in range(3)], (left, res)  # old code: [] (time_base "local")
        assert res["time_base"] == "server" and res["deleted_objects"] == 0 and res["errors"] == 0, res
        assert list(st.list(CLOCK_PROBE_PREFIX)) == [] and list(st.list_temps(CLOCK_PROBE_PREFIX)) == []
        assert run_gc(st, max_age_s=0, now=time.time() + AHEAD_S)["deleted_by"]["age"] == 3  # deletes still work


def test_a_pass_removes_the_clock_probes_a_crashed_gc_left(tmp_path):
    """The probe's mtime is read back by ``stat`` (no listing of its own: a proxy's list page is never spent on
    it), so probes a crashed gc left are removed by the pass's own listing once a day old, as before."""
    st = FsStore(tmp_path / "store", fsync=False)
    assert st.put_if_absent(_name(0), b"x" * SIZE)
    stale, recent = f"{CLOCK_PROBE_PREFIX}{'0' * 32}", f"{CLOCK_PROBE_PREFIX}{'1' * 32}"
    for name, age in ((stale, 2 * 86400), (recent, 3600)):
        assert st.put_if_absent(name, b"")
        t = time.time() - age
        os.utime(tmp_path / "store" / name, (t, t))
    dry = run_gc(st, max_age_s=3600, dry_run=True)
    assert sorted(o.name for o in st.list(CLOCK_PROBE_PREFIX)) == [stale, recent], dry  # a dry run deletes none
    res = run_gc(st, max_age_s=3600)
    assert [o.name for o in st.list(CLOCK_PROBE_PREFIX)] == [recent], res
    assert res["deleted_objects"] == 0 and [o.name for o in st.list(NS)] == [_name(0)], res


def test_an_infinite_now_is_refused_before_anything_is_deleted(tmp_path):
    """A bad caller's ``now`` (this host's clock, used where the store's cannot be measured: here the probe is
    refused, ``gc-clock-probe`` being a plain file) was not checked: ``inf`` made every block infinitely old, and
    ``max_age_s=3600`` deleted them all. Now a ValueError naming it, before anything is listed or deleted."""
    root = tmp_path / "store"
    st = FsStore(root, fsync=False)
    for i in range(3):
        assert st.put_if_absent(_name(i), b"x" * SIZE)
    (root / CLOCK_PROBE_PREFIX.rstrip("/")).write_bytes(b"not a directory")  # the probe cannot be written
    assert run_gc(st, max_age_s=3600)["time_base"] == "local"
    for bad in (math.inf, -math.inf, math.nan):
        with pytest.raises(ValueError, match="now"):
            run_gc(st, max_age_s=3600, now=bad)
    assert sorted(o.name for o in st.list(NS)) == [_name(i) for i in range(3)]  # old code: [] (inf: all "old")
