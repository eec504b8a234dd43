"""Room for a G3 write batch: free slots, then evicted ones, then, when the pool is full of writes still in
flight, the room those writes leave once they settle.

A batch's slots stay *reserved* from allocation until its pieces are published or released (writer.py). A
reserved slot cannot be evicted, so when fdatasyncs run slow (a busy or stalled drive) several batches can be
in flight at once on a small pool and a new batch finds neither free nor evictable slots. Before 2026-12-02 the
rest of that batch was dropped (``no_space``) at once: on the busy CI VM, 5 of 12 store jobs of a native
``G3Tier`` with room for 11 chunks failed although the pool could have held each of them in turn (a
reproduction with a 0.5 s ``fdatasync``: 4 puts of 5 blocks into 11 slots, 9 blocks dropped). Now the writer
thread waits for those writes to settle (their published blocks become evictable, their failed slots free)
and allocates again; only what cannot fit once nothing else is in flight (every other slot pinned by loads, or
a batch larger than the pool) is dropped ``no_space``. The wait is on the writer thread, off every caller's
path (invariant 3): puts go on queueing meanwhile, bounded by ``g3.write_queue_blocks`` (``queue_full``).
The batch itself is cut to the pool's capacity when it is formed (:func:`batch_room_slots`), so merged puts
never ask for more than the pool holds.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from .catalog import SlotCatalog
    from .pieces import Slot


def batch_room_slots(cat: SlotCatalog) -> int:
    """Blocks a batch of several puts may hold at most: the pool's usable slots now (at least 1). A single put
    larger than that still forms one batch (its excess is dropped ``no_space``)."""
    return max(1, cat.slabs.capacity_slots)


def reserve_room(cat: SlotCatalog, n: int, run: int, abandoned: Callable[[], bool]) -> tuple[list[Slot], int]:
    """Reserve up to ``n`` slots (``cat.reserved`` grows by as many) for a batch, in runs of ``run`` adjacent
    slots where the files allow: free slots first, then least recently used published blocks evicted (their
    keys noted removed, their headers cleared unless the slot is reused here). While fewer than ``n`` are
    found and other batches' slots are reserved (writes in flight), waits on ``cat.cv`` for them to settle and
    tries again; returns short (the caller drops the rest ``no_space``) once nothing else is in flight or
    ``abandoned()`` (close gave up on the writes in flight).

    Caller holds ``cat.lock`` (``cat.cv``'s lock; released while waiting). Returns ``(slots, evicted)``:
    the slots reserved, and how many published blocks were evicted for them.
    """
    slots: list[Slot] = []
    evicted = 0
    while True:
        want = n - len(slots)
        got = cat.slabs.allocate(want, run)
        if len(got) < want:
            ev = cat.index.evict(want - len(got))
            for _, s in ev:
                cat.slabs.release([s])
            cat.note_removed(k for k, _ in ev)
            evicted += len(ev)
            got += cat.slabs.allocate(want - len(got), run)
            cat.clear_headers(set(s for _, s in ev).difference(got))  # evicted, not reused: no scan finds it
        slots += got
        cat.reserved += len(got)
        others = cat.reserved - len(slots)
        if len(slots) >= n or others <= 0 or abandoned():  # only the writer thread reserves: others only settle
            return slots, evicted
        cat.cv.wait()  # a piece in flight settled (published: evictable; failed: freed), or close gave up
