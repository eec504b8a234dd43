"""Invariant 2 under the pipelined writer: a block is published (index + journal) only after an
fdatasync of its file that started after the block's bytes were written; a failed fdatasync drops
the blocks it was to cover (and every unpublished block that wrote that file before), never
publishes them. Real posix engine and real fdatasync; the engine and ``fdatasync`` are wrapped only
to record the order of events (and, in the second test, to make one fdatasync fail with EIO as a
failing disk would)."""
from __future__ import annotations

import errno
import itertools
import threading
import time
from concurrent.futures import Future

import pytest

from tests.helpers.crash_writer import LAYOUT, NS, open_pool, payload
from kvbm_backend.io import fdatasync as real_fdatasync
from kvbm_backend.io.posix import PosixEngine
from kvbm_backend.memory import aligned_empty
from kvbm_backend.model import frame
from kvbm_backend.pool.g3 import G3Pool
from kvbm_backend.pool.g3 import pool as pool_mod
from kvbm_backend.pool.g3.index import LruIndex

HANG_S = 600.0  # a hang guard, not a bound: waits for what must come (results, held steps' events); returns as soon as it does

SLOT = frame.slot_bytes(LAYOUT.bytes_per_block)


class Log:
    def __init__(self):
        self.seq = itertools.count()
        self.lock = threading.Lock()
        self.events = []  # (seq, kind, payload)

    def add(self, kind, what):
        with self.lock:
            self.events.append((next(self.seq), kind, what))


class RecordingEngine(PosixEngine):
    """The real posix engine; records each finished write op as (fd, start, end) byte ranges."""

    def __init__(self, log: Log):
        super().__init__(threads=4)
        self.log = log

    def submit(self, ops):
        ops = list(ops)
        inner = super().submit(ops)
        out: Future = Future()

        def done(f):
            if f.exception() is None and ops and ops[0].write:
                for op in ops:
                    self.log.add("written", (op.fd, op.offset, op.offset + op.nbytes))
            if f.exception() is not None:
                out.set_exception(f.exception())
            else:
                out.set_result(f.result())

        inner.add_done_callback(done)
        return out


class RecordingIndex(LruIndex):
    def __init__(self, log: Log):
        super().__init__()
        self.log = log

    def put(self, key, slot):
        self.log.add("publish", (key, slot))
        super().put(key, slot)


def _pipelined(monkeypatch):
    monkeypatch.setattr(G3Pool, "chunk_bytes", 3 * SLOT)
    monkeypatch.setattr(G3Pool, "min_chunk_blocks", 1)
    monkeypatch.setattr(G3Pool, "chunks_in_flight", 2)


@pytest.mark.parametrize("fsync", [True, False])
def test_fsync_setting_decides_whether_slab_files_are_fdatasynced(tmp_path, monkeypatch, fsync):
    """``g3.fsync``: true (the default), every slab file a batch wrote is fdatasync'ed before the batch is
    published; false (throwaway benchmarks only), none is."""
    synced: list[int] = []

    def recording_sync(fd):
        synced.append(fd)
        real_fdatasync(fd)

    monkeypatch.setattr(pool_mod, "fdatasync", recording_sync)
    with open_pool(tmp_path, fsync=fsync, files_per_path=2, io_size_bytes=4 * SLOT) as pool:
        keys = NS.keys(range(1, 17))
        assert pool.put(keys, [payload(k.seq_hash) for k in keys]).result(timeout=HANG_S).written == 16
        slab_fds = {f.fd for f in pool.slabs.files}
        if fsync:
            assert set(synced) == slab_fds  # 16 blocks in runs of 4 striped over both files
        else:
            assert not set(synced) & slab_fds


def test_publish_only_after_own_fdatasync_while_writes_overlap_syncs(tmp_path, monkeypatch):
    _pipelined(monkeypatch)
    log = Log()
    # Deterministic on a loaded machine: the writer's second piece is held until the first fdatasync
    # has started, and that first fdatasync (a slow disk flush) lasts until a write lands. A pipelined
    # writer submits the second piece while the first one syncs, so the flush ends at once; a writer
    # that waits for the sync before writing on never lands one, and the check below fails (after 30 s).
    first_sync_started, write_during_first_sync = threading.Event(), threading.Event()

    def slow_sync(fd):
        log.add("sync_start", fd)
        if not first_sync_started.is_set():
            first_sync_started.set()
            write_during_first_sync.wait(timeout=HANG_S)
        else:
            time.sleep(0.01)  # a slow disk flush, so later pieces' writes land during it
        real_fdatasync(fd)
        log.add("sync_end", fd)

    monkeypatch.setattr(pool_mod, "fdatasync", slow_sync)
    eng = RecordingEngine(log)
    write_submits = itertools.count(1)
    plain_submit = eng.submit

    def gated_submit(ops):
        ops = list(ops)
        if ops and ops[0].write and next(write_submits) == 2:
            first_sync_started.wait(timeout=HANG_S)
        out = plain_submit(ops)
        if ops and ops[0].write and first_sync_started.is_set():
            out.add_done_callback(lambda f: write_during_first_sync.set())
        return out

    eng.submit = gated_submit
    try:
        with open_pool(tmp_path, engine=eng, files_per_path=2) as pool:
            pool.index = RecordingIndex(log)
            keys = NS.keys(range(1, 61))
            res = pool.put(keys, [payload(k.seq_hash) for k in keys]).result(timeout=HANG_S)
            assert res.written == 60
            ev = list(log.events)
            checked = 0
            for seq, _kind, (key, (fi, si)) in ((s, k, w) for s, k, w in ev if k == "publish"):
                fd = pool.slabs.by_index[fi].fd
                lo, hi = si * SLOT, (si + 1) * SLOT
                # the slot's bytes: every write covering them finished before ...
                w = [s for s, k, x in ev if k == "written" and x[0] == fd and x[1] < hi and x[2] > lo and s < seq]
                assert w, f"{key} published before its slot was written"
                last_w = max(w)
                # ... a sync of that file that started after them and ended before the publish
                starts = [s for s, k, x in ev if k == "sync_start" and x == fd and last_w < s < seq]
                ends = [s for s, k, x in ev if k == "sync_end" and x == fd and s < seq]
                assert starts and any(e > min(starts) for e in ends), f"{key} published before its fdatasync"
                checked += 1
            assert checked == 60
            # the pipeline really overlapped: some write finished while an fdatasync was running
            open_syncs, overlapped = 0, False
            for _, kind, _ in ev:
                open_syncs += kind == "sync_start"
                open_syncs -= kind == "sync_end"
                overlapped |= kind == "written" and open_syncs > 0
            assert overlapped, "no write landed during an fdatasync: the writer is not pipelined"
            out = [aligned_empty(LAYOUT.bytes_per_block) for _ in keys]
            assert all(pool.get(keys, out).result(timeout=HANG_S).ok)
            assert pool.slot_accounting()["leaked"] == 0
    finally:
        eng.close()


@pytest.mark.parametrize("fail_call", [1, 2])
def test_failed_fdatasync_never_publishes_what_it_covered(tmp_path, monkeypatch, fail_call):
    _pipelined(monkeypatch)
    log = Log()
    calls = itertools.count(1)
    failed_fds = []

    def flaky_sync(fd):
        n = next(calls)
        log.add("sync_start", fd)
        time.sleep(0.005)
        if n == fail_call:
            failed_fds.append(fd)
            log.add("sync_fail", fd)
            raise OSError(errno.EIO, "Input/output error (injected fdatasync failure)")
        real_fdatasync(fd)
        log.add("sync_end", fd)

    monkeypatch.setattr(pool_mod, "fdatasync", flaky_sync)
    eng = RecordingEngine(log)
    try:
        with open_pool(tmp_path, engine=eng, files_per_path=1) as pool:
            pool.index = RecordingIndex(log)
            keys = NS.keys(range(1, 61))
            written = dropped = 0
            for part in (keys[:30], keys[30:]):  # two puts: at least two fdatasync rounds
                r = pool.put(part, [payload(k.seq_hash) for k in part]).result(timeout=HANG_S)
                written, dropped = written + r.written, dropped + r.dropped
            assert failed_fds
            assert written + dropped == 60 and dropped >= 1
            st = pool.stats()
            assert st["write_errors"] == 1 and st["dropped_by_reason"] == {"io_error": dropped}
            ev = list(log.events)
            fail_seq = next(s for s, k, _ in ev if k == "sync_fail")
            fd = pool.slabs.files[0].fd
            published = {x[0] for _, k, x in ev if k == "publish"}
            assert len(published) == written
            # a block whose bytes were written before the failed sync started and that was not
            # published before it failed is never published
            for s, k, x in ev:
                if k != "publish":
                    continue
                key, (fi, si) = x
                lo, hi = si * SLOT, (si + 1) * SLOT
                last_w = max(t for t, kk, y in ev if kk == "written" and y[0] == fd and y[1] < hi and y[2] > lo)
                assert not (last_w < fail_seq < s), f"{key} published although the fdatasync covering it failed"
            assert not any(pool.contains(k) for k in keys if k not in published)
            assert pool.slot_accounting()["leaked"] == 0 and pool.stats()["reserved_slots"] == 0
            out = [aligned_empty(LAYOUT.bytes_per_block) for _ in keys]
            got = pool.get(keys, out).result(timeout=HANG_S)
            assert [k in published for k in keys] == got.ok
            # the tier keeps working: the dropped blocks are written on the next offer
            res2 = pool.put(keys, [payload(k.seq_hash) for k in keys]).result(timeout=HANG_S)
            assert res2.written == dropped
    finally:
        eng.close()


def test_reads_verified_off_the_completion_thread_next_chunk_not_waiting(tmp_path, monkeypatch):
    """A get's chunks are verified on the pool's verifier thread: while one chunk's verification is
    held up, the engine's completion thread is free and the following chunks are still submitted and
    completed; every block is still verified (a corrupt one in a later chunk misses)."""
    monkeypatch.setattr(G3Pool, "read_chunk_bytes", 3 * SLOT)
    monkeypatch.setattr(G3Pool, "min_chunk_blocks", 1)
    monkeypatch.setattr(G3Pool, "read_chunks_in_flight", 2)
    log = Log()
    release = threading.Event()
    with open_pool(tmp_path, engine=PosixEngine(threads=4)) as pool:
        keys = NS.keys(range(1, 13))  # 4 chunks of 3
        assert pool.put(keys, [payload(k.seq_hash) for k in keys]).result(timeout=HANG_S).written == 12
        f, s = pool.index.get(keys[10])
        with open(pool.slabs.by_index[f].path, "r+b") as fh:
            fh.seek(s * SLOT + frame.HEADER_BYTES + 3)
            fh.write(b"\x5a\xa5")
        real_submit = pool.engine.submit
        real_verify = pool._frames.verify_many
        first = []

        def submit(ops):
            log.add("submit", threading.current_thread().name)
            return real_submit(ops)

        def verify_many(*a, **kw):
            if not first:
                first.append(threading.current_thread().name)
                log.add("verify_wait", None)
                assert release.wait(HANG_S)  # the first chunk's verification is held up
            log.add("verified", None)
            return real_verify(*a, **kw)

        monkeypatch.setattr(pool.engine, "submit", submit)
        monkeypatch.setattr(pool._frames, "verify_many", verify_many)
        outs = [aligned_empty(LAYOUT.bytes_per_block) for _ in keys]
        fut = pool.get(keys, outs)
        deadline = time.monotonic() + HANG_S
        while sum(1 for _, k, _ in log.events if k == "submit") < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        kinds = [k for _, k, _ in log.events]
        assert kinds.count("submit") == 4 and "verified" not in kinds  # all chunks went out meanwhile
        assert not fut.done()
        release.set()
        res = fut.result(timeout=HANG_S)
        assert res.ok == [True] * 10 + [False, True]
        assert first[0].startswith("kvbm-g3-verify")
        for o, k in zip(outs, keys):
            if k != keys[10]:
                assert (o == payload(k.seq_hash)).all()
        assert pool.stats()["pinned_slots"] == 0 and pool.slot_accounting()["leaked"] == 0


def test_verifier_failure_is_a_miss_never_a_hang_or_a_hit(tmp_path, monkeypatch):
    """If checking a chunk raises (a bug), its blocks are misses (counted io_error), the get still
    completes, nothing stays pinned, and staged bytes of unchecked blocks are not copied out."""
    monkeypatch.setattr(G3Pool, "read_chunk_bytes", 3 * SLOT)
    monkeypatch.setattr(G3Pool, "min_chunk_blocks", 1)
    with open_pool(tmp_path, engine=PosixEngine(threads=2)) as pool:
        keys = NS.keys(range(1, 7))  # 2 chunks of 3
        assert pool.put(keys, [payload(k.seq_hash) for k in keys]).result(timeout=HANG_S).written == 6
        real_verify = pool._frames.verify_many
        calls = []

        def verify_many(headers, payloads, *a):
            calls.append(len(payloads))
            if len(calls) == 1:
                raise RuntimeError("bug in the checker")
            return real_verify(headers, payloads, *a)

        monkeypatch.setattr(pool._frames, "verify_many", verify_many)
        outs = [aligned_empty(LAYOUT.bytes_per_block) for _ in keys]
        for o in outs:
            o[:] = 0xEE
        res = pool.get(keys, outs).result(timeout=HANG_S)
        assert sum(res.ok) == 3 and calls == [3, 3]
        for ok, o, k in zip(res.ok, outs, keys):
            assert (o == payload(k.seq_hash)).all() if ok else (o == 0xEE).all()
        st = pool.stats()
        assert st["misses_by_reason"].get("io_error") == 3
        assert st["pinned_slots"] == 0 and pool.slot_accounting()["leaked"] == 0


def test_small_gets_take_small_staging_buffers(tmp_path):
    """A get of a few blocks stages them in a buffer sized to them (the next power of two of slots), not
    in a full read piece (at least ``min_chunk_blocks`` = 32 slots): vLLM's tiers issue many gets of a
    few chunks at once, and full-piece buffers for each went past the kept staging, so every load
    pre-faulted fresh memory (with 2 MiB blocks, 64 MiB per get). 16 concurrent gets of 2 blocks leave
    at most 16 x 2 slots of staging behind (before: 16 x 32 slots, as far as the keep cap allowed)."""
    with open_pool(tmp_path, engine=PosixEngine(threads=4)) as pool:
        keys = NS.keys(range(1, 33))
        assert pool.put(keys, [payload(k.seq_hash) for k in keys]).result(timeout=HANG_S).written == 32
        pool._staging.clear()  # the staging pool is process-wide: forget other tests' buffers
        from kvbm_backend.pool.g3.read.host import HostGet
        hg = HostGet(pool.reader, [], [])  # the numpy get's planning, without a get
        assert hg.piece_slots >= 32
        outs = [aligned_empty(LAYOUT.bytes_per_block) for _ in keys]
        futs = [pool.get(keys[i:i + 2], outs[i:i + 2]) for i in range(0, 32, 2)]
        for f in futs:
            assert f.result(timeout=HANG_S).ok == [True, True]
        for o, k in zip(outs, keys):
            assert (o == payload(k.seq_hash)).all()
        kept = pool._staging.stats()["kept_bytes"]
        assert kept <= 16 * 2 * SLOT, f"{kept} B of staging kept after 16 gets of 2 blocks ({SLOT} B slots)"
        assert hg.stage_slots(1) == 1 and hg.stage_slots(3) == 4 and hg.stage_slots(10 ** 6) == hg.piece_slots
