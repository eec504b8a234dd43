"""Requests whose KV is not a function of their token ids (multimodal inputs, prompt embeddings) are neither
loaded nor saved by the connector. Review finding (2026-11-29): the connector's block identity is token ids,
``cache_salt`` and LoRA; two images behind the same placeholder token ids got the same keys, so the second
request loaded the first image's KV (verified and accepted: the frame's identity really was that key), and a
prompt-embeds request (no token ids: vLLM's placeholders are 0s) was saved under the hashes of token 0. Real
vLLM ``Request`` objects (its block hasher says the blocks differ), the real SchedulerSide and a G3 pool."""
from __future__ import annotations

from types import SimpleNamespace as S

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.utils.hashing import sha256_cbor  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvbm_backend.config import load_config  # noqa: E402
from kvbm_backend.integrations.tiers import open_tiers  # noqa: E402
from kvbm_backend.integrations.vllm import stats  # noqa: E402
from kvbm_backend.integrations.vllm.scheduler_side import SchedulerSide, kv_beyond_token_ids  # noqa: E402
from kvbm_backend.model.hashing import sequence_hashes  # noqa: E402
from kvbm_backend.model.layout import KvLayout  # noqa: E402
from kvbm_backend.model.namespace import Namespace  # noqa: E402

pytestmark = [pytest.mark.vllm]

BS = 16
IMG = 151655  # an image placeholder token id
PROMPT = [IMG] * 32 + list(range(100, 117))  # 2 image blocks, 1 text block, 1 token


def _mm(rid: str, image: str, hasher) -> Request:
    f = MultiModalFeatureSpec(data=None, modality="image", identifier=image,
                              mm_position=PlaceholderRange(offset=0, length=32), mm_hash=image)
    return Request(rid, list(PROMPT), SamplingParams(max_tokens=1), None, mm_features=[f], block_hasher=hasher)


def _step(rid: str, blocks: list[int], computed: int, scheduled: int):
    return S(scheduled_new_reqs=[S(req_id=rid, block_ids=(blocks,), num_computed_tokens=computed)],
             scheduled_cached_reqs=S(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set()),
             num_scheduled_tokens={rid: scheduled})


@pytest.fixture
def sched(tmp_path):
    init_none_hash(sha256_cbor)
    lay = KvLayout(2, 2, BS, 64, "bfloat16")
    ns = Namespace("m", lay)
    cfg = load_config({"g3": {"paths": [str(tmp_path / "g3")], "capacity_gb": 0.05, "files_per_path": 1,
                              "admission": {"policy": "all"}}}, use_env=False)
    g3, _ = open_tiers(cfg, ns)
    yield ns, g3, SchedulerSide(ns, BS, g3, None), get_request_block_hasher(BS, sha256_cbor)
    g3.close()


def test_multimodal_requests_are_neither_loaded_nor_saved(sched):
    ns, g3, s, hasher = sched
    a, b = _mm("A", "img-cat", hasher), _mm("B", "img-dog", hasher)
    assert all(x != y for x, y in zip(a.block_hashes, b.block_hashes))  # vLLM: different KV
    assert kv_beyond_token_ids(a)
    # B's token ids are stored (by a text request with the same ids): B still gets no hit
    hs = sequence_hashes(PROMPT, BS)
    lay = ns.layout
    assert g3.put(ns.keys(hs[:3]), [np.zeros(lay.bytes_per_block, np.uint8)] * 3).result(10).written == 3
    before = stats.get("requests_not_tiered")
    assert s.get_num_new_matched_tokens(a, 0) == (0, False)
    s.update_state_after_alloc(a, S(get_block_ids=lambda: ([1, 2, 3, 4],)), 0)
    meta = s.build_connector_meta(_step("A", [1, 2, 3, 4], 0, len(PROMPT)))
    assert meta.saves == [] and meta.loads == []
    assert s.request_finished(a, []) == (False, None)
    assert s.get_num_new_matched_tokens(b, 0) == (0, False)
    assert stats.get("requests_not_tiered") == before + 2


def test_prompt_embeds_requests_are_neither_loaded_nor_saved_and_text_requests_are(sched):
    ns, g3, s, hasher = sched
    e = Request("E", None, SamplingParams(max_tokens=1), None, prompt_embeds=torch.randn(40, 32))
    assert kv_beyond_token_ids(e)
    assert s.get_num_new_matched_tokens(e, 0) == (0, False)
    s.update_state_after_alloc(e, S(get_block_ids=lambda: ([1, 2, 3],)), 0)
    assert s.build_connector_meta(_step("E", [1, 2, 3], 0, 40)).saves == []
    t = Request("T", list(range(7, 47)), SamplingParams(max_tokens=1), None)  # a text request: tiered as before
    assert not kv_beyond_token_ids(t)
    assert s.get_num_new_matched_tokens(t, 0)[0] == 0
    s.update_state_after_alloc(t, S(get_block_ids=lambda: ([5, 6, 7],)), 0)
    saves = s.build_connector_meta(_step("T", [5, 6, 7], 0, 40)).saves
    assert [j.block_ids for j in saves] == [[5, 6]]


def test_streaming_session_that_adds_an_image_is_no_longer_saved(sched):
    """Review finding (2026-11-30): a streaming-input session (vLLM 0.32 ``resumable`` requests) that starts with
    text and whose next input chunk brings an image (``StreamingUpdate.mm_features``; vLLM's own
    ``Scheduler._update_request_as_session`` applies it to the same ``Request``) kept the ``opaque`` verdict of its
    first chunk: the chunk's blocks (image placeholder ids, then text whose KV depends on the image) were offered
    under token-id hashes, so another request with the same ids would load this image's KV."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus, StreamingUpdate
    ns, g3, s, hasher = sched
    text = list(range(200, 240))  # first chunk: 40 text tokens, 2 full blocks
    r = Request("S", list(text), SamplingParams(max_tokens=1), None, block_hasher=hasher, resumable=True)
    assert not kv_beyond_token_ids(r)
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    s.update_state_after_alloc(r, S(get_block_ids=lambda: ([1, 2, 3],)), 0)
    assert [j.block_ids for j in s.build_connector_meta(_step("S", [1, 2, 3], 0, 40)).saves] == [[1, 2]]
    # the first chunk ends (its sampled token is discarded by the session update), the next brings an image
    r.num_computed_tokens = 40
    r.append_output_token_ids(999)
    r.status = RequestStatus.WAITING_FOR_STREAMING_REQ
    f = MultiModalFeatureSpec(data=None, modality="image", identifier="img-cat",
                              mm_position=PlaceholderRange(offset=0, length=32), mm_hash="img-cat")
    upd = StreamingUpdate(mm_features=[f], prompt_token_ids=[IMG] * 32 + list(range(300, 308)), max_tokens=1,
                          arrival_time=0.0, sampling_params=SamplingParams(max_tokens=1))
    vllm_sched = S(hash_block_size=BS, log_stats=False, num_waiting_for_streaming_input=1)
    Scheduler._update_request_as_session(vllm_sched, r, upd)  # vLLM's own session update
    assert r.num_tokens == 80 and r.status == RequestStatus.WAITING and kv_beyond_token_ids(r)
    # the session is scheduled again as a new request (status WAITING) holding its blocks: 40 computed, 40 new
    meta = s.build_connector_meta(_step("S", [1, 2, 3, 4, 5], 40, 40))
    assert meta.saves == []
