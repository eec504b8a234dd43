"""The G3 journal's generation: which of two journals of a namespace is the newer, without trusting clocks.

Before 2026-12-01 the journal used at open, when several configured directories held one (:mod:`.journal_home`),
was the one with the latest modification time. A run whose clock was behind (an NTP step after boot, a VM
restored from a snapshot, an NFS client with skew, a directory restored with its mtimes) wrote a newer journal
that lost to a stale one: the stale one's file table covered the newer one's directory, so that directory's
blocks were neither restored nor scanned, and the newer journal was removed (review 2026-12-01, finding 6).

Now every open picks a generation ``G``: one more than the highest generation any configured directory shows
(its journal's, or its marker's, below). ``G`` is written into every configured directory's marker first, then
into the journal the open rewrites (and into every later rewrite and compaction of that run). So a journal
whose file table names a directory was written by a run that first raised that directory's marker to its
generation, and any later run with that directory configured picks a higher one: of two journals, the one with
the higher generation is the newer. Journals without a generation (written by an earlier version) fall back to
the modification time, as before; see :func:`.journal_home.find_home`.

Formats (docs/format.md "Journal", "Generation"):

* the generation record: the first record after a journal's header, a version-3 DEL record of a key no block
  can have (rank ``0xFFFFFFFF``, tenant tag ``b"KVBM-journal-gen"``) whose ``seq_hash`` is the generation.
  An earlier version replays it as the delete of a key it never held (a no-op), so journals stay readable
  both ways. Anywhere else such a record means nothing.
* vacancy records (:func:`encode_vacant`, since 2026-12-03): a PUT of the key no block can have (rank
  ``0xFFFFFFFF``, tenant tag ``b"KVBM-slot-vacant"``, ``seq_hash`` 0) into each slot whose header the pool zeroed
  while the journal's last word on it may still be the PUT of a block that left without a DEL record (evicted
  for a batch whose write then failed, or that did not reuse the slot; since 2026-12-03 also a group withdrawn
  when the journal's barrier and its repair failed, :func:`.journal_sync.repair_or_withdraw_locked`; since
  2026-12-03 also while the journal is marked for repair, :func:`.vacancy.journal_vacant`), then one
  DEL of that key. Replay (the last record of a key and of a slot wins) empties those slots, in this version and
  in earlier ones alike. Before, such a slot's stale PUT met the zeroed header at the next open:
  ``restore_dropped`` (reason ``magic``) counted every such evicted block as lost (~60 after one failed batch on
  a full tmpfs: reported 2026-12-03).
  :func:`is_vacancy` finds the key's rows (a crash between the PUTs and the DEL leaves one live: not a block).
* the marker ``journal-<fp>.gen`` in each directory (0600, ``O_NOFOLLOW``): ``"KVBMJGEN"``, the generation
  (u64), and an xxh3_64 of those 16 bytes; 24 bytes, written in place and fdatasync'ed. A marker that is
  absent, short or fails its check reads as 0.
"""
from __future__ import annotations

import errno
import logging
import os
import stat
import struct
from typing import Any, Iterable

import numpy as np
import numpy.typing as npt
import xxhash

log = logging.getLogger(__name__)

GEN_TAG = b"KVBM-journal-gen"  # 16 bytes: no xxh3_128 tenant tag in practice, and the rank below rules it out
GEN_RANK = 0xFFFFFFFF  # past every TP world: no block key has it
VACANT_TAG = b"KVBM-slot-vacant"  # the vacancy records' key (with GEN_RANK, seq_hash 0): no block has it
_REC = struct.Struct("<BHIQI16s")  # the journal's version-2/3 record (journal.py), then its check
_SUM = struct.Struct("<Q")
RECORD_BYTES = _REC.size + _SUM.size
_PUT, _DEL = 1, 2
_MARK = struct.Struct("<8sQ")
MARK_MAGIC = b"KVBMJGEN"
MARK_BYTES = _MARK.size + _SUM.size


def encode_record(generation: int) -> bytes:
    """The generation record of ``generation`` (1 .. 2**64-1), 43 bytes. Raises ValueError out of range."""
    if not 0 < generation < 1 << 64:
        raise ValueError(f"generation: must be in 1..2**64-1 (got {generation})")
    body = _REC.pack(_DEL, 0, 0, generation, GEN_RANK, GEN_TAG)
    return body + _SUM.pack(xxhash.xxh3_64_intdigest(body))


def parse_record(data: bytes | memoryview) -> int | None:
    """The generation of the record at the start of ``data`` (the bytes after a version-3 header), or None when
    it is no generation record (a journal of an earlier version, or empty)."""
    if len(data) < RECORD_BYTES:
        return None
    kind, fi, si, gen, rank, tag = _REC.unpack_from(data, 0)
    if (kind, fi, si, rank, tag) != (_DEL, 0, 0, GEN_RANK, GEN_TAG) or not gen:
        return None
    if _SUM.unpack_from(data, _REC.size)[0] != xxhash.xxh3_64_intdigest(bytes(data[:_REC.size])):
        return None
    return int(gen)


def encode_vacant(slots: Iterable[tuple[int, int]]) -> list[bytes]:
    """The vacancy records of ``slots`` ((file index, slot index) pairs of the journal's file table): a PUT of
    the vacancy key into each, then one DEL of it (43 bytes each; none for no slots). Appended in one write,
    they leave every one of ``slots`` empty at replay, whatever PUT named it before."""
    out = [_REC.pack(_PUT, fi, si, 0, GEN_RANK, VACANT_TAG) for fi, si in slots]
    if out:
        out.append(_REC.pack(_DEL, 0, 0, 0, GEN_RANK, VACANT_TAG))
    return [body + _SUM.pack(xxhash.xxh3_64_intdigest(body)) for body in out]


def is_vacancy(tags: npt.NDArray[np.uint8], ranks: npt.NDArray[Any]) -> npt.NDArray[np.bool_]:
    """Which journal entries (``tags`` uint8 ``(n, 16)``, ``ranks`` ``(n,)``) name the vacancy key: never a
    block (one is live after replay only when a crash cut the journal between a vacancy's PUTs and its DEL)."""
    out: npt.NDArray[np.bool_] = (np.asarray(ranks) == GEN_RANK) & (tags == np.frombuffer(VACANT_TAG, np.uint8)).all(1)
    return out


def marker_name(fingerprint: str) -> str:
    return f"journal-{fingerprint}.gen"


def read_marker(dir_fd: int, directory: str, fingerprint: str) -> int:
    """The generation recorded in ``directory``'s marker (opened relative to its verified ``dir_fd``,
    ``O_NOFOLLOW``): 0 when absent, not a regular file, unreadable (logged) or damaged. Never raises."""
    name = marker_name(fingerprint)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        return 0
    except OSError as e:
        log.warning("G3: cannot read the journal generation marker %s (%s); read as 0",
                    os.path.join(directory, name), e)
        return 0
    try:
        data = os.pread(fd, MARK_BYTES, 0)
    except OSError as e:
        log.warning("G3: cannot read the journal generation marker %s (%s); read as 0",
                    os.path.join(directory, name), e)
        return 0
    finally:
        os.close(fd)
    if len(data) < MARK_BYTES:
        return 0
    magic, gen = _MARK.unpack_from(data, 0)
    if magic != MARK_MAGIC or _SUM.unpack_from(data, _MARK.size)[0] != xxhash.xxh3_64_intdigest(data[:_MARK.size]):
        return 0
    return int(gen)


def write_marker(dir_fd: int, directory: str, fingerprint: str, generation: int, sync: bool = True) -> bool:
    """Record ``generation`` in ``directory``'s marker (created 0600 if absent, then the directory fsynced; an
    existing one narrowed to 0600; one that is not a regular file is left alone), fdatasync'ed (``sync``
    False: neither synced, as the pool's ``g3.fsync`` false says). Returns False when it could not be written (logged: the journals' own generations still
    order them; a directory whose marker is behind may make a later run's generation too low, which then
    falls back to the modification time on a tie). Never raises."""
    name = marker_name(fingerprint)
    body = _MARK.pack(MARK_MAGIC, generation)
    data = body + _SUM.pack(xxhash.xxh3_64_intdigest(body))
    try:
        try:
            fd = os.open(name, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
            created = False
        except FileNotFoundError:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=dir_fd)
            created = True
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, "not a regular file")
            if stat.S_IMODE(st.st_mode) != 0o600:  # narrowed like the pool's other files
                os.fchmod(fd, 0o600)
            if os.pwrite(fd, data, 0) != len(data):
                raise OSError(errno.EIO, "short write")
            if sync:
                os.fdatasync(fd)
        finally:
            os.close(fd)
        if created and sync:
            os.fsync(dir_fd)
    except OSError as e:
        log.warning("G3: cannot record the journal generation %d in %s (%s)", generation,
                    os.path.join(directory, name), e)
        return False
    return True
