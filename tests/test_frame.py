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
