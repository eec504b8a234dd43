"""A failed load is never offered again to its request, on the connector's load paths beyond the G3 one that
``test_connector_units::test_a_failed_load_is_never_offered_again_to_its_request_and_cools_down_for_others`` and
``tests/e2e/test_connector_liveness.py`` cover (vLLM's ``kv_load_failure_policy=recompute`` reschedules the request
and asks for its match again: the same hit would fail the same way, forever).

* G4 blocks the pool reports present at lookup (an existence check) but that fail at load: the object deleted in
  between (as ``gc`` does), its bytes damaged, the tenant's key revoked. The worker reports a ``miss``; the
  scheduler answers 0 for that request and ends other requests' hits before the failed block while it cools.
* TP: the block fails on one rank only (a read error on rank 1's slot, which G3 keeps; rank 0 loads it): the
  ranks' reports aggregated by vLLM's own ``KVOutputAggregator`` withdraw the request's hit, and the block ends
  other requests' hits for every rank, although every rank's index still holds it.

Real parts: the CPU engine's tensors, the worker role, real G3 files and a ``file://`` G4 store with its keyring,
the scheduler role, vLLM's aggregator. The load plan is the scheduler's own (``update_state_after_alloc``).
"""
from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from kvbm_backend.config import G4Config  # noqa: E402
from kvbm_backend.integrations.vllm.metadata import KvbmWorkerMeta  # noqa: E402
from kvbm_backend.integrations.vllm.scheduler_side import SchedulerSide  # noqa: E402
from kvbm_backend.integrations.vllm.worker_side import WorkerSide  # noqa: E402
from kvbm_backend.model.hashing import salt_bytes, salt_hash, sequence_hashes, token_digests  # noqa: E402
from kvbm_backend.model.namespace import Namespace  # noqa: E402
from kvbm_backend.pool.g4.pool import G4Pool  # noqa: E402
from kvbm_backend.pool.g3 import G3Pool  # noqa: E402
from tests.helpers.eio import slot_eio  # noqa: E402
from tests.helpers.pools import G4_TIMEOUT_S, LOOKUP_S, g3_config  # noqa: E402
from tests.integrations.vllm.test_worker_device_path import LOAD_S, _engine, _save  # noqa: E402

HANG_S = 600.0  # a hang guard, not a bound: waits for what must come (a lookup's answer, a load's end)
TENANT = "acme"
N = 4  # blocks of the prompt that may be loaded


def _prompt(bs: int) -> tuple[list[int], list[int]]:
    """``(tokens, sequence hashes)`` of a prompt of ``N`` full blocks plus one token, as the scheduler hashes it."""
    toks = list(range(1000, 1000 + N * bs + 1))
    return toks, list(sequence_hashes(toks, bs, salt=salt_hash(salt_bytes(TENANT, None, None))))


def _digests(bs: int, blocks: list[int]) -> bytes:
    """The token digests of blocks ``blocks`` of :func:`_prompt`'s prompt, as the scheduler sends them with a save."""
    d = token_digests(_prompt(bs)[0], bs, salt_bytes(TENANT, None, None))
    return b"".join(d[16 * i:16 * i + 16] for i in blocks)


def _req(rid: str, toks: list[int]) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, prompt_token_ids=toks, cache_salt=TENANT, lora_request=None)


def _ask(s: SchedulerSide, req) -> int:
    """The scheduler's answer (tokens offered beyond none computed) once its lookup is done."""
    end = time.monotonic() + HANG_S
    while True:
        n, _ = s.get_num_new_matched_tokens(req, 0)
        if n is not None:
            return n
        assert time.monotonic() < end, "lookup never finished"
        time.sleep(0.01)


def _plan(s: SchedulerSide, req, n_tokens: int, block_ids: list[int]) -> list:
    """The scheduler's load jobs for ``req`` after vLLM allocated ``block_ids`` for its ``n_tokens`` hit."""
    s.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (block_ids,)), n_tokens)
    idle = SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={},  # a step scheduling no request's tokens
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[]))
    return s.build_connector_meta(idle).loads  # save=False: only the planned loads


def _finish(w: WorkerSide, rid: str) -> tuple[set[int], KvbmWorkerMeta | None]:
    end = time.monotonic() + HANG_S
    while rid not in w.get_finished():
        assert time.monotonic() < end, f"load {rid} never finished"
        time.sleep(0.01)
    return w.load_errors(), w.worker_meta()


def _flip_payload_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(-100, os.SEEK_END)  # inside the (sealed) payload, past the header
        b = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x5A]))


@pytest.mark.parametrize("fault", ["deleted", "corrupt", "revoked"])
def test_a_g4_block_found_at_lookup_that_fails_at_load_is_not_offered_again(tmp_path, fault):
    """The scheduler's G4 lookup finds all ``N`` blocks; then block 1 is deleted (gc), damaged, or the tenant's
    key is revoked (every block unreadable); the load fails at that block, reported a miss. The same request is
    then answered 0 (recomputed, never reloaded); a new request with the same prompt is offered only the blocks
    before the failed one (G4 itself now misses it in all three cases: the reader deletes an object it proved
    damaged, and a revoked tenant's names are no longer looked up; the cool-down cuts it as well)."""
    kv = _engine("cpu", seed=31)
    bs = kv.layout.page_size
    ns = Namespace(model="test/failed-load-paths", revision="r1", layout=kv.layout, tp_world_size=1)
    g4 = G4Pool(G4Config(enabled=True, url=f"file://{tmp_path / 'g4'}", keyring={"path": str(tmp_path / "kr.json")},
                         timeout_s=G4_TIMEOUT_S), ns)  # the load bound is no subject: the faults are
    w = WorkerSide(ns, 0, None, g4, load_timeout_s=LOAD_S)
    try:
        w.register(kv)
        toks, hs = _prompt(bs)
        _save(w, g4, list(range(1, N + 1)), hs[:N], tenant=TENANT, digests=_digests(bs, list(range(N))))
        s = SchedulerSide(ns, bs, None, g4, save=False, lookup_timeout_s=LOOKUP_S)
        r1 = _req("r1", toks)
        assert _ask(s, r1) == N * bs  # every block found (an existence check)
        jobs = _plan(s, r1, N * bs, list(range(10, 10 + N)))
        assert [j.tiers for j in jobs] == [["G4"] * N]
        key = w.offloads.g4_keys(ns.keys([hs[1]], TENANT, 0))[0]
        path = str(g4.store._path(g4.object_name(key)))
        if fault == "deleted":
            os.remove(path)
        elif fault == "corrupt":
            _flip_payload_byte(path)
        else:
            assert g4.keyring is not None
            g4.keyring.revoke(TENANT)
        first = 0 if fault == "revoked" else 1
        w.start_loads(jobs)
        errs, meta = _finish(w, "r1")
        assert errs == set(range(10 + first, 10 + N))  # vLLM recomputes from the failed block
        assert meta is not None and [(f.first_failed, f.reason) for f in meta.failed] == [(hs[first], "miss")]
        s.update_connector_output(meta)
        assert s.get_num_new_matched_tokens(r1, 0) == (0, False)  # vLLM asks again: never the same load
        assert _ask(s, _req("r2", toks)) == first * bs  # others: the hit ends before the cooling block
    finally:
        w.shutdown()
        g4.close()


def test_a_block_that_fails_on_one_tp_rank_is_withdrawn_for_every_rank(tmp_path, monkeypatch):
    """TP 2: both ranks stored the prompt; rank 1's slot of block 1 has a read error (kept by G3), rank 0's reads
    fine. vLLM's KVOutputAggregator merges the ranks' outputs (invalid block ids: their union; worker meta: both
    reports); the scheduler answers the request 0 from then on and offers a new request only block 0 (the cool-down
    of the block's sequence hash is rank-independent). Both copies stay in G3: rank 1's read error is no proof of
    bad bytes (docs/invariants.md #1; before 2026-12-01 it was deleted), and rank 0's read fine."""
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput
    from copy import copy

    kvs = [_engine("cpu", seed=41), _engine("cpu", seed=42)]
    bs = kvs[0].layout.page_size
    ns = Namespace(model="test/failed-load-paths", revision="r1", layout=kvs[0].layout, tp_world_size=2)
    # the posix engine reads through os.preadv / os.pread, where the bad sector is injected
    g3 = G3Pool(g3_config(tmp_path / "g3", files_per_path=1, load_timeout_s=LOAD_S, engine="posix"), ns)
    ws = [WorkerSide(ns, r, g3, None, load_timeout_s=LOAD_S) for r in (0, 1)]
    try:
        toks, hs = _prompt(bs)
        for w, kv in zip(ws, kvs):
            w.register(kv)
        for i in range(N):  # one block at a time, rank by rank: no two slots of a rank are adjacent, so the bad
            for w in ws:    # sector fails only rank 1's block 1 (the reader merges reads of adjacent slots)
                _save(w, g3, [i + 1], [hs[i]], tenant=TENANT, digests=_digests(bs, [i]))
        s = SchedulerSide(ns, bs, g3, None, save=False, lookup_timeout_s=LOOKUP_S)
        r1 = _req("r1", toks)
        assert _ask(s, r1) == N * bs  # both ranks hold every block
        jobs = _plan(s, r1, N * bs, list(range(10, 10 + N)))
        bad = ns.key(hs[1], TENANT, 1)
        slot_eio(monkeypatch, g3, bad)
        outs = []
        for w in ws:
            w.start_loads(jobs)
            errs, meta = _finish(w, "r1")
            o = copy(EMPTY_MODEL_RUNNER_OUTPUT)
            o.kv_connector_output = KVConnectorOutput(finished_recving={"r1"}, invalid_block_ids=errs,
                                                      kv_connector_worker_meta=meta)
            outs.append(o)
        agg = KVOutputAggregator(expected_finished_count=2).aggregate(outs, output_rank=0).kv_connector_output
        assert agg.finished_recving == {"r1"} and agg.invalid_block_ids == set(range(11, 10 + N))
        assert [(f.first_failed, f.reason) for f in agg.kv_connector_worker_meta.failed] == [(hs[1], "miss")]
        s.update_connector_output(agg.kv_connector_worker_meta)
        # rank 1's unreadable copy is kept (an I/O error proves nothing; it cools), rank 0's too
        assert g3.contains(bad) and g3.contains(ns.key(hs[1], TENANT, 0))
        assert s.get_num_new_matched_tokens(r1, 0) == (0, False)
        assert _ask(s, _req("r2", toks)) == 1 * bs
    finally:
        for w in ws:
            w.shutdown()
        g3.close()



def _worker_with_two_blocks(tmp_path, seed: int):
    """A CPU engine's ``WorkerSide`` over a real G3 pool holding blocks 1 and 2 of a prompt (saved from the
    engine): ``(engine kv, namespace, g3, worker, the prompt's sequence hashes)``. Shut down on failure here."""
    kv = _engine("cpu", seed=seed)
    ns = Namespace(model="test/failed-load-paths", revision="r1", layout=kv.layout, tp_world_size=1)
    g3 = G3Pool(g3_config(tmp_path / "g3", files_per_path=1, load_timeout_s=LOAD_S, engine="posix"), ns)
    w = WorkerSide(ns, 0, g3, None, load_timeout_s=LOAD_S, report_g3=True)
    try:
        w.register(kv)
        _, hs = _prompt(kv.layout.page_size)
        _save(w, g3, [1, 2], hs[:2], tenant=TENANT, digests=_digests(kv.layout.page_size, [0, 1]))
    except BaseException:
        w.shutdown()
        g3.close()
        raise
    return kv, ns, g3, w, hs

def test_a_g3_block_that_stays_unreadable_is_deleted_so_its_recompute_is_stored_again(tmp_path, monkeypatch):
    """A read error G3 cannot prove bad (EIO on the slot) keeps the slot. Before 2026-11-30 the scheduler cooled the
    block for 30 s and then offered it again, every new request's load failed on it again, and the recomputed
    block's store was skipped (held), so it was never written again, for good; from 2026-11-30 the worker deleted it
    at its first failed load, also when the error was a hiccup of milliseconds (review 2026-12-01, finding 3: an
    I/O error is no proof of bad bytes, docs/invariants.md #1). Now each failed load is a miss the scheduler cools
    (reason ``miss``) while the block stays in G3 and in the mirror; once its re-reads have failed in
    ``UNREADABLE_STRIKES`` loads over ``UNREADABLE_SPAN_S`` (the pool's clock, set here: the loads 150 s apart),
    the worker's delete goes through, the block is reported removed, and the recompute's store writes it again: it
    then loads the exact bytes."""
    from kvbm_backend.integrations.vllm import stats
    from kvbm_backend.integrations.vllm.metadata import LoadJob, mirror_id
    from kvbm_backend.pool.g3.read.unreadable import UNREADABLE_SPAN_S, UNREADABLE_STRIKES
    from tests.integrations.vllm.test_worker_device_path import _block_bytes

    assert (UNREADABLE_STRIKES, UNREADABLE_SPAN_S) == (3, 300.0)  # the schedule below
    kv, ns, g3, w, hs = _worker_with_two_blocks(tmp_path, 51)
    try:
        w.worker_meta()  # the first report (snapshot) is out
        bad = ns.key(hs[1], TENANT, 0)
        now = [1000.0]
        g3.reader.unreadable.clock = lambda: now[0]
        stats.reset()
        with monkeypatch.context() as mp:
            slot_eio(mp, g3, bad)
            for t in (0.0, 150.0, 300.0):
                now[0] = 1000.0 + t
                rid = f"r{int(t)}"
                w.start_loads([LoadJob(rid, [11], [hs[1]], ["G3"], TENANT)])
                errs, meta = _finish(w, rid)
                assert errs == {11}
                assert meta is not None and [(f.first_failed, f.reason) for f in meta.failed] == [(hs[1], "miss")]
                if t < 300.0:  # kept: still in G3 and in the scheduler's mirror (the failed load cools it there)
                    assert g3.contains(bad) and mirror_id(bad) not in meta.removed, t
                    assert not stats.get("load_g3_dropped_blocks")
        assert not g3.contains(bad) and g3.contains(ns.key(hs[0], TENANT, 0))  # only the unreadable block
        assert mirror_id(bad) in meta.removed  # the scheduler's mirror no longer offers it
        assert stats.get("load_g3_dropped_blocks") == 1
        _save(w, g3, [2], [hs[1]], tenant=TENANT)  # vLLM recomputed it; the step's save
        assert g3.contains(bad)
        w.start_loads([LoadJob("r2", [12], [hs[1]], ["G3"], TENANT)])
        errs, _ = _finish(w, "r2")
        assert errs == set() and torch.equal(_block_bytes(kv, 12), _block_bytes(kv, 2))
    finally:
        w.shutdown()
        g3.close()


def test_a_g3_block_a_burst_of_read_errors_missed_is_kept_and_loads_after_it(tmp_path, monkeypatch):
    """Review 2026-12-01, finding 3: every read of the slot fails for a moment (a device reset, an NFS server
    restarting), covering the load's read and G3's re-read before a delete. The load fails (vLLM recomputes; the
    scheduler cools the block: reason ``miss``), but the block is kept and stays in the scheduler's mirror, and once
    the reads work again the next load gets its exact bytes. Before the fix it was deleted (and reported removed)."""
    from kvbm_backend.integrations.vllm import stats
    from kvbm_backend.integrations.vllm.metadata import LoadJob, mirror_id
    from tests.integrations.vllm.test_worker_device_path import _block_bytes

    kv, ns, g3, w, hs = _worker_with_two_blocks(tmp_path, 57)
    try:
        w.worker_meta()
        key = ns.key(hs[1], TENANT, 0)
        stats.reset()
        with monkeypatch.context() as mp:
            eio = slot_eio(mp, g3, key)
            w.start_loads([LoadJob("r1", [11], [hs[1]], ["G3"], TENANT)])
            errs, meta = _finish(w, "r1")
            assert eio.failed >= 2, eio  # the load's read and the re-read before the delete
        assert errs == {11}
        assert meta is not None and [(f.first_failed, f.reason) for f in meta.failed] == [(hs[1], "miss")]
        assert g3.contains(key), "a good block was deleted after a burst of read errors"
        assert mirror_id(key) not in meta.removed and not stats.get("load_g3_dropped_blocks")
        assert g3.stats()["unreadable_kept"] == 1
        w.start_loads([LoadJob("r2", [12], [hs[1]], ["G3"], TENANT)])
        errs, _ = _finish(w, "r2")
        assert errs == set() and torch.equal(_block_bytes(kv, 12), _block_bytes(kv, 2))
    finally:
        w.shutdown()
        g3.close()


def test_a_g3_block_whose_read_failed_once_but_re_reads_good_is_kept(tmp_path, monkeypatch):
    """Hostile review 2026-11-30: one transient read error (a single EIO, a flaky controller, an io_uring
    submission refused under memory pressure) on a load made the worker delete the G3 block, although the
    slot re-reads and verifies: good blocks lost to one bad read (and a recompute and a rewrite for each). Now
    the worker asks G3 to drop a block only after a fresh re-read of the slot fails to verify
    (``G3Pool.drop_unreadable``): the slot re-reads good here, so it is kept, the load fails once (the
    request recomputes), and the next load of the block gets its exact bytes. Deleted before the fix."""
    from kvbm_backend.integrations.vllm import stats
    from kvbm_backend.integrations.vllm.metadata import LoadJob
    from tests.integrations.vllm.test_worker_device_path import _block_bytes

    kv, ns, g3, w, hs = _worker_with_two_blocks(tmp_path, 53)
    try:
        w.worker_meta()
        key = ns.key(hs[1], TENANT, 0)
        stats.reset()
        with monkeypatch.context() as mp:
            slot_eio(mp, g3, key, times=1)  # the load's read fails; every later read of the slot is fine
            w.start_loads([LoadJob("r1", [11], [hs[1]], ["G3"], TENANT)])
            errs, _ = _finish(w, "r1")
        assert errs == {11}  # that load failed (vLLM recomputes), never wrong KV
        assert g3.contains(key), "a good block was deleted after one failed read"
        assert not stats.get("load_g3_dropped_blocks")
        w.start_loads([LoadJob("r2", [12], [hs[1]], ["G3"], TENANT)])
        errs, _ = _finish(w, "r2")
        assert errs == set() and torch.equal(_block_bytes(kv, 12), _block_bytes(kv, 2))
    finally:
        w.shutdown()
        g3.close()


def test_an_unreadable_g3_block_is_deleted_even_while_another_thread_holds_the_pools_lock(tmp_path, monkeypatch):
    """The third failed load of an unreadable block (the strike that deletes it, as in the test above) ends while
    another thread holds the G3 pool's lock (a journal append on a slow drive, an eviction; here a thread holding it
    0.5 s). Before 2026-12-02 the worker first filtered the keys with ``G3Pool.contains``, which answers False
    rather than wait more than ~20 ms for a busy lock: the block was taken for absent and not deleted, and stayed
    offered (cooled, re-failed) until a later load happened to find the lock free. Now every missed G3 key goes to
    ``G3Pool.drop_unreadable``, which waits for the lock: deleted, reported removed."""
    import threading

    from kvbm_backend.integrations.vllm import stats
    from kvbm_backend.integrations.vllm.metadata import LoadJob, mirror_id

    kv, ns, g3, w, hs = _worker_with_two_blocks(tmp_path, 52)
    try:
        w.worker_meta()
        bad = ns.key(hs[1], TENANT, 0)
        now = [1000.0]
        g3.reader.unreadable.clock = lambda: now[0]
        stats.reset()
        real_drop = w.drop_unreadable
        held = threading.Event()

        def drop_while_locked(missed: list) -> None:
            def hold() -> None:
                with g3.cat.lock:
                    held.set()
                    time.sleep(0.5)
            t = threading.Thread(target=hold, name="test-lock-holder")
            t.start()
            assert held.wait(HANG_S)
            real_drop(missed)
            t.join()
        with monkeypatch.context() as mp:
            slot_eio(mp, g3, bad)
            for t in (0.0, 150.0, 300.0):
                now[0] = 1000.0 + t
                if t == 300.0:
                    mp.setattr(w, "drop_unreadable", drop_while_locked)
                w.start_loads([LoadJob(f"r{int(t)}", [11], [hs[1]], ["G3"], TENANT)])
                errs, meta = _finish(w, f"r{int(t)}")
                assert errs == {11}
        assert held.is_set()
        assert not g3.contains(bad) and stats.get("load_g3_dropped_blocks") == 1, "kept: the busy lock hid it"
        assert meta is not None and mirror_id(bad) in meta.removed
    finally:
        w.shutdown()
        g3.close()
