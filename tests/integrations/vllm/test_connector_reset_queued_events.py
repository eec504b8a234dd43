"""KV events still queued when the connector's ``reset_cache`` runs (kvbm_backend/integrations/vllm/kv_events.py
``G3KvEvents.forget``, kvbm_backend/integrations/vllm/reset_epoch.py).

A worker's G3 report (the report channel: any thread, any time) queues ``BlockStored`` for the blocks it completes;
vLLM's step takes them, or the idle publisher once the engine has not stepped for ``idle_s``. The last saves of a
batch are reported just after it finished, so a reset right after it (an RL loop: generate, update the weights,
``reset_prefix_cache(reset_connector=True)``) finds their ``BlockStored`` still queued. The engine's own reset
succeeded (it was idle), so ``forget`` withdraws silently: vLLM's ``AllBlocksCleared`` goes out with the next step.
But the queued ``BlockStored`` left in that step's batch after the clear (vLLM publishes the engine's events, then
the connector's), and ``forget`` had given up their holders, so no ``BlockRemoved`` ever followed: the router
credited this worker with G3 blocks of the old identity that it is never served again, until the next clear."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from tests.helpers.kv_router import DiskRouter  # noqa: E402


def _h(i: int):
    """Block ``i``'s vLLM hash as the events carry it (``maybe_convert_block_hash``)."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    return maybe_convert_block_hash(f"h{i}".encode())


def _request(n: int, first: int = 0):
    return SimpleNamespace(block_hashes=[f"h{first + i}".encode() for i in range(n)],
                           all_token_ids=list(range(4 * n)), lora_request=None, cache_salt=None, mm_features=[],
                           prompt_embeds=None)


def _scheduler_side():
    from kvbm_backend.integrations.vllm.kv_events import G3KvEvents
    from kvbm_backend.integrations.vllm.scheduler_side import SchedulerSide
    from kvbm_backend.model.layout import KvLayout
    from kvbm_backend.model.namespace import Namespace

    sd = SchedulerSide(Namespace("m", KvLayout(2, 2, 4, 64, "bfloat16")), 4, None, None)
    sd.events = G3KvEvents(1, 4)
    return sd


def test_blocks_stored_but_not_yet_taken_at_a_reset_are_not_published_after_the_clear():
    """Step 1 publishes blocks 0..2 (old identity); the worker then reports blocks 3..4 written (queued, not taken:
    the engine went idle less than ``idle_s`` ago). ``reset_cache`` with the engine's own reset done
    (``engine_cleared``); the next step's batch is vLLM's ``AllBlocksCleared`` then the connector's events. The
    router must credit none of the five old blocks then, nor after G3 evicts them (before: h3 and h4 stayed
    credited for good: their ``BlockStored`` followed the clear, their holders were gone, so their eviction published
    nothing)."""
    from vllm.distributed.kv_events import AllBlocksCleared

    from kvbm_backend.integrations.vllm import reset_epoch
    from kvbm_backend.integrations.vllm.metadata import KvbmWorkerMeta
    from kvbm_backend.pool.g3.index import tag_of

    sd, router, t = _scheduler_side(), DiskRouter(), tag_of("")
    seqs = [1000 + i for i in range(5)]
    sd.events.learn("", _request(5), seqs, 0, 5)  # the saves planned by the old identity's request
    sd.apply_g3_report(0, KvbmWorkerMeta(added=[(t, 0, s) for s in seqs[:3]]))
    router.apply(sd.take_events())  # step 1
    assert router.disk == {_h(0), _h(1), _h(2)}
    sd.apply_g3_report(0, KvbmWorkerMeta(added=[(t, 0, s) for s in seqs[3:]]))  # the report channel, after step 1

    reset_epoch.reset(sd, engine_cleared=True)  # the connector's reset_cache, vLLM's own reset succeeded
    router.apply([AllBlocksCleared()] + sd.take_events(engine_cache_reset=True))  # the next step's batch
    assert router.disk == set()  # before: {h3, h4}
    sd.apply_g3_report(0, KvbmWorkerMeta(removed=[(t, 0, s) for s in seqs]))  # G3 evicts the old blocks
    router.apply(sd.take_events())
    assert router.disk == set()


def test_blocks_the_engine_still_holds_are_published_again_after_the_reset():
    """What the queue loses at the reset is only what the re-publishing after ``AllBlocksCleared`` supersedes: the
    G4 blocks the poller still credits (``G4Announcer.live``) are published again with the step, whether their
    ``BlockStored`` had been taken or was still queued; a block the new identity stores after the reset is
    published as usual. Since 2026-12-03 the poller credits only its engine's current epoch
    (``G4Announcer.set_epoch``: tests/integrations/vllm/test_g4_announce_reset.py), so the blocks announced before a
    ``reset_tiers`` reset are not among them; a block announced under the new epoch is."""
    from vllm.distributed.kv_events import AllBlocksCleared

    from kvbm_backend.integrations.vllm import reset_epoch
    from kvbm_backend.integrations.vllm.metadata import KvbmWorkerMeta
    from kvbm_backend.pool.g3.index import tag_of

    sd, router, t = _scheduler_side(), DiskRouter(), tag_of("")

    class _Announcer:  # the G4 announcements the poller holds now (G4Announcer.live)
        def __init__(self) -> None:
            self.held: list = []

        def learn(self, *a) -> None:
            pass

        def live(self) -> list:
            return list(self.held)

        def set_epoch(self, epoch: str) -> None:  # as G4Announcer: other epochs' blocks are no longer credited
            self.held.clear()

    ann = sd.events.announcer = _Announcer()
    g4a, g4b = (b"g4a", None, [1, 2, 3, 4], None, None, None), (b"g4b", None, [5, 6, 7, 8], None, None, None)
    ann.held.append(g4a)
    sd.events.emit_announced([g4a], [])
    router.apply(sd.take_events())
    ann.held.append(g4b)
    sd.events.emit_announced([g4b], [])  # queued, not taken at the reset
    old = [1000, 1001]
    sd.events.learn("", _request(2), old, 0, 2)
    sd.apply_g3_report(0, KvbmWorkerMeta(added=[(t, 0, s) for s in old]))  # queued too

    reset_epoch.reset(sd, engine_cleared=True)
    router.apply([AllBlocksCleared()] + sd.take_events(engine_cache_reset=True))
    assert router.disk == set()  # before 2026-12-03: g4a, g4b (old identity, no longer loadable) and h0, h1
    g4c = (b"g4c", None, [9, 10, 11, 12], None, None, None)  # announced under the new epoch
    ann.held.append(g4c)
    sd.events.emit_announced([g4c], [])
    new = [2000, 2001]  # the new identity's blocks of another prompt
    sd.events.learn("", _request(2, first=10), new, 0, 2)
    sd.apply_g3_report(0, KvbmWorkerMeta(added=[(t, 0, s) for s in new]))
    router.apply(sd.take_events())
    assert router.disk == {b"g4c", _h(10), _h(11)}
