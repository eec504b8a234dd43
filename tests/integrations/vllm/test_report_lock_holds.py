"""A big G3 report (a worker's snapshot of its whole index) is applied with the scheduler-side locks released
between chunks, so the scheduler's step (KV events ``take``, G3 lookups) is not held for the whole report.

Review finding (2026-12-01): ``G3KvEvents.apply`` held its lock across a 1M-block snapshot (0.3 s; a re-snapshot
at 300k published blocks 1.2 s) and ``G3Mirror.apply`` its lock (0.4 s), every scheduler step waiting.
``benchmarks/report_lock_holds.py`` gives the longest hold beside each operation's whole time."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from kvbm_backend.integrations.vllm.metadata import KvbmWorkerMeta
from kvbm_backend.pool.g3.index import tag_of


class _SeenAtRelease:
    """A lock that records ``probe()`` each time it is released (what another thread could see then)."""

    def __init__(self, probe):
        self._l, self.probe, self.seen = threading.Lock(), probe, []

    def __enter__(self):
        self._l.acquire()

    def __exit__(self, *exc):
        self.seen.append(self.probe())
        self._l.release()


def _snapshot(rank: int, n: int) -> KvbmWorkerMeta:
    t = tag_of("")
    return KvbmWorkerMeta(added=[(t, rank, (i * 0x9E3779B97F4A7C15 + 7) & (2**64 - 1)) for i in range(n)],
                          snapshot=True)


def test_the_mirror_applies_a_snapshot_in_chunks_between_which_lookups_get_the_lock():
    from kvbm_backend.integrations.vllm.g3_mirror import APPLY_CHUNK, G3Mirror
    m = G3Mirror(SimpleNamespace(fingerprint="f" * 16, layout=SimpleNamespace(page_size=16), tp_world_size=1))
    n = 3 * APPLY_CHUNK + 5
    lock = m._lock = _SeenAtRelease(lambda: len(m._set))
    m.apply(_snapshot(0, n), rank=0)
    assert len(m) == n and m.ready
    partial = [s for s in lock.seen if 0 < s < n]
    assert len(partial) >= 3, lock.seen  # released with 1, 2 and 3 chunks applied (before 2026-12-02: never)


def test_kv_events_apply_a_snapshot_in_chunks_between_which_take_gets_the_lock():
    pytest.importorskip("vllm")
    from kvbm_backend.integrations.vllm.kv_events import APPLY_CHUNK, G3KvEvents
    ev = G3KvEvents(1, 4)
    n = 3 * APPLY_CHUNK + 5
    lock = ev._lock = _SeenAtRelease(lambda: len(ev._ranks))
    ev.apply(_snapshot(0, n))
    assert len(ev._ranks) == n
    partial = [s for s in lock.seen if 0 < s < n]
    assert len(partial) >= 3, lock.seen


class _ThenOnce:
    """A lock that, after its first release, runs ``hook`` once (another thread's work between two holds)."""

    def __init__(self, hook):
        self._l, self.hook = threading.Lock(), hook

    def __enter__(self):
        self._l.acquire()

    def __exit__(self, *exc):
        self._l.release()
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()


def test_a_block_removed_while_republish_runs_ends_removed_for_the_router():
    """``republish`` (after vLLM's AllBlocksCleared) queues its BlockStored events a chunk at a time; a G3 removal
    applied between two chunks must not be followed by a BlockStored of the same block (the router would credit
    a block G3 no longer holds until its next change)."""
    pytest.importorskip("vllm")
    from vllm.distributed.kv_events import BlockRemoved

    from kvbm_backend.integrations.vllm.kv_events import EMIT_CHUNK, G3KvEvents
    n = 2 * EMIT_CHUNK + 3
    ev = G3KvEvents(1, 4)
    t = tag_of("")
    seqs = [(i * 0x9E3779B97F4A7C15 + 7) & (2**64 - 1) for i in range(n)]
    req = SimpleNamespace(block_hashes=[i.to_bytes(8, "little") for i in range(n)], all_token_ids=list(range(n * 4)),
                          lora_request=None, cache_salt=None, mm_features=[], prompt_embeds=None,
                          num_prompt_tokens=n * 4)
    ev.learn("", req, seqs, 0, n)
    ev.apply(_snapshot(0, n))
    assert ev.published() == n
    ev.take()
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    last = maybe_convert_block_hash(req.block_hashes[-1])  # as the events carry it
    ev._lock = _ThenOnce(lambda: ev.apply(KvbmWorkerMeta(removed=[(t, 0, seqs[-1])])))
    ev.republish()
    final = None
    for e in ev.take():
        if last in e.block_hashes:
            final = type(e)
    assert final is BlockRemoved, final
    assert ev.published() == n - 1


def test_an_announced_g4_block_withdrawn_while_republish_runs_ends_removed_for_the_router():
    """The same for a G4 block another worker announced: its batch withdrawn by the announcer's poll (expired, its
    tenant revoked) after ``republish`` read the live announcements ends BlockRemoved (review 2026-12-02: it was
    stored again, and no removal could ever follow: nobody held it any more)."""
    pytest.importorskip("vllm")
    from array import array

    from kvbm_backend.integrations.vllm.g4_announce import G4Announcer
    from kvbm_backend.integrations.vllm.kv_events import G3KvEvents
    from kvbm_backend.pool.g4.announce import Batch
    bs = 4
    ev = G3KvEvents(1, bs, g3=False)
    ann = G4Announcer.__new__(G4Announcer)  # the poller-side state _credit / _withdraw / live use
    ann._lock, ann._live, ann._batches, ann.events = threading.Lock(), {}, {}, ev
    ev.announcer = ann
    infos = [(bytes([i + 1]) * 8, bytes([i]) * 8 if i else None, array("I", range(i * bs, (i + 1) * bs)),
              None, None, None) for i in range(3)]
    # batch A announces blocks 0 and 1, batch B block 2 (what the poll does: _credit, then emit_announced)
    st = ann._credit(Batch("A", "00" * 16, 1, 0.0), 0.0, None, [(i, None, infos[i]) for i in range(2)], 3600.0)
    st += ann._credit(Batch("B", "00" * 16, 2, 0.0), 0.0, None, [(2, None, infos[2])], 3600.0)
    ev.emit_announced(st, [])
    ev.take()
    gone = infos[2][0]
    ev._lock = _ThenOnce(lambda: ev.emit_announced([], ann._withdraw(["B"])))  # the poll, right after live()
    ev.republish()
    events = ev.take()
    kinds = [type(e).__name__ for e in events if gone in e.block_hashes]
    assert gone not in [e[0] for e in ann.live()] and not ev._holders.get(gone, 0)
    assert kinds and kinds[-1] == "BlockRemoved", kinds
    stored = {h for e in events if type(e).__name__ == "BlockStored" for h in e.block_hashes}
    assert {infos[0][0], infos[1][0]} <= stored  # batch A's blocks, still announced, are published again
