"""Token digests (docs/format.md "Token digest"): the collision-resistant identity our frames carry beside KVBM's
sequence hash, and the frame checks that refuse a frame holding another one.

The sequence hash is xxh3_64 with a public seed. For the 64 bytes of a 16-token block xxh3 sums products of 8-byte
lanes XORed with its public secret: tokens 0 and 1 equal to the secret's first 8 bytes zero one product, so tokens 2
and 3 no longer count. :func:`colliding_prompts` gives two prompts of one tenant (the default one: no salt) with
every sequence hash equal, found with no search at all."""
from __future__ import annotations

import hashlib
import pickle
import struct

import numpy as np
import pytest

from kvbm_backend.model import frame
from kvbm_backend.model.frame import ChecksumFrames, FrameError, FrameHeader, accept
from kvbm_backend.model.hashing import salt_bytes, sequence_hashes, token_digests
from kvbm_backend.model.layout import KvLayout
from kvbm_backend.model.namespace import BlockKey, DigestKey, Namespace

LAYOUT = KvLayout(2, 2, 16, 8, "bfloat16")
NS = Namespace("test/token-digest", LAYOUT)


def colliding_prompts(bs: int = 16, blocks: int = 4) -> tuple[list[int], list[int]]:
    """Two token lists of ``blocks`` full ``bs``-token blocks plus one token that differ in tokens 2 and 3 and have
    equal KVBM sequence hashes for every block (no salt; ``bs`` 16: a 64-byte block, xxh3's 17-128 byte path)."""
    t0, t1 = struct.unpack("<II", bytes([0xB8, 0xFE, 0x6C, 0x39, 0x23, 0xA4, 0x4B, 0xBE]))  # XXH3_kSecret[0:8]
    rest = list(range(100, 100 + blocks * bs - 3))
    return [t0, t1, 5, 6] + rest, [t0, t1, 7, 8] + rest


def test_the_sequence_hash_is_forgeable_and_the_token_digest_is_not():
    a, b = colliding_prompts()
    assert a != b and sequence_hashes(a, 16) == sequence_hashes(b, 16)  # every block: one name for two prompts
    da, db = token_digests(a, 16), token_digests(b, 16)
    assert len(da) == len(db) == 4 * 16
    assert all(da[16 * i:16 * i + 16] != db[16 * i:16 * i + 16] for i in range(4))  # the chain tells them apart


def test_token_digests_follow_the_documented_chain():
    """docs/format.md: d[-1] = BLAKE2b-128(salt, person kvbm-digest-root); d[i] = BLAKE2b-128(block i as LE u32,
    key d[i-1], person kvbm-digest-blk). Recomputed here from hashlib alone."""
    toks = list(range(7, 7 + 3 * 16 + 5))
    salt = salt_bytes("alice")
    d = hashlib.blake2b(salt or b"", digest_size=16, person=b"kvbm-digest-root").digest()
    want = b""
    for i in range(3):
        blk = struct.pack("<16I", *toks[16 * i:16 * (i + 1)])
        d = hashlib.blake2b(blk, digest_size=16, key=d, person=b"kvbm-digest-blk").digest()
        want += d
    assert bytes(token_digests(toks, 16, salt)) == want
    # continued from a parent: the same chain; a salt or one token changes every digest from its block on
    head = token_digests(toks[:16], 16, salt)
    assert bytes(token_digests(toks[16:48], 16, parent=bytes(head), into=head)) == want
    bob = bytes(token_digests(toks, 16, salt_bytes("bob")))
    assert all(bob[i:i + 16] != want[i:i + 16] for i in range(0, 48, 16))
    other = list(toks)
    other[20] += 1
    o = bytes(token_digests(other, 16, salt))
    assert o[:16] == want[:16] and o[16:32] != want[16:32] and o[32:] != want[32:]
    assert token_digests(toks, 16) != token_digests(toks, 16, salt)  # no salt is a salt too
    with pytest.raises(ValueError, match="page_size"):
        token_digests(toks, 0)
    with pytest.raises(ValueError, match="parent"):
        token_digests(toks, 16, parent=b"short")


def test_a_digest_key_is_its_block_key_everywhere_but_the_frame_check():
    d = bytes(range(16))
    k = NS.keys([5, 6], "t", 0, d + d[::-1])
    assert [type(x) for x in k] == [DigestKey, DigestKey] and k[0].token_digest == d and k[1].token_digest == d[::-1]
    plain = NS.key(5, "t")
    assert k[0] == plain and hash(k[0]) == hash(plain) and {plain: 1}[k[0]] == 1
    assert pickle.loads(pickle.dumps(k[0])).token_digest == d
    assert k[0]._replace(rank=0).token_digest == d
    assert frame.key_digest(plain) is None and frame.key_digests([plain, plain]) is None
    assert frame.key_digests([plain, k[1]]) == [None, d[::-1]]
    with pytest.raises(ValueError, match="digests: 16 bytes for 2 blocks"):
        NS.keys([5, 6], "t", 0, d)
    with pytest.raises(ValueError, match="token_digest"):
        DigestKey(NS.fingerprint, "t", 0, 5, b"x")


def test_frames_carry_the_digest_and_readers_refuse_another():
    d, other = b"\x11" * 16, b"\x22" * 16
    key = DigestKey(NS.fingerprint, "t", 0, 9, d)
    tag = b"\x05" * 16
    hdr = FrameHeader.for_block(key, LAYOUT, 1, tag).pack()
    assert hdr[152:168] == d and FrameHeader.unpack(hdr).token_digest == d
    assert accept(hdr, key, LAYOUT, tag).token_digest == d
    assert accept(hdr, NS.key(9, "t"), LAYOUT, tag)  # a key naming no digest: not checked
    with pytest.raises(FrameError) as e:
        accept(hdr, DigestKey(NS.fingerprint, "t", 0, 9, other), LAYOUT, tag)
    assert e.value.reason == "token_digest"
    legacy = FrameHeader.for_block(NS.key(9, "t"), LAYOUT, 1, tag).pack()  # written without a digest
    assert legacy[152:168] == bytes(16)
    with pytest.raises(FrameError) as e:
        accept(legacy, key, LAYOUT, tag)
    assert e.value.reason == "token_digest"


def test_checksum_frames_write_and_check_the_digest():
    """The G3 writer's fast header path and the readers' batched checks (host verify_many, device and layer-wise
    check_headers) take the digest as the slow path does."""
    cf = ChecksumFrames(NS.fingerprint_bytes, LAYOUT, 1)
    bb = LAYOUT.bytes_per_block
    payloads = [np.full(bb, i, np.uint8) for i in range(3)]
    digs = [bytes([i]) * 16 for i in range(1, 4)]
    tag = b"\x07" * 16
    hdrs = np.zeros((3, frame.HEADER_BYTES), np.uint8)
    for j in range(3):
        cf.write_header(hdrs[j].data, 0, tag, 0, 40 + j, frame.payload_checksum(payloads[j]), 1,
                        token_digest=digs[j] if j < 2 else None)  # row 2: written without one
    assert bytes(hdrs[0, 152:168]) == digs[0] and bytes(hdrs[2, 152:168]) == bytes(16)
    seqs, tags = [40, 41, 42], [tag] * 3
    assert cf.verify_many(hdrs, payloads, tags, [0] * 3, seqs).tolist() == [True] * 3  # no digest named
    assert cf.verify_many(hdrs, payloads, tags, [0] * 3, seqs, [digs[0], None, digs[2]]).tolist() == [True, True, False]
    assert cf.verify_many(hdrs, payloads, tags, [0] * 3, seqs, [digs[1], digs[1], None]).tolist() == [False, True, True]
    ok, _ = cf.check_headers(hdrs, tags, [0] * 3, seqs, digests=[digs[0], digs[0], None])
    assert ok.tolist() == [True, False, True]
    assert cf.verify(hdrs[0], payloads[0], tag, 0, 40, digs[0])
    assert not cf.verify(hdrs[0], payloads[0], tag, 0, 40, digs[1])
    assert cf.verify(hdrs[0], payloads[0], tag, 0, 40)
    # the header the fast path writes is the one FrameHeader packs for the DigestKey (one format)
    key = DigestKey(NS.fingerprint, "", 0, 40, digs[0])
    h = FrameHeader.unpack(hdrs[0])
    assert h.token_digest == digs[0] and accept(hdrs[0], key, LAYOUT, tag, world=1)


def test_block_key_tuples_unchanged():
    assert BlockKey._fields == ("namespace", "tenant", "rank", "seq_hash")


def test_a_digest_key_cannot_be_made_without_its_digest():
    """``_make`` (namedtuple's constructor from an iterable) would give a DigestKey with no digest, read as "not
    checked": refused. ``_replace`` keeps the digest and refuses unknown fields."""
    k = DigestKey(NS.fingerprint, "t", 0, 5, b"\x09" * 16)
    with pytest.raises(TypeError, match="names its token digest"):
        DigestKey._make(tuple(k))
    with pytest.raises(ValueError, match="unknown fields"):
        k._replace(seq=6)
    assert k._replace(seq_hash=6) == NS.key(6, "t") and k._replace(seq_hash=6).token_digest == b"\x09" * 16


def test_an_encrypted_frame_binds_its_token_digest_in_the_aad():
    """Version 2 (docs/format.md "Token digest"): an encrypted frame's AEAD additional data ends with its token
    digest, so a digest changed in the store fails the GCM tag. Other frames, and frames without one, stay version 1
    (readers from before know only version 1: to them a version 2 frame is a miss, never dropped)."""
    d = b"\x33" * 16
    key = DigestKey(NS.fingerprint, "t", 0, 9, d)
    h = FrameHeader.for_block(key, LAYOUT, 1, b"\x05" * 16)
    base = frame.identity_bytes(NS.fingerprint_bytes, b"\x05" * 16, 0, 1, 9, LAYOUT)
    assert h.identity_bytes() == base  # version 1: unchanged
    h.version, h.flags = frame.DIGEST_AAD_VERSION, frame.FLAG_ENCRYPTED
    assert h.identity_bytes() == base + d and frame.bound_aad(h, base) == base + d
    assert FrameHeader.unpack(h.pack()).version == 2
    h.flags = frame.FLAG_CHECKSUM  # version 2 is only ever an encrypted frame
    with pytest.raises(FrameError) as e:
        FrameHeader.unpack(h.pack())
    assert e.value.reason == "version"
