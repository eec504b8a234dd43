"""G4Pool correctness on both stores (a real SeaweedFS server and a real directory): round trip,
restart persistence in a new process, corruption/swap/truncation detection, wrong tenant keys,
rotation, crypto-shred + gc, unencrypted mode, bounded offload queue."""
from __future__ import annotations

import hashlib
import json
import struct
import shutil
import subprocess
import sys
from hmac import HMAC

import numpy as np
import pytest

from tests.helpers.g4_writer import namespace, payload
from kvbm_backend.config import G4Config
from kvbm_backend.crypto.keyring import Keyring, KeyringError, provider_for
from kvbm_backend.pool.g4.gc import run_gc
from kvbm_backend.pool.g4.naming import namespace_name, parse_block_name
from kvbm_backend.pool.g4.pool import G4Pool
from kvbm_backend.model.frame import FLAG_CHECKSUM, FLAG_ENCRYPTED, HEADER_BYTES, FrameHeader
from kvbm_backend.pool.base import BlockPool
from tests.helpers.paths import HELPERS
from tests.helpers.g4_target import g4_target

WRITER = str(HELPERS / "g4_writer.py")
HANG_S = 600.0  # a hang guard, not a bound: waits for results that must come; returns as soon as they do


@pytest.fixture(params=["fs", "s3"])
def target(request, tmp_path, s3_prefix):
    """(cfg kwargs) for one store kind; keyring in tmp_path (:func:`tests.helpers.g4_target.g4_target`)."""
    return g4_target(request, tmp_path, s3_prefix)


def _pool(kw, **over) -> G4Pool:
    d = {**kw, **over}
    return G4Pool(G4Config(**d), namespace())


def _blocks(seqs, tenant):
    bpb = namespace().layout.bytes_per_block
    return [payload(s, tenant, bpb) for s in seqs]


def _read(pool, seqs, tenant):
    ns = namespace()
    keys = ns.keys(seqs, tenant=tenant)
    out = [np.full(ns.layout.bytes_per_block, 0xEE, np.uint8) for _ in keys]
    ok = pool.get(keys, out).result(timeout=HANG_S).ok
    want = _blocks(seqs, tenant)
    for o, b, w in zip(ok, out, want):
        if o:
            assert np.array_equal(b, w), "a block reported ok holds wrong bytes"
    return ok


def test_roundtrip_lookup_and_names(target):
    ns = namespace()
    with _pool(target) as p:
        assert isinstance(p, BlockPool) and p.tier == "G4"
        keys = ns.keys([11, 12, 13, 14], tenant="alice")
        res = p.put(keys, _blocks([11, 12, 13, 14], "alice")).result(timeout=HANG_S)
        assert (res.written, res.dropped) == (4, 0)
        assert p.put(keys[:2], _blocks([11, 12], "alice")).result(timeout=HANG_S).skipped == 2
        assert p.lookup_prefix(keys).result(timeout=HANG_S) == 4
        assert p.lookup_prefix(keys[:2] + ns.keys([99], tenant="alice") + keys[2:]).result(timeout=HANG_S) == 2
        assert p.lookup_prefix(ns.keys([11], tenant="bob")).result(timeout=HANG_S) == 0
        assert _read(p, [11, 12, 13, 14], "alice") == [True] * 4
        assert _read(p, [11], "bob") == [False]
        name = p.object_name(keys[0])
        meta = parse_block_name(name)
        bid = HMAC(p.keyring.name_key(p.pseudonym("alice")), struct.pack("<8sIQ", ns.fingerprint_bytes, 0, 11),
                   hashlib.sha256).digest()[:16]  # docs/format.md "G4 names", recomputed here
        assert meta == {"ns": ns.fingerprint, "tenant": p.pseudonym("alice").hex(), "rank": 0,
                        "fan": f"{int.from_bytes(bid[:4], 'big') % 16:x}", "block_id": bid.hex(), "legacy": False}
        # g4.dir_fanout (16 here): the directory is the block id's first 4 bytes % dir_fanout, in hex
        fans = {p.object_name(ns.key(s, tenant="alice")).split("/")[3] for s in range(200)}
        assert p.cfg.dir_fanout == 16 and fans == {f"{i:x}" for i in range(16)}
        assert "alice" not in name and f"{11:016x}" not in name
        raw = bytes(p.store.get(name))
        hdr = FrameHeader.unpack(raw[:HEADER_BYTES])
        assert hdr.flags == FLAG_ENCRYPTED and len(raw) == HEADER_BYTES + ns.layout.bytes_per_block
        assert hdr.tenant_tag == p.pseudonym("alice") and hdr.key_version == 1
        assert bytes(_blocks([11], "alice")[0][:64]) not in raw  # ciphertext, not plaintext
        # the namespace's canonical JSON beside the data, plus the dir_fanout its block names use (2026-12-01)
        assert json.loads(bytes(p.store.get(namespace_name(ns.fingerprint)))) == {**json.loads(ns.canonical_json()),
                                                                                  "g4": {"dir_fanout": 16}}
        assert p.delete(keys[:1]).result(timeout=HANG_S) == 1
        assert p.lookup_prefix(keys).result(timeout=HANG_S) == 0
        st = p.stats()
        assert st["encrypted"] is True and st["written"] == 4 and st["hits"] == 4


def test_restart_persistence_new_process(target):
    ns = namespace()
    seqs = [101, 102, 103]
    with _pool(target) as p:
        assert p.put(ns.keys(seqs, tenant="t1"), _blocks(seqs, "t1")).result(timeout=HANG_S).written == 3
    spec = {"mode": "read", "cfg": target, "tenant": "t1", "seqs": seqs + [104]}
    out = subprocess.run([sys.executable, WRITER, json.dumps(spec)], capture_output=True, text=True, timeout=HANG_S)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["lookup"] == 3 and r["ok"] == [True, True, True, False] and r["correct"] == [True, True, True, False]


def test_corrupt_swapped_truncated_objects_never_served(target):
    ns = namespace()
    seqs = list(range(200, 207))
    with _pool(target) as p:
        p.put(ns.keys(seqs, tenant="a"), _blocks(seqs, "a")).result(timeout=HANG_S)
        p.put(ns.keys([300], tenant="b"), _blocks([300], "b")).result(timeout=HANG_S)
        st = p.store
        name = lambda s, t="a": p.object_name(ns.key(s, tenant=t))  # noqa: E731
        raw = {s: bytes(st.get(name(s))) for s in seqs}
        # 200: payload bit flip; 201: header bit flip; 202: truncated; 203 <- 204 swapped;
        # 205 <- tenant b's block 300 moved into tenant a's name; 206 intact.
        st.put(name(200), raw[200][:-100] + bytes([raw[200][-100] ^ 0x10]) + raw[200][-99:])
        st.put(name(201), raw[201][:40] + bytes([raw[201][40] ^ 1]) + raw[201][41:])
        st.put(name(202), raw[202][: HEADER_BYTES + 1000])
        st.put(name(203), raw[204])
        st.put(name(205), bytes(st.get(name(300, "b"))))
        ok = _read(p, seqs, "a")
        assert ok == [False, False, False, False, True, False, True]
        s = p.stats()
        assert s["corrupt"] == 5 and s["deleted_corrupt"] == 5, str({k: v for k, v in s.items() if "corrupt" in k or "miss" in k})
        assert s["corrupt_integrity"] >= 1 and s["corrupt_header_check"] == 1 and s["corrupt_length"] == 1
        assert s["corrupt_identity"] == 2  # header names another seq / another tenant
        # corrupt objects were dropped, so the next offload can publish good copies again
        assert p.put(ns.keys(seqs, tenant="a"), _blocks(seqs, "a")).result(timeout=HANG_S).written == 5
        assert _read(p, seqs, "a") == [True] * 7


def test_swap_with_forged_header_fails_aead(target):
    """An attacker rewrites the header identity (recomputing its check) of a moved blob: the AEAD
    additional data still binds the original identity, so the tag fails."""
    ns = namespace()
    with _pool(target) as p:
        p.put(ns.keys([400, 401], tenant="a"), _blocks([400, 401], "a")).result(timeout=HANG_S)
        raw = bytes(p.store.get(p.object_name(ns.key(401, tenant="a"))))
        hdr = FrameHeader.unpack(raw[:HEADER_BYTES])
        hdr.seq_hash = 400
        p.store.put(p.object_name(ns.key(400, tenant="a")), hdr.pack() + raw[HEADER_BYTES:])
        assert _read(p, [400, 401], "a") == [False, True]
        assert p.stats()["corrupt_integrity"] == 1


def test_wrong_tenant_key_decrypts_nothing(target, tmp_path):
    ns = namespace()
    seqs = [500, 501, 502]
    with _pool(target) as p:
        p.put(ns.keys(seqs, tenant="alice"), _blocks(seqs, "alice")).result(timeout=HANG_S)
    # Another keyring that shares the pseudonym key but holds a different data key for alice.
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(target["keyring"]["path"], other / "keyring.json")
    shutil.copy(target["keyring"]["path"] + ".kek", other / "keyring.json.kek")
    kr = Keyring(other / "keyring.json", provider_for(other / "keyring.json"))
    kr.revoke("alice")
    kr.create("alice")
    with _pool(target, keyring={"path": str(other / "keyring.json")}) as q:
        assert q.lookup_prefix(ns.keys(seqs, tenant="alice")).result(timeout=HANG_S) == 3  # names exist...
        assert _read(q, seqs, "alice") == [False] * 3  # ...but 0 blocks decrypt
        assert q.stats()["miss_no_key"] == 3 and q.stats()["hits"] == 0
    # A completely unrelated keyring: different pseudonyms, nothing even found.
    with _pool(target, keyring={"path": str(tmp_path / "third" / "keyring.json")}) as r:
        assert r.lookup_prefix(ns.keys(seqs, tenant="alice")).result(timeout=HANG_S) == 0
        assert _read(r, seqs, "alice") == [False] * 3
    with _pool(target) as p:  # the right key still reads all (misses above deleted nothing)
        assert _read(p, seqs, "alice") == [True] * 3


def test_rotation_and_crypto_shred_then_gc(target):
    ns = namespace()
    with _pool(target) as p:
        p.put(ns.keys([600, 601], tenant="alice"), _blocks([600, 601], "alice")).result(timeout=HANG_S)
        p.put(ns.keys([700], tenant="bob"), _blocks([700], "bob")).result(timeout=HANG_S)
        p.keyring.rotate("alice")
        p.put(ns.keys([602], tenant="alice"), _blocks([602], "alice")).result(timeout=HANG_S)
        vers = [FrameHeader.unpack(bytes(p.store.get(p.object_name(ns.key(s, tenant="alice"))))[:HEADER_BYTES]).key_version
                for s in (600, 601, 602)]
        assert vers == [1, 1, 2]
        assert _read(p, [600, 601, 602], "alice") == [True] * 3  # old versions still read
        p.keyring.revoke("alice")
    with _pool(target) as q:  # a fresh worker after the revocation
        assert _read(q, [600, 601, 602], "alice") == [False] * 3
        assert _read(q, [700], "bob") == [True]
        res = run_gc(q.store, keyring=q.keyring)
        assert res["deleted_by"]["revoked"] == 3 and res["deleted_objects"] == 3
        assert q.lookup_prefix(ns.keys([600], tenant="alice")).result(timeout=HANG_S) == 0
        assert _read(q, [700], "bob") == [True]


def test_unencrypted_only_when_explicit_and_stats_say_so(target, tmp_path):
    ns = namespace()
    kw = {k: v for k, v in target.items() if k != "keyring"}
    with pytest.raises(KeyringError, match="g4.keyring.path: required"):
        G4Pool(G4Config(**kw), ns)  # encrypt defaults to True
    with G4Pool(G4Config(**kw, encrypt=False), ns) as p:
        p.put(ns.keys([800], tenant="t"), _blocks([800], "t")).result(timeout=HANG_S)
        assert _read(p, [800], "t") == [True]
        st = p.stats()
        assert st["encrypted"] is False and st["pseudonym_keyed"] is False
        raw = bytes(p.store.get(p.object_name(ns.key(800, tenant="t"))))
        assert FrameHeader.unpack(raw[:HEADER_BYTES]).flags == FLAG_CHECKSUM
        bad = bytearray(raw)
        bad[-1] ^= 0xFF
        p.store.put(p.object_name(ns.key(800, tenant="t")), bytes(bad))
        assert _read(p, [800], "t") == [False] and p.stats()["corrupt_integrity"] == 1


def test_encrypted_pool_refuses_plaintext_objects(target):
    ns = namespace()
    with _pool(target) as enc:
        plain = G4Pool(G4Config(**target, encrypt=False), ns)  # same keyring: same names
        plain.put(ns.keys([900], tenant="t"), _blocks([900], "t")).result(timeout=HANG_S)
        plain.close()
        assert _read(enc, [900], "t") == [False]
        assert enc.stats()["miss_unencrypted_object"] == 1


def test_offload_queue_bound_drops_and_counts(target):
    ns = namespace()
    seqs = list(range(1000, 1010))
    with _pool(target, write_queue_blocks=3) as p:
        res = p.put(ns.keys(seqs, tenant="q"), _blocks(seqs, "q")).result(timeout=HANG_S)
        assert (res.written, res.dropped) == (3, 7)
        assert p.stats()["dropped_queue_full"] == 7
        assert p.flush(timeout=HANG_S)


def test_bad_input_errors_are_clear(tmp_path):
    ns = namespace()
    with pytest.raises(ValueError, match="g4.url: required"):
        G4Pool(G4Config(encrypt=False), ns)
    with pytest.raises(ValueError, match="scheme 'http' not supported"):
        G4Pool(G4Config(url="http://x/y", encrypt=False), ns)
    with pytest.raises(ValueError, match="file:///path"):
        G4Pool(G4Config(url="file://relative/dir", encrypt=False), ns)
    with G4Pool(G4Config(url=f"file://{tmp_path}", encrypt=False), ns) as p:
        with pytest.raises(ValueError, match="block buffer of 10 bytes"):
            p.put(ns.keys([1]), [np.zeros(10, np.uint8)])
        with pytest.raises(ValueError, match="1 keys but 2 blocks"):
            p.put(ns.keys([1]), _blocks([1, 2], ""))


def test_object_longer_than_a_block_is_a_length_miss(target):
    """Extra bytes after the payload (longer than the read buffer on file://, whose reads go into
    fixed-size bounce buffers) are detected as corrupt_length, never served, and deleted."""
    ns = namespace()
    with _pool(target) as p:
        p.put(ns.keys([400, 401], tenant="a"), _blocks([400, 401], "a")).result(timeout=HANG_S)
        name = p.object_name(ns.key(400, tenant="a"))
        raw = bytes(p.store.get(name))
        p.store.put(name, raw + b"\0" * 8192)
        assert _read(p, [400, 401], "a") == [False, True]
        s = p.stats()
        assert s["corrupt_length"] == 1 and s["deleted_corrupt"] == 1
        assert p.store.head(name) is None


def test_close_resolves_gets_and_lookups_queued_behind_busy_io_threads(tmp_path):
    """A get, a staged get and a lookup queued behind the pool's only I/O thread when ``close`` runs: each
    resolves (a miss, ``miss_closed``; the lookup with what it confirmed, here nothing) within a bound and the
    staged batch goes idle (its rows may be reused). Before, close cancelled their queued tasks and dropped the
    timers that would have expired them: they never resolved and the staged rows were never idle again."""
    import threading
    # a load bound far above how long a busy runner may take to reach close() below: their own timers must not
    # resolve b and c first (flake audit); a close that left them would show as miss_timeout or a hang.
    # 120 s (the maximum): the busy CI VM froze processes for 13-31 s (2026-11-29)
    cfg = G4Config(url=f"file://{tmp_path}/g4", encrypt=False, max_inflight=1, timeout_s=120, retries=0)
    pool = G4Pool(cfg, namespace())
    ns, bpb = pool.namespace, pool.layout.bytes_per_block
    keys = ns.keys(range(1, 3), tenant="t")
    assert pool.put(keys, [payload(s, "t", bpb) for s in (1, 2)]).result(timeout=HANG_S).written == 2
    gate, holding = threading.Event(), threading.Event()
    rows_a = np.zeros((1, bpb), np.uint8)

    def slow_copy(i):  # the caller's copy thread is busy: batch A holds the only I/O thread
        holding.set()
        gate.wait(HANG_S)
    a = pool.get_staged([keys[0]], [rows_a[0]], on_hit=slow_copy)
    assert holding.wait(HANG_S)
    out_b = [np.full(bpb, 7, np.uint8)]
    b = pool.get([keys[1]], out_b)
    rows_c = np.zeros((1, bpb), np.uint8)
    c = pool.get_staged([keys[1]], [rows_c[0]])
    look = pool.lookup_prefix([keys[1]])
    pool.close(timeout=0)
    gate.set()
    bound = HANG_S
    assert a.future.result(timeout=bound).ok == [True] and a.idle.wait(bound)
    rb = b.result(timeout=bound)
    assert rb.ok == [False] and (out_b[0] == 7).all()  # a miss leaves the buffer untouched
    assert not rb.timed_out_at(0)  # closed, not timed out (GetResult.timed_out)
    assert c.future.result(timeout=bound).ok == [False] and c.idle.wait(bound)
    assert look.result(timeout=bound) == 0
    st = pool.stats()
    assert st["miss_closed"] >= 2 and st.get("miss_timeout", 0) == 0, st


def test_close_ends_queued_offloads_dropped_and_their_futures_resolve(tmp_path):
    """Review finding (2026-11-29): ``close`` after a bounded flush cancelled the offloads still queued, so
    their put future never resolved (a caller or ``flush(None)`` waiting on it hung), ``pending_put_blocks``
    stayed up and nothing counted them. Now each ends ``dropped`` (``dropped_closed``) without I/O."""
    import threading

    from kvbm_backend.pool.g4.fs_store import FsStore

    class FirstPutHeld(FsStore):  # a slow store: the first PUT lasts until the test lets it go, so the rest
        held = threading.Event()  # is still queued when close runs (not written by a fast I/O thread first)

        def put_if_absent(self, name, data):
            if parse_block_name(name) is not None and not self.held.is_set():  # a block (not namespace.json)
                self.held.set()
                release.wait(HANG_S)
            return super().put_if_absent(name, data)

    release = threading.Event()
    ns = namespace()
    bpb = ns.layout.bytes_per_block
    cfg = G4Config(url=f"file://{tmp_path}/g4", encrypt=False, max_inflight=1, write_queue_blocks=64)
    pool = G4Pool(cfg, ns, store=FirstPutHeld(f"{tmp_path}/g4"))
    seqs = list(range(40))
    fut = pool.put(ns.keys(seqs, tenant="t"), [payload(s, "t", bpb) for s in seqs])
    assert FirstPutHeld.held.wait(HANG_S)
    pool.close(timeout=0.0)  # its flush times out at once: the rest is dropped
    release.set()
    r = fut.result(timeout=HANG_S)
    assert r.written + r.skipped + r.dropped == 40 and r.dropped > 0, r
    st = pool.stats()
    assert st["pending_put_blocks"] == 0 and st["dropped_closed"] >= r.dropped - 1, st
    assert pool.flush(timeout=HANG_S)
    assert pool.put(ns.keys([99], tenant="t"), [payload(99, "t", bpb)]).result(timeout=HANG_S).dropped == 1
