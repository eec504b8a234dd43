"""The G3 KV events' idle publisher (:class:`~kvbm_backend.integrations.vllm.kv_events.IdlePublisher`) around a reset
of the engine's prefix cache: the blocks re-published for it (:meth:`G3KvEvents.republish`) must reach Dynamo's router
after vLLM's ``AllBlocksCleared``, i.e. in the step's own batch, never in an idle batch sent before it."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

HANG_S = 600.0  # a hang guard, not a bound: each wait returns as soon as what it waits for happened


class _Publisher:
    """Stands where vLLM's KV event publisher is (``ZmqEventPublisher.publish``: batches queued in order)."""

    def __init__(self) -> None:
        self.batches: list = []

    def publish(self, batch) -> None:
        self.batches.append(batch)


def _wait(cond) -> None:
    end = time.monotonic() + HANG_S
    while not cond():
        assert time.monotonic() < end, "hang guard"
        time.sleep(0.001)


def test_blocks_republished_after_a_reset_leave_with_the_step_not_before_its_all_blocks_cleared():
    """vLLM publishes a step's batch as its engine events (a prefix-cache reset's ``AllBlocksCleared`` among them)
    followed by the connector's ``take_events``, which first re-publishes what G3 holds (``republish``: the router
    forgot it with the clear) and then takes the queue. After an idle spell (no take for ``idle_s``: the usual case
    of an admin reset) the idle thread took the re-published blocks while ``republish`` was still queueing them
    (a chunk per lock hold, ``time.sleep(0)`` between: 100 chunks at 100k blocks) and published them in a batch of
    its own, before the step's: the router applied the clear after them and credited none of the worker's G3 (and
    announced G4) blocks until the next reset. Here the idle thread is given its turn between ``republish`` and the
    step's take (what that race does): it must leave the re-published blocks to the step, and publish again after
    it. Real vLLM events, real idle thread; old code: the idle thread published them (2 batches instead of 1)."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as conv

    from kvbm_backend.integrations.vllm.kv_events import G3KvEvents, IdlePublisher
    from kvbm_backend.integrations.vllm.metadata import KvbmWorkerMeta
    from kvbm_backend.pool.g3.index import tag_of

    t = tag_of("")
    ev = G3KvEvents(1, 4)
    req = SimpleNamespace(block_hashes=[b"h0", b"h1"], all_token_ids=list(range(8)), lora_request=None,
                          cache_salt=None, mm_features=[], prompt_embeds=None, num_prompt_tokens=8)
    ev.learn("", req, [11, 12], 0, 2)
    ev.apply(KvbmWorkerMeta(added=[(t, 0, 11), (t, 0, 12)]))  # G3 holds both: published stored
    pub = _Publisher()
    idle = IdlePublisher(ev, idle_s=0.0, interval_s=0.001)  # no step takes events: every pass may publish
    idle.capture(pub)
    try:
        _wait(lambda: len(pub.batches) == 1)  # the engine idle: the stored blocks left by the idle thread
        (st,) = pub.batches[0].events
        assert isinstance(st, BlockStored) and st.block_hashes == [conv(b"h0"), conv(b"h1")]
        # a step after a reset of the engine's prefix cache: vLLM took its AllBlocksCleared, the connector's
        # take_events re-publishes G3's blocks, and the idle thread gets the CPU before the step's take
        ev.republish()
        passes = getattr(idle, "passes", 0)
        _wait(lambda: len(pub.batches) > 1 or getattr(idle, "passes", 0) >= passes + 3)
        assert len(pub.batches) == 1, "the idle thread published the re-published blocks before the step's clear"
        (again,) = idle.take()  # the step's take: published by vLLM after its AllBlocksCleared
        assert isinstance(again, BlockStored) and again.block_hashes == [conv(b"h0"), conv(b"h1")]
        # once the step took them, what comes while the engine idles leaves by the idle thread again
        ev.apply(KvbmWorkerMeta(removed=[(t, 0, 12)]))
        _wait(lambda: len(pub.batches) == 2)
        (rm,) = pub.batches[1].events
        assert isinstance(rm, BlockRemoved) and rm.block_hashes == [conv(b"h1")]
    finally:
        idle.stop()
        if idle._t is not None:
            idle._t.join(HANG_S)
