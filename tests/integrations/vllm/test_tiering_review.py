"""Review findings on the native tiers (G3Tier/G4Tier through vLLM's real TieringOffloadingSpec and manager, real
G3/G4 pools on tmp_path, out of tree via ``module_path``), 2026-11-30: the config's ``model`` names the namespace,
a chunk whose load failed is not a hit again at once, removals logged while a store publishes are not lost (nor
those polled before its job was), one
tenant's copy dropped is not the chunk removed, a G4 lookup stops at a request's first missing chunk, and a job's
``job_timeout_s`` counts from its submission (one queued past it fails without asking the pool)."""
from __future__ import annotations

import errno
import os

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")

from vllm.v1.kv_offload.base import LookupResult, Medium  # noqa: E402

from kvbm_backend.integrations.vllm.tiering import offload_key_hash  # noqa: E402
from kvbm_backend.integrations.vllm.tiering_harness import TieringHarness, offloading_config  # noqa: E402
from tests.integrations.vllm.test_tiering import GEO, HANG_S, _looked_up, _resolve, g3_tier, keys_for, payloads  # noqa: E402

pytestmark = [pytest.mark.vllm]


@pytest.fixture
def make():
    made: list[TieringHarness] = []

    def mk(tiers, **kw):
        h = TieringHarness(offloading_config(secondary_tiers=tiers, chunks=kw.pop("chunks", 32), **{**GEO, **kw}))
        made.append(h)
        return h

    yield mk
    for h in made:
        if h.primary is not None:
            h.shutdown()


def test_config_model_names_the_namespace_as_in_the_connector(tmp_path, make):
    """Two fine-tunes mounted at one path (vLLM's model name ``/model``) with different config ``model`` never
    share blocks; the same ``model`` does; without one, vLLM's model name (before: ``model`` was ignored and
    engine B served engine A's KV)."""
    a = make([g3_tier(tmp_path / "g3", config={"model": "finetune-A"})], model="/model")
    assert a.tier.namespace.model == "finetune-A"
    keys, data = keys_for(2, "ft"), payloads(a, 2, seed=1)
    a.store(keys, data)
    a.wait_idle()
    a.shutdown()
    b = make([g3_tier(tmp_path / "g3", config={"model": "finetune-B"})], model="/model")
    assert b.tier.namespace.model == "finetune-B"
    assert _looked_up(b.tier, b.context(), keys[0]) is LookupResult.MISS
    assert b.load(keys) == []
    b.shutdown()
    same = make([g3_tier(tmp_path / "g3", config={"model": "finetune-A"})], model="/model")
    got = same.load(keys)
    assert len(got) == 2 and all(np.array_equal(x, y) for x, y in zip(got, data))
    same.shutdown()
    plain = make([g3_tier(tmp_path / "g3plain")], model="/model")
    assert plain.tier.namespace.model == "/model"


def _inject_eio(monkeypatch, tier, key) -> None:
    """Reads of ``key``'s G3 slot fail with EIO (a bad sector; G3 cannot prove the bytes bad, so keeps the slot)."""
    fi, si = tier.pool.index.get(tier.namespace.key(offload_key_hash(key)))
    spath, sb = os.path.realpath(tier.pool.slabs.by_index[fi].path), tier.pool.slot_bytes
    real_preadv, real_pread = os.preadv, os.pread

    def bad(fd, off) -> bool:
        try:
            return si * sb <= off < (si + 1) * sb and os.readlink(f"/proc/self/fd/{fd}") == spath
        except OSError:
            return False

    def preadv(fd, bufs, off, *a):
        if bad(fd, off):
            raise OSError(errno.EIO, "injected bad sector")
        return real_preadv(fd, bufs, off, *a)

    def pread(fd, n, off, *a):
        if bad(fd, off):
            raise OSError(errno.EIO, "injected bad sector")
        return real_pread(fd, n, off, *a)

    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(os, "pread", pread)


@pytest.mark.parametrize("drop", [True, False], ids=["deleted", "kept"])
def test_a_chunk_g3_cannot_read_is_no_hit_again_and_is_rewritten(tmp_path, make, monkeypatch, drop):
    """A read error G3 cannot prove bad keeps the slot: before, every new request was offered the chunk, loaded it
    in vain and recomputed it, and the recomputed chunk's store (skipped: held) was published stored again. Now
    new requests miss the chunk for the cool-down (no load scheduled) and the recomputed chunk's stores are not
    published while it cools. ``deleted``: the copy has stayed unreadable long enough (two earlier failed loads'
    re-reads, 150 and 300 s before this one on the pool's clock: ``G3Pool.drop_unreadable``), so the tier deletes
    it, the recompute's store writes a new copy, and that copy serves the exact bytes once the cool-down is over (a
    fresh tier). ``kept``: a tier that keeps the copy (G4, or a deletion that failed) still misses the chunk and
    publishes none of its stores while it cools."""
    t = g3_tier(tmp_path / "g3", enable_kv_events=True)
    t["g3"]["engine"] = "posix"  # reads through os.preadv/os.pread, where the bad sector is injected
    h = make([t], enable_kv_cache_events=True)
    tier = h.tier
    monkeypatch.setattr(tier, "drop_unreadable", drop, raising=False)
    keys, data = keys_for(1, "bad-sector"), payloads(h, 1, seed=7)
    h.store(keys, data)
    h.wait_idle()
    assert [(e.removed, len(e.keys)) for e in h.manager.take_events() if e.medium is Medium.STORAGE] == [(False, 1)]
    with monkeypatch.context() as mp:
        _inject_eio(mp, tier, keys[0])
        now = [1000.0]
        tier.pool.reader.unreadable.clock = lambda: now[0]
        for t in (1000.0, 1150.0):  # earlier failed loads' re-reads (kept: docs/invariants.md #1)
            now[0] = t
            assert tier.pool.drop_unreadable(tier._block_keys(keys[0], tier._tenant)).result(timeout=HANG_S) == 0
        now[0] = 1300.0
        for attempt in range(3):
            h.reset_primary()
            assert h.load(keys, ctx=h.context(f"req-{attempt}"), timeout=HANG_S) == []
            if attempt == 0:  # deleted: the recompute's store writes it again; kept: it stays (cooling)
                assert tier.pool.contains(tier.namespace.key(offload_key_hash(keys[0]))) is not drop
            h.reset_primary()
            h.store(keys, data)  # the request recomputed the chunk; vLLM offloads it again
            h.wait_idle()
            ev = [(e.removed, len(e.keys)) for e in h.manager.take_events() if e.medium is Medium.STORAGE]
            # never published stored again (the deleted copy's removal is not reported either when the recompute
            # wrote the chunk again before the tier looked: held again)
            assert all(removed for removed, _ in ev) and (attempt == 0 or ev == []), (attempt, ev)
            st = tier.kvbm_stats()["tier"]
            assert (st["loads"], st["loads_failed"], st["blocks_dropped"]) == (1, 1, int(drop)), (attempt, st)
            assert st["chunks_stored"] == 1, st  # the first store only: the cooling chunk's stores are skipped
        assert _looked_up(tier, h.context("new"), keys[0]) is LookupResult.MISS
        assert tier.pool.contains(tier.namespace.key(offload_key_hash(keys[0])))  # recomputed (deleted) or kept
    h.shutdown()
    again = make([g3_tier(tmp_path / "g3")])
    got = again.load(keys, timeout=HANG_S)
    assert len(got) == 1 and np.array_equal(got[0], data[0])


def test_a_burst_of_read_errors_keeps_the_g3_chunk_cooling_and_it_loads_after(tmp_path, make, monkeypatch):
    """Review 2026-12-01, finding 3 (the reviewer's r2_eio_burst on a G3Tier): every read of the chunk's slot fails
    for a moment, covering the load's read, the get's re-read and the tier's re-read before a delete. The load fails
    (the request recomputes) and new requests miss the chunk while it cools (not offered again), but G3 keeps it: an
    I/O error is no proof of bad bytes (docs/invariants.md #1). Once the reads work again, a fresh tier (the
    cool-down is the tier's) loads its exact bytes. Before the fix the tier deleted it (``blocks_dropped`` 1)."""
    t = g3_tier(tmp_path / "g3")
    t["g3"]["engine"] = "posix"  # reads through os.preadv/os.pread, where the errors are injected
    h = make([t])
    tier = h.tier
    keys, data = keys_for(1, "eio-burst"), payloads(h, 1, seed=13)
    h.store(keys, data)
    h.wait_idle()
    h.reset_primary()
    bkey = tier.namespace.key(offload_key_hash(keys[0]))
    from tests.helpers.eio import slot_eio
    with monkeypatch.context() as mp:
        eio = slot_eio(mp, tier.pool, bkey)
        assert h.load(keys, ctx=h.context("req-burst"), timeout=HANG_S) == []
        assert eio.failed >= 3, eio  # the load's read, the get's re-read, the tier's re-read
    st = tier.kvbm_stats()
    assert (st["tier"]["loads_failed"], st["tier"].get("blocks_dropped", 0)) == (1, 0), st["tier"]
    assert tier.pool.contains(bkey), "a good block was deleted after a burst of read errors"
    assert st["pool"]["unreadable_kept"] == 1 and st["pool"]["deleted"] == 0, st["pool"]
    assert _looked_up(tier, h.context("new"), keys[0]) is LookupResult.MISS  # cooling: not offered again
    h.shutdown()
    again = make([g3_tier(tmp_path / "g3")])
    got = again.load(keys, timeout=HANG_S)
    assert len(got) == 1 and np.array_equal(got[0], data[0])


def test_a_chunk_evicted_right_after_its_store_published_is_reported_removed(tmp_path, make, monkeypatch):
    """Another job's eviction of a chunk lands right after this job's put published it (here: the put's block is
    deleted as soon as the put completes). Before, the tier read the pool's removal cursor only after its puts,
    took that removal for an older copy's, and kept the chunk published (and vLLM's tracker its payload) for good."""
    h = make([g3_tier(tmp_path / "g3", enable_kv_events=True)], enable_kv_cache_events=True)
    tier = h.tier
    keys, data = keys_for(2, "evicted-at-once"), payloads(h, 2, seed=9)
    doomed = tier.namespace.key(offload_key_hash(keys[0]))
    real_put = tier.pool.put

    def put_then_evict(bkeys, bufs):
        fut = real_put(bkeys, bufs)
        fut.result(timeout=HANG_S)  # published ...
        if doomed in bkeys:
            tier.pool.delete([doomed]).result(timeout=HANG_S)  # ... and evicted at once
        return fut

    monkeypatch.setattr(tier.pool, "put", put_then_evict)
    h.store(keys, data)
    h.wait_idle()
    ev = [(e.removed, sorted(e.keys)) for e in h.manager.take_events() if e.medium is Medium.STORAGE]
    assert (True, [keys[0]]) in ev, ev
    assert len(tier._held) == 1  # only the chunk the pool still holds stays published
    assert not tier.pool.contains(doomed)


def test_a_chunk_evicted_before_its_store_job_is_polled_is_not_published(tmp_path, make):
    """The store job finished, its chunk was evicted (here: deleted from G3), and vLLM asked for events before its
    step polled the job. Before, that ``take_events`` took the removal from G3's log as no published chunk's, then
    the job's chunks were all published stored: a chunk the pool did not hold, never reported removed (kept for
    good, and its payload in vLLM's tracker). Now only the chunks G3 holds when the job is polled are published."""
    h = make([g3_tier(tmp_path / "g3", enable_kv_events=True)], enable_kv_cache_events=True)
    tier = h.tier
    keys, data = keys_for(2, "polled-late"), payloads(h, 2, seed=5)
    h.store(keys, data)
    tier.drain_jobs()  # the job ended; its result waits for the next step's get_finished_jobs
    doomed = tier._block_keys(keys[0], tier._tenant)
    assert tier.pool.delete(doomed).result(timeout=HANG_S) == 1  # evicted before the job is polled

    def events():
        return [(e.removed, list(e.keys)) for e in h.manager.take_events() if e.medium is Medium.STORAGE]

    ev = events()
    h.wait_idle()
    ev += events()
    stored = [k for removed, ks in ev if not removed for k in ks]
    gone = [k for removed, ks in ev if removed for k in ks]
    assert [k for k in stored if k not in gone] == [keys[1]], ev  # announced: exactly what G3 holds
    assert list(tier._held._held) == [keys[1]]
    assert not tier.pool.contains(doomed[0]) and tier.pool.contains(tier._block_keys(keys[1], tier._tenant)[0])
    tier.pool.delete(tier._block_keys(keys[1], tier._tenant)).result(timeout=HANG_S)
    assert events() == [(True, [keys[1]])] and len(tier._held) == 0


def test_one_tenants_copy_dropped_is_not_the_chunk_removed(tmp_path, make):
    """Alice and Bob each stored a chunk (published twice, one key: vLLM's block hash has no tenant). Alice's copy
    dropped: not reported removed while Bob's is held (before: the removal log, by sequence hash only, reported the
    chunk removed and the tier forgot it); Bob's dropped too: reported removed, once."""
    h = make([g3_tier(tmp_path / "g3", enable_kv_events=True)], enable_kv_cache_events=True)
    tier = h.tier
    keys, data = keys_for(1, "shared"), payloads(h, 1, seed=11)
    for t in ("alice", "bob"):
        h.store(keys, data, ctx=h.context(kv_transfer_params={"kvbm_tenant": t}))
        h.wait_idle()
        h.reset_primary()

    def events():
        return [(e.removed, list(e.keys)) for e in h.manager.take_events() if e.medium is Medium.STORAGE]

    assert events() == [(False, keys), (False, keys)]
    tier.pool.delete(tier._block_keys(keys[0], "alice")).result(timeout=HANG_S)
    assert events() == [] and len(tier._held) == 1
    got = h.load(keys, ctx=h.context(kv_transfer_params={"kvbm_tenant": "bob"}), timeout=HANG_S)
    assert len(got) == 1 and np.array_equal(got[0], data[0])
    tier.pool.delete(tier._block_keys(keys[0], "bob")).result(timeout=HANG_S)
    assert events() == [(True, keys)] and len(tier._held) == 0
    assert events() == []


def _positioned(ctx, keys):
    """Record each key's end position in the request, as vLLM's ``update_offload_keys`` does (16 tokens a chunk)."""
    for i, k in enumerate(keys):
        ctx.set_offload_key_position(k, (i + 1) * 16)
    return ctx


def test_a_g4_lookup_stops_at_the_requests_first_missing_chunk(tmp_path, make):
    """vLLM posts every chunk of a prompt in its first step: one HEAD per chunk before (64 here, with only chunks
    0-3 in G4); now one prefix lookup per request and tenant, whose HEAD waves stop at chunk 4."""
    tier_spec = {"type": "G4Tier", "module_path": "kvbm_backend.integrations.vllm.tiering",
                 "num_kv_heads": GEO["num_kv_heads"], "io_threads": 2,
                 "g4": {"url": f"file://{tmp_path / 'g4'}", "keyring": {"path": str(tmp_path / "keys" / "kr.json")},
                        "timeout_s": 60.0}}
    h = make([tier_spec], chunks=64)
    keys, data = keys_for(64, "long-prompt"), payloads(h, 4, seed=13)
    h.store(keys[:4], data)
    h.wait_idle()
    h.reset_primary()
    tier = h.tier
    heads: list = []
    store, real_head = tier.pool.lookups.store, tier.pool.lookups.store.head
    store.head = lambda name: heads.append(name) or real_head(name)
    ctx = _positioned(h.context("R"), keys)
    tier.on_new_request(ctx)
    got = _resolve(tier, ctx, keys)
    assert [got[k] for k in keys] == [LookupResult.HIT] * 4 + [LookupResult.MISS] * 60
    assert 5 <= len(heads) <= 16, len(heads)  # the first wave(s) only, not 64
    tier.on_request_finished(ctx)


def test_prefix_lookups_follow_vllms_scan_order(tmp_path, make):
    """Ascending positions (vLLM's full-attention prefix scan): one prefix lookup, and G3 looks past the missing
    chunk 2 (another tier may hold it: vLLM's manager takes each chunk from the first tier holding it), so chunk 3
    is a hit (until 2026-11-30 a miss; G4 still stops at its first gap:
    test_a_g4_lookup_stops_at_the_requests_first_missing_chunk; tests/integrations/vllm/test_tiering_gaps.py).
    Descending (its sliding-window scan from the end) or no positions: each chunk on its own, so a missing last
    chunk hides no earlier one."""
    h = make([g3_tier(tmp_path / "g3")])
    keys, data = keys_for(6, "scan"), payloads(h, 6, seed=17)
    held = [0, 1, 3]
    h.store([keys[i] for i in held], [data[i] for i in held])
    h.wait_idle()
    tier = h.tier
    expect = [LookupResult.HIT if i in held else LookupResult.MISS for i in range(6)]
    fwd = _positioned(h.context("fwd"), keys)
    back = _positioned(h.context("back"), keys)
    bare = h.context("bare")
    for ctx in (fwd, back, bare):
        tier.on_new_request(ctx)
    got = _resolve(tier, fwd, keys)
    assert [got[k] for k in keys] == expect  # chunk 3 (after the missing chunk 2): a hit, G3 holds it
    tier.on_request_finished(fwd)
    got = _resolve(tier, back, keys[::-1])
    assert [got[k] for k in keys] == expect
    tier.on_request_finished(back)
    got = _resolve(tier, bare, keys)
    assert [got[k] for k in keys] == expect
    tier.on_request_finished(bare)


@pytest.mark.parametrize("timer", ["on_time", "late"])
def test_a_job_queued_past_its_deadline_fails_without_asking_the_pool(tmp_path, make, monkeypatch, caplog, timer):
    """``job_timeout_s`` counts from vLLM's submission of a job. One I/O thread, a G4 ``file://`` store whose
    object opens block in the kernel (a hung mount): load job 901 waits for its object until its deadline; job 902,
    submitted with it and queued behind it past its own deadline, fails without opening its object. Before, its
    bound started when the thread took it up: it opened its object and waited a whole ``job_timeout_s`` more (with
    n jobs queued, a request and ``drain_jobs`` waited n bounds). ``late``: the deadline timer thread has not run
    when the I/O thread takes job 902 up (a busy host; CI 2026-12-02: job 902 asked the pool): the thread itself
    finds the deadline passed and fails it, the pool not asked."""
    import logging
    import threading
    import time

    from vllm.v1.kv_offload.tiering.base import TransferJob

    from tests.helpers.held_open import HeldOpen
    timeout_s = 0.5
    h = make([{"type": "G4Tier", "module_path": "kvbm_backend.integrations.vllm.tiering",
               "num_kv_heads": GEO["num_kv_heads"], "io_threads": 1, "job_timeout_s": timeout_s,
               "g4": {"url": f"file://{tmp_path / 'g4'}", "keyring": {"path": str(tmp_path / "keys" / "kr.json")},
                      "timeout_s": 60.0}}])  # the pool's own bound far beyond the job's
    tier = h.tier
    if timer == "late":  # deadlines armed from now on never fire on the timer thread
        monkeypatch.setattr(tier._tasks._timer, "add", lambda at, fn: None)
    keys, data = keys_for(2, "queued"), payloads(h, 2, seed=19)
    h.store(keys, data)
    h.wait_idle(timeout=HANG_S)
    assert tier.kvbm_stats()["tier"]["chunks_stored"] == 2
    name = [tier.pool.object_name(tier._block_keys(k, tier._tenant)[0]) for k in keys]
    opened: list[str] = []
    store = tier.pool.store

    def recording(real):
        return lambda n, *a: opened.append(n) or real(n, *a)

    for m in ("get", "get_into"):  # every object read of the G4 store starts with one of these (then opens it)
        monkeypatch.setattr(store, m, recording(getattr(store, m)))

    class HoldFirstFailure(logging.Handler):
        """Holds the I/O thread in job 901's failure warning (before its next job) until the test lets it go:
        job 902 is then taken up past its deadline whatever the machine's scheduling (no race of microseconds)."""
        logged, go = threading.Event(), threading.Event()

        def emit(self, record):
            if "job 901 " in record.getMessage():
                self.logged.set()
                self.go.wait(HANG_S)

    hold = HoldFirstFailure()
    logger = logging.getLogger("kvbm_backend.integrations.vllm.tiering")
    logger.addHandler(hold)
    held = HeldOpen([store._path(n) for n in name])
    try:
        with caplog.at_level("WARNING", logger="kvbm_backend.integrations.vllm.tiering"):
            tier.submit_load(TransferJob(901, keys[:1], np.array([5]), True, h.context()))
            tier.submit_load(TransferJob(902, keys[1:], np.array([6]), True, h.context()))
            passed = time.monotonic() + timeout_s  # job 902's deadline is no later than this
            assert hold.logged.wait(HANG_S), "job 901 never failed"
            assert name[0] in opened  # job 901 asked its object of the hung store
            while time.monotonic() <= passed:  # an ordering guard, no bound: job 902 is now past its deadline
                time.sleep(0.01)
            hold.go.set()
            done: dict = {}
            end = time.monotonic() + HANG_S
            while len(done) < 2:
                assert time.monotonic() < end, f"jobs not finished: {done}"
                done.update({r.job_id: r.success for r in tier.get_finished_jobs()})
                time.sleep(0.002)
        assert done == {901: False, 902: False}
        assert name[1] not in opened, opened  # before: job 902 opened its object and waited job_timeout_s more
        st = tier.kvbm_stats()["tier"]
        assert (st["loads"], st["loads_failed"], st["chunks_load_failed"], st["chunks_loaded"]) == (2, 2, 2, 0), st
        assert "job 902 (load of 1 chunks) failed: job_timeout_s (0.5 s) passed while it was queued" in caplog.text
        assert "the pool was not asked" in caplog.text, caplog.text
    finally:
        hold.go.set()
        logger.removeHandler(hold)
        held.release()
