"""The stored frame: round trip, rejection of anything not exactly the requested block."""
import numpy as np
import pytest

from kvbm_backend.model import frame as fr
from kvbm_backend.model.layout import KvLayout
from kvbm_backend.model.namespace import Namespace, tenant_tag

LAY = KvLayout(2, 2, 16, 64)
NS = Namespace("model", LAY)


def _frame(key, payload):
    h = fr.FrameHeader.for_block(key, LAY, 1, tenant_tag(key.tenant), integrity=fr.payload_checksum(payload))
    return h.pack()


def test_round_trip_and_verify():
    payload = np.random.default_rng(1).integers(0, 256, LAY.bytes_per_block, dtype=np.uint8)
    key = NS.key(0xDEADBEEF, "t1")
    hdr = fr.FrameHeader.unpack(_frame(key, payload))
    hdr.check_identity(key, LAY, tenant_tag("t1"))
    fr.verify_payload(hdr, payload)
    assert fr.slot_bytes(LAY.bytes_per_block) % 4096 == 0


@pytest.mark.parametrize("mutate,reason", [
    (lambda b: b.__setitem__(0, 0), "magic"),
    (lambda b: b.__setitem__(8, 9), "version"),
    (lambda b: b.__setitem__(50, b[50] ^ 1), "header_check"),
])
def test_header_damage_rejected(mutate, reason):
    key = NS.key(7, "t")
    b = bytearray(_frame(key, np.zeros(LAY.bytes_per_block, np.uint8)))
    mutate(b)
    with pytest.raises(fr.FrameError) as e:
        fr.FrameHeader.unpack(b)
    assert e.value.reason == reason


def test_identity_mismatches_rejected():
    payload = np.zeros(LAY.bytes_per_block, np.uint8)
    key = NS.key(7, "t")
    hdr = fr.FrameHeader.unpack(_frame(key, payload))
    for other, ttag in [(NS.key(8, "t"), tenant_tag("t")), (NS.key(7, "u"), tenant_tag("u")),
                        (Namespace("other", LAY).key(7, "t"), tenant_tag("t"))]:
        with pytest.raises(fr.FrameError, match="identity"):
            hdr.check_identity(other, LAY, ttag)
    with pytest.raises(fr.FrameError, match="layout"):
        hdr.check_identity(key, KvLayout(2, 2, 16, 32), tenant_tag("t"))


def test_bit_flip_in_payload_detected():
    payload = np.arange(LAY.bytes_per_block, dtype=np.uint32).astype(np.uint8)
    hdr = fr.FrameHeader.unpack(_frame(NS.key(1, "t"), payload))
    bad = payload.copy()
    bad[1234] ^= 0x10
    with pytest.raises(fr.FrameError, match="integrity"):
        fr.verify_payload(hdr, bad)


def test_device_checksum_definition():
    data = np.frombuffer(bytes(range(8)) + b"\x01", np.uint8)
    w = [int.from_bytes(bytes(range(0, 4)), "little"), int.from_bytes(bytes(range(4, 8)), "little"), 1]
    assert fr.device_checksum(data) == (1 * w[0] + 2 * w[1] + 3 * w[2]) % 2**64
    flipped = data.copy()
    flipped[0] ^= 1
    assert fr.device_checksum(flipped) != fr.device_checksum(data)


def test_accept_is_every_readers_one_check():
    """``frame.accept``: header damage, identity, layout, TP world, stored length and frame size each
    give their reason; a frame that passes returns its header."""
    key = NS.key(7, "t")
    b = _frame(key, np.zeros(LAY.bytes_per_block, np.uint8))
    bpb = LAY.bytes_per_block
    h = fr.accept(b, key, LAY, tenant_tag("t"), world=1, stored_len=bpb, frame_bytes=fr.HEADER_BYTES + bpb, exact=True)
    assert h.seq_hash == 7 and h.stored_len == bpb
    assert fr.accept(b, key, LAY, tenant_tag("t"), frame_bytes=fr.slot_bytes(bpb)).world == 1  # a padded G3 slot
    cases = [
        (dict(key=NS.key(8, "t")), "identity"),
        (dict(ttag=tenant_tag("u")), "identity"),
        (dict(layout=KvLayout(2, 2, 16, 32)), "layout"),
        (dict(world=2), "identity"),
        (dict(stored_len=bpb + 16), "length"),
        (dict(frame_bytes=fr.HEADER_BYTES + bpb - 1), "length"),
        (dict(frame_bytes=fr.HEADER_BYTES + bpb + 4096, exact=True), "length"),
        (dict(buf=b[:100]), "length"),
        (dict(buf=b"\0" * len(b)), "magic"),
    ]
    for kw, reason in cases:
        args = dict(buf=b, key=key, layout=LAY, ttag=tenant_tag("t"))
        args.update(kw)
        extra = {k: v for k, v in args.items() if k in ("world", "stored_len", "frame_bytes", "exact")}
        with pytest.raises(fr.FrameError) as e:
            fr.accept(args["buf"], args["key"], args["layout"], args["ttag"], **extra)
        assert e.value.reason == reason, (kw, e.value.reason)
