"""One contract, every pool: the :class:`~kvbm_backend.pool.base.BlockPool` protocol exercised the same way
against G3 (local files), G4 on a ``file://`` store, G4 on SeaweedFS S3 and G4 on the in-process ``mem://``
store, through ``open_tiers`` as the
integrations open them. A behaviour that differs between the tiers fails here, not in a caller's ``hasattr``.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from kvbm_backend.config import load_config
from kvbm_backend.integrations.tiers import open_tiers
from kvbm_backend.memory import aligned_empty
from kvbm_backend.model.hashing import sequence_hashes
from kvbm_backend.model.namespace import Namespace
from kvbm_backend.pool.base import STATS_CONTRACT, BlockPool, GetResult, PutResult
from tests.helpers.pools import G3_LOAD_S, G4_TIMEOUT_S, TINY_LAYOUT

LAYOUT = TINY_LAYOUT
NS = Namespace("conformance/model", LAYOUT)
OTHER = Namespace("conformance/other-model", LAYOUT)
N = 6
HANG_S = 600.0  # a hang guard, not a bound: waits for a result that must come (was 10 and 30 s)


def _cfg(kind: str, tmp_path, seaweed=None):
    # the contract, not the serving bounds (5 s / 2 s by default): a read the busy CI VM freezes is no miss here
    g3 = {"enabled": kind == "g3", "paths": [str(tmp_path / "g3")], "capacity_gb": 0.05, "files_per_path": 1,
          "admission": {"policy": "all"}, "load_timeout_s": G3_LOAD_S}
    g4 = {"enabled": kind != "g3", "encrypt": True, "keyring": {"path": str(tmp_path / "keyring.json")},
          "timeout_s": G4_TIMEOUT_S}
    if kind == "g4-file":
        g4["url"] = f"file://{tmp_path / 'g4'}"
    elif kind == "g4-mem":
        g4["url"] = f"mem://conformance-{os.getpid()}-{tmp_path.name}"
    elif kind == "g4-s3":
        g4.update(url=seaweed.url(f"conformance-{os.getpid()}-{tmp_path.name}"), endpoint_url=seaweed.endpoint)
    return load_config({"g3": g3, "g4": g4}, use_env=False)


@pytest.fixture(params=["g3", "g4-file", pytest.param("g4-s3", marks=pytest.mark.s3), "g4-mem"])
def pool(request, tmp_path):
    seaweed = request.getfixturevalue("seaweed") if request.param == "g4-s3" else None
    g3, g4 = open_tiers(_cfg(request.param, tmp_path, seaweed), NS)
    p = g3 if request.param == "g3" else g4
    assert p is not None and (g3 is None or g4 is None)
    yield p
    p.close()


def _blocks(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        b = aligned_empty(LAYOUT.bytes_per_block)
        b[:] = rng.integers(0, 256, LAYOUT.bytes_per_block, dtype=np.uint8)
        out.append(b)
    return out


def _keys(ns: Namespace, n: int = N, start: int = 0):
    return ns.keys(sequence_hashes(list(range(start, start + n * LAYOUT.page_size)), LAYOUT.page_size))


def _empty(n: int, fill: int = 0xAB) -> list[np.ndarray]:
    out = []
    for _ in range(n):
        b = aligned_empty(LAYOUT.bytes_per_block)
        b[:] = fill
        out.append(b)
    return out


def test_pool_is_a_blockpool_bound_to_its_namespace(pool):
    assert isinstance(pool, BlockPool)
    assert pool.tier in ("G3", "G4")
    assert pool.namespace == NS and pool.layout == LAYOUT


def test_put_then_lookup_and_get_round_trip(pool):
    keys, data = _keys(NS), _blocks(N)
    r = pool.put(keys, data).result(HANG_S)
    assert isinstance(r, PutResult) and (r.written, r.dropped) == (N, 0)
    assert pool.lookup_prefix(keys).result(HANG_S) == N
    out = _empty(N)
    g = pool.get(keys, out).result(HANG_S)
    assert isinstance(g, GetResult) and g.ok == [True] * N and g.prefix_hits == N
    assert all(np.array_equal(a, b) for a, b in zip(out, data))


def test_a_second_put_of_the_same_blocks_is_skipped(pool):
    keys, data = _keys(NS), _blocks(N)
    assert pool.put(keys, data).result(HANG_S).written == N
    r = pool.put(keys, data).result(HANG_S)
    assert (r.written, r.skipped, r.dropped) == (0, N, 0)


def test_absent_keys_are_misses_and_leave_buffers_untouched(pool):
    keys = _keys(NS)
    assert pool.put(keys[:3], _blocks(3)).result(HANG_S).written == 3
    assert pool.lookup_prefix(keys).result(HANG_S) == 3
    out = _empty(N)
    g = pool.get(keys, out).result(HANG_S)
    assert g.ok == [True] * 3 + [False] * 3 and g.prefix_hits == 3
    assert all((b == 0xAB).all() for b in out[3:])


def test_another_namespace_is_a_miss_never_served(pool):
    keys, data = _keys(NS), _blocks(N)
    assert pool.put(keys, data).result(HANG_S).written == N
    foreign = _keys(OTHER)  # same token ids, another model's namespace
    assert pool.lookup_prefix(foreign).result(HANG_S) == 0
    out = _empty(N)
    assert pool.get(foreign, out).result(HANG_S).ok == [False] * N
    assert all((b == 0xAB).all() for b in out)


def test_delete_counts_what_was_there(pool):
    keys = _keys(NS)
    assert pool.put(keys[:4], _blocks(4)).result(HANG_S).written == 4
    assert pool.delete(keys).result(HANG_S) == 4
    assert pool.lookup_prefix(keys).result(HANG_S) == 0
    assert pool.get(keys[:1], _empty(1)).result(HANG_S).ok == [False]


def test_stats_name_the_same_counters(pool):
    keys = _keys(NS)
    assert pool.put(keys[:2], _blocks(2)).result(HANG_S).written == 2
    assert pool.put(keys[:2], _blocks(2)).result(HANG_S).skipped == 2
    pool.get(keys, _empty(N)).result(HANG_S)
    st = pool.stats()
    assert isinstance(st, dict)
    missing = set(STATS_CONTRACT) - set(st)
    assert not missing, f"{pool.tier} stats() lacks {sorted(missing)}: {sorted(st)}"
    assert (st["tier"], st["namespace"]) == (pool.tier, NS.fingerprint)
    assert st["written"] == 2 and st["skipped"] == 2 and st["dropped"] == 0
    assert st["hits"] == 2 and st["misses"] == N - 2 and st["corrupt"] == 0
    assert st["bytes_written"] >= 2 * LAYOUT.bytes_per_block and st["bytes_read"] >= 2 * LAYOUT.bytes_per_block


def _lookup_counts(pool) -> dict:
    """The pool's lookup counters (``lookup*`` in stats) and the matched tokens of its registry."""
    st = pool.stats()
    out = {k: v for k, v in st.items() if k.startswith("lookup") and isinstance(v, (int, float))}
    out["matched_tokens"] = pool.metrics.registry.get_sample_value("kvbm_matched_tokens_total") or 0.0
    return out


def _delta(a: dict, b: dict) -> dict:
    return {k: b.get(k, 0) - a.get(k, 0) for k in set(a) | set(b) if b.get(k, 0) != a.get(k, 0)}


def test_count_lookup_counts_what_a_counted_lookup_counts(pool):
    """``count_lookup(requested, found)`` (a hand-off's wait settles its request's lookup outside the pool) moves the
    pool's lookup counters and ``kvbm_matched_tokens`` as a counted ``lookup_prefix`` with that result does; an
    uncounted one (``request=False``) moves none."""
    keys = _keys(NS)
    assert pool.put(keys[:3], _blocks(3)).result(HANG_S).written == 3
    c0 = _lookup_counts(pool)
    assert pool.lookup_prefix(keys, request=False).result(HANG_S) == 3
    c1 = _lookup_counts(pool)
    assert _delta(c0, c1) == {}
    assert pool.lookup_prefix(keys).result(HANG_S) == 3
    c2 = _lookup_counts(pool)
    counted = _delta(c1, c2)
    assert counted.get("lookup_hits") == 3 and counted.get("matched_tokens") == 3 * LAYOUT.page_size, counted
    pool.count_lookup(N, 3)
    assert _delta(c2, _lookup_counts(pool)) == counted


def test_flush_waits_for_queued_offloads_and_says_whether_it_finished(pool):
    keys = _keys(NS)
    fut = pool.put(keys, _blocks(N))  # not waited on
    assert pool.flush(timeout=HANG_S) is True
    assert fut.done() and fut.result().written == N
    assert pool.lookup_prefix(keys).result(HANG_S) == N
    assert pool.flush(timeout=0) is True  # nothing queued: done at once


def test_a_put_for_another_namespace_stores_nothing(pool):
    """A caller bug (a key of another model's namespace) never lands in this pool: refused with ValueError
    naming both namespaces, before anything is queued."""
    with pytest.raises(ValueError, match="namespace"):
        pool.put(_keys(OTHER, 2), _blocks(2))
    assert pool.flush(timeout=HANG_S) is True
    assert pool.lookup_prefix(_keys(OTHER, 2)).result(HANG_S) == 0
    assert pool.stats()["written"] == 0


def test_open_tiers_opens_only_the_enabled_tiers(tmp_path):
    """``g3.enabled`` / ``g4.enabled``: a disabled tier is None and leaves nothing on disk; G4 enabled
    without a url is refused naming ``g4.url``."""
    g3, g4 = open_tiers(_cfg("g4-file", tmp_path), NS)  # g3.enabled false, g4.enabled true
    try:
        assert g3 is None and g4 is not None and not (tmp_path / "g3").exists()
    finally:
        g4.close()
    g3, g4 = open_tiers(_cfg("g3", tmp_path), NS)  # g3.enabled true, g4.enabled false
    try:
        assert g3 is not None and g4 is None and (tmp_path / "g3").is_dir()
    finally:
        g3.close()
    # refused naming g4.url when the config is loaded (the config model checks g4.url since issue 22 item 3)
    with pytest.raises(ValueError, match=r"^g4\.url: required when g4\.enabled"):
        load_config({"g3": {"enabled": False}, "g4": {"enabled": True, "encrypt": False}}, use_env=False)


def test_open_pool_opens_the_tier_its_config_section_names(tmp_path):
    """``kvbm_backend.pool.open_pool``: the one opener (G3Config -> G3Pool, G4Config -> G4Pool); a disabled
    G4 section is refused naming ``g4.enabled``; the registry reaches the pool."""
    from prometheus_client import CollectorRegistry

    from kvbm_backend.config import G4Config
    from kvbm_backend.pool import open_pool
    from kvbm_backend.pool.g3 import G3Pool
    from kvbm_backend.pool.g4 import G4Pool

    cfg = _cfg("g3", tmp_path)
    with open_pool(cfg.g3, NS) as g3:
        assert isinstance(g3, G3Pool) and isinstance(g3, BlockPool) and g3.namespace == NS
    reg = CollectorRegistry()
    g4cfg = G4Config(enabled=True, url=f"mem://open-pool-{os.getpid()}-{tmp_path.name}", encrypt=False)
    with open_pool(g4cfg, NS, registry=reg) as g4:
        assert isinstance(g4, G4Pool) and g4.tier == "G4" and g4.namespace == NS
        assert reg.get_sample_value("kvbm_g4_written") == 0
    with pytest.raises(ValueError, match=r"g4\.enabled"):
        open_pool(g4cfg.model_copy(update={"enabled": False}), NS)
    with pytest.raises(TypeError, match="G3Config or G4Config"):
        open_pool(cfg, NS)
