"""The scheduler's G3 mirror (integrations/vllm/g3_mirror.py): the numpy fingerprint set against a plain
Python set, namespace and readiness semantics, and memory per entry. No engine, no GPU."""
from __future__ import annotations

import random

import numpy as np

from kvbm_backend.integrations.vllm.g3_mirror import FingerprintSet, G3Mirror, fingerprint
from kvbm_backend.integrations.vllm.metadata import KvbmWorkerMeta, mirror_id
from kvbm_backend.model.namespace import BlockKey, tenant_tag
from kvbm_backend.pool.g3.index import TagKey

NS = "0123456789abcdef"


class _Ns:
    fingerprint = NS


def _check_table(s: FingerprintSet) -> None:
    """Linear-probing invariant: every value is reachable from its home cell without crossing an empty
    cell, and the count matches."""
    occ = np.flatnonzero(s._tab)
    assert len(occ) == len(s)
    assert 2 * len(s) <= len(s._tab)
    home = s._home(s._tab[occ])
    tab, mask = s._tab.tolist(), len(s._tab) - 1
    for p, h in zip(occ.tolist(), home.tolist()):
        q = h
        while q != p:
            assert tab[q] != 0, "empty cell inside a probe path"
            q = (q + 1) & mask


def test_fingerprint_set_matches_a_python_set_on_random_operations():
    rng = random.Random(12)
    s = FingerprintSet()
    ref: set[int] = set()
    universe = [rng.getrandbits(64) or 1 for _ in range(6000)]
    # Small universe of clustered values too: values that share home cells (top bits) stress probing/shifts
    universe += [(h << 60) | rng.getrandbits(8) for h in range(1, 7) for _ in range(20)]
    grown = []
    for step in range(3000):
        op = rng.random()
        batch = [rng.choice(universe) for _ in range(rng.randint(0, 40))]
        if op < 0.55:
            new = len(set(batch) - ref)
            assert s.add(np.array(batch, np.uint64)) == new
            ref.update(batch)
        elif op < 0.9:
            batch += [rng.getrandbits(64) or 1 for _ in range(3)]  # absent ones
            gone = len(set(batch) & ref)
            assert s.remove(np.array(batch, np.uint64)) == gone
            ref.difference_update(batch)
        probe = batch + [rng.choice(universe) for _ in range(20)]
        assert s.contains(np.array(probe, np.uint64)).tolist() == [v in ref for v in probe]
        assert len(s) == len(ref)
        if not grown or grown[-1] != s.capacity:
            grown.append(s.capacity)
        if step % 250 == 0:
            _check_table(s)
    _check_table(s)
    assert sorted(s.values().tolist()) == sorted(ref)
    assert len(grown) >= 3, grown  # grew across several doublings
    # remove everything, then the set is empty and still consistent
    assert s.remove(np.array(sorted(ref), np.uint64)) == len(ref)
    assert len(s) == 0 and not s.values().size
    assert not s.contains(np.array(universe[:100], np.uint64)).any()


def test_fingerprint_set_big_batches_and_zero():
    rng = np.random.default_rng(3)
    vals = rng.integers(1, 2 ** 64, 200_000, dtype=np.uint64, endpoint=False)
    s = FingerprintSet()
    assert s.add(np.concatenate([vals, vals[:1000]])) == len(vals)
    assert s.capacity == 1 << 19 and len(s) == len(vals)
    assert s.contains(vals).all()
    assert s.remove(vals[::2]) == len(vals[::2])
    assert s.contains(vals[1::2]).all() and not s.contains(vals[::2]).any()
    _check_table(s)
    # 0 is the empty marker: taken as 1, never found at an empty cell
    z = FingerprintSet()
    assert not z.contains(np.zeros(3, np.uint64)).any()
    assert z.remove(np.zeros(1, np.uint64)) == 0 and len(z) == 0
    assert z.add(np.zeros(2, np.uint64)) == 1 and z.contains(np.array([1], np.uint64)).all()


def _keys(tenant: str, seqs, rank: int = 0, ns: str = NS) -> list[BlockKey]:
    return [BlockKey(ns, tenant, rank, s) for s in seqs]


def test_mirror_against_a_set_of_mirror_ids():
    rng = random.Random(7)
    m = G3Mirror(_Ns())
    ref: set = set()
    tenants = ["", "a", "b"]
    seqs = [rng.getrandbits(64) for _ in range(400)] + [-5, 1 << 70]  # out-of-width seq hashes too
    ids = [mirror_id(k) for t in tenants for r in (0, 1) for k in _keys(t, seqs, r)]
    for _ in range(600):
        added = [rng.choice(ids) for _ in range(rng.randint(0, 30))]
        removed = [rng.choice(ids) for _ in range(rng.randint(0, 10))]
        m.apply(KvbmWorkerMeta(added=added, removed=removed))
        ref.difference_update(removed)
        ref.update(added)  # removed first, then added
        assert len(m) == len(ref)
        t, r = rng.choice(tenants), rng.randint(0, 1)
        a = rng.randrange(len(seqs))
        keys = _keys(t, seqs[a:a + rng.randint(0, 300)], r)
        want = 0
        for k in keys:
            if mirror_id(k) not in ref:
                break
            want += 1
        assert m.lookup_prefix(keys).result() == want
    st = m.stats()
    assert st["tier"] == "G3" and st["mirror"] and st["blocks"] == len(ref) and st["bytes"] > 0


def test_mirror_remove_then_add_in_one_report():
    m = G3Mirror(_Ns())
    ids = [mirror_id(k) for k in _keys("t", range(1, 6))]
    m.apply(KvbmWorkerMeta(added=ids))
    m.apply(KvbmWorkerMeta(added=ids[:1], removed=ids[:2]))
    assert len(m) == 4
    assert m.lookup_prefix(_keys("t", range(1, 6))).result() == 1


def test_mirror_namespace_and_readiness():
    m = G3Mirror(_Ns())
    assert not m.ready and len(m) == 0 and m.tier == "G3"
    keys = _keys("t", range(100, 400))
    assert m.lookup_prefix(keys).result() == 0
    m.apply(KvbmWorkerMeta(added=[mirror_id(k) for k in keys]))
    assert not m.ready  # only a snapshot report marks it ready
    assert m.lookup_prefix(keys).result() == 300
    assert m.lookup_prefix(iter(keys)).result() == 300  # any iterable
    assert m.lookup_prefix([]).result() == 0
    # a key of another namespace stops the prefix, even if its (tag, rank, seq) is mirrored
    other = _keys("t", range(100, 400), ns="fedcba9876543210")
    assert m.lookup_prefix(other).result() == 0
    assert m.lookup_prefix(keys[:150] + other[150:]).result() == 150
    # tenant and rank are part of the identity
    assert m.lookup_prefix(_keys("u", range(100, 400))).result() == 0
    assert m.lookup_prefix(_keys("t", range(100, 400), rank=1)).result() == 0
    # a restored tag-only id (tag from the journal) matches its tenant's BlockKey
    tag = tenant_tag("salted")
    m.apply(KvbmWorkerMeta(added=[(tag, 0, 9)], snapshot=True))
    assert m.ready
    assert m.lookup_prefix(_keys("salted", [9, 10])).result() == 1
    assert fingerprint(tag, 0, 9) == fingerprint(*mirror_id(BlockKey(NS, "salted", 0, 9)))
    assert m.lookup_prefix([TagKey(NS, tag, 0, 9), BlockKey(NS, "salted", 0, 9)]).result() == 2
    assert m.lookup_prefix([TagKey("fedcba9876543210", tag, 0, 9)]).result() == 0
    # a miss in a late chunk (past the first 64 and 256 keys)
    m.apply(KvbmWorkerMeta(removed=[mirror_id(keys[290])]))
    assert m.lookup_prefix(keys).result() == 290
    m.close()


def test_memory_per_entry_at_1m_entries():
    s = FingerprintSet()
    rng = np.random.default_rng(1)
    n = 1_000_000
    s.add(rng.integers(1, 2 ** 64, n, dtype=np.uint64, endpoint=False))
    assert len(s) > n - 10  # 64-bit random values: duplicates are vanishingly rare
    per = s.nbytes / len(s)
    assert per < 40, per
    # the mirror reports the same bytes
    m = G3Mirror(_Ns())
    m._set = s
    assert m.stats()["bytes"] == s.nbytes


def test_vectorised_fingerprints_match_fingerprint():
    """The one-pass numpy fingerprints of reports and of lookup keys equal fingerprint() of each id,
    also for mixed tenants, tags, ranks and out-of-range values; one tenant and rank never collide."""
    from kvbm_backend.integrations.vllm.g3_mirror import _fps_of_ids, _fps_of_keys
    rng = random.Random(3)
    tags = [tenant_tag(t) for t in ("", "a", "b")]
    ids = [(rng.choice(tags), rng.choice([0, 1, 7]), rng.getrandbits(64)) for _ in range(3000)]
    assert _fps_of_ids(ids).tolist() == [fingerprint(*i) for i in ids]
    assert _fps_of_ids(ids[:1] * 50).tolist() == [fingerprint(*ids[0])] * 50
    odd = ids[:10] + [(tags[0], -1, 5), (tags[1], 2 ** 32, 5), (tags[2], 0, 2 ** 64), (tags[0], 0, -3)]
    assert _fps_of_ids(odd).tolist() == [fingerprint(*i) for i in odd]
    keys = [BlockKey(NS, rng.choice(["", "a", "b"]), rng.choice([0, 1]), rng.getrandbits(64)) for _ in range(2000)]
    keys[100] = TagKey(NS, tenant_tag("a"), 0, 9)
    want = [fingerprint(*mirror_id(k)) for k in keys]
    assert _fps_of_keys(keys, NS).tolist() == want
    one = [BlockKey(NS, "a", 0, s) for s in range(1, 5000)]
    assert _fps_of_keys(one, NS).tolist() == [fingerprint(*mirror_id(k)) for k in one]
    assert len(set(_fps_of_keys(one, NS).tolist())) == len(one)
    assert _fps_of_keys(keys[:7] + [BlockKey("fedcba9876543210", "a", 0, 1)] + keys[7:], NS).tolist() == want[:7]


def test_mirror_answers_the_pool_calls_the_connector_shutdown_makes():
    """A scheduler in its own process (vLLM's mp executor: every Dynamo worker on CPU) holds a G3Mirror
    where the worker holds a G3 pool; the connector's shutdown flushes and closes every pool it holds.
    The mirror queues nothing: flush is True at once (it had no flush, and every such shutdown raised
    AttributeError, skipping the scheduler's last counters and its G4 pool's close)."""
    m = G3Mirror(_Ns())
    assert m.flush(timeout=10.0) is True and m.flush() is True
    assert m.stats()["tier"] == "G3"
    m.close()
