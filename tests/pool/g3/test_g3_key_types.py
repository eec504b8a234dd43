"""G3 takes a key's rank and seq_hash as any integral type, and checks keys at its entry, before any effect
(``kvbm_backend/pool/g3/entry.py``).

Before 2026-12-04 a BlockKey naming its sequence hash or TP rank as a numpy integer (``np.int64(3)``, a valid
value) raised OverflowError from the compact index's hash in ``get``, ``put``, ``holds``, ``contains``, ``lease``,
``delete`` and lookups of up to 8 keys (longer lookups took it), after part of the call had taken effect: a lease
left the keys before it pinned for good, a delete removed them from the index and zeroed their headers without a
DEL record or a ``deleted`` count, and the first put of such a key under a new tenant killed the syncer's settle
(the put's future never resolved, the close hung its whole bound). A key whose tenant is not a str did the same
(TypeError partway). All through real pools on real files.
"""
from __future__ import annotations

import numpy as np
import pytest

from kvbm_backend.model.namespace import BlockKey
from tests.helpers.crash_writer import LAYOUT, NS, open_pool, payload

HANG_S = 600.0  # a hang guard, not a bound: waits for results that must come; returns as soon as they do
BB = LAYOUT.bytes_per_block


def _key(seq, rank=0, tenant="t"):
    return BlockKey(NS.fingerprint, tenant, rank, seq)


def _put(pool, keys):
    r = pool.put(keys, [payload(int(k.seq_hash)) for k in keys]).result(timeout=HANG_S)
    assert pool.flush(HANG_S)
    return r


def _get(pool, keys):
    out = [np.zeros(BB, np.uint8) for _ in keys]
    ok = pool.get(keys, out).result(timeout=HANG_S).ok
    return [bool(o) and np.array_equal(b, payload(int(k.seq_hash))) for k, b, o in zip(keys, out, ok)]


def _all_ints(key):
    return type(key.rank) is int and type(key.seq_hash) is int


@pytest.mark.parametrize("np_key", [lambda s: _key(np.int64(s)), lambda s: _key(np.uint64(s)),
                                    lambda s: _key(s, rank=np.int32(0)), lambda s: _key(np.int64(s), np.uint8(0))],
                         ids=["seq_int64", "seq_uint64", "rank_int32", "both"])
def test_numpy_integer_keys_are_the_same_keys_in_every_call(tmp_path, np_key):
    with open_pool(tmp_path) as pool:
        held = [_key(s) for s in range(1, 13)]
        assert _put(pool, held).written == 12
        alias = [np_key(s) for s in range(1, 13)]  # the same keys, fields numpy integers
        assert pool.contains(alias[0]) is True
        assert pool.holds(alias[:3] + [np_key(99)]) == [True, True, True, False]
        assert pool.lookup_prefix(alias[:4] + [np_key(99)]).result(timeout=HANG_S) == 4  # <= 8 keys
        assert pool.lookup_prefix(alias + [np_key(99)]).result(timeout=HANG_S) == 12  # > 8 keys
        assert _get(pool, alias[:5]) == [True] * 5
        leases = pool.lease(alias[:2] + [np_key(99)])
        assert [ls is not None for ls in leases] == [True, True, False]
        assert all(_all_ints(ls.key) for ls in leases if ls is not None)
        pool.release([ls for ls in leases if ls is not None])
        r = _put(pool, alias[:2] + [np_key(20), np_key(21)])  # held: skipped; new: written
        assert (r.written, r.skipped, r.dropped) == (2, 2, 0), r
        assert all(_all_ints(k) for k in pool.keys()) and len(pool.keys()) == 14
        cursor = pool.removal_cursor()
        assert pool.delete(alias[:2] + [np_key(20), np_key(99)]).result(timeout=HANG_S) == 3
        _, removed = pool.removed_since(cursor)
        assert removed is not None and all(type(s) is int and type(r) is int for _, s, r in removed)
        assert pool.holds(held[:2] + [_key(20)]) == [False] * 3 and pool.contains(_key(21))
        st = pool.stats()
        assert st["deleted"] == 3 and st["vacancies_unjournaled"] == 0, st
        acc = pool.slot_accounting()
        assert acc["leaked"] == 0 and acc["deferred"] == 0 and acc["used"] == 11, acc
    with open_pool(tmp_path) as pool:  # the DEL records were journaled: nothing to drop at the restart
        st = pool.stats()
        assert (st["restored_blocks"], st["restore_dropped"]) == (11, 0), st
        assert _get(pool, [_key(3), _key(21)]) == [True, True]


def test_the_first_numpy_keyed_put_of_a_tenant_is_published(tmp_path):
    """A put whose key is the first of its tenant (no index probe before the write) used to reach the syncer with
    numpy fields: the settle raised, the put's future never resolved and the close hung its bound."""
    with open_pool(tmp_path) as pool:
        keys = [_key(np.int64(s), tenant="new") for s in range(1, 4)]
        r = pool.put(keys, [payload(s) for s in range(1, 4)]).result(timeout=HANG_S)
        assert (r.written, r.dropped) == (3, 0), r
        assert pool.flush(HANG_S)
        assert _get(pool, [_key(s, tenant="new") for s in range(1, 4)]) == [True] * 3


def test_a_numpy_integer_out_of_range_is_a_key_no_slot_holds(tmp_path):
    with open_pool(tmp_path) as pool:
        assert _put(pool, [_key(1)]).written == 1
        bad = _key(np.int64(-1))
        assert pool.holds([_key(1), bad]) == [True, False]
        assert pool.lookup_prefix([_key(1), bad, _key(1)]).result(timeout=HANG_S) == 1
        assert [ls is None for ls in pool.lease([bad])] == [True]
        assert _get(pool, [_key(1), bad]) == [True, False]
        assert pool.delete([bad]).result(timeout=HANG_S) == 0
        r = pool.put([bad, _key(2)], [payload(0), payload(2)]).result(timeout=HANG_S)
        assert (r.written, r.dropped) == (1, 1) and pool.stats()["dropped_by_reason"] == {"invalid_key": 1}
        assert pool.slot_accounting()["leaked"] == 0


@pytest.mark.parametrize("call", ["lease", "delete", "holds", "contains", "get", "put", "lookup_prefix"])
@pytest.mark.parametrize("bad", [_key(5, tenant=None), _key(5, tenant=[]), ("ns", "t", 0, 5)],
                         ids=["tenant_none", "tenant_list", "tuple"])
def test_a_call_with_an_item_that_is_no_key_fails_before_any_effect(tmp_path, call, bad):
    if call in ("get", "put") and isinstance(bad, BlockKey):
        pytest.skip("get and put take a key whose tenant is not a str as a key no slot holds: "
                    "test_get_and_put_take_a_non_str_tenant_as_a_key_no_slot_holds")
    with open_pool(tmp_path) as pool:
        held = [_key(s) for s in range(1, 4)]
        assert _put(pool, held).written == 3
        keys = held + [bad]
        field = "tenant" if isinstance(bad, BlockKey) else "not a BlockKey"
        with pytest.raises(TypeError, match=rf"G3 {call}: key (3|0)\b.*{field}"):
            if call == "lease":
                pool.lease(keys)
            elif call == "delete":
                pool.delete(keys)
            elif call == "holds":
                pool.holds(keys)
            elif call == "contains":
                pool.contains(bad)
            elif call == "get":
                pool.get(keys, [np.zeros(BB, np.uint8) for _ in keys])
            elif call == "put":
                pool.put(keys, [payload(1) for _ in keys])
            else:
                pool.lookup_prefix(keys)
        # nothing happened: every key still held, none pinned (a delete frees its slot at once), nothing counted
        assert pool.holds(held) == [True] * 3
        st = pool.stats()
        assert st["deleted"] == 0 and st["offloads_written"] == 3, st
        assert pool.delete(held).result(timeout=HANG_S) == 3
        acc = pool.slot_accounting()
        assert acc["deferred"] == 0 and acc["used"] == 0 and acc["leaked"] == 0, acc


@pytest.mark.parametrize("tenant", [None, [], b"t"], ids=["none", "list", "bytes"])
def test_get_and_put_take_a_non_str_tenant_as_a_key_no_slot_holds(tmp_path, tenant):
    """``get`` and ``put`` keep the per-key answer for a key whose tenant is not a str (``tests/pool/g3/
    test_g3_hostile.py``: bad keys drop nothing): a miss, an ``invalid_key`` drop of that key alone; the others
    are served and written, nothing pinned or leaked."""
    with open_pool(tmp_path) as pool:
        held = [_key(s) for s in range(1, 4)]
        assert _put(pool, held).written == 3
        bad = _key(5, tenant=tenant)
        assert _get(pool, held + [bad]) == [True, True, True, False]
        r = pool.put([bad, _key(4)], [payload(5), payload(4)]).result(timeout=HANG_S)
        assert (r.written, r.dropped) == (1, 1), r
        assert pool.stats()["dropped_by_reason"] == {"invalid_key": 1}
        assert pool.holds(held + [_key(4)]) == [True] * 4
        acc = pool.slot_accounting()
        assert acc["leaked"] == 0, acc
