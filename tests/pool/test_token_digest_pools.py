"""Every pool read path serves a frame for a :class:`DigestKey` only when the frame holds that token digest
(docs/format.md "Token digest"): G3's host get, device loader and layer-wise loader, G4 per-rank and canonical.
A frame written without a digest (the zero digest: before digests, or by a writer that names none) asked for by
a key naming one is a miss counted under ``token_digest`` and dropped, so the block's own frame, with its digest,
is stored at the next put. A verified frame holding another NONZERO digest is another token sequence's good
block under that name (the sequence hash is forgeable): a miss counted under ``other_digest``, and KEPT, and a
put of the other digest's block under the name does not replace it (review 2026-12-01: before, it was dropped,
so a tenant-mate's forged prompt deleted the victim's block). Keys naming no digest (the native tiers, the CLI)
read every frame as before. Real G3 files and ``file://`` G4 stores."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvbm_backend.config import KvbmBackendConfig  # noqa: E402
from kvbm_backend.integrations.tiers import open_tiers  # noqa: E402
from kvbm_backend.model.layout import KvLayout  # noqa: E402
from kvbm_backend.model.namespace import Namespace  # noqa: E402
from tests.helpers.pools import G4_TIMEOUT_S, open_g3  # noqa: E402

HANG_S = 600.0  # a hang guard, not a bound
LAYOUT = KvLayout(num_layers=4, outer_dim=2, page_size=16, inner_dim=128, dtype="bfloat16")  # 8 KiB layers
NS = Namespace(model="test/token-digest-pools", revision="r1", layout=LAYOUT, tp_world_size=1)
D1, D2 = b"\x01" * 16, b"\x02" * 16


def _blocks(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, LAYOUT.bytes_per_block, dtype=np.uint8) for _ in range(n)]


def _host_get(pool, keys) -> tuple[list[bool], list[np.ndarray]]:
    out = [np.zeros(LAYOUT.bytes_per_block, np.uint8) for _ in keys]
    return list(pool.get(keys, out).result(timeout=HANG_S).ok), out


def _device_get(pool, keys) -> tuple[list[bool], torch.Tensor]:
    out = torch.zeros(len(keys), LAYOUT.bytes_per_block, dtype=torch.uint8)
    return list(pool.get(keys, out).result(timeout=HANG_S).ok), out


def _layerwise_get(pool, keys) -> tuple[list[bool], None]:
    ld = pool.layerwise_load(keys, "cpu", min_read=8192)
    for layer in range(LAYOUT.num_layers):
        ld.wait_layer(layer)
    return [r is None for r in ld.finish()], None


@pytest.mark.parametrize("read", [_host_get, _device_get, _layerwise_get], ids=["host", "device", "layerwise"])
def test_g3_serves_a_frame_only_for_its_token_digest(tmp_path, read):
    pool = open_g3(tmp_path / "g3", NS, load_timeout_s=120.0)
    try:
        k1 = NS.keys([11, 12], "t", 0, D1 + D1)
        blocks = _blocks(2, 1)
        assert pool.put(k1, blocks).result(timeout=HANG_S).written == 2
        assert pool.put(NS.keys([13], "t"), _blocks(1, 2)).result(timeout=HANG_S).written == 1  # no digest
        assert pool.flush(HANG_S)
        ok, out = read(pool, k1)
        assert ok == [True, True]
        if out is not None:
            assert all(np.array_equal(np.asarray(out[i]), blocks[i]) for i in range(2))
        assert read(pool, NS.keys([11, 12], "t"))[0] == [True, True]  # a key naming no digest: not checked
        # another digest under block 12's name, and a digest asked of block 13 written without one: misses
        ok, out = read(pool, [k1[0]] + NS.keys([12, 13], "t", 0, D2 + D2))
        assert ok == [True, False, False]
        if out is not None:
            assert not np.asarray(out[1]).any() and not np.asarray(out[2]).any()  # nothing unverified delivered
        st = pool.stats()
        # 13, written without a digest: proven unservable for a key naming one, dropped (re-stored with it)
        assert st["corrupt_by_reason"].get("token_digest") == 1 and not pool.contains(NS.key(13, "t"))
        assert st["misses_by_reason"].get("token_digest") == 1
        # 12, another token sequence's verified block: a miss for D2, kept (before: dropped as token_digest)
        assert st["misses_by_reason"].get("other_digest") == 1 and pool.contains(NS.key(12, "t"))
        ok, out = read(pool, k1[1:])
        assert ok == [True] and (out is None or np.array_equal(np.asarray(out[0]), blocks[1]))
        if read is _host_get:
            # one get naming a block twice with two digests: the repeat is not served from the first copy
            assert _host_get(pool, NS.keys([11, 11], "t", 0, D1 + D2))[0] == [True, False]
            assert pool.stats()["misses_by_reason"].get("other_digest") == 2
        # D2's own block put under the name D1's holds: D1's block stays (G3 skips a held key), D2 still misses
        assert pool.put(NS.keys([12], "t", 0, D2), _blocks(1, 3)).result(timeout=HANG_S).written == 0
        assert pool.flush(HANG_S)
        ok, out = read(pool, k1[1:])
        assert ok == [True] and (out is None or np.array_equal(np.asarray(out[0]), blocks[1]))
        assert read(pool, NS.keys([12], "t", 0, D2))[0] == [False] and pool.contains(NS.key(12, "t"))
        # block 13's own frame, with its digest, can now be stored under the name, and serves
        k3 = NS.keys([13], "t", 0, D2)
        assert pool.put(k3, _blocks(1, 4)).result(timeout=HANG_S).written == 1
        assert pool.flush(HANG_S)
        assert read(pool, k3)[0] == [True]
    finally:
        pool.close()


def test_g3_drop_unreadable_keeps_another_digests_block(tmp_path):
    """The connector's worker asks G3 to delete a block whose load failed (``G3Pool.drop_unreadable``, after a
    forged prompt's load of the victim's block, too): a frame written without a digest is dropped, a verified frame
    of another nonzero digest is kept and still serves its own digest."""
    pool = open_g3(tmp_path / "g3", NS, load_timeout_s=120.0)
    try:
        blocks = _blocks(1, 5)
        assert pool.put(NS.keys([41], "t", 0, D1), blocks).result(timeout=HANG_S).written == 1
        assert pool.put(NS.keys([42], "t"), _blocks(1, 6)).result(timeout=HANG_S).written == 1
        assert pool.flush(HANG_S)
        assert pool.drop_unreadable(NS.keys([41, 42], "t", 0, D2 + D2)).result(timeout=HANG_S) == 1
        assert pool.contains(NS.key(41, "t")) and not pool.contains(NS.key(42, "t"))  # before: both dropped
        ok, out = _host_get(pool, NS.keys([41], "t", 0, D1))
        assert ok == [True] and np.array_equal(out[0], blocks[0])
        assert pool.stats()["unreadable_kept"] == 0  # not an I/O error: nothing to strike
    finally:
        pool.close()


def _g4(tmp_path, **kw):
    """A G4 pool on a ``file://`` store under ``tmp_path`` with its keyring (``kw``: more ``g4`` settings), its
    load bound :data:`~tests.helpers.pools.G4_TIMEOUT_S` x 2 (the 2 s default turned a frozen read into a miss)."""
    cfg = KvbmBackendConfig(model="m", g3={"enabled": False}, g4={
        "enabled": True, "url": f"file://{tmp_path / 'store'}", "keyring": {"path": str(tmp_path / "keyring.json")},
        "timeout_s": G4_TIMEOUT_S, **kw})
    _, g4 = open_tiers(cfg, NS, 1)
    assert g4 is not None
    return g4


def _g4_device_get(pool, keys) -> tuple[list[bool], list[np.ndarray]]:
    """A tensor get (``G4Pool.get`` into one ``[n, bytes]`` tensor: staged rows, :meth:`G4Reader.get_staged`)."""
    ok, out = _device_get(pool, keys)
    return ok, [out[i].numpy() for i in range(len(keys))]


@pytest.mark.parametrize("encrypt", [False, True], ids=["plain", "encrypted"])
@pytest.mark.parametrize("read", [_host_get, _g4_device_get], ids=["host", "staged"])
@pytest.mark.parametrize("layout", ["per-rank", "canonical"])
def test_g4_serves_a_frame_only_for_its_token_digest(tmp_path, layout, read, encrypt):
    g4 = _g4(tmp_path, layout=layout, encrypt=encrypt)
    try:
        k1 = NS.keys([21, 22], "alice", 0, D1 + D1)
        blocks = _blocks(2, 4)
        assert g4.put(k1, blocks).result(timeout=HANG_S).written == 2
        assert g4.put(NS.keys([23], "alice"), _blocks(1, 5)).result(timeout=HANG_S).written == 1
        assert g4.flush(HANG_S)
        ok, out = read(g4, k1)
        assert ok == [True, True] and all(np.array_equal(out[i], blocks[i]) for i in range(2))
        assert read(g4, NS.keys([21, 22], "alice"))[0] == [True, True]
        ok, out = read(g4, [k1[0]] + NS.keys([22, 23], "alice", 0, D2 + D2))
        assert ok == [True, False, False] and not out[1].any() and not out[2].any()
        st = g4.stats()
        assert st.get("corrupt_token_digest", 0) >= 1  # 23, written without one (canonical: counted per part)
        assert st.get("miss_other_digest", 0) >= 1  # 22, another token sequence's verified block
        # 22 kept (before: deleted), 23 deleted (the store confirmed)
        assert read(g4, NS.keys([22, 23], "alice"))[0] == [True, False]
        # D2's own block put under the name D1's holds: create-exclusive keeps D1's (not stored, not served)
        assert g4.put(NS.keys([22], "alice", 0, D2), _blocks(1, 6)).result(timeout=HANG_S).written == 0
        assert g4.flush(HANG_S)
        ok, out = read(g4, k1[1:])
        assert ok == [True] and np.array_equal(out[0], blocks[1])
        assert read(g4, NS.keys([22], "alice", 0, D2))[0] == [False]
        # block 23's own frame, with its digest, can now be stored under the name, and serves
        assert g4.put(NS.keys([23], "alice", 0, D2), _blocks(1, 7)).result(timeout=HANG_S).written == 1
        assert g4.flush(HANG_S)
        assert read(g4, NS.keys([23], "alice", 0, D2))[0] == [True]
    finally:
        g4.close()


def test_an_encrypted_g4_frame_whose_digest_was_changed_in_the_store_fails_its_tag(tmp_path):
    """Review finding (2026-12-01): the digest sat outside the AEAD additional data, so whoever could write to the
    store could relabel a block with another prompt's digest (a forged sequence hash already gives both the same
    object name) and have it served. Encrypted frames with a digest are now format version 2, whose additional data
    ends with the digest: a changed digest fails the GCM tag (a miss, the object dropped as corrupt)."""
    from kvbm_backend.model.frame import HEADER_BYTES, FrameHeader
    g4 = _g4(tmp_path, encrypt=True)
    try:
        k1 = NS.keys([31], "alice", 0, D1)
        assert g4.put(k1, _blocks(1, 7)).result(timeout=HANG_S).written == 1
        assert g4.flush(HANG_S)
        path = g4.store._path(g4.object_name(k1[0]))
        raw = bytearray(path.read_bytes())
        hdr = FrameHeader.unpack(raw[:HEADER_BYTES])
        assert hdr.version == 2 and hdr.token_digest == D1
        raw[152:168] = D2  # the store relabels it with another prompt's digest
        path.write_bytes(bytes(raw))
        assert _host_get(g4, NS.keys([31], "alice", 0, D2))[0] == [False]  # before: [True], D1's KV served
        assert g4.stats().get("corrupt_integrity", 0) == 1
    finally:
        g4.close()
