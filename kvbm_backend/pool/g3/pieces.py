"""A G3 write batch cut into pieces, and the frames a piece writes.

:class:`_Job` is one ``put`` queued; :class:`_Batch` the jobs written together; :class:`_Piece` ~``chunk_bytes``
of a batch, written and published together. :class:`PieceFramer` turns a piece into extents: per block a
frame (4 KiB header with the payload's xxh3_128, the payload, zero padding) into its slot, either staged
(small or unaligned blocks: one slot image per piece) or zero-copy from the caller's buffers.
"""
from __future__ import annotations

import copy
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np
import xxhash

from ...memory import BufferPool, is_aligned
from ...model.frame import ALIGN, ChecksumFrames, align_up, key_digest
from ...model.namespace import BlockKey
from ...transfer import Extent, slot_extent, staged_run_extents
from ..base import BlockBuffer, PutResult
from .catalog import HDR, SlotCatalog

#: a G3 slot: (file index, slot index in the file)
Slot = tuple[int, int]


@dataclass
class _Job:
    keys: list[BlockKey]
    blocks: list[BlockBuffer]
    future: Future[PutResult]
    result: PutResult
    checks: list[int] | None = None  # per block: device_checksum of the payload, or None
    # keys deleted while queued/written and put again meanwhile: a later job writes them, this one must not publish
    lost: set[BlockKey] = field(default_factory=set)
    gone: bool = False  # resolved by a close that gave up on it (abandon_locked): later settling must not resolve it


def abandon_locked(batches: Iterable["_Batch"], cat: SlotCatalog) -> list[tuple[Future[PutResult], PutResult]]:
    """A closing pool gave up waiting for ``batches`` (their writes or flushes hang): each job's blocks not yet
    accounted for are dropped (``closed``) and the job is marked ``gone`` (its later settling resolves nothing and
    publishes nothing, see ``G3Writer._settle``). Caller holds ``cat``'s lock. Returns (future, a copy of its
    result) to resolve once the lock is released."""
    out: list[tuple[Future[PutResult], PutResult]] = []
    for b in batches:
        for job in b.jobs:
            if job.gone or job.future.done():
                continue
            job.gone = True
            r = copy.copy(job.result)
            left = len(job.keys) - r.written - r.skipped - r.dropped
            if left > 0:
                r.dropped += left
                cat.drop("closed", left)
            out.append((job.future, r))
    return out


def live_blocks(jobs: list[_Job], cancelled: set[BlockKey]) -> tuple[
        list[_Job], list[BlockKey], list[BlockBuffer], list[int | None], list[tuple[_Job, BlockKey]]]:
    """The blocks of ``jobs`` to write, as parallel lists (per block: its job, key, block, device checksum or
    None), and ``(job, key)`` of those not to write: deleted while queued (``cancelled``, the writer's set) or
    put again since by another job (``job.lost``)."""
    lj: list[_Job] = []
    lk: list[BlockKey] = []
    lb: list[BlockBuffer] = []
    lc: list[int | None] = []
    gone: list[tuple[_Job, BlockKey]] = []
    for job in jobs:
        jc: Sequence[int | None] = job.checks if job.checks is not None else [None] * len(job.keys)
        if not cancelled and not job.lost:
            lj.extend([job] * len(job.keys))
            lk.extend(job.keys)
            lb.extend(job.blocks)
            lc.extend(jc)
            continue
        for k, b, c in zip(job.keys, job.blocks, jc):
            if k in cancelled or k in job.lost:
                gone.append((job, k))
            else:
                lj.append(job)
                lk.append(k)
                lb.append(b)
                lc.append(c)
    return lj, lk, lb, lc, gone


@dataclass
class _Batch:
    """Offload jobs written together; finished (counts, futures) when its last piece settles."""
    jobs: list[_Job]
    left: int = 1  # pieces not yet settled, plus 1 while the writer is still submitting pieces
    failed: BaseException | None = None  # first write failure: later pieces are not submitted
    counted: bool = False  # the failure was counted (once per batch)
    broken: bool = False  # the writer hit a bug: blocks not accounted for are dropped ("error")


@dataclass
class _Piece:
    """~``chunk_bytes`` of a batch: written together, published together after their fdatasync."""
    batch: _Batch
    jobs: list[_Job]  # per block: its job (parallel lists, not a tuple per block: fewer GC-tracked objects)
    keys: list[BlockKey]
    blocks: list[BlockBuffer]
    slots: list[Slot]  # (file index, slot), one per block
    checks: list[int | None] | None = None  # per block: device_checksum or None (None: no block has one)
    files: tuple[int, ...] = ()  # file indexes written
    gens: tuple[int, ...] = ()  # the files' fdatasync error generations when the piece was submitted
    error: BaseException | None = None
    stage: list[BlockBuffer] = field(default_factory=list)  # staging buffers, given back once written
    ready_at: float = 0.0  # time.monotonic() when it was handed to the syncer


class PieceFramer:
    """Builds a piece's write extents (see the module doc).

    Args:
        cat: the slot catalog (slot / block sizes, slab files, tenant tags).
        frames: the pool's :class:`~kvbm_backend.model.frame.ChecksumFrames` (header writer).
        staging: the pool's staging :class:`~kvbm_backend.memory.BufferPool`.
        io_size: bytes per coalesced I/O (a multiple of 4096).
        gather_below: blocks smaller than this (bytes) are staged into one slot image per piece.
    """

    def __init__(self, cat: SlotCatalog, frames: ChecksumFrames, staging: BufferPool, io_size: int,
                 gather_below: int) -> None:
        self.cat, self.frames, self.staging, self.io_size = cat, frames, staging, io_size
        bb = cat.block_bytes
        self._stored_padded = align_up(bb)
        # small or unaligned blocks are gathered into one staged slot image per batch (a copy, but one
        # iovec per I/O); large aligned blocks go zero-copy from the caller's buffers
        self.gather = bb < gather_below or bb % ALIGN != 0
        self._zero_pad = np.zeros(self._stored_padded - bb, np.uint8)

    def extents(self, pc: _Piece, piece_slots: int) -> list[Extent]:
        """Frames (header with the payload's xxh3_128, payload, zero pad) of the piece's blocks into its
        slots (``piece_slots``: the most blocks a piece holds). Staging/header buffers come from the pool's
        staging and are listed in ``pc.stage`` (given back once the piece is written)."""
        sb, bb = self.cat.slot_bytes, self.cat.block_bytes
        m = len(pc.keys)
        now = time.time_ns()
        wh = self.frames.write_header
        digest = xxhash.xxh3_128_digest  # the payload's; key_digest: the block's token digest (None: none named)
        if self.gather:  # small blocks: one staged slot image per piece, one iovec per I/O
            stage = self.staging.take(piece_slots * sb)
            pc.stage.append(stage)
            s2 = stage[:m * sb].reshape(m, sb)
            np.stack(pc.blocks, out=s2[:, HDR:HDR + bb])
            if sb - HDR > bb:
                s2[:, HDR + bb:] = 0
            mv = stage.data  # memoryview(stage) (numpy's stubs give ndarray no buffer protocol before 3.12)
            off = 0
            checks: list[int | None] = pc.checks or [None] * m
            for key, block, dc in zip(pc.keys, pc.blocks, checks):
                wh(mv, off, self.cat.tag(key.tenant), key.rank, key.seq_hash, digest(block.data), now, dc,
                   key_digest(key))
                off += sb
            return staged_run_extents(pc.slots, stage[:m * sb], sb, self.io_size, self.cat.fd_of)
        hdrs = self.staging.take(piece_slots * HDR)
        pc.stage.append(hdrs)
        mv = hdrs.data
        extents = []
        files = self.cat.slabs.by_index
        checks = pc.checks or [None] * m
        for j, (key, block, (fi, si), dc) in enumerate(zip(pc.keys, pc.blocks, pc.slots, checks)):
            f = files[fi]
            wh(mv, j * HDR, self.cat.tag(key.tenant), key.rank, key.seq_hash, digest(block.data), now, dc,
               key_digest(key))
            hv = hdrs[j * HDR:(j + 1) * HDR]
            if f.o_direct and not is_aligned(block):
                st = self.staging.take(self._stored_padded)  # aligned; back once the piece is written
                pc.stage.append(st)
                st[:bb] = block
                st[bb:] = 0
                bufs = [hv, st]
            else:
                bufs = [hv, block] + ([self._zero_pad] if self._zero_pad.nbytes else [])
            extents.append(slot_extent(f.fd, si, sb, bufs, self.io_size))
        return extents
