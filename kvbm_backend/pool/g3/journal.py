"""Append-only G3 journal: which slot holds which key, for warm restart (docs/invariants.md #6).

File ``journal-<fingerprint>.log`` in the pool's first directory (mode 0600, opened with
``O_NOFOLLOW`` relative to the pool's verified directory fd). Format version 2: a 16-byte file header
(``KVBMJRN2`` + 8 bytes of the namespace fingerprint), then fixed-size records, each::

    <B type> <H file index> <I slot index> <Q sequence hash> <I rank> <16s tenant tag>
    <Q xxh3_64 of everything before it in the record>

The tenant is stored only as its tag (``model.namespace.tenant_tag``: xxh3_128 of the tenant UTF-8,
the value every frame header carries), never as the tenant string: the journal names no tenant in
clear. The restored index keys entries of unknown tenants by tag (:class:`.index.TagKey`) until a
lookup with the real key adopts them. The tag is a plain hash: a guessable (low-entropy) tenant id can
still be confirmed by hashing candidates, exactly as from the slot headers.

``type`` is 1 (PUT: the slot holds the key; appended only after the slot's bytes were fdatasync'ed,
invariant 2) or 2 (DEL: the key was deleted). Replay applies records in order (last one wins per key
and per slot) and stops at the first record that does not check (a torn tail after a crash).
The journal is a hint: every entry it yields is verified against the slot's header before use, and
every payload is verified again on every read.

Version 1 journals (``KVBMJRN1``: records with ``<H tenant length> <tenant UTF-8>`` in place of the
tag) are still read; the pool rewrites them as version 2 at open.

Compaction rewrites the live entries to a uniquely named temp file (``O_EXCL``, 0600), fsyncs it and
renames it over the journal (never a fixed ``.tmp`` name); until the rename the old journal stays open
for appends, so a failed rewrite (ENOSPC) leaves a working journal. A failed append is cut back to
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
from typing import Any, Iterable, TypeVar

import xxhash

from ...model.namespace import BlockKey
from .index import TagKey, tag_of

FILE_MAGIC = b"KVBMJRN2"
FILE_MAGIC_V1 = b"KVBMJRN1"
PUT, DEL = 1, 2
_REC = struct.Struct("<BHIQI16s")  # version 2
_REC_V1 = struct.Struct("<BHIQIH")  # version 1, followed by the tenant UTF-8
_SUM = struct.Struct("<Q")
RECORD_BYTES = _REC.size + _SUM.size

Slot = tuple[int, int]  # (file index, slot index in that file)
K = TypeVar("K", BlockKey, TagKey)


class JournalPathError(RuntimeError):
    """The journal path is not a regular file of ours (a directory, a symbolic link, a device...)."""


def encode(kind: int, key: "BlockKey | TagKey", slot: Slot = (0, 0)) -> bytes:
    """One version-2 record; ``key`` is a BlockKey (its tenant is hashed to the tag) or a TagKey."""
    tag = key.tag if type(key) is TagKey else tag_of(key.tenant)
    body = _REC.pack(kind, slot[0], slot[1], key.seq_hash, key.rank, tag)
    return body + _SUM.pack(xxhash.xxh3_64_intdigest(body))


def decode_all(data: bytes, namespace: str) -> tuple["OrderedDict[TagKey, Slot]", int, int]:
    """Replay version-2 ``data`` (the records after the file header).

    Returns ``(entries, records, good_bytes)``: key (a :class:`TagKey`) -> slot in LRU order (oldest
    first), the number of good records, and the byte length of the good prefix (a torn tail starts there).
    """
    entries: OrderedDict[TagKey, Slot] = OrderedDict()
    by_slot: dict[Slot, TagKey] = {}
    pos = 0
    n = 0
    mv = memoryview(data)
    while pos + RECORD_BYTES <= len(data):
        kind, fi, si, seq, rank, tag = _REC.unpack_from(mv, pos)
        end = pos + _REC.size
        if kind not in (PUT, DEL) or _SUM.unpack_from(mv, end)[0] != xxhash.xxh3_64_intdigest(mv[pos:end]):
            break
        _apply(entries, by_slot, kind, TagKey(namespace, tag, rank, seq), (fi, si))
        pos = end + _SUM.size
        n += 1
    return entries, n, pos


def decode_all_v1(data: bytes, namespace: str) -> tuple["OrderedDict[BlockKey, Slot]", int, int]:
    """Replay version-1 records (tenant strings in clear); same result shape as :func:`decode_all`."""
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


class Journal:
    """The open journal of one pool (not thread-safe: the pool serialises calls).

    Args:
        dir_fd: an open fd of ``directory`` (verified by :class:`.slabs.SlabSet`); the journal and its
            temp files are opened relative to it with ``O_NOFOLLOW`` (a planted symlink is refused).
            Default: the directory is opened here.
    """

    def __init__(self, directory: str, fingerprint: str, dir_fd: int | None = None):
        self.name = f"journal-{fingerprint}.log"
        self.path = os.path.join(directory, self.name)
        self.directory = directory
        self._fp = fingerprint
        self._header = FILE_MAGIC + bytes.fromhex(fingerprint)
        self._header_v1 = FILE_MAGIC_V1 + bytes.fromhex(fingerprint)
        self.records = 0
        self.fd: int | None = None
        self.size = 0  # bytes of whole records (plus header) in the open journal
        self.broken = False  # an append could not be cut back: rewrite before appending again
        self._own_dfd = dir_fd is None
        self._dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC) if dir_fd is None else dir_fd

    def _refuse(self, what: str) -> JournalPathError:
        return JournalPathError(
            f"G3 journal {self.path} is {what}, not a regular file: G3 does not follow or replace it. "
            f"Remove or rename it (the pool rebuilds the journal), then open the pool again.")

    def load(self) -> tuple["OrderedDict[TagKey, Slot] | OrderedDict[BlockKey, Slot]", dict[str, Any]]:
        """Read and replay the journal if present. Returns (entries, info) where info has ``records``,
        ``torn_bytes``, ``bad_header`` (a journal of another namespace/format is ignored) and
        ``version``. Keys are TagKeys (version 2) or BlockKeys (version 1).

        Raises:
            JournalPathError: the journal path is a directory, a symbolic link or another non-file.
        """
        info: dict[str, Any] = {"records": 0, "torn_bytes": 0, "bad_header": False, "version": 0}
        try:
            fd = os.open(self.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=self._dfd)
        except FileNotFoundError:
            return OrderedDict(), info
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise self._refuse("a symbolic link") from None
            if e.errno == errno.EISDIR:
                raise self._refuse("a directory") from None
            raise
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise self._refuse("a directory")
            if not stat.S_ISREG(st.st_mode):
                raise self._refuse("a special file")
            chunks = []
            while True:
                b = os.read(fd, 1 << 24)
                if not b:
                    break
                chunks.append(b)
            data = b"".join(chunks)
        finally:
            os.close(fd)
        entries: OrderedDict[TagKey, Slot] | OrderedDict[BlockKey, Slot]
        if data[:16] == self._header:
            entries, n, good = decode_all(data[16:], self._fp)
            info["version"] = 2
        elif data[:16] == self._header_v1:
            entries, n, good = decode_all_v1(data[16:], self._fp)
            info["version"] = 1
        else:
            info["bad_header"] = True
            return OrderedDict(), info
        info["records"] = n
        info["torn_bytes"] = len(data) - 16 - good
        return entries, info

    def rewrite(self, entries: Iterable[tuple["BlockKey | TagKey", Slot]]) -> None:
        """Atomically replace the journal with PUT records of ``entries`` (oldest first) and open it
        for appending. On failure (ENOSPC...) the temp file is removed and the old journal, if open,
        stays open for appends (``broken`` unchanged); the error is raised."""
        tmp = f".journal-{self._fp}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=self._dfd)
        n = 0
        size = 0
        try:
            try:
                buf = [self._header]
                for key, slot in entries:
                    buf.append(encode(PUT, key, slot))
                    n += 1
                    if len(buf) >= 4096:
                        size += _write_all(fd, b"".join(buf))
                        buf = []
                size += _write_all(fd, b"".join(buf))
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.name, src_dir_fd=self._dfd, dst_dir_fd=self._dfd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=self._dfd)
            except OSError:
                pass
            raise
        # the new journal is in place: the old fd (if any) now points at the replaced inode
        self.close()
        try:
            os.fsync(self._dfd)
        except OSError:
            pass  # the rename is done; a lost directory fsync only risks the old journal after a crash
        self.records = n
        self.size = size
        self.broken = False
        self.fd = os.open(self.name, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dfd)

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

    def sync(self) -> None:
        if self.fd is not None:
            os.fdatasync(self.fd)

    def close(self) -> None:
        if self.fd is not None:
            try:
                os.fdatasync(self.fd)
            except OSError:
                pass
            os.close(self.fd)
            self.fd = None

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
