"""ChecksumFrames (the G3 fast frame path) makes exactly FrameHeader.pack's bytes and accepts only
frames the full parser would accept for that key."""
from __future__ import annotations

import numpy as np

from kvbm_backend.model import frame
from kvbm_backend.model.frame import ChecksumFrames, FrameHeader
from kvbm_backend.model.layout import KvLayout
from kvbm_backend.model.namespace import Namespace, tenant_tag

LAYOUT = KvLayout(num_layers=2, outer_dim=2, page_size=16, inner_dim=64, dtype="bfloat16")
NS = Namespace(model="test/frames", layout=LAYOUT, tp_world_size=2)


def test_header_bytes_identical_and_verify_strict():
    k = NS.keys([0xDEADBEEF], tenant="acme", rank=1)[0]
    pay = np.random.default_rng(1).integers(0, 256, LAYOUT.bytes_per_block, dtype=np.uint8)
    tt = tenant_tag("acme")
    ref = FrameHeader.for_block(k, LAYOUT, 2, tt, integrity=frame.payload_checksum(pay), flags=frame.FLAG_CHECKSUM,
                                created_ns=123456789).pack()
    cf = ChecksumFrames(bytes.fromhex(k.namespace), LAYOUT, 2)
    buf = np.full(3 * 4096, 0xAB, np.uint8)  # a reused staging buffer: stale bytes everywhere
    cf.write_header(memoryview(buf), 4096, tt, 1, 0xDEADBEEF, frame.payload_checksum(pay), 123456789)
    assert bytes(buf[4096:8192]) == ref
    assert (buf[:4096] == 0xAB).all() and (buf[8192:] == 0xAB).all()  # nothing outside the header touched
    h = memoryview(buf)[4096:8192]
    assert cf.verify(h, pay, tt, 1, 0xDEADBEEF)
    assert not cf.verify(h, pay, tt, 1, 0xDEADBEF0)  # another sequence hash
    assert not cf.verify(h, pay, tt, 0, 0xDEADBEEF)  # another rank
    assert not cf.verify(h, pay, tenant_tag("other"), 1, 0xDEADBEEF)  # another tenant
    bad = pay.copy()
    bad[100] ^= 1
    assert not cf.verify(h, bad, tt, 1, 0xDEADBEEF)  # payload bit flip
    for pos in (3, 20, 60, 120, 130, 140, 146):  # any header bit flip in the checked part
        b2 = buf[4096:8192].copy()
        b2[pos] ^= 0x10
        assert not cf.verify(memoryview(b2), pay, tt, 1, 0xDEADBEEF), pos
    other_layout = KvLayout(num_layers=4, outer_dim=2, page_size=8, inner_dim=64, dtype="bfloat16")
    assert other_layout.bytes_per_block == LAYOUT.bytes_per_block
    assert not ChecksumFrames(bytes.fromhex(k.namespace), other_layout, 2).verify(h, pay, tt, 1, 0xDEADBEEF)


def test_verify_many_agrees_with_verify_block_by_block():
    """The batched check the G3 read path uses accepts exactly the frames :meth:`verify` accepts:
    every block of a staged chunk with one fault of each kind (payload flip, header flips in the
    identity, layout, length, integrity and header-check bytes, another key, another tenant) is
    rejected and only it; good blocks pass. Rows of whole slots (stride > header) and packed headers."""
    rng = np.random.default_rng(3)
    bb = LAYOUT.bytes_per_block
    sb = frame.slot_bytes(bb)
    m = 24
    keys = NS.keys([1000 + j for j in range(m)], tenant="acme", rank=1)
    tt = tenant_tag("acme")
    cf = ChecksumFrames(bytes.fromhex(keys[0].namespace), LAYOUT, 2)
    stage = np.zeros(m * sb, np.uint8)
    mv = memoryview(stage)
    for j, k in enumerate(keys):
        o = j * sb
        stage[o + 4096:o + 4096 + bb] = rng.integers(0, 256, bb, dtype=np.uint8)
        cf.write_header(mv, o, tt, 1, k.seq_hash, frame.payload_checksum(mv[o + 4096:o + 4096 + bb]), 7)
    faults = {1: 4096 + 5, 3: 3, 5: 30, 7: 44, 9: 50, 11: 60, 13: 76, 15: 84, 17: 115, 19: 146}
    for j, pos in faults.items():
        stage[j * sb + pos] ^= 0x04
    tags = [tt] * m
    ranks = [1] * m
    seqs = [k.seq_hash for k in keys]
    seqs[21] += 1  # asked for another key
    tags[23] = tenant_tag("other")  # asked for another tenant
    payloads = [mv[j * sb + 4096:j * sb + 4096 + bb] for j in range(m)]
    ref = [cf.verify(mv[j * sb:j * sb + 4096], payloads[j], tags[j], ranks[j], seqs[j]) for j in range(m)]
    got = cf.verify_many(stage.reshape(m, sb), payloads, tags, ranks, seqs)
    assert got.dtype == bool and got.tolist() == ref
    assert [j for j in range(m) if not ref[j]] == sorted(list(faults) + [21, 23])
    packed = np.ascontiguousarray(stage.reshape(m, sb)[:, :4096])  # headers packed apart from payloads
    assert cf.verify_many(packed, payloads, tags, ranks, seqs).tolist() == ref
    assert cf.verify_many(packed[:0], [], [], [], []).tolist() == []


def test_check_headers_accepts_exactly_what_accept_does_and_reads_dev_check():
    """The device loader's batched header check (``ChecksumFrames.check_headers``) agrees with the full
    parser (:func:`frame.accept` with the stored length) row by row: frames with and without the device
    checksum flag pass, every single-byte fault in the checked header part, another key, tenant, rank or
    TP world, an encrypted frame, and a header of another layout fail; ``check_world=False`` accepts any
    world; ``devcheck`` and :func:`frame.header_dev_checks` name the device-checked rows and their sums."""
    m = 12
    keys = NS.keys([500 + j for j in range(m)], tenant="acme", rank=1)
    tt = tenant_tag("acme")
    bb = LAYOUT.bytes_per_block
    hdrs = np.zeros((m, 256), np.uint8)
    for j, k in enumerate(keys):
        flags = frame.FLAG_CHECKSUM | (frame.FLAG_DEVCHECK if j % 2 else 0)
        h = FrameHeader.for_block(k, LAYOUT, 2, tt, flags=flags, dev_check=(j + 1) * 0x0123456789ABCDEF % 2**64)
        if j == 4:
            h.world = 4  # a frame of another TP world
        if j == 6:
            h.flags = frame.FLAG_ENCRYPTED  # not a G3 frame a device can verify
        if j == 8:
            h.num_layers = 4  # another layout
        hdrs[j] = np.frombuffer(h.pack()[:256], np.uint8)
    hdrs[2, 50] ^= 1  # a sequence hash byte
    hdrs[10, 140] ^= 1  # the dev_check field: the header check catches it
    tags, ranks, seqs = [tt] * m, [1] * m, [k.seq_hash for k in keys]
    tags[3] = tenant_tag("other")
    ranks[5] = 0
    cf = ChecksumFrames(bytes.fromhex(keys[0].namespace), LAYOUT, 2)

    def ref(j, world):
        try:
            frame.accept(hdrs[j], NS.key(seqs[j], "acme", ranks[j]), LAYOUT, tags[j], world=world, stored_len=bb)
        except frame.FrameError:
            return False
        return not (hdrs[j][10] & frame.FLAG_ENCRYPTED)

    ok, dev = cf.check_headers(hdrs, tags, ranks, seqs)
    assert ok.tolist() == [ref(j, 2) for j in range(m)]
    assert [j for j in range(m) if ok[j]] == [0, 1, 7, 9, 11]
    assert dev.tolist() == [bool(j % 2) for j in range(m)]
    ok_any, _ = cf.check_headers(hdrs, tags, ranks, seqs, check_world=False)
    assert ok_any.tolist() == [ref(j, None) for j in range(m)] and ok_any[4]
    checks = frame.header_dev_checks(hdrs)
    assert checks.dtype == np.uint64
    assert [int(checks[j]) for j in (1, 7)] == [2 * 0x0123456789ABCDEF % 2**64, 8 * 0x0123456789ABCDEF % 2**64]
