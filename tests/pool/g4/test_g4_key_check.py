"""The frame header's ``key_check`` (docs/format.md "Frame", offset 108): encrypted frames name the data key's
material, so a reader holding other material under the same ``(key_id, version)`` tells a block it cannot open
from a corrupt one. Real parts: a file:// G4 store in ``tmp_path``, keyring files made and rotated by the real
``kvbm-backend keys`` CLI.

Before (2026-11-30) the 4 bytes were reserved zero: two copies of one keyring (same KEK and pseudonym key, e.g.
given to two fleets) that each ran ``keys rotate alice`` held alice's key under the same id and version with
different material; fleet B's load of fleet A's block failed the GCM tag, was classed ``corrupt_integrity`` and,
the store confirming the bytes, deleted (``deleted_corrupt``): A's next load missed. Now B's load is
``miss_key_mismatch`` and deletes nothing. A matching ``key_check`` with a failing tag is still corrupt (deleted),
and frames written before the field (``key_check`` 0) are judged as before: readable, and deleted when their tag
fails.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import xxhash
from typer.testing import CliRunner

from kvbm_backend.apps.cli import app
from kvbm_backend.config import G4Config
from kvbm_backend.crypto.aead import key_check
from kvbm_backend.model.frame import HEADER_BYTES, FrameHeader
from kvbm_backend.pool.g4.announce import Announcements
from kvbm_backend.pool.g4.pool import G4Pool
from tests.helpers.g4_writer import namespace, payload

HANG_S = 600.0  # a hang guard, not a bound: waits for results that must come; returns as soon as they do
KC = slice(108, 112)  # key_check's bytes in the header


def _cli(*args: str) -> dict:
    r = CliRunner().invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def _keyrings(tmp_path: Path, diverge: bool) -> tuple[str, str]:
    """Keyring A, and B: a copy of A (same KEK, same pseudonym key). ``diverge``: each then rotates alice on
    its own (the same key id and version, other key material); else B stays an exact copy."""
    (tmp_path / "a").mkdir(mode=0o700)
    (tmp_path / "b").mkdir(mode=0o700)
    a, b = str(tmp_path / "a" / "kr.json"), str(tmp_path / "b" / "kr.json")
    _cli("keys", "create", "--keyring", a, "--tenant", "alice")
    shutil.copy2(a, b)
    shutil.copy2(a + ".kek", b + ".kek")
    if diverge:
        (ra,) = _cli("keys", "rotate", "--keyring", a, "--tenant", "alice")
        (rb,) = _cli("keys", "rotate", "--keyring", b, "--tenant", "alice")
        assert (ra["key_id"], ra["current_version"]) == (rb["key_id"], rb["current_version"]) \
            and ra["current_version"] == 2  # the same (key_id, version)
    return a, b


def _pool(tmp_path: Path, keyring: str) -> G4Pool:
    cfg = G4Config(url=f"file://{tmp_path / 'store'}", timeout_s=60.0, dir_fanout=16,
                   keyring={"path": keyring, "auto_create_tenants": False})
    return G4Pool(cfg, namespace())


def _block_files(tmp_path: Path) -> list[Path]:
    """The block objects in the store (not namespace.json, not announcements, not a temp file of a write in
    progress: the second pool's start-up writes namespace.json's ``.namespace.json.*.tmp`` in the background, and a
    listing that met it failed ``(f,) = ...`` once under a busy host)."""
    return sorted(Path(d) / f for d, _, fs in os.walk(tmp_path / "store") for f in fs
                  if not f.endswith((".json", ".tmp")) and "announce" not in d)


def _get(pool: G4Pool, seq: int) -> tuple[bool, np.ndarray]:
    bpb = pool.namespace.layout.bytes_per_block
    out = np.zeros(bpb, np.uint8)
    r = pool.get(pool.namespace.keys([seq], tenant="alice"), [out]).result(HANG_S)
    return r.ok[0], out


def _put(pool: G4Pool, seq: int):
    bpb = pool.namespace.layout.bytes_per_block
    return pool.put(pool.namespace.keys([seq], tenant="alice"), [payload(seq, "alice", bpb)]).result(HANG_S)


def _rewrite_header(f: Path, **fields: bytes) -> None:
    """Set header bytes (``kc``: key_check) and recompute header_check, as a frame written that way would be."""
    raw = bytearray(f.read_bytes())
    if "kc" in fields:
        raw[KC] = fields["kc"]
    raw[144:152] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(raw[:144])))
    f.write_bytes(bytes(raw))


def _flip_payload_byte(f: Path) -> None:
    raw = bytearray(f.read_bytes())
    raw[HEADER_BYTES + 17] ^= 0x40
    f.write_bytes(bytes(raw))


def test_key_check_is_the_keys_hmac_and_never_zero():
    k1, k2 = os.urandom(32), os.urandom(32)
    want = int.from_bytes(hmac.new(k1, b"kvbm-backend key check v1", hashlib.sha256).digest()[:4], "little") or 1
    assert key_check(k1) == want and key_check(k1) != key_check(k2) and key_check(k1) != 0
    with pytest.raises(ValueError):
        key_check(b"short")
    h = FrameHeader(ns_fp=b"\x01" * 8, tenant_tag=b"\x02" * 16, rank=0, world=1, seq_hash=7, num_layers=1,
                    outer_dim=2, dtype_bytes=2, page_size=16, inner_dim=8, payload_len=512, stored_len=512,
                    key_check=0xDEADBEEF)
    packed = h.pack()
    assert packed[KC] == struct.pack("<I", 0xDEADBEEF) and FrameHeader.unpack(packed).key_check == 0xDEADBEEF


def test_a_diverged_keyring_copy_misses_and_never_deletes_the_other_fleets_block(tmp_path):
    """The reviewer's case (test_probe_rot.py). Fails on the old code: B's load deleted A's block
    (corrupt_integrity, deleted_corrupt) and A's next load missed."""
    a, b = _keyrings(tmp_path, diverge=True)
    with _pool(tmp_path, a) as pa, _pool(tmp_path, b) as pb:
        assert _put(pa, 5).written == 1
        (f,) = _block_files(tmp_path)
        assert struct.unpack("<I", f.read_bytes()[KC])[0] != 0  # written with its key_check
        before = f.read_bytes()
        ok, out = _get(pb, 5)
        st = pb.stats()
        assert not ok and not out.any()  # a miss never touches the caller's buffer
        assert st.get("miss_key_mismatch") == 1, st
        assert not st.get("deleted_corrupt") and not st.get("corrupt_integrity"), st
        assert f.read_bytes() == before  # A's block is still there, as written
        ok, out = _get(pa, 5)
        assert ok and np.array_equal(out, payload(5, "alice", out.size))  # A loads it byte-exact
        # B's own offload of that block finds a frame it cannot serve: not counted as stored, and nothing replaced
        res = _put(pb, 5)
        assert res.written == 0 and pb.stats().get("skipped_unservable") == 1 and f.read_bytes() == before


def test_a_flipped_ciphertext_byte_under_a_matching_key_check_is_still_deleted(tmp_path):
    a, b = _keyrings(tmp_path, diverge=False)  # B: an exact copy, the same key material
    with _pool(tmp_path, a) as pa, _pool(tmp_path, b) as pb:
        assert _put(pa, 6).written == 1
        (f,) = _block_files(tmp_path)
        _flip_payload_byte(f)
        ok, _ = _get(pb, 6)
        st = pb.stats()
        assert not ok and st.get("corrupt_integrity") == 1 and st.get("deleted_corrupt") == 1, st
        assert not st.get("miss_key_mismatch") and not f.exists()


def test_a_frame_written_before_key_check_still_loads_and_is_judged_as_before(tmp_path):
    """key_check 0 (the reserved zero bytes of frames written before 2026-11-30): the block loads byte-exact;
    with a failing tag it is corrupt and deleted, as before, even for a diverged keyring (it cannot tell)."""
    a, b = _keyrings(tmp_path, diverge=True)
    with _pool(tmp_path, a) as pa, _pool(tmp_path, b) as pb:
        assert _put(pa, 7).written == 1 and _put(pa, 8).written == 1
        by_seq = {FrameHeader.unpack(f.read_bytes()[:HEADER_BYTES]).seq_hash: f for f in _block_files(tmp_path)}
        f7, f8 = (by_seq[pa.namespace.keys([s], tenant="alice")[0].seq_hash] for s in (7, 8))
        for f in (f7, f8):
            _rewrite_header(f, kc=b"\x00" * 4)
            assert FrameHeader.unpack(f.read_bytes()[:HEADER_BYTES]).key_check == 0
        ok, out = _get(pa, 7)
        assert ok and np.array_equal(out, payload(7, "alice", out.size))
        _flip_payload_byte(f7)
        ok, _ = _get(pa, 7)
        assert not ok and pa.stats().get("deleted_corrupt") == 1 and not f7.exists()
        ok, _ = _get(pb, 8)  # the other key material, unnamed: a failing tag, deleted as before
        assert not ok and pb.stats().get("corrupt_integrity") == 1 and not pb.stats().get("miss_key_mismatch")


def test_an_announcement_batch_of_other_key_material_is_foreign_not_corrupt(tmp_path):
    """Batches carry key_check too: a diverged copy's batch is ``foreign`` (retried later), not ``corrupt``
    (ignored for good). Before: ``corrupt``."""
    a, b = _keyrings(tmp_path, diverge=True)
    with _pool(tmp_path, a) as pa, _pool(tmp_path, b) as pb:
        ann_a, ann_b = (Announcements(p.store, p.namespace.fingerprint, p.keyring, p.encrypt, p.pseudonym)
                        for p in (pa, pb))
        ann_a.write("alice", {"x": 1})
        (batch,) = ann_b.list()
        assert ann_a.read(batch) == ({"x": 1}, "ok")
        assert ann_b.read(batch) == (None, "foreign")
