"""``kvbm-backend gc`` / ``g4 migrate`` operations findings (review of 2026-11-29, reproduced on real file
stores): a directory that cannot be listed, ``--tenant`` pseudonym hex with a keyring, ``remaining_bytes``."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvbm_backend.pool.g4.fs_store import FsStore

NS, TEN = "0123456789abcdef", "ab" * 16
ROOT = Path(__file__).resolve().parents[3]


def _without_dac(cmd: list[str]) -> list[str]:
    """``cmd`` run so that file modes bind: as root, with CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH dropped
    (``setpriv``; root ignores a directory's mode otherwise)."""
    if os.geteuid() != 0:
        return cmd
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: cannot make a directory unreadable")
    caps = "-dac_override,-dac_read_search"
    return ["setpriv", "--bounding-set", caps, "--inh-caps", caps, *cmd]


def test_gc_and_migrate_report_a_directory_they_cannot_list(tmp_path):
    """Review finding: ``os.walk`` skipped a directory it could not read (EACCES here; on NFS ESTALE, EIO)
    without a word, so gc and migrate reported success (exit 0, errors 0) over 48 of 64 objects. Now the
    directory is one error, named on stderr and in ``unlisted``, exit 1; the rest is still processed."""
    root = tmp_path / "store"
    st = FsStore(root, fsync=False)
    for s in range(64):  # format 1 (legacy) names: migrate lists them too
        st.put_if_absent(f"{NS}/{TEN}/0/{s % 4:01x}/{s:016x}", b"x" * 1000)
    locked = root / NS / TEN / "0" / "2"
    locked.chmod(0)
    cli = [sys.executable, "-m", "kvbm_backend.apps.cli"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    try:
        for args, count in ((["gc", "--max-age-s", "0", "--dry-run"], "scanned_objects"),
                            (["g4", "migrate", "--unkeyed", "--dir-fanout", "4", "--dry-run"], "legacy_objects")):
            r = subprocess.run(_without_dac([*cli, *args, "--url", f"file://{root}", "--json"]), env=env,
                               capture_output=True, text=True, timeout=600)
            assert r.returncode == 1, (args, r.stdout, r.stderr)
            res = json.loads(r.stdout)
            assert res[count] == 48 and res["errors"] == 1, res
            assert res["unlisted"] == [f"cannot list {locked}: Permission denied"], res
            assert str(locked) in " ".join(r.stderr.split()), r.stderr
    finally:
        locked.chmod(0o700)
    assert len(list(st.list(""))) == 64  # a dry run: nothing deleted, nothing renamed


def _keyring(tmp_path):
    import base64

    from kvbm_backend.crypto.keyring import Keyring, provider_for
    kp = str(tmp_path / "kr.json")
    kek = tmp_path / "kr.json.kek"
    kek.write_bytes(base64.b64encode(b"k" * 32))
    kek.chmod(0o600)
    kr = Keyring(kp, provider_for(kp, "KVBM_TEST_UNSET_KEK", str(kek), create=True), create=True)
    return kp, str(kek), kr


def test_gc_tenant_as_pseudonym_with_a_keyring(tmp_path, monkeypatch):
    """Review finding: ``gc --tenant <pseudonym hex> --keyring F`` hashed the hex again as a tenant id and
    matched nothing (0 scanned; 10 without ``--keyring``), though ``keys list`` shows a revoked tenant by its
    pseudonym only. A tenant id the keyring knows wins, else 32 hex is a pseudonym; a tenant id the keyring
    does not know is a warning on stderr (a typo?)."""
    from typer.testing import CliRunner

    from kvbm_backend.apps.cli import app
    from kvbm_backend.pool.g4.gc import run_gc
    monkeypatch.delenv("KVBM_TEST_UNSET_KEK", raising=False)
    kp, kek, kr = _keyring(tmp_path)
    kr.create("alice")
    kr.create("bob")
    ps = kr.pseudonym("alice").hex()
    st = FsStore(tmp_path / "store", fsync=False)
    for i in range(10):
        st.put_if_absent(f"{NS}/{ps}/0/{i:02x}/{i:032x}", b"x" * 100)
        st.put_if_absent(f"{NS}/{kr.pseudonym('bob').hex()}/0/{i:02x}/{i:032x}", b"y" * 100)
    for t in ("alice", ps):
        res = run_gc(st, keyring=kr, tenant=t, max_age_s=0, dry_run=True)
        assert res["scanned_objects"] == 10 and "warnings" not in res, (t, res)
    runner = CliRunner()
    base = ["gc", "--url", f"file://{tmp_path / 'store'}", "--keyring", kp, "--kek-file", kek]
    assert runner.invoke(app, ["keys", "revoke", "--keyring", kp, "--kek-file", kek, "--tenant", "alice"]).exit_code == 0
    r = runner.invoke(app, [*base, "--tenant", ps, "--json"])  # a revoked tenant, by the name keys list shows
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["deleted_by"]["revoked"] == 10 and "warning" not in r.stderr, r.output
    r = runner.invoke(app, [*base, "--tenant", "bobb", "--max-age-s", "0", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["scanned_objects"] == 0, r.output
    assert "warning: gc: --tenant 'bobb': not a tenant of the keyring" in " ".join(r.stderr.split()), r.stderr
    assert len(list(st.list(""))) == 10  # bob's blocks: the typo deleted nothing
    kr.create(ps)  # a tenant whose id is 32 hex: the keyring's tenant of that name wins over the pseudonym
    assert run_gc(st, keyring=kr, tenant=ps, max_age_s=0, dry_run=True)["scanned_objects"] == 0


def test_gc_remaining_bytes_counts_blocks_only(tmp_path):
    """Review finding: ``remaining_bytes`` was ``scanned_bytes`` (blocks) less ``deleted_bytes`` (blocks and
    temp files): -999000 with a 1000 B block kept and a crashed writer's 1 MB temp file reclaimed."""
    import time

    from kvbm_backend.pool.g4.gc import run_gc
    st = FsStore(tmp_path / "store", fsync=False)
    kept, gone = f"{NS}/{TEN}/0/00/{'0' * 32}", f"{NS}/{TEN}/0/01/{'1' * 32}"
    st.put_if_absent(kept, b"x" * 1000)
    st.put_if_absent(gone, b"x" * 300)
    old = time.time() - 7200
    os.utime(tmp_path / "store" / gone, (old, old))
    tmp = tmp_path / "store" / NS / TEN / "0" / "00" / f".{'1' * 32}.host.1.{'f' * 32}.tmp"
    tmp.write_bytes(b"y" * 1_000_000)
    os.utime(tmp, (old, old))
    res = run_gc(st, max_age_s=3600)
    assert res["deleted_by"] == {"revoked": 0, "age": 1, "capacity": 0, "temp": 1, "announce": 0} and not tmp.exists(), res
    assert res["deleted_bytes"] == 1_000_300 and res["remaining_bytes"] == 1000 == sum(o.size for o in st.list(""))


def test_gc_help_and_docs_state_the_time_base_the_code_uses():
    """Review finding: ``gc --help`` and docs/configuration.md still said the newest mtime listed sets the
    time base (true before 2026-11-29); gc uses the earlier of the store's stated time and a probe object's
    mtime (:func:`~kvbm_backend.pool.g4.gc.probe_clock`), else this host's clock."""
    from typer.testing import CliRunner

    from kvbm_backend.apps.cli import app
    r = CliRunner().invoke(app, ["gc", "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    conf = (ROOT / "docs" / "configuration.md").read_text()
    gc_doc = conf[conf.index("- **gc**"):conf.index("- **Object names are keyed**")]
    for text in (" ".join(r.output.replace("│", " ").split()), " ".join(gc_doc.split())):
        assert "newest" not in text and "probe object" in text and "this host's clock" in text, text


class _ScriptedS3:
    """A botocore S3 client answering ``pages`` LIST pages of 100 old blocks; "503 SlowDown" (as AWS sends
    it) to the first ``list_throttles`` requests for page ``throttle_page`` and to every ``throttle_every``-th
    DELETE (``throttle_every`` 1: every DELETE)."""

    def __init__(self, pages, throttle_page=None, list_throttles=1, throttle_every=None):
        self.pages, self.tp, self.lt, self.te = pages, throttle_page, list_throttles, throttle_every
        self.list_calls, self.delete_calls, self.deleted = 0, 0, 0
        self.tp_calls = 0

    @staticmethod
    def _slowdown(op):
        from botocore.exceptions import ClientError
        return ClientError({"Error": {"Code": "SlowDown", "Message": "Please reduce your request rate."},
                            "ResponseMetadata": {"HTTPStatusCode": 503}}, op)

    def head_bucket(self, **kw):
        return {"ResponseMetadata": {"HTTPHeaders": {"date": "Sun, 29 Nov 2026 12:00:00 GMT"}}}

    def list_objects_v2(self, **kw):
        import datetime as dt
        i = int(kw.get("ContinuationToken", "0"))
        self.list_calls += 1
        if i == self.tp and self.tp_calls < self.lt:
            self.tp_calls += 1
            raise self._slowdown("ListObjectsV2")
        old = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
        c = [{"Key": f"p/{NS}/{TEN}/0/{j % 256:02x}/{j:032x}", "Size": 1, "LastModified": old}
             for j in range(i * 100, i * 100 + 100)]
        more = i + 1 < self.pages
        return {"Contents": c, "IsTruncated": more, **({"NextContinuationToken": str(i + 1)} if more else {})}

    def delete_object(self, **kw):
        self.delete_calls += 1
        if self.te and self.delete_calls % self.te == 0:
            raise self._slowdown("DeleteObject")
        self.deleted += 1

    def close(self):
        pass


def test_gc_over_s3_retries_throttled_list_pages_and_deletes(monkeypatch):
    """Review finding: one "503 SlowDown" on any LIST page aborted the gc pass (nothing deleted) and each
    throttled DELETE was an error, unretried. Both are retried after the pool's backoff now, a bounded number
    of times (``THROTTLE_ATTEMPTS``): still throttled after that, a DELETE is one error and a LIST ends the
    pass (raised, after the pages before it were acted on). (Backoff sleeps made 0 here; the retry count is what is tested.)"""
    from kvbm_backend.pool.g4 import throttle
    from kvbm_backend.pool.g4.gc import THROTTLE_ATTEMPTS, run_gc
    from kvbm_backend.pool.g4.s3_store import S3Store
    from kvbm_backend.pool.g4.store import StoreThrottled
    monkeypatch.setattr(throttle, "backoff_s", lambda attempt: 0.0)
    c = _ScriptedS3(pages=5, throttle_page=3, throttle_every=10)
    res = run_gc(S3Store("b", "p", client=c), max_age_s=3600)
    assert res["scanned_objects"] == 500 and res["deleted_objects"] == c.deleted == 500, res
    assert res["errors"] == 0 and c.list_calls == 6 and c.delete_calls == 500 + 500 // 9, (res, c.delete_calls)
    c = _ScriptedS3(pages=1, throttle_every=1)  # throttled for good: bounded, each DELETE one error
    res = run_gc(S3Store("b", "p", client=c), max_age_s=3600)
    assert res["errors"] == 100 and res["deleted_objects"] == 0 and c.delete_calls == 100 * THROTTLE_ATTEMPTS
    c = _ScriptedS3(pages=2, throttle_page=1, list_throttles=10**6)
    with pytest.raises(StoreThrottled):
        run_gc(S3Store("b", "p", client=c), max_age_s=3600)
    # the first page's blocks were decided (and deleted) as they were listed (gc.py "Memory"); the pass ends at page 2
    assert c.list_calls == 1 + THROTTLE_ATTEMPTS and c.deleted == 100
    assert list(S3Store("b", "p", client=_ScriptedS3(pages=1)).list("")) != []  # the pool's list: unchanged
    c = _ScriptedS3(pages=2, throttle_page=1)
    with pytest.raises(StoreThrottled):  # the pool's own list never sleeps: its backoff owns the wait
        list(S3Store("b", "p", client=c).list(""))


class _ManyObjects:
    """A store of ``n`` block objects listed lazily (names made on the fly, nothing held per object), the first
    half old: what gc keeps in memory is then gc's own. Stands in for a bucket of millions of blocks."""
    url = "mem://many"

    def __init__(self, n: int, now: float):
        self.n, self.now, self.deleted = n, now, 0

    def server_time(self):
        return self.now

    def list_patient(self, prefix: str = "", attempts: int = 10):
        from kvbm_backend.pool.g4.store import ObjectInfo
        for i in range(self.n):
            yield ObjectInfo(f"{NS}/{TEN}/0/{i % 16:x}/{i:032x}", 4096, self.now - (7200 if i < self.n // 2 else 0))

    def list_temps(self, prefix: str = ""):
        return iter(())

    def delete(self, name: str) -> None:
        self.deleted += 1

    def prune_dirs(self, names) -> int:
        self.pruned = sorted(names)  # the directories gc deleted from: one entry each, not one per object
        return 0


def test_an_age_pass_keeps_nothing_per_object(tmp_path):
    """Review finding: gc kept every listed block (its ObjectInfo and parsed name, ~870 B each: ~40 GiB at 50M
    objects) before deleting any. An age pass now decides while listing: its peak memory over 100,000 objects
    stays under 4 MB (before: ~80 MB), and a capacity pass keeps only (mtime, size, name) of the blocks it
    may still delete."""
    import time
    import tracemalloc

    from kvbm_backend.pool.g4.gc import run_gc
    now = time.time()
    st = _ManyObjects(100_000, now)
    tracemalloc.start()
    try:
        res = run_gc(st, max_age_s=3600, now=now)  # type: ignore[arg-type]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (res["scanned_objects"], res["deleted_by"]["age"], st.deleted) == (100_000, 50_000, 50_000), res
    assert res["remaining_bytes"] == 50_000 * 4096
    assert peak < 4 << 20, peak
    assert st.pruned == [f"{NS}/{TEN}/0/{f:x}/" for f in range(16)]
    st = _ManyObjects(1000, now)
    res = run_gc(st, target_bytes=100 * 4096, now=now)  # type: ignore[arg-type]
    assert (res["deleted_by"]["capacity"], res["remaining_bytes"]) == (900, 100 * 4096), res


def test_docs_name_every_key_of_the_gc_report(tmp_path):
    """Review finding (observability 3): docs/cli.md's gc row named none of the report's counters
    (``headers_read``, ``deleted_by``, ...), and docs/operations.md had no word on where the counters
    that are no Prometheus series appear. Every key of a real gc report (a file store; and ``warnings``, only
    there when there are) is named in the gc row, and in operations.md's table of such counters (but for the
    run's context: dry_run, url, the clock, warnings), which names today's counters of stats() and stats_path."""
    import re

    from kvbm_backend.pool.g4.gc import run_gc
    st = FsStore(tmp_path / "store", fsync=False)
    st.put_if_absent(f"{NS}/{TEN}/0/00/{'0' * 32}", b"x" * 1000)
    res = run_gc(st, max_age_s=3600)
    assert "headers_read" in res and "deleted_by" in res, res
    keys = set(res) | set(res["deleted_by"]) | {"warnings"}
    cli = (ROOT / "docs" / "cli.md").read_text()
    row = next(line for line in cli.splitlines() if line.startswith("| `kvbm-backend gc "))
    assert sorted(k for k in keys if f"`{k}`" not in row) == [], row
    ops = (ROOT / "docs" / "operations.md").read_text()
    table = ops[ops.index("**Counters in `stats()` / `stats_path` / gc output"):ops.index("Tests that the series move")]
    context = {"dry_run", "url", "store_now", "time_base", "clock_skew_s", "warnings"}
    assert sorted(k for k in keys - context if f"`{k}`" not in table) == []
    named = set(re.findall(r"`([a-z0-9_]+)`", table))
    assert {"handoff_g4_offered_blocks", "deleted_unencrypted", "unconfirmed_unencrypted", "restored_by_scan",
            "restore_scanned_slots"} <= named
