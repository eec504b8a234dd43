"""Never stall decode (docs/invariants.md #3) against slow journal I/O: the connector's scheduler role in the
``uni`` deployment asks the real :class:`G3Pool` (its index, under the pool's lock) on vLLM's scheduler thread,
while other threads hold that lock across journal I/O. Reviewer repro (2026-12-01): a journal repair after a
failed append, rewritten under the lock with a 2 s fsync, blocked ``get_num_new_matched_tokens`` 3.9 s.

Real G3 files; the slow I/O is injected at the OS boundary (``os.fsync`` / ``os.write`` on the journal's files
only) and held on :class:`threading.Event` handshakes: the assertions are about what returns while the other
thread is still inside the held I/O, never about durations (``GUARD_S`` is a hang guard only)."""
from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np

from kvbm_backend.integrations.vllm.scheduler_side import SchedulerSide
from kvbm_backend.model.hashing import sequence_hashes
from kvbm_backend.model.layout import KvLayout
from kvbm_backend.model.namespace import Namespace
from kvbm_backend.pool.g3 import G3Pool
from tests.helpers.held_io import HeldIO, in_background
from tests.helpers.pools import LOOKUP_S, g3_config

GUARD_S = 60.0  # hang guard: what must happen at once (the fix) gets this long; the old code waited forever
BS = 16


def _pool(tmp_path):
    lay = KvLayout(num_layers=2, outer_dim=2, page_size=BS, inner_dim=64, dtype="float16")
    ns = Namespace(model="t/stall", revision="r", layout=lay, tp_world_size=1)
    g3 = G3Pool(g3_config(tmp_path / "g3"), ns)
    toks = list(range(1000, 1000 + 4 * BS + 1))
    keys = [ns.key(h, "", 0) for h in sequence_hashes(toks, BS)]
    extra = [ns.key(12345 + i, "", 0) for i in range(2)]
    res = g3.put(keys + extra, [np.full(lay.bytes_per_block, 7, np.uint8) for _ in keys + extra]).result(GUARD_S)
    assert res.written == len(keys) + 2
    assert g3.flush(GUARD_S)
    return g3, ns, toks, keys, extra


def _request(toks, rid="r1"):
    return SimpleNamespace(request_id=rid, prompt_token_ids=toks, all_token_ids=toks, cache_salt=None,
                           lora_request=None, kv_transfer_params=None)


def test_scheduler_lookup_returns_while_a_journal_append_holds_the_pool_lock(tmp_path, monkeypatch):
    """A journal append's ``os.write`` (under the pool's lock) is held; the scheduler's lookup returns at once
    with "not yet" (None), counted ``lookups_deferred``, and finds the prefix once the lock is free."""
    g3, ns, toks, keys, extra = _pool(tmp_path)
    try:
        s = SchedulerSide(ns, BS, g3, None, lookup_timeout_s=LOOKUP_S)  # its answer waits for the held write
        s.mirror_wait_s = 0
        hold = HeldIO(monkeypatch, "write", lambda fd: fd == g3.cat.journal.fd, GUARD_S)
        deleter, deleted, _ = in_background(lambda: g3.delete([extra[0]]).result(GUARD_S))
        assert hold.inside.wait(GUARD_S)
        assert g3.cat.lock.locked()  # the append holds the pool's lock across its os.write
        sched, answered, ans = in_background(lambda: s.get_num_new_matched_tokens(_request(toks), 0))
        returned = answered.wait(GUARD_S)
        still_held = not deleted.is_set()
        hold.release()
        assert returned, "the scheduler thread waited for the pool's lock (decode stalled)"
        assert still_held  # it returned while the append was still inside its write
        assert ans["value"] == (None, False)  # not yet: vLLM asks again next step
        assert g3.stats()["lookups_deferred"] >= 1
        assert deleted.wait(GUARD_S) and deleted.is_set()
        g3._lookups.join(GUARD_S)  # the deferred lookup got the lock
        assert s.get_num_new_matched_tokens(_request(toks), 0) == (4 * BS, True)
        sched.join(GUARD_S)
        deleter.join(GUARD_S)
    finally:
        g3.close()


def _journal_file(fd, directory):
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return False
    return os.path.dirname(target) == directory and os.path.basename(target).startswith(".journal-")


def test_journal_repair_is_written_off_the_pool_lock(tmp_path, monkeypatch):
    """After a failed append the next append repairs the journal (a rewrite from the index, with fsync): held
    inside that fsync, the pool's lock is free (lookups, gets and puts go on), the append itself has returned,
    and the repaired journal (with the DEL that the failed append lost) is installed once the fsync returns."""
    g3, ns, toks, keys, extra = _pool(tmp_path)
    real_append = g3.cat.journal.append
    try:
        failing = {"on": True}

        def append(recs):
            if failing["on"]:
                raise OSError(5, "Input/output error (injected)")
            return real_append(recs)
        g3.cat.journal.append = append
        assert g3.delete([extra[0]]).result(GUARD_S) == 1  # its DEL lost: the journal is marked for repair
        failing["on"] = False
        assert g3.cat.journal_dirty
        directory = os.path.realpath(g3.cat.journal.directory)
        hold = HeldIO(monkeypatch, "fsync", lambda fd: _journal_file(fd, directory), GUARD_S)
        deleter, deleted, _ = in_background(lambda: g3.delete([extra[1]]).result(GUARD_S))
        assert hold.inside.wait(GUARD_S) or deleted.wait(GUARD_S)
        got = g3.cat.lock.acquire(timeout=GUARD_S)  # hang guard: free at once once the delete returned
        if got:
            g3.cat.lock.release()
        returned = deleted.wait(GUARD_S)
        inside_fsync = hold.inside.is_set() and not hold.released.is_set()
        hold.release()
        assert got and returned, "the journal repair held the pool's lock across its fsync"
        assert inside_fsync  # all that while the repair was still inside its fsync
        assert g3.lookup_prefix(keys).result(GUARD_S) == len(keys)
        assert g3.cat.wait_compaction(GUARD_S)
        with g3.cat.lock:
            assert not g3.cat.journal_dirty  # repaired
        deleter.join(GUARD_S)
    finally:
        g3.cat.journal.append = real_append
        g3.close()
    g3 = G3Pool(g3_config(tmp_path / "g3"), ns)
    try:
        assert g3.stats()["restored_blocks"] == len(keys)  # both deletes stand (the lost DEL was repaired)
        assert g3.lookup_prefix(keys).result(GUARD_S) == len(keys)
        assert not g3.contains(extra[0]) and not g3.contains(extra[1])
    finally:
        g3.close()
