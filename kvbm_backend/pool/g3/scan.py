"""G3 warm restart without a journal: rebuild the index of slab files no journal covers from their slot headers.

Every stored frame's 4 KiB header names its block (namespace fingerprint, tenant tag, TP rank, sequence hash),
its layout, its lengths and its payload checksum (docs/format.md "Frame"), so the journal is an index of the
headers, not the only record of them. When the journal is gone (the directory that held it failed or was left
out of ``g3.paths``; its header is damaged) or names only some of the configured directories (a directory that
was left out for a run came back; the journal of that run won; one read as moved to a directory the journal
does not name, :func:`.restore._file_map`), the slab files it does not cover are scanned:
each slot's header is read and checked exactly as a journal entry's is (:func:`.restore.restore`: identity,
layout, lengths, a checksum flag) and the slot is indexed under the key its header names. The files are
``fdatasync``'ed first (a frame written but never synced before a crash is made durable before it is
published again). The payload is checked on every read as always (invariant 1), so a scan never serves bytes
the journal would not have.

What a scan cannot know, the journal knew: the LRU order (scanned blocks are ordered by the header's write
time, ``created_ns``, and placed before the journal's blocks, to be evicted first). Blocks deleted or proven
corrupt while the pool held them do not come back: their headers are zeroed before their slots can be reused
(:meth:`.catalog.SlotCatalog.clear_headers`), a write cancelled by a delete included. Nor do slots a put
reserved and did not publish (its write, slab sync or journal append failed) or evicted blocks: the evicting
write overwrites the header, or it is zeroed (:meth:`.catalog.SlotCatalog.release_unpublished`). Only a
worker killed between an eviction and that write leaves an evicted block's header (a hit of its own bytes).
A block deleted in a run whose ``g3.paths`` left its directory out was not held then, and is found again when
the directory returns.

Cost: one 4 KiB read per slot the files cover (their size, not the configured capacity), by ``g3.io_threads``
threads; headers without the frame magic and this namespace's fingerprint are dropped without parsing, and the
others are checked in batches (numpy), so a scan runs about as fast as a journal replay.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Iterator, Sequence

import numpy as np
import numpy.typing as npt

from ...memory import aligned_empty
from ...model import frame
from ...model.frame import FrameError
from ...model.namespace import BlockKey
from .catalog import HDR, SlotCatalog
from .index import Slot, TagKey
from .slabs import SlabFile
from ...threads import executor

log = logging.getLogger(__name__)

CHUNK_SLOTS = 4096  # headers read per engine submission (16 MiB of buffer)
HEADER_READ_TRIES = 3  # reads of one slot header at once (the first and 2 retries, no sleep)
HEADER_RETRY_WINDOW_S = 5.0  # then re-read with backoff until this long after the open's first failed read
HEADER_RETRY_PAUSE_S = (0.005, 0.5)  # the first pause between re-reads, doubled up to the second
_FP_AT = 16  # byte offset of ns_fp in the frame header (docs/format.md: magic 8, version 2, flags 2, header_len 4)


def read_headers(cat: SlotCatalog, threads: int,
                 slots: Sequence[Slot]) -> Iterator[tuple[int, npt.NDArray[np.uint8], npt.NDArray[np.bool_]]]:
    """Read the header of each slot of ``slots``, :data:`CHUNK_SLOTS` at a time, with ``threads`` threads each
    reading a contiguous share of a chunk by one ``preadv`` per header (the GIL is released in the system call;
    no per-header future or plan: a warm restart reads one header per block). Yields ``(start, rows, readable)``
    per chunk: ``rows[j]`` (uint8 ``[HDR]``) is the header of ``slots[start + j]``, ``readable[j]`` whether a
    read returned the whole header. A read that fails (OSError: EIO on a bad sector, a device-path or NFS
    hiccup; or short) is retried at once, :data:`HEADER_READ_TRIES` reads in all; a header still unread is then
    re-read with backoff (pauses from :data:`HEADER_RETRY_PAUSE_S`, doubling) until
    :data:`HEADER_RETRY_WINDOW_S` after the first failed read of this call (one window for all chunks: a
    restart never waits longer than that for its headers; a chunk reached after it gets the reads at once only).
    A slot none of whose reads returned its header is ``readable`` False: no proof that its bytes are bad
    (the caller keeps a journaled block unverified, ``restore_unverified``; a scan skips the slot). Before
    2026-12-01 the 3 reads ran back to back and such a block was dropped: an outage of a few ms destroyed
    intact blocks for good. Slots whose first read failed are counted ``restore_header_retries`` in ``cat.c``
    (logged); the happy path costs nothing more (no sleep, no extra read)."""
    retried = 0
    deadline: list[float] = []  # set at the first failed read: the end of the re-read window
    with executor(max(1, threads), "g3-restore") as ex:
        for c0 in range(0, len(slots), CHUNK_SLOTS):
            part = slots[c0:c0 + CHUNK_SLOTS]
            hdrs = aligned_empty(len(part) * HDR)  # 4 KiB-aligned rows: O_DIRECT fds read into them too
            ok = np.zeros(len(part), bool)
            tries = np.zeros(len(part), np.uint32)
            _read_rows(ex, threads, cat, part, hdrs, ok, tries, np.arange(len(part)), HEADER_READ_TRIES)
            again = tries > 1
            if again.any():
                t0 = time.monotonic()
                if not deadline:
                    deadline.append(t0 + HEADER_RETRY_WINDOW_S)
                _read_later(ex, threads, cat, part, hdrs, ok, tries, deadline[0])
                n, lost = int(again.sum()), int((again & ~ok).sum())
                retried += n
                log.warning("G3: %d slot header read(s) failed and were retried at restart: %d read back, %d "
                            "still unreadable after %d read(s) over %.2f s (journaled blocks kept unverified, "
                            "scanned slots skipped)", n, n - lost, lost, int(tries.max()), time.monotonic() - t0)
            yield c0, hdrs.reshape(-1, HDR), ok
    if retried:
        cat.c["restore_header_retries"] += retried


def _read_later(ex: Any, threads: int, cat: SlotCatalog, part: Sequence[Slot], hdrs: npt.NDArray[np.uint8],
                ok: npt.NDArray[np.bool_], tries: npt.NDArray[np.uint32], deadline: float) -> None:
    """Re-read the headers of ``part`` not yet read (``~ok`` with ``tries`` > 0: a file of this run), one read
    each per round, pausing before each round (:data:`HEADER_RETRY_PAUSE_S`, doubling), until all are read or
    ``deadline`` (``time.monotonic()`` seconds) has passed."""
    pause, cap = HEADER_RETRY_PAUSE_S
    while True:
        left = np.flatnonzero(~ok & (tries > 0))
        wait = deadline - time.monotonic()
        if not len(left) or wait <= 0:
            return
        time.sleep(min(pause, wait))  # a backoff between re-reads, not a synchronisation
        pause = min(pause * 2, cap)
        _read_rows(ex, threads, cat, part, hdrs, ok, tries, left, 1)


def _read_rows(ex: Any, threads: int, cat: SlotCatalog, part: Sequence[Slot], hdrs: npt.NDArray[np.uint8],
               ok: npt.NDArray[np.bool_], tries: npt.NDArray[np.uint32], rows: npt.NDArray[np.int64],
               n_tries: int) -> None:
    """Read the headers ``rows`` of ``part`` into ``hdrs`` on ``threads`` threads of ``ex``, each a contiguous
    share of ``rows``: at most ``n_tries`` reads per header (:func:`_read_share`)."""
    step = -(-len(rows) // max(1, threads))
    for f in [ex.submit(_read_share, cat, part, hdrs, ok, tries, rows[j0:j0 + step], n_tries)
              for j0 in range(0, len(rows), step)]:
        f.result()


def _read_share(cat: SlotCatalog, part: Sequence[Slot], hdrs: npt.NDArray[np.uint8], ok: npt.NDArray[np.bool_],
                tries: npt.NDArray[np.uint32], rows: npt.NDArray[np.int64], n_tries: int) -> None:
    """Read headers ``rows`` of ``part`` into ``hdrs``: ``ok[j]`` whether one of at most ``n_tries`` reads
    returned the whole header, ``tries[j]`` the reads made so far (0: no such file)."""
    sb = cat.slot_bytes
    for j in rows.tolist():
        fi, si = part[j]
        try:
            fd = cat.fd_of(fi)
        except KeyError:  # no such file this run: nothing to retry
            continue
        buf = hdrs[j * HDR:(j + 1) * HDR].data
        for _ in range(n_tries):
            tries[j] += 1
            try:
                if os.preadv(fd, [buf], si * sb) == HDR:
                    ok[j] = True
                    break
            except OSError:
                pass


def check_header(cat: SlotCatalog, hdr: npt.NDArray[np.uint8], key: BlockKey | TagKey) -> frame.FrameHeader:
    """The check every restored slot passes (journal entry or scan): the header names exactly ``key`` in the
    namespace's layout, TP world and stored length, and carries a payload checksum. Raises FrameError."""
    tag = key.tag if type(key) is TagKey else cat.tag(key.tenant)
    h = frame.accept(hdr, key, cat.layout, tag, world=cat.namespace.tp_world_size, stored_len=cat.block_bytes)
    if not h.flags & frame.FLAG_CHECKSUM:
        raise FrameError("length", "frame carries no checksum")
    return h


def written_by_g3(cat: SlotCatalog, rows: npt.NDArray[np.uint8], tags: Sequence[bytes] | npt.NDArray[np.uint8],
                  ranks: Sequence[int] | npt.NDArray[Any], seqs: Sequence[int] | npt.NDArray[Any]) -> npt.NDArray[np.bool_]:
    """The fast form of :func:`check_header` for ``m`` headers at once (numpy compares, one xxh3 per header):
    True where ``rows[j]`` is exactly the header the G3 writer makes for block ``(tags[j], ranks[j], seqs[j])``
    (:meth:`~kvbm_backend.model.frame.ChecksumFrames.check_headers`). A True passes :func:`check_header`; a
    False is checked by it (it names the reason, or accepts a frame another writer made)."""
    if not len(rows):
        return np.zeros(0, bool)
    frames = frame.ChecksumFrames(bytes.fromhex(cat.fp), cat.layout, cat.namespace.tp_world_size)
    return frames.check_headers(rows, tags, ranks, seqs)[0]


def scan(cat: SlotCatalog, threads: int, files: Sequence[SlabFile],
         held: set[BlockKey | TagKey]) -> list[tuple[TagKey, Slot]]:
    """Index entries of the slots of ``files`` whose headers check (:func:`check_header`, a TP rank below the
    world) and name a key not in ``held`` (the journal's): ``[(key, slot)]`` oldest first by the header's
    ``created_ns``; a key found in several slots keeps its newest. Reads slots below each file's size (past its
    share too: :func:`.restore.restore` keeps what the pool's capacity holds) with ``threads`` threads
    (:func:`read_headers`). Counts
    ``restore_scanned_slots`` and ``restored_by_scan`` in ``cat.c`` and logs what it did."""
    slots = [(f.index, s) for f in files for s in range(f.size_slots)]
    if not slots:
        return []
    t0 = time.monotonic()
    want = np.frombuffer(frame.MAGIC + bytes.fromhex(cat.fp), dtype=np.uint8)
    world = cat.namespace.tp_world_size
    found: dict[TagKey, tuple[int, Slot]] = {}
    for c0, rows, readable in read_headers(cat, threads, slots):
        hit = np.flatnonzero(readable & (rows[:, :8] == want[:8]).all(axis=1)
                             & (rows[:, _FP_AT:_FP_AT + 8] == want[8:]).all(axis=1))
        if not len(hit):
            continue
        sel = rows[hit]
        tags = [bytes(t) for t in sel[:, 24:40]]  # the identity each header names (docs/format.md offsets)
        ranks = sel[:, 40:44].copy().view("<u4").reshape(-1).tolist()
        seqs = sel[:, 48:56].copy().view("<u8").reshape(-1).tolist()
        created = sel[:, 128:136].copy().view("<u8").reshape(-1).tolist()
        fast = written_by_g3(cat, sel, tags, ranks, seqs)
        for n, j in enumerate(hit.tolist()):
            key = TagKey(cat.fp, tags[n], ranks[n], seqs[n])
            if ranks[n] >= world or key in held:
                continue
            if not fast[n]:
                try:
                    check_header(cat, rows[j], key)
                except FrameError:
                    continue
            old = found.get(key)
            if old is None or created[n] > old[0]:
                found[key] = (created[n], slots[c0 + j])
    unsynced = set()
    for f in files:  # frames written but never synced (a crash before the barrier) are made durable, or dropped
        try:
            os.fdatasync(f.fd)
        except OSError as e:
            log.warning("G3: fdatasync of %s failed (%s): its slots are not restored", f.path, e)
            unsynced.add(f.index)
    out = [(k, slot) for k, (_t, slot) in sorted(found.items(), key=lambda kv: kv[1][0]) if slot[0] not in unsynced]
    cat.c["restore_scanned_slots"] += len(slots)
    cat.c["restored_by_scan"] += len(out)
    log.warning("G3: %d slab file(s) not covered by a journal (%s): scanned %d slot headers in %.1f s, %d blocks "
                "restored", len(files), ", ".join(sorted({f.directory for f in files})), len(slots),
                time.monotonic() - t0, len(out))
    return out
