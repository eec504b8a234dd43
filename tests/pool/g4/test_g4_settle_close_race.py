"""The G4 late settle's republish (a27f8d1) reads the caller's buffer only while the put's future is open, and only
within the settle bound (review of a27f8d1, 2026-12-03).

A create-exclusive PUT met worker B's copy and its answer was lost (PutUnsettled); the settle later finds B's bytes,
a deleter removes them before the writer's header GET, and ``G4Writer._settle_found`` seals the block again from the
caller's buffer and publishes it.

1. Before, ``G4Writer.close`` (``G4Pool.close`` on another thread) made the settler end every pending block
   ``dropped_unsettled`` at once, also one whose buffer that re-seal was reading: the put's future resolved, the
   caller reused its buffer (the vLLM tier hands its staging back then), and the writer sealed the reused bytes with
   a valid tag and published them under the block's name: a later reader served wrong KV. Now the settler holds the
   block while the writer reads it (``LateSettler._hold``): close waits for that read, bounded by the block's settle
   bound, and the writer publishes nothing once closed.
2. Before, a settle check at the bound (``bound_s`` after the PUT became unsettled) that found the object gone
   republished the block, its PUTs running past the bound. Now no republish starts past the bound: the block ends
   ``dropped_unsettled``, unread.

Real file store and G4Pool; the hooks only order the race (B's publish before this pool's PUT, the delete right after
the settle's look, the close landing during the re-seal, the settle's HEAD answering only once the bound passed).
Tests 1, 3 and 4 are not about the bound: their pools settle within 80 s
(:data:`~tests.helpers.g4_put_race.WIDE_SETTLE_BOUNDS`), so a settle check the busy CI VM froze cannot reach it (with
the product's 8 s, a check 5.5 s late ended the block unread)."""
from __future__ import annotations

from contextlib import contextmanager

import hashlib
import threading
import time

import numpy as np

from kvbm_backend.config import G4Config
from kvbm_backend.pool.g4.fs_store import FsStore
from kvbm_backend.pool.g4.pool import G4Pool
from kvbm_backend.pool.g4.store import PutUnsettled
from tests.helpers.g4_put_race import waits_in_settler_close, wide_settle_bound
from tests.helpers.g4_writer import namespace, payload

HANG_S = 600.0  # hang guards only
NS = namespace()
BPB = NS.layout.bytes_per_block
B_COPY = b"worker B's copy" * 64


class _RaceFs(FsStore):
    """A file store settling as S3 does (the MD5 of what the name holds). On ``target``: ``unsettled``, worker B
    publishes first, this pool's PUT meets it and its answer is lost (PutUnsettled); ``delete_at_settle``, a settle
    that found other bytes has them deleted right after it (gc, a load dropping a bad copy); ``until_bound``: the
    pool whose pending block's bound a settle's HEAD waits for (a slow HEAD: it answers only once that bound passed).
    Before (2026-12) it answered "cannot tell" until the bound, and a check that got that answer and was frozen past
    the bound ended the block there, before any settle found B's copy."""

    target: str | None = None
    unsettled = delete_at_settle = 0
    until_bound: G4Pool | None = None

    def put_if_absent(self, name, data):
        if name != self.target or not self.unsettled:
            return super().put_if_absent(name, data)
        self.unsettled -= 1
        assert super().put_if_absent(name, B_COPY)
        assert not super().put_if_absent(name, data)
        raise PutUnsettled("no answer (test)", name, hashlib.md5(bytes(data)).hexdigest())

    def settle(self, name, md5_hex):
        if name == self.target and self.until_bound is not None:
            pending = list(self.until_bound.writer._settler._pending)
            while pending and time.monotonic() < pending[0].give_up_at:  # waits for the bound (1 s), not a margin
                time.sleep(0.005)
        body = self.get(name)
        landed = None if body is None else hashlib.md5(bytes(body)).hexdigest() == md5_hex
        if landed is False and name == self.target and self.delete_at_settle:
            self.delete_at_settle -= 1
            self.delete(name)
        return landed


def _config(tmp_path, timeout_s: float) -> G4Config:
    return G4Config(url=f"file://{tmp_path / 'g4'}", fsync=False, timeout_s=timeout_s, retries=0,
                    keyring={"path": str(tmp_path / "keys" / "kr.json")})


def _served(cfg: G4Config, key) -> tuple[bool, np.ndarray]:
    with G4Pool(cfg, NS, store=_RaceFs(cfg.url.removeprefix("file://"), fsync=False)) as q:
        out = [np.full(BPB, 0xEE, np.uint8)]
        return q.get([key], out).result(timeout=HANG_S).ok[0], out[0]


def test_a_close_during_the_resettle_never_publishes_the_reused_buffer(tmp_path, monkeypatch):
    wide_settle_bound(monkeypatch)
    cfg = _config(tmp_path, 2.0)
    store = _RaceFs(tmp_path / "g4", fsync=False)
    key = NS.key(11, tenant="t")
    good = payload(11, "t", BPB)
    block = good.copy()  # the caller's (e.g. the tier's staging buffer)
    reused = threading.Event()
    with G4Pool(cfg, NS, store=store) as p:
        store.target, store.unsettled, store.delete_at_settle = p.object_name(key), 1, 1
        real_seal, seals, closer = p.writer._seal, [], threading.Thread(target=p.writer.close)

        def seal(k, blk, buf):
            seals.append(k)
            if len(seals) == 2:  # the settle's re-seal: the pool closes on another thread now
                closer.start()
                guard = time.monotonic() + HANG_S
                while not (reused.is_set() or waits_in_settler_close(closer)):
                    assert time.monotonic() < guard, "hang guard"
                    time.sleep(0.001)
            return real_seal(k, blk, buf)

        p.writer._seal = seal
        fut = p.put([key], [block])

        def reuse(_f):
            block.fill(0x5A)  # resolved: the caller reuses its buffer
            reused.set()
        fut.add_done_callback(reuse)
        res = fut.result(timeout=HANG_S)
        closer.join(HANG_S)
        assert not closer.is_alive(), "close hung"
        assert len(seals) == 2, seals
        assert (res.written, res.skipped, res.dropped) == (0, 0, 1), res  # the caller heard "dropped"
        assert p.stats().get("dropped_unsettled") == 1, p.stats()
    waiter = threading.Thread(target=p._io_put.shutdown, kwargs={"wait": True})  # the settle check's end
    waiter.start()
    waiter.join(HANG_S)
    ok, got = _served(cfg, key)
    assert not ok or np.array_equal(got, good), (
        f"a block reported dropped was published after its future resolved, sealed from the reused buffer: a hit "
        f"serving {got[:8].tolist()}... instead of {good[:8].tolist()}...")
    assert store.head(store.target) is None  # closed: nothing published after the future resolved


def test_a_settle_check_at_the_bound_never_republishes(tmp_path):
    cfg = _config(tmp_path, 0.25)  # settle bound: 4 x 0.25 s
    store = _RaceFs(tmp_path / "g4", fsync=False)
    key = NS.key(12, tenant="t")
    with G4Pool(cfg, NS, store=store) as p:
        store.target, store.unsettled, store.delete_at_settle, store.until_bound = p.object_name(key), 1, 1, p
        res = p.put([key], [payload(12, "t", BPB)]).result(timeout=HANG_S)
        assert store.delete_at_settle == 0  # the check answered past the bound found B's copy, deleted right after it
        assert (res.written, res.skipped, res.dropped) == (0, 0, 1), res
        c = p.stats()
        assert (c.get("dropped_unsettled"), c.get("written", 0)) == (1, 0), c
        assert store.head(store.target) is None  # no republish started past the bound


def test_a_close_during_the_republish_waits_for_it_and_the_block_counts_written(tmp_path, monkeypatch):
    """The close lands after the re-seal, while the settle publishes the block again (review of 1ddf0ce): before, the
    writer had checked ``closed`` once before that PUT and held nothing during it, so close ended the block
    ``dropped_unsettled`` at once, ``G4Pool.close`` returned, and the PUT landed afterwards: an object written after
    close, reported dropped, counted nowhere as written. Now the PUT runs inside the settler's hold: close waits for it
    (at most until the block's settle bound) and the block ends as the PUT ended it, ``written``, its bytes right."""
    wide_settle_bound(monkeypatch)
    cfg = _config(tmp_path, 2.0)
    store = _RaceFs(tmp_path / "g4", fsync=False)
    key = NS.key(13, tenant="t")
    good = payload(13, "t", BPB)
    p = G4Pool(cfg, NS, store=store)
    store.target, store.unsettled, store.delete_at_settle = p.object_name(key), 1, 1
    real_publish_found, calls, published = p.writer._publish_found, [], threading.Event()
    closed_after: list[bool] = []

    def close_pool():
        p.close(timeout=0)
        closed_after.append(published.is_set())
    closer = threading.Thread(target=close_pool)

    def publish_found(*a, **kw):
        calls.append(a[1])
        if len(calls) == 2:  # the settle's republish: the pool closes on another thread now
            closer.start()
            guard = time.monotonic() + HANG_S
            while not (closed_after or waits_in_settler_close(closer)):
                assert time.monotonic() < guard, "hang guard"
                time.sleep(0.001)
        out = real_publish_found(*a, **kw)
        if len(calls) == 2:
            published.set()
        return out

    p.writer._publish_found = publish_found
    res = p.put([key], [good.copy()]).result(timeout=HANG_S)
    closer.join(HANG_S)
    assert not closer.is_alive(), "close hung"
    assert len(calls) == 2, calls
    assert closed_after == [True], "G4Pool.close() returned before the settle's republish PUT ended"
    assert (res.written, res.skipped, res.dropped) == (1, 0, 0), res
    c = p.stats()
    assert c.get("written") == 1 and c.get("dropped_unsettled", 0) == 0, c
    ok, got = _served(cfg, key)
    assert ok and np.array_equal(got, good)


def test_a_close_waking_after_the_republish_hold_still_counts_the_block_written(tmp_path, monkeypatch):
    """The hold lasts until the settler records the outcome (review of 390a739): before, the hold ended as the writer
    left it, a close woken by that ended the block ``dropped_unsettled`` before the settler's ``_finish(u, "written")``
    ran, and a block the republish PUT had stored was reported dropped. The pause after the hold stands in for the
    offload thread being preempted there (an ordering aid; nothing is timed)."""
    wide_settle_bound(monkeypatch)
    cfg = _config(tmp_path, 2.0)
    store = _RaceFs(tmp_path / "g4", fsync=False)
    key = NS.key(14, tenant="t")
    good = payload(14, "t", BPB)
    p = G4Pool(cfg, NS, store=store)
    store.target, store.unsettled, store.delete_at_settle = p.object_name(key), 1, 1
    real_publish_found, calls = p.writer._publish_found, []
    closer = threading.Thread(target=lambda: p.close(timeout=0))

    def publish_found(*a, **kw):
        calls.append(a[1])
        if len(calls) == 2:  # the settle's republish (inside the hold): the pool closes on another thread now
            closer.start()
            guard = time.monotonic() + HANG_S
            while not waits_in_settler_close(closer):
                assert closer.is_alive() and time.monotonic() < guard, "close did not wait in LateSettler.close"
                time.sleep(0.001)
        return real_publish_found(*a, **kw)

    settler = p.writer._settler
    real_hold = settler._hold

    @contextmanager
    def hold_then_preempted(u):
        with real_hold(u) as live:
            yield live
        time.sleep(0.3)  # the offload thread is preempted after the hold ended, before the settler's _finish

    settler._hold = hold_then_preempted
    p.writer._publish_found = publish_found
    res = p.put([key], [good.copy()]).result(timeout=HANG_S)
    closer.join(HANG_S)
    assert not closer.is_alive(), "close hung"
    assert len(calls) == 2, calls
    ok, got = _served(cfg, key)
    assert ok and np.array_equal(got, good)  # the republish PUT stored the block (close waited for it)
    c = p.stats()
    assert (res.written, res.skipped, res.dropped) == (1, 0, 0), (
        f"the block is stored but the caller heard {res}; counters {c}")
    assert c.get("written") == 1 and c.get("dropped_unsettled", 0) == 0, c
