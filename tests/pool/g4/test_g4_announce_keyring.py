"""G4 announcements and the keyring (``g4.announce``), on a real file:// G4 store and a real keyring file.

* A block stored again under another name or key is announced again. Before (2026-11-30) the announcer
  remembered each ``(tenant, seq_hash)`` it had learned for the life of the process, so after the keyring
  file was replaced (new pseudonyms and block names) or the tenant was revoked and re-created (a new data key
  id; gc reclaimed its old blocks) the blocks stored anew were never announced: other workers' routers lost
  the credit for them (they stayed loadable). Plain repeats are still suppressed.
* A plaintext pool (``g4.encrypt: false``) with a keyring writes no announcement for a revoked tenant, as it
  writes none of its blocks (:class:`~kvbm_backend.pool.g4.writer.G4Writer`). Before (2026-11-30) it did.
* Such a pool withdraws a revoked tenant's batches written before the revocation (it no longer serves their
  blocks) and does not credit them again. Before (2026-11-30) checksummed batches counted as held for good.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from kvbm_backend.config import G4Config
from kvbm_backend.crypto.keyring import Keyring, TenantRevoked, provider_for
from kvbm_backend.model.hashing import sequence_hashes
from kvbm_backend.pool.g4.announce import Announcements
from kvbm_backend.pool.g4.gc import run_gc
from kvbm_backend.pool.g4.pool import G4Pool
from tests.helpers.g4_writer import namespace
from tests.pool.g4.test_g4_announce import _request, _save, _worker  # the same worker and save steps

HANG_S = 600.0  # a hang guard, not a bound: waits for what must come; returns as soon as it does
RELOAD_S = 0.2  # g4.keyring.reload_interval_s of the pools


def _until(pred) -> None:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < HANG_S, "hang guard"
        time.sleep(0.05)


def _cfg(tmp_path, encrypt: bool = True) -> G4Config:
    return G4Config(url=f"file://{tmp_path / 'store'}", encrypt=encrypt, announce=True, dir_fanout=16,
                    timeout_s=60.0, keyring={"path": str(tmp_path / "keys" / "keyring.json"),
                                             "reload_interval_s": RELOAD_S})


def _operator(tmp_path) -> Keyring:
    """The operator's own view of the keyring file (``kvbm-backend keys ...``)."""
    p = tmp_path / "keys" / "keyring.json"
    return Keyring(p, provider_for(p), reload_every_s=0)


def _batches_of(pool, tenant: str) -> int:
    ann = Announcements(pool.store, pool.namespace.fingerprint, pool.keyring, pool.encrypt, pool.pseudonym)
    return sum(1 for b in ann.list() if b.tenant_hex == pool.pseudonym(tenant).hex())


def _relearn(ev, tenant, toks, rid):
    """The same blocks saved again by a request (the scheduler learns them again)."""
    bs = namespace().layout.page_size
    hs = list(sequence_hashes(toks, bs))
    ev.learn(tenant, _request(rid, toks, bs), hs, 0, len(hs))


@pytest.mark.slow  # imports vLLM (~20 s on the dev VM); no wall-clock assertion
@pytest.mark.side
def test_blocks_stored_again_after_the_keyring_file_is_replaced_are_announced_again(tmp_path, monkeypatch):
    monkeypatch.delenv("KVBM_BACKEND_KEK", raising=False)  # the KEK file next to the keyring (kept)
    cfg = _cfg(tmp_path)
    kr = tmp_path / "keys" / "keyring.json"
    bs = namespace().layout.page_size
    toks = list(range(7001, 7001 + 4 * bs))
    with G4Pool(cfg, namespace()) as pool:
        a = _worker(pool)
        _save(pool, a, "tenant-x", toks)
        assert a.announcer.flush() == 4
        _relearn(a, "tenant-x", toks, "again")
        assert a.announcer.flush() == 0  # a plain repeat: announced once
        old = pool.pseudonym("tenant-x").hex()

        kr.unlink()  # a crypto-shred of every tenant, then a new keyring file (a new pseudonym key)
        _operator(tmp_path).create("tenant-x")
        _until(lambda: pool.keyring.naming_generation() == 1)
        assert pool.pseudonym("tenant-x").hex() != old
        _save(pool, a, "tenant-x", toks, rid="after-swap")  # stored anew: 4 written under the new names
        assert a.announcer.flush() == 4  # the old code: 0 (learned once per process)
        assert _batches_of(pool, "tenant-x") == 1  # under the new pseudonym
        _relearn(a, "tenant-x", toks, "again2")
        assert a.announcer.flush() == 0  # repeats under the new names: suppressed again

        with G4Pool(cfg, namespace()) as fresh:  # a worker on the new keyring credits them
            assert _worker(fresh).announcer.poll() == (4, 0)


@pytest.mark.slow  # imports vLLM (~20 s on the dev VM); no wall-clock assertion
@pytest.mark.side
def test_blocks_stored_again_after_the_tenant_is_revoked_and_re_created_are_announced_again(tmp_path, monkeypatch):
    monkeypatch.delenv("KVBM_BACKEND_KEK", raising=False)
    cfg = _cfg(tmp_path)
    bs = namespace().layout.page_size
    toks = list(range(5001, 5001 + 3 * bs))
    with G4Pool(cfg, namespace()) as pool:
        a = _worker(pool)
        _save(pool, a, "tenant-x", toks)
        assert a.announcer.flush() == 3
        key_id = pool.keyring.info("tenant-x")["key_id"]
        op = _operator(tmp_path)
        op.revoke("tenant-x")
        _until(lambda: pool.keyring.tenant_state("tenant-x") == "revoked")
        assert run_gc(pool.store, keyring=op)["deleted_by"]["revoked"] == 3  # its blocks reclaimed
        op.create("tenant-x")  # the operator brings the tenant back: a new key id, the same pseudonym
        _until(lambda: pool.keyring.tenant_state("tenant-x") == "active")
        assert pool.keyring.info("tenant-x")["key_id"] != key_id
        _save(pool, a, "tenant-x", toks, rid="re-created")  # stored anew: 3 written under the new key
        assert a.announcer.flush() == 3  # the old code: 0
        _relearn(a, "tenant-x", toks, "again")
        assert a.announcer.flush() == 0  # then repeats are suppressed

        with G4Pool(cfg, namespace()) as fresh:  # the revoked key's batch is foreign; the new one credited
            assert _worker(fresh).announcer.poll() == (3, 0)


def test_a_plaintext_pool_writes_no_announcement_for_a_revoked_tenant(tmp_path, monkeypatch):
    monkeypatch.delenv("KVBM_BACKEND_KEK", raising=False)
    with G4Pool(_cfg(tmp_path, encrypt=False), namespace()) as pool:
        op = _operator(tmp_path)
        op.create("tenant-x")
        ann = Announcements(pool.store, pool.namespace.fingerprint, pool.keyring, False, pool.pseudonym)
        ann.write("tenant-x", {"v": 2, "b": []})
        ann.write("tenant-unknown", {"v": 2, "b": []})  # no data key needed in plaintext: written, as its blocks
        assert len(ann.list()) == 2
        op.revoke("tenant-x")
        _until(lambda: pool.keyring.tenant_state("tenant-x") == "revoked")
        with pytest.raises(TenantRevoked):
            ann.write("tenant-x", {"v": 2, "b": []})  # the old code wrote it
        assert len(ann.list()) == 2  # nothing published
        block = np.zeros(namespace().layout.bytes_per_block, np.uint8)
        res = pool.put(namespace().keys([1], tenant="tenant-x"), [block]).result(HANG_S)
        assert res.dropped == 1  # as the pool's own block writes for the tenant


@pytest.mark.slow  # imports vLLM (~20 s on the dev VM); no wall-clock assertion
@pytest.mark.side
def test_a_plaintext_pool_withdraws_a_revoked_tenants_older_batches(tmp_path, monkeypatch):
    """A plaintext pool with a keyring stops serving a revoked tenant's blocks (reader: ``miss_revoked_tenant``),
    so its batches written before the revocation are withdrawn (``announce_revoked_batches``) and not credited
    again, as an encrypted pool's are. Before (2026-11-30) checksummed batches counted as held for good: the
    router kept crediting blocks whose loads miss."""
    from vllm.distributed.kv_events import BlockRemoved

    from kvbm_backend.integrations.vllm import stats
    monkeypatch.delenv("KVBM_BACKEND_KEK", raising=False)
    cfg = _cfg(tmp_path, encrypt=False)
    ns, bs = namespace(), namespace().layout.page_size
    with G4Pool(cfg, ns) as a_pool, G4Pool(cfg, ns) as b_pool:
        op = _operator(tmp_path)
        op.create("tenant-y")
        op.create("tenant-z")
        a, b = _worker(a_pool), _worker(b_pool)
        toks = list(range(3001, 3001 + 3 * bs))
        _save(a_pool, a, "tenant-y", toks)
        _save(a_pool, a, "tenant-z", list(range(4001, 4001 + 2 * bs)), rid="z")
        assert a.announcer.flush() == 5
        assert b.announcer.poll() == (5, 0)
        b.take()
        keys = ns.keys(list(sequence_hashes(toks, bs)), tenant="tenant-y")
        out = [np.zeros(ns.layout.bytes_per_block, np.uint8) for _ in keys]
        assert b_pool.get(keys, out).result(HANG_S).ok == [True] * 3  # served before the revocation

        op.revoke("tenant-y")
        _until(lambda: b_pool.keyring.tenant_state("tenant-y") == "revoked")
        assert b_pool.get(keys, out).result(HANG_S).ok == [False] * 3  # the pool no longer serves them
        before = stats.snapshot()
        assert b.announcer.poll() == (0, 3)  # the old code: (0, 0), the 3 blocks kept their router credit
        assert stats.snapshot().get("announce_revoked_batches", 0) - before.get("announce_revoked_batches", 0) == 1
        assert sum(len(e.block_hashes) for e in b.take() if isinstance(e, BlockRemoved)) == 3
        assert len(b.announcer.live()) == 2
        assert b.announcer.poll() == (0, 0)  # not credited again (ignored as foreign, as an encrypted one)

        with G4Pool(cfg, ns) as fresh:  # a worker started after the revocation credits tenant-z only
            assert _worker(fresh).announcer.poll() == (2, 0)


@pytest.mark.slow  # imports vLLM (~20 s on the dev VM); no wall-clock assertion
@pytest.mark.side
def test_learning_a_block_never_reloads_the_keyring_on_the_scheduler_thread(tmp_path, monkeypatch):
    """vLLM's scheduler thread calls ``learn`` for every saved block. Another worker changed the keyring file (a new
    tenant; use-count persists do the same) and the reload interval passed: ``learn`` must not read the file there
    (the keyring's reload parses and unwraps every key under its lock: 82-176 ms with 4,096 tenants). Before
    (2026-12-01) it asked the keyring for the tenant's name and key, which reloaded it on that thread. The
    background flush reads the keyring and still announces the blocks, and suppresses a plain repeat."""
    import threading
    monkeypatch.delenv("KVBM_BACKEND_KEK", raising=False)
    cfg = G4Config(url=f"file://{tmp_path / 'store'}", encrypt=True, announce=True, dir_fanout=16, timeout_s=60.0,
                   keyring={"path": str(tmp_path / "keys" / "keyring.json"), "reload_interval_s": 0.001})
    bs = namespace().layout.page_size
    with G4Pool(cfg, namespace()) as pool:
        a = _worker(pool)
        _save(pool, a, "tenant-x", list(range(9001, 9001 + 2 * bs)), rid="first")
        assert a.announcer.flush() == 2
        kr = pool.keyring
        loaders: list[int] = []
        real = kr._load
        kr._load = lambda: loaders.append(threading.get_ident()) or real()  # records who reads the file
        toks = list(range(9101, 9101 + 3 * bs))
        hs = list(sequence_hashes(toks, bs))
        assert pool.put(namespace().keys(hs, tenant="tenant-x"), [np.full(namespace().layout.bytes_per_block, 7,
                                                                          np.uint8)] * 3).result(HANG_S).written == 3
        for i in range(3):
            op = _operator(tmp_path)
            op.create(f"other-{i}")  # the file changed; its reload interval (1 ms) passes meanwhile
            time.sleep(0.01)
            a.learn("tenant-x", _request(f"r{i}", toks, bs), hs, 0, len(hs))  # what the scheduler thread does
        assert threading.get_ident() not in loaders  # the old code: the reload ran here
        del kr._load
        assert a.announcer.flush() == 3  # the flush (its own thread in a worker) reads the keyring and announces
        _relearn(a, "tenant-x", toks, "again")
        assert a.announcer.flush() == 0  # a plain repeat: suppressed


@pytest.mark.slow  # imports vLLM (~20 s on the dev VM); no wall-clock assertion
@pytest.mark.side
def test_a_block_not_announced_the_first_time_is_announced_when_learned_again(tmp_path, monkeypatch):
    """A learned block is remembered as announced only once its batch is written. Before (2026-12-01) ``learn``
    remembered it at once, so a block learned before its offload reached G4 (``announce_dropped_absent``) or
    whose batch write failed (``announce_write_errors``: a store error) was a "repeat" every later time it was
    learned: never announced, its router credit lost for the life of the process."""
    from kvbm_backend.integrations.vllm import stats
    monkeypatch.delenv("KVBM_BACKEND_KEK", raising=False)
    ns, bs = namespace(), namespace().layout.page_size
    with G4Pool(_cfg(tmp_path), ns) as pool:
        a = _worker(pool)
        a.announcer.absent_s = 0.0  # a learned block not in G4 at the flush is dropped at once
        _save(pool, a, "tenant-x", list(range(7001, 7001 + bs)), rid="created")  # the tenant has its data key
        assert a.announcer.flush() == 1
        toks = list(range(8001, 8001 + 2 * bs))
        hs = list(sequence_hashes(toks, bs))
        before = stats.snapshot()
        a.learn("tenant-x", _request("early", toks, bs), hs, 0, len(hs))  # before its blocks reached G4
        assert a.announcer.flush() == 0
        assert stats.snapshot().get("announce_dropped_absent", 0) - before.get("announce_dropped_absent", 0) == 2
        _save(pool, a, "tenant-x", toks, rid="stored")  # stored now, learned again
        assert a.announcer.flush() == 2  # the old code: 0

        toks2 = list(range(8101, 8101 + 3 * bs))

        def store_error(*_a, **_k):
            raise OSError("the store answered 500")
        a.announcer.ann.write = store_error
        before = stats.snapshot()
        _save(pool, a, "tenant-x", toks2, rid="w")
        assert a.announcer.flush() == 0
        assert stats.snapshot().get("announce_write_errors", 0) - before.get("announce_write_errors", 0) == 1
        del a.announcer.ann.write  # the store answers again
        _relearn(a, "tenant-x", toks2, "w2")
        assert a.announcer.flush() == 3  # the old code: 0
        _relearn(a, "tenant-x", toks2, "w3")
        assert a.announcer.flush() == 0  # now a repeat
        with G4Pool(_cfg(tmp_path), ns) as fresh:
            assert _worker(fresh).announcer.poll() == (6, 0)


@pytest.mark.slow  # imports vLLM (~20 s on the dev VM); no wall-clock assertion (waits are aged by hand)
@pytest.mark.side
def test_a_block_whose_offload_reaches_g4_late_is_still_announced_and_looked_for_less_often(tmp_path, monkeypatch):
    """Review finding (2026-12-01): a learned block not yet in G4 was looked for at every flush and dropped after
    30 s (``announce_dropped_absent``), so blocks behind a write-behind queue of a throttled or saturated store,
    durable a minute later, were never announced: other workers' routers never credited them. Now a block waits
    up to ``absent_s`` (600 s by default), looked for again after as long as it has waited (at least one
    interval): HEADs at about 1, 2, 4, 8 ... intervals instead of one per interval."""
    from kvbm_backend.integrations.vllm import stats
    monkeypatch.delenv("KVBM_BACKEND_KEK", raising=False)
    ns, bs = namespace(), namespace().layout.page_size
    with G4Pool(_cfg(tmp_path), ns) as pool:
        a = _worker(pool)
        ann = a.announcer
        _save(pool, a, "tenant-x", list(range(7001, 7001 + bs)), rid="created")  # the tenant has its data key
        assert ann.flush() == 1
        looks = []
        real = ann.g4.lookup_prefix
        ann.g4.lookup_prefix = lambda keys, **kw: looks.append(1) or real(keys, **kw)  # counts the HEADs asked
        toks = list(range(8001, 8001 + 2 * bs))
        hs = list(sequence_hashes(toks, bs))
        before = stats.snapshot().get("announce_dropped_absent", 0)
        a.learn("tenant-x", _request("early", toks, bs), hs, 0, len(hs))  # before its blocks reached G4
        assert ann.flush() == 0 and len(looks) == 2  # looked for once each
        assert ann.flush() == 0 and len(looks) == 2  # not due again before an interval has passed
        with ann._lock:  # the blocks have waited 100 s (past the old 30 s bound) and are due
            ann._pending = type(ann._pending)((k, (v[0], v[1], v[2] - 100, v[3] - 1000)) for k, v in ann._pending.items())
        assert ann.flush() == 0 and len(looks) == 4  # still not in G4: kept (the old code dropped them here)
        assert len(ann._pending) == 2 and min(v[3] - v[2] for v in ann._pending.values()) >= 2 * 100 - 1  # next
        # look after as long again as they waited
        assert stats.snapshot().get("announce_dropped_absent", 0) == before
        _save(pool, a, "tenant-x", toks, rid="stored")  # durable in G4 now (learned again: still pending)
        with ann._lock:
            ann._pending = type(ann._pending)((k, (v[0], v[1], v[2], v[3] - 1000)) for k, v in ann._pending.items())
        assert ann.flush() == 2  # the old code: dropped at 30 s, never announced
        with ann._lock:
            assert not ann._pending
        a.learn("tenant-x", _request("never", list(range(9001, 9001 + bs)), bs),
                list(sequence_hashes(list(range(9001, 9001 + bs)), bs)), 0, 1)  # a dropped offload: never in G4
        with ann._lock:
            ann._pending = type(ann._pending)((k, (v[0], v[1], v[2] - ann.absent_s, v[3])) for k, v in ann._pending.items())
        assert ann.flush() == 0
        assert stats.snapshot().get("announce_dropped_absent", 0) == before + 1  # given up after absent_s
