"""The compact G3 index (numpy arrays) against the OrderedDict index it replaces: same results, same
LRU order, same TagKey adoption, on random operation sequences (pins, restores, evictions)."""
from __future__ import annotations

import random

import numpy as np
import pytest

from kvbm_backend.model.namespace import BlockKey, tenant_tag
from kvbm_backend.pool.g3 import compact_index as ci
from kvbm_backend.pool.g3.compact_index import CompactLruIndex
from kvbm_backend.pool.g3.index import LruIndex, TagKey

NS, NS2 = "ab" * 8, "cd" * 8
TENANTS = ["", "alice", "bob", "carol"]


def _state(ix):
    return list(ix.items()), len(ix), ix.pinned, ix.deferred


def _universe(rng, n):
    big = [(1 << 64) - 1, 1 << 63, 0, 12345]
    seqs = big + [rng.getrandbits(64) for _ in range(n // 8)]
    return [BlockKey(rng.choice([NS, NS, NS, NS2]), rng.choice(TENANTS), rng.randrange(3), rng.choice(seqs))
            for _ in range(n)]


def _check_table(ix):
    """Every live entry is found from its home; the table holds exactly the live entries."""
    ent, table = ix._ent, ix._table
    live = np.flatnonzero(ent.lp[:ent.hi] >= 0)
    assert len(live) == len(ix) == table.n == int((table.tab != 0).sum())
    for e in live.tolist():
        assert table.find(int(ent.own[e]), int(ent.rank[e]), int(ent.seq[e]))[0] == e


def _tag(k):
    return TagKey(k.namespace, tenant_tag(k.tenant), k.rank, k.seq_hash)


@pytest.fixture(params=[3, 10], ids=["tiny-table", "default-table"])
def table_bits(request, monkeypatch):
    monkeypatch.setattr(ci, "_MIN_TAB_BITS", request.param)  # tiny: dense clusters that wrap around
    return request.param


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_match_the_ordereddict_index(seed, table_bits):
    rng = random.Random(seed)
    keys = sorted(set(_universe(rng, 120)))
    rng.shuffle(keys)
    old, new = LruIndex(), CompactLruIndex(capacity=16)
    slot_no = [0]

    def fresh():
        slot_no[0] += 1
        return (slot_no[0] % 5, slot_no[0])

    # warm restart: tag entries of unknown tenants, "" tags become BlockKeys at once
    restored = rng.sample(keys, 40)
    ents = [(_tag(k) if rng.random() < 0.8 else k, fresh()) for k in restored]
    ents += [(ents[3][0], fresh())]  # a repeated journal key: the last one wins
    if seed % 2:
        for k, s in ents:
            old.restore(k, s)
            new.restore(k, s)
    else:
        old.restore_many(ents)
        new.restore_many(ents)
    assert _state(new) == _state(old)
    pins: list = []
    for step in range(1500):
        op = rng.random()
        k = rng.choice(keys)
        if op < 0.2:
            s = fresh()
            old.put(k, s)
            new.put(k, s)
        elif op < 0.35:
            t = rng.random() < 0.5
            assert new.get(k, touch=t) == old.get(k, touch=t)
        elif op < 0.42:
            assert (k in new) == (k in old)
        elif op < 0.5:
            s = old.get(k) if rng.random() < 0.7 else None
            guard = s if rng.random() < 0.7 else (9, 9)
            assert new.remove(k, guard) == old.remove(k, guard)
        elif op < 0.55:
            assert new.remove(k) == old.remove(k)
        elif op < 0.65:
            s = old.get(k)
            if s is not None:
                assert new.get(k) == s
                old.pin(s)
                new.pin(s)
                pins.append(s)
        elif op < 0.72 and pins:
            s = pins.pop(rng.randrange(len(pins)))
            assert new.unpin(s) == old.unpin(s)
        elif op < 0.8:
            n = rng.randrange(0, 6) if rng.random() < 0.9 else rng.randrange(32, 80)  # bulk path from 32
            assert new.evict(n) == old.evict(n)
            _check_table(new)
        elif op < 0.95:
            a = rng.randrange(len(keys))
            ks = keys[a:a + rng.randrange(0, 30)]
            if rng.random() < 0.3:
                ks = ks + ks[:3]  # repeated keys
            ns = rng.choice([None, NS])
            assert new.lookup_prefix(ks, ns) == old.lookup_prefix(ks, ns)
        else:
            tk = _tag(k)
            assert (tk in new) == (tk in old)
        assert _state(new) == _state(old), step
    while pins:
        s = pins.pop()
        assert new.unpin(s) == old.unpin(s)
    assert new.evict(10 ** 6) == old.evict(10 ** 6)
    assert _state(new) == _state(old) and len(new) == 0


def test_lookup_prefix_touches_in_order_and_stops_at_first_miss():
    ix = CompactLruIndex()
    ks = [BlockKey(NS, "t", 0, i) for i in range(40)]
    for i, k in enumerate(ks):
        ix.put(k, (0, i))
    assert ix.lookup_prefix(ks[10:20] + [BlockKey(NS, "t", 0, 999)] + ks[20:30]) == 10
    assert ix.lookup_prefix(ks[30:40], namespace=NS2) == 0
    assert ix.lookup_prefix(ks[:15] + [BlockKey(NS2, "t", 0, 1)], namespace=NS) == 15
    order = [s[1] for _, s in ix.items()]
    assert order == list(range(20, 40)) + list(range(15, 20)) + list(range(0, 15))
    assert ix.lookup_prefix([BlockKey(NS, "nobody", 0, i) for i in range(20)]) == 0


def test_tag_entries_are_adopted_by_the_real_key():
    ix = CompactLruIndex()
    k = BlockKey(NS, "alice", 0, 7)
    ix.restore(_tag(k), (0, 1))
    ix.restore(_tag(BlockKey(NS, "", 0, 8)), (0, 2))
    ix.restore(_tag(BlockKey(NS, "alice", 0, 9)), (0, 4))
    assert BlockKey(NS, "", 0, 8) in ix  # known tag: a BlockKey at once
    assert [type(x) for x, _ in ix.items()] == [TagKey, BlockKey, TagKey]
    assert _tag(k) in ix and ix.get(k) == (0, 1)
    assert _tag(k) not in ix  # adopted: found by the BlockKey only, and most recently used
    assert [x for x, _ in ix.items()] == [BlockKey(NS, "", 0, 8), _tag(BlockKey(NS, "alice", 0, 9)), k]
    assert ix.remove(k) == (0, 1) and len(ix) == 2
    ix.restore(_tag(k), (0, 3))
    assert [s for _, s in ix.evict(5)] == [(0, 2), (0, 4), (0, 3)] and len(ix) == 0


def test_pinned_slots_are_skipped_by_evict_and_freed_on_last_unpin():
    ix = CompactLruIndex()
    ks = [BlockKey(NS, "", 0, i) for i in range(6)]
    for i, k in enumerate(ks):
        ix.put(k, (1, i))
    ix.pin((1, 0))
    ix.pin((1, 0))
    ix.pin((1, 2))
    assert [s for _, s in ix.evict(2)] == [(1, 1), (1, 3)]
    assert ix.remove(ks[0]) is None and ix.deferred == 1 and ix.pinned == 2
    assert ix.unpin((1, 0)) is None and ix.unpin((1, 0)) == (1, 0) and ix.deferred == 0
    assert ix.unpin((1, 2)) is None and ix.pinned == 0
    assert [s for _, s in ix.evict(10)] == [(1, 2), (1, 4), (1, 5)]


def test_restore_arrays_matches_restore_one_by_one():
    rng = np.random.default_rng(5)
    n = 5000
    tenants = ["", "x", "y"]
    tags = np.frombuffer(b"".join(tenant_tag(tenants[i % 3]) for i in range(n)), np.uint8).reshape(n, 16)
    seqs = rng.integers(0, 2 ** 64, n, dtype=np.uint64)
    seqs[100:200] = seqs[:100]  # repeated keys (same tag where i % 3 agrees): the last one wins
    ranks = rng.integers(0, 2, n)
    files, slots = rng.integers(0, 4, n), np.arange(n)
    a, b = CompactLruIndex(), LruIndex()
    a.restore_arrays(NS, tags, ranks, seqs, files, slots)
    for i in range(n):
        b.restore(TagKey(NS, bytes(tags[i]), int(ranks[i]), int(seqs[i])), (int(files[i]), int(slots[i])))
    assert list(a.items()) == list(b.items()) and len(a) == len(b)
    k = BlockKey(NS, "x", int(ranks[1]), int(seqs[1]))
    assert a.get(k) == b.get(k) and list(a.items()) == list(b.items())
    with pytest.raises(ValueError, match="restore_arrays"):
        a.restore_arrays(NS, tags[:3], ranks, seqs, files, slots)


def test_identity_is_exact_not_hash_only():
    ix = CompactLruIndex()
    ix.put(BlockKey(NS, "a", 0, 5), (0, 1))
    for other in (BlockKey(NS, "b", 0, 5), BlockKey(NS, "a", 1, 5), BlockKey(NS2, "a", 0, 5),
                  BlockKey(NS, "a", 0, 6)):
        assert other not in ix and ix.get(other) is None and ix.remove(other) is None
    assert ix.lookup_prefix([BlockKey(NS, "a", 0, 5)] * 9 + [BlockKey(NS, "b", 0, 5)]) == 9


def test_growth_keeps_every_entry():
    ix = CompactLruIndex(capacity=16)
    ks = [BlockKey(NS, "t%d" % (i % 7), i % 2, i * 0x9E3779B97F4A7C15 % (1 << 64)) for i in range(20000)]
    for i, k in enumerate(ks):
        ix.put(k, (i % 3, i))
    assert len(ix) == 20000 and ix.lookup_prefix(ks) == 20000
    assert [s[1] for _, s in ix.items()] == list(range(20000))
    ev = ix.evict(19990)
    assert [s[1] for _, s in ev] == list(range(19990)) and len(ix) == 10
    assert ix.lookup_prefix(ks[19990:]) == 10 and ix.get(ks[0]) is None
    assert ix.nbytes > 0


def test_bench_index_json(tmp_path):
    import json

    from typer.testing import CliRunner

    from kvbm_backend.apps.cli import app
    r = CliRunner().invoke(app, ["bench", "--tier", "index", "--blocks", "20000", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    c, o = d["compact"]["20000"], d["ordereddict"]["20000"]
    for x in (c, o):
        assert x["entries"] == 20000 and x["bytes_per_block"] > 0 and x["rebuild_s"] > 0
        assert x["prefix_lookup_ms"]["median"] > 0 and x["get_us"] > 0
        assert x["partial_hit_blocks"] == 300 and x["partial_lookup_ms"]["median"] > 0
        assert x["keys_lookup_ms"]["median"] > 0 and x["prefix_lookup_path"].startswith("Namespace.rank_runs")
    m = d["mirror"]["20000"]
    assert m["prefix_lookup_ms"]["median"] > 0 and m["keys_lookup_ms"]["median"] > 0
    assert m["prefix_lookup_path"] == "Namespace.rank_runs(hashes, tenant) -> G3Mirror.lookup_prefix(run).result()"
    assert c["array_bytes"] > 0 and set(d["targets"]) >= {"memory_under_1_gib", "prefix_8k_under_1_ms"}
    for h in (d["sequence_hashes_ms"], d["token_digests_ms"]):
        assert h["blocks"] == 8192 and h["block_tokens"] == 32 and h["min"] > 0 and h["median"] >= h["min"]
    (tmp_path / "index.json").write_text(r.output)  # and the CLI plots it
    p = CliRunner().invoke(app, ["plot", str(tmp_path / "index.json"), "--out", str(tmp_path / "index.png")])
    assert p.exit_code == 0, p.output
    assert (tmp_path / "index.png").stat().st_size > 10_000


def test_bulk_evict_keeps_the_table_consistent(table_bits):
    rng = random.Random(3)
    ix, old = CompactLruIndex(capacity=16), LruIndex()
    ks = [BlockKey(NS, rng.choice(TENANTS), rng.randrange(2), rng.getrandbits(64)) for _ in range(3000)]
    for i, k in enumerate(ks):
        ix.put(k, (0, i))
        old.put(k, (0, i))
    for i in range(0, 3000, 7):
        ix.pin((0, i))
        old.pin((0, i))
    for n in (40, 500, 33, 1200):
        assert ix.evict(n) == old.evict(n)
        _check_table(ix)
        assert list(ix.items()) == list(old.items())
    for i, k in enumerate(ks[:200]):  # freed entries are reused
        ix.put(k, (1, i))
        old.put(k, (1, i))
    _check_table(ix)
    assert list(ix.items()) == list(old.items())


def test_restore_many_into_a_non_empty_index_matches():
    rng = random.Random(9)
    ks = [BlockKey(rng.choice([NS, NS2]), rng.choice(TENANTS), 0, rng.getrandbits(64)) for _ in range(300)]
    a, b = CompactLruIndex(capacity=16), LruIndex()
    first = [(_tag(k), (0, i)) for i, k in enumerate(ks[:200])]
    a.restore_many(first)
    b.restore_many(first)
    a.evict(50)
    b.evict(50)
    again = [(_tag(k), (1, i)) for i, k in enumerate(ks[100:300])] + [(_tag(ks[150]), (2, 0))]
    a.restore_many(again)
    b.restore_many(again)
    assert list(a.items()) == list(b.items()) and len(a) == len(b)
    _check_table(a)
    assert a.lookup_prefix(ks[250:300]) == b.lookup_prefix(ks[250:300]) == 50
    assert list(a.items()) == list(b.items())


def test_reserve_sizes_the_table_once():
    ix = CompactLruIndex()
    ix.put(BlockKey(NS, "", 0, 1), (0, 0))
    ix.reserve(100_000)
    size = ix._table.size
    assert size >= ci._LOAD * 100_000 and ix.get(BlockKey(NS, "", 0, 1)) == (0, 0)
    ks = [BlockKey(NS, "", 0, i) for i in range(2, 100_000, 7)]
    for i, k in enumerate(ks):
        ix.put(k, (0, i + 1))
    ix.restore_many([(k, (1, i)) for i, k in enumerate(ks[:10])])
    assert ix._table.size == size and ix.lookup_prefix(ks) == len(ks)
    fresh = CompactLruIndex()
    fresh.reserve(50_000)
    fresh.restore_many([(k, (0, i)) for i, k in enumerate(ks)])  # a restore keeps the reserved size
    assert fresh._table.size >= ci._LOAD * 50_000 and fresh.lookup_prefix(ks) == len(ks)
    _check_table(fresh)


def test_out_of_range_slots_are_refused_before_any_change():
    ix = CompactLruIndex()
    k = BlockKey(NS, "", 0, 1)
    ix.put(k, (1, 2))
    for bad in ((70000, 1), (0, -1), (0, 1 << 32)):
        with pytest.raises(ValueError, match="field"):
            ix.put(k, bad)
    with pytest.raises(ValueError, match="field"):
        ix.put(BlockKey(NS, "", -1, 1), (0, 0))
    with pytest.raises(ValueError, match="field"):
        ix.restore_many([(BlockKey(NS, "", 0, 5), (1 << 16, 0))])
    assert list(ix.items()) == [(k, (1, 2))]


def test_find_run_matches_the_scalar_probe():
    """The one-owner batch probe of lookup_prefix (HashTable.find_run) finds exactly what find finds, present or
    absent, including keys far from their home cell (a small table at load 1/4: long clusters) and keys
    whose seq matches an entry of another owner or rank."""
    rng = np.random.default_rng(5)
    ix = CompactLruIndex()
    seqs = rng.integers(0, 2 ** 64, 6000, dtype=np.uint64).tolist()
    for i, s in enumerate(seqs):
        ix.put(BlockKey(NS, TENANTS[i % 3], i % 2, s), (0, i))
    probe = np.array(seqs + rng.integers(0, 2 ** 64, 2000, dtype=np.uint64).tolist(), np.uint64)
    for tenant in TENANTS[:3]:
        for rank in (0, 1, 2):
            o = ix._owner_of(BlockKey(NS, tenant, rank, 0))[0]
            want = [ix._table.find(o, rank, q)[0] for q in probe.tolist()]
            assert ix._table.find_run(o, rank, probe).tolist() == want
    _check_table(ix)


def _lookup_one_by_one(ix, keys, namespace=None):
    """The simple path lookup_prefix must equal: get(k, touch=True) key by key until the first miss."""
    i = 0
    for k in keys:
        if (namespace is not None and k.namespace != namespace) or ix.get(k, touch=True) is None:
            break
        i += 1
    return i


def _twin_indexes(runs: dict) -> tuple[CompactLruIndex, CompactLruIndex]:
    """Two equal compact indexes holding the first 1400 keys of every run (the last 100: absent); every
    other key of tenant "alice" restored as a tag entry (until a lookup adopts it)."""
    a, b = CompactLruIndex(), CompactLruIndex()
    slot = 0
    for (t, _), ks in runs.items():
        for k in ks[:1400]:
            slot += 1
            for ix in (a, b):
                if t == "alice" and slot % 2:
                    ix.restore(_tag(k), (slot % 7, slot))
                else:
                    ix.put(k, (slot % 7, slot))
    return a, b


@pytest.mark.parametrize("seed", range(3))
def test_lookup_prefix_matches_the_key_by_key_path(seed):
    """lookup_prefix (first chunk, then the rest; vectorised probes) returns what get(k, touch=True) key by
    key returns and leaves the same LRU order and TagKey adoption, on random prefixes: mixed namespaces,
    tenants and ranks, seq hashes >= 2**63, repeated keys, misses before, at and after the first chunk's
    end, and tag entries (restored, unknown tenant) adopted by the lookup."""
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    seqs = nrng.integers(0, 2 ** 64, 3000, dtype=np.uint64).tolist() + [(1 << 64) - 1, 1 << 63, 0]
    runs = {(t, r): [BlockKey(NS, t, r, s) for s in rng.sample(seqs, 1500)] for t in TENANTS for r in (0, 1)}
    a, b = _twin_indexes(runs)
    first = ci.FIRST_CHUNK
    for case in range(40):
        t, r = rng.choice(list(runs))
        run = runs[(t, r)]
        n = rng.choice([9, 300, first - 1, first, first + 1, first + first // 2 + 1, 1000, 1399])
        start = rng.randrange(0, 1400 - n + 1)
        keys = run[start:start + n]
        kind = case % 6
        if kind == 1:  # a miss somewhere, often around the first chunk's end
            at = rng.choice([0, 1, first - 1, first, first + 1, rng.randrange(n)])
            keys = keys[:at] + [run[1400 + case % 100]] + keys[at:]
        elif kind == 2:  # another tenant or rank from some point on (one key or all the rest)
            at = rng.randrange(n)
            o = runs[rng.choice([k for k in runs if k != (t, r)])]
            keys = keys[:at] + (o[at:at + 1] + keys[at + 1:] if case % 2 else o[at:n])
        elif kind == 3:  # another namespace from some point on
            at = rng.choice([0, first - 1, first, rng.randrange(n)])
            keys = keys[:at] + [k._replace(namespace=NS2) for k in keys[at:]]
        elif kind == 4:  # repeated keys
            keys = keys + keys[: n // 3]
        elif kind == 5:  # a random mix of every run (the vectorised mixed-owner probe)
            keys = [rng.choice(rng.choice(list(runs.values()))) for _ in range(n)]
        for ns in (None, NS) if kind == 3 else (rng.choice([None, NS]),):
            assert a.lookup_prefix(keys, ns) == _lookup_one_by_one(b, keys, ns)
            assert list(a.items()) == list(b.items())
    assert [s for _, s in a.evict(len(a))] == [s for _, s in b.evict(len(b))]


def test_find_many_one_owner_branch_matches_the_scalar_probe():
    """HashTable.find_many with one owner and rank for every key (0-d ``own`` and ``rank``: its scalar-mix branch)
    finds exactly what _find finds and what its per-key-array branch finds: present keys, absent keys,
    keys evicted (their cells shifted back), an absent owner (-1: nothing found), and seq hashes held by
    another owner or rank at the same home cell (found first on the probe path: only the owner and rank
    comparison tells them apart)."""
    from kvbm_backend.pool.g3.compact_table import _mix_v
    rng = np.random.default_rng(7)
    ix = CompactLruIndex()
    ix.reserve(8000)  # the table size is fixed from here (the crafted home collisions below stay valid)
    seqs = rng.integers(0, 2 ** 64, 5000, dtype=np.uint64).tolist()
    for i, s in enumerate(seqs):
        ix.put(BlockKey(NS, TENANTS[i % 3], i % 2, s), (0, i))
    oa, ob = (ix._owner_of(BlockKey(NS, t, 0, 0))[0] for t in TENANTS[:2])
    cand = rng.integers(0, 2 ** 64, 2_000_000, dtype=np.uint64)
    one = np.ones(len(cand), np.int64)

    def home(o, r):
        return _mix_v(o * one, r * one, cand) >> np.uint64(ix._table.shift)
    ha = home(oa, 0)
    own_coll = cand[ha == home(ob, 0)][:20].tolist()  # (alice, 0, s) and (bob, 0, s): one home cell
    rank_coll = cand[ha == home(oa, 1)][:20].tolist()  # (alice, 0, s) and (alice, 1, s): one home cell
    assert len(own_coll) == len(rank_coll) == 20
    for j, (s1, s2) in enumerate(zip(own_coll, rank_coll)):
        ix.put(BlockKey(NS, TENANTS[1], 0, s1), (1, j))  # the other owner first: at the home cell
        ix.put(BlockKey(NS, TENANTS[0], 1, s2), (2, j))  # the other rank first
        if j % 2:  # then the key itself (further along the probe path), or never (a miss)
            ix.put(BlockKey(NS, TENANTS[0], 0, s1), (3, j))
            ix.put(BlockKey(NS, TENANTS[0], 0, s2), (4, j))
    gone = {(k.tenant, k.rank, k.seq_hash) for k, _ in ix.evict(1200)}  # bulk path: cells shifted back
    probe = np.array(seqs + own_coll + rank_coll + rng.integers(0, 2 ** 64, 1500, dtype=np.uint64).tolist(),
                     np.uint64)
    n = len(probe)
    for tenant in TENANTS[:3]:
        for rank in (0, 1, 2):
            o = ix._owner_of(BlockKey(NS, tenant, rank, 0))[0]
            want = [ix._table.find(o, rank, q)[0] for q in probe.tolist()]
            got = ix._table.find_many(np.int64(o), np.int64(rank), probe.copy())
            assert got.tolist() == want
            per_key = ix._table.find_many(np.full(n, o, np.int64), np.full(n, rank, np.int64), probe.copy())
            assert per_key.tolist() == want
            for q, e in zip(probe.tolist(), want):
                if e >= 0:
                    assert (int(ix._ent.seq[e]), int(ix._ent.own[e]), int(ix._ent.rank[e])) == (q, o, rank)
                    assert (tenant, rank, q) not in gone
            if o >= 0 and rank < 2:
                assert sum(e >= 0 for e in want) > 500  # the branch is exercised with hits, not only misses
    got = ix._table.find_many(np.int64(oa), np.int64(0), np.array(own_coll + rank_coll, np.uint64)).tolist()
    assert [e >= 0 for e in got] == [bool(j % 2) for j in range(20)] * 2  # the key itself, or a miss
    assert (ix._table.find_many(np.int64(-1), np.int64(0), probe) == -1).all()
    _check_table(ix)


@pytest.mark.parametrize("seed", range(3))
def test_key_run_lookup_matches_the_key_by_key_path(seed):
    """lookup_prefix of a KeyRun (probed from its uint64 array) returns what get(k, touch=True) key by key
    over the same BlockKeys returns and leaves the same LRU order and TagKey adoption: full, partial
    (misses before, at and after the first chunk's end), empty, a tenant never seen, another namespace
    (the run's or the caller's), seq hashes >= 2**63."""
    from kvbm_backend.model.namespace import KeyRun, SeqHashes
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    seqs = nrng.integers(0, 2 ** 64, 3000, dtype=np.uint64).tolist() + [(1 << 64) - 1, 1 << 63, 0]
    runs = {(t, r): rng.sample(seqs, 1500) for t in TENANTS for r in (0, 1)}
    a, b = _twin_indexes({(t, r): [BlockKey(NS, t, r, s) for s in ss] for (t, r), ss in runs.items()})
    first = ci.FIRST_CHUNK
    for case in range(60):
        t, r = rng.choice(list(runs))
        ss = runs[(t, r)]
        n = rng.choice([0, 1, 8, 9, 300, first - 1, first, first + 1, first + first // 2 + 1, 1000, 1399])
        start = rng.randrange(0, 1400 - n + 1)
        hs = ss[start:start + n]
        kind = case % 5
        if kind == 1 and n:  # a miss somewhere, often around the first chunk's end
            at = rng.choice([0, 1, first - 1, first, first + 1, rng.randrange(n)])
            hs = hs[:at] + [ss[1400 + case % 100]] + hs[at:]
        ns, tenant, want_ns = NS, t, rng.choice([None, NS])
        if kind == 2:
            tenant = "never-seen"
        elif kind == 3:
            ns = NS2  # the run's namespace is not the caller's (or, without one, holds nothing)
        elif kind == 4:
            want_ns = NS2
        run = KeyRun(ns, tenant, r, SeqHashes(hs))
        assert run.keys() == [BlockKey(ns, tenant, r, h) for h in hs] == list(run)
        got = a.lookup_prefix(run, want_ns)
        assert got == _lookup_one_by_one(b, run.keys(), want_ns)
        if kind == 0:
            assert got == n
        assert list(a.items()) == list(b.items())
    assert [s for _, s in a.evict(len(a))] == [s for _, s in b.evict(len(b))]


@pytest.mark.parametrize("n", [3, 8, 9, 40, 700])
@pytest.mark.parametrize("bad", [("seq", -1), ("seq", 1 << 64), ("seq", 1.5), ("seq", 2.0), ("rank", -1),
                                 ("rank", 1 << 32), ("rank", 1 << 63), ("rank", 1.5), ("rank", 1.0)])
def test_a_key_no_entry_can_have_ends_the_prefix_like_the_reference(n, bad):
    """A key with a seq_hash outside [0, 2**64) or not an int (or such a rank) is held by no entry: the prefix
    ends there, at any position. Before, the compact index's batch path (> 8 keys) raised OverflowError (-1,
    2**64) and truncated a float onto another key (1.5 -> key 1, held: a hit for a key never stored); the <= 8
    path raised TypeError for a float. An integral float (2.0) equals an int key in the OrderedDict reference,
    but G3 neither stores nor reads such a key (``valid_key``: a get misses it, ``invalid_key``), so the
    compact index ends the prefix there too; the reference is compared for every other value."""
    field, value = bad
    held = [BlockKey(NS, "t", 1, i) for i in range(n)]
    for at in sorted({0, 1, n // 2, n - 1}):
        keys = list(held)
        keys[at] = keys[at]._replace(**{"seq_hash" if field == "seq" else "rank": value})
        got = []
        for ix in (LruIndex(), CompactLruIndex()):
            for i, k in enumerate(held):
                ix.put(k, (0, i))
            ix.put(BlockKey(NS, "t", 1, 2), (0, n + 1))  # what a truncated seq 2.x would hit
            got.append(ix.lookup_prefix(keys, NS))
        assert got[1] == at, (at, got)
        if not (isinstance(value, float) and value.is_integer()):
            assert got[0] == at, (at, got)
