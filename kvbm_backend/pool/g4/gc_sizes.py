"""Which sizes an object at a G4 block name can have (:func:`.gc.run_gc`): one whose size cannot be a block of its
namespace is no block. It never counts toward a capacity target, so no good block is deleted because of it.

A G4 block object is one frame, unpadded: ``HEADER_BYTES`` (4096) + the namespace layout's ``bytes_per_block``
(docs/format.md "Frame"; encrypted frames store the ciphertext without its tag, the tag is in the header), and
every reader refuses any other length (``exact``). The block name's first component is the namespace fingerprint,
and ``{ns}/namespace.json`` (written by the namespace's first worker) holds the namespace: when it parses and its
fingerprint is the name's, that one size is the only one a block there can have (:meth:`BlockSizes.judge`: an
object of another size is junk, never served: gc deletes it). Without such a file (missing, not JSON, not a
namespace, another namespace's) gc knows no layout: only a negative size, or one over :data:`MAX_FRAME_BYTES` (the
frame of the largest payload ``g4 migrate`` reads, 1 GiB: no published layout's KV block is near it), is
impossible, and such an object is kept (a layout gc does not know might be that large) and left out of the
capacity total. A read of the file that *failed* (the get raised: the store unavailable, still throttled after the
retries, EIO, a directory or link at that name) says nothing about the layout: such an object is ``unchecked``,
left alone as when its own HEAD / ``stat`` fails, and gc counts an error (before 2026-12-03 it was ``kept``, the
warning blaming a missing file, errors 0: junk a readable file would have had deleted stayed, silently).

A listed size is checked against the object itself before anything is decided (S3: a HEAD, file stores:
``stat``): an S3 listing that states a wrong ``Size`` for a good block leaves that block a block, at its true
size. Before 2026-12-03 the listed size was taken as it came: a block-named file ``truncate``'d to 1 TiB (sparse:
4 KiB on disk), or an S3 listing stating one block at 1 TiB or at a negative size, made a capacity pass delete
every good block of the store (a negative one made the total grow as blocks were deleted).

Every pass looks: an object the age or revoked pass deletes whatever its size is still judged (``deleting``: a
failed read of ``namespace.json`` does not matter to it), so that a block whose listing misstated its size counts
at its true size, and anything else counts ``invalid_size`` at the bytes :meth:`BlockSizes.freed` gives. Before
2026-12-03 those passes counted it at its listed size: an S3 listing stating 1 TiB, or a 1 TiB sparse file, made
the report say 1 TiB was freed. Such an object whose look failed is deleted for the pass's reason at 0 bytes: no
``invalid_size`` (its size was never checked), and its failure is not :attr:`BlockSizes.stat_error` (gc's warning
of objects left alone names that one); one the look finds gone counts ``changed_since_listed``, as the delete would
have. Before (2026-12-03, the first version) the first counted ``invalid_size`` and could be the object that
warning named, and the second was counted nowhere.

The look judges the object listed, never another: where the name holds another object by then (its version, S3
ETag or file inode/mtime/size, is not the listed one: the listed copy was dropped by a worker's load and the block
offloaded again) the listed object is ``gone`` (``changed_since_listed`` for a pass that deletes it), and the object
there now is left to the next pass, which lists it and judges it by its own mtime and size. In the first version
of 2026-12-03 the pass went on with the new object: an age pass, which had found the listed copy old by its listed
mtime, deleted the block written seconds before (conditioned on the new object's version) as ``age``.
"""
from __future__ import annotations

import json
from typing import Literal

from ...model.frame import HEADER_BYTES
from ...model.namespace import Namespace
from .naming import NAMESPACE_JSON_MAX, namespace_name
from .store import ObjectInfo, ObjectStore
from .throttle import call_attempts

MAX_FRAME_BYTES = HEADER_BYTES + (1 << 30)  # larger objects are no block of a layout gc does not know (module doc)
Verdict = Literal["block", "junk", "kept", "gone", "unchecked"]


def same_version(listed: str | None, now: str | None) -> bool:
    """Whether the object a look (:meth:`~.store.ObjectStore.stat`) found is the one listed, by their
    :attr:`~.store.ObjectInfo.version` (S3: the ETag, quotes and case aside; file stores: inode, mtime and size).
    True where either gives none (it cannot be told: what a :meth:`~.store.ObjectStore.delete_if_listed` by name
    assumes too)."""
    if listed is None or now is None:
        return True
    return listed.strip().strip('"').lower() == now.strip().strip('"').lower()


class BlockSizes:
    """The block sizes of each namespace of ``store`` (its ``namespace.json``, read once per pass and namespace,
    throttled answers tried ``attempts`` times; a read that fails is remembered as failed, not as no file)."""

    def __init__(self, store: ObjectStore, attempts: int):
        self._store, self._attempts = store, attempts
        self._exact: dict[str, int | None] = {}  # namespace fingerprint -> its frame size (None: not known)
        self._failed: set[str] = set()  # namespaces whose namespace.json read failed (not: is missing)
        self.stat_error: str | None = None  # the first failed look at an object (:meth:`judge`: "unchecked")
        self.read_error: str | None = None  # the first failed read of a namespace.json
        self.unread = 0  # objects judged "unchecked" because their namespace.json read failed (not their stat)

    def exact(self, ns: str) -> int | None:
        """The one size (bytes) a block of namespace ``ns`` (16 hex) has, or None when the store does not say (no
        usable ``namespace.json``, or its read failed: then also counted by :meth:`judge` as ``unchecked``)."""
        if ns not in self._exact:
            self._exact[ns] = self._read(ns)
        return self._exact[ns]

    def _read(self, ns: str) -> int | None:
        name = namespace_name(ns)
        try:
            body = call_attempts(lambda: self._store.get(name, 0, NAMESPACE_JSON_MAX + 1), self._attempts)
        except Exception as e:  # noqa: BLE001 - the get failed (unavailable, throttled, EIO, no regular file)
            self._failed.add(ns)
            self.read_error = self.read_error or f"{name}: {e}"
            return None
        if body is None or len(body) > NAMESPACE_JSON_MAX:
            return None  # missing (or too large for one): no layout known
        try:
            doc = json.loads(bytes(body))
            doc.pop("g4", None)  # the store's fan-out: not in the fingerprint
            namespace = Namespace.from_dict(doc)
        except Exception:  # noqa: BLE001 - not JSON, not a namespace: no layout known
            return None
        return HEADER_BYTES + namespace.layout.bytes_per_block if namespace.fingerprint == ns else None

    @staticmethod
    def freed(verdict: Verdict, judged: ObjectInfo) -> int:
        """The bytes a deleted object gc judged (:meth:`judge`) no block counts in ``deleted_bytes``: its size by the
        look at it (``judged``) when a block of some layout could have it (0 to :data:`MAX_FRAME_BYTES`), else 0 (a
        negative size is none, a 1 TiB sparse file takes 4 KiB), and 0 for an ``unchecked`` one (its true size is
        not known). Before 2026-12-03 a 1 TiB object the age or revoked pass deleted counted 1 TiB freed."""
        return judged.size if verdict != "unchecked" and 0 <= judged.size <= MAX_FRAME_BYTES else 0

    def possible(self, ns: str, size: int) -> bool:
        """Whether an object of ``size`` bytes at a block name of namespace ``ns`` can be a block (module doc)."""
        exact = self.exact(ns)
        return size == exact if exact is not None else 0 <= size <= MAX_FRAME_BYTES

    def judge(self, o: ObjectInfo, ns: str, deleting: bool = False) -> tuple[Verdict, ObjectInfo]:
        """What listed object ``o`` (at a block name of namespace ``ns``) is: ``("block", o)`` when its listed size
        is possible; else, after a look at the object itself (:meth:`~.store.ObjectStore.stat`, throttled answers
        tried again): ``("block", what stat says)`` when the listing misstated a possible size, ``("junk", o)`` (its
        size is impossible in a namespace whose size is known: delete it), ``("kept", o)`` (impossible, layout not
        known: keep it, it is no block) or ``("gone", o)`` (deleted since listed, or the name holds another object
        since: its version is not the listed one, :func:`same_version`; module doc). A stat that raises (the store
        unavailable, still throttled after ``attempts`` tries; its message kept in :attr:`stat_error`, the first
        one, unless ``deleting``): ``("unchecked", o)``: its listed size is impossible and its true one unknown; gc
        leaves it alone and counts an error (before 2026-12-03 ``kept``: reported as a missing ``namespace.json``, no
        error), or, ``deleting``, deletes it for the pass's reason at 0 bytes, not as ``invalid_size``. An object
        of a size impossible for any layout in a namespace whose ``namespace.json`` read failed (its message in
        :attr:`read_error`, counted in :attr:`unread`): ``("unchecked", what stat says)`` too, as it might be junk
        a readable file would have said to delete (before 2026-12-03 ``kept``, as if the file were missing), unless
        ``deleting`` (the pass deletes the object whatever its size: age, revoked): then ``("kept", what stat says)``,
        not counted in :attr:`unread`."""
        if self.possible(ns, o.size):
            return "block", o
        try:
            now = call_attempts(lambda: self._store.stat(o.name), self._attempts)
        except OSError as e:
            if not deleting:  # named by gc's warning of objects left alone: one the pass deletes anyway is none
                self.stat_error = self.stat_error or f"{o.name}: {e}"
            return "unchecked", o
        if now is None or not same_version(o.version, now.version):  # gone, or the name changed hands since
            return "gone", o
        # a store whose stat states no mtime (0.0) or version keeps the listed ones (never an ancient mtime)
        now = ObjectInfo(o.name, now.size, now.mtime or o.mtime, now.version if now.version is not None else o.version)
        if self.possible(ns, now.size):
            return "block", now
        if self.exact(ns) is not None:
            return "junk", now
        if ns in self._failed and not deleting:  # the layout is unknown because the read failed, not for lack of one
            self.unread += 1
            return "unchecked", now
        return "kept", now
