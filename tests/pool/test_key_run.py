"""The scheduler's key runs (:class:`~kvbm_backend.model.namespace.KeyRun`: one namespace, tenant and TP rank,
the sequence hashes in a uint64 array) against lists of BlockKeys: every pool the scheduler asks (a real G3
pool, the scheduler's G3 mirror, G4 on the in-process ``mem://`` store) gives the same prefix length from
both, on random namespaces, tenants and ranks, for full, partial and empty prefixes, runs of another
namespace and runs of another tenant. No mocks; G3 writes real slab files in a temporary directory.
"""
from __future__ import annotations

import os
import random
from array import array

import numpy as np
import pytest

from kvbm_backend.config import G4Config
from kvbm_backend.integrations.vllm.g3_mirror import G3Mirror
from kvbm_backend.integrations.vllm.metadata import KvbmWorkerMeta, mirror_id
from kvbm_backend.memory import aligned_empty
from kvbm_backend.metrics import new_registry
from kvbm_backend.model.layout import KvLayout
from kvbm_backend.model.namespace import BlockKey, KeyRun, Namespace, SeqHashes
from kvbm_backend.pool import open_pool
from tests.helpers.pools import G4_TIMEOUT_S, TINY_LAYOUT, g3_config

LAYOUT = TINY_LAYOUT
TENANTS = ["", "alice", "bob"]
HANG_S = 600.0  # a hang guard, not a bound (the waits below were 5-60 s: the busy CI VM froze processes 13-31 s)


def _namespaces(rng: random.Random) -> list[Namespace]:
    return [Namespace(f"keyrun/model-{i}-{rng.getrandbits(32):x}", LAYOUT, tp_world_size=rng.choice([1, 2, 4]))
            for i in range(2)]


def _cases(rng: random.Random, nss: list[Namespace], seqs: dict, stored: dict, length: int):
    """(namespace, tenant, rank, hashes) to look up: the stored runs' full and partial prefixes (a miss
    at a random block, the stored part ending early), empty, another namespace's and another tenant's
    runs over the same hashes, and fresh hashes."""
    out = []
    for (ns_i, t, r), hs in seqs.items():
        ns = nss[ns_i]
        have = stored[(ns_i, t, r)]
        out.append((ns, t, r, hs[:have]))  # all present
        out.append((ns, t, r, hs))  # present up to `have`
        if have:
            at = rng.randrange(have)
            out.append((ns, t, r, hs[:at] + [rng.getrandbits(64)] + hs[at + 1:have]))  # one absent block
        out.append((ns, t, r, []))
        out.append((nss[1 - ns_i], t, r % nss[1 - ns_i].tp_world_size, hs))  # another namespace
        out.append((ns, rng.choice([x for x in TENANTS if x != t] + ["carol"]), r, hs))  # another tenant
        out.append((ns, t, r, [rng.getrandbits(64) for _ in range(rng.randrange(1, length))]))
    return out


def _data(seed: int, length: int):
    rng = random.Random(seed)
    nss = _namespaces(rng)
    seqs, stored = {}, {}
    for ns_i, ns in enumerate(nss):
        for t in rng.sample(TENANTS, 2):
            r = rng.randrange(ns.tp_world_size)
            hs = [rng.getrandbits(64) for _ in range(length)]
            seqs[(ns_i, t, r)] = hs
            stored[(ns_i, t, r)] = rng.choice([0, 1, length // 3, length - 1, length])
    return rng, nss, seqs, stored


def _same_from_both(lookup, cases) -> None:
    """Each case's prefix length from its BlockKey list equals the one from its KeyRun, built from a list
    of ints and from the ``array('Q')`` the scheduler hashes into."""
    for ns, t, r, hs in cases:
        run = ns.run(hs, t, r)
        assert isinstance(run, KeyRun) and len(run) == len(hs)
        want = lookup(ns.keys(hs, t, r))
        assert lookup(run) == want, (ns.model, t, r, len(hs))
        assert lookup(ns.run(array("Q", hs), t, r)) == want, (ns.model, t, r, len(hs), "array('Q')")


@pytest.mark.parametrize("seed", range(2))
def test_g3_pool_gives_the_same_prefix_for_a_key_run_and_its_keys(tmp_path, seed):
    """A real G3 pool per namespace (the compact index): runs longer than the index's first chunk (512)."""
    length = 800
    rng, nss, seqs, stored = _data(seed, length)
    pools = [open_pool(g3_config(tmp_path / f"g3-{i}", capacity_gb=0.06), ns, registry=new_registry())
             for i, ns in enumerate(nss)]
    try:
        blk = aligned_empty(LAYOUT.bytes_per_block)
        blk[:] = 7
        for (ns_i, t, r), hs in seqs.items():
            keys = nss[ns_i].keys(hs[:stored[(ns_i, t, r)]], t, r)
            if keys:
                assert pools[ns_i].put(keys, [blk] * len(keys)).result(HANG_S).written == len(keys)
        for ns_i, p in enumerate(pools):
            assert p.flush(HANG_S)
            _same_from_both(lambda k, p=p: p.lookup_prefix(k).result(HANG_S),
                            [c for c in _cases(rng, nss, seqs, stored, length) if c[0] is nss[ns_i]])
            for (ns_j, t, r), hs in seqs.items():  # and the numbers are the right ones
                if ns_j == ns_i:
                    assert p.lookup_prefix(nss[ns_i].run(hs, t, r)).result(HANG_S) == stored[(ns_j, t, r)]
    finally:
        for p in pools:
            p.close()


@pytest.mark.parametrize("seed", range(3))
def test_g3_mirror_gives_the_same_prefix_for_a_key_run_and_its_keys(seed):
    length = 3000  # past the mirror's first two chunks (512, then 8192 at most)
    rng, nss, seqs, stored = _data(seed, length)
    for ns_i, ns in enumerate(nss):
        m = G3Mirror(ns)
        ids = [mirror_id(k) for (ns_j, t, r), hs in seqs.items() if ns_j == ns_i
               for k in ns.keys(hs[:stored[(ns_j, t, r)]], t, r)]
        m.apply(KvbmWorkerMeta(added=ids, snapshot=True))
        _same_from_both(lambda k, m=m: m.lookup_prefix(k).result(), _cases(rng, nss, seqs, stored, length))
        for (ns_j, t, r), hs in seqs.items():
            if ns_j == ns_i:
                assert m.lookup_prefix(ns.run(hs, t, r)).result() == stored[(ns_j, t, r)]


def test_g4_mem_gives_the_same_prefix_for_a_key_run_and_its_keys(tmp_path):
    length = 40
    rng, nss, seqs, stored = _data(5, length)
    for ns_i, ns in enumerate(nss):
        cfg = G4Config(enabled=True, url=f"mem://keyrun-{os.getpid()}-{tmp_path.name}-{ns_i}", encrypt=False,
                       timeout_s=G4_TIMEOUT_S)
        with open_pool(cfg, ns, registry=new_registry()) as p:
            blk = np.full(LAYOUT.bytes_per_block, 3, np.uint8)
            for (ns_j, t, r), hs in seqs.items():
                keys = ns.keys(hs[:stored[(ns_j, t, r)]], t, ns.shared_rank(r)) if ns_j == ns_i else []
                if keys:
                    assert p.put(keys, [blk] * len(keys)).result(HANG_S).written == len(keys)
            assert p.flush(HANG_S)
            _same_from_both(lambda k: p.lookup_prefix(k).result(HANG_S), _cases(rng, nss, seqs, stored, length))


def test_rank_runs_is_one_run_per_rank_over_one_array():
    """Namespace.rank_runs (what the scheduler's lookups call): one KeyRun per TP rank naming exactly the
    BlockKeys Namespace.keys names, sharing one SeqHashes; G4 gets the distinct shared ranks (MLA: one)."""
    ns = Namespace("keyrun/tp", LAYOUT, tp_world_size=4)
    hs = [0, 1, (1 << 64) - 1, 1 << 63, 12345]
    by_rank, g4 = ns.rank_runs(hs, "alice")
    assert [r.keys() for r in by_rank] == [ns.keys(hs, "alice", r) for r in range(4)] and g4 == by_rank
    assert all(r.hashes is by_rank[0].hashes for r in by_rank)  # converted once for every rank
    assert by_rank[2].seq_hashes.tolist() == hs and by_rank[2][-1] == ns.key(12345, "alice", 2)
    assert [list(r) for r in (by_rank[1][1:3], by_rank[1][5:])] == [ns.keys(hs[1:3], "alice", 1), []]
    mla = Namespace("keyrun/mla", KvLayout(2, 1, 16, 64, "bfloat16"), tp_world_size=4)
    assert [r.rank for r in mla.rank_runs(hs, "")[1]] == [0]


def test_the_schedulers_array_of_hashes_is_copied_once_and_never_converted():
    """The scheduler hashes a prompt into an ``array('Q')`` (sequence_hashes ``into=``) and appends decode
    blocks to it later: a run built from it holds its own uint64 copy (the array stays appendable, the
    run does not change), all of it available at once; the keys are the ones a list of ints names."""
    ns = Namespace("keyrun/array", LAYOUT, tp_world_size=2)
    hs = array("Q", [0, 1, (1 << 64) - 1, 1 << 63, 12345])
    by_rank, _ = ns.rank_runs(hs, "alice")
    assert by_rank[0].hashes._done == len(hs)  # nothing left to convert
    hs.append(7)  # no BufferError: the run holds a copy
    assert len(by_rank[1]) == 5 and by_rank[1].keys() == ns.keys(list(hs)[:5], "alice", 1)
    assert by_rank[1].seq_hashes.tolist() == list(hs)[:5]
    with pytest.raises(ValueError):
        by_rank[0].seq_hashes[0] = 1  # read-only, as for a list's run


def test_a_partial_hit_converts_only_the_first_chunk(tmp_path):
    """The hashes of a run are converted to uint64 only as far as the pools probe: a G3 lookup (compact
    index) and a mirror lookup that miss in their first 512 keys leave the rest of an 8K run unconverted."""
    ns = Namespace("keyrun/lazy", LAYOUT)
    rng = random.Random(1)
    hs = [rng.getrandbits(64) for _ in range(8192)]
    with open_pool(g3_config(tmp_path / "g3", capacity_gb=0.02), ns, registry=new_registry()) as p:
        blk = aligned_empty(LAYOUT.bytes_per_block)
        blk[:] = 1
        assert p.put(ns.keys(hs[:100]), [blk] * 100).result(HANG_S).written == 100 and p.flush(HANG_S)
        m = G3Mirror(ns)
        m.apply(KvbmWorkerMeta(added=[mirror_id(k) for k in ns.keys(hs[:100])], snapshot=True))
        by_rank, _ = ns.rank_runs(hs, "")
        assert p.lookup_prefix(by_rank[0]).result(HANG_S) == 100 == m.lookup_prefix(by_rank[0]).result()
        assert by_rank[0].hashes._done == 512  # the first chunk only
        assert len(by_rank[0].seq_hashes) == 8192 and by_rank[0].hashes._done == 8192


def test_bad_key_runs_are_refused_naming_the_field():
    ns = Namespace("keyrun/bad", LAYOUT, tp_world_size=2)
    with pytest.raises(ValueError, match="rank: 2 outside TP world size 2"):
        ns.run([1], "", 2)
    with pytest.raises(TypeError, match="sequence hashes are ints, got float"):
        _ = ns.run([1, 2.5]).seq_hashes
    with pytest.raises(ValueError, match="seq_hashes: a 1-D uint64 array"):
        SeqHashes(np.zeros(3, np.int64))
    with pytest.raises(ValueError, match="KeyRun.rank"):
        KeyRun(ns.fingerprint, "", -1, SeqHashes([1]))
    with pytest.raises(TypeError, match="KeyRun.hashes"):
        KeyRun(ns.fingerprint, "", 0, [1, 2])
    run = ns.run([-1, 1 << 64 | 5, np.int64(4)])  # taken modulo 2**64, as Namespace.key does
    assert run.keys() == [ns.key(-1), ns.key(1 << 64 | 5), ns.key(4)] == list(run)
    assert run.seq_hashes.tolist() == [(1 << 64) - 1, 5, 4]
    with pytest.raises(ValueError):
        run.seq_hashes[0] = 1  # read-only: a pool may keep probing it
    assert run[1] == BlockKey(ns.fingerprint, "", 0, 5)
    with pytest.raises(IndexError, match="KeyRun index 3"):
        run[3]
    arr = np.array([7, 8], np.uint64)
    assert ns.run(arr, "t", 1).keys() == ns.keys([7, 8], "t", 1)
