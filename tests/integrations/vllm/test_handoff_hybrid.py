"""The prefill -> decode hand-off through G4 (:mod:`kvbm_backend.integrations.vllm.handoff`) for a hybrid model (a
sliding-window and a full-attention KV cache group), through vLLM's real ``Scheduler`` on both sides with
``KvbmBackendConnector``'s scheduler role, real G3 pools and a real shared G4 ``file://`` store. The worker's part is
played by putting the blocks each step's save jobs name into the pools those jobs are for (G3 and G4, or G4 alone for
a hand-off's ``g4_only`` job), as the worker's write-behind does."""
from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256_cbor  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvbm_backend.integrations.vllm import stats  # noqa: E402
from kvbm_backend.integrations.vllm.handoff import KEY  # noqa: E402
from tests.helpers.vllm_handoff import handoff_extra, prefill, step_until, store_saves  # noqa: E402
from tests.helpers.vllm_sched import runner_output, tiny_scheduler  # noqa: E402

pytestmark = [pytest.mark.vllm]

BS, NBLK, WINDOW = 16, 64, 32  # the sliding group needs the 2 blocks before a resume point


def _scheduler(tmp: Path, name: str) -> Scheduler:
    """vLLM's Scheduler with KvbmBackendConnector over a hybrid KV cache (layers 0, 2 sliding, 1, 3 full), its own G3
    and the shared G4; ``handoff_wait_s`` 0: a decode request's wait ends at its first look, complete or not."""
    extra = handoff_extra(tmp, name, "tiny")
    return tiny_scheduler(tmp, extra, lambda kw, names: [
        KVCacheGroupSpec(names[0::2], SlidingWindowSpec(sliding_window=WINDOW, **kw)),
        KVCacheGroupSpec(names[1::2], FullAttentionSpec(**kw))], block_size=BS, num_blocks=NBLK, batched_tokens=512)


@pytest.mark.parametrize("tokens, cached", [(6 * BS, False), (6 * BS, True), (6 * BS + 5, True)],
                         ids=["block-aligned", "block-aligned-cached", "cached"])
def test_a_hybrid_models_handoff_stores_the_window_the_decode_side_resumes_at(tmp_path, tokens, cached):
    """Review finding 2026-11-30 (hand-off): a decode request's hit needs, besides the full group's blocks, the
    sliding group's window before the point it resumes at: ``(prompt tokens - 1) // block_size`` blocks, the blocks
    its prefill worker promised. The prefill side stored the window before its own computed end only: a prompt
    ending on a block boundary (``block-aligned``: 6 blocks, resumed at 5, window blocks 3..4; block 3 was never
    stored), and every prompt the prefill worker's engine or G3 held (``cached``: the hand-off's ``g4_only`` job
    offered full-attention groups only), never had the window in G4: the decode side found 0 of the 5 (or 6)
    promised blocks, waited ``handoff_wait_s`` for nothing (counted ``handoff_timeouts``) and computed the whole
    prompt. Now both windows are offered: the decode side finds every promised block at its first look and loads
    the full group's blocks and the sliding group's window."""
    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(BS, sha256_cbor)
    prompt = list(range(1000, 1000 + tokens))
    want = (tokens - 1) // BS
    pre = _scheduler(tmp_path, "prefill")
    dec = None
    try:
        if cached:  # an earlier request of the same prompt: in the prefill worker's G3 (G4 missed its writes)
            pre.add_request(Request("p0", prompt, SamplingParams(max_tokens=1), None, 0, block_hasher=hasher))
            so = step_until(pre, "p0")
            store_saves(pre, so, g3_only=True)
            pre.update_from_output(so, runner_output(pre, so))
        params = prefill(pre, prompt, hasher)
        assert params[KEY]["blocks"] == want

        dec = _scheduler(tmp_path, "decode")
        done, timeouts = stats.get("handoff_complete_requests"), stats.get("handoff_timeouts")
        dec.add_request(Request("d", prompt, SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params}),
                                None, 0, block_hasher=hasher))
        so = step_until(dec, "d", loads=True)
        loads = sorted((j.group, len(j.block_ids)) for j in so.kv_connector_metadata.loads if j.req_id == "d")
        assert loads == [(0, WINDOW // BS), (1, want)]  # before: [] (d computed the prompt)
        assert stats.get("handoff_complete_requests") == done + 1
        assert stats.get("handoff_timeouts") == timeouts  # before: + 1 (the whole handoff_wait_s waited)
    finally:
        pre.shutdown()
        if dec is not None:
            dec.shutdown()
