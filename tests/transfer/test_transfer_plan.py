"""coalesce(): property tests over random extents plus the edge cases."""
from __future__ import annotations

import numpy as np
import pytest

from kvbm_backend.memory import aligned_empty
from kvbm_backend.transfer import IOV_MAX, Extent, coalesce

K4 = 4096


def _random_extents(rng: np.random.Generator, aligned: bool):
    """Random non-overlapping extents over a few fds, shuffled, some adjacent, with random buffers.
    Every buffer is a view into a distinct region of one backing array so we can check coverage."""
    backing = np.zeros(1 << 22, dtype=np.uint8)
    bpos = 0
    extents = []
    for fd in rng.choice([3, 7, 11], size=rng.integers(1, 4), replace=False):
        off = int(rng.integers(0, 8)) * (K4 if aligned else 1)
        for _ in range(rng.integers(1, 12)):
            bufs = []
            for _ in range(rng.integers(0, 6)):
                n = int(rng.integers(0, 80)) * K4 if aligned else int(rng.integers(0, 300_000))
                if bpos + n > backing.size:
                    n = 0
                bufs.append(backing[bpos:bpos + n])
                bpos += n
            extents.append(Extent(int(fd), off, bufs))
            n = sum(b.nbytes for b in bufs)
            gap = 0 if rng.random() < 0.6 else int(rng.integers(1, 5)) * (K4 if aligned else 7)
            off += n + gap
    order = rng.permutation(len(extents))
    return backing, [extents[i] for i in order]


def _placement(backing, pieces):
    """For every byte of ``backing``: how many times it is planned, and the (fd, file offset) it goes to.
    ``pieces``: (fd, offset, bufs) triples; every buffer is a view into ``backing``."""
    count = np.zeros(backing.size, np.int64)
    where_fd = np.full(backing.size, -1, np.int64)
    where_off = np.full(backing.size, -1, np.int64)
    for fd, off, bufs in pieces:
        pos = off
        for b in bufs:
            if b.nbytes:
                i0 = b.ctypes.data - backing.ctypes.data
                idx = np.arange(i0, i0 + b.nbytes)
                np.add.at(count, idx, 1)
                where_fd[idx] = fd
                where_off[idx] = np.arange(pos, pos + b.nbytes)
            pos += b.nbytes
    return count, where_fd, where_off


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("aligned", [True, False])
def test_random_extents_cover_every_byte_once(seed, aligned):
    rng = np.random.default_rng(seed)
    backing, extents = _random_extents(rng, aligned)
    io_size = int(rng.choice([K4, 3 * K4, 64 * K4, 256 * K4, 5000, 1 << 20]))
    ops = coalesce(extents, io_size, write=bool(seed % 2))

    total_in = sum(e.nbytes for e in extents)
    assert sum(op.nbytes for op in ops) == total_in

    # ops do not overlap in file space, are sorted, bounded, never empty
    limit = max(io_size, K4)
    prev = {}
    for op in ops:
        assert op.write == bool(seed % 2)
        assert 0 < op.nbytes <= limit
        assert len(op.bufs) <= IOV_MAX
        assert all(b.nbytes > 0 for b in op.bufs)
        assert op.offset >= prev.get(op.fd, -1)
        prev[op.fd] = op.offset + op.nbytes
        if aligned:
            assert op.offset % K4 == 0 and op.nbytes % K4 == 0
            assert all(b.nbytes % K4 == 0 for b in op.bufs)

    # every host byte lands at the same (fd, offset) as in the extents, and is planned exactly once
    want = _placement(backing, [(e.fd, e.offset, e.bufs) for e in extents])
    got = _placement(backing, [(op.fd, op.offset, op.bufs) for op in ops])
    assert want[0].max() <= 1  # the generator's own invariant
    assert np.array_equal(got[0], want[0])
    assert np.array_equal(got[1], want[1]) and np.array_equal(got[2], want[2])

    # ops never span a gap: each op's range lies inside one merged run of the input
    runs = {}
    for e in sorted(extents, key=lambda e: (e.fd, e.offset)):
        if e.nbytes == 0:
            continue
        r = runs.setdefault(e.fd, [])
        if r and r[-1][1] == e.offset:
            r[-1][1] += e.nbytes
        else:
            r.append([e.offset, e.offset + e.nbytes])
    for op in ops:
        assert any(a <= op.offset and op.offset + op.nbytes <= b for a, b in runs[op.fd])
    # maximal merging: the number of ops is the minimum the size cap allows per run (within slack)
    for fd, r in runs.items():
        n_ops = sum(1 for op in ops if op.fd == fd)
        assert n_ops >= len(r)


def test_adjacent_blocks_merge_into_one_op_and_cut_at_io_size():
    blocks = [aligned_empty(64 * K4) for _ in range(8)]  # 256 KiB blocks
    # slots 0..7 of fd 5 given out of order
    extents = [Extent(5, i * 64 * K4, [blocks[i]]) for i in [3, 0, 7, 1, 2, 6, 5, 4]]
    ops = coalesce(extents, 1 << 20, write=True)
    assert [(op.offset, op.nbytes, len(op.bufs)) for op in ops] == [(0, 1 << 20, 4), (1 << 20, 1 << 20, 4)]
    assert all(op.bufs[j] is blocks[i * 4 + j] for i, op in enumerate(ops) for j in range(4))


def test_large_buffer_split_into_aligned_views():
    big = aligned_empty(10 * (1 << 20) + 3 * K4)
    ops = coalesce([Extent(4, 8 * K4, [big])], 1 << 20, write=False)
    assert len(ops) == 11
    assert [op.nbytes for op in ops] == [1 << 20] * 10 + [3 * K4]
    for i, op in enumerate(ops):
        assert op.offset == 8 * K4 + i * (1 << 20)
        assert op.bufs[0].ctypes.data == big.ctypes.data + i * (1 << 20)  # views, not copies
        assert np.shares_memory(op.bufs[0], big)


def test_odd_io_size_rounds_split_to_4k():
    big = aligned_empty(40 * K4)
    ops = coalesce([Extent(4, 0, [big])], 3 * K4 + 100, write=False)
    assert all(op.nbytes % K4 == 0 for op in ops)
    assert sum(op.nbytes for op in ops) == big.nbytes


def test_iov_max_respected():
    tiny = [aligned_empty(K4) for _ in range(3000)]
    ops = coalesce([Extent(9, 0, tiny)], 1 << 30, write=True)
    assert [len(op.bufs) for op in ops] == [IOV_MAX, IOV_MAX, 3000 - 2 * IOV_MAX]
    assert [op.offset for op in ops] == [0, IOV_MAX * K4, 2 * IOV_MAX * K4]


def test_gap_and_other_file_split_runs():
    a, b, c = (aligned_empty(K4) for _ in range(3))
    ops = coalesce([Extent(1, 0, [a]), Extent(1, 2 * K4, [b]), Extent(2, K4, [c])], 1 << 20, write=False)
    assert [(op.fd, op.offset, op.nbytes) for op in ops] == [(1, 0, K4), (1, 2 * K4, K4), (2, K4, K4)]


def test_empty_inputs():
    assert coalesce([], 1 << 20, write=True) == []
    assert coalesce([Extent(1, 0, []), Extent(1, 0, [np.empty(0, np.uint8)])], 1 << 20, write=True) == []


def test_bad_input_named():
    a = aligned_empty(2 * K4)
    with pytest.raises(ValueError, match="overlap"):
        coalesce([Extent(1, 0, [a]), Extent(1, K4, [a])], 1 << 20, write=True)
    with pytest.raises(ValueError, match="io_size"):
        coalesce([Extent(1, 0, [a])], 0, write=True)
    with pytest.raises(ValueError, match="negative"):
        coalesce([Extent(1, -K4, [a])], K4, write=True)
    with pytest.raises(ValueError, match="uint8"):
        coalesce([Extent(1, 0, [np.zeros(4, np.float32)])], K4, write=True)
    with pytest.raises(ValueError, match="contiguous"):
        coalesce([Extent(1, 0, [a[::2]])], K4, write=True)
    with pytest.raises(TypeError, match="numpy"):
        coalesce([Extent(1, 0, [b"abc"])], K4, write=True)


# ---- slot planning (transfer/slots.py): G3 slot runs -> extents cut at io_size -> ops ----------------
def test_staged_slot_runs_become_io_size_ops_on_file_boundaries():
    from kvbm_backend.transfer import plan_ops, staged_run_extents
    slot = 5 * K4  # 20 KiB slots: io_size 64 KiB boundaries fall inside slots
    slots = [(0, 2), (0, 3), (0, 4), (1, 0), (1, 1), (0, 9)]  # two runs in file 0, one in file 1
    stage = aligned_empty(len(slots) * slot)
    fds = {0: 30, 1: 31}
    ext = staged_run_extents(slots, stage, slot, 16 * K4, fds.__getitem__)
    assert [(e.fd, e.offset, e.nbytes) for e in ext] == [(30, 2 * slot, 3 * slot), (31, 0, 2 * slot),
                                                        (30, 9 * slot, slot)]
    ops = plan_ops(ext, 16 * K4, write=True)
    for op in ops:  # at most io_size, 4 KiB aligned, views of stage
        assert op.nbytes <= 16 * K4 and op.offset % K4 == 0 and op.nbytes % K4 == 0
        assert all(np.shares_memory(b, stage) for b in op.bufs)
    assert sum(op.nbytes for op in ops) == stage.nbytes


def test_slot_extent_and_cut_at():
    from kvbm_backend.transfer import cut_at, slot_extent
    hdr, body = aligned_empty(K4), aligned_empty(7 * K4)
    e = slot_extent(5, 3, 8 * K4, [hdr, body], 16 * K4)
    assert e.offset == 24 * K4 and [b.nbytes for b in e.bufs] == [K4, 7 * K4]  # 24..32 KiB: one window
    e = slot_extent(5, 1, 8 * K4, [hdr, body], 12 * K4)  # 8..16 KiB crosses the 12 KiB boundary
    assert [b.nbytes for b in e.bufs] == [K4, 3 * K4, 4 * K4]
    assert cut_at([body], 0, 1 << 20)[0] is body  # uncut buffers are passed through as is


# ---- device-loader planning (transfer/slots.py): leased slots -> runs (reads) and passes ---------------
def test_contiguous_runs_merge_adjacent_spans_of_one_file_only():
    from kvbm_backend.transfer import contiguous_runs
    slot = 9 * K4
    spans = [("a", 0, slot), ("a", slot, slot), ("a", 5 * slot, slot),  # gap after the second
             ("b", 6 * slot, slot), ("b", 7 * slot, slot), ("b", 8 * slot, slot), ("a", 9 * slot, slot)]
    assert contiguous_runs(spans) == [(0, 2), (2, 1), (3, 3), (6, 1)]  # another file never continues a run
    assert contiguous_runs(spans, max_bytes=2 * slot) == [(0, 2), (2, 1), (3, 2), (5, 1), (6, 1)]
    assert contiguous_runs(spans, max_bytes=slot // 2) == [(i, 1) for i in range(7)]  # >= one span per run
    assert contiguous_runs([]) == []
    # spans of other lengths: adjacency is by bytes, the cut by the run's bytes
    assert contiguous_runs([(0, 0, K4), (0, K4, 3 * K4), (0, 4 * K4, K4), (0, 6 * K4, K4)],
                           max_bytes=4 * K4) == [(0, 2), (2, 1), (3, 1)]


@pytest.mark.parametrize("seed", range(5))
def test_contiguous_runs_cover_every_span_once_and_match_staged_extents(seed):
    from kvbm_backend.transfer import contiguous_runs, staged_run_extents
    rng = np.random.default_rng(seed)
    slot = 3 * K4
    slots = [(int(rng.integers(0, 2)), int(rng.integers(0, 6))) for _ in range(int(rng.integers(1, 30)))]
    spans = [(fi, si * slot, slot) for fi, si in slots]
    cap = int(rng.integers(1, 5)) * slot
    runs = contiguous_runs(spans, max_bytes=cap)
    assert [j for f, c in runs for j in range(f, f + c)] == list(range(len(slots)))
    for f, c in runs:
        assert c == 1 or c * slot <= cap
        assert all(slots[j][0] == slots[f][0] and slots[j][1] == slots[f][1] + j - f for j in range(f, f + c))
    # staged_run_extents uses the same run rule (uncut)
    ext = staged_run_extents(slots, aligned_empty(len(slots) * slot), slot, 1 << 30, lambda fi: fi)
    assert [(e.fd, e.offset, e.nbytes) for e in ext] == [
        (slots[f][0], slots[f][1] * slot, c * slot) for f, c in contiguous_runs(spans)]


def test_group_passes_one_slot_length_each_bounded_by_staging():
    from kvbm_backend.transfer import group_passes
    rows = [(0, 8 * K4), (1, 8 * K4), (2, 4 * K4), (3, 8 * K4), (4, 4 * K4), (5, 8 * K4)]
    assert group_passes(rows, 16 * K4) == [([0, 1], 8 * K4), ([3, 5], 8 * K4), ([2, 4], 4 * K4)]
    assert group_passes(rows, K4) == [([0], 8 * K4), ([1], 8 * K4), ([3], 8 * K4), ([5], 8 * K4),
                                      ([2], 4 * K4), ([4], 4 * K4)]  # a pass holds at least one row
    assert group_passes([], K4) == []
