"""A G3 lease finds a load's slots in one batch (``CompactLruIndex.get_many``) with exactly the effects of the per-key
loop it replaced (``index.get(k, touch=True)``, ``pin``, a ``SlotLease`` per key): the same leases (None for absent
and foreign keys), ``absent`` misses, LRU order (so the same blocks are evicted next), tag-entry adoption and
``touches``, pins (a key leased twice is pinned twice).

Real pools on real files: one pool is filled, closed (its tenants' entries other than ``""``'s come back as
restored TagKeys) and copied; one copy leases through ``G3Pool.lease``, the other through the per-key loop
(:func:`_per_key_lease`, the loop as it was), and both are compared, then filled past capacity (eviction) while the
leases are held, then after the release. The index-level test compares ``get_many`` with the loop on random batches.
"""
from __future__ import annotations

import os
import random
import shutil

import pytest

from kvbm_backend.model.namespace import BlockKey, Namespace
from kvbm_backend.pool.base import SlotLease
from kvbm_backend.pool.g3.compact_index import CompactLruIndex
from kvbm_backend.pool.g3.index import LruIndex, TagKey, tag_of
from tests.helpers.crash_writer import LAYOUT, open_pool, payload

HANG_S = 600.0  # a hang guard, not a bound
CAP = 0.001  # GB: 81 slots of 12 KiB
NS = Namespace(model="test/lease-batch", layout=LAYOUT, tp_world_size=2)
OTHER_NS = Namespace(model="test/lease-batch-other", layout=LAYOUT, tp_world_size=2)
RUN = NS.keys(range(1, 41))  # tenant "", rank 0: BlockKeys after the restart
RANK1 = NS.keys(range(1, 11), rank=1)
ALICE = NS.keys(range(101, 121), "alice")  # restored as TagKeys (only "" is known by its tag)
BOB = NS.keys(range(201, 212), "bob")  # fills the pool: 40 + 10 + 20 + 11 = 81 blocks
NEW = NS.keys(range(1001, 1013))  # put after the lease: evicts the 12 least recently used unpinned blocks


def _put(pool, keys) -> None:
    for i in range(0, len(keys), 10):
        part = keys[i:i + 10]
        assert pool.put(part, [payload(k.seq_hash) for k in part]).result(timeout=HANG_S).written == len(part)


@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    """A closed, full pool directory: the groups put interleaved, so the LRU order is not the key order."""
    d = tmp_path_factory.mktemp("lease-batch") / "filled"
    with open_pool(d, NS, capacity_gb=CAP, files_per_path=1) as pool:
        assert pool.stats()["capacity_blocks"] == 81
        _put(pool, RUN[20:] + ALICE[:10] + RANK1 + RUN[:20] + BOB + ALICE[10:])
        assert pool.stats()["blocks"] == 81
    return d


@pytest.fixture
def twins(filled, tmp_path):
    """Two pools restored from copies of ``filled``: (batched, per-key)."""
    pools = []
    for name in ("batched", "per_key"):
        shutil.copytree(filled, tmp_path / name)
        pools.append(open_pool(tmp_path / name, NS, capacity_gb=CAP, files_per_path=1))
        assert pools[-1].stats()["restored_blocks"] == 81
    yield pools
    for p in pools:
        p.close()


def _per_key_lease(pool, keys):
    """The lease loop before the batch (kvbm_backend/pool/g3/read/reader.py up to 2026-12-04), on ``pool``."""
    cat = pool.cat
    out: list[SlotLease | None] = []
    absent = 0
    with cat.lock:
        sb = cat.slot_bytes
        for k in keys:
            slot = cat.index.get(k, touch=True) if k.namespace == cat.fp else None
            if slot is None:
                out.append(None)
                absent += 1
                continue
            cat.index.pin(slot)
            out.append(SlotLease(k, cat.slabs.by_index[slot[0]].path, slot[1] * sb, sb, slot))
        if absent:
            cat.miss("absent", absent)
    return out


def _state(pool, leases):
    """What the two paths must leave alike: the leases (file names, not the pools' dirs), the LRU order (oldest
    first; TagKey until adopted), ``touches``, the pins per slot (a read of the index's pin table), the misses."""
    idx, st = pool.cat.index, pool.stats()
    view = [None if ls is None else (ls.key, type(ls.key), os.path.basename(ls.path), ls.offset, ls.slot_len, ls.token)
            for ls in leases]
    return {"leases": view, "lru": list(idx.items()), "touches": idx.touches, "pins": dict(idx._pins._pins),
            "misses": (st["misses"], st["misses_by_reason"]), "pinned_slots": st["pinned_slots"]}


def _check_alike(twins, keys):
    """Lease ``keys`` batched and per key; compare after the lease, after an eviction with the leases held, and
    after the release. Returns the batched pool's state after the lease."""
    batched, per_key = twins
    la, lb = batched.lease(keys), _per_key_lease(per_key, keys)
    sa, sb = _state(batched, la), _state(per_key, lb)
    assert sa == sb
    for p in twins:  # the pool is full: these evict the least recently used unpinned blocks
        _put(p, NEW)
    ea, eb = _state(batched, la), _state(per_key, lb)
    assert ea["lru"] == eb["lru"], "another eviction order"
    assert batched.stats()["evictions"] == per_key.stats()["evictions"] == len(NEW)
    batched.release([x for x in la if x is not None])
    per_key.release([x for x in lb if x is not None])
    ra, rb = _state(batched, []), _state(per_key, [])
    assert ra == rb and ra["pins"] == {} and ra["pinned_slots"] == 0
    assert batched.slot_accounting()["leaked"] == 0
    return sa


def _permuted(keys, seed):
    keys = list(keys)
    random.Random(seed).shuffle(keys)
    return keys


def test_all_present(twins):
    keys = _permuted(RUN, 1)  # LRU order after: the lease's order, not the key order
    st = _check_alike(twins, keys)
    assert all(v is not None for v in st["leases"]) and st["misses"] == (0, {})
    assert [k for k, _ in st["lru"][-len(keys):]] == keys


def test_some_absent(twins):
    keys = _permuted(RUN[:25] + NS.keys(range(5000, 5010)), 2)
    st = _check_alike(twins, keys)
    assert sum(v is None for v in st["leases"]) == 10 and st["misses"] == (10, {"absent": 10})


def test_foreign_namespace(twins):
    keys = OTHER_NS.keys(range(1, 41))  # the same seq hashes, another namespace: all absent, nothing touched
    before = list(twins[0].cat.index.items())
    st = _check_alike(twins, keys)
    assert st["leases"] == [None] * 40 and st["misses"] == (40, {"absent": 40}) and st["lru"] == before


def test_foreign_keys_among_own(twins):
    keys = _permuted(RUN[:20] + OTHER_NS.keys(range(1, 11)), 3)
    st = _check_alike(twins, keys)
    assert st["misses"] == (10, {"absent": 10})


def test_restored_tag_entries_adopted_by_a_block_key_lease(twins):
    assert all(type(k) is TagKey for k, _ in twins[0].cat.index.items() if k.rank == 0 and 101 <= k.seq_hash <= 120)
    keys = _permuted(ALICE[:15], 4)
    st = _check_alike(twins, keys)
    assert st["touches"] == 2 * 15  # the adoption and the hit, as get(k, touch=True) counts them
    adopted = {k for k, _ in st["lru"] if k.tenant == "alice"}
    assert adopted == set(keys) and all(type(k) is BlockKey for k in adopted)
    assert sum(type(k) is TagKey for k, _ in st["lru"]) == 5 + len(BOB)  # alice's 5 others, bob's, untouched


def test_the_same_key_twice(twins):
    keys = _permuted(RUN[:12], 5)
    keys = keys[:6] + [keys[2]] + keys[6:] + [keys[9]]  # two keys leased twice
    st = _check_alike(twins, keys)
    assert len(st["pins"]) == 12 and sorted(st["pins"].values()) == [1] * 10 + [2] * 2


def test_the_same_tag_entry_twice(twins):
    keys = _permuted(ALICE[:10], 6)
    keys = keys[:4] + [keys[7]] + keys[4:]  # adopted by its first lease, only hit by the second
    st = _check_alike(twins, keys)
    assert st["touches"] == 11 + 10


def test_mixed_ranks_go_key_by_key(twins):
    keys = _permuted(RUN[:10] + RANK1, 7)  # the same seq hashes on two ranks
    st = _check_alike(twins, keys)
    assert all(v is not None for v in st["leases"])


def test_digest_keys(twins):
    st = _check_alike(twins, NS.keys(range(21, 31), digests=bytes(range(16)) * 10))  # DigestKeys: the batch too
    assert all(v is not None for v in st["leases"])


def test_a_short_list_goes_key_by_key(twins):
    _check_alike(twins, RUN[30:34] + RUN[32:33])


@pytest.mark.parametrize("seed", range(6))
def test_get_many_equals_the_per_key_loop(seed):
    """Index level, random batches on twin indexes: runs of one owner and rank (some absent, repeated, restored tag
    entries, another namespace), mixed ranks, odd keys; the same slots, LRU (and eviction) order and touches. The
    OrderedDict reference index's ``get_many`` (key by key) agrees too."""
    rng = random.Random(seed)
    ns, other = NS.fingerprint, OTHER_NS.fingerprint
    a, b, c = CompactLruIndex(64), CompactLruIndex(64), LruIndex()
    for ix in (a, b, c):
        for i in range(300):  # restored tag entries of alice, oldest first
            ix.restore(TagKey(ns, tag_of("alice"), i % 2, 10_000 + i), (1, i))
        for i in range(600):
            ix.put(BlockKey(ns, ("", "bob")[i % 2], i % 3, i), (0, i))
    for step in range(60):
        kind = rng.choice(["run", "run", "alice", "mixed", "odd", "foreign"])
        n = rng.choice([3, 9, 40, 300])
        if kind == "run":
            t, r = rng.choice(["", "bob"]), rng.randrange(3)
            keys = [BlockKey(ns, t, r, rng.randrange(700)) for _ in range(n)]  # repeats, absent ones
        elif kind == "alice":
            r = rng.randrange(2)
            keys = [BlockKey(ns, "alice", r, 10_000 + rng.randrange(320)) for _ in range(n)]
        elif kind == "mixed":
            keys = [BlockKey(ns, "", rng.randrange(3), rng.randrange(700)) for _ in range(n)]
        elif kind == "odd":  # a seq hash no entry can have, a TagKey
            keys = [BlockKey(ns, "", 0, rng.randrange(700)) for _ in range(n)]
            keys[rng.randrange(n)] = rng.choice([BlockKey(ns, "", 0, -1), BlockKey(ns, "", 0, 1 << 64),
                                                 TagKey(ns, tag_of("alice"), 0, 10_000 + rng.randrange(300))])
        else:
            keys = [BlockKey(rng.choice([ns, other]), "", 0, rng.randrange(700)) for _ in range(n)]
        got = a.get_many(keys, ns)
        want = [b.get(k, touch=True) if k.namespace == ns else None for k in keys]
        assert got == want == c.get_many(keys, ns), (step, kind)
        assert a.touches == b.touches == c.touches, (step, kind)
        if step % 10 == 9:
            assert list(a.items()) == list(b.items()) == c.items(), (step, kind)
            assert a.evict(25) == b.evict(25) == c.evict(25), (step, kind)
    assert list(a.items()) == list(b.items()) == c.items()


def test_get_many_without_a_namespace():
    ix = CompactLruIndex()
    keys = [BlockKey("n1", "", 0, i) for i in range(20)] + [BlockKey("n2", "", 0, i) for i in range(20)]
    for i, k in enumerate(keys):
        ix.put(k, (0, i))
    assert ix.get_many(keys[20:]) == [(0, i) for i in range(20, 40)]  # no namespace given: every key looked up
    assert [k for k, _ in ix.items()][-20:] == keys[20:]
    assert ix.get_many(keys[:20], "n2") == [None] * 20
    assert ix.get_many([]) == []
