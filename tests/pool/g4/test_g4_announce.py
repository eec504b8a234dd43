"""G4 announcements (``g4.announce``, issue 25 item 5) against a real SeaweedFS: worker A saves blocks to G4
and announces them; worker B (another pool and scheduler, the same bucket and keyring) polls and queues
``BlockStored`` (``medium="DISK"``) events for A's blocks with A's vLLM hashes and tokens. Records are sealed
(the prompt's tokens never appear in the object); another fleet's records (a keyring B does not share),
records moved to another tenant's directory and garbage are ignored and counted; expired records are
withdrawn (``BlockRemoved``) and deleted."""
from __future__ import annotations

import time
from array import array

import numpy as np
import pytest

from tests.helpers.g4_writer import namespace

from kvbm_backend.config import G4Config
from kvbm_backend.integrations.vllm import stats
from kvbm_backend.pool.g4.pool import G4Pool

HANG_S = 600.0  # a hang guard, not a bound: waits for records and results that must come; returns as soon as they do


@pytest.fixture
def fleet(tmp_path, seaweed, s3_prefix):
    """Two G4 pools (workers A and B) on one SeaweedFS prefix and keyring, plus a third pool of another
    fleet (its own keyring) on the same prefix."""
    # timeout_s 60 (was 5): these tests check records, not speed; a request the busy CI VM froze for 13-31 s
    # (2026-11-29) must not turn a check into a miss
    kw = {"url": seaweed.url(s3_prefix), "endpoint_url": seaweed.endpoint, "timeout_s": 60.0, "dir_fanout": 16,
          "announce": True, "announce_interval_s": 0.1}
    pools = [G4Pool(G4Config(**kw, keyring={"path": str(tmp_path / "keys" / "keyring.json")}), namespace())
             for _ in range(2)]
    pools.append(G4Pool(G4Config(**kw, keyring={"path": str(tmp_path / "other" / "keyring.json")}), namespace()))
    yield pools
    for p in pools:
        p.close()


def _request(rid, toks, bs, salt=None):
    """A vLLM request of ``toks`` with vLLM's block hasher (``salt``: its ``cache_salt``)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request
    init_none_hash(sha256_cbor)
    return Request(rid, toks, SamplingParams(max_tokens=1), None, block_hasher=get_request_block_hasher(bs, sha256_cbor),
                   cache_salt=salt)


def _worker(pool, ttl=None):
    """A scheduler's KV events (no G3) with the announcer the connector wires for ``g4.announce``."""
    from kvbm_backend.integrations.vllm.g4_announce import G4Announcer
    from kvbm_backend.integrations.vllm.kv_events import G3KvEvents
    ns = namespace()
    ev = G3KvEvents(1, ns.layout.page_size, g3=False)
    ev.announcer = G4Announcer(ev, pool, ns, pool.cfg.announce_interval_s, ttl or pool.cfg.announce_ttl_s)
    return ev


def _save(pool, ev, tenant, toks, rid="r"):
    """What a worker's save does: the blocks go to G4, the scheduler learns them."""
    from kvbm_backend.model.hashing import sequence_hashes
    ns = namespace()
    bs = ns.layout.page_size
    hs = list(sequence_hashes(toks, bs))
    blocks = [np.full(ns.layout.bytes_per_block, i + 1, np.uint8) for i in range(len(hs))]
    assert pool.put(ns.keys(hs, tenant=tenant), blocks).result(HANG_S).written == len(hs)
    assert pool.flush(HANG_S)
    r = _request(rid, toks, bs)
    ev.learn(tenant, r, hs, 0, len(hs))
    return r


def _stored(events):
    from vllm.distributed.kv_events import BlockStored
    return [e for e in events if isinstance(e, BlockStored)]


def test_announced_g4_blocks_reach_every_worker_sealed(fleet):
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as conv
    a_pool, b_pool, _ = fleet
    a, b = _worker(a_pool), _worker(b_pool)
    bs = namespace().layout.page_size
    toks = list(range(7001, 7001 + 4 * bs))
    r = _save(a_pool, a, "tenant-x", toks)
    before = stats.snapshot()
    assert b.announcer.poll() == (0, 0)  # nothing announced yet: B credits nothing
    assert a.announcer.flush() == 4  # one batch for the tenant's 4 blocks
    objs = list(a_pool.store.list(f"{a_pool.namespace.fingerprint}/announce/"))
    assert len(objs) == 1
    raw = bytes(a_pool.store.get(objs[0].name))
    assert array("I", toks[bs:2 * bs]).tobytes() not in raw and b"7001" not in raw  # tokens sealed

    assert b.announcer.poll() == (4, 0)
    (ev,) = _stored(b.take())
    want = [conv(h) for h in r.block_hashes]
    assert ev.medium == "DISK" and ev.block_hashes == want and ev.parent_block_hash is None
    assert ev.token_ids == toks and ev.block_size == bs
    assert b.announcer.poll() == (0, 0) and b.take() == []  # read once
    # a prefix-cache reset (AllBlocksCleared) makes B publish them again
    b.republish()
    (again,) = _stored(b.take())
    assert again.block_hashes == want
    # A polls its own batch too: every announcing worker is credited (the writer included)
    assert a.announcer.poll() == (4, 0)
    after = stats.snapshot()
    assert after.get("announce_written_blocks", 0) - before.get("announce_written_blocks", 0) == 4


def test_unwritten_foreign_misplaced_and_corrupt_records_are_ignored(fleet):
    a_pool, b_pool, other_pool = fleet
    a, b, other = _worker(a_pool), _worker(b_pool), _worker(other_pool)
    bs = namespace().layout.page_size
    # learned but never in G4 (a dropped offload): not announced
    from kvbm_backend.model.hashing import sequence_hashes
    toks = list(range(9001, 9001 + 2 * bs))
    a.learn("tenant-x", _request("u", toks, bs), list(sequence_hashes(toks, bs)), 0, 2)
    assert a.announcer.flush() == 0
    # another fleet (a keyring B does not hold) announces into the same prefix: foreign
    _save(other_pool, other, "tenant-x", list(range(8001, 8001 + 2 * bs)))
    assert other.announcer.flush() == 2
    # A's batch for tenant-y copied under tenant-x's directory: sealed under another tenant's key
    _save(a_pool, a, "tenant-y", list(range(6001, 6001 + 2 * bs)), rid="y")
    assert a.announcer.flush() == 2
    ann = a.announcer.ann
    (y,) = [o for o in ann.list()
            if o.tenant_hex == a_pool.pseudonym("tenant-y").hex()]
    x_dir = a_pool.pseudonym("tenant-x").hex()
    moved = f"{ann.prefix}{x_dir}/{y.batch_id:016x}"
    a_pool.store.put(moved, a_pool.store.get(y.name))
    a_pool.store.delete(y.name)
    # garbage under a valid-looking name, and a flipped byte in a real batch
    a_pool.store.put(f"{ann.prefix}{x_dir}/{1:016x}", b"\x00" * 5000)
    _save(a_pool, a, "tenant-x", list(range(5001, 5001 + 2 * bs)), rid="z")
    assert a.announcer.flush() == 2
    (good,) = [o for o in ann.list() if o.tenant_hex == x_dir and o.name != moved and o.batch_id != 1]
    before = stats.snapshot()
    assert b.announcer.poll() == (2, 0)  # A's good tenant-x batch only
    after = stats.snapshot()

    def d(k):
        return after.get(k, 0) - before.get(k, 0)
    assert d("announce_ignored_foreign") == 1, after
    assert d("announce_ignored_corrupt") == 2, after  # the moved batch and the garbage
    stored = _stored(b.take())
    assert sum(len(e.block_hashes) for e in stored) == 2  # only A's good tenant-x batch
    assert stored[0].token_ids[0] == 5001
    # a flipped byte: a fresh name (B reads each name once), the same damage B must refuse
    data = bytearray(a_pool.store.get(good.name))
    data[-1] ^= 1
    a_pool.store.put(f"{ann.prefix}{x_dir}/{2:016x}", bytes(data))
    before = stats.snapshot()
    b.announcer.poll()
    assert stats.snapshot().get("announce_ignored_corrupt", 0) - before.get("announce_ignored_corrupt", 0) == 1
    assert _stored(b.take()) == []


def test_expired_announcements_are_withdrawn_and_deleted(fleet):
    """``g4.announce_ttl_s``: records expire (removal is by expiry, not announced): B withdraws the blocks
    (``BlockRemoved``) once the batch is as old as its writer's TTL (A's, sealed in it) on the store's clock and
    deletes the object."""
    from vllm.distributed.kv_events import BlockRemoved
    a_pool, _, _ = fleet
    b_pool = G4Pool(a_pool.cfg, namespace())
    a, b = _worker(a_pool, ttl=3.0), _worker(b_pool)  # B's own TTL is the default (3600 s): A's governs its batch
    bs = namespace().layout.page_size
    r = _save(a_pool, a, "tenant-x", list(range(4001, 4001 + 3 * bs)))
    assert a.announcer.flush() == 3
    assert b.announcer.poll() == (3, 0)
    b.take()
    deadline = time.time() + HANG_S
    while time.time() < deadline:  # store mtimes have a 1 s resolution: wait for the TTL on the store's clock
        if b.announcer.poll() != (0, 0):
            break
        time.sleep(0.5)
    (rm,) = [e for e in b.take() if isinstance(e, BlockRemoved)]
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as conv
    assert sorted(rm.block_hashes) == sorted(conv(h) for h in r.block_hashes)
    assert b.announcer.ann.list() == []  # the expired batch is deleted
    b.republish()
    assert _stored(b.take()) == []  # withdrawn blocks are not re-published
    b_pool.close()


def test_a_poller_with_a_shorter_ttl_keeps_another_writers_batches_for_the_writers_ttl(fleet):
    """``g4.announce_ttl_s`` is set per worker. Before (2026-12-01) every poller withdrew and deleted any batch older
    than its OWN TTL: one worker configured with a short TTL stripped the fleet's router credit for G4 blocks (on
    every worker: the batches were deleted; their blocks are not announced again under the same name and key). Now
    a batch is judged by the TTL its writer sealed in it; a batch written before then (none sealed) by the
    poller's own, as before."""
    a_pool, b_pool, _ = fleet
    a, b = _worker(a_pool), _worker(b_pool, ttl=2.0)  # A seals the default 3600 s; B's own TTL is 2 s
    bs = namespace().layout.page_size
    _save(a_pool, a, "tenant-x", list(range(6001, 6001 + 3 * bs)))
    assert a.announcer.flush() == 3
    assert b.announcer.poll() == (3, 0)
    time.sleep(3.5)  # the batch is now older than B's TTL on the store's clock (mtimes: 1 s resolution)
    assert b.announcer.poll() == (0, 0)  # the old code: (0, 3), and the batch deleted
    assert len(b.announcer.ann.list()) == 1
    assert _worker(b_pool, ttl=2.0).announcer.poll() == (3, 0)  # a poller that never read it: reads it, credits it

    old = _worker(a_pool)
    old.announcer.ttl_s = None  # writes its batch without a TTL, as writers before 2026-12-01 did
    _save(a_pool, old, "tenant-x", list(range(6101, 6101 + 2 * bs)), rid="old")
    assert old.announcer.flush() == 2
    assert b.announcer.poll() == (2, 0)
    deadline = time.time() + HANG_S
    while time.time() < deadline:  # B's own 2 s on the store's clock
        got = b.announcer.poll()
        if got != (0, 0):
            break
        time.sleep(0.5)
    assert got == (0, 2)  # withdrawn by B's own TTL, and deleted; A's batch stays
    assert len(b.announcer.ann.list()) == 1


def test_the_background_thread_flushes_and_polls_every_interval(fleet):
    """``g4.announce_interval_s``: started, each announcer writes what G4 holds and reads the others' batches
    by itself (0.1 s here; 30 s allowed for a loaded machine)."""
    a_pool, b_pool, _ = fleet
    a, b = _worker(a_pool), _worker(b_pool)
    assert a.announcer.interval_s == b.announcer.interval_s == 0.1  # the fleet's g4.announce_interval_s
    bs = namespace().layout.page_size
    a.announcer.start()
    b.announcer.start()
    try:
        _save(a_pool, a, "tenant-x", list(range(3001, 3001 + 2 * bs)))
        got = []
        deadline = time.time() + HANG_S
        while time.time() < deadline and sum(len(e.block_hashes) for e in got) < 2:
            got += _stored(b.take())
            time.sleep(0.1)
        assert sum(len(e.block_hashes) for e in got) == 2
    finally:
        a.announcer.stop()
        b.announcer.stop()


def test_unencrypted_pools_checksum_records_and_encrypted_pools_refuse_them(tmp_path):
    """``g4.encrypt: false`` stores records xxh3-checksummed, as its blocks; an encrypted pool on the same
    store never trusts such plaintext records (``corrupt``), and a flipped byte fails the checksum."""
    from kvbm_backend.pool.g4.announce import Announcements
    url = f"file://{tmp_path / 'store'}"
    plain = G4Pool(G4Config(url=url, encrypt=False, announce=True), namespace())
    sealed = G4Pool(G4Config(url=url, keyring={"path": str(tmp_path / "keys" / "keyring.json")}, announce=True),
                    namespace())
    try:
        p_ann = Announcements(plain.store, plain.namespace.fingerprint, None, False, plain.pseudonym)
        s_ann = Announcements(sealed.store, sealed.namespace.fingerprint, sealed.keyring, True, sealed.pseudonym)
        name = p_ann.write("t", {"v": 1, "b": []})
        (b,) = p_ann.list()
        assert b.name == name and p_ann.read(b) == ({"v": 1, "b": []}, "ok")
        assert s_ann.read(b) == (None, "corrupt")
        data = bytearray(plain.store.get(name))
        data[-2] ^= 1
        plain.store.put(name, bytes(data))
        assert p_ann.read(b) == (None, "corrupt")
    finally:
        plain.close()
        sealed.close()


@pytest.mark.slow  # imports vLLM (~20 s on the dev VM); no wall-clock assertion
@pytest.mark.side
def test_announcement_checks_are_not_counted_as_request_lookups(tmp_path):
    """Review finding (2026-11-29): the announcer's "is it in G4 yet?" checks went through the pool's
    lookup_prefix as if a request had looked the blocks up: every announced block raised kvbm_matched_tokens and
    pulled kvbm_object_cache_hit_rate towards 1 (and the pool's lookups / lookup_hits), with no request at all."""
    from kvbm_backend import metrics
    from kvbm_backend.integrations.vllm.g4_announce import G4Announcer
    from kvbm_backend.integrations.vllm.kv_events import G3KvEvents
    from kvbm_backend.model.hashing import sequence_hashes
    reg = metrics.new_registry()
    pool = G4Pool(G4Config(enabled=True, url=f"file://{tmp_path / 'store'}", announce=True, announce_interval_s=0.1,
                           keyring={"path": str(tmp_path / "keys" / "keyring.json")}), namespace(), registry=reg)
    try:
        ns = namespace()
        bs = ns.layout.page_size
        ev = G3KvEvents(1, bs, g3=False)
        ev.announcer = G4Announcer(ev, pool, ns, 0.1, 3600)
        toks = list(range(7001, 7001 + 4 * bs))
        hs = list(sequence_hashes(toks, bs))
        blocks = [np.full(ns.layout.bytes_per_block, i + 1, np.uint8) for i in range(4)]
        assert pool.put(ns.keys(hs, tenant="t"), blocks).result(HANG_S).written == 4
        pool.flush(HANG_S)
        ev.learn("t", _request("r", toks, bs), hs, 0, len(hs))
        assert ev.announcer.flush() == 4  # the checks ran and found the blocks
        st = pool.stats()
        assert st.get("lookups", 0) == 0 and st.get("lookup_hits", 0) == 0, st
        assert not metrics.sample_value(reg, "kvbm_matched_tokens_total")
        assert pool.lookup_prefix(ns.keys(hs, tenant="t")).result(HANG_S) == 4  # a request's lookup still counts
        assert pool.stats()["lookups"] == 1 and metrics.sample_value(reg, "kvbm_matched_tokens_total") == 4 * bs
    finally:
        pool.close()


@pytest.mark.slow  # imports vLLM (~20 s on the dev VM); no wall-clock assertion (the poller is driven directly)
@pytest.mark.side
def test_a_batch_stamped_ahead_neither_ages_nor_deletes_the_fresh_ones(tmp_path):
    """Review finding (2026-11-29): the poller's ``now`` was never earlier than the newest listed mtime, so one
    batch stamped an hour ahead (a writer's clock ahead on a client-stamped filesystem, a restored file) made
    every fresh batch an hour old: with the default TTL the poll withdrew and deleted all of them. Now the
    fresh batches and the one ahead are all credited and kept; the one ahead expires ``announce_ttl_s`` after
    this poller first listed it (module doc "Time base"), with the others."""
    import os
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as conv
    cfg = G4Config(url=f"file://{tmp_path / 'store'}", announce=True,
                   keyring={"path": str(tmp_path / "keys" / "keyring.json")})
    assert cfg.announce_ttl_s == 3600
    a_pool, b_pool = G4Pool(cfg, namespace()), G4Pool(cfg, namespace())
    try:
        a, b = _worker(a_pool), _worker(b_pool)
        bs = namespace().layout.page_size
        want = []
        for i in range(4):  # four batches of two blocks each
            r = _save(a_pool, a, "tenant-x", list(range(9001 + 1000 * i, 9001 + 1000 * i + 2 * bs)), rid=f"r{i}")
            assert a.announcer.flush() == 2
            want += [conv(h) for h in r.block_hashes]
        listed = a.announcer.ann.list()
        assert len(listed) == 4
        ahead = listed[0].name
        fut = time.time() + 3600  # one batch stamped an hour ahead
        os.utime(tmp_path / "store" / ahead, (fut, fut))
        before = stats.snapshot()
        assert b.announcer.poll() == (8, 0)  # every block credited, none withdrawn
        assert {x.name for x in b.announcer.ann.list()} == {x.name for x in listed}  # nothing deleted
        assert sorted(h for e in _stored(b.take()) for h in e.block_hashes) == sorted(want)
        after = stats.snapshot()
        assert after.get("announce_expired_batches", 0) == before.get("announce_expired_batches", 0)
        assert after.get("announce_future_batches", 0) - before.get("announce_future_batches", 0) == 1
        assert b.announcer.poll() == (0, 0)  # nothing changes on the next poll
        # a TTL later on the poller's clock, every batch expires: the one ahead too, though its stamp is young
        now = b.announcer._now
        b.announcer._now = lambda listed: (now(listed)[0] + 3600, True)  # type: ignore[method-assign]
        assert b.announcer.poll() == (0, 8)
        assert b.announcer.ann.list() == []
    finally:
        a_pool.close()
        b_pool.close()
