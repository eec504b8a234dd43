"""G4 announcements against hostile or broken batches, clocks and fleets (review 2026-11-30), on real file://
stores: records out of msgpack's range, a poller whose clock runs ahead, oversized and too-deep objects,
floods, replayed batches, revoked tenants, records of another tenant, and gc of announcement objects."""
from __future__ import annotations

import base64
import os
import socket
import time
import types
from array import array

import pytest

from tests.helpers.g4_writer import namespace
from tests.pool.g4.test_g4_announce import _request, _save, _worker  # the same worker and save steps

from kvbm_backend.config import G4Config
from kvbm_backend.integrations.vllm import stats
from kvbm_backend.pool.g4.pool import G4Pool

pytestmark = [pytest.mark.slow, pytest.mark.side, pytest.mark.vllm]  # imports vLLM; no wall-clock assertion
HANG_S = 60.0  # a hang guard, not a bound


def _init_hash():
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import init_none_hash
    init_none_hash(sha256_cbor)


@pytest.fixture
def mk(tmp_path):
    pools = []

    def make(**kw):
        cfg = dict(url=f"file://{tmp_path / 'store'}", announce=True,
                   keyring={"path": str(tmp_path / "keys" / "keyring.json")})
        cfg.update(kw)
        p = G4Pool(G4Config(**cfg), namespace())
        pools.append(p)
        return p
    _init_hash()
    yield make
    for p in pools:
        p.close()




def _tok64(toks):
    return base64.b64encode(array("I", toks).tobytes()).decode()


def _batch(bs, rows, t=None, v=None):
    from kvbm_backend.integrations.vllm.g4_announce import RECORD_VERSION, hash_domain
    return {"v": RECORD_VERSION if v is None else v, "w": "evil", "d": hash_domain(), "bs": bs, "t": time.time() if t is None else t, "b": rows}


def _delta(before):
    after = stats.snapshot()
    return {k: after[k] - before.get(k, 0) for k in after if k.startswith("announce") and after[k] != before.get(k, 0)}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("bad", ["hash", "parent", "lora_id", "lora_name", "extra_keys", "seq"])
def test_a_record_out_of_range_makes_its_batch_corrupt_and_the_step_batch_publishes(mk, bad):
    """Review finding 1: a record with a vLLM hash of 2**70 (or a str lora_id, ...) was queued; vLLM's
    ZmqEventPublisher failed to msgpack the step's whole batch (the engine's GPU events included). Now the
    batch is corrupt: nothing of it is queued, and the step's batch reaches a subscriber."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher
    a_pool, b_pool = mk(), mk()
    a, b = _worker(a_pool), _worker(b_pool)
    bs = namespace().layout.page_size
    _save(a_pool, a, "tenant-x", list(range(7001, 7001 + 2 * bs)))
    assert a.announcer.flush() == 2
    row = [1, None, 12345, None, _tok64([0] * bs), None, None, None]
    i, v = {"hash": (2, 2 ** 70), "parent": (3, -1), "lora_id": (6, "7"), "lora_name": (7, "x" * 5000),
            "extra_keys": (5, [{"a": 1}]), "seq": (0, 2 ** 64)}[bad]
    row[i] = v
    a.announcer.ann.write("tenant-x", _batch(bs, [row]))
    before = stats.snapshot()
    assert b.announcer.poll() == (2, 0)  # A's two good blocks only
    assert _delta(before).get("announce_ignored_corrupt") == 1
    assert b.announcer.poll() == (0, 0) and _delta(before).get("announce_ignored_corrupt") == 1  # never retried
    assert len(b.announcer.live()) == 2 and all(ent[0] != 2 ** 70 for ent in b.announcer.live())
    ev = b.take()
    gpu = BlockStored(block_hashes=[b"\x01" * 32], parent_block_hash=None, token_ids=list(range(bs)), block_size=bs,
                      lora_id=None, medium="GPU", lora_name=None)
    port = _free_port()
    pub = ZmqEventPublisher(0, endpoint=f"tcp://*:{port}")
    sub = zmq.Context.instance().socket(zmq.SUB)
    try:
        sub.connect(f"tcp://127.0.0.1:{port}")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        got = None
        deadline = time.monotonic() + HANG_S
        while got is None and time.monotonic() < deadline:  # a slow-joiner: publish until one arrives
            pub.publish(KVEventBatch(ts=time.time(), events=[gpu, BlockRemoved(block_hashes=[b"\x02" * 32], medium="GPU")] + ev))
            if sub.poll(200):
                got = msgspec.msgpack.decode(sub.recv_multipart()[-1])
        assert got is not None and len(got[1]) == 2 + len(ev)
    finally:
        sub.close(0)
        pub.shutdown()


def test_a_poller_whose_clock_runs_ahead_deletes_nothing(mk):
    """Review finding 2: a poller whose host clock was 2 h ahead, on a store stating no clock, had skew 0
    until it listed a batch of its own: every fresh batch looked expired and it deleted them all. Now it
    measures the store's clock (gc's probe object) before expiring anything."""
    import kvbm_backend.integrations.vllm.g4_announce as ga
    a_pool, c_pool = mk(), mk()
    a, c = _worker(a_pool), _worker(c_pool)
    bs = namespace().layout.page_size
    _save(a_pool, a, "tenant-x", list(range(7001, 7001 + 3 * bs)))
    assert a.announcer.flush() == 3
    real = time
    ga.time = types.SimpleNamespace(time=lambda: real.time() + 7200, monotonic=real.monotonic, sleep=real.sleep)  # type: ignore[assignment]
    try:
        before = stats.snapshot()
        assert c.announcer.poll() == (3, 0)
    finally:
        ga.time = real  # type: ignore[assignment]
    assert "announce_expired_batches" not in _delta(before)
    assert len(a.announcer.ann.list()) == 1
    assert a_pool.store.list("gc-clock-probe/") is not None and not list(a_pool.store.list("gc-clock-probe/"))


def test_an_oversized_object_is_refused_unread(mk, tmp_path):
    """Review finding 3: any object under announce/ was read whole before its size was checked (a 1 GiB sparse
    file: 1 GiB per poller per poll). Now the listed size refuses it, not a byte read; corrupt, once."""
    from kvbm_backend.pool.g4.announce import MAX_OBJECT_BYTES
    p = mk()
    b = _worker(p)
    name = f"{p.namespace.fingerprint}/announce/{'ab' * 16}/{'cd' * 8}"
    path = tmp_path / "store" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(MAX_OBJECT_BYTES + 1)  # sparse
    reads = []
    get = p.store.get
    p.store.get = lambda n, *a, **k: reads.append(n) or get(n, *a, **k)  # type: ignore[method-assign]
    before = stats.snapshot()
    assert b.announcer.poll() == (0, 0) and b.announcer.poll() == (0, 0)
    assert name not in reads
    assert _delta(before) == {"announce_ignored_corrupt": 1}


def test_records_nested_too_deep_are_corrupt_once(mk):
    """Review finding 7: RecursionError while parsing counted a poll error and the batch was read again every
    poll. Now it is corrupt, remembered, never read again."""
    from kvbm_backend.pool.g4 import announce as A
    p = mk()
    b = _worker(p)
    mark = {"mark": 1}
    dumps = A.json.dumps
    A.json.dumps = lambda o, *a, **k: ('{"v":2,"b":' + "[" * 200000 + "]" * 200000 + "}") if o is mark else dumps(o, *a, **k)
    try:
        b.announcer.ann.write("tenant-x", mark)
    finally:
        A.json.dumps = dumps
    reads = []
    get = p.store.get
    p.store.get = lambda n, *a, **k: reads.append(n) or get(n, *a, **k)  # type: ignore[method-assign]
    before = stats.snapshot()
    for _ in range(3):
        assert b.announcer.poll() == (0, 0)
    assert _delta(before) == {"announce_ignored_corrupt": 1}
    assert len([n for n in reads if "/announce/" in n]) == 1


def test_records_of_another_tenant_make_the_batch_corrupt(mk):
    """Review finding 6: a batch sealed for tenant-y carried tenant-x's blocks (cache salt tenant-x in their
    extra keys) and was credited. Now such a batch is corrupt; the same blocks sealed for tenant-x are fine."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as conv
    p = mk()
    b = _worker(p)
    bs = namespace().layout.page_size
    toks = list(range(5001, 5001 + 2 * bs))
    rx = _request("x", toks, bs, salt="tenant-x")
    ek = [to_event_extra_keys([generate_block_hash_extra_keys(rx, i * bs, (i + 1) * bs, 0)[0]])[0] for i in range(2)]
    assert ek[0] == ("tenant-x",)

    def enc(h):
        return None if h is None else (h.hex() if isinstance(h, bytes) else h)
    rows = [[i, i - 1 if i else None, enc(conv(rx.block_hashes[i])), enc(conv(rx.block_hashes[i - 1]) if i else None),
             _tok64(toks[i * bs:(i + 1) * bs]), list(ek[i]) if ek[i] else None, None, None] for i in range(2)]
    b.announcer.ann.write("tenant-y", _batch(bs, rows))
    before = stats.snapshot()
    assert b.announcer.poll() == (0, 0)
    assert _delta(before) == {"announce_ignored_corrupt": 1}
    b.announcer.ann.write("tenant-x", _batch(bs, rows))
    assert b.announcer.poll() == (2, 0)


def test_polls_read_a_bounded_number_of_batches_and_live_blocks_are_capped(mk, monkeypatch):
    """Review finding 4: no cap on batches read per poll or on blocks credited. Now MAX_BATCHES_PER_POLL
    batches are read a poll, and a batch that would take the live blocks past MAX_LIVE_BLOCKS is not
    credited (counted once, read again later)."""
    import kvbm_backend.integrations.vllm.g4_announce as ga
    monkeypatch.setattr(ga, "MAX_BATCHES_PER_POLL", 2)
    monkeypatch.setattr(ga, "MAX_LIVE_BLOCKS", 7)
    p = mk()
    b = _worker(p)
    bs = namespace().layout.page_size
    for k in range(4):
        b.announcer.ann.write("tenant-x", _batch(bs, [[k * 10 + i, None, k * 10 + i + 1, None, _tok64([k] * bs),
                                                       None, None, None] for i in range(3)]))
    before = stats.snapshot()
    assert b.announcer.poll() == (6, 0)  # two batches read
    assert b.announcer.poll() == (0, 0)  # the third and fourth would each make 9 > 7: not credited
    assert b.announcer.poll() == (0, 0)  # nor read again before FOREIGN_RETRY_S
    assert _delta(before).get("announce_ignored_capped") == 2 and len(b.announcer.live()) == 6


def test_importing_announced_blocks_holds_the_events_lock_a_chunk_at_a_time():
    """Review finding 4: emit_announced held the lock the scheduler's take() needs for the whole import
    (2.5 s for 600k records). Now it takes it once per EMIT_CHUNK blocks."""
    from kvbm_backend.integrations.vllm.kv_events import EMIT_CHUNK, G3KvEvents
    ev = G3KvEvents(1, 4, g3=False)
    n = [0]

    class Counting:
        def __init__(self, lock):
            self.lock = lock

        def __enter__(self):
            n[0] += 1
            return self.lock.__enter__()

        def __exit__(self, *a):
            return self.lock.__exit__(*a)
    ev._lock = Counting(ev._lock)  # type: ignore[assignment]
    k = 3 * EMIT_CHUNK
    ev.emit_announced([(i.to_bytes(8, "big"), None, [1, 2, 3, 4], None, None, None) for i in range(k)], [])
    assert n[0] == 3
    assert sum(len(e.block_hashes) for e in ev.take()) == k


def test_a_replayed_expired_batch_is_not_credited(mk):
    """Review finding 5 (replay): a batch's age came from its store mtime only, so writing back the bytes of
    an expired batch re-credited its blocks. Now the write time is sealed in the batch: the copy is still
    expired (and deleted)."""
    a_pool, b_pool = mk(), mk()
    a, b = _worker(a_pool, ttl=60), _worker(b_pool, ttl=60)
    bs = namespace().layout.page_size
    _save(a_pool, a, "tenant-x", list(range(7001, 7001 + 3 * bs)))
    clock = a.announcer._clock
    a.announcer._clock = lambda: (clock()[0] - 120, True)  # type: ignore[method-assign]  # written 2 min ago
    assert a.announcer.flush() == 3
    (bt,) = a.announcer.ann.list()
    saved = bytes(a_pool.store.get(bt.name))
    a_pool.store.delete(bt.name)
    a_pool.store.put(bt.name, saved)  # the replay: a fresh mtime
    before = stats.snapshot()
    assert b.announcer.poll() == (0, 0)
    assert _delta(before).get("announce_expired_batches") == 1 and a.announcer.ann.list() == []


def test_a_revoked_tenants_live_batch_is_withdrawn(mk):
    """Review finding 5 (revocation): a live batch of a tenant revoked since was never withdrawn. Now each
    poll re-checks live batches' keys: BlockRemoved once the keyring no longer holds it."""
    from vllm.distributed.kv_events import BlockRemoved
    a_pool, b_pool = mk(), mk()
    a, b = _worker(a_pool), _worker(b_pool)
    bs = namespace().layout.page_size
    _save(a_pool, a, "tenant-y", list(range(3001, 3001 + 3 * bs)))
    _save(a_pool, a, "tenant-z", list(range(4001, 4001 + 2 * bs)), rid="z")
    assert a.announcer.flush() == 5
    assert b.announcer.poll() == (5, 0)
    b.take()
    a_pool.keyring.revoke("tenant-y")
    deadline = time.monotonic() + HANG_S
    got = (0, 0)
    while got == (0, 0) and time.monotonic() < deadline:  # b's keyring reloads within reload_every_s
        got = b.announcer.poll()
        time.sleep(0.1)
    assert got == (0, 3)
    assert sum(len(e.block_hashes) for e in b.take() if isinstance(e, BlockRemoved)) == 3
    assert len(b.announcer.live()) == 2


def test_version_1_batches_are_ignored(mk):
    p = mk()
    b = _worker(p)
    bs = namespace().layout.page_size
    b.announcer.ann.write("tenant-x", _batch(bs, [[1, None, 5, None, _tok64([0] * bs), None, None, None]], v=1))
    before = stats.snapshot()
    assert b.announcer.poll() == (0, 0) and _delta(before) == {"announce_ignored_domain": 1}


def test_gc_deletes_expired_announcements_and_junk_under_announce(mk, tmp_path):
    """Review finding 8: gc never deleted announcement objects. Now it deletes batches announce_ttl_s old on
    the store's clock and unparseable names under announce/, and keeps young batches and every block."""
    from kvbm_backend.pool.g4.gc import run_gc
    p = mk()
    a = _worker(p)
    bs = namespace().layout.page_size
    _save(p, a, "tenant-x", list(range(7001, 7001 + 3 * bs)))
    assert a.announcer.flush() == 3
    (old,) = a.announcer.ann.list()
    _save(p, a, "tenant-x", list(range(8001, 8001 + 2 * bs)), rid="r2")
    assert a.announcer.flush() == 2
    fp = p.namespace.fingerprint
    junk = f"{fp}/announce/junk/0000/extra"
    p.store.put(junk, b"x" * 1000)
    t = time.time() - 7200
    os.utime(tmp_path / "store" / old.name, (t, t))
    res = run_gc(p.store, keyring=p.keyring, max_age_s=3600 * 24)
    assert res["deleted_by"]["announce"] == 2 and res["deleted_by"]["age"] == 0, res
    left = {o.name for o in p.store.list(f"{fp}/announce/")}
    assert old.name not in left and junk not in left and len(left) == 1
    assert run_gc(p.store, keyring=p.keyring, max_age_s=3600 * 24, dry_run=True)["deleted_by"]["announce"] == 0
