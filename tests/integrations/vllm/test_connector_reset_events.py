"""KV events after the connector's ``reset_cache`` (kvbm_backend/integrations/vllm/reset_epoch.py): the G3 blocks
stored before are no longer this engine's (another identity), so the router must stop crediting them. The engine
path itself (no hit after ``reset_prefix_cache(reset_connector=True)``): tests/e2e/test_connector_reset.py."""
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")


def _published_events(n: int):
    from kvbm_backend.integrations.vllm.kv_events import G3KvEvents
    from kvbm_backend.integrations.vllm.metadata import KvbmWorkerMeta
    from kvbm_backend.pool.g3.index import tag_of

    t, seqs = tag_of(""), [1000 + i for i in range(n)]
    r = SimpleNamespace(block_hashes=[f"h{i}".encode() for i in range(n)], all_token_ids=list(range(4 * n)),
                        lora_request=None, cache_salt=None, mm_features=[], prompt_embeds=None)
    ev = G3KvEvents(1, 4)
    ev.learn("", r, seqs, 0, n)
    ev.apply(KvbmWorkerMeta(added=[(t, 0, s) for s in seqs]))
    (stored,) = ev.take()
    assert len(stored.block_hashes) == n and ev.published() == n
    return ev, t, seqs, stored


@pytest.mark.parametrize("engine_cleared", [False, True])
def test_reset_withdraws_the_g3_blocks_stored_before(engine_cleared):
    """``forget(withdraw=not engine_cleared)``: when vLLM's own prefix-cache reset failed (no ``AllBlocksCleared``
    goes out), every published block is withdrawn with ``BlockRemoved``; when it succeeded, nothing is queued and the
    re-publishing that follows ``AllBlocksCleared`` publishes none of them again. Later reports of those blocks
    (evicted by G3's LRU) publish nothing. Before, there was no reset: the re-publishing credited them again."""
    from vllm.distributed.kv_events import BlockRemoved

    from kvbm_backend.integrations.vllm.metadata import KvbmWorkerMeta

    ev, t, seqs, stored = _published_events(5)
    assert ev.forget(withdraw=not engine_cleared) == 5
    out = ev.take()
    if engine_cleared:
        assert out == []
    else:
        assert [type(e) for e in out] == [BlockRemoved] and out[0].block_hashes == stored.block_hashes
    assert ev.published() == 0
    ev.republish()  # what take_events does after AllBlocksCleared
    assert ev.take() == []
    ev.apply(KvbmWorkerMeta(removed=[(t, 0, s) for s in seqs]))  # the old blocks age out of G3
    assert ev.take() == []
