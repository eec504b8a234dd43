"""G3Tier / G4Tier as vLLM secondary tiers, driven through vLLM's REAL TieringOffloadingSpec and
TieringOffloadingManager (CPU primary tier on a /dev/shm mmap, no engine), with the real G3 and G4
pools on tmp_path. vLLM loads our tiers out of tree via ``module_path`` in every test."""
from __future__ import annotations

import hashlib
import os
import time

import numpy as np
import pytest

HANG_S = 600.0  # a hang guard, not a bound: waits for results and lookups that must come; returns as soon as they do
POLLS = 300_000  # lookup polls >= 2 ms apart until resolved: >= HANG_S (was 2000: ~4 s)

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")

from vllm.v1.kv_offload.base import LookupResult, Medium, ScheduleEndContext, make_offload_key  # noqa: E402

from kvbm_backend.integrations.vllm.tiering_harness import TieringHarness, offloading_config  # noqa: E402
from kvbm_backend.integrations.vllm.tiering import G3Tier, PrimaryGeometry, offload_key_hash  # noqa: E402
from kvbm_backend.model.frame import HEADER_BYTES  # noqa: E402

pytestmark = [pytest.mark.vllm]

MOD = "kvbm_backend.integrations.vllm.tiering"
GEO = dict(num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16", tokens_per_block=16)  # 32 KiB chunks


def keys_for(n: int, tag: str) -> list[bytes]:
    return [make_offload_key(hashlib.sha256(f"{tag}:{i}".encode()).digest(), 0) for i in range(n)]


def g3_tier(path, **kw) -> dict:
    d = {"type": "G3Tier", "module_path": MOD, "num_kv_heads": GEO["num_kv_heads"], "io_threads": 2,
         "g3": {"paths": [str(path)], "capacity_gb": 0.05, "io_threads": 2,
                "load_timeout_s": 120.0}}  # was 5: a read the busy CI VM froze (13-31 s) is no miss
    d.update(kw)
    return d


@pytest.fixture
def harnesses():
    made: list[TieringHarness] = []

    def make(tiers, **kw):
        h = TieringHarness(offloading_config(secondary_tiers=tiers, chunks=kw.pop("chunks", 32),
                                             **{**GEO, **kw}))
        made.append(h)
        return h

    yield make
    for h in made:
        if h.primary is not None:
            h.shutdown()


def payloads(h: TieringHarness, n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, h.chunk_bytes, dtype=np.uint8) for _ in range(n)]


# ---- the explicit primary-chunk <-> FullyContiguous mapping ------------------------------------
@pytest.mark.parametrize("kvl", ["LBNHC", "LBHNC", "BLNHC", "BLHNC"])
@pytest.mark.parametrize("bpc", [1, 2])
def test_mapping_places_every_element_where_kvbm_expects_it(kvl, bpc):
    L, H, N, D, O = 3, 2, 4, 8, 2  # D in elements; bfloat16 -> 2 bytes
    g = PrimaryGeometry(num_layers=L, num_kv_heads=H, head_dim=D, outer_dim=O, dtype="bfloat16",
                        tokens_per_block=N, blocks_per_chunk=bpc, copies=1, rank_bytes=L * H * N * O * D * 2 * bpc,
                        kv_cache_layout=kvl)
    # Engine image with a unique tag per (layer, sub_block, head, token, outer, d) element (uint16)
    tag = np.arange(L * bpc * H * N * O * D, dtype=np.uint16)
    if kvl.startswith("LB"):
        eng = tag.reshape(L, bpc, *((H, N) if kvl.endswith("HNC") else (N, H)), O, D)
    else:
        eng = tag.reshape(bpc, L, *((H, N) if kvl.endswith("HNC") else (N, H)), O, D)
    src = eng.reshape(-1).view(np.uint8).copy()
    fc = np.empty_like(src)
    g.engine_to_block(src, fc)
    blk = fc.view(np.uint16).reshape(L, O, bpc * N, H * D)  # KVBM [layer, outer, token, heads*head_dim]
    for (l, j, h, n, o) in [(0, 0, 0, 0, 0), (L - 1, bpc - 1, H - 1, N - 1, 1), (1, bpc - 1, 0, 2, 1), (2, 0, 1, 3, 0)]:
        if kvl.startswith("LB"):
            want = eng[l, j, h, n] if kvl.endswith("HNC") else eng[l, j, n, h]
        else:
            want = eng[j, l, h, n] if kvl.endswith("HNC") else eng[j, l, n, h]
        np.testing.assert_array_equal(blk[l, o, j * N + n, h * D:(h + 1) * D], want[o])
    back = np.empty_like(src)
    g.block_to_engine(fc, back)
    np.testing.assert_array_equal(back, src)
    assert g.kv_layout.bytes_per_block == src.nbytes and g.kv_layout.page_size == bpc * N


def test_geometry_errors_name_the_setting(tmp_path, harnesses):
    with pytest.raises(ValueError, match="kv_cache_layout"):
        PrimaryGeometry(2, 2, 8, 2, "bfloat16", 4, 1, 1, 2 * 2 * 8 * 2 * 2 * 4, kv_cache_layout="BHLNC")
    with pytest.raises(ValueError, match="num_kv_heads/head_dim"):
        PrimaryGeometry(2, 2, 8, 2, "bfloat16", 4, 1, 1, 12345)
    tier = g3_tier(tmp_path / "g3")
    del tier["num_kv_heads"]
    with pytest.raises(ValueError, match="num_kv_heads"):
        harnesses([tier])
    with pytest.raises(ValueError, match="head_dim"):
        harnesses([g3_tier(tmp_path / "g3b", num_kv_heads=3)])
    # a preset of another model (32 layers against the engine's 4) is refused, not cut to fit
    with pytest.raises(ValueError, match="layout: preset 'llama-3.1-8b' has 32 layers, the engine's KV cache groups 4"):
        harnesses([{k: v for k, v in g3_tier(tmp_path / "g3c", layout="llama-3.1-8b").items() if k != "num_kv_heads"}])


def test_engines_whose_settings_cut_other_heads_never_share_blocks(tmp_path, harnesses):
    """Review finding (2026-11-29): num_kv_heads 4 (the model's total, a TP=2 engine's easy mistake; head_dim then
    derives as 32) and the right 2 x 64 give the same byte total, so both engines got one namespace and each
    loaded the other's chunks as verified hits, its heads scrambled. The head split is now in the namespace."""
    wrong = harnesses([g3_tier(tmp_path / "g3", num_kv_heads=4)])
    assert (wrong.tier.geometry.num_kv_heads, wrong.tier.geometry.head_dim) == (4, 32)
    keys, data = keys_for(3, "heads"), payloads(wrong, 3, seed=5)
    wrong.store(keys, data)
    wrong.wait_idle()
    wrong_fp = wrong.tier.namespace.fingerprint
    wrong.shutdown()
    right = harnesses([g3_tier(tmp_path / "g3")])
    assert _looked_up(right.tier, right.context(), keys[0]) is LookupResult.MISS
    assert right.tier.namespace.kv_heads == 2 and right.tier.namespace.fingerprint != wrong_fp
    right.shutdown()
    again = harnesses([g3_tier(tmp_path / "g3", num_kv_heads=4)])  # the same settings still find their chunks
    got = again.load(keys)
    assert len(got) == 3 and all(np.array_equal(a, b) for a, b in zip(got, data))


# ---- store / load through vLLM's manager ------------------------------------------------------
CHUNK = 32 << 10  # bytes of one GEO chunk


@pytest.fixture(params=["one_piece", "two_chunk_pieces"])
def pieces(request, monkeypatch):
    """Run a test with a job in one pool call, and with a job split into pieces of 2 chunks (several
    pool.put / pool.get calls per job, pipelined)."""
    if request.param == "two_chunk_pieces":
        monkeypatch.setattr(G3Tier, "piece_bytes", 2 * CHUNK)
    return request.param


def test_store_then_load_through_vllm_tiering_manager(tmp_path, harnesses, pieces):
    h = harnesses([g3_tier(tmp_path / "g3", enable_kv_events=True)], enable_kv_cache_events=True)
    assert h.chunk_bytes == CHUNK
    keys, data = keys_for(6, "a"), payloads(h, 6)
    h.store(keys, data)
    h.wait_idle()
    events = list(h.manager.take_events())
    stored = [e for e in events if e.medium is Medium.STORAGE]
    assert stored and sorted(k for e in stored for k in e.keys) == sorted(keys)
    # the tier stored KVBM FullyContiguous blocks in G3 under xxh3_64(offload key)
    tier = h.tier
    out = np.empty(tier.geometry.rank_bytes, np.uint8)
    res = tier.pool.get([tier.namespace.key(offload_key_hash(keys[3]))], [out]).result(timeout=HANG_S)
    assert res.ok == [True]
    want = np.empty_like(out)
    tier.geometry.engine_to_block(data[3], want)
    np.testing.assert_array_equal(out, want)
    assert tier.namespace.hash_scheme == "vllm-block-hash"

    h.reset_primary()  # vLLM's reset_cache: drains the tiers, empties the primary; G3 keeps the data
    got = h.load(keys)
    assert len(got) == 6
    for a, b in zip(got, data):
        np.testing.assert_array_equal(a, b)
    st = tier.kvbm_stats()["tier"]
    assert st["chunks_loaded"] == 6 and st["chunks_load_failed"] == 0


def test_g3_tier_publishes_removal_of_chunks_it_no_longer_holds(tmp_path, harnesses, monkeypatch):
    """KV events on: stores are published with ``removal_expected`` (vLLM's events tracker keeps their payload
    for the removal), and a chunk G3 drops afterwards (here deleted from the pool, as an eviction or a corrupt
    block drops it) is published removed (``medium`` STORAGE, the tier's locality) once, the others not."""
    monkeypatch.setattr(G3Tier, "reconcile_interval_s", 0.0)
    h = harnesses([g3_tier(tmp_path / "g3", enable_kv_events=True, locality="LOCAL")], enable_kv_cache_events=True)
    keys, data = keys_for(6, "r"), payloads(h, 6)
    h.store(keys, data)
    h.wait_idle()
    stored = [e for e in h.manager.take_events() if e.medium is Medium.STORAGE]
    assert sorted(k for e in stored for k in e.keys) == sorted(keys)
    assert all(e.removal_expected and not e.removed for e in stored), stored
    assert [e for e in h.manager.take_events() if e.medium is Medium.STORAGE] == []  # nothing dropped yet
    tier = h.tier
    assert tier.pool.delete([tier.namespace.key(offload_key_hash(k)) for k in keys[1:3]]).result(timeout=HANG_S) == 2
    removed = [e for e in h.manager.take_events() if e.medium is Medium.STORAGE]
    assert len(removed) == 1 and removed[0].removed, removed
    assert sorted(removed[0].keys) == sorted(keys[1:3]) and removed[0].locality.value == "LOCAL"
    assert [e for e in h.manager.take_events() if e.medium is Medium.STORAGE] == []  # published once


def test_evicted_chunks_are_published_removed_from_the_pools_removal_log(tmp_path, harnesses):
    """A G3 tier that evicts: the chunks its pool evicted are published removed, found from G3's removal log
    (``G3Pool.removed_since``) without reading the index on the scheduler thread (before 2026-11-29 every check
    read the whole index: 1.2-2.3 s per check at 200,000 chunks). A chunk deleted and stored again before the
    check is not reported removed (its copy is newer than the removal)."""
    h = harnesses([g3_tier(tmp_path / "g3", enable_kv_events=True, g3={"paths": [str(tmp_path / "g3")],
                                                                       "capacity_gb": 0.002, "io_threads": 2})],
                  enable_kv_cache_events=True)
    tier = h.tier
    calls = []
    keys_of_pool, keys_within = tier.pool.keys, tier.pool.keys_within
    tier.pool.keys = lambda: calls.append(1) or keys_of_pool()  # spies: count index reads, same answers
    tier.pool.keys_within = lambda wait_s: calls.append(1) or keys_within(wait_s)
    keys = keys_for(120, "e")
    for i in range(0, 120, 10):
        h.store(keys[i:i + 10], payloads(h, 10, seed=i))
        h.wait_idle()
    events = [e for e in h.manager.take_events() if e.medium is Medium.STORAGE]
    removed = {k for e in events if e.removed for k in e.keys}
    held = {(k.seq_hash, k.rank) for k in keys_of_pool()}
    assert removed and removed == {k for k in keys if (offload_key_hash(k), 0) not in held}, len(removed)
    assert calls == []
    again = [k for k in keys if k not in removed][-1]
    tier.pool.delete([tier.namespace.key(offload_key_hash(again))]).result(timeout=HANG_S)
    h.reset_primary()  # vLLM's CPU tier forgets it: the next store reaches the tier again
    h.store([again], payloads(h, 1, seed=999))
    h.wait_idle()
    events = [e for e in h.manager.take_events() if e.medium is Medium.STORAGE]
    assert not any(e.removed and again in e.keys for e in events), events


def test_tier_without_events_keeps_nothing_for_removals(tmp_path, harnesses):
    h = harnesses([g3_tier(tmp_path / "g3")], enable_kv_cache_events=True)
    keys = keys_for(3, "n")
    h.store(keys, payloads(h, 3))
    h.wait_idle()
    assert [e for e in h.manager.take_events() if e.medium is Medium.STORAGE] == []
    assert len(h.tier._held) == 0 and not h.tier._removals


def test_restart_finds_blocks_in_g3(tmp_path, harnesses):
    h = harnesses([g3_tier(tmp_path / "g3")])
    keys, data = keys_for(4, "r"), payloads(h, 4, seed=1)
    h.store(keys, data)
    h.wait_idle()
    h.shutdown()  # closes the G3 pool (directory lock released) and vLLM's primary mmap
    h2 = harnesses([g3_tier(tmp_path / "g3")])
    got = h2.load(keys)
    assert len(got) == 4 and all(np.array_equal(a, b) for a, b in zip(got, data))


def _resolve(tier, ctx, keys) -> dict:
    """Each key's lookup result once none is RETRY: the steps vLLM runs (``on_schedule_end`` posts the batch)."""
    results: dict = {}
    for _ in range(POLLS):
        tier.on_schedule_end(ScheduleEndContext((), ()))
        results = {k: tier.lookup(k, ctx) for k in keys}
        if LookupResult.RETRY not in results.values():
            break
        time.sleep(0.002)
    return results


def test_lookup_is_async_retry_then_hit_or_miss(tmp_path, harnesses):
    h = harnesses([g3_tier(tmp_path / "g3")])
    keys, data = keys_for(2, "l"), payloads(h, 2)
    h.store(keys[:1], data[:1])
    h.wait_idle()
    tier, ctx = h.tier, h.context()
    tier.on_new_request(ctx)
    # first sighting of a key: the index lookup is posted at the end of the step -> RETRY now
    assert tier.lookup(keys[0], ctx) is LookupResult.RETRY
    assert tier.lookup(keys[1], ctx) is LookupResult.RETRY
    results = _resolve(tier, ctx, keys)
    assert results[keys[0]] is LookupResult.HIT
    assert results[keys[1]] is LookupResult.MISS
    tier.on_request_finished(ctx)


def test_failed_load_is_reported_failed_never_wrong_bytes(tmp_path, harnesses, pieces):
    h = harnesses([g3_tier(tmp_path / "g3")])
    keys, data = keys_for(6, "c"), payloads(h, 6, seed=2)
    h.store(keys, data)
    h.wait_idle()
    tier = h.tier
    # corrupt chunk 2's payload on disk (one byte inside the stored block)
    fi, si = tier.pool.index.get(tier.namespace.key(offload_key_hash(keys[2])))
    path = tier.pool.slabs.by_index[fi].path
    off = si * tier.pool.slot_bytes + HEADER_BYTES + 100
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, off)
        os.pwrite(fd, bytes([b[0] ^ 0xFF]), off)
        os.fsync(fd)
    finally:
        os.close(fd)
    h.reset_primary()
    got = h.load(keys)
    # the usable prefix stops before the corrupt chunk; what was served is exact
    assert len(got) == 2
    for a, b in zip(got, data):
        np.testing.assert_array_equal(a, b)
    st = tier.kvbm_stats()
    assert st["tier"]["chunks_load_failed"] >= 1 and st["tier"]["loads_failed"] >= 1
    # every verified chunk was loaded, also those after the corrupt one (with two-chunk pieces: chunk 2
    # is in the second of three pieces, the third piece still lands)
    assert st["tier"]["chunks_loaded"] == 5 and st["tier"]["chunks_load_failed"] == 1
    assert st["pool"]["corrupt"] >= 1
    # the failed key is a miss from now on (no promotion livelock), the others still load
    assert h.lookup_prefix(keys[2:3], timeout=HANG_S) == 0
    got2 = h.load(keys[3:])
    assert len(got2) == 3 and all(np.array_equal(a, b) for a, b in zip(got2, data[3:]))


def test_drain_and_shutdown(tmp_path, harnesses):
    h = harnesses([g3_tier(tmp_path / "g3")])
    keys, data = keys_for(8, "d"), payloads(h, 8, seed=3)
    h.store(keys, data)  # cascade jobs in flight; no step taken yet
    tier = h.tier
    # vLLM's reset_cache: every tier's drain_jobs(), then it consumes the results and asserts no job is left
    h.manager.reset_cache()
    assert not tier.has_pending_work() and not h.manager.has_pending_work()
    got = h.load(keys)
    assert len(got) == 8 and all(np.array_equal(a, b) for a, b in zip(got, data))
    h.shutdown()  # vLLM's manager.shutdown: our tier first (pool closed, primary export dropped), then the mmap
    assert tier._closed and tier._primary is None and tier.pool._closed


def test_g4_tier_store_then_load(tmp_path, harnesses):
    """Also the config's ``tenant``: the tenant of a request that names none (here the store)."""
    store = tmp_path / "g4"
    tier = {"type": "G4Tier", "module_path": MOD, "num_kv_heads": GEO["num_kv_heads"], "io_threads": 2,
            "config": {"tenant": "acme"},
            "g4": {"url": f"file://{store}", "keyring": {"path": str(tmp_path / "keys" / "keyring.json")},
                   "timeout_s": 60.0}}  # was 5: a read the busy CI VM froze is not a miss (2026-11-29)
    h = harnesses([tier])
    keys, data = keys_for(3, "g4"), payloads(h, 3, seed=4)
    h.store(keys, data)  # no kvbm_tenant: the config's tenant
    h.wait_idle()
    assert h.tier.kvbm_stats()["tier"]["chunks_stored"] == 3
    h.reset_primary()
    # another tenant does not see acme's blocks; acme does
    assert h.load(keys, ctx=h.context(kv_transfer_params={"kvbm_tenant": "other"})) == []
    got = h.load(keys, ctx=h.context(kv_transfer_params={"kvbm_tenant": "acme"}))
    assert len(got) == 3 and all(np.array_equal(a, b) for a, b in zip(got, data))


def test_staging_arena_reuses_its_buffers_and_never_blocks():
    from kvbm_backend.integrations.vllm.tiering import staging_pool
    st = staging_pool(8192, 3)
    a = [st.take(8192) for _ in range(5)]  # 3 from the arena, 2 fresh
    assert len(a) == 5 and all(b.nbytes == 8192 and b.ctypes.data % 4096 == 0 for b in a)
    assert len({b.ctypes.data for b in a}) == 5
    for x in a:
        st.give(x)
    b = [st.take(8192) for _ in range(4)]  # only the 3 arena buffers came back; the fresh ones were not kept
    arena = {x.ctypes.data for x in a[:3]}
    assert {x.ctypes.data for x in b[:3]} == arena and b[3].ctypes.data not in arena
    b[0][:] = 7  # writable
    assert staging_pool(8192, 0).take(8192).nbytes == 8192


def test_staging_mb_is_validated_and_a_refused_tier_leaves_nothing_open(tmp_path, harnesses):
    """Review finding (2026-11-29): the check came after the pool opened, so a refused tier left the G3 pool's
    threads running and its directory locked (a retry in the process got G3LockedError)."""
    import threading
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(ValueError, match="staging_mb"):
        harnesses([g3_tier(tmp_path / "g3", staging_mb=-1)])
    assert not {t.name for t in threading.enumerate()} - before
    h = harnesses([g3_tier(tmp_path / "g3")])  # the same directory opens again at once
    assert h.tier.pool is not None


def test_io_threads_run_before_the_first_job(tmp_path, harnesses):
    """Every I/O thread of the tier is started at construction, so vLLM's scheduler thread never starts
    one inside submit_store/submit_load (a thread start + GIL hand-off: up to ~4 ms a call measured)."""
    h = harnesses([g3_tier(tmp_path / "g3", io_threads=3)])
    names = sorted(t.name for t in h.tier._executor._threads)
    assert len(names) == 3 and all(n.startswith("kvbm_G3Tier") for n in names), names
    assert all(t.is_alive() for t in h.tier._executor._threads)
    keys = keys_for(4, "t")
    h.store(keys, payloads(h, 4))
    h.wait_idle()
    assert len(h.tier._executor._threads) == 3  # the jobs ran on them: none started later


def _looked_up(tier, ctx, key):
    tier.on_new_request(ctx)
    res = tier.lookup(key, ctx)
    for _ in range(POLLS):
        if res is not LookupResult.RETRY:
            break
        tier.on_schedule_end(ScheduleEndContext((), ()))
        time.sleep(0.002)
        res = tier.lookup(key, ctx)
    tier.on_request_finished(ctx)
    return res


def test_revision_key_separates_engines_sharing_g3(tmp_path, harnesses):
    """The tier's ``revision`` key is the namespace's revision (vLLM hands tiers no --revision/--quantization):
    chunks stored under one revision are misses for a tier of another on the same G3 paths, hits for the same."""
    h = harnesses([g3_tier(tmp_path / "g3", revision="int8-w")])
    assert h.tier.namespace.revision == "int8-w"
    keys, data = keys_for(2, "rev"), payloads(h, 2, seed=3)
    h.store(keys, data)
    h.wait_idle()
    h.shutdown()
    other = harnesses([g3_tier(tmp_path / "g3", revision="bf16-w")])
    assert _looked_up(other.tier, other.context(), keys[0]) is LookupResult.MISS
    other.shutdown()
    same = harnesses([g3_tier(tmp_path / "g3", revision="int8-w")])
    assert _looked_up(same.tier, same.context(), keys[0]) is LookupResult.HIT
    got = same.load(keys)
    assert len(got) == 2 and all(np.array_equal(a, b) for a, b in zip(got, data))


def test_a_chunk_lookup_counts_once_at_any_tp_size(tmp_path, harnesses):
    """At TP=2 a chunk is two blocks (one per rank's copy); its lookup counts once in kvbm_matched_tokens and
    the G3 hit rate (review finding, 2026-11-29: each copy counted, twice the tokens at TP=2)."""
    from kvbm_backend import metrics
    h = harnesses([g3_tier(tmp_path / "g3")], world_size=2)
    assert h.tier.geometry.copies == 2
    keys, data = keys_for(3, "tp2"), payloads(h, 3)
    h.store(keys[:2], data[:2])
    h.wait_idle()
    before = metrics.sample_value(None, "kvbm_matched_tokens_total") or 0.0
    tier, ctx = h.tier, h.context()
    tier.on_new_request(ctx)
    results = _resolve(tier, ctx, keys)
    assert [results[k] for k in keys] == [LookupResult.HIT, LookupResult.HIT, LookupResult.MISS]
    tier.on_request_finished(ctx)
    got = metrics.sample_value(None, "kvbm_matched_tokens_total") - before
    assert got == 2 * GEO["tokens_per_block"], got  # two chunks of one 16-token block each, not four
    st = tier.pool.stats()
    assert (st["lookup_blocks"], st["lookup_hits"]) == (3, 2), st


# ---- verdicts per tenant, what a store publishes, jobs that raise (review of 2026-11-29) -------------------------
def _tenant(name: str) -> dict:
    return {"kvbm_tenant": name}


def test_lookup_verdicts_are_per_tenant(tmp_path, harnesses):
    """vLLM's lookup manager caches one verdict per key for as long as a request refers to it, and our tiers key a
    chunk's blocks by tenant too (``kvbm_tenant``). A tenant holding the chunk gets its hit while another tenant's
    request for the same chunk (a miss) is alive, and the other tenant never gets the holder's hit (before: the
    first asker's verdict answered every tenant)."""
    h = harnesses([g3_tier(tmp_path / "g3")])
    keys = keys_for(1, "shared-system-prompt")
    h.store(keys, payloads(h, 1), ctx=h.context(kv_transfer_params=_tenant("alice")))
    h.wait_idle()
    tier = h.tier
    bob, alice, bob2 = (h.context(n, _tenant(t)) for n, t in (("bob", "bob"), ("alice", "alice"), ("bob2", "bob")))
    for c in (bob, alice, bob2):
        tier.on_new_request(c)
    assert _resolve(tier, bob, keys)[keys[0]] is LookupResult.MISS
    assert _resolve(tier, alice, keys)[keys[0]] is LookupResult.HIT  # bob's live miss is not alice's
    assert _resolve(tier, bob2, keys)[keys[0]] is LookupResult.MISS  # alice's live hit is not bob's
    for c in (bob, alice, bob2):
        tier.on_request_finished(c)


def test_a_failed_load_forces_a_miss_for_its_tenant_only(tmp_path, harnesses):
    """Alice's copy of a chunk is corrupt, Bob's is good: Alice's failed load makes her verdict a miss (no promotion
    livelock) and leaves Bob's live hit as it was (before: the failure forced every tenant's shared verdict)."""
    h = harnesses([g3_tier(tmp_path / "g3")])
    keys, data = keys_for(1, "both"), payloads(h, 1, seed=5)
    for t in ("alice", "bob"):
        h.store(keys, data, ctx=h.context(kv_transfer_params=_tenant(t)))
        h.wait_idle()
        h.reset_primary()
    tier = h.tier
    fi, si = tier.pool.index.get(tier._block_keys(keys[0], "alice")[0])
    fd = os.open(tier.pool.slabs.by_index[fi].path, os.O_RDWR)
    try:
        off = si * tier.pool.slot_bytes + HEADER_BYTES + 100
        os.pwrite(fd, bytes([os.pread(fd, 1, off)[0] ^ 0xFF]), off)
        os.fsync(fd)
    finally:
        os.close(fd)
    bob = h.context("bob-live", _tenant("bob"))
    tier.on_new_request(bob)
    assert _resolve(tier, bob, keys)[keys[0]] is LookupResult.HIT
    assert h.load(keys, ctx=h.context(kv_transfer_params=_tenant("alice")), timeout=HANG_S) == []
    assert tier.kvbm_stats()["tier"]["chunks_load_failed"] == 1
    assert tier.lookup(keys[0], bob) is LookupResult.HIT
    tier.on_request_finished(bob)
    got = h.load(keys, ctx=h.context(kv_transfer_params=_tenant("bob")), timeout=HANG_S)
    assert len(got) == 1 and np.array_equal(got[0], data[0])


def test_chunks_the_pool_did_not_take_are_not_published_stored(tmp_path, harnesses):
    """An operator's ``g3.admission`` policy (``frequency``; the tiers default to ``all``) refuses a first sighting:
    the chunk is counted skipped, not stored, and is not published as a KV 'stored' event (before: the router was
    told of chunks G3 does not hold, and each was kept for a removal event that never came). The second sighting
    is admitted, stored and published."""
    spec = g3_tier(tmp_path / "g3", enable_kv_events=True)
    spec["g3"]["admission"] = {"policy": "frequency"}
    h = harnesses([spec], enable_kv_cache_events=True)
    keys, data = keys_for(8, "adm"), payloads(h, 8)
    h.store(keys, data)
    h.wait_idle()
    st = h.tier.kvbm_stats()
    assert st["pool"]["offloads_skipped_admission"] == 8, st["pool"]
    assert (st["tier"]["chunks_stored"], st["tier"]["chunks_skipped"], st["tier"]["stores_failed"]) == (0, 8, 0)
    assert [e for e in h.manager.take_events() if e.medium is Medium.STORAGE] == []
    assert len(h.tier._held) == 0
    h.reset_primary()  # vLLM's CPU tier forgets them: the next store reaches the tier again
    h.store(keys, data)
    h.wait_idle()
    stored = [e for e in h.manager.take_events() if e.medium is Medium.STORAGE]
    assert sorted(k for e in stored for k in e.keys) == sorted(keys)
    assert h.tier.kvbm_stats()["tier"]["chunks_stored"] == 8


def _finished(tier, n: int) -> dict:
    out: dict = {}
    for _ in range(POLLS):
        out.update({r.job_id: r.success for r in tier.get_finished_jobs()})
        if len(out) >= n:
            return out
        time.sleep(0.002)
    raise AssertionError(f"jobs not finished: {out}")


def test_a_chunk_another_job_is_still_writing_is_not_published_by_the_second(tmp_path, harnesses, monkeypatch):
    """The same chunk cascaded twice while the first write is in flight: the second job is not told 'stored' by a
    write that is not durable yet (publish after durable), and when that write then fails nothing was published."""
    import errno
    import threading

    from vllm.v1.kv_offload.tiering.base import TransferJob

    from kvbm_backend.pool.g3 import G3Pool
    h = harnesses([g3_tier(tmp_path / "g3", enable_kv_events=True)], enable_kv_cache_events=True)
    tier = h.tier
    gate = threading.Event()

    def held_then_failing_sync(fd):
        gate.wait(HANG_S)
        raise OSError(errno.EIO, "test: fdatasync failed")

    monkeypatch.setattr(G3Pool, "_fdatasync", staticmethod(held_then_failing_sync))
    key = keys_for(1, "dup")
    h.primary[3, :h.chunk_bytes] = 7
    ctx = h.context()
    tier.submit_store(TransferJob(101, key, np.array([3]), False, ctx))
    for _ in range(POLLS):  # the first job's write is in flight (its flush held at the gate)
        if tier.pool.writer._inflight:
            break
        time.sleep(0.002)
    try:
        assert tier.pool.writer._inflight
        tier.submit_store(TransferJob(102, key, np.array([3]), False, ctx))  # the same chunk cascaded again
        assert _finished(tier, 1) == {102: True}  # skipped: another job writes it
        assert [e for e in tier.take_events() if not e.removed] == []  # not durable yet: not published
    finally:
        gate.set()
    assert _finished(tier, 1) == {101: False}
    assert [e for e in tier.take_events()] == [] and len(tier._held) == 0
    assert not tier.pool.contains(tier._block_keys(key[0], tier._tenant)[0])
    st = tier.kvbm_stats()["tier"]
    assert (st["chunks_stored"], st["chunks_skipped"], st["stores_failed"]) == (0, 1, 1), st


def test_jobs_that_raise_are_counted_and_say_why(tmp_path, harnesses, monkeypatch, caplog):
    """A job past ``job_timeout_s`` (the pool did not answer: a flush or a read held) is counted in the tier's own
    counters like a job that ended with failed blocks, and the warning names the bound (before: not counted, so
    ``kvbm_stats`` showed no failure during the stalls an operator needs to see, and the reason was blank)."""
    import threading
    from concurrent.futures import Future

    from kvbm_backend.pool.g3 import G3Pool
    h = harnesses([g3_tier(tmp_path / "g3", job_timeout_s=0.5)])
    tier = h.tier
    keys, data = keys_for(3, "t"), payloads(h, 3)
    h.store(keys[:1], data[:1])
    h.wait_idle()
    gate = threading.Event()
    real_sync = G3Pool._fdatasync

    def held_sync(fd):
        gate.wait(HANG_S)
        real_sync(fd)

    monkeypatch.setattr(G3Pool, "_fdatasync", staticmethod(held_sync))
    try:
        with caplog.at_level("WARNING", logger="kvbm_backend.integrations.vllm.tiering"):
            h.store(keys[1:], data[1:])
            h.wait_idle(timeout=HANG_S)
    finally:
        gate.set()
    st = tier.kvbm_stats()["tier"]
    assert (st["stores"], st["stores_failed"], st["chunks_stored"]) == (2, 1, 1), st
    assert "job_timeout_s (0.5 s)" in caplog.text and "store of 2 chunks" in caplog.text, caplog.text
    engine, real_submit = tier.pool.engine, tier.pool.engine.submit
    reads = threading.Event()

    def held_submit(ops):  # the disk answers no read until the test is done with the timed-out load
        ops = list(ops)
        if not ops or ops[0].write:
            return real_submit(ops)
        out: Future = Future()

        def later():
            reads.wait(HANG_S)
            try:
                out.set_result(real_submit(ops).result())
            except BaseException as e:  # noqa: BLE001
                out.set_exception(e)

        threading.Thread(target=later, daemon=True).start()
        return out

    monkeypatch.setattr(engine, "submit", held_submit)
    h.reset_primary()
    try:
        with caplog.at_level("WARNING", logger="kvbm_backend.integrations.vllm.tiering"):
            assert h.load(keys[:1], timeout=HANG_S) == []
    finally:
        reads.set()
    st = tier.kvbm_stats()["tier"]
    assert (st["loads"], st["loads_failed"], st["chunks_load_failed"]) == (1, 1, 1), st
    assert "load of 1 chunks" in caplog.text, caplog.text


def test_a_tier_decides_its_namespace_as_the_connector_and_says_so(tmp_path, harnesses, caplog):
    """The native tiers take model and revision from the connector's functions (namespaces.namespace_model /
    namespace_revision: one rule for both forms): a config ``model`` that is not vLLM's model name is one WARNING
    naming both; the start-up line names the namespace in use (model, the tier's ``revision`` key, fingerprint),
    not the config's (review finding 2026-12-01: it printed ``<config model>@<config revision>``)."""
    import logging
    caplog.set_level(logging.INFO, logger="kvbm_backend")
    h = harnesses([g3_tier(tmp_path / "g3", revision="int8-w", config={"model": "org/pinned-model"})],
                  model="org/served-model")
    ns = h.tier.namespace
    assert (ns.model, ns.revision) == ("org/pinned-model", "int8-w")
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "org/pinned-model" in
              r.getMessage()]
    assert len(warned) == 1 and "'org/served-model'" in warned[0], caplog.text
    lines = [r.getMessage() for r in caplog.records if "kvbm_backend tiers open" in r.getMessage()]
    assert len(lines) == 1 and f"model=org/pinned-model@int8-w namespace={ns.fingerprint};" in lines[0], lines
