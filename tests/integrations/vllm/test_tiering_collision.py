"""Colliding ``OffloadKey`` s on the native tiers (review 2026-12-01, HIGH: wrong KV). G3Tier and G4Tier named a
chunk by ``xxh3_64(OffloadKey)`` only (G3's index, the frame's seq_hash, G4's object name, an encrypted frame's
AAD), so a second key with the same 64 bits was served the first key's KV. xxh3_64 resists no search: the two
36-byte keys below share one (lanes cancelled against xxh3's public secret); a birthday search over prompts finds
real ones, and at fleet scale chance does. Now every key the tiers build is a ``DigestKey`` whose digest binds the
whole OffloadKey (:func:`~kvbm_backend.integrations.vllm.tier_base.offload_key_digest`): the second key is a miss
(the frame under the name holds the first key's nonzero digest: kept, docs/format.md), the first loads byte for
byte, and a frame written before the fix (no digest) costs one clean failed load, then is stored again. Through vLLM's real tiering
manager (:mod:`~kvbm_backend.integrations.vllm.tiering_harness`), real G3 and G4 (``file://``) pools."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
import xxhash

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")

from vllm.v1.kv_offload.base import LookupResult, Medium, make_offload_key  # noqa: E402

from kvbm_backend.integrations.vllm.failed_blocks import FailedChunks  # noqa: E402
from kvbm_backend.integrations.vllm.tiering import offload_key_hash  # noqa: E402
from kvbm_backend.integrations.vllm.tiering_harness import TieringHarness  # noqa: E402
from kvbm_backend.model.frame import HEADER_BYTES, FrameHeader  # noqa: E402
from kvbm_backend.model.hashing import digest_root, token_digests  # noqa: E402
from kvbm_backend.model.namespace import BlockKey, DigestKey  # noqa: E402
from tests.integrations.vllm.test_tiering import GEO, HANG_S, _looked_up, g3_tier, payloads  # noqa: E402
from tests.integrations.vllm import test_tiering_review as _review  # noqa: E402

pytestmark = [pytest.mark.vllm]

MOD = "kvbm_backend.integrations.vllm.tiering"
#: XXH3_kSecret[0:64], xxhash's public default secret
_SECRET = bytes.fromhex("b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
                        "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c")


def colliding_keys(group: int = 0) -> tuple[bytes, bytes]:
    """Two OffloadKeys (32-byte block hash + 4-byte group) with one ``xxh3_64``. For a 36-byte input xxh3 sums
    ``fold64(lo * hi)`` over four 16-byte windows, each lane xored with its secret; bytes 0-7 equal to
    ``secret[0:8]`` and bytes 12-19 to ``secret[56:64]`` zero the lanes multiplying bytes 8-11 (windows [0,16) and
    [4,20)), so those 4 bytes change the key, not its hash."""
    def key(free: bytes) -> bytes:
        return make_offload_key(_SECRET[0:8] + free + _SECRET[56:64] + bytes(range(1, 13)), group)
    k1, k2 = key(b"\x01\x02\x03\x04"), key(b"\xaa\xbb\xcc\xdd")
    assert k1 != k2 and len(k1) == 36 and xxhash.xxh3_64_intdigest(k1) == xxhash.xxh3_64_intdigest(k2)
    return k1, k2


def tier_spec(kind: str, tmp_path) -> dict:
    if kind == "g3":
        return g3_tier(tmp_path / "g3")
    g4: dict = {"url": f"file://{tmp_path / 'g4'}", "timeout_s": 60.0}
    g4.update({"keyring": {"path": str(tmp_path / "keys" / "kr.json")}} if kind == "g4-encrypted" else
              {"encrypt": False})
    return {"type": "G4Tier", "module_path": MOD, "num_kv_heads": GEO["num_kv_heads"], "io_threads": 2, "g4": g4}


make = _review.make  # the fixture: harnesses made by a test are shut down after it


def _held(tier, key) -> bool:
    """Whether the tier's pool holds every rank's block under ``key``'s name (G3's index, G4's HEADs)."""
    bks = tier._block_keys(key, tier._tenant)
    return int(tier.pool.lookup_prefix(bks, request=False).result(timeout=HANG_S)) == len(bks)


def _loads(h: TieringHarness, key, want: np.ndarray) -> bool:
    """A fresh request for ``key`` (primary emptied first) is served exactly ``want``."""
    h.reset_primary()
    got = h.load([key])
    return len(got) == 1 and np.array_equal(got[0], want)


def test_colliding_keys_share_a_name_never_a_digest():
    """The keys' digest is the documented formula (docs/format.md "Token digest"), binds the whole OffloadKey
    (group index included) and is personalised apart from the connector's token digests."""
    from kvbm_backend.integrations.vllm.tier_base import OFFLOAD_KEY_PERSON, offload_key_digest
    k1, k2 = colliding_keys()
    assert offload_key_hash(k1) == offload_key_hash(k2)
    d1, d2 = offload_key_digest(k1), offload_key_digest(k2)
    assert d1 != d2 and len(d1) == 16
    assert d1 == hashlib.blake2b(k1, digest_size=16, person=b"kvbm-offload-key").digest()
    assert offload_key_digest(colliding_keys(group=1)[0]) != d1  # the group index is bound too
    assert OFFLOAD_KEY_PERSON not in (b"kvbm-digest-root", b"kvbm-digest-blk")
    assert d1 != digest_root(k1) and d1 != bytes(token_digests([0] * 16, 16, k1))


@pytest.mark.parametrize("kind", ["g3", "g4-encrypted", "g4-plain"])
def test_a_colliding_key_is_a_miss_and_the_first_still_loads(tmp_path, make, kind):
    """k1 stored, k2 (same xxh3_64) asked: before the fix k2 was served k1's bytes (a hit); now a miss (the frame
    under the shared name holds k1's digest), k1's frame is kept (another nonzero digest is no proof of bad bytes:
    docs/format.md "Token digest"; until 2026-12-01 it was dropped), k2's recompute stored under the name does not
    replace it, and past the cool-down k1 still loads byte for byte while k2 is only ever a miss."""
    h = make([tier_spec(kind, tmp_path)])
    tier = h.tier
    assert tier.pool.stats().get("encrypted", False) is (kind == "g4-encrypted")
    k1, k2 = colliding_keys()
    p1, p2 = payloads(h, 2, seed=7)
    h.store([k1], [p1])
    h.wait_idle()
    assert _loads(h, k1, p1)
    h.reset_primary()
    got = h.load([k2])
    assert not any(np.array_equal(g, p1) for g in got), "k2 was served k1's KV"  # before the fix it was
    assert got == []
    b1, b2 = tier._block_keys(k1, tier._tenant)[0], tier._block_keys(k2, tier._tenant)[0]
    assert isinstance(b1, DigestKey) and BlockKey(*b1) == BlockKey(*b2) and b1.token_digest != b2.token_digest
    st = tier.kvbm_stats()["tier"]
    assert (st["loads_failed"], st["chunks_load_failed"]) == (1, 1)
    assert _looked_up(tier, h.context(), k2) is LookupResult.MISS  # cooling (FailedChunks)
    assert _held(tier, k1)  # k1's frame is kept: k2's failed load proves nothing bad about it
    tier._failed = FailedChunks(offload_key_hash, cooldown_s=0.0)  # past the cool-down (30 s), without waiting
    h.store([k2], [p2])  # k2's recompute under the shared name: G3 skips the held name, G4's PUT finds k1's object
    h.wait_idle()
    if kind != "g3":  # the object under the name still holds k1's digest; an encrypted one binds it (version 2)
        from kvbm_backend.integrations.vllm.tier_base import offload_key_digest
        head = tier.pool.store.get(tier.pool.object_name(b2), 0, HEADER_BYTES)
        hdr = FrameHeader.unpack(bytes(head)[:HEADER_BYTES])
        assert hdr.token_digest == offload_key_digest(k1) and hdr.version == (2 if kind == "g4-encrypted" else 1)
    assert _loads(h, k1, p1)  # k1 still loads byte for byte
    h.reset_primary()
    assert h.load([k2]) == []  # k2: only ever a miss, never k1's bytes
    st = tier.kvbm_stats()["tier"]
    assert (st["loads_failed"], st["chunks_loaded"]) == (2, 2)


@pytest.mark.parametrize("kind", ["g3", "g4-encrypted", "g4-plain"])
def test_a_chunk_stored_before_the_digest_costs_one_failed_load(tmp_path, make, kind):
    """A frame the tiers wrote before 2026-12-01 (no token digest: a plain BlockKey's) is one failed load, a clean
    miss that drops it (no error, no hit offered again), then the recompute's store writes it with its digest and
    it loads byte for byte: one failed load in all, not a loop."""
    h = make([tier_spec(kind, tmp_path)])
    tier = h.tier
    tier._failed = FailedChunks(offload_key_hash, cooldown_s=0.0)  # the re-stored chunk: looked up at once, not 30 s on
    key = make_offload_key(hashlib.sha256(b"old-chunk").digest(), 0)
    old, new = payloads(h, 2, seed=11)
    plain = BlockKey(tier.namespace.fingerprint, tier._tenant, 0, offload_key_hash(key))  # the old tiers' key
    res = tier.pool.put([plain], [old[:tier.geometry.rank_bytes].copy()]).result(timeout=HANG_S)
    assert res.written == 1 and _held(tier, key)
    h.reset_primary()
    assert h.load([key]) == []  # before: served (the old tiers checked no digest)
    assert not _held(tier, key)
    assert _looked_up(tier, h.context(), key) is LookupResult.MISS
    h.store([key], [new])
    h.wait_idle()
    assert _loads(h, key, new) and _loads(h, key, new)
    st = tier.kvbm_stats()["tier"]
    assert (st["loads_failed"], st["chunks_load_failed"], st["chunks_loaded"]) == (1, 1, 2)


def test_removal_events_name_every_published_chunk_of_a_dropped_name(tmp_path, make):
    """KV events on: k1 stored, then k2 (same name: G3 skips it as held without reading it, so it is published
    stored too). The name dropped is both chunks removed, each reported once (before 2026-12-01 the removal log,
    by sequence hash, found only the chunk published last: k1 stayed published to the router for good)."""
    h = make([g3_tier(tmp_path / "g3", enable_kv_events=True)], enable_kv_cache_events=True)
    tier = h.tier
    k1, k2 = colliding_keys()
    p1, p2 = payloads(h, 2, seed=3)
    for k, p in ((k1, p1), (k2, p2)):
        h.store([k], [p])
        h.wait_idle()
        h.reset_primary()

    def events():
        return [(e.removed, sorted(e.keys)) for e in h.manager.take_events() if e.medium is Medium.STORAGE]

    assert events() == [(False, [k1]), (False, [k2])]
    assert tier.pool.delete(tier._block_keys(k1, tier._tenant)).result(timeout=HANG_S) == 1
    assert events() == [(True, sorted([k1, k2]))] and len(tier._held) == 0
    assert not tier._held._by_hash and not tier._held._also  # nothing of either kept
    assert events() == []
