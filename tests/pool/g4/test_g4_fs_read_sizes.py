"""file:// store: a read with a cap (``FsStore.get(name, offset, length)``) allocates what the file holds, not the
cap. Before 2026-12 a buffered read allocated (and zeroed) ``length`` bytes whatever the file's size: every pool's
start-up check read namespace.json (a few hundred bytes) into 64 KiB (``NAMESPACE_JSON_MAX``), and each announce
batch read took 64 MiB (``MAX_OBJECT_BYTES + 1``). Found by a CI failure of
test_g4_host_load.py::test_staged_loads_..._allocate_no_payload_buffer: a starved pool's start-up check ran during
the load it measured, 137,470 bytes at the peak against a bound of 131,072. Real files in tmp_path."""
from __future__ import annotations

import tracemalloc

import pytest

from kvbm_backend.pool.g4.announce import MAX_OBJECT_BYTES
from kvbm_backend.pool.g4.fs_store import FsStore
from kvbm_backend.pool.g4.naming import NAMESPACE_JSON_MAX


def _peak_of(fn):
    """``(fn(), bytes allocated at the peak while it ran)`` (tracemalloc: Python and numpy buffers)."""
    tracemalloc.start()
    try:
        got = fn()
        return got, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("cap", [NAMESPACE_JSON_MAX, MAX_OBJECT_BYTES + 1], ids=["namespace_json", "announce"])
def test_a_capped_read_of_a_small_file_allocates_the_file_not_the_cap(tmp_path, cap):
    st = FsStore(tmp_path / "s")
    body = bytes(range(256)) * 3  # 768 bytes
    assert st.put_if_absent("ns/namespace.json", body)
    got, peak = _peak_of(lambda: st.get("ns/namespace.json", 0, cap))
    assert bytes(got) == body
    assert peak < 16 << 10, f"{peak} bytes allocated to read a file of {len(body)} bytes with a cap of {cap}"


def test_capped_and_offset_reads_return_the_same_bytes_as_before(tmp_path):
    """What a read returns is unchanged: ``[offset, offset + length)`` clipped to the file, empty past its end,
    the whole rest with no length; a negative length is still a ValueError."""
    st = FsStore(tmp_path / "s")
    body = bytes(range(256)) * 20 + b"xyz"  # 5123 bytes: not whole 4 KiB blocks (buffered even with no length)
    assert st.put_if_absent("a/obj", body)
    for offset, length in [(0, 10), (0, len(body)), (0, len(body) + 1), (100, 1 << 20), (len(body) - 1, 5),
                           (len(body), 5), (len(body) + 10, 5), (7, 0), (0, None), (4000, None), (len(body) + 1, None)]:
        got = st.get("a/obj", offset, length)
        want = body[offset:] if length is None else body[offset:offset + length]
        assert isinstance(got, bytearray) and bytes(got) == want, (offset, length)
    assert st.get("a/absent", 0, 10) is None
    with pytest.raises(ValueError):
        st.get("a/obj", 0, -1)
