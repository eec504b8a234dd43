"""Append-only G3 journal: which slot holds which key, for warm restart (DESIGN.md invariant 6).

File ``journal-<fingerprint>.log`` in the pool's first directory. It starts with a 16-byte file header
(``KVBMJRN1`` + 8 bytes of the namespace fingerprint), then records, each::

    <B type> <H file index> <I slot index> <Q sequence hash> <I rank> <H tenant length>
    <tenant UTF-8 bytes> <Q xxh3_64 of everything before it in the record>

``type`` is 1 (PUT: the slot holds the key; appended only after the slot's bytes were fdatasync'ed,
invariant 2) or 2 (DEL: the key was deleted). Replay applies records in order (last one wins per key
and per slot) and stops at the first record that does not check (a torn tail after a crash).
The journal is a hint: every entry it yields is verified against the slot's header before use, and
every payload is verified again on every read.

Compaction rewrites the live entries to a uniquely named temp file, fsyncs it and renames it over
the journal (never a fixed ``.tmp`` name).
"""
from __future__ import annotations

import os
import struct
import uuid
from collections import OrderedDict
from typing import Iterable

import xxhash

from ...model.namespace import BlockKey

FILE_MAGIC = b"KVBMJRN1"
PUT, DEL = 1, 2
_REC = struct.Struct("<BHIQIH")
_SUM = struct.Struct("<Q")

Slot = tuple[int, int]  # (file index, slot index in that file)


def encode(kind: int, key: BlockKey, slot: Slot = (0, 0)) -> bytes:
    t = key.tenant.encode()
    if len(t) > 0xFFFF:
        raise ValueError(f"tenant id of {len(t)} bytes: at most 65535")
    body = _REC.pack(kind, slot[0], slot[1], key.seq_hash, key.rank, len(t)) + t
    return body + _SUM.pack(xxhash.xxh3_64_intdigest(body))


def decode_all(data: bytes, namespace: str) -> tuple["OrderedDict[BlockKey, Slot]", int, int]:
    """Replay ``data`` (the records after the file header).

    Returns ``(entries, records, good_bytes)``: key -> slot in LRU order (oldest first), the number of
    good records, and the byte length of the good prefix (a torn tail starts there).
    """
    entries: OrderedDict[BlockKey, Slot] = OrderedDict()
    by_slot: dict[Slot, BlockKey] = {}
    pos = 0
    n = 0
    mv = memoryview(data)
    while pos + _REC.size + _SUM.size <= len(data):
        kind, fi, si, seq, rank, tlen = _REC.unpack_from(mv, pos)
        end = pos + _REC.size + tlen
        if kind not in (PUT, DEL) or end + _SUM.size > len(data):
            break
        if _SUM.unpack_from(mv, end)[0] != xxhash.xxh3_64_intdigest(mv[pos:end]):
            break
        try:
            tenant = bytes(mv[pos + _REC.size:end]).decode()
        except UnicodeDecodeError:
            break
        key = BlockKey(namespace, tenant, rank, seq)
        old = entries.pop(key, None)
        if old is not None:
            by_slot.pop(old, None)
        if kind == PUT:
            slot = (fi, si)
            prev = by_slot.get(slot)
            if prev is not None:
                entries.pop(prev, None)
            entries[key] = slot
            by_slot[slot] = key
        pos = end + _SUM.size
        n += 1
    return entries, n, pos


class Journal:
    """The open journal of one pool (not thread-safe: the pool serialises calls)."""

    def __init__(self, directory: str, fingerprint: str):
        self.path = os.path.join(directory, f"journal-{fingerprint}.log")
        self.directory = directory
        self._fp = fingerprint
        self._header = FILE_MAGIC + bytes.fromhex(fingerprint)
        self.records = 0
        self.fd: int | None = None

    def load(self) -> tuple["OrderedDict[BlockKey, Slot]", dict]:
        """Read and replay the journal if present. Returns (entries, info) where info has
        ``records``, ``torn_bytes`` and ``bad_header`` (a journal of another namespace/format is ignored)."""
        info = {"records": 0, "torn_bytes": 0, "bad_header": False}
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return OrderedDict(), info
        if data[:16] != self._header:
            info["bad_header"] = True
            return OrderedDict(), info
        entries, n, good = decode_all(data[16:], self._fp)
        info["records"] = n
        info["torn_bytes"] = len(data) - 16 - good
        return entries, info

    def rewrite(self, entries: Iterable[tuple[BlockKey, Slot]]) -> None:
        """Atomically replace the journal with PUT records of ``entries`` (oldest first) and open it
        for appending."""
        self.close()
        tmp = os.path.join(self.directory, f".journal-{self._fp}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
        n = 0
        with open(tmp, "wb") as f:
            buf = [self._header]
            for key, slot in entries:
                buf.append(encode(PUT, key, slot))
                n += 1
                if len(buf) >= 4096:
                    f.write(b"".join(buf))
                    buf = []
            f.write(b"".join(buf))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        dfd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        self.records = n
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)

    def append(self, records: list[bytes]) -> None:
        """Append encoded records in one write (the kernel keeps them across a kill -9 of this process)."""
        if not records or self.fd is None:
            return
        data = b"".join(records)
        mv = memoryview(data)
        while mv:
            n = os.write(self.fd, mv)
            mv = mv[n:]
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
