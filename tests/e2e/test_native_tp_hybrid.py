"""vLLM's native offloading path (``OffloadingConnector`` + our ``CpuTieringOffloadingSpec`` + our G3 tier as
a ``secondary_tiers`` entry) on the real vLLM CPU engine, for TP=2 and for a hybrid model (several KV cache
groups). Each engine in its own process, float32, real files. Chunks of 4 engine blocks (128 tokens).
"""
from __future__ import annotations

import pytest

from tests.helpers.vllm_runner import native_extra, prompts, run_engine, vllm_available

from kvbm_backend.apps.engine_model import TINY, TINY_GPT_OSS, write_hybrid_model_dir, write_model_dir  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]

_why = vllm_available()
if _why:
    pytestmark.append(pytest.mark.skip(reason=f"vLLM engine not importable: {_why}"))

CHUNK_TOKENS = 4 * 32  # blocks_per_chunk 4 over 32-token engine blocks


def _tier(res: dict, kind: str) -> dict:
    (t,) = [t for t in res["tier_stats"] if t["type"] == kind]
    return t


@pytest.mark.two_cores
def test_native_tiers_tensor_parallel_two_ranks(tmp_path):
    """TP=2 (two worker processes, one KV head each; the tiers live in the engine core process and store
    each chunk's two rank slices as two G3 blocks): greedy outputs with native offloading equal those
    without; with the engine's prefix cache emptied the prompts load from the CPU primary tier through
    both ranks' workers; a FRESH TP=2 engine on the writer's G3 directory serves every full chunk of
    both prompts (G3 is the only tier below a new, empty CPU primary tier) with identical outputs."""
    model_dir = write_model_dir(tmp_path / "model", TINY)
    ps = prompts(2, 700, shared_prefix=320, seed=21)
    full = 700 // CHUNK_TOKENS * CHUNK_TOKENS
    kw = dict(dtype="float32", num_gpu_blocks=48, tensor_parallel_size=2, warmup=False)
    g3 = tmp_path / "w" / "g3"
    extra = native_extra(tmp_path / "w", num_kv_heads=1)  # heads per rank

    base = run_engine(tmp_path, "tp-base", model_dir, ps, None, **kw)
    # every full chunk of both prompts, the 2 whole chunks of their shared 320-token prefix once (5 + 3), x 2
    # ranks: the G3 blocks the restart must find (the writer waits for them: a quiet window alone was not enough)
    stored = (2 * (full // CHUNK_TOKENS) - 320 // CHUNK_TOKENS) * 2
    w = run_engine(tmp_path, "tp-writer", model_dir, ps + ps, None, native=extra, reset_prefix_cache_before=[2],
                   settle_dirs=[str(g3)], settle_g3_blocks=stored, **kw)
    assert w["outputs"] == base["outputs"] * 2
    assert w["cached_tokens"][2:] == [full, full], w["cached_tokens"]  # loaded from the CPU primary tier
    assert w["settled"]

    r = run_engine(tmp_path, "tp-restart", model_dir, ps, None, native=extra, settle_dirs=[str(g3)], **kw)
    assert r["outputs"] == base["outputs"]
    assert r["cached_tokens"] == [full, full], r["cached_tokens"]  # from G3: a new engine, a new primary tier


@pytest.mark.side
def test_native_tiers_hybrid_model_groups(tmp_path):
    """The gpt-oss-like hybrid model (alternating sliding-window (64 tokens) / full attention: two KV cache
    groups, see tests/e2e/test_hybrid_e2e.py): the full group offloads every full chunk of each prompt,
    the sliding group only the chunk its window needs for a hit at the end of the prompt (vLLM's
    offloading connector decides; the OffloadKey carries the group). Outputs with native offloading
    equal those without; a second round with the engine's prefix cache emptied loads from the CPU
    primary tier; a FRESH engine on the writer's G3 loads every one of those chunks from G3 (none from
    the new CPU primary tier), with identical outputs."""
    model_dir = write_hybrid_model_dir(tmp_path / "model", TINY_GPT_OSS)
    ps = [prompts(1, n, seed=s, vocab=TINY_GPT_OSS.vocab_size)[0] for n, s in ((400, 21), (300, 22), (360, 23))]
    full = [len(p) // CHUNK_TOKENS for p in ps]  # full chunks per prompt: 3, 2, 2
    # one chunk per prompt in the sliding group: the 64-token window before the hit's end lies in its last chunk
    chunks = sum(full) + len(ps)
    kw = dict(dtype="float32", num_gpu_blocks=96, max_model_len=512, warmup=False)
    extra = native_extra(tmp_path / "w", num_kv_heads=TINY_GPT_OSS.num_key_value_heads, model="kvbm-backend/tiny-gpt-oss")

    base = run_engine(tmp_path, "hy-base", model_dir, ps, None, **kw)
    w = run_engine(tmp_path, "hy-writer", model_dir, ps + ps, None, native=extra, reset_prefix_cache_before=[3], **kw)
    assert w["outputs"] == base["outputs"] * 2
    assert w["cached_tokens"] == [0, 0, 0] + [n * CHUNK_TOKENS for n in full], w["cached_tokens"]
    g3w = _tier(w, "G3Tier")
    assert g3w["tier"]["chunks_stored"] == chunks and g3w["tier"]["stores_failed"] == 0, g3w["tier"]
    assert w["native_loads"]["chunks_by_source"] == {"CPU": chunks, "G3Tier": 0}, w["native_loads"]

    r = run_engine(tmp_path, "hy-restart", model_dir, ps, None, native=extra, **kw)
    assert r["outputs"] == base["outputs"]
    assert r["cached_tokens"] == [n * CHUNK_TOKENS for n in full], r["cached_tokens"]
    assert r["native_loads"]["chunks_by_source"] == {"CPU": 0, "G3Tier": chunks}, r["native_loads"]
    g3r = _tier(r, "G3Tier")
    assert g3r["pool"]["restored_blocks"] == chunks, g3r["pool"]  # warm index from the writer's journal
    assert g3r["tier"]["chunks_loaded"] == chunks and g3r["tier"]["chunks_load_failed"] == 0, g3r["tier"]
