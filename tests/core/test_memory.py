"""memory.BufferPool: the one staging-buffer pool (reuse by size, cap, arena, kinds, errors)."""
from __future__ import annotations

import threading

import pytest

from kvbm_backend.memory import ALIGN, HUGE, BufferPool, is_aligned


@pytest.mark.parametrize("kind", ["host", "thp", "pinned"])
def test_take_is_exact_aligned_and_reused(kind):
    bp = BufferPool(kind, keep_bytes=1 << 20)
    a = bp.take(8192)
    assert a.nbytes == 8192 and is_aligned(a, ALIGN)
    if kind == "thp":
        assert a.ctypes.data % HUGE == 0
    a[:] = 7
    bp.give(a)
    b = bp.take(8192)
    assert b.ctypes.data == a.ctypes.data and bp.reused == 1 and bp.allocated == 1
    c = bp.take(8192)  # the free list is empty again: a fresh one, not the lent one
    assert c.ctypes.data != b.ctypes.data and bp.allocated == 2


def test_cap_drops_past_keep_bytes_and_evicts_other_sizes_first():
    bp = BufferPool("host", keep_bytes=3 * 4096)
    small = [bp.take(4096) for _ in range(3)]
    for s in small:
        bp.give(s)
    assert bp.stats()["kept_bytes"] == 3 * 4096
    big = bp.take(2 * 4096)  # new size: the stale 4 KiB ones make room for it
    bp.give(big)
    st = bp.stats()
    assert st["kept_bytes"] <= 3 * 4096
    assert bp.take(2 * 4096).ctypes.data == big.ctypes.data
    huge = bp.take(8 * 4096)  # larger than the whole cap: never kept, nothing else dropped for it
    before = bp.stats()["kept_bytes"]
    bp.give(huge)
    assert bp.stats()["kept_bytes"] == before


def test_arena_is_preallocated_kept_past_the_cap_and_survives_clear():
    bp = BufferPool("thp", keep_bytes=0, arena=(4, 16384))
    st = bp.stats()
    assert st["arena_bytes"] == 4 * 16384 and st["kept_bytes"] == 0
    got = [bp.take(16384) for _ in range(4)]
    assert bp.allocated == 0 and len({g.ctypes.data for g in got}) == 4
    extra = bp.take(16384)  # arena exhausted: allocates, never waits
    assert bp.allocated == 1
    for g in got + [extra]:
        bp.give(g)
    bp.clear()
    again = [bp.take(16384) for _ in range(4)]
    assert {g.ctypes.data for g in again} == {g.ctypes.data for g in got} and bp.allocated == 1


def test_lend_gives_back_on_error_and_threads_never_share_a_buffer():
    bp = BufferPool("host", keep_bytes=64 << 10, arena=(2, 4096))
    with pytest.raises(RuntimeError):
        with bp.lend(4096) as b:
            addr = b.ctypes.data
            raise RuntimeError("boom")
    assert bp.take(4096).ctypes.data == addr
    held, lock, clash = set(), threading.Lock(), []

    def worker():
        for _ in range(200):
            with bp.lend(4096) as buf:
                with lock:
                    if buf.ctypes.data in held:
                        clash.append(buf.ctypes.data)
                    held.add(buf.ctypes.data)
                with lock:
                    held.discard(buf.ctypes.data)

    ts = [threading.Thread(target=worker) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not clash


@pytest.mark.parametrize("kw, field", [({"kind": "gpu"}, "kind"), ({"keep_bytes": -1}, "keep_bytes"),
                                       ({"arena": (2, 0)}, "arena")])
def test_bad_arguments_name_the_field(kw, field):
    with pytest.raises(ValueError, match=f"BufferPool.{field}"):
        BufferPool(**kw)


def test_raise_keep_only_grows_the_cap_and_keeps_more():
    bp = BufferPool("host", keep_bytes=4096)
    assert bp.raise_keep(2 * 4096) == 2 * 4096
    assert bp.raise_keep(4096) == 2 * 4096 and bp.keep_bytes == 2 * 4096  # never lowered
    a, b = bp.take(4096), bp.take(4096)
    bp.give(a)
    bp.give(b)  # both kept under the raised cap
    assert bp.stats()["kept_bytes"] == 2 * 4096
    assert {bp.take(4096).ctypes.data, bp.take(4096).ctypes.data} == {a.ctypes.data, b.ctypes.data}
