"""Workers sharing one G4 store but differing in ``g4.dir_fanout`` (review finding of 2026-12-01). The fan-out
directory is part of every block name, but nothing recorded or checked the value: a worker tuned to 1024 (as
docs/format.md invites) beside workers on the default 256 found none of their blocks and stored every block again,
silently (32 of 32 misses, 32 duplicates). The store's ``{ns}/namespace.json`` now records the fan-out its block
names use (written by the namespace's first worker) and a pool configured otherwise names blocks with the recorded
value, with a WARNING naming both values and the fix (and ``stats()["dir_fanout_overridden"]``). Real file and
SeaweedFS stores, real keyrings, real pools."""
from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from kvbm_backend.config import G4Config
from kvbm_backend.pool.g4.factory import open_store
from kvbm_backend.pool.g4.naming import namespace_name, parse_block_name
from kvbm_backend.pool.g4.pool import G4Pool
from tests.helpers.g4_writer import namespace, payload

HANG_S = 600.0  # a hang guard, not a bound: waits for results that must come; returns as soon as they do
SEQS = list(range(1, 33))
LOGGER = "kvbm_backend.pool.g4.tenant_names"


def _base(kind: str, tmp_path, s3_prefix: str, request) -> dict:
    kw: dict = {"keyring": {"path": str(tmp_path / "keys" / "keyring.json")}, "timeout_s": 30.0}
    if kind == "fs":
        (tmp_path / "store").mkdir(exist_ok=True)
        return {**kw, "url": f"file://{tmp_path / 'store'}"}
    sw = request.getfixturevalue("seaweed")
    return {**kw, "url": sw.url(s3_prefix), "endpoint_url": sw.endpoint}


def _pool(base: dict, fanout: int) -> G4Pool:
    p = G4Pool(G4Config(**base, dir_fanout=fanout), namespace())
    p.flush(HANG_S)  # the start-up namespace.json check is done
    return p


def _blocks(base: dict) -> list[str]:
    store = open_store(base["url"], endpoint_url=base.get("endpoint_url"))
    return sorted(o.name for o in store.list("") if parse_block_name(o.name) is not None)


def _recorded(base: dict) -> dict:
    store = open_store(base["url"], endpoint_url=base.get("endpoint_url"))
    return json.loads(bytes(store.get(namespace_name(namespace().fingerprint))))


@pytest.mark.parametrize("kind", ["fs", "s3"])
def test_a_worker_tuned_to_another_dir_fanout_shares_the_stores_blocks(kind, tmp_path, s3_prefix, request, caplog):
    """A (256, the default) writes 32 blocks; B (1024) starts on the same store: it names blocks with the 256 the
    store's namespace.json records, finds and loads all 32 and stores none again (one object per block); it logs
    a WARNING naming ``g4.dir_fanout``, both values and the fix. Before: B found 0 and wrote 32 duplicates."""
    base = _base(kind, tmp_path, s3_prefix, request)
    ns = namespace()
    bpb = ns.layout.bytes_per_block
    keys = ns.keys(SEQS, tenant="alice")
    blocks = [payload(s, "alice", bpb) for s in SEQS]
    with _pool(base, 256) as a:
        assert a.put(keys, blocks).result(HANG_S).written == len(SEQS)
        a.flush(HANG_S)
        a_stats = a.stats()
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with _pool(base, 1024) as b:
        assert b.lookup_prefix(keys).result(HANG_S) == len(SEQS)  # before: 0
        out = [np.zeros(bpb, np.uint8) for _ in keys]
        assert b.get(keys, out).result(HANG_S).ok == [True] * len(SEQS)
        assert all(np.array_equal(o, blk) for o, blk in zip(out, blocks))
        r = b.put(keys, blocks).result(HANG_S)
        assert (r.written, r.skipped) == (0, len(SEQS)), r  # before: 32 written again
        b.flush(HANG_S)
        assert b.stats()["dir_fanout_overridden"] is True and b.names.dir_fanout == 256
    assert a_stats["dir_fanout_overridden"] is False
    assert len(_blocks(base)) == len(SEQS)  # one object per block
    assert _recorded(base)["g4"] == {"dir_fanout": 256}
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "g4.dir_fanout" in r.getMessage()]
    assert len(warned) == 1 and "1024" in warned[0] and "records 256" in warned[0] and "g4.url" in warned[0], warned


def test_the_first_worker_records_its_dir_fanout_and_later_ones_follow_it(tmp_path, s3_prefix, request):
    """A fresh store: the first worker (1024) writes namespace.json with the namespace's canonical members (its
    fingerprint recomputes from them) plus ``"g4": {"dir_fanout": 1024}``; a later worker configured with 256 names
    its blocks with 1024 (three hex digits), beside the first's."""
    base = _base("fs", tmp_path, s3_prefix, request)
    ns = namespace()
    bpb = ns.layout.bytes_per_block
    with _pool(base, 1024) as first:
        assert first.put(ns.keys([1], tenant="t"), [payload(1, "t", bpb)]).result(HANG_S).written == 1
    doc = _recorded(base)
    assert doc.pop("g4") == {"dir_fanout": 1024} and doc == ns.to_dict()
    with _pool(base, 256) as later:
        assert later.put(ns.keys([2], tenant="t"), [payload(2, "t", bpb)]).result(HANG_S).written == 1
        assert later.lookup_prefix(ns.keys([1, 2], tenant="t")).result(HANG_S) == 2
    assert {len(parse_block_name(n)["fan"]) for n in _blocks(base)} == {3}  # 1024 -> 3 hex digits
    assert _recorded(base)["g4"] == {"dir_fanout": 1024}  # never rewritten


def test_a_namespace_json_from_before_the_record_leaves_the_configured_value(tmp_path, s3_prefix, request, caplog):
    """A store whose namespace.json an older version wrote (the canonical members only): the value its writers used
    is unknown, so the pool names blocks with its own ``g4.dir_fanout`` as before (unchecked, one INFO line), and
    leaves the file as it is."""
    base = _base("fs", tmp_path, s3_prefix, request)
    ns = namespace()
    bpb = ns.layout.bytes_per_block
    store = open_store(base["url"])
    legacy = ns.canonical_json().encode()
    assert store.put_if_absent(namespace_name(ns.fingerprint), legacy)
    caplog.set_level(logging.INFO, logger=LOGGER)
    with _pool(base, 1024) as p:
        assert p.names.dir_fanout == 1024 and p.stats()["dir_fanout_overridden"] is False
        assert p.put(ns.keys([1], tenant="t"), [payload(1, "t", bpb)]).result(HANG_S).written == 1
    assert {len(parse_block_name(n)["fan"]) for n in _blocks(base)} == {3}
    assert bytes(store.get(namespace_name(ns.fingerprint))) == legacy
    assert any("records no dir_fanout" in r.getMessage() for r in caplog.records), caplog.text


def test_an_unparsable_namespace_json_leaves_the_configured_value_with_a_warning(tmp_path, s3_prefix, request,
                                                                                  caplog):
    base = _base("fs", tmp_path, s3_prefix, request)
    ns = namespace()
    store = open_store(base["url"])
    assert store.put_if_absent(namespace_name(ns.fingerprint), b'{"g4": {"dir_fanout": 0}}')
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with _pool(base, 64) as p:
        assert p.names.dir_fanout == 64
    assert any("does not parse" in r.getMessage() and "dir_fanout" in r.getMessage() for r in caplog.records)
