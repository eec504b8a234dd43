"""Dropping a G4 object a load found bad (:mod:`.reader`): only once the store confirms it holds the very bytes
read, and only while its name still holds them.

* :func:`stored_is_bad` -- the proof: :meth:`~.store.ObjectStore.stored_matches` (an S3 HEAD's length and MD5
  ETag, a file store's re-read past the page cache). Without it a miss keeps the object (a lying endpoint or
  proxy, a bad read never gets a good object deleted).
* :func:`drop_if_same` -- the delete: :meth:`~.store.ObjectStore.delete_if_matches` (a file store renames the
  object to a quarantine name and compares again, :mod:`.fs_quarantine`; S3 sends ``If-Match``), so a good copy
  another worker published under the name after the proof (a third worker deleted the bad one, then a
  create-exclusive write succeeded) stays. Before 2026-12-01 the delete went by name (review finding 4).
* :func:`drop_longer` -- both for an object the read got only the first bytes of (an S3 GET asks for one frame
  and a byte more, however large the object): the proof is the store's own size (:meth:`~.store.ObjectStore.stat`,
  an S3 HEAD) over the limit, since no frame is longer, and an MD5 ETag that is not the MD5 of the frame's worth of
  bytes read (an object of exactly those bytes is one frame long, whatever a gateway said of its length), and the
  delete is of that very object (:meth:`~.store.ObjectStore.delete_if_listed`: S3 ``If-Match`` its ETag). Before
  2026-12-01 such an object was downloaded whole (a planted 160 MiB object cost each load 160 MiB, times
  ``g4.max_inflight``) and MD5'd; from then to 2026-12-02 the size alone was the proof: a gateway adding a byte to
  GET bodies and to HEAD lengths, the ETag untouched, got every good object a worker behind it loaded deleted
  (reviewer 2026-12-02: the real store's object gone, honest workers' loads missed it after).
* :func:`drop_bad` -- the reader's one call: whichever of the two applies.
"""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .store import Blob, ObjectStore


def stored_is_bad(store: ObjectStore, name: str, data: Blob, size: int) -> bool:
    """True only when ``store`` confirms the object under ``name`` is exactly what was read (``data``, the first
    bytes of an object of ``size`` bytes): then dropping it drops the bad copy, not a good one a transport
    garbled (:meth:`~kvbm_backend.pool.g4.store.ObjectStore.stored_matches`). False on any error."""
    try:
        return bool(store.stored_matches(name, data, size))
    except Exception:  # noqa: BLE001 - unconfirmed: keep the object
        return False


def drop_if_same(store: ObjectStore, name: str, data: Blob, size: int) -> bool:
    """Delete ``name`` only while it still holds the bytes :func:`stored_is_bad` proved bad (``data``, of an
    object of ``size`` bytes). True when deleted; False when the name holds other bytes or none (kept), or the
    store failed (OSError: the object stays, a later load tries again)."""
    try:
        return bool(store.delete_if_matches(name, data, size))
    except OSError:
        return False


def drop_longer(store: ObjectStore, name: str, limit: int, data: Blob | None = None) -> bool | None:
    """An object ``name`` a read cut at ``limit + 1`` bytes (so longer than ``limit``, the length of a valid frame):
    None when the store does not confirm it holds an object longer than ``limit`` (absent, a valid length, or an MD5
    ETag equal to the MD5 of the first ``limit`` bytes read, ``data``: an object of exactly those bytes; the read was
    not what it holds; any error: kept); True when this call deleted the object the store described; False when
    the name holds another object by now, or the delete failed (kept, a later load tries again)."""
    try:
        info = store.stat(name)
    except Exception:  # noqa: BLE001 - unconfirmed: keep the object
        return None
    if info is None or info.size <= limit or _one_frame(info.version, data, limit):
        return None
    try:
        return bool(store.delete_if_listed(info))
    except OSError:
        return False


def _one_frame(version: str | None, data: Blob | None, limit: int) -> bool:
    """Whether ``version`` (an S3 ETag, quoted) is the MD5 of the first ``limit`` bytes of ``data``: the stored object
    is then exactly those bytes (a single-part upload's ETag is its body's MD5; our writers upload single-part), so
    it is not longer than a frame, whatever length a HEAD reported. False without an MD5 ETag or the bytes."""
    etag = (version or "").strip('"').lower()
    if data is None or len(etag) != 32 or any(c not in "0123456789abcdef" for c in etag):
        return False
    mv = memoryview(data).cast("B")
    return len(mv) >= limit and hashlib.md5(mv[:limit], usedforsecurity=False).hexdigest() == etag


def drop_bad(store: ObjectStore, name: str, data: Blob, size: int, limit: int | None = None) -> bool | None:
    """Drop the object ``name`` whose bytes read (``data``, of an object of ``size`` bytes) failed verification:
    None when the store does not confirm it holds them (:func:`stored_is_bad`: kept), else whether this call
    deleted them (:func:`drop_if_same`). ``limit``: the read was cut at ``limit + 1`` bytes (``size`` is not the
    object's): :func:`drop_longer` instead."""
    if limit is not None:
        return drop_longer(store, name, limit, data)
    if not stored_is_bad(store, name, data, size):
        return None
    return drop_if_same(store, name, data, size)
