"""Append-only G3 journal: which slot holds which key, for warm restart (docs/invariants.md #6).

File ``journal-<fingerprint>.log`` in one of the pool's directories (its home, chosen by :mod:`.journal_home`:
where it was found at open, else the first; mode 0600, opened with ``O_NOFOLLOW`` relative to the pool's
verified directory fd). Format version 3: a file header (``KVBMJRN3``, 8 bytes of the namespace
fingerprint, the header's length, the file table: ``files_per_path`` and the real path of each directory in
file-index order, and an xxh3_64 of all that), then fixed-size records, each::

    <B type> <H file index> <I slot index> <Q sequence hash> <I rank> <16s tenant tag>
    <Q xxh3_64 of everything before it in the record>

The tenant is stored only as its tag (``model.namespace.tenant_tag``: xxh3_128 of the tenant UTF-8,
the value every frame header carries), never as the tenant string: the journal names no tenant in
clear. The restored index keys entries of unknown tenants by tag (:class:`.index.TagKey`) until a
lookup with the real key adopts them. The tag is a plain hash: a guessable (low-entropy) tenant id can
still be confirmed by hashing candidates, exactly as from the slot headers.

``type`` is 1 (PUT: the slot holds the key; appended only after the slot's bytes were fdatasync'ed,
invariant 2, and fdatasync'ed itself -- once per group-commit round, off the pool's lock -- before the put is
reported stored: :mod:`.writer`) or 2 (DEL: the key was deleted). The first record a pool writes after the
header is its generation record, a DEL of a key no block has (:mod:`.journal_gen`: which of two journals is newer). Replay applies records in order (last one wins per key
and per slot) and stops at the first record that does not check (a torn tail after a crash).
The journal is a hint: every entry it yields is verified against the slot's header before use, and
every payload is verified again on every read.

The file index of a record is ``d * files_per_path + k`` for slab file ``k`` of directory ``d`` of the
header's file table, so a restart maps it to the same file whatever the order of ``g3.paths`` now is
(:func:`.restore.restore`). Versions 2 (``KVBMJRN2``: a 16-byte header, the same records) and 1
(``KVBMJRN1``: records with ``<H tenant length> <tenant UTF-8>`` in place of the tag) carry no file table:
their file indexes are positions in the configured list (read as before); the pool rewrites them as
version 3 at open.

A rewrite writes the live entries to a uniquely named temp file (``O_EXCL``, 0600), fsyncs it and
renames it over the journal (never a fixed ``.tmp`` name), then fsyncs the directory; until the rename the
old journal stays open for appends, so a failed rewrite (ENOSPC) leaves a working journal. Compaction
(:meth:`Journal.begin_compaction`) does the long part -- encoding and writing one record per block -- off
the pool's lock: the old journal keeps taking appends, each also remembered, and under the lock only the
records appended meanwhile are copied to the new file before the rename. A failed append is cut back to
the last whole record (``ftruncate``, which needs no space); if even that fails the journal is marked
:attr:`Journal.broken` and must be rewritten before the next append.
"""
from __future__ import annotations

import errno
import os
import stat
import struct
import uuid
from collections import OrderedDict
from contextlib import suppress
from typing import Any, Iterable, Protocol, TypeVar, runtime_checkable

import xxhash

from ...model.namespace import BlockKey
from . import journal_columns as jc
from . import journal_gen
from .index import TagKey, tag_of
from .journal_columns import JournalColumns

FILE_MAGIC = b"KVBMJRN3"
FILE_MAGIC_V2 = b"KVBMJRN2"
FILE_MAGIC_V1 = b"KVBMJRN1"
PUT, DEL = 1, 2
_REC = struct.Struct("<BHIQI16s")  # versions 2 and 3
_REC_V1 = struct.Struct("<BHIQIH")  # version 1, followed by the tenant UTF-8
_SUM = struct.Struct("<Q")
HDR3 = struct.Struct("<8s8sIHH")  # version 3: magic, fingerprint, header length, files_per_path, directories
_PLEN = struct.Struct("<H")  # version 3: a directory's path length, then its bytes
RECORD_BYTES = _REC.size + _SUM.size
MAX_FILES = 1 << 16  # a record's file index is a u16: a file table naming more files is damage (restore sizes on it)
MAX_HEADER_BYTES = 1 << 24  # a version-3 header claiming more is damage (65,535 paths of 4 KiB fit in 1/4 of it)

Slot = tuple[int, int]  # (file index, slot index in that file)
FileTable = tuple[list[str], int]  # (directory identities (real paths) in file-index order, files_per_path)
K = TypeVar("K", BlockKey, TagKey)
WRITE_RECORDS = 4096  # records encoded per write of a rewrite or compaction (176 KB; a compaction checks for a
# cancel between): each batch holds the GIL about a millisecond, beside an engine serving from the same process


@runtime_checkable
class Columnar(Protocol):
    """Entries that give their columns at once (the index's snapshot, ``CompactLruIndex.items()``)."""

    def columns(self) -> JournalColumns: ...


JournalEntries = Iterable[tuple["BlockKey | TagKey", Slot]] | Columnar  # (key, slot) pairs, oldest first, or columns


class JournalPathError(RuntimeError):
    """The journal path is not a regular file of ours (a directory, a symbolic link, a device...)."""


def encode_header(fingerprint: str, files: FileTable) -> bytes:
    """The version-3 file header of a journal whose file indexes follow ``files`` (docs/format.md).

    Raises:
        ValueError: more than 65,535 directories, ``files_per_path`` outside 1..65,535, or a path longer
            than 65,535 bytes.
    """
    dirs, per_path = files
    raw = [os.fsencode(d) for d in dirs]
    if not 1 <= per_path <= 0xFFFF or len(raw) > 0xFFFF or any(len(b) > 0xFFFF for b in raw):
        raise ValueError(f"G3 journal: {len(dirs)} directories of {per_path} files do not fit its header")
    table = b"".join(_PLEN.pack(len(b)) + b for b in raw)
    size = HDR3.size + len(table) + _SUM.size
    body = HDR3.pack(FILE_MAGIC, bytes.fromhex(fingerprint), size, per_path, len(dirs)) + table
    return body + _SUM.pack(xxhash.xxh3_64_intdigest(body))


def parse_header(data: bytes, fingerprint: str) -> tuple[int, int, FileTable | None] | None:
    """Check the file header at the start of ``data`` (a journal's bytes, or at least its header) for the
    namespace ``fingerprint``. Returns ``(version, header bytes, file table)`` (no file table for versions
    1 and 2: their file indexes are positions in the configured directory list), or None when it is not a
    journal of this namespace in a known version (another magic or fingerprint, too short, a version-3
    header whose length or check does not hold)."""
    fp = bytes.fromhex(fingerprint)
    if data[:16] == FILE_MAGIC_V2 + fp:
        return 2, 16, None
    if data[:16] == FILE_MAGIC_V1 + fp:
        return 1, 16, None
    if len(data) < HDR3.size + _SUM.size:
        return None
    magic, hfp, size, per_path, ndirs = HDR3.unpack_from(data, 0)
    if magic != FILE_MAGIC or hfp != fp or not HDR3.size + _SUM.size <= size <= len(data) or not per_path:
        return None
    if ndirs * per_path > MAX_FILES:  # more files than a record's u16 file index can name: damage, never sized on
        return None
    if _SUM.unpack_from(data, size - _SUM.size)[0] != xxhash.xxh3_64_intdigest(data[:size - _SUM.size]):
        return None
    dirs, pos = [], HDR3.size
    for _ in range(ndirs):
        if pos + _PLEN.size > size - _SUM.size:
            return None
        n = _PLEN.unpack_from(data, pos)[0]
        pos += _PLEN.size
        dirs.append(os.fsdecode(bytes(data[pos:pos + n])))
        pos += n
    if pos != size - _SUM.size:
        return None
    return 3, size, (dirs, per_path)


def _refuse(path: str, what: str) -> JournalPathError:
    return JournalPathError(
        f"G3 journal {path} is {what}, not a regular file: G3 does not follow or replace it. "
        f"Remove or rename it (the pool rebuilds the journal), then open the pool again.")


def read_journal(dir_fd: int, directory: str, name: str, limit: int | None = None) -> tuple[bytes, int] | None:
    """Read journal ``name`` in ``directory`` (opened relative to its verified ``dir_fd``, ``O_NOFOLLOW``):
    its first ``limit`` bytes (default: all) and its modification time (``st_mtime_ns``); None when absent.

    Raises:
        JournalPathError: the name holds a directory, a symbolic link or another non-file.
        OSError: the read failed.
    """
    path = os.path.join(directory, name)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _refuse(path, "a symbolic link") from None
        if e.errno == errno.EISDIR:
            raise _refuse(path, "a directory") from None
        raise
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise _refuse(path, "a directory")
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(path, "a special file")
        chunks, got = [], 0
        while limit is None or got < limit:
            b = os.read(fd, 1 << 24 if limit is None else min(1 << 24, limit - got))
            if not b:
                break
            chunks.append(b)
            got += len(b)
        return b"".join(chunks), st.st_mtime_ns
    finally:
        os.close(fd)


def encode(kind: int, key: "BlockKey | TagKey", slot: Slot = (0, 0)) -> bytes:
    """One version-2/3 record; ``key`` is a BlockKey (its tenant is hashed to the tag) or a TagKey."""
    tag = key.tag if type(key) is TagKey else tag_of(key.tenant)
    body = _REC.pack(kind, slot[0], slot[1], key.seq_hash, key.rank, tag)
    return body + _SUM.pack(xxhash.xxh3_64_intdigest(body))


def decode_all_v1(data: bytes, namespace: str) -> tuple["OrderedDict[BlockKey, Slot]", int, int]:
    """Replay version-1 records (tenant strings in clear). Returns ``(entries, records, good_bytes)``: key -> slot
    in LRU order (oldest first), the number of good records, the byte length of the good prefix. Versions 2 and 3
    replay in :func:`.journal_columns.decode`, to the same rule (:func:`_apply`)."""
    entries: OrderedDict[BlockKey, Slot] = OrderedDict()
    by_slot: dict[Slot, BlockKey] = {}
    pos = 0
    n = 0
    mv = memoryview(data)
    while pos + _REC_V1.size + _SUM.size <= len(data):
        kind, fi, si, seq, rank, tlen = _REC_V1.unpack_from(mv, pos)
        end = pos + _REC_V1.size + tlen
        if kind not in (PUT, DEL) or end + _SUM.size > len(data):
            break
        if _SUM.unpack_from(mv, end)[0] != xxhash.xxh3_64_intdigest(mv[pos:end]):
            break
        try:
            tenant = bytes(mv[pos + _REC_V1.size:end]).decode()
        except UnicodeDecodeError:
            break
        _apply(entries, by_slot, kind, BlockKey(namespace, tenant, rank, seq), (fi, si))
        pos = end + _SUM.size
        n += 1
    return entries, n, pos


def _apply(entries: OrderedDict[K, Slot], by_slot: dict[Slot, K], kind: int, key: K, slot: Slot) -> None:
    old = entries.pop(key, None)
    if old is not None:
        by_slot.pop(old, None)
    if kind == PUT:
        prev = by_slot.get(slot)
        if prev is not None:
            entries.pop(prev, None)
        entries[key] = slot
        by_slot[slot] = key


class Compaction:
    """A journal rewrite in progress off the pool's lock (:meth:`Journal.begin_compaction`)."""

    def __init__(self, tmp: str, entries: JournalEntries):
        self.tmp = tmp  # the temp file's name in the journal's directory
        self.entries: JournalEntries | None = entries  # the index snapshot
        self.fd = -1
        self.records = 0  # records written to the temp file
        self.size = 0  # bytes written to the temp file (header included)
        self.taken = 0  # remembered appends already copied to the temp file
        self.gen = 0  # the pool's count of record-losing journal failures at the snapshot (catalog.dirty_gen)


class Journal:
    """The open journal of one pool (not thread-safe: the pool serialises calls; a compaction's
    :meth:`write_snapshot` and :meth:`write_caught_up` are the calls made without the pool's lock).

    Args:
        dir_fd: an open fd of ``directory`` (verified by :class:`.slabs.SlabSet`); the journal and its
            temp files are opened relative to it with ``O_NOFOLLOW`` (a planted symlink is refused).
            Default: the directory is opened here.
        files: the file table the pool's file indexes follow (:meth:`.slabs.SlabSet.file_table`), written
            into every header this journal writes. Default: ``directory`` alone, one file.
        generation: this run's journal generation (:mod:`.journal_gen`), written as the first record of every
            file it writes; 0 writes none (as versions before 2026-12-01 did).

    Raises (constructor):
        ValueError: ``files`` does not fit a header (:func:`encode_header`).
    """

    def __init__(self, directory: str, fingerprint: str, dir_fd: int | None = None, files: FileTable | None = None,
                 generation: int = 0):
        self.generation = generation  # written first by every rewrite (0: none; :mod:`.journal_gen`)
        self.name = f"journal-{fingerprint}.log"
        self.path = os.path.join(directory, self.name)
        self.directory = directory
        self._fp = fingerprint
        self._header = encode_header(fingerprint, files or ([os.path.realpath(directory)], 1))
        self.records = 0
        self.fd: int | None = None
        self.size = 0  # bytes of whole records (plus header) in the open journal
        self.broken = False  # an append could not be cut back: rewrite before appending again
        self.compaction: Compaction | None = None  # the compaction in progress (None: none, or cancelled)
        self._pending: list[tuple[bytes, int]] = []  # appends since the compaction's snapshot: (bytes, records)
        self._own_dfd = dir_fd is None
        self._dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC) if dir_fd is None else dir_fd

    def load_columns(self) -> tuple[JournalColumns, dict[str, Any]]:
        """Read and replay the journal if present. Returns ``(entries, info)``: the live entries as columns,
        oldest first, and ``info`` with ``records``, ``torn_bytes``, ``bad_header`` (a journal of another
        namespace/format is ignored), ``version``, ``generation`` (its generation record's, None without one:
        :mod:`.journal_gen`), ``files`` (the header's :data:`FileTable` the entries' file
        indexes follow; None for versions 1 and 2: positions in the configured list) and ``tenants`` (version
        1, which names tenants in clear: tag -> tenant of its entries; else None).

        Raises:
            JournalPathError: the journal path is a directory, a symbolic link or another non-file.
        """
        info: dict[str, Any] = {"records": 0, "torn_bytes": 0, "bad_header": False, "version": 0, "files": None,
                                "tenants": None, "generation": None}
        got = read_journal(self._dfd, self.directory, self.name)
        if got is None:
            return jc.empty(), info
        data = got[0]
        head = parse_header(data, self._fp)
        if head is None:
            info["bad_header"] = True
            return jc.empty(), info
        version, start, info["files"] = head
        if version == 1:
            entries, n, good = decode_all_v1(data[start:], self._fp)
            cols = jc.columns_of(entries.items())
            info["tenants"] = {tag_of(k.tenant): k.tenant for k in entries}
        else:
            cols, n, good = jc.decode(memoryview(data)[start:])
            info["generation"] = journal_gen.parse_record(memoryview(data)[start:start + good])
        info["version"] = version
        info["records"] = n
        info["torn_bytes"] = len(data) - start - good
        return cols, info

    def load(self) -> tuple["OrderedDict[TagKey | BlockKey, Slot]", dict[str, Any]]:
        """:meth:`load_columns` with the entries as key -> slot, oldest first: TagKeys (versions 2, 3) or
        BlockKeys (version 1)."""
        cols, info = self.load_columns()
        return OrderedDict(jc.pairs_of(cols, self._fp, info["tenants"])), info

    def rewrite(self, entries: JournalEntries) -> None:
        """Atomically replace the journal with PUT records of ``entries`` (oldest first) and open it
        for appending. On failure (ENOSPC...) the temp file is removed and the old journal, if open,
        stays open for appends (``broken`` unchanged); the error is raised. A compaction in progress is
        cancelled (this rewrite supersedes it)."""
        self.cancel_compaction()
        c = Compaction(self._tmp_name(), entries)
        try:
            self._write_entries(c, None)
            os.close(c.fd)
            c.fd = -1
            os.replace(c.tmp, self.name, src_dir_fd=self._dfd, dst_dir_fd=self._dfd)
        except BaseException:
            self._discard(c)
            raise
        self._installed(c)

    def _tmp_name(self) -> str:
        return f".journal-{self._fp}.{os.getpid()}.{uuid.uuid4().hex}.tmp"

    def _write_entries(self, c: Compaction, owner: "Compaction | None") -> bool:
        """Create ``c``'s temp file, write the header and a PUT record per entry, fsync. With ``owner``
        (a compaction, run off the pool's lock), stop and return False once it is no longer the journal's
        compaction (cancelled: a rewrite or close superseded it). Raises OSError (the caller discards)."""
        c.fd = os.open(c.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                       dir_fd=self._dfd)
        assert c.entries is not None
        cols = c.entries.columns() if isinstance(c.entries, Columnar) else jc.columns_of(c.entries)
        c.entries = None
        c.size += _write_all(c.fd, self._header)
        if self.generation:
            c.size += _write_all(c.fd, journal_gen.encode_record(self.generation))
            c.records += 1
        for a in range(0, len(cols), WRITE_RECORDS):  # records encoded a batch at a time (numpy: jc.encode)
            part = cols.take(slice(a, a + WRITE_RECORDS))
            c.size += _write_all(c.fd, jc.encode(PUT, part))
            c.records += len(part)
            if owner is not None and self.compaction is not owner:
                return False
        os.fsync(c.fd)
        return True

    def _discard(self, c: Compaction) -> None:
        """Close and remove ``c``'s temp file (never raises)."""
        if c.fd >= 0:
            try:
                os.close(c.fd)
            except OSError:
                pass
            c.fd = -1
        try:
            os.unlink(c.tmp, dir_fd=self._dfd)
        except OSError:
            pass

    def _installed(self, c: Compaction) -> None:
        """``c``'s file was renamed over the journal: fsync the directory (the rename is durable), open
        the new journal for appending."""
        # the new journal is in place: the old fd (if any) now points at the replaced inode
        self.close()
        try:
            os.fsync(self._dfd)
        except OSError:
            pass  # the rename is done; a lost directory fsync only risks the old journal after a crash
        self.records = c.records
        self.size = c.size
        self.broken = False
        self.fd = os.open(self.name, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dfd)

    # ---- compaction off the pool's lock ----------------------------------------------------------
    def begin_compaction(self, entries: JournalEntries) -> Compaction:
        """(Pool lock held) Start a compaction from ``entries``, a snapshot of the index taken now (every
        record journaled so far is reflected in it): from here every append is also remembered, to be
        copied to the new file after the snapshot. Cheap; the file is written by :meth:`write_snapshot`."""
        self.cancel_compaction()
        c = self.compaction = Compaction(self._tmp_name(), entries)
        return c

    def write_snapshot(self, c: Compaction) -> bool:
        """(Pool lock NOT held) Write and fsync ``c``'s snapshot to its temp file; False: cancelled
        meanwhile (the caller then calls :meth:`abort_compaction`). Raises OSError."""
        return self._write_entries(c, c)

    def take_pending(self, c: Compaction) -> list[tuple[bytes, int]]:
        """(Pool lock held) The appends remembered for ``c`` not yet copied to its temp file."""
        if self.compaction is not c:
            return []
        out = self._pending[c.taken:]
        c.taken = len(self._pending)
        return out

    def write_caught_up(self, c: Compaction, pending: list[tuple[bytes, int]]) -> None:
        """Append ``pending`` (from :meth:`take_pending`) to ``c``'s temp file and fdatasync it (no-op when
        empty). Called off the lock for the bulk and under it for the rest. Raises OSError."""
        if pending:
            c.size += _write_all(c.fd, b"".join(d for d, _ in pending))
            c.records += sum(n for _, n in pending)
            os.fdatasync(c.fd)

    def finish_compaction(self, c: Compaction) -> None:
        """(Pool lock held) Copy the appends made since the last :meth:`take_pending`, rename ``c``'s file
        over the journal, fsync the directory and append to the new file from now on. The old journal
        stays valid (it got every append too) until the rename. Raises OSError (the caller discards)."""
        assert self.compaction is c
        self.write_caught_up(c, self.take_pending(c))
        os.close(c.fd)
        c.fd = -1
        os.replace(c.tmp, self.name, src_dir_fd=self._dfd, dst_dir_fd=self._dfd)
        self._installed(c)  # a failure here leaves fd None: the next append rewrites the journal (repair)
        self.cancel_compaction()

    def abort_compaction(self, c: Compaction) -> None:
        """Remove ``c``'s temp file and stop remembering appends for it (no-op for another compaction's
        state); the old journal, which got every append, stays."""
        self._discard(c)
        if self.compaction is c:
            self.cancel_compaction()

    def cancel_compaction(self) -> None:
        """Forget the compaction in progress (its thread sees it and removes its temp file)."""
        self.compaction = None
        self._pending = []

    def append(self, records: list[bytes]) -> None:
        """Append encoded records in one write (the kernel keeps them across a kill -9 of this process).

        Raises:
            OSError: the write failed (ENOSPC, EIO...); the journal was cut back to its last whole record
                (or marked :attr:`broken` when that failed too), or it is not open / broken (EBADF).
        """
        if not records:
            return
        if self.fd is None or self.broken:
            raise OSError(errno.EBADF, f"G3 journal {self.path} needs a rewrite before appending")
        data = b"".join(records)
        mv = memoryview(data)
        try:
            while mv:
                n = os.write(self.fd, mv)
                mv = mv[n:]
        except OSError:
            try:  # a partial record would hide every later record from replay: cut it off
                os.ftruncate(self.fd, self.size)
            except OSError:
                self.broken = True
            raise
        self.size += len(data)
        self.records += len(records)
        if self.compaction is not None:
            self._pending.append((data, len(records)))

    def sync(self) -> None:
        if self.fd is not None:
            os.fdatasync(self.fd)

    def sync_handle(self) -> int | None:
        """(Pool lock held) A duplicate of the open journal's fd (None when none is open), for the writer's
        once-per-round ``fdatasync`` off the lock: a compaction or repair that replaces (and closes) the journal
        meanwhile cannot turn it into another file's fd; syncing the replaced file is harmless (the new one was
        fsynced with every record). The caller closes it. Raises OSError (EMFILE)."""
        return None if self.fd is None else os.dup(self.fd)

    def shut_down(self) -> None:
        """Close for good, with the pool (its directory fd numbers may soon be another pool's): later rewrites fail, EBADF
        (before 2026-12-02 a closed pool's ``delete`` rewrote its journal over a newer pool's, its blocks lost)."""
        self.close()
        self.close_dir()
        self._dfd = -1

    def close(self) -> None:
        if self.fd is not None:
            with suppress(OSError):
                os.fdatasync(self.fd)
            os.close(self.fd)
            self.fd = None

    def forget(self) -> None:
        """In a child forked from the process that opened the journal (:mod:`.forked`): close the child's copies
        of its fds (the journal, a compaction's temp file, a directory fd of its own); no sync, nothing written."""
        c, self.compaction = self.compaction, None
        for fd in (self.fd, -1 if c is None else c.fd, self._dfd if self._own_dfd else -1):
            if fd is not None and fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.fd, self._dfd = None, -1 if self._own_dfd else self._dfd

    def close_dir(self) -> None:
        """Close the directory fd if this journal opened it."""
        if self._own_dfd and self._dfd >= 0:
            os.close(self._dfd)
            self._dfd = -1


def _write_all(fd: int, data: bytes) -> int:
    mv = memoryview(data)
    while mv:
        n = os.write(fd, mv)
        mv = mv[n:]
    return len(data)
