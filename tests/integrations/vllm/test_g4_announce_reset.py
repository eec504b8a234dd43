"""G4 announcements (kvbm_backend/integrations/vllm/g4_announce.py) after the connector's ``reset_cache`` with
``reset_tiers`` (kvbm_backend/integrations/vllm/reset_epoch.py).

Review finding (2026-12-03): a reset makes the engine see none of the G4 blocks stored before it (a new reset epoch
is folded into every later request's identity), but the announcer kept crediting the engine with every announced
block, those stored before the reset and other engines' of another epoch, and announced the blocks stored after it
to engines of other epochs: the router routed prompts to a worker that missed them. Now a batch names the epoch its
blocks were stored under and a poller credits only its engine's current epoch's; a reset withdraws the rest.

Real G4 pools on one file store and keyring (workers A and B), real scheduler sides (their identity), real KV events
and announcers driven directly (no background thread); the router is what Dynamo keeps of one worker's DISK blocks."""
from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.g4_writer import namespace
from tests.helpers.kv_router import DiskRouter

pytestmark = [pytest.mark.slow, pytest.mark.side]  # imports vLLM (~20 s on the dev VM); no wall-clock assertion

HANG_S = 600.0  # a hang guard, not a bound: pool results that must come; returns as soon as they do


def _request(rid, toks, bs):
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request
    init_none_hash(sha256_cbor)
    return Request(rid, toks, SamplingParams(max_tokens=1), None, block_hasher=get_request_block_hasher(bs, sha256_cbor))


class _Worker:
    """One engine's scheduler side as the connector wires it for ``g4.announce`` (no G3)."""

    def __init__(self, pool) -> None:
        from kvbm_backend.integrations.vllm.g4_announce import G4Announcer
        from kvbm_backend.integrations.vllm.kv_events import G3KvEvents
        from kvbm_backend.integrations.vllm.scheduler_side import SchedulerSide
        self.ns, self.pool = namespace(), pool
        self.bs = self.ns.layout.page_size
        self.side = SchedulerSide(self.ns, self.bs, None, None)
        self.side.events = ev = G3KvEvents(1, self.bs, g3=False)
        ev.announcer = self.ann = G4Announcer(ev, pool, self.ns, 0.1, 3600)
        self.router = DiskRouter()

    def hashes(self, rid, toks):
        """The KVBM sequence hashes of a new request of ``toks`` under the engine's identity now."""
        return list(self.side._state(_request(rid, toks, self.bs)).hashes)

    def save(self, rid, toks, tenant="t"):
        """What a save does: the blocks go to G4 under the engine's identity, the scheduler learns them. Returns the
        blocks' vLLM hashes as the events carry them."""
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
        hs = self.hashes(rid, toks)
        blocks = [np.full(self.ns.layout.bytes_per_block, i + 1, np.uint8) for i in range(len(hs))]
        assert self.pool.put(self.ns.keys(hs, tenant=tenant), blocks).result(HANG_S).written == len(hs)
        assert self.pool.flush(HANG_S)
        r = _request(rid, toks, self.bs)
        self.side.events.learn(tenant, r, hs, 0, len(hs))
        return {maybe_convert_block_hash(h) for h in r.block_hashes}

    def finds(self, rid, toks, tenant="t") -> int:
        """Blocks of ``toks`` a lookup of this engine finds in G4 now (its identity)."""
        return self.pool.lookup_prefix(self.ns.keys(self.hashes(rid, toks), tenant=tenant)).result(HANG_S)

    def poll(self):
        got = self.ann.poll()
        self.router.apply(self.side.events.take())
        return got


@pytest.mark.parametrize("engine_cleared", [False, True])
def test_after_a_reset_only_the_blocks_of_the_new_identity_are_credited(tmp_path, engine_cleared):
    from vllm.distributed.kv_events import AllBlocksCleared

    from kvbm_backend.config import G4Config
    from kvbm_backend.integrations.vllm import reset_epoch
    from kvbm_backend.pool.g4.pool import G4Pool

    cfg = G4Config(url=f"file://{tmp_path / 'store'}", announce=True,
                   keyring={"path": str(tmp_path / "keys" / "keyring.json")})
    pools = [G4Pool(cfg, namespace()) for _ in range(2)]
    try:
        a, b = (_Worker(p) for p in pools)
        bs = a.bs
        p1, p2, p3 = (list(range(s, s + 4 * bs)) for s in (7001, 17001, 27001))
        old = a.save("a1", p1)
        assert a.ann.flush() == 4
        assert b.poll() == (4, 0) and b.router.disk == old and b.finds("b0", p1) == 4  # credited, and a hit

        reset_epoch.reset(b.side, engine_cleared=engine_cleared)
        assert b.finds("b1", p1) == 0  # B's lookups miss the blocks stored before: so must its credits
        assert b.ann.live() == []
        if engine_cleared:  # vLLM's AllBlocksCleared, then the re-publishing that follows it: none of them again
            b.router.apply([AllBlocksCleared()])
            b.side.events.republish()
            b.router.apply(b.side.events.take())
            assert b.router.disk == set()
        assert b.poll() == (0, 4)  # withdrawn (after a clear, of blocks the router has forgotten already: harmless)
        assert b.router.disk == set()

        more = a.save("a2", p2)  # A, never reset, stores more under the old identity
        assert a.ann.flush() == 4
        assert b.poll() == (0, 0) and b.router.disk == set() and b.finds("b2", p2) == 0
        assert a.poll() == (8, 0) and a.router.disk == old | more  # A is credited both: it hits both

        new = b.save("b3", p3)  # B stores under its new identity: credited to B, not to A (it misses them)
        assert b.ann.flush() == 4
        assert b.poll() == (4, 0) and b.router.disk == new and b.finds("b4", p3) == 4
        assert a.poll() == (0, 0) and a.router.disk == old | more and a.finds("a3", p3) == 0
        assert len(a.ann.ann.list()) == 3  # every batch kept for its writer's TTL

        reset_epoch.reset(a.side, engine_cleared=False)  # A resets too: another epoch than B's
        assert a.poll() == (0, 8) and a.router.disk == set()
        assert b.poll() == (0, 0) and b.router.disk == new
    finally:
        for p in pools:
            p.close()


def test_a_batch_naming_a_malformed_epoch_is_corrupt(tmp_path):
    """The sealed ``"e"`` of a batch must be a string of at most 64 characters: else the batch is ignored whole
    (``announce_ignored_corrupt``), as any record failing its checks."""
    from kvbm_backend.config import G4Config
    from kvbm_backend.integrations.vllm import stats
    from kvbm_backend.integrations.vllm.g4_records import encode_records, hash_domain
    from kvbm_backend.pool.g4.pool import G4Pool

    cfg = G4Config(url=f"file://{tmp_path / 'store'}", announce=True,
                   keyring={"path": str(tmp_path / "keys" / "keyring.json")})
    pool = G4Pool(cfg, namespace())
    try:
        w = _Worker(pool)
        w.save("r", list(range(5001, 5001 + 2 * w.bs)))  # sets vLLM's NONE_HASH (the hash domain)
        for bad in (7, "x" * 65):
            recs = encode_records("w", hash_domain(), w.bs, [], 0.0, 3600)
            recs["e"] = bad
            w.ann.ann.write("t", recs)
        before = stats.snapshot().get("announce_ignored_corrupt", 0)
        assert w.poll() == (0, 0)
        assert stats.snapshot().get("announce_ignored_corrupt", 0) - before == 2
    finally:
        pool.close()


@pytest.mark.parametrize("engine_cleared", [False, True])
def test_a_prompt_stored_again_after_a_reset_stays_credited(tmp_path, engine_cleared):
    """Review finding (2026-12-03): ``set_epoch`` queues the withdrawal of the old epoch's credits for the next
    ``poll``, which queued them *after* the blocks it credited. vLLM's block hashes (the announced ``h``) do not
    change with the reset epoch (it is folded into KVBM's salt), so the same prompt stored again under the new epoch
    before that poll was credited (``BlockStored``; after ``AllBlocksCleared``: none, its holder still counted) and
    then withdrawn (``BlockRemoved``): the router forgot blocks the engine holds and hits. Now the withdrawals come
    first. Without the clear the router keeps them either way (per-hash holder counts)."""
    from vllm.distributed.kv_events import AllBlocksCleared

    from kvbm_backend.config import G4Config
    from kvbm_backend.integrations.vllm import reset_epoch
    from kvbm_backend.pool.g4.pool import G4Pool

    cfg = G4Config(url=f"file://{tmp_path / 'store'}", announce=True,
                   keyring={"path": str(tmp_path / "keys" / "keyring.json")})
    pool = G4Pool(cfg, namespace())
    try:
        b = _Worker(pool)
        p1 = list(range(7001, 7001 + 4 * b.bs))
        old = b.save("b1", p1)
        assert b.ann.flush() == 4
        assert b.poll() == (4, 0) and b.router.disk == old

        reset_epoch.reset(b.side, engine_cleared=engine_cleared)  # weights updated; the same prompt comes again
        if engine_cleared:  # vLLM's AllBlocksCleared, then the re-publishing that follows it
            b.router.apply([AllBlocksCleared()])
            b.side.events.republish()
            b.router.apply(b.side.events.take())
            assert b.router.disk == set()
        new = b.save("b2", p1)  # stored under the new identity: the same vLLM hashes
        assert new == old
        assert b.ann.flush() == 4
        assert b.poll() == (4, 4)  # the old epoch's credits withdrawn, the new one's credited
        assert b.finds("b3", p1) == 4  # the engine hits them under its new identity
        assert {e[0] for e in b.ann.live()} == new  # the announcer itself counts them live
        assert b.router.disk == new  # ... so the router must credit them
        assert b.poll() == (0, 0) and b.router.disk == new  # and nothing withdraws them later
    finally:
        pool.close()
