"""Device loads into one ``[n, bytes_per_block]`` matrix (kvbm_backend.gpu.rows) and reads in file order.

A load into a matrix must write exactly the verified rows (a miss leaves its row untouched), whatever order
the slots lie in on disk; slots the G3 writer striped over several files are read as one run per file, not
one read per block (each read and each per-block tensor object costs GIL hand-offs beside a busy engine).
Runs on the CPU device (host mode) over real frames in real files and through the real pools.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvbm_backend.gpu.host_path import load_via_host
from kvbm_backend.gpu.rows import MAX_RUN_COPIES, BlockRows, is_matrix, runs
from kvbm_backend.pool.base import is_tensor_batch
from kvbm_backend.pool.g3.read.device import DeviceLoader
from kvbm_backend.transfer import contiguous_runs, file_order
from tests.gpu.test_gpu_path import BPB, NS, SLOT, FileSlots, _blocks
from tests.helpers.pools import open_g3


class StripedSlots:
    """Frames striped over ``files`` real files as the G3 writer places them: key k in file ``k % files`` at
    slot ``k // files`` (a SlotLeaseSource)."""

    def __init__(self, tmp_path, keys, payloads, files=4):
        self.parts = [FileSlots(tmp_path / f"slab-{f}", keys[f::files], payloads[f::files]) for f in range(files)]
        self.part_of = {k: self.parts[i % files] for i, k in enumerate(keys)}
        self.dropped = []

    def lease(self, keys, timeout_s=None):
        return [self.part_of[k].lease([k])[0] if k in self.part_of else None for k in keys]

    def release(self, leases):
        pass

    def drop_corrupt(self, key, reason):
        self.dropped.append((key, reason))


def test_runs_and_matrix_detection():
    assert list(runs([4, 5, 6, 0, 1], [0, 1, 2, 3, 4])) == [(4, 0, 3), (0, 3, 2)]
    assert list(runs([0, 1, 2], [0, 2, 3])) == [(0, 0, 1), (1, 2, 2)]
    m = torch.zeros((3, BPB), dtype=torch.uint8)
    assert is_matrix(m) and is_tensor_batch(m) and not is_matrix(list(m))
    assert is_tensor_batch(list(m)) and not is_tensor_batch([]) and not is_tensor_batch([np.zeros(4, np.uint8)])


def test_block_rows_names_what_is_wrong():
    with pytest.raises(ValueError, match=r"out: need a \[n, 3072-byte rows\]"):
        BlockRows(torch.zeros((2, BPB + 1), dtype=torch.uint8), BPB)
    with pytest.raises(ValueError, match=r"out: need"):
        BlockRows(torch.zeros((2, BPB, 2), dtype=torch.uint8)[:, :, 0], BPB)  # rows not contiguous
    with pytest.raises(ValueError, match=r"dst\[1\]: need a contiguous tensor of 3072 bytes"):
        BlockRows([torch.zeros(BPB, dtype=torch.uint8), torch.zeros(BPB - 1, dtype=torch.uint8)], BPB)
    bf16 = torch.zeros((2, BPB // 2), dtype=torch.bfloat16)  # any dtype whose rows are the block's bytes
    assert len(BlockRows(bf16, BPB)) == 2


@pytest.mark.parametrize("order", ["runs", "scattered"])
def test_copy_in_writes_exactly_the_given_rows(order):
    n = 12
    src = torch.arange(n * (BPB + 64), dtype=torch.int64).to(torch.uint8).view(n, BPB + 64)[:, 32:32 + BPB]
    dst = torch.full((n, BPB), 7, dtype=torch.uint8)
    if order == "runs":
        d_rows, s_rows = [0, 1, 2, 6, 7], [3, 4, 5, 0, 1]
    else:  # more runs than MAX_RUN_COPIES: one index_copy_
        d_rows = [0, 4, 8, 1, 5, 9, 2, 10]
        s_rows = [0, 1, 2, 3, 4, 6, 7, 8]
        assert len(list(runs(d_rows, s_rows))) > MAX_RUN_COPIES
    BlockRows(dst, BPB).copy_in(d_rows, src, s_rows)
    for d in range(n):
        want = src[s_rows[d_rows.index(d)]] if d in d_rows else torch.full((BPB,), 7, dtype=torch.uint8)
        assert torch.equal(dst[d], want), d


def test_file_order_makes_one_read_per_file():
    where = {k: (f"f{k % 4}", (k // 4) * SLOT) for k in range(16)}
    rows = file_order(range(16), where.__getitem__)
    assert rows == [0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15]
    spans = [(where[r][0], where[r][1], SLOT) for r in rows]
    assert contiguous_runs(spans) == [(0, 4), (4, 4), (8, 4), (12, 4)]
    assert len(contiguous_runs([(where[r][0], where[r][1], SLOT) for r in range(16)])) == 16  # key order


def test_striped_load_into_matrix_reads_runs_and_leaves_misses_untouched(tmp_path):
    n = 16
    keys = NS.keys(list(range(1, n + 1)), "t", 0)
    payloads = _blocks(n, seed=3)
    src = StripedSlots(tmp_path, keys, payloads)
    bad = 6  # corrupt one payload byte on disk: a miss, dropped, its row untouched
    part = src.part_of[keys[bad]]
    ls = part.lease([keys[bad]])[0]
    with open(part.path, "r+b") as f:
        f.seek(ls.offset + 4096 + 10)
        b = f.read(1)
        f.seek(ls.offset + 4096 + 10)
        f.write(bytes([b[0] ^ 1]))
    missing = NS.key(999, "t", 0)
    load_keys = keys[:10] + [missing] + keys[10:]
    staging = torch.full((n + 3, BPB), 0xAB, dtype=torch.uint8)
    out = staging[1:1 + len(load_keys)]  # a slice of rows, as the connector passes its load staging
    rd = DeviceLoader(src, NS.layout, "cpu", timeout_s=60)
    try:
        why = []
        ok = rd.load(load_keys, out, why)
        stats = rd.stats()
    finally:
        rd.close()
    want_ok = [i != bad and k != missing for i, k in enumerate(load_keys)]
    assert ok == want_ok, why
    assert why[bad] == "devcheck" and why[10] == "not_found"
    assert src.dropped == [(keys[bad], "devcheck")]
    for i, k in enumerate(load_keys):
        row = out[i].numpy()
        if ok[i]:
            assert np.array_equal(row, payloads[keys.index(k)]), i
        else:
            assert (row == 0xAB).all(), f"row {i} written on a miss"
    assert (staging[0] == 0xAB).all() and (staging[-1] == 0xAB).all()
    assert stats["reads"] == 4, stats  # one run per file; in key order every block was its own read


def test_g3_pool_get_into_matrix(tmp_path):
    g3 = open_g3(tmp_path, NS)
    try:
        keys = NS.keys(list(range(1, 9)), "t", 0)
        payloads = _blocks(8, seed=5)
        assert g3.put(keys, payloads).result(timeout=60).written == 8
        out = torch.zeros((9, BPB), dtype=torch.uint8)
        res = g3.get(keys + [NS.key(77, "t", 0)], out).result(timeout=60)
        assert res.ok == [True] * 8 + [False]
        assert all(np.array_equal(out[i].numpy(), payloads[i]) for i in range(8))
        assert not out[8].any()
    finally:
        g3.close()


@pytest.mark.parametrize("chunk_rows", [None, 2], ids=["one_chunk", "chunks_of_2"])
def test_load_via_host_into_matrix_copies_only_verified_rows(tmp_path, chunk_rows):
    """Any pool taking numpy buffers: one get per chunk into its staging buffer, then its verified rows (in
    chunks of 2 rows: 3 gets through 2 reused buffers, the miss in the middle one)."""
    from kvbm_backend.gpu.host_path import CHUNK_BYTES
    g3 = open_g3(tmp_path, NS)
    try:
        keys = NS.keys(list(range(1, 7)), "t", 0)
        payloads = _blocks(6, seed=8)
        assert g3.put(keys[:3] + keys[4:], payloads[:3] + payloads[4:]).result(timeout=60).written == 5
        out = torch.full((6, BPB), 0x5A, dtype=torch.uint8)
        ok = load_via_host(g3, keys, out, timeout_s=60, chunk_bytes=chunk_rows * BPB if chunk_rows else CHUNK_BYTES)
        assert ok == [True, True, True, False, True, True]
        for i in range(6):
            if ok[i]:
                assert np.array_equal(out[i].numpy(), payloads[i])
        assert (out[3] == 0x5A).all()
    finally:
        g3.close()


def _torch_calls(fn):
    """Calls into torch's C functions and tensor methods made by ``fn()`` on any thread (each gives the GIL up
    and retakes it, and each view it makes costs more hand-offs when freed)."""
    import sys
    import threading
    calls = 0
    mu = threading.Lock()

    def prof(frame, event, arg):
        nonlocal calls
        if event == "c_call" and (type(getattr(arg, "__self__", None)).__module__.startswith("torch")
                                  or (getattr(arg, "__module__", None) or "").startswith("torch")):
            with mu:
                calls += 1
    threading.setprofile(prof)
    sys.setprofile(prof)
    try:
        fn()
    finally:
        threading.setprofile(None)
        sys.setprofile(None)
    return calls


def test_a_matrix_load_makes_no_torch_call_per_block(tmp_path):
    """Beside an engine step loop running Python, every GIL hand-off of a load waits up to the switch
    interval: on a lent H100 the connector's G3 loads fell from 26 GB/s to 0.06 (5 ms) / 0.72 GB/s (0.5 ms)
    with ~7 hand-offs per 2 MiB block, from per-block tensor views (rows, copy-out) and one read per block.
    A load into a matrix now makes the same number of torch calls for 8 blocks as for 32 (failed before:
    two or more per block: a view of each destination row and of each staging row, one read per block)."""
    keys = NS.keys(list(range(1, 33)), "t", 0)
    payloads = _blocks(32, seed=11)
    src = StripedSlots(tmp_path, keys, payloads)
    rd = DeviceLoader(src, NS.layout, "cpu", timeout_s=60)
    try:
        counts = {}
        for n in (8, 32):
            out = torch.zeros((n, BPB), dtype=torch.uint8)
            rd.load(keys[:n], out)  # warm: the staging ring is sized for this many rows
            counts[n] = _torch_calls(lambda n=n, out=out: rd.load(keys[:n], out))
            assert all(np.array_equal(out[i].numpy(), payloads[i]) for i in range(n))
    finally:
        rd.close()
    assert counts[32] - counts[8] < 4, counts
