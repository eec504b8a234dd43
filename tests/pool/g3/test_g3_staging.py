"""G3 staging buffers: aligned for O_DIRECT (2 MiB, for transparent huge pages), pre-faulted, reused,
and a change of the sizes in use does not leave the free list full of stale sizes."""
from __future__ import annotations

from kvbm_backend.memory import HUGE
from kvbm_backend.pool.g3.staging import populated, staging_pool


def test_populated_is_huge_page_aligned_and_writable():
    a = populated(3 * HUGE + 4096)
    assert a.nbytes == 3 * HUGE + 4096 and a.ctypes.data % HUGE == 0
    a[:] = 7
    assert int(a[-1]) == 7 and int(a[0]) == 7


def test_reuse_and_stale_sizes_released_over_cap():
    pool = staging_pool(keep_bytes=4 << 20)
    a = pool.take(2 << 20)
    b = pool.take(2 << 20)
    pool.give(a)
    pool.give(b)
    assert pool.allocated == 2
    x = pool.take(2 << 20)
    assert x is b and pool.allocated == 2  # reused, not allocated
    pool.give(x)  # free now: a and b (2 MiB each, the cap)
    c = pool.take(1 << 20)  # another size in use now
    assert pool.allocated == 3
    pool.give(c)  # over the cap: a stale 2 MiB buffer is released so the 1 MiB one is kept
    assert pool.take(1 << 20) is c and pool.allocated == 3
    big = pool.take(8 << 20)
    pool.give(big)  # larger than the cap: not kept, nothing else dropped for it
    assert pool.take(8 << 20) is not big
