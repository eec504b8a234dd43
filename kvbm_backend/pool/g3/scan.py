"""G3 warm restart without a journal: rebuild the index of slab files no journal covers from their slot headers.

Every stored frame's 4 KiB header names its block (namespace fingerprint, tenant tag, TP rank, sequence hash),
its layout, its lengths and its payload checksum (docs/format.md "Frame"), so the journal is an index of the
headers, not the only record of them. When the journal is gone (the directory that held it failed or was left
out of ``g3.paths``; its header is damaged) or names only some of the configured directories (a directory that
was left out for a run came back; the journal of that run won), the slab files it does not cover are scanned:
each slot's header is read and checked exactly as a journal entry's is (:func:`.restore.restore`: identity,
layout, lengths, a checksum flag) and the slot is indexed under the key its header names. The payload is
checked on every read as always (invariant 1), so a scan never serves bytes the journal would not have.

What a scan cannot know, the journal knew: which blocks were evicted (their headers stay in slots that were
free when the journal was lost; a block comes back as a hit, which a cache may serve: the bytes are that
block's) and the LRU order (scanned blocks are ordered by the header's write time, ``created_ns``, and placed
before the journal's blocks, to be evicted first). Deleted blocks do not come back: :meth:`.pool.G3Pool.delete`
zeroes their headers (:func:`clear_headers`) before their slots can be reused.

Cost: one 4 KiB read per slot the files cover (their size, not the configured capacity), in chunks of
:data:`CHUNK_SLOTS` through the pool's I/O engine; headers without the frame magic and this namespace's
fingerprint are dropped without parsing (numpy), so empty and foreign slots cost the read only.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Iterator, Sequence

import numpy as np
import numpy.typing as npt

from ...io.base import IoEngine
from ...memory import aligned_empty
from ...model import frame
from ...model.frame import FrameError
from ...model.namespace import BlockKey
from ...transfer import header_extents, plan_ops
from .catalog import HDR, SlotCatalog
from .index import Slot, TagKey
from .slabs import SlabFile

log = logging.getLogger(__name__)

CHUNK_SLOTS = 4096  # headers read per engine submission (16 MiB of buffer)
_FP_AT = 16  # byte offset of ns_fp in the frame header (docs/format.md: magic 8, version 2, flags 2, header_len 4)


def read_headers(cat: SlotCatalog, engine: IoEngine, io_size: int,
                 slots: Sequence[Slot]) -> Iterator[tuple[int, npt.NDArray[np.uint8], list[bool] | None]]:
    """Read the header of each slot of ``slots``, :data:`CHUNK_SLOTS` at a time. Yields ``(start, hdrs,
    readable)`` per chunk: ``hdrs[j * HDR:(j + 1) * HDR]`` is the header of ``slots[start + j]``; ``readable`` is
    None when the chunk's reads all succeeded, else which reads returned the whole header (after a failed chunk
    read each header is read alone, so one bad sector costs its slot, not the chunk)."""
    for c0 in range(0, len(slots), CHUNK_SLOTS):
        part = slots[c0:c0 + CHUNK_SLOTS]
        hdrs = aligned_empty(len(part) * HDR)
        readable = None
        try:
            engine.submit(plan_ops(header_extents(part, hdrs, cat.slot_bytes, HDR, cat.fd_of),
                                   io_size, write=False)).result()
        except OSError as e:
            log.warning("G3 restore: header reads failed (%s); reading %d headers one by one", e, len(part))
            readable = _one_by_one(cat, part, hdrs)
        yield c0, hdrs, readable


def _one_by_one(cat: SlotCatalog, part: Sequence[Slot], hdrs: npt.NDArray[np.uint8]) -> list[bool]:
    out = []
    for j, (fi, si) in enumerate(part):
        try:
            out.append(os.preadv(cat.fd_of(fi), [hdrs[j * HDR:(j + 1) * HDR].data], si * cat.slot_bytes) == HDR)
        except (OSError, KeyError):
            out.append(False)
    return out


def check_header(cat: SlotCatalog, hdr: npt.NDArray[np.uint8], key: BlockKey | TagKey) -> frame.FrameHeader:
    """The check every restored slot passes (journal entry or scan): the header names exactly ``key`` in the
    namespace's layout, TP world and stored length, and carries a payload checksum. Raises FrameError."""
    tag = key.tag if type(key) is TagKey else cat.tag(key.tenant)
    h = frame.accept(hdr, key, cat.layout, tag, world=cat.namespace.tp_world_size, stored_len=cat.block_bytes)
    if not h.flags & frame.FLAG_CHECKSUM:
        raise FrameError("length", "frame carries no checksum")
    return h


def scan(cat: SlotCatalog, engine: IoEngine, io_size: int, files: Sequence[SlabFile],
         held: set[BlockKey | TagKey]) -> list[tuple[TagKey, Slot]]:
    """Index entries of the slots of ``files`` whose headers check (:func:`check_header`) and name a key not
    in ``held`` (the journal's): ``[(key, slot)]`` oldest first by the header's ``created_ns``; a key found in
    several slots keeps its newest. Counts ``restore_scanned_slots`` and ``restored_by_scan`` in ``cat.c`` and
    logs what it did. Reads slots below each file's size and its configured share (``max_slots``)."""
    slots = [(f.index, s) for f in files for s in range(min(f.size_slots, f.max_slots))]
    if not slots:
        return []
    t0 = time.monotonic()
    want = np.frombuffer(frame.MAGIC + bytes.fromhex(cat.fp), dtype=np.uint8)
    found: dict[TagKey, tuple[int, Slot]] = {}
    for c0, hdrs, readable in read_headers(cat, engine, io_size, slots):
        rows = hdrs.reshape(-1, HDR)
        hit = np.flatnonzero((rows[:, :8] == want[:8]).all(axis=1) & (rows[:, _FP_AT:_FP_AT + 8] == want[8:]).all(axis=1))
        for j in hit.tolist():
            if readable is not None and not readable[j]:
                continue
            try:
                h = frame.FrameHeader.unpack(rows[j])
                key = TagKey(cat.fp, h.tenant_tag, h.rank, h.seq_hash)
                check_header(cat, rows[j], key)
                if h.rank >= cat.namespace.tp_world_size:
                    raise FrameError("identity", f"rank {h.rank} of a TP world of {h.world}")
            except FrameError:
                continue
            if key in held:
                continue
            old = found.get(key)
            if old is None or h.created_ns > old[0]:
                found[key] = (h.created_ns, slots[c0 + j])
    out = [(k, slot) for k, (_t, slot) in sorted(found.items(), key=lambda kv: kv[1][0])]
    cat.c["restore_scanned_slots"] += len(slots)
    cat.c["restored_by_scan"] += len(out)
    log.warning("G3: %d slab file(s) not covered by a journal (%s): scanned %d slot headers in %.1f s, %d blocks "
                "restored", len(files), ", ".join(sorted({f.directory for f in files})), len(slots),
                time.monotonic() - t0, len(out))
    return out


def clear_headers(cat: SlotCatalog, slots: Sequence[Slot]) -> int:
    """Zero the header of each of ``slots`` and ``fdatasync`` their files, so a later :func:`scan` cannot bring
    their blocks back (a deleted block must stay deleted even when the journal that recorded the DEL is lost).
    Call holding ``cat.lock`` before the slots are released (a released slot may be written again at once).
    A reader of such a slot meanwhile finds no frame: a miss, never wrong bytes. Returns the headers cleared; a
    failed write or sync is logged, never raised (the journal's DEL record still stands)."""
    if not slots:
        return 0
    zero = aligned_empty(HDR)
    zero[:] = 0
    done, files = 0, set()
    for fi, si in slots:
        try:
            if os.pwritev(cat.fd_of(fi), [zero.data], si * cat.slot_bytes) == HDR:
                done += 1
                files.add(fi)
        except (OSError, KeyError) as e:
            log.warning("G3: cannot clear the header of deleted slot %d of file %d (%s): the block could come back "
                        "after a journal loss", si, fi, e)
    for fi in files:
        try:
            os.fdatasync(cat.fd_of(fi))
        except OSError as e:
            log.warning("G3: fdatasync after clearing headers of file %d failed (%s)", fi, e)
    return done
